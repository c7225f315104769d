"""Edits that outlive the request that made them, and their kept answers.

An edit sent with `async=true` is answered 202 at once and fetched later; an edit sent with an
`Idempotency-Key` header is kept so that a retry of the same request (a dropped connection, a client's
automatic retry) gets the same answer rather than a second generation. Each runs as a `Job` on the
server's event loop, so it goes on when its client goes away, within the server's request timeout.

    jobs = EditJobs(ttl_s=3600, max_bytes=512 << 20)
    job = jobs.add(Job("edit-1", tenant, key="k", fingerprint=f))  # at once: a concurrent retry finds it
    jobs.run(job, produce(), cancelled=lambda: Outcome(...))  # once admitted; produce() -> Outcome
    jobs.abandon(job, Outcome(...))                    # or: refused before it ran (nothing is kept)
    await job.ended.wait(); job.outcome.reply          # what its POST answered (or would have)
    jobs.find(tenant, "edit-1"); jobs.keyed(tenant, "k", f)   # KeyReused: the key named another request

A finished job's answer is kept for `ttl_s`, and all kept answers within `max_bytes`: beyond it the
longest-finished go first, but the newest stays even alone over it, so that no answer is gone the
moment it is made. A running job is never evicted. A key names one request of one tenant: the same
key with another request (other fields or files: `fingerprint`) is refused, as the IETF
Idempotency-Key draft says (422), since answering it with the first request's image would be wrong.
A job that failed on the server's side (5xx: a GPU error, a timeout) or was cancelled gives its key back,
so that a retry runs again rather than being answered that outcome for as long as it is kept.
With a `folder` (`retouch.kept_answers`), every job is also written to disk as it is admitted and as it
ends, and `restore()` takes them back in a restarted server.

The store belongs to the event loop; `counts()` alone may be called from another thread (a metrics
scrape), and it only reads.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from retouch.kept_answers import AnswerFolder

STATUSES = ("in_progress", "completed", "failed", "cancelled")
logger = logging.getLogger("retouch.edit_jobs")
JOB_OVERHEAD_BYTES = 1024  # what a kept job costs besides its answer: bounds how many failures are kept
HASH_CHUNK = 1 << 20


class KeyReused(Exception):
    """The Idempotency-Key names another request of this tenant."""


@dataclass(frozen=True)
class Reply:
    """What an edit's POST answered (or would have), as plain data, so that it can be kept (in memory, and
    on disk: `retouch.kept_answers`) and given again to each request that fetches it: never a raised
    exception, whose frames would hold the request's images. `media_type` set: the answer is `images[0]`
    itself; else a JSON `body`: the envelope `images` go in as base64 (`data`), or an error."""
    headers: dict[str, str]
    body: dict | None = None
    images: tuple[bytes, ...] = ()
    media_type: str | None = None


@dataclass(frozen=True)
class Outcome:
    """How a job ended: its status, its HTTP status and its answer."""
    status: str
    http_status: int
    reply: Reply

    @property
    def nbytes(self) -> int:
        return sum(map(len, self.reply.images))

    @property
    def error(self) -> dict | None:
        return None if self.status == "completed" else self.reply.body

    @property
    def gives_key_back(self) -> bool:
        """A failure of the server's (5xx: a GPU error, a timeout, its stop) or a cancel: a retry runs again."""
        return self.http_status >= 500 or self.status == "cancelled"


@dataclass(eq=False)
class Job:
    id: str
    tenant: str
    template_id: str = ""  # known once the request is validated
    key: str | None = None  # its Idempotency-Key
    fingerprint: str | None = None  # of the request that made it (`fingerprint`)
    runs_async: bool = False  # answered 202 at once (the request's choice, part of what a key names)
    interrupted: bool = False  # cancelled by the server's stop (its outcome is then the server's failure)
    deleted: bool = False  # cancelled by its client (DELETE); any other cancel of its task is the server's stop
    created: float = field(default_factory=time.time)  # wall clock: clients read it
    webhook: str | None = None  # called when it ends (`retouch.webhooks`)
    webhook_state: str | None = None  # how its delivery ended: delivered, gone, failed, refused; None: not yet
    outcome: Outcome | None = None
    ended_at: float | None = None  # wall clock: clients read it, and it outlives a restart
    task: asyncio.Task | None = None  # while it runs (dropped when it ends: a cancelled task holds its frames)
    finished_at: float | None = None  # on the store's clock
    admitted: asyncio.Event = field(default_factory=asyncio.Event)  # it runs (`EditJobs.run`): it was not refused
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set with `outcome`

    @property
    def status(self) -> str:
        return "in_progress" if self.outcome is None else self.outcome.status

    async def wait_ended(self, timeout_s: float) -> bool:
        """Whether it ended, waiting up to `timeout_s` for it."""
        await wait_events([self.ended], timeout_s)
        return self.ended.is_set()

    async def settled(self, timeout_s: float) -> None:
        """Return once it runs or ended (a placeholder still being checked is neither), or after `timeout_s`."""
        await wait_events([self.admitted, self.ended], timeout_s, asyncio.FIRST_COMPLETED)

    def nbytes(self) -> int:
        return JOB_OVERHEAD_BYTES + (0 if self.outcome is None else self.outcome.nbytes)


