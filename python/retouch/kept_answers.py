"""Kept answers of asynchronous and keyed edits (`retouch.edit_jobs`) on disk, so that a restarted server
still answers them: the 202's id of an edit made before a rolling restart, and a keyed retry that comes
after it. `retouch serve --cache-disk-dir DIR` keeps them in DIR/edits, beside the templates
(`retouch.engine.registry`).

    <name>.json     {"format", "id", "tenant", "key", "fingerprint", "async", "template_id", "created",
                     "finished" (wall clock; null while it runs), "status", "http_status", "headers",
                     "body", "media_type", "images": [their sizes]}; written last
    <name>.<i>.bin  the answer's images, as they were answered

<name> is a digest of the tenant and the id: both are the clients' strings, never part of a path.
An edit is written when it is admitted, so that one a killed server never finished is known after it
(it answers 503 interrupted, and its key runs again), then again when it ends; its files go when the store
forgets it (expired, evicted, deleted). Writes run on one thread, in the order they were asked for, off
the event loop; one that fails (a full disk) is logged and counted, and the answer stays in memory.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import time
from pathlib import Path

from retouch.edit_jobs import Job, Outcome, Reply
from retouch.paths import lock_folder, write_whole

FORMAT = 1
logger = logging.getLogger("retouch.edit_jobs")


class AnswerFolder:
    def __init__(self, directory: Path | str):
        self.directory = Path(directory)
        self._lock_file = lock_folder(self.directory)
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="retouch-answers")
        self.write_errors = 0

    def close(self) -> None:
        """Finish the writes asked for, then give the folder back; later writes are skipped."""
        self._writer.shutdown(wait=True)
        self._lock_file.close()

    def flush(self) -> None:
        """Return once every write asked for so far is done (tests; a stop)."""
        self._writer.submit(lambda: None).result()

    def save(self, job: Job) -> None:
        """Write `job` as it is now (running, or ended with its outcome)."""
        header = {"format": FORMAT, "id": job.id, "tenant": job.tenant, "key": job.key,
                  "fingerprint": job.fingerprint, "async": job.runs_async, "template_id": job.template_id,
                  "created": job.created, "finished": None, "status": job.status}
        images: tuple[bytes, ...] = ()
        if job.outcome is not None:
            reply = job.outcome.reply
            images = reply.images
            header |= {"finished": time.time(), "http_status": job.outcome.http_status, "headers": reply.headers,
                       "body": reply.body, "media_type": reply.media_type, "images": [len(image) for image in images]}
        self._submit(self._write, self._name(job), json.dumps(header).encode(), images)

    def remove(self, job: Job) -> None:
        images = 0 if job.outcome is None else len(job.outcome.reply.images)
        self._submit(self._unlink, self._name(job), images)

    def _submit(self, *write) -> None:
        try:
            self._writer.submit(*write)
        except RuntimeError:  # closed: the server is gone, and what it did since is not kept, as after a kill
            logger.debug("the folder of kept answers is closed; a write is skipped")

    def load(self) -> list[tuple[Job, float | None]]:
        """Every edit written whole, with the wall-clock time it ended (None: it was running when the server
        stopped); one that cannot be read is logged, skipped and removed."""
        loaded = []
        for path in sorted(self.directory.glob("*.json")):
            try:
                loaded.append(self._read(path))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.warning("kept answer %s cannot be read (%s); removed", path, exc)
                for stale in self.directory.glob(f"{path.stem}.*"):
                    stale.unlink(missing_ok=True)
        names = {self._name(job) for job, _ in loaded}
        for image in self.directory.glob("*.bin"):  # a write cut short before its header
            if image.name.split(".")[0] not in names:
                image.unlink(missing_ok=True)
        return loaded

    def _read(self, path: Path) -> tuple[Job, float | None]:
        header = json.loads(path.read_bytes())
        if header["format"] != FORMAT:
            raise ValueError(f"format {header['format']}")
        job = Job(str(header["id"]), str(header["tenant"]), template_id=str(header["template_id"]),
                  key=header["key"], fingerprint=header["fingerprint"], runs_async=bool(header["async"]),
                  created=float(header["created"]))
        if self._name(job) != path.stem:
            raise ValueError("its name is not its tenant's and id's")
        if header["finished"] is None:
            return job, None
        images = tuple(self._path(path.stem, f".{index}.bin").read_bytes() for index in range(len(header["images"])))
        if [len(image) for image in images] != header["images"]:
            raise ValueError("an image was cut short")
        reply = Reply({str(k): str(v) for k, v in header["headers"].items()}, header["body"], images,
                      header["media_type"])
        job.outcome = Outcome(str(header["status"]), int(header["http_status"]), reply)
        return job, float(header["finished"])

    def _write(self, name: str, header: bytes, images: tuple[bytes, ...]) -> None:
        try:
            for index, image in enumerate(images):
                write_whole(self._path(name, f".{index}.bin"), image)
            write_whole(self._path(name, ".json"), header)
        except OSError as exc:
            self.write_errors += 1
            logger.warning("cannot keep an answer on disk in %s (%s); it stays in memory", self.directory, exc)

    def _unlink(self, name: str, images: int) -> None:
        try:
            self._path(name, ".json").unlink(missing_ok=True)  # first: a half-removed one is not loaded
            for index in range(images):
                self._path(name, f".{index}.bin").unlink(missing_ok=True)
        except OSError as exc:
            self.write_errors += 1
            logger.warning("cannot remove a kept answer from %s (%s)", self.directory, exc)

    def _path(self, name: str, suffix: str) -> Path:
        return self.directory / (name + suffix)

    @staticmethod
    def _name(job: Job) -> str:
        return hashlib.sha256(f"{job.tenant}\0{job.id}".encode()).hexdigest()[:32]
