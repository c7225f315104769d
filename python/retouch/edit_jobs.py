"""Edits that outlive the request that made them, and their kept answers.

An edit sent with `async=true` (or `Prefer: respond-async`) is answered 202 at once and fetched later;
an edit sent with an `Idempotency-Key` header is kept so that a retry of the same request (a dropped
connection, a client's automatic retry) gets the same answer rather than a second generation. Each
runs as a `Job` on the server's event loop, so it goes on when its client goes away, within the
server's request timeout.

    jobs = EditJobs(ttl_s=3600, max_bytes=512 << 20)
    job = jobs.start(Job("edit-1", tenant, "tpl", key, fingerprint), produce())  # produce: -> Outcome
    jobs.find(tenant, "edit-1")               # running or kept; None once forgotten or expired
    jobs.keyed(tenant, key, fingerprint)      # the key's job; KeyReused if it was another request

A finished job's answer is kept for `ttl_s`, and all kept answers within `max_bytes`: beyond it the
longest-finished go first, but the newest stays even alone over it, so that no answer is gone the
moment it is made. A running job is never evicted. A key names one request of one tenant: the same
key with another request (other fields or files: `fingerprint`) is refused, as the IETF
Idempotency-Key draft says (422), since answering it with the first request's image would be wrong.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

STATUSES = ("in_progress", "completed", "failed", "cancelled")
JOB_OVERHEAD_BYTES = 1024  # what a kept job costs besides its answer: bounds how many failures are kept


class KeyReused(Exception):
    """The Idempotency-Key names another request of this tenant."""


@dataclass(frozen=True)
class Outcome:
    """How a job ended: its status, its HTTP status, a maker of the answer the POST gave (or would have:
    called once per request that fetches it), the answer's size, and for a failure its error body."""
    status: str
    http_status: int
    answer: Callable[[], Any]
    nbytes: int = 0
    error: dict | None = None


@dataclass(eq=False)
class Job:
    id: str
    tenant: str
    template_id: str
    key: str | None = None  # its Idempotency-Key
    fingerprint: str | None = None  # of the request that made it (`fingerprint`)
    runs_async: bool = False  # answered 202 at once (the request's choice, part of what a key names)
    created: float = field(default_factory=time.time)  # wall clock: clients read it
    outcome: Outcome | None = None
    task: asyncio.Task | None = None
    finished_at: float | None = None  # on the store's clock

    @property
    def status(self) -> str:
        return "in_progress" if self.outcome is None else self.outcome.status

    def nbytes(self) -> int:
        return JOB_OVERHEAD_BYTES + (0 if self.outcome is None else self.outcome.nbytes)


def fingerprint(endpoint: str, fields: list[tuple[str, str | bytes]], runs_async: bool) -> str:
    """What a request asked for: its endpoint, every form field (name and value, files by their bytes)
    in the order sent, and whether it runs asynchronously."""
    digest = hashlib.sha256(f"{endpoint}\0{int(runs_async)}\0".encode())
    for name, value in fields:
        data = value if isinstance(value, bytes) else value.encode()
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


class EditJobs:
    def __init__(self, ttl_s: float, max_bytes: int, clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0 or max_bytes <= 0:
            raise ValueError("ttl_s and max_bytes must be > 0")
        self.ttl_s, self.max_bytes, self.clock = ttl_s, max_bytes, clock
        self._jobs: dict[tuple[str, str], Job] = {}
        self._keys: dict[tuple[str, str], Job] = {}
        self._finished: OrderedDict[tuple[str, str], Job] = OrderedDict()  # oldest first
        self.kept_bytes = 0
        self.replays = 0  # requests answered from a kept or running job (by key)

    def start(self, job: Job, produce: Coroutine[Any, Any, Outcome], cancelled: Outcome) -> Job:
        """Run `produce` as the job (on the running loop); its outcome is kept when it ends, and
        `cancelled` when its task is cancelled (a DELETE before it reached a worker, or the server stops)."""
        self._expire()
        if (job.tenant, job.id) in self._jobs:
            raise ValueError(f"job {job.id!r} exists")
        self._jobs[(job.tenant, job.id)] = job
        if job.key is not None:
            self._keys[(job.tenant, job.key)] = job
        job.task = asyncio.get_running_loop().create_task(self._run(job, produce, cancelled),
                                                          name=f"edit-job-{job.id}")
        return job

    async def _run(self, job: Job, produce: Coroutine[Any, Any, Outcome], cancelled: Outcome) -> None:
        try:
            outcome = await produce
        except asyncio.CancelledError:
            self._finish(job, cancelled)
            raise
        self._finish(job, outcome)

    def _finish(self, job: Job, outcome: Outcome) -> None:
        if outcome.status not in STATUSES[1:]:
            raise ValueError(f"a job ends completed, failed or cancelled, not {outcome.status!r}")
        job.outcome, job.finished_at = outcome, self.clock()
        if self._jobs.get((job.tenant, job.id)) is not job:
            return  # forgotten while it ran (DELETE): nobody will fetch it
        self._finished[(job.tenant, job.id)] = job
        self.kept_bytes += job.nbytes()
        self._expire()

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
        """Drop a job (a DELETE): a running one finishes for nobody."""
        if self._jobs.get((job.tenant, job.id)) is not job:
            return
        del self._jobs[(job.tenant, job.id)]
        if job.key is not None and self._keys.get((job.tenant, job.key)) is job:
            del self._keys[(job.tenant, job.key)]
        if self._finished.pop((job.tenant, job.id), None) is not None:
            self.kept_bytes -= job.nbytes()

    def _expire(self) -> None:
        """Drop finished jobs past their time, then the oldest while over the byte budget (never the newest)."""
        now = self.clock()
        while self._finished:
            oldest = next(iter(self._finished.values()))
            over_budget = self.kept_bytes > self.max_bytes and len(self._finished) > 1
            if now - oldest.finished_at <= self.ttl_s and not over_budget:
                break
            self.forget(oldest)

    def counts(self) -> dict[str, int]:
        """Jobs by status, and the bytes of the kept answers."""
        self._expire()
        counts = dict.fromkeys(STATUSES, 0)
        for job in self._jobs.values():
            counts[job.status] += 1
        return {**counts, "kept_bytes": self.kept_bytes}
