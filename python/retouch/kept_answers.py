"""Kept answers of asynchronous and keyed edits (`retouch.edit_jobs`) on disk, so that a restarted server
still answers them: the 202's id of an edit made before a rolling restart, and a keyed retry that comes
after it. `retouch serve --cache-disk-dir DIR` keeps them in DIR/edits, beside the templates
(`retouch.engine.registry`).

    <name>.json     {"format", "id", "tenant", "key", "fingerprint", "async", "template_id", "created",
                     "webhook", "webhook_state", "ended_at" (wall clock; null while it runs), "status",
                     "http_status", "headers", "body", "media_type", "images": [their sizes]}; written last
    <name>.<i>.bin  the answer's images, as they were answered

<name> is 32 hex digits of a digest of the tenant and the id: both are the clients' strings, never part of
a path. An edit is written when it is admitted, so that one a killed server never finished is known after
it (it answers 503 interrupted, and its key runs again), then again when it ends; its files go when the
store forgets it (expired, evicted, deleted). Writes run on one thread off the event loop; of the writes of
one edit still waiting there only the last is done (an edit evicted before its answer was written is
never written), so what waits is bounded by what the store holds. One that fails (a full disk) is logged
and counted, and the answer stays in memory.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import logging
import re
import threading
import time
from pathlib import Path

from retouch.edit_jobs import JOB_OVERHEAD_BYTES, STATUSES, Job, Outcome, Reply
from retouch.paths import lock_folder, write_whole

FORMAT = 1
MAX_TIME = 95_617_584_000.0  # 5000-01-01, in seconds: later is no time this server wrote
WEBHOOK_STATES = (None, "delivered", "gone", "failed", "refused")
RETRY_REMOVALS_S = 5.0  # how often failed removals are tried again (with the writes that come)
NAME = re.compile(r"[0-9a-f]{32}")
IMAGE_FILE = re.compile(r"([0-9a-f]{32})\.(\d+)\.bin")
logger = logging.getLogger("retouch.kept_answers")


class AnswerFolder:
    def __init__(self, directory: Path | str):
        self.directory = Path(directory)
        self._lock_file = lock_folder(self.directory)
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="retouch-answers")
        # name -> what waits for the writer: the images of files to remove first (None: none), then what to
        # write (the edit's id, its header, its images, whether it ended)
        self._latest: dict[str, tuple[int | None, tuple[str, bytes, tuple[bytes, ...], bool] | None]] = {}
        # the writer's own: edits whose end is on disk whole, and removals that failed (tried again now and then)
        self._ended_on_disk: set[str] = set()
        self._unremoved: dict[str, int] = {}
        self._removals_tried = 0.0
        self._latest_lock = threading.Lock()
        self.write_errors = 0

    def close(self, timeout_s: float | None = None) -> None:
        """Finish the writes asked for (within `timeout_s`: those left are lost, as after a kill), then give the
        folder back; later writes are skipped."""
        done = self._submit(self._remove_again)  # the last chance of failed removals
        try:
            if done is not None:
                done.result(timeout_s)
        except concurrent.futures.TimeoutError:
            # The folder stays locked (until this process exits) while a write may still run.
            logger.warning("kept answers: writes still waiting after %.1f s are dropped", timeout_s)
            self._writer.shutdown(wait=False, cancel_futures=True)
            return
        self._writer.shutdown(wait=False, cancel_futures=True)
        self._lock_file.close()

    def save(self, job: Job) -> None:
        """Write `job` as it is now (running, or ended with its outcome)."""
        header = {"format": FORMAT, "id": job.id, "tenant": job.tenant, "key": job.key,
                  "fingerprint": job.fingerprint, "async": job.runs_async, "template_id": job.template_id,
                  "created": job.created, "webhook": job.webhook, "webhook_state": job.webhook_state,
                  "ended_at": job.ended_at, "status": job.status}
        images: tuple[bytes, ...] = ()
        if job.outcome is not None:
            reply = job.outcome.reply
            images = reply.images
            header |= {"http_status": job.outcome.http_status, "headers": reply.headers, "body": reply.body,
                       "media_type": reply.media_type, "images": [len(image) for image in images]}
        try:
            encoded = json.dumps(header).encode()
        except (TypeError, ValueError) as exc:  # the store must go on whatever one answer holds
            self.write_errors += 1
            logger.warning("kept answer of edit %r cannot be written (%s)", job.id, exc)
            return
        self._queue(name_of(job), write=(job.id, encoded, images, job.outcome is not None))

    def remove(self, job: Job) -> None:
        self._queue(name_of(job), remove=0 if job.outcome is None else len(job.outcome.reply.images))

    def load(self, ttl_s: float, max_bytes: int) -> list[Job]:
        """The edits written whole that the store would still hold: ended less than `ttl_s` ago (wall clock;
        one without an outcome ran when the server stopped, and ends now), the most recently ended within
        `max_bytes` (the newest even alone over it), read in that order; the others are removed, and so is
        one that cannot be read (logged). Images are read only for the edits kept."""
        headers = {}
        skipped = set()  # a newer version's, or unreadable for now: left as they are, images and all
        for path in self.directory.glob("*.json"):
            if not NAME.fullmatch(path.stem) or not path.is_file():  # not ours (a FIFO would block the read)
                continue
            try:
                header = json.loads(path.read_bytes())
                if isinstance(header, dict) and isinstance(header.get("format"), int) and header["format"] > FORMAT:
                    # a rollback must not delete what the newer version keeps
                    logger.warning("kept answer %s is of format %r, not %d; skipped", path, header["format"], FORMAT)
                    skipped.add(path.stem)
                    continue
                headers[path.stem] = checked_header(header)
            except (ValueError, KeyError, TypeError, RecursionError) as exc:
                logger.warning("kept answer %s cannot be read (%s); removed", path, type(exc).__name__)
                self._unlink(path.stem, 0)
            except OSError as exc:  # perhaps readable later
                logger.warning("kept answer %s cannot be read (%s); skipped", path, exc)
                skipped.add(path.stem)
        self._remove_stray_images(headers, skipped)
        now = time.time()
        newest_first = sorted(headers.items(), key=lambda item: -(item[1]["ended_at"] or now))
        jobs, total = [], 0
        for name, header in newest_first:
            if now - (header["ended_at"] or now) <= ttl_s:
                total += JOB_OVERHEAD_BYTES + sum(header["images"])
                if not jobs or total <= max_bytes:
                    try:
                        jobs.append(self._job(name, header))
                        continue
                    except (OSError, ValueError) as exc:
                        logger.warning("kept answer %s cannot be read (%s); removed", name, exc)
            self._unlink(name, len(header["images"]))
        self._ended_on_disk.update(name_of(job) for job in jobs if job.outcome is not None)
        return jobs[::-1]

    def _job(self, name: str, header: dict) -> Job:
        job = Job(header["id"], header["tenant"], template_id=header["template_id"], key=header["key"],
                  fingerprint=header["fingerprint"], runs_async=header["async"], created=header["created"],
                  webhook=header["webhook"], webhook_state=header["webhook_state"])
        if name_of(job) != name:
            raise ValueError("its name is not its tenant's and id's")
        if header["ended_at"] is None:
            return job
        images = tuple(self._path(name, f".{index}.bin").read_bytes() for index in range(len(header["images"])))
        if [len(image) for image in images] != header["images"]:
            raise ValueError("an image was cut short")
        reply = Reply(header["headers"], header["body"], images, header["media_type"])
        job.outcome, job.ended_at = Outcome(header["status"], header["http_status"], reply), header["ended_at"]
        return job

    def _remove_stray_images(self, headers: dict[str, dict], skipped: set[str]) -> None:
        """Images without a header saying so: a kill between an answer's images and its header."""
        for path in self.directory.glob("*.bin"):
            match = IMAGE_FILE.fullmatch(path.name)
            if match is None or match[1] in skipped:
                continue
            header = headers.get(match[1])
            if header is None or header["ended_at"] is None or int(match[2]) >= len(header["images"]):
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)

    def _queue(self, name: str, remove: int | None = None,
               write: tuple[str, bytes, tuple[bytes, ...], bool] | None = None) -> None:
        """A removal replaces what waits to be written; a write, what waits to be written after any removal
        (a DELETE, then a new edit with the same id: the old files go first)."""
        with self._latest_lock:
            waiting = self._latest.get(name)
            if waiting is not None and waiting[0] is not None:  # a removal waiting is never undone
                remove = max(remove or 0, waiting[0])
            self._latest[name] = (remove, write)
        if waiting is None:
            self._submit(self._write_latest, name)

    def _submit(self, *write) -> concurrent.futures.Future | None:
        try:
            return self._writer.submit(*write)
        except RuntimeError:  # closed: the server is gone, and what it did since is not kept, as after a kill
            self.write_errors += 1
            logger.warning("kept answers: a write after the folder was closed is skipped")
            return None

    def _write_latest(self, name: str) -> None:
        with self._latest_lock:
            remove, write = self._latest.pop(name)
        if time.monotonic() - self._removals_tried > RETRY_REMOVALS_S:
            self._remove_again()
        if remove is not None:
            self._unlink(name, remove)
        if write is None:
            return
        job_id, header, images, ended = write
        try:
            for index, image in enumerate(images):
                write_whole(self._path(name, f".{index}.bin"), image)
            write_whole(self._path(name, ".json"), header)
        except OSError as exc:
            self.write_errors += 1
            logger.warning("the answer of edit %r cannot be kept on disk in %s (%s); it stays in memory until the "
                           "server stops", job_id, self.directory, exc)
            if name not in self._ended_on_disk:
                # Its admission's header (it says "running") would be answered as interrupted after a restart,
                # though the edit ended: it goes, and the edit is unknown there. A later write of an edit whose
                # end is on disk leaves that whole (files are replaced by renames).
                self._unlink(name, len(images))
            return
        self._unremoved.pop(name, None)  # this write replaced what a failed removal left
        if ended:
            self._ended_on_disk.add(name)

    def _unlink(self, name: str, images: int) -> None:
        self._ended_on_disk.discard(name)
        try:
            self._path(name, ".json").unlink(missing_ok=True)  # first: a half-removed one is not loaded
            for index in range(images):
                self._path(name, f".{index}.bin").unlink(missing_ok=True)
            self._unremoved.pop(name, None)
        except OSError as exc:
            if name in self._unremoved or not self._path(name, ".json").exists():  # counted once; nothing left
                return
            self.write_errors += 1
            logger.warning("cannot remove a kept answer from %s (%s); it is tried again", self.directory, exc)
            self._unremoved[name] = images  # a DELETEd answer must not come back

    def _remove_again(self) -> None:
        self._removals_tried = time.monotonic()
        for name, images in list(self._unremoved.items()):
            self._unlink(name, images)

    def _path(self, name: str, suffix: str) -> Path:
        return self.directory / (name + suffix)