async def wait_events(events: list[asyncio.Event], timeout_s: float, return_when=asyncio.ALL_COMPLETED) -> None:
    """Return once `events` are set (all, or with FIRST_COMPLETED one), or after `timeout_s`; at once for none."""
    if not events:  # asyncio.wait refuses an empty set
        return
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, timeout=max(0.0, timeout_s), return_when=return_when)
    finally:
        for wait in waits:
            wait.cancel()


WHEN_NOT_WHAT = frozenset({"slo_ms"})  # fields a retry may change under the same Idempotency-Key


def fingerprint(endpoint: str, fields: list[tuple[str, str | IO[bytes]]], runs_async: bool) -> str:
    """What a request asked for: its endpoint, every form field (name and value; a file by its bytes, read
    in chunks from its start and left at its start) by name, whatever their order (a client may rebuild
    its form from a map), and whether it runs asynchronously. Not `slo_ms`: it says when the answer is due,
    not what it is, and a client retrying may well send the time it has left.
    Reads files: run it in a worker thread."""
    digest = hashlib.sha256(f"{endpoint}\0{int(runs_async)}\0".encode())
    for name, value in sorted(fields, key=lambda field: field[0]):  # stable: a repeated field keeps its order
        if name in WHEN_NOT_WHAT:
            continue
        if isinstance(value, str):
            data = value.encode()
            digest.update(f"{name}\0{len(data)}\0".encode())
            digest.update(data)
            continue
        size = value.seek(0, 2)
        value.seek(0)
        digest.update(f"{name}\0{size}\0".encode())
        while chunk := value.read(HASH_CHUNK):
            digest.update(chunk)
        value.seek(0)
    return digest.hexdigest()


class EditJobs:
    def __init__(self, ttl_s: float, max_bytes: int, clock: Callable[[], float] = time.monotonic,
                 folder: AnswerFolder | None = None, on_end: Callable[[Job], None] = lambda job: None):
        """`on_end(job)`: each job that ends, once its outcome is kept."""
        if not (ttl_s > 0 and max_bytes > 0):
            raise ValueError("ttl_s and max_bytes must be > 0")
        self.ttl_s, self.max_bytes, self.clock, self.folder = ttl_s, max_bytes, clock, folder
        self.on_end = on_end
        self._jobs: dict[tuple[str, str], Job] = {}
        self._keys: dict[tuple[str, str], Job] = {}
        self._finished: OrderedDict[tuple[str, str], Job] = OrderedDict()  # oldest first
        self.kept_bytes = 0
        self.replays = 0  # requests answered from a kept or running job (by key)
        self.dropped = {"expired": 0, "evicted": 0}  # kept answers gone past ttl_s, and over max_bytes

    def add(self, job: Job) -> Job:
        """Hold the job's id and key from now on (a concurrent retry finds it, and waits for its outcome)."""
        self._expire()
        if (job.tenant, job.id) in self._jobs:
            raise ValueError(f"job {job.id!r} exists")
        if job.key is not None and (job.tenant, job.key) in self._keys:
            raise ValueError(f"the key of job {job.id!r} is held")
        self._jobs[(job.tenant, job.id)] = job
        if job.key is not None:
            self._keys[(job.tenant, job.key)] = job
        return job

    def run(self, job: Job, produce: Coroutine[Any, Any, Outcome], cancelled: Callable[[], Outcome]) -> Job:
        """Run `produce` as the added job (on the running loop); its outcome is kept when it ends, and
        `cancelled()` when its task is cancelled (a DELETE of its last stage, or the server stops), even
        before it first ran (then `produce` never starts)."""
        job.task = asyncio.get_running_loop().create_task(self._run(job, produce), name=f"edit-job-{job.id}")
        job.task.add_done_callback(lambda _: self._on_done(job, produce, cancelled))
        job.admitted.set()
        if self.folder is not None:
            self.folder.save(job)
        return job

    def start(self, job: Job, produce: Coroutine[Any, Any, Outcome], cancelled: Callable[[], Outcome]) -> Job:
        return self.run(self.add(job), produce, cancelled)

    async def _run(self, job: Job, produce: Coroutine[Any, Any, Outcome]) -> None:
        self._finish(job, await produce)

    def _on_done(self, job: Job, produce: Coroutine, cancelled: Callable[[], Outcome]) -> None:
        if not job.ended.is_set():  # its task was cancelled, while it ran or before it began
            produce.close()  # one that never began must not be left unawaited
            self._finish(job, cancelled())

    def _finish(self, job: Job, outcome: Outcome) -> None:
        if outcome.status not in STATUSES[1:]:
            raise ValueError(f"a job ends completed, failed or cancelled, not {outcome.status!r}")
        if job.ended.is_set():
            return
        job.outcome, job.task, job.ended_at = outcome, None, time.time()
        self._keep(job, self.clock())
        if self.folder is not None:
            self.folder.save(job)
        try:
            self.on_end(job)
        except Exception:  # noqa: BLE001 - the job ended whatever its listener does
            logger.exception("after edit %s ended", job.id)
        self._expire()

    def _keep(self, job: Job, finished_at: float) -> None:
        job.finished_at = finished_at
        job.ended.set()
        if job.outcome.gives_key_back:
            self._release_key(job)
        self._finished[(job.tenant, job.id)] = job
        self.kept_bytes += job.nbytes()

    def restore(self, interrupted: Callable[[Job], Outcome]) -> int:
        """Take back the answers kept in `folder` (a restarted server), for what remains of their time;
        an edit that ran when the server stopped ends `interrupted(job)`. How many were taken back."""
        if self.folder is None:
            return 0
        now, wall = self.clock(), time.time()
        loaded = self.folder.load(self.ttl_s, self.max_bytes)
        for job in loaded:  # the longest ended first: a key two of them name is the newer's (the older gave it back)
            job.admitted.set()
            if job.outcome is None:
                job.outcome, job.ended_at = interrupted(job), wall
                self.folder.save(job)
            self._jobs[(job.tenant, job.id)] = job
            if job.key is not None:
                self._keys[(job.tenant, job.key)] = job
            self._keep(job, now - max(0.0, wall - job.ended_at))
        self._expire()
        return len(loaded)

    def unsent_webhooks(self) -> list[Job]:
        """Kept jobs whose webhook's delivery did not end (a stopped server's: a restarted one sends them)."""
        return [job for job in self._finished.values() if job.webhook is not None and job.webhook_state is None]

    def webhook_done(self, job: Job, state: str) -> None:
        """Its webhook's delivery ended (`state`), which is kept with it: a restart sends it no more."""
        job.webhook_state = state
        if self.folder is not None and self._jobs.get((job.tenant, job.id)) is job:  # not one forgotten since
            self.folder.save(job)

    def abandon(self, job: Job, outcome: Outcome) -> None:
        """An added job refused before it ran (bad input, a full queue): whoever waits for it gets
        `outcome`, and nothing is kept (its id and key are free again)."""
        job.outcome, job.finished_at = outcome, self.clock()
        job.ended.set()
        self.forget(job)

    def find(self, tenant: str, job_id: str) -> Job | None:
        self._expire()
        return self._jobs.get((tenant, job_id))

    def keyed(self, tenant: str, key: str, fingerprint: str) -> Job | None:
        """The job the tenant's `key` made, if it is still kept; KeyReused when it was made by another
        request."""
        self._expire()
        job = self._keys.get((tenant, key))
        if job is not None and job.fingerprint != fingerprint:
            raise KeyReused(f"Idempotency-Key {key!r} was used for another request (edit {job.id!r}); a retry "
                            "must send the same fields and files, and a new request a new key")
        if job is not None:
            self.replays += 1
        return job

    def forget(self, job: Job) -> None:
        """Drop a job that is not running (a DELETE of a kept answer, `abandon`)."""
        if self._jobs.get((job.tenant, job.id)) is not job:
            return
        del self._jobs[(job.tenant, job.id)]
        self._release_key(job)
        if self._finished.pop((job.tenant, job.id), None) is not None:
            self.kept_bytes -= job.nbytes()
        if self.folder is not None and job.admitted.is_set():
            self.folder.remove(job)

    def _release_key(self, job: Job) -> None:
        if job.key is not None and self._keys.get((job.tenant, job.key)) is job:
            del self._keys[(job.tenant, job.key)]

    def _expire(self) -> None:
        """Drop finished jobs past their time, then the oldest while over the byte budget (never the newest)."""
        now = self.clock()
        while self._finished:
            oldest = next(iter(self._finished.values()))
            over_budget = self.kept_bytes > self.max_bytes and len(self._finished) > 1
            expired = now - oldest.finished_at > self.ttl_s
            if not expired and not over_budget:
                break
            self.dropped["expired" if expired else "evicted"] += 1
            self.forget(oldest)

    def running_async(self) -> list[Job]:
        """The asynchronous edits that run (a stopping server cancels them: nobody could fetch their answers)."""
        return [job for job in self._jobs.values() if job.runs_async and job.admitted.is_set()
                and not job.ended.is_set()]

    def expires_in_s(self, job: Job) -> float | None:
        return None if job.finished_at is None else max(0.0, job.finished_at + self.ttl_s - self.clock())

    def counts(self) -> dict[str, int]:
        """Jobs by status, and the bytes of the kept answers (expired ones until the loop next touches the
        store). Only reads: a scrape's thread may call it."""
        counts = dict.fromkeys(STATUSES, 0)
        for job in list(self._jobs.values()):
            counts[job.status] += 1
        return {**counts, "kept_bytes": self.kept_bytes}