def name_of(job: Job) -> str:
    return hashlib.sha256(f"{job.tenant}\0{job.id}".encode()).hexdigest()[:32]


def checked_header(header) -> dict:
    """A header as read, once every field has the type it is written with; ValueError (or KeyError,
    TypeError) otherwise: an answer served later must not fail then, nor a scrape of the store's counts."""
    def text(value, optional=False) -> bool:
        return isinstance(value, str) or (optional and value is None)

    def header_text(value) -> bool:  # what an HTTP header may carry: visible ASCII and spaces, no line breaks
        return isinstance(value, str) and all(32 <= ord(char) < 127 for char in value)

    def number(value, optional=False) -> bool:  # a time (clients read it as an integer date): 1970 to 5000
        return ((isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < MAX_TIME)
                or (optional and value is None))

    if header["format"] != FORMAT:
        raise ValueError(f"format {header['format']!r}")
    if not (all(text(header[name]) for name in ("id", "tenant", "template_id"))
            and all(text(header[name], optional=True) for name in ("key", "fingerprint", "webhook", "webhook_state"))
            and isinstance(header["async"], bool) and header["webhook_state"] in WEBHOOK_STATES
            and number(header["created"]) and number(header["ended_at"], optional=True)):
        raise ValueError("a field of the wrong type")
    if header["ended_at"] is None:
        return {**header, "images": []}
    images, media_type, body = header["images"], header["media_type"], header["body"]
    if not (header["status"] in STATUSES[1:] and isinstance(header["http_status"], int)
            and 100 <= header["http_status"] <= 599
            and isinstance(header["headers"], dict)
            and all(header_text(key) and header_text(value) for key, value in header["headers"].items())
            and (body is None or isinstance(body, dict)) and text(media_type, optional=True)
            and isinstance(images, list) and all(isinstance(size, int) and size >= 0 for size in images)
            and (media_type is None or len(images) == 1)):
        raise ValueError("an answer field of the wrong type")
    return header
