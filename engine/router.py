"""The router: one ZeroMQ ROUTER socket between the HTTP frontend and the workers (paper §4.1, §4.4).

Workers (`python -m retouch.engine.node`, one per GPU) connect with DEALER sockets, say hello, then
heartbeat their running batch and queue. The router keeps, per worker, what it has dispatched and
how far each request has got (`policies.ClusterLoad`) and sends each edit to the worker its policy
picks among those holding the edit's template.

Templates are registered on workers (all of them, or `replicas` of them): an edit is routed only to
a worker whose recording is ready, and waits ("parked") while none is. The router keeps each
template's image so that a worker that joins, or replaces one that died, can record it again.
A one-off image (`TemplateRecord.one_off`) is never registered: its first edit goes to a worker
with the image and records it as it runs (one generation); later edits of it go where it is ready.
An edit with a LoRA (`EditTask.lora`, sent as `retouch.lora.choice_header` JSON) of an image nobody
holds is computed in full and records nothing (the cache holds the base model's activations): it
carries the image without claiming its recording. Among the workers an edit with a LoRA may go to, those
that hold its adapters (their heartbeat's `loras`, or an edit sent there naming them) are preferred when
one has a free batch slot and at most `RouterConfig.lora_affinity` requests more in flight than the least
loaded (`policies.prefer_holders`): with thousands of long-tailed adapters, spreading one adapter's
requests over every worker would read its file, and evict another adapter for it, once per worker.
Likewise, among the workers ready for an edit's template, those that hold its recording in host memory
(their heartbeat's `cached`, or an edit of it sent there) are preferred within
`RouterConfig.template_affinity`: a template recorded on every worker is not in every worker's host cache,
and an edit elsewhere reads it from disk or, evicted from every tier, records it again (a generation).
Requests can be cancelled (the client went away): the worker drops them at its next step.

Failure handling: a worker that stops heartbeating for `dead_after_s`, or whose process the
supervisor saw exit, is removed; every request it held is routed again. An answer counts only from
the worker the request is assigned to at that moment, so a request is answered exactly once even if
a worker presumed dead speaks again. A worker removed while still alive (a network cut that healed)
is told to join again; its hello lists the templates it still holds, which need no new recording.
A hello says the worker's model, dtype and weights digest (its scheduler included): another model
(`RouterConfig.model`) is refused ("refused", the worker exits); other weights join with a warning
(logged: retouch.router). Each heartbeat is answered ("alive"), so a worker notices a head that
crashed. Closing tells the workers the server started ("supervised") to stop, and the others that it
is closing: they outlive it and join the next.

Deadlines (SLOs): an edit's `RequestLoad.deadline` is on this router's clock (time.monotonic());
each worker is sent what is left of it (`budget_s`: clocks differ across hosts) and orders its queue
by slack. With `slo_admission="reject"` a request whose predicted finish (`predict_finish_s`, from
the StepCost and the cluster's load) is past its deadline is refused at once (DeadlineUnattainable),
rather than accepted to miss it. Per size class (`size_class`) the router counts requests with a
deadline and whether each was met, missed, refused or cancelled (`snapshot()["slo"]`).

Workers on other hosts connect over TCP with CURVE (`engine.curve`): the router refuses to bind an
address other hosts can reach without keys.

Threads: the router's own thread owns the socket; the frontend calls `submit`, `register_template`
and friends from its threads. State is guarded by one lock; sends are queued and the router thread
is woken through an inproc socket.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import zmq

from retouch.engine import wire
from retouch.engine.curve import RouterSecurity, is_loopback
from retouch.engine.policies import (ClusterLoad, NoWorker, RequestLoad, denoiser_calls, full_finish_s, make_policy,
                                    prefer_holders, replica_to_add)
from retouch.engine.step_cost import StepCost
from retouch.engine.wakeup import Wakeup
from retouch.config import model_label
from retouch.errors import InputError
from retouch.lora import LoraChoice, choice_header
from retouch.strength import steps_run

if TYPE_CHECKING:
    from retouch.engine.registry import TemplateRegistry

logger = logging.getLogger("retouch.router")


class QueueFull(RuntimeError):
    """More requests are waiting than the router accepts (`max_queue`): answer 429, with
    `retry_after_s`, when the queue should have room for them at the rate edits were answered lately."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


DROPPED_KEPT = 10_000  # template ids remembered as dropped, for workers back after missing the drop (`_on_hello`)
CLOSE_LINGER_MS = 1000  # at most this long for the last messages to a worker when the router closes
REPLICA_IDLE_S = 300.0  # a replica added for a template's load is dropped when no edit went there for this long
# Retry-After of a full queue: without answers to go by yet, this long; never beyond the cap (OpenAI's
# SDKs honour at most 60 s).
RETRY_AFTER_UNKNOWN_S, RETRY_AFTER_MAX_S = 5, 60


NO_WORKER = "no_worker"  # the error code of an edit refused or answered because no worker is connected
LORA_UNAVAILABLE = "lora_unavailable"  # ... of an edit with a LoRA that no connected worker serves


def no_lora_worker_message() -> str:
    return "no connected worker serves LoRAs (none was started with --lora-dir); retry later"


class Unavailable(RuntimeError):
    """The router is closing, or no worker can take the request."""


class NoWorkerConnected(Unavailable):
    """No worker has been connected for `RouterConfig.no_worker_s`: edits are refused (503) until one joins."""


def no_worker_message(idle_s: float) -> str:
    return f"no worker has been connected for {idle_s:.0f} s; retry later"


class TemplateLimit(RuntimeError):
    """The tenant already keeps `RouterConfig.max_templates_per_tenant` registered templates."""


class TemplateStorageFull(RuntimeError):
    """The registered templates' images, all tenants', would exceed `RouterConfig.max_template_bytes`."""


class RegistryError(RuntimeError):
    """The template registry (`--cache-disk-dir`) could not save or remove a template's files."""


class DeadlineUnattainable(RuntimeError):
    """With `slo_admission="reject"`: the request is predicted to finish after its deadline (429)."""

    def __init__(self, predicted_s: float, budget_s: float):
        super().__init__(f"predicted to finish in {predicted_s:.3f} s, over its SLO budget of {budget_s:.3f} s")
        self.predicted_s, self.budget_s = predicted_s, budget_s


SLO_ADMISSION = ("accept", "reject")
SLO_OUTCOMES = ("met", "missed", "refused", "cancelled")
# Size classes by image side in pixels (a square of the same area); larger ones are "larger".
SIZE_CLASSES = (256, 512, 768, 1024, 1536, 2048, 4096)
TOKEN_SIDE = 16  # pixels: the policies' token grid (`http_api.TOKEN_STRIDE`)
PIXELS_PER_TOKEN = TOKEN_SIDE * TOKEN_SIDE


def _this_attempt(header: dict, pending: Pending) -> bool:
    """Whether a worker's message is about the latest sending of the edit: a worker presumed dead and back
    may still run the copy it was sent before the edit came back to it (the same worker name), whose
    steps and answer are for nobody. A message without an attempt (a worker that numbers none) counts."""
    return header.get("attempt", pending.routes) == pending.routes


def _recording_key(worker: WorkerState, template_id: str) -> tuple[str, int]:
    """A recording's row in the ClusterLoad (beside the edits' request ids): one per template and worker."""
    return template_id, worker.slot


def size_class(load: RequestLoad) -> str:
    """The resolution bucket SLO metrics are kept by: the smallest of SIZE_CLASSES whose square holds
    the request's pixels ("512": up to 512x512), else "larger"."""
    pixels = load.image_tokens * PIXELS_PER_TOKEN
    return next((str(side) for side in SIZE_CLASSES if pixels <= side * side), "larger")


@dataclass(frozen=True)
class EditTask:
    """One edit as the router carries it: everything the worker needs, already validated."""

    template_id: str
    mask: bytes  # raw mode-"L" pixels of the template's original size, white = repaint
    mask_size: tuple[int, int]
    prompt: str
    seed: int
    load: RequestLoad
    preview_every: int = 0  # a preview PNG of its latents every that many steps (0: none)
    lora: LoraChoice = ()  # its LoRA adapters (checked against the LoRA folder at the frontend); () for none
    trace: str = ""  # the client's X-Request-Id (#i for the i-th of n images): the worker logs it with the edit
    strength: float = 1.0  # below 1, it runs the last steps of its template's schedule (`retouch.strength`)
    negative_prompt: str | None = None  # checked (`MaskAwareEditor.check_negative_prompt`); None: the pipeline's
    guidance: float | None = None  # a template's edit's own scale (`MaskAwareEditor.check_edit_guidance`); None: its


@dataclass(frozen=True)
class EditAnswer:
    """A worker's answer: a PNG, or an error with the HTTP status it maps to."""

    png: bytes | None
    status: int
    error: str | None = None
    message: str | None = None
    worker: str | None = None
    metrics: dict = field(default_factory=dict)


@dataclass
class TemplateRecord:
    template_id: str
    image: bytes  # encoded: PNG for a registered template, the client's upload for a one-off image
    size: tuple[int, int]
    prompt: str
    steps: int
    seed: int
    guidance: float | None
    replicas: int  # 0: the router's `template_replicas`
    # Workers its edits' load added as replicas beyond `replicas` (`Router._grow_replicas`) -> when an edit of it
    # was last sent there; idle for REPLICA_IDLE_S, such a replica is dropped
    added: dict[str, float] = field(default_factory=dict)
    one_off: bool = False  # recorded by its first edit, never registered on its own
    edits_below_full: int = 0  # requests editing it below strength 1 (a one-off's second records it, `_route`)
    owner: str = ""  # the tenant (API key) that registered it: others neither see nor use it
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)  # its last edit (one-off images are evicted by it)
    alpha: bytes | None = None  # its transparency (PNG, "L"), which answers get back; the frontend's only
    states: dict[str, str] = field(default_factory=dict)  # worker -> recording | ready | failed
    progress: dict[str, int] = field(default_factory=dict)  # worker -> recorded steps
    error: str | None = None
    # A one-off image larger than these workers' whole host caches (a recording there answered "too_large"):
    # its edits go elsewhere to record it, or run in full side by side where none can.
    too_large_for: set[str] = field(default_factory=set)
    negative_prompt: str | None = None  # a registered template's recorded run's (None for a one-off: its first edit's own)

    @property
    def nbytes(self) -> int:
        """What the head holds of it in memory: its image and transparency, encoded."""
        return len(self.image) + len(self.alpha or b"")

    @property
    def status(self) -> str:
        if "ready" in self.states.values():
            return "ready"
        if self.error is not None and "recording" not in self.states.values():
            return "failed"
        if self.one_off and "recording" not in self.states.values():
            return "pending"  # its next edit records it
        return "recording"

    def to_json(self, live: set[str], cached: set[str] = frozenset()) -> dict:
        """`live`: the connected workers' names; `cached`: those whose host memory holds its recording (their
        last heartbeat), where an edit of it costs no disk read and no recording again."""
        recording = [w for w, s in self.states.items() if s == "recording" and w in live]
        return {"id": self.template_id, "status": self.status, "width": self.size[0], "height": self.size[1],
                "steps": self.steps, "seed": self.seed, "prompt": self.prompt, "negative_prompt": self.negative_prompt,
                "guidance": self.guidance, "created": int(self.created), "error": self.error, "one_off": self.one_off,
                "progress": {"workers_ready": sum(1 for w, s in self.states.items() if s == "ready" and w in live),
                             "workers_recording": len(recording),
                             # "ready" workers keep it on disk, or record it again for an edit, once their host
                             # memory went to other templates: these hold it there now
                             "workers_cached": len(cached & live),
                             # 0: it waits for a worker to join and record it (its edits get 503 after no_worker_s)
                             "workers_connected": len(live),
                             # Once one replica is ready the template is, whatever the others are at.
                             "step": self.steps if self.status == "ready"
                             else max((self.progress.get(w, 0) for w in recording), default=0),
                             "steps": self.steps}}


@dataclass(eq=False)
class Pending:
    request_id: int
    task: EditTask
    future: Future
    worker: str | None = None  # where it is now
    routes: int = 0  # how many times it was sent (re-routes after failures add to it)
    records: bool = False  # sent as a one-off edit that records its template on `worker`
    steps_left: int | None = None  # from the worker's heartbeats once it runs
    calls: int | None = None  # its denoiser calls, as its worker counts them (Heun: 2 x steps - 1)
    owner: str = ""  # the tenant of its template (`max_queue_per_tenant`)


@dataclass(eq=False)
class WorkerState:
    name: str
    identity: bytes
    slot: int
    pid: int
    last_seen: float
    assigned: set[int] = field(default_factory=set)
    report: dict = field(default_factory=dict)  # its last heartbeat's metrics
    loras: frozenset[str] = frozenset()  # the LoRAs its last heartbeat held (`LoraManager.resident`)
    cached: frozenset[str] = frozenset()  # the templates its last heartbeat held in host memory (`CacheStore.in_host`)
    lora_digests: dict[str, str] = field(default_factory=dict)  # of their files (`LoraManager.digests`)
    info: dict = field(default_factory=dict)  # from its hello: model, dtype, weights (digest), supervised, lora
    # assigned edits (by request id) and templates it records (by template id) its heartbeats lack, since when
    missing: dict[int | str, float] = field(default_factory=dict)
    sent: int = 0  # the number of the last message sent to it (its heartbeats say the last they saw)
    # the number of the message that carried each assigned edit and each template sent to it to record, and when
    sent_in: dict[int | str, tuple[int, float]] = field(default_factory=dict)
    draining: bool = False  # stopping: it finishes its edits, and gets no new edit or template
    registering: set[str] = field(default_factory=set)  # templates sent to it to record, not yet reported
    # Those of them sent in bulk (`_ensure_replicas(bulk=...)`), in order: it records them one at a time, so
    # only the first weighs
    bulk: dict[str, None] = field(default_factory=dict)
    dropping: set[int] = field(default_factory=set)  # edits it holds that are not its own, told to drop them


@dataclass(frozen=True, kw_only=True)  # by name: a field added in the middle must not shift callers' values
class RouterConfig:
    address: str = "tcp://127.0.0.1:0"  # bind; ipc:// on one host, tcp:// across hosts (loopback unless set)
    policy: str = "mask-aware"
    heartbeat_s: float = 0.5  # told to workers in the welcome
    dead_after_s: float = 5.0  # silence after which a worker is removed
    # An edit or template sent to a worker that has not seen it yet is on its way (a large image over a slow
    # link) for at most this long; after that, missing from its heartbeats for dead_after_s, it is lost.
    transfer_timeout_s: float = 120.0
    max_queue: int = 256  # requests accepted and not yet answered
    # Of them, one tenant's (API key's) at most, so that one client's burst cannot refuse every other
    # client for as long as it lasts; None: max_queue.
    max_queue_per_tenant: int | None = None
    # One-off images remembered, and their bytes (uploads of up to --max-upload-mb each); beyond either the
    # least recently edited idle ones go.
    max_one_off: int = 1024
    max_one_off_bytes: int = 1 << 30
    slo_admission: str = "accept"  # reject: refuse an edit predicted to miss its deadline (needs a StepCost)
    # An edit with a LoRA goes to a worker that holds its adapters (no file read, no second copy evicting
    # another adapter) if one has a free batch slot and at most this many more requests in flight than the
    # least loaded eligible worker; None: the policy alone decides. 0 cut reads without costing latency in
    # `retouch simulate --loras`; 1 cuts more reads, but adds to p95 when loads are mostly hidden.
    lora_affinity: int | None = 0
    # The same for an edit's template: a worker holding its recording in host memory (no disk read, no
    # recording again) is preferred within this bound. None: the policy alone decides.
    template_affinity: int | None = 0
    # The workers a registered template is recorded on (0: every one). Each recording is a generation on
    # that worker and takes room in its caches: with fewer, a registration costs less GPU time and the
    # cluster's caches hold more distinct templates, while each template's edits go to its replicas only.
    template_replicas: int = 0
    # With fewer replicas than workers: a template with more than this many of its own edits in flight per
    # replica, whose replicas all have more than this many requests in flight beyond the least loaded other
    # worker, gets another replica there (`Router._grow_replicas`), so a popular template's edits do not pile
    # onto its few; dropped after REPLICA_IDLE_S without an edit. None: the replicas stay as many as asked.
    template_replicas_grow: int | None = 1
    # With no worker connected for this long, parked edits are answered 503 and new ones refused at once: a
    # cluster without workers should not hold clients for minutes. inf: wait for one (a single worker whose
    # restart reloads a large model may take longer than the default).
    no_worker_s: float = 30.0
    # The model workers must serve (a pipeline folder by its name: hosts mount it at their own paths); a
    # worker of another model is refused. None: any (tests with scripted workers).
    model: str | None = None
    # The served model's family and its sampler's calls line (`retouch.models.samplers.calls_line`), as its
    # workers will say them in their hello: edits that come before any worker has are counted as they will
    # run (steps below strength 1, progress). None: Flux's rounding, one call a step.
    family: str | None = None
    calls: tuple[int, int] | None = None
    # Registered templates one tenant (API key) may keep; the router holds each one's image in memory (and
    # the registry on disk), so without a bound one client could grow the head without end. One-off
    # images are bounded by max_one_off instead.
    max_templates_per_tenant: int = 1000
    # The registered templates' images, all tenants', held in memory (each is also on disk with a registry,
    # but the head sends it to every worker that joins); beyond it registrations are refused.
    max_template_bytes: int = 4 << 30

    def __post_init__(self):
        if self.dead_after_s <= self.heartbeat_s:
            raise ValueError("dead_after_s must exceed heartbeat_s")
        if not self.transfer_timeout_s > 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.max_queue_per_tenant is not None and self.max_queue_per_tenant < 1:
            raise ValueError(f"max_queue_per_tenant must be >= 1 or None, got {self.max_queue_per_tenant}")
        if not self.no_worker_s > 0:
            raise ValueError(f"no_worker_s must be > 0, got {self.no_worker_s}")
        if self.max_one_off < 1:
            raise ValueError(f"max_one_off must be >= 1, got {self.max_one_off}")
        if self.max_templates_per_tenant < 1:
            raise ValueError(f"max_templates_per_tenant must be >= 1, got {self.max_templates_per_tenant}")
        for name in ("max_one_off_bytes", "max_template_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("lora_affinity", "template_affinity", "template_replicas_grow"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {getattr(self, name)}")
        if self.template_replicas < 0:
            raise ValueError(f"template_replicas must be >= 0, got {self.template_replicas}")
        if self.slo_admission not in SLO_ADMISSION:
            raise ValueError(f"slo_admission must be one of {', '.join(SLO_ADMISSION)}, got {self.slo_admission!r}")


class Router:
    def __init__(self, config: RouterConfig = RouterConfig(), cost: StepCost | None = None,
                 on_decision: Callable[[float], None] | None = None, security: RouterSecurity | None = None,
                 registry: TemplateRegistry | None = None):
        """`on_decision(seconds)`: told the policy's time of every routing decision (metrics).
        `security`: CURVE keys; required to bind an address other hosts can reach. `registry`: where
        registered templates are kept across restarts (`engine.registry`); the ones it holds are the router's
        from the start, recorded by each worker that joins (which adopts its disk tier's file of one, if it has
        it). Each worker that joins or leaves, and why, is logged (retouch.router: info; refusals and
        mismatches: warning)."""
        if security is None and not is_loopback(config.address):
            raise InputError(f"refusing to listen for workers on {config.address} without CURVE keys "
                             "(--curve-secret, --curve-allowed): anyone who can reach it could join as a worker")
        self.config = config
        self.on_decision = on_decision
        # told the name of each worker removed for its silence (`retouch serve`: its supervisor kills it)
        self.on_worker_lost: Callable[[str], None] | None = None
        self.security = security
        self.policy = make_policy(config.policy, cost)
        self.cluster = ClusterLoad(cost)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # A worker that reconnects after a network cut keeps its identity: the new link replaces the
        # stale one instead of being refused.
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if security is not None:
            security.apply(self.context, self.socket)
        self.socket.bind(config.address)
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._wakeup = Wakeup(self.context)
        self._lock = threading.RLock()
        self._outgoing: deque[tuple[bytes, list]] = deque()
        self.workers: dict[str, WorkerState] = {}
        self.registry = registry
        self._registry_lock = threading.Lock()  # taken before self._lock, never after
        self.templates: dict[str, TemplateRecord] = {} if registry is None else {
            record.template_id: record for record in registry.load()}
        if registry is not None:
            self._restore_recency(registry.recency())
        if self.held_bytes(one_off=False) > config.max_template_bytes:  # kept: they are the clients' templates
            logger.warning("the %d registered templates in %s hold %.0f MiB, over the %.0f MiB allowed "
                           "(--max-templates-mb): new registrations are refused until some are deleted",
                           len(self.templates), registry.directory, self.held_bytes(one_off=False) / 2**20,
                           config.max_template_bytes / 2**20)
        self.pending: dict[int, Pending] = {}
        self._answered: deque[float] = deque(maxlen=64)  # when the last edits were answered (Retry-After)
        self.parked: dict[str, deque[int]] = {}  # template -> requests waiting for a ready replica
        # Request ids start at random, with a session id told in each welcome: a worker that outlived the
        # last router (it rejoins with its old edits still running) can never answer one of this router's
        # requests with an old one's image.
        self.session = secrets.token_hex(8)
        self._ids = itertools.count(secrets.randbelow(1 << 62) + 1)
        self._thread: threading.Thread | None = None
        self._closing = False
        self._stopped = False
        self._said_goodbye = False  # closing: the workers were told (`close`), and a hello now is too
        self._no_worker_since: float | None = time.monotonic()  # None while a worker is connected
        self._lora_workers_since = time.monotonic()  # when a worker that serves LoRAs was last connected
        self._next_idle_check = time.monotonic()  # of the replicas added for load (`_drop_idle_replicas`)
        self.counters = {"routed": 0, "rerouted": 0, "duplicates_dropped": 0, "workers_removed": 0, "cancelled": 0,
                         "one_offs_evicted": 0, "one_offs_recorded_beside": 0, "one_offs_too_large": 0,
                         "lora_affinity": 0, "template_affinity": 0, "replicas_added": 0, "replicas_removed": 0,
                         "registry_failures": 0, "workers_mismatched": 0, "lost_requests": 0, "lost_recordings": 0,
                         "lora_mismatches": 0, "worker_names_taken": 0, "stale_edits_dropped": 0}
        self._lora_mismatches: set[tuple[str, str, str]] = set()  # (name, digest, digest) said once
        self._name_taken_said: set[tuple[str, bytes]] = set()  # (name, identity) of second workers, said once
        # size class -> {"with_deadline": n, and n per SLO_OUTCOMES}
        self.slo: dict[str, dict[str, int]] = {}
        # Notified on every dispatch, answer, heartbeat and worker change.
        self._changed = threading.Condition(self._lock)
        # ("request", id) or ("template", id) -> callbacks told what happens to it (`watch`)
        self._watchers: dict[tuple[str, int | str], list[Callable[[dict], None]]] = {}
        # Templates deleted or evicted lately (the newest DROPPED_KEPT), for workers that were away then: a
        # worker back from a pause, or a replacement that adopted its disk tier, is told to drop them.
        self._dropped: OrderedDict[str, None] = OrderedDict()

    # ---- lifecycle ----

    def start(self) -> Router:
        self._thread = threading.Thread(target=self._run, name="retouch-router", daemon=True)
        self._thread.start()
        return self

    def close(self, drain_s: float = 60.0) -> None:
        """Stop accepting, wait up to `drain_s` for every accepted request to be answered, tell the
        workers to finish and stop. Closing twice is closing once."""
        if self.socket.closed:
            return
        with self._lock:
            self._closing = True
            futures = [p.future for p in self.pending.values()]
        deadline = time.monotonic() + drain_s
        for future in futures:
            try:
                future.exception(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                break
        with self._lock:
            for pending in list(self.pending.values()):
                if pending.worker in self.workers:  # answered here: its worker need not compute it while draining
                    self._send(self.workers[pending.worker], {"kind": "cancel", "request": pending.request_id})
                self._answer(pending, EditAnswer(None, 503, "interrupted",
                                                 "the server stopped before this edit was done; send it again"))
            for worker in self.workers.values():  # a worker started on its own outlives the server
                self._send(worker, {"kind": self._goodbye(worker.info)})
            self._said_goodbye = True
        self._wake()
        if self._thread is not None:
            with self._lock:  # the loop's next swap, which sends the stop messages, is its last
                self._stopped = True
            self._wake()
            self._thread.join(timeout=10)
        self._wakeup.close()
        # The last messages (stop, closing) were handed to the socket, not yet to TCP: a moment to go out.
        self.socket.close(linger=CLOSE_LINGER_MS)
        if self.security is not None:
            self.security.close()
        if self.registry is not None:
            try:  # a worker that joins the next router records the templates most recently edited first
                self.registry.save_recency([r.template_id for r in self._most_recently_edited() if not r.one_off])
            except OSError as exc:
                logger.warning("the order in which templates were edited could not be kept in %s: %s",
                               self.registry.directory, exc)
            self.registry.close()
        self.context.term()

    # ---- the frontend's calls ----

    def submit(self, task: EditTask) -> Future[EditAnswer]:
        return self.submit_many([task])[1][0]

    def submit_many(self, tasks: list[EditTask], one_off: TemplateRecord | None = None,
                    on_event: Callable[[int, dict], None] | None = None) -> tuple[list[int], list[Future[EditAnswer]]]:
        """Accept all of `tasks` or none (QueueFull, Unavailable, KeyError for an unknown template,
        DeadlineUnattainable with `slo_admission="reject"`);
        `one_off`: the one-off image they edit, registered with them if new. Returns the request ids
        (for `cancel` and `request_status`) and the futures of the answers. `on_event(id, event)`
        watches them (`watch`) from before they are routed, so it misses none of their steps."""
        with self._lock:
            if self._closing:
                raise Unavailable("the server is shutting down")
            if (idle := self._without_workers_s()) > self.config.no_worker_s:
                raise NoWorkerConnected(no_worker_message(idle))
            excess = len(self.pending) + len(tasks) - self.config.max_queue
            if excess > 0:
                waiting = len(self.pending)
                raise QueueFull(f"{waiting} request{'s are' if waiting != 1 else ' is'} waiting (max_queue "
                                f"{self.config.max_queue})",
                                self._retry_after_s(excess))
            new_one_off = one_off is not None and one_off.template_id not in self.templates
            unknown = [task.template_id for task in tasks if task.template_id not in self.templates
                       and not (new_one_off and task.template_id == one_off.template_id)]
            if unknown:
                raise KeyError(unknown[0])
            owner = (one_off if new_one_off else self.templates[tasks[0].template_id]).owner if tasks else ""
            self._admit_tenant(owner, len(tasks))
            self._admit_deadlines(tasks)
            # Registered only once the edits are accepted: a refused one-off leaves no template.
            if new_one_off:
                self.templates[one_off.template_id] = one_off
                self._dropped.pop(one_off.template_id, None)
                self._evict_one_offs(keep=one_off.template_id)
            for task in tasks:
                self.templates[task.template_id].last_used = time.monotonic()
            for template_id in {task.template_id for task in tasks if task.strength < 1 and not task.lora}:
                self.templates[template_id].edits_below_full += 1  # per request: n images are one
            accepted = [Pending(next(self._ids), task, Future(), owner=owner) for task in tasks]
            for pending in accepted:
                self.pending[pending.request_id] = pending
                if on_event is not None:
                    self._watchers[("request", pending.request_id)] = [functools.partial(on_event, pending.request_id)]
            for pending in accepted:
                self._route(pending)
        self._wake()
        return [p.request_id for p in accepted], [p.future for p in accepted]

    def _admit_recording(self, owner: str) -> None:
        """QueueFull when a registration would hold more than the queue: a recording is a generation a
        worker runs, as an edit is, so the templates a live worker is recording count with the edits waiting
        (1000 registrations at once slowed every edit 20-fold), in all and the tenant's. A worker's bulk
        registrations (it joined, or took over) count as the one it records, and as no tenant's: with them all
        counted, a registration was refused until a joining worker had reported every template of the server.
        (Edits are admitted by the edits waiting alone: a burst of registrations does not refuse them.)"""
        recording = [record for record in self.templates.values() if not record.one_off and any(
            state == "recording" and name in self.workers and record.template_id not in self.workers[name].bulk
            for name, state in record.states.items())]
        held = len(self.pending) + len(recording) + sum(1 for worker in self.workers.values() if worker.bulk)
        if held >= self.config.max_queue:
            raise QueueFull(f"{held} edits and recordings are waiting (max_queue {self.config.max_queue})",
                            self._retry_after_s(held + 1 - self.config.max_queue))
        limit = self.config.max_queue_per_tenant
        if limit is not None:
            held = (sum(1 for pending in self.pending.values() if pending.owner == owner)
                    + sum(1 for record in recording if record.owner == owner))
            if held >= limit:
                raise QueueFull(f"this API key has {held} edits and recordings waiting, its most "
                                f"(max_queue_per_tenant {limit})", self._retry_after_s(held + 1 - limit))

    def _admit_tenant(self, owner: str, count: int) -> None:
        """QueueFull when the tenant would hold more than its share of the queue (`max_queue_per_tenant`)."""
        limit = self.config.max_queue_per_tenant
        if limit is None:
            return
        held = sum(1 for pending in self.pending.values() if pending.owner == owner)
        if held + count > limit:
            raise QueueFull(f"this API key has {held} requests waiting, its most (max_queue_per_tenant {limit})",
                            self._retry_after_s(held + count - limit))

    def _retry_after_s(self, excess: int) -> int:
        """Seconds until `excess` more requests have been answered, at the rate of the last answers
        (counted up to now, so a stalled cluster reads slow)."""
        if not self._answered:
            return RETRY_AFTER_UNKNOWN_S
        rate = len(self._answered) / max(time.monotonic() - self._answered[0], 1.0)
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(excess / rate)))

    def _admit_deadlines(self, tasks: list[EditTask]) -> None:
        """Count the tasks with a deadline; in reject mode refuse them all (DeadlineUnattainable) if
        one is predicted to finish after its deadline. A request's images are predicted in turn, each
        with the earlier ones placed where they would finish first. No prediction (no StepCost, no live
        worker): accepted."""
        timed = [task for task in tasks if task.load.deadline is not None]
        for task in timed:
            self._slo_count(task.load, "with_deadline")
        if self.config.slo_admission != "reject":
            return
        siblings = np.zeros(self.cluster.num_slots, dtype=int)
        for task in timed:
            budget_s = task.load.deadline - time.monotonic()
            finish = self._finish_s(task.load, self._ready_slots(task.template_id), siblings)
            if finish is None:
                continue
            slot = int(np.argmin(finish))
            if finish[slot] > budget_s:
                for refused in timed:
                    self._slo_count(refused.load, "refused")
                raise DeadlineUnattainable(float(finish[slot]), budget_s)
            siblings[slot] += 1

    def _ready_slots(self, template_id: str) -> np.ndarray | None:
        """Bool [slots] of live workers where the template is ready; None if there is none (it will be
        recorded, or wait: any worker may take it)."""
        record = self.templates.get(template_id)  # None: a one-off not yet registered, recorded anywhere
        states = record.states.items() if record is not None else ()
        eligible = self._slots(name for name, state in states if state == "ready")
        return eligible if eligible.any() else None

    def predict_finish_s(self, load: RequestLoad, eligible: np.ndarray | None = None) -> float | None:
        """Seconds until `load` would be answered by the (eligible) live worker that would finish it
        first, from the StepCost and the cluster's view: with a free batch slot, its steps x the step
        latency of that worker's batch with it added; on a full worker, the steps until a slot frees
        for it (the requests its worker admits first take the first ones: `full_finish_s`) and then its
        own, at the running batch's step latency. None without a StepCost or a live eligible worker."""
        finish = self._finish_s(load, eligible)
        return None if finish is None else float(finish.min())

    def _finish_s(self, load: RequestLoad, eligible: np.ndarray | None,
                  siblings: np.ndarray | None = None) -> np.ndarray | None:
        """[slots] `predict_finish_s` at each worker (inf where it cannot run), with `siblings` ([slots]:
        earlier images of the same request placed at each) counted ahead of it; None as there."""
        cluster, cost = self.cluster, self.cluster.cost
        candidates = cluster.alive if eligible is None else cluster.alive & eligible
        if cost is None or not candidates.any():
            return None
        placed = np.zeros(cluster.num_slots, dtype=int) if siblings is None else siblings
        features = cost.request_features(load.image_tokens, load.masked_tokens, load.text_tokens)
        free = candidates & (cluster.in_flight + placed < cluster.max_batch)
        finish = full_finish_s(load, cluster, np.flatnonzero(candidates & ~free), cost, features, placed)
        for slot in map(int, np.flatnonzero(free)):
            finish[slot] = load.steps * float(cost.latency(cluster.inflight_features[slot]
                                                           + (placed[slot] + 1) * features))
        return finish

    def _slo_count(self, load: RequestLoad, what: str) -> None:
        counts = self.slo.setdefault(size_class(load), dict.fromkeys(("with_deadline", *SLO_OUTCOMES), 0))
        counts[what] += 1

    def cancel(self, request_id: int, why: str = "the client went away") -> bool:
        """Answer the request now (409 Cancelled) and tell its worker to drop it at the next step;
        False if it was already answered."""
        with self._lock:
            pending = self.pending.get(request_id)
            if pending is None:
                return False
            parked = self.parked.get(pending.task.template_id)
            if parked is not None and request_id in parked:
                parked.remove(request_id)
            worker = self.workers.get(pending.worker) if pending.worker is not None else None
            if worker is not None:
                self._send(worker, {"kind": "cancel", "request": request_id})
            self.counters["cancelled"] += 1
            self._answer(pending, EditAnswer(None, 409, "Cancelled", f"the edit was cancelled: {why}"))
            if pending.records:  # its recording goes with it: the next edit of the image records it
                self._recording_ended(pending.task.template_id, pending.worker)
        self._wake()
        return True

    def watch(self, kind: str, key: int | str, on_event: Callable[[dict], None]) -> Callable[[], None] | None:
        """Tell `on_event` what happens to request `key` (kind "request": where it is, each step, its
        previews, its answer) or template `key` ("template": its recording's progress, ready or
        failed), starting with where it is now; None (and nothing told) if it is unknown or answered.
        `on_event` runs on the router's threads with its lock held: it must only hand the event on.
        Returns the call that stops the telling."""
        with self._lock:
            if kind == "request":
                now = self.request_status(key)
                if now is None:
                    return None
                on_event({"event": now["status"], **now})
            else:
                record = self.templates.get(key)
                if record is None:
                    return None
                on_event({"event": "template", **self._template_json(record)})
            self._watchers.setdefault((kind, key), []).append(on_event)

        def stop() -> None:
            with self._lock:
                callbacks = self._watchers.get((kind, key), [])
                if on_event in callbacks:
                    callbacks.remove(on_event)
                if not callbacks:
                    self._watchers.pop((kind, key), None)
        return stop

    def _tell(self, kind: str, key: int | str, event: dict) -> None:
        """With the lock held: the watchers of `key` hear of `event`."""
        for callback in self._watchers.get((kind, key), ()):
            try:
                callback(event)
            except Exception:  # noqa: BLE001 - a watcher's bug must not stop routing
                logger.exception("a watcher of %s %s failed", kind, key)  # through the log's escaping formatter

    def _template_changed(self, record: TemplateRecord) -> None:
        if ("template", record.template_id) in self._watchers:
            self._tell("template", record.template_id, {"event": "template", **self._template_json(record)})

    def denoiser_calls(self, steps: int, worker: str | None = None, strength: float = 1.0) -> int:
        """How many denoiser calls, the units of an edit's progress, an edit of `steps` steps at `strength`
        makes on `worker`'s sampler (a second-order one makes about two a step), as it said when it joined;
        with no worker, on the sampler most live workers run; with none that said, the served model's."""
        line = self._most_said("calls", worker, self.config.calls or (1, 0))
        return denoiser_calls(line, self.steps_run(steps, strength, worker), steps)

    def steps_run(self, steps: int, strength: float = 1.0, worker: str | None = None) -> int:
        """The steps an edit of `steps` at `strength` runs, as `worker`'s model family counts them (most
        live workers' with no worker; `retouch.strength`)."""
        return steps_run(self._most_said("family", worker, self.config.family), steps, strength)

    def _most_said(self, key: str, worker: str | None, default):
        """What `worker` said of `key` in its hello; with no worker, what most live workers said."""
        with self._lock:
            said = [w.info.get(key) for w in self.workers.values() if worker is None or w.name == worker]
        said = [tuple(value) if isinstance(value, list) else value for value in said if value is not None]
        return max(set(said), key=said.count) if said else default

    def request_status(self, request_id: int) -> dict | None:
        """Where an accepted edit is: parked (its template is not ready anywhere), queued at a
        worker, or running step k of n; None once answered."""
        with self._lock:
            pending = self.pending.get(request_id)
            if pending is None:
                return None
            record = self.templates.get(pending.task.template_id)
            steps = (self.denoiser_calls(record.steps, pending.worker, pending.task.strength)
                     if record is not None else None)
            if pending.worker is None:
                return {"status": "parked", "steps": steps}
            if pending.steps_left is None:
                return {"status": "queued", "worker": pending.worker, "steps": steps}
            steps = pending.calls or steps  # as its worker counts
            return {"status": "running", "worker": pending.worker, "step": max(0, steps - pending.steps_left),
                    "steps": steps}

    def register_template(self, record: TemplateRecord) -> TemplateRecord:
        """Record `record` on its replicas (again if it was dropped); the same id twice is one template.
        With a registry it is saved first: one that cannot be saved is not registered (RegistryError),
        since its id would not outlive the server as promised. A tenant keeping its most templates
        already is refused (TemplateLimit), and so is a template the server has no memory left for
        (TemplateStorageFull)."""
        with self._registry_lock:  # a save and the change it follows are one step for deletions too
            with self._lock:
                existing = self.templates.get(record.template_id)
                if existing is not None and existing.status != "failed":
                    return existing
                kept = sum(1 for other in self.templates.values() if other.owner == record.owner and not other.one_off)
                if existing is None and kept >= self.config.max_templates_per_tenant:
                    raise TemplateLimit(f"this API key keeps {kept} templates, the most this server allows "
                                        f"(--max-templates-per-tenant); delete some (DELETE /v1/templates/ID)")
                held = self.held_bytes(one_off=False) - (existing.nbytes if existing is not None else 0)
                if held + record.nbytes > self.config.max_template_bytes:
                    raise TemplateStorageFull(
                        f"the server has no memory left for this template ({record.nbytes / 2**20:.2f} MiB): the "
                        f"templates of every API key hold {held / 2**20:.2f} of its "
                        f"{self.config.max_template_bytes / 2**20:.2f} MiB (--max-templates-mb); delete some of "
                        f"yours (DELETE /v1/templates/ID), or send the image with each edit (a one-off image)")
                self._admit_recording(record.owner)
            self._keep(lambda registry: registry.save(record), record.template_id, "saved")
            with self._lock:
                self.templates[record.template_id] = record
                self._dropped.pop(record.template_id, None)
                self._ensure_replicas(record)
        self._wake()
        return record

    def template(self, template_id: str, owner: str | None = None) -> dict | None:
        """The template as JSON; None if unknown or (`owner` given) another tenant's."""
        with self._lock:
            record = self._owned(template_id, owner)
            return None if record is None else self._template_json(record)

    def list_templates(self, owner: str | None = None) -> list[dict]:
        """Every template, or (`owner` given) that tenant's, newest first."""
        with self._lock:
            records = sorted((record for record in self.templates.values() if owner is None or record.owner == owner),
                             key=lambda record: (-record.created, record.template_id))
            return [self._template_json(record) for record in records]

    def drop_template(self, template_id: str, owner: str | None = None) -> bool:
        """Forget a template (False if unknown or, `owner` given, another tenant's). Its saved copy goes
        first: one that cannot be removed leaves the template registered (RegistryError), rather than
        forgotten now and back after a restart."""
        with self._registry_lock:
            with self._lock:
                if self._owned(template_id, owner) is None:
                    return False
            self._keep(lambda registry: registry.remove(template_id), template_id, "removed")
            with self._lock:
                if self._owned(template_id, owner) is None:
                    return False
                self._drop(template_id)
        self._wake()
        return True

    def _keep(self, change: Callable[[TemplateRegistry], None], template_id: str, what: str) -> None:
        """Apply a template change to the registry, outside the router's lock (it writes files); a
        failure is counted, logged and raised as RegistryError."""
        if self.registry is None:
            return
        try:
            change(self.registry)
        except OSError as exc:
            with self._lock:
                self.counters["registry_failures"] += 1
            logger.error("template %s could not be %s (template registry %s: %s)", template_id, what,
                         self.registry.directory, exc)
            raise RegistryError(f"the template could not be {what} on the server's disk "
                                f"({exc.strerror or exc}); try again later") from None

    def _drop(self, template_id: str) -> None:
        record = self.templates.pop(template_id)
        self._dropped[template_id] = None
        while len(self._dropped) > DROPPED_KEPT:
            self._dropped.popitem(last=False)
        self._tell("template", template_id, {"event": "deleted", "id": template_id})
        self._watchers.pop(("template", template_id), None)
        for name in record.states:
            if name in self.workers:
                self._send(self.workers[name], {"kind": "drop", "template": template_id})
                self._recording_over(self.workers[name], template_id)  # a recording under way stops there
        for request_id in self.parked.pop(template_id, ()):
            self._answer(self.pending[request_id],
                         EditAnswer(None, 404, "template_deleted", f"template {template_id!r} was deleted"))

    def held_bytes(self, one_off: bool) -> int:
        """The bytes of the one-off images, or of the registered templates, the router holds."""
        with self._lock:
            return sum(record.nbytes for record in self.templates.values() if record.one_off == one_off)

    def _evict_one_offs(self, keep: str) -> None:
        """Keep at most `max_one_off` one-off images of at most `max_one_off_bytes` in all: forget the least
        recently edited ones that no accepted edit waits for (their next edit records them again: one
        generation). The busy ones stay, over the bounds if they must, until they are idle (checked again
        as each edit of a one-off is answered)."""
        one_offs = [r for r in self.templates.values() if r.one_off]
        count, held = len(one_offs), sum(r.nbytes for r in one_offs)
        if count <= self.config.max_one_off and held <= self.config.max_one_off_bytes:
            return
        busy = {p.task.template_id for p in self.pending.values()} | {keep}
        for record in sorted((r for r in one_offs if r.template_id not in busy), key=lambda r: r.last_used):
            if count <= self.config.max_one_off and held <= self.config.max_one_off_bytes:
                break
            self._drop(record.template_id)
            self.counters["one_offs_evicted"] += 1
            count, held = count - 1, held - record.nbytes

    def _owned(self, template_id: str, owner: str | None) -> TemplateRecord | None:
        record = self.templates.get(template_id)
        if record is None or (owner is not None and record.owner != owner):
            return None
        return record

    def worker_exited(self, name: str) -> None:
        """The supervisor saw the worker's process end: remove it now rather than after the timeout."""
        with self._lock:
            self._remove_worker(name, "its process exited")
        self._wake()

    def wait_for_workers(self, count: int, timeout_s: float) -> bool:
        return self.wait_until(lambda router: len(router.workers) >= count, timeout_s)

    def wait_until(self, predicate, timeout_s: float) -> bool:
        """Block until `predicate(router)` holds (checked under the lock at every change)."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout_s)

    def snapshot(self) -> dict:
        """What /metrics and /readyz read."""
        with self._lock:
            workers = {}
            for name, worker in self.workers.items():
                workers[name] = {"running": int(self.cluster.running[worker.slot]),
                                 "queued": int(self.cluster.queued[worker.slot]), "assigned": len(worker.assigned),
                                 "pid": worker.pid, "info": dict(worker.info), "draining": worker.draining,
                                 **worker.report}
            return {"workers": workers, "pending": len(self.pending),
                    "parked": sum(len(q) for q in self.parked.values()),
                    "templates": len(self.templates),
                    "template_bytes": {"registered": self.held_bytes(one_off=False),
                                       "one_off": self.held_bytes(one_off=True)},
                    "counters": {**self.counters, "workers_refused": self.security.allowed.refused
                                 if self.security is not None else 0},
                    "slo": {size: dict(counts) for size, counts in self.slo.items()}}

    # ---- routing (called with the lock held) ----

    def _route(self, pending: Pending) -> None:
        record = self.templates.get(pending.task.template_id)
        if record is None:
            self._answer(pending, EditAnswer(None, 404, "template_deleted",
                                             f"template {pending.task.template_id!r} was deleted"))
            return
        eligible = np.zeros_like(self.cluster.alive)
        for name, state in record.states.items():
            if state == "ready" and name in self.workers and not self.workers[name].draining:
                eligible[self.workers[name].slot] = True
        carries_image = records = records_beside = False
        if eligible.any() and not record.one_off:
            self._grow_replicas(record)
        if not eligible.any():
            open_workers = self._open_workers()
            if record.one_off and open_workers.any() and not self._holders(record):
                # Nobody holds the image: this edit goes with it to any worker, computing every token,
                # and records it as it runs unless it has a LoRA (its activations are not the base model's)
                # or a strength below 1 (it runs only the schedule's last steps). An image edited below
                # strength 1 a second time is likely edited again: its worker records it beside the edit,
                # as the edit would have at full strength (once: not after a failed recording).
                # A worker whose whole host cache is smaller than the image's recording is not asked for one:
                # where no worker can hold it, its edits run in full without waiting for each other.
                recordable = open_workers & ~self._slots(record.too_large_for)
                records = not pending.task.lora and pending.task.strength == 1 and bool(recordable.any())
                records_beside = (not (records or pending.task.lora) and record.edits_below_full > 1
                                  and not record.states and bool(recordable.any()))
                eligible = recordable if records or records_beside else open_workers
                carries_image = True
            else:
                self._park(pending, record)
                self._ensure_replicas(record)
                self._hurry_bulk(record)
                if record.status == "failed":
                    self._fail_parked(record)
                return
        if pending.task.lora:
            serving = self._serving_loras()  # a worker started without --lora-dir would fail the edit
            if not serving.any():
                if self._without_lora_workers_s() > self.config.no_worker_s:
                    self._answer(pending, EditAnswer(None, 503, LORA_UNAVAILABLE, no_lora_worker_message()))
                else:  # one may be restarting: wait for it as for any worker
                    self._park(pending, record)
                return
            if not (eligible & serving).any():
                # held only where LoRAs are not served: one that serves them computes it in full from the
                # image (the router keeps every template's), recording nothing
                eligible, carries_image, records = serving, True, False
            eligible = self._lora_holders(pending.task.lora, eligible & serving)
        if not carries_image:
            eligible = self._template_holders(record.template_id, eligible)
        load = pending.task.load
        if carries_image:
            load = replace(load, masked_tokens=load.image_tokens)
        started = time.perf_counter()
        try:
            slot = self.policy.choose(load, self.cluster, eligible)
        except NoWorker:
            self._park(pending, record)
            return
        except Exception as exc:  # noqa: BLE001 - a policy bug answers the request, it does not lose it
            self._answer(pending, EditAnswer(None, 500, "RoutingError", f"{type(exc).__name__}: {exc}"))
            return
        if self.on_decision is not None:
            self.on_decision(time.perf_counter() - started)
        worker = next(w for w in self.workers.values() if w.slot == slot)
        if worker.name in record.added:
            record.added[worker.name] = time.monotonic()
        pending.worker, pending.routes, pending.records = worker.name, pending.routes + 1, records
        pending.steps_left = pending.calls = None
        self.counters["routed" if pending.routes == 1 else "rerouted"] += 1
        worker.assigned.add(pending.request_id)
        self.cluster.assign(slot, pending.request_id, load)
        task = pending.task
        self._changed.notify_all()
        header = {"kind": "edit", "request": pending.request_id, "attempt": pending.routes,
                  "template": task.template_id, "prompt": task.prompt, "seed": task.seed,
                  "mask_size": list(task.mask_size), "preview_every": task.preview_every, "trace": task.trace}
        if task.load.deadline is not None:  # what is left of it: the worker's clock is its own
            header["budget_s"] = task.load.deadline - time.monotonic()
        if task.lora:
            header["lora"] = choice_header(task.lora)
        if task.strength != 1:
            header["strength"] = task.strength
        if task.negative_prompt is not None:
            header["negative_prompt"] = task.negative_prompt
        if task.guidance is not None:
            header["guidance"] = task.guidance
        blobs = {"mask": task.mask}
        if records or records_beside:
            record.states[worker.name] = "recording"
        if carries_image:
            header["one_off"] = {"steps": record.steps, "guidance": record.guidance} | (
                {"records": True} if records_beside else {})
            blobs["image"] = record.image
        seq = self._send(worker, header, blobs)
        worker.sent_in[pending.request_id] = (seq, time.monotonic())
        if records_beside:  # a recording of its own, which heartbeats report (`_find_lost_recordings`)
            self._recording_sent(worker, record, seq)
            self.counters["one_offs_recorded_beside"] += 1
        # A request sent again (its worker died) starts over: its watchers see it queued, then steps from 1.
        self._tell("request", pending.request_id, {"event": "queued", "worker": worker.name, "attempt": pending.routes,
                                                   "steps": self.denoiser_calls(record.steps, worker.name,
                                                                                task.strength)})

    def _park(self, pending: Pending, record: TemplateRecord) -> None:
        self.parked.setdefault(record.template_id, deque()).append(pending.request_id)
        self._tell("request", pending.request_id, {"event": "parked", "steps": self.denoiser_calls(
            record.steps, strength=pending.task.strength)})

    def _open_workers(self) -> np.ndarray:
        """The live workers that take new edits (not draining)."""
        open_ = np.zeros_like(self.cluster.alive)
        for worker in self.workers.values():
            open_[worker.slot] = not worker.draining
        return open_ & self.cluster.alive

    def _serving_loras(self) -> np.ndarray:
        """The live workers that serve LoRAs (their hello said they have a --lora-dir) and take new edits."""
        serving = np.zeros_like(self.cluster.alive)
        for worker in self.workers.values():
            serving[worker.slot] = worker.info.get("lora") is not False
        return serving & self._open_workers()

    def _without_lora_workers_s(self) -> float:
        """Seconds since a worker that serves LoRAs was last connected, draining ones included (or since the
        router started); 0 while one is."""
        if any(worker.info.get("lora") is not False for worker in self.workers.values()):
            self._lora_workers_since = time.monotonic()
            return 0.0
        return time.monotonic() - self._lora_workers_since

    def _lora_holders(self, choice, eligible: np.ndarray) -> np.ndarray:
        """`policies.prefer_holders` for an edit's adapters: a worker holds what its last heartbeat reported and
        what the edits sent there and not yet answered named (their loads have started)."""
        names = {use.name for use in choice}

        def holds(worker: WorkerState, sent: list[EditTask]) -> bool:
            return names <= set(worker.loras).union(use.name for task in sent for use in task.lora)

        return self._prefer(eligible, holds, self.config.lora_affinity, "lora_affinity")

    def _template_holders(self, template_id: str, eligible: np.ndarray) -> np.ndarray:
        """`policies.prefer_holders` for an edit's template: a worker holds what its last heartbeat reported in
        host memory and the templates of the edits sent there and not yet answered (they bring it there)."""
        def holds(worker: WorkerState, sent: list[EditTask]) -> bool:
            return template_id in worker.cached or any(task.template_id == template_id for task in sent)

        return self._prefer(eligible, holds, self.config.template_affinity, "template_affinity")

    def _prefer(self, eligible: np.ndarray, holds: Callable[[WorkerState, list[EditTask]], bool],
                bound: int | None, event: str) -> np.ndarray:
        """`policies.prefer_holders` over the workers `holds(worker, the edits sent there and not yet answered)`
        says hold what an edit needs; each choice it narrows is counted as `event`."""
        held = np.zeros_like(eligible)
        for worker in self.workers.values():
            sent = [self.pending[request_id].task for request_id in worker.assigned if request_id in self.pending]
            held[worker.slot] = holds(worker, sent)
        preferred = prefer_holders(eligible, held, self.cluster, bound)
        if not np.array_equal(preferred, eligible):  # affinity narrowed the choice
            self.counters[event] += 1
        return preferred

    def _restore_recency(self, ids: list[str]) -> None:
        """`last_used` (this process's clock: not kept) in the order the last router saw edits (`ids`, most
        recent first). Templates it did not list were registered after it kept the order (it died): they
        come first, newest first, as they would have here."""
        listed = list(dict.fromkeys(template_id for template_id in ids if template_id in self.templates))
        kept = set(listed)
        unlisted = sorted((r for r in self.templates.values() if r.template_id not in kept),
                          key=lambda record: record.created, reverse=True)
        now = time.monotonic()
        for rank, template_id in enumerate([r.template_id for r in unlisted] + listed):
            self.templates[template_id].last_used = now - rank * 1e-3

    def _most_recently_edited(self) -> list[TemplateRecord]:
        """The templates, the most recently edited (or registered) first: the order a worker that joins, or
        takes over from one that left, records them in, so that it serves the templates in use first (each
        recording is a generation there, and it may be sent hundreds)."""
        return sorted(self.templates.values(), key=lambda record: record.last_used, reverse=True)

    def _template_json(self, record: TemplateRecord) -> dict:
        return record.to_json(set(self.workers), {name for name, worker in self.workers.items()
                                                  if record.template_id in worker.cached})

    def _slots(self, names) -> np.ndarray:
        """The cluster mask of the live workers among `names`."""
        mask = np.zeros_like(self.cluster.alive)
        for name in names:
            if name in self.workers:
                mask[self.workers[name].slot] = True
        return mask

    def _holders(self, record: TemplateRecord) -> list[str]:
        """Live workers that take new edits where the template is recording or ready (a draining one's
        copy serves no new edit)."""
        return [w for w, state in record.states.items() if state in ("recording", "ready") and w in self.workers
                and not self.workers[w].draining]

    def _recording_ended(self, template_id: str, worker: str | None) -> None:
        """A one-off edit that was recording its template on `worker` ended without it: the next edit
        of the image records it (the parked ones are sent on)."""
        record = self.templates.get(template_id)
        if record is not None and worker is not None and record.states.get(worker) == "recording":
            del record.states[worker]
            record.progress.pop(worker, None)
            self._dispatch_parked(template_id)

    def _dispatch_parked(self, template_id: str) -> None:
        waiting = self.parked.pop(template_id, deque())
        for request_id in waiting:
            pending = self.pending.get(request_id)
            if pending is not None:
                self._route(pending)

    def _fail_parked(self, record: TemplateRecord) -> None:
        for request_id in self.parked.pop(record.template_id, ()):
            self._answer(self.pending[request_id], EditAnswer(
                None, 422, "TemplateFailed", f"template {record.template_id!r} could not be recorded: {record.error}"))

    def _ensure_replicas(self, record: TemplateRecord, bulk: bool | str = False) -> None:
        """Send the template to live workers until it has the replicas it wants (recording or ready).
        A one-off image is recorded by its next edit instead, sent on if it waits. `bulk` (True, or the name of
        the worker that has just said hello): the registration is one of many sent at once (to a worker that
        joined, or taking over from one that left), whose worker records them one at a time and only those its
        caches hold beside each other, leaving the others to their first edit (`Node._start_bulk`)."""
        if record.one_off:
            if self.workers and not self._holders(record) and self.parked.get(record.template_id):
                self._dispatch_parked(record.template_id)
            return
        live = [w for w in self.workers.values() if not w.draining]  # none yet: the first hello records it
        holding = [w for w in live if record.states.get(w.name) in ("recording", "ready")]
        replicas = record.replicas or self.config.template_replicas
        wanted = len(live) if replicas == 0 else min(replicas, len(live))
        holding = [w for w in holding if w.name not in record.added]  # added replicas come and go with load
        candidates = [w for w in live if w.name not in record.states]
        candidates.sort(key=lambda w: self.cluster.in_flight[w.slot])  # the least busy records it
        for worker in candidates[:max(0, wanted - len(holding))]:
            self._send_registration(worker, record, bulk is True or worker.name == bulk)

    def _hurry_bulk(self, record: TemplateRecord) -> None:
        """An edit waits for the template, which workers have queued among their bulk registrations (after a
        takeover, say: it waited for every recording before it there, while other workers idled): sent
        again by name, it is recorded now."""
        for worker in self.workers.values():
            if record.template_id in worker.bulk and next(iter(worker.bulk)) != record.template_id:
                self._send_registration(worker, record, bulk=False)

    def _send_registration(self, worker: WorkerState, record: TemplateRecord, bulk: bool) -> None:
        record.states[worker.name] = "recording"
        seq = self._send(worker, {"kind": "register", "template": record.template_id, "prompt": record.prompt,
                                  "steps": record.steps, "seed": record.seed, "guidance": record.guidance,
                                  **({"negative_prompt": record.negative_prompt} if record.negative_prompt else {}),
                                  **({"bulk": True} if bulk else {})},
                         {"image": record.image})
        self._recording_sent(worker, record, seq, bulk=bulk)

    def _grow_replicas(self, record: TemplateRecord) -> None:
        """With fewer replicas than workers (`RouterConfig.template_replicas`): one more for a template whose own
        edits fill its replicas (more than `template_replicas_grow` of them in flight on each, on average)
        while each of those carries more than that many requests beyond the least loaded other worker, which
        records it (a generation) while this edit goes to a replica. A template edited now and then on a busy
        worker gets none."""
        bound = self.config.template_replicas_grow
        if bound is None or (record.replicas or self.config.template_replicas) == 0:
            return
        holders = np.zeros_like(self.cluster.alive)
        others = self._open_workers().copy()
        own = 0  # its edits in flight on its replicas
        for name, state in record.states.items():
            worker = self.workers.get(name)
            if worker is None:
                continue
            others[worker.slot] = False
            if state in ("recording", "ready") and not worker.draining:
                holders[worker.slot] = True
                own += sum(1 for request_id in worker.assigned if request_id in self.pending
                           and self.pending[request_id].task.template_id == record.template_id)
        if own <= bound * int(holders.sum()):
            return
        slot = replica_to_add(holders, others, self.cluster, bound)
        if slot is None:
            return
        worker = next(w for w in self.workers.values() if w.slot == slot)
        record.added[worker.name] = time.monotonic()
        self.counters["replicas_added"] += 1
        logger.info(f"template {record.template_id}: its edits fill its replicas; worker {worker.name} records it too")
        self._send_registration(worker, record, bulk=False)

    def _drop_idle_replicas(self) -> None:
        """Added replicas that no edit was sent to for REPLICA_IDLE_S are dropped there (replicas the load
        added and never gave back made --template-replicas K every worker, in time)."""
        now = time.monotonic()
        for record in self.templates.values():
            for name, last in list(record.added.items()):
                worker = self.workers.get(name)
                busy = worker is not None and any(
                    request_id in self.pending and self.pending[request_id].task.template_id == record.template_id
                    for request_id in worker.assigned)
                if now - last <= REPLICA_IDLE_S or busy:
                    continue
                del record.added[name]
                record.states.pop(name, None)
                record.progress.pop(name, None)
                self.counters["replicas_removed"] += 1
                if worker is not None:
                    self._recording_over(worker, record.template_id)
                    self._send(worker, {"kind": "drop", "template": record.template_id})
                self._template_changed(record)

    def _recording_sent(self, worker: WorkerState, record: TemplateRecord, seq: int, bulk: bool = False) -> None:
        """The message `seq` asked `worker` to record the template: until it reports the end, its heartbeats
        must say it is under way (`_find_lost_recordings`), and the policies weigh it as a request computing
        every token for all the template's steps (a worker busy recording is not an idle one). Those sent in
        `bulk` it records one at a time: one weighs, the next once that one is over."""
        self._recording_over(worker, record.template_id)  # one sent again after it was lost
        worker.registering.add(record.template_id)
        worker.sent_in[record.template_id] = (seq, time.monotonic())
        if bulk:
            worker.bulk[record.template_id] = None
        if not bulk or len(worker.bulk) == 1:
            self._weigh_recording(worker, record)
        self._template_changed(record)

    def _weigh_recording(self, worker: WorkerState, record: TemplateRecord) -> None:
        width, height = record.size
        tokens = math.ceil(width / TOKEN_SIDE) * math.ceil(height / TOKEN_SIDE)
        self.cluster.assign(worker.slot, _recording_key(worker, record.template_id),
                            RequestLoad(tokens, tokens, record.steps))

    def _recording_over(self, worker: WorkerState, template_id: str) -> None:
        """The worker no longer records the template (reported, lost, or deleted): its load leaves the worker's."""
        worker.registering.discard(template_id)
        worker.missing.pop(template_id, None)
        worker.sent_in.pop(template_id, None)
        key = _recording_key(worker, template_id)
        if self.cluster.holds(worker.slot, key):
            self.cluster.finish(worker.slot, key)
        if template_id in worker.bulk:
            weighed = next(iter(worker.bulk)) == template_id
            del worker.bulk[template_id]
            following = next(iter(worker.bulk), None)
            if weighed and following is not None and following in self.templates:
                self._weigh_recording(worker, self.templates[following])  # the one it records now

    def _remove_worker(self, name: str, why: str) -> None:
        worker = self.workers.pop(name, None)
        if worker is None:
            return
        self.counters["workers_removed"] += 1
        self.cluster.remove_worker(worker.slot)
        if worker.info.get("lora") is not False:
            self._lora_workers_since = time.monotonic()  # served LoRAs until now
        logger.info(f"worker {name} left: {why}; {len(self.workers)} connected")
        if not self.workers:
            self._no_worker_since = time.monotonic()
        for record in self.templates.values():
            record.added.pop(name, None)
            if record.states.pop(name, None) is not None:
                record.progress.pop(name, None)
                self._template_changed(record)
        orphans = sorted(worker.assigned)
        worker.assigned.clear()
        for record in self._most_recently_edited():
            self._ensure_replicas(record, bulk=True)  # its templates, all at once: another worker takes them over
        for request_id in orphans:
            pending = self.pending.get(request_id)
            if pending is not None:
                pending.worker = None
                self._route(pending)
        self._changed.notify_all()

    def _answer(self, pending: Pending, answer: EditAnswer) -> None:
        deadline = pending.task.load.deadline
        if deadline is not None and pending.request_id in self.pending:
            met = answer.status == 200 and time.monotonic() <= deadline
            self._slo_count(pending.task.load, "cancelled" if answer.error == "Cancelled" else
                            "met" if met else "missed")
            answer = replace(answer, metrics={**answer.metrics, "deadline_met": met})
        if self.pending.pop(pending.request_id, None) is not None:
            self._answered.append(time.monotonic())
        self._tell("request", pending.request_id, {"event": "answered", "status": answer.status,
                                                   "error": answer.error, "message": answer.message})
        self._watchers.pop(("request", pending.request_id), None)
        if pending.worker is not None and pending.worker in self.workers:
            self._release(self.workers[pending.worker], pending.request_id)
        if not pending.future.done():
            pending.future.set_result(answer)
        record = self.templates.get(pending.task.template_id)
        if record is not None and record.one_off:  # it may be idle now: one-offs over their bounds go
            self._evict_one_offs(keep="")
        self._changed.notify_all()

    # ---- the socket (router thread) ----

    def _send(self, worker: WorkerState, header: dict, blobs: dict | None = None) -> int:
        """Queue a message to the worker; its number (`seq`), which the worker's heartbeats echo."""
        worker.sent += 1
        self._outgoing.append((worker.identity, wire.encode({**header, "seq": worker.sent}, blobs=blobs)))
        return worker.sent

    def _wake(self) -> None:
        self._wakeup.wake()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._wakeup.socket, zmq.POLLIN)
        tick_ms = max(10, int(self.config.heartbeat_s * 1000 / 2))
        while True:
            events = dict(poller.poll(tick_ms))
            if self._wakeup.socket in events:
                self._wakeup.drain()
            if self.socket in events:
                while self.socket.poll(0):
                    identity, *frames = self.socket.recv_multipart()
                    try:
                        self._on_message(identity, frames)
                    except Exception:  # noqa: BLE001 - a bug handling one message must not stop routing
                        logger.exception("handling a message from %r failed", identity[:64])
            with self._lock:
                self._check_liveness()
                stopped = self._stopped  # read with the swap: what close() queued before stopping goes out
                outgoing, self._outgoing = self._outgoing, deque()
            for identity, frames in outgoing:
                self.socket.send_multipart([identity, *frames])
            if stopped:
                return

    def _check_liveness(self) -> None:
        now = time.monotonic()
        if now >= self._next_idle_check:
            self._next_idle_check = now + 1.0
            self._drop_idle_replicas()
        for name, worker in list(self.workers.items()):
            if now - worker.last_seen > self.config.dead_after_s:
                self._remove_worker(name, f"no heartbeat for {now - worker.last_seen:.1f} s")
                if self.on_worker_lost is not None:
                    self.on_worker_lost(name)
        if self.parked and (idle := self._without_workers_s()) > self.config.no_worker_s:
            for template_id in list(self.parked):
                for request_id in self.parked.pop(template_id):
                    pending = self.pending.get(request_id)
                    if pending is not None:
                        self._answer(pending, EditAnswer(None, 503, NO_WORKER, no_worker_message(idle)))
        if self.parked and self._without_lora_workers_s() > self.config.no_worker_s:
            for template_id, waiting in list(self.parked.items()):
                for request_id in [r for r in waiting if r in self.pending and self.pending[r].task.lora]:
                    waiting.remove(request_id)
                    self._answer(self.pending[request_id], EditAnswer(None, 503, LORA_UNAVAILABLE,
                                                                      no_lora_worker_message()))
                if not waiting:
                    del self.parked[template_id]

    def _without_workers_s(self) -> float:
        """Seconds since the last worker left (or the router started without one); 0 while one is connected."""
        return 0.0 if self._no_worker_since is None else time.monotonic() - self._no_worker_since

    def _on_message(self, identity: bytes, frames: list) -> None:
        try:
            header, _, blobs = wire.decode(frames)
            kind = header["kind"]
            name = header["worker"]
        except (wire.WireError, KeyError, TypeError):
            return  # not one of ours; a router never dies of a peer's message
        with self._lock:
            if kind == "hello":
                self._on_hello(identity, header)
                return
            worker = self.workers.get(name)
            if worker is None or worker.identity != identity:  # removed (presumed dead): it no longer counts
                self.counters["duplicates_dropped"] += kind == "result"
                if kind == "heartbeat":  # alive after all (a network cut healed): it must join again
                    self._outgoing.append((identity, wire.encode({"kind": "rejoin"})))
                return
            worker.last_seen = time.monotonic()
            if "cached" in header:  # heartbeats, answers and recordings' ends say what its host memory holds
                worker.cached = frozenset(header["cached"])
            if kind == "heartbeat":
                self._on_heartbeat(worker, header)
                self._send(worker, {"kind": "alive"})  # a worker hearing nothing presumes the router gone
            elif kind == "result":
                self._on_result(worker, header, blobs)
            elif kind == "template":
                self._on_template(worker, header)
            elif kind == "bye":  # it stopped: whatever it still held goes elsewhere now
                self._remove_worker(name, "it said bye")
            elif kind == "draining":  # stopping: no new work; its heartbeats and answers go on
                self._draining(worker)
            elif kind == "ping":  # everything this worker sent before it has been handled
                self._send(worker, {"kind": "pong"})
            elif kind == "progress" and "request" in header:
                self._on_step(worker, header)
            elif kind == "unrecorded":
                self._on_unrecorded(worker, header)
            elif kind == "progress":
                record = self.templates.get(header["template"])
                if record is not None:  # in the template's steps (a worker counts denoiser calls)
                    calls = int(header.get("steps", record.steps))
                    record.progress[name] = int(header["step"]) * record.steps // max(calls, 1)
                    key = _recording_key(worker, record.template_id)
                    if self.cluster.holds(worker.slot, key):  # it runs (its first step is done)
                        self.cluster.admit(worker.slot, key)
                        self.cluster.advance(worker.slot, key, max(1, record.steps - record.progress[name]))
                    self._template_changed(record)
            elif kind == "preview":
                pending = self.pending.get(header["request"])
                if pending is not None and pending.worker == name and _this_attempt(header, pending):
                    self._tell("request", pending.request_id, {"event": "preview", "step": int(header["step"]),
                                                               "png": blobs.get("png", b"")})

    def _on_unrecorded(self, worker: WorkerState, header: dict) -> None:
        """A one-off edit that was recording its image on `worker` goes on without recording it: the edits
        waiting for that recording go now, without waiting for its answer."""
        pending = self.pending.get(header["request"])
        if (pending is not None and pending.worker == worker.name and _this_attempt(header, pending)
                and pending.records):
            self._recorded_nothing(worker, pending, header.get("reason", "held"))

    def _recorded_nothing(self, worker: WorkerState, pending: Pending, reason: str) -> None:
        """`pending`, which was to record its one-off image on `worker`, records nothing: an image too large for
        the worker's whole host cache is not asked of it again (`TemplateRecord.too_large_for`)."""
        record = self.templates.get(pending.task.template_id)
        pending.records = False
        if record is not None and reason == "too_large":
            record.too_large_for.add(worker.name)
            self.counters["one_offs_too_large"] += 1
        self._recording_ended(pending.task.template_id, worker.name)

    def _on_step(self, worker: WorkerState, header: dict) -> None:
        pending = self.pending.get(header["request"])
        if pending is None or pending.worker != worker.name or not _this_attempt(header, pending):
            return  # answered, or moved elsewhere (to another worker, or sent to this one again): the step is stale
        record = self.templates.get(pending.task.template_id)
        # Denoiser calls, as the worker counts them (a second-order sampler makes two a step).
        steps = int(header.get("steps", record.steps if record is not None else header["step"]))
        pending.calls, pending.steps_left = steps, steps - int(header["step"])
        self._tell("request", pending.request_id, {"event": "step", "step": int(header["step"]), "steps": steps})

    def _goodbye(self, hello: dict) -> str:
        """What a closing router tells a worker: one started on its own outlives the server (closing), one
        of its supervisor stops."""
        return "closing" if hello.get("supervised") is False else "stop"

    def _on_hello(self, identity: bytes, header: dict) -> None:
        name = header["worker"]
        if self._said_goodbye:  # told it is closing, a worker on its own says hello again at once
            self._outgoing.append((identity, wire.encode({"kind": self._goodbye(header)})))
            return
        known = self.workers.get(name)
        if known is not None and known.identity == identity and known.info.get("boot") == header.get("boot"):
            # the same process again (its welcome lost); a restart in the same pod may reuse name and pid
            known.last_seen = time.monotonic()
            self._send(known, self._welcome())
            return
        if known is not None and known.identity != identity and time.monotonic() - known.last_seen < \
                self.config.dead_after_s:
            # Another live process under this name (two workers given one --name): taking it for a restart
            # removed the first, whose next heartbeat rejoined it and removed the second, twice a second, each
            # time sending their edits elsewhere. The name stays its holder's until that one is presumed
            # dead; the other is told so at each of its hellos, and joins then (a restart that came fast).
            self.counters["worker_names_taken"] += 1  # hellos refused so
            if (name, identity) not in self._name_taken_said:
                self._name_taken_said.add((name, identity))
                logger.warning(f"a second worker named {name} (pid {header.get('pid')}) said hello while worker "
                               f"{name} (pid {known.pid}) is alive: it waits until that one is gone; give each "
                               "worker its own --name")
            self._outgoing.append((identity, wire.encode({"kind": "name_taken", "pid": known.pid})))
            return
        refusal = self._refusal(header)
        if refusal is not None:
            self.counters["workers_mismatched"] += 1
            self._outgoing.append((identity, wire.encode({"kind": "refused", "reason": refusal})))
            logger.warning(f"worker {name} refused: {refusal}")
            return
        if known is not None:
            self._remove_worker(name, "it said hello again (restarted)")
        slot = self.cluster.add_worker(int(header["max_batch"]))
        info = {key: header.get(key)
                for key in ("model", "dtype", "weights", "scheduler", "supervised", "lora", "boot", "family",
                            "cache_dtype")}
        calls = header.get("calls")
        info["calls"] = [int(calls[0]), int(calls[1])] if isinstance(calls, list) and len(calls) == 2 else None
        info["scheduler_id"] = header.get("scheduler_id")
        worker = WorkerState(name, identity, slot, int(header.get("pid", 0)), time.monotonic(), info=info)
        others = [other for other in self.workers.values() if other.info.get("weights") != info["weights"]]
        self.workers[name] = worker
        self._no_worker_since = None
        sampler = f", {info['scheduler']}" if info["scheduler"] else ""
        logger.info(f"worker {name} joined (pid {worker.pid}{sampler}); {len(self.workers)} connected")
        if others and info["weights"] is not None:  # a rolling update does this for a while; say so
            other = others[0]
            samplers = (info["scheduler_id"], other.info.get("scheduler_id"))
            if None not in samplers and samplers[0] != samplers[1]:
                what = (f"another scheduler ({info['scheduler']}) than worker {other.name} "
                        f"({other.info.get('scheduler')})")
            elif info["dtype"] != other.info.get("dtype"):
                what = f"another dtype ({info['dtype']}) than worker {other.name} ({other.info.get('dtype')})"
            elif None not in samplers:
                what = f"other weights than worker {other.name}"
            else:  # a worker that does not say its sampler
                what = f"other weights, scheduler or dtype than worker {other.name}"
            logger.warning(f"worker {name} runs {what}: an edit's image depends on which of them runs it")
        stores = [other for other in self.workers.values() if other is not worker and None not in (
            info["cache_dtype"], other.info.get("cache_dtype")) and other.info["cache_dtype"] != info["cache_dtype"]]
        if stores:  # the same weights, but cached activations kept in another (lossy) format: other pixels
            logger.warning(f"worker {name} stores cached activations as {info['cache_dtype']}, worker "
                           f"{stores[0].name} as {stores[0].info['cache_dtype']} (--cache-dtype): an edit's image "
                           "depends on which of them runs it")
        self._send(worker, self._welcome())
        if header.get("draining"):  # joined (a new head) while stopping: it only finishes what it holds
            self._draining(worker)
        elif info["lora"] is not False:  # LoRA edits that waited for a worker that serves them
            for template_id in list(self.parked):
                self._dispatch_parked(template_id)
        for template_id in header.get("templates", ()):  # recorded before it (re)joined: ready there
            record = self.templates.get(template_id)
            if record is None and template_id in self._dropped:  # deleted (or evicted) while it was away
                self._send(worker, {"kind": "drop", "template": template_id})
            if record is not None:
                record.states[name] = "ready"
                record.progress[name] = record.steps
                self._template_changed(record)
                self._dispatch_parked(template_id)
        on_disk = set(header.get("on_disk", ()))
        for record in self._most_recently_edited():
            if record.template_id in on_disk and name not in record.states and not (record.one_off or worker.draining):
                # its disk tier holds the recording (a restarted worker's): adopted there at the cost of a
                # file's header, it is one more replica (the first worker to say hello took them all)
                self._send_registration(worker, record, bulk=True)
            self._ensure_replicas(record, bulk=name)
        self._changed.notify_all()

    def _draining(self, worker: WorkerState) -> None:
        """The worker stops (it said so, in a message, a heartbeat, its hello or an answer): it gets nothing
        new; what only it held is recorded elsewhere, and what waited for it goes on now."""
        if worker.draining:
            return
        worker.draining = True
        recording = sum(1 for record in self.templates.values() if record.states.get(worker.name) == "recording")
        logger.info(f"worker {worker.name} is draining: it finishes its {len(worker.assigned)} edits and "
                    f"{recording} recordings")
        for record in self._most_recently_edited():
            if worker.name in record.states:
                self._ensure_replicas(record, bulk=True)
                self._dispatch_parked(record.template_id)

    def _welcome(self) -> dict:
        return {"kind": "welcome", "heartbeat_s": self.config.heartbeat_s, "dead_after_s": self.config.dead_after_s,
                "session": self.session}

    def _refusal(self, header: dict) -> str | None:
        """Why a worker saying `header` must not serve here, or None."""
        protocol = header.get("protocol")
        if protocol != wire.PROTOCOL:
            spoken = (f"protocol {protocol}" if protocol is not None
                      else "no protocol (a release from before protocol numbers)")
            return (f"it speaks {spoken}, this server protocol {wire.PROTOCOL}: run the same retouch release "
                    "on the head and the workers")
        model = header.get("model")
        if self.config.model is not None and (model is None or model_label(model) != self.config.model):
            return f"it serves the model {model_label(model or '?')!r}, this server {self.config.model!r}"
        return None

    def _on_heartbeat(self, worker: WorkerState, header: dict) -> None:
        for request_id, steps_left in header.get("running", []):
            if request_id in worker.assigned:
                self.cluster.admit(worker.slot, request_id)
                self.cluster.advance(worker.slot, request_id, int(steps_left))
                self.pending[request_id].steps_left = int(steps_left)
        worker.report = dict(header.get("metrics", {}))
        worker.loras = frozenset(header.get("loras", ()))
        if "lora_digests" in header:
            digests = {str(name): str(digest) for name, digest in dict(header["lora_digests"]).items()}
            read = {name: digest for name, digest in digests.items() if worker.lora_digests.get(name) != digest}
            worker.lora_digests = digests
            self._check_lora_files(worker, read)
        if header.get("draining"):  # said in every heartbeat: a lost "draining" message is not missed
            self._draining(worker)
        seen = header.get("seen")
        if "held" in header:
            self._find_lost(worker, set(header["held"]), seen)
            self._drop_stale(worker, set(header["held"]))
        if "recording" in header:
            self._find_lost_recordings(worker, set(header["recording"]), seen)
        self._changed.notify_all()

    def _check_lora_files(self, worker: WorkerState, read: dict[str, str]) -> None:
        """Workers whose LoRA folders hold other files under one name give an edit of it another image
        depending on where it runs (a folder copied to some hosts only, or mid-copy): said once per name and
        pair of files, and counted (`lora_mismatches`). `read`: the worker's files new since its last
        heartbeat, the only ones to compare (every heartbeat repeats the rest, and a mismatch appears when
        one side's file does)."""
        for name, digest in read.items():
            for other in self.workers.values():
                theirs = other.lora_digests.get(name)
                if other is worker or theirs is None or theirs == digest:
                    continue
                pair = (name, *sorted((digest, theirs)))
                if pair not in self._lora_mismatches:
                    self._lora_mismatches.add(pair)
                    self.counters["lora_mismatches"] += 1
                    logger.warning(f"LoRA {name!r} differs between worker {worker.name} (file digest "
                                    f"{digest}) and worker {other.name} ({theirs}): its edits' images depend on "
                                    "which worker runs them; give every worker's --lora-dir the same files")

    def _overdue(self, worker: WorkerState, key: int | str, there: bool, seen: int | None, now: float) -> bool:
        """Whether an edit (by request id) or a template (by id) sent to the worker is lost on the way: its
        heartbeats have lacked it for `dead_after_s` although they saw the message that carried it (a link
        that dropped and came back before the worker was presumed dead loses what was in flight). A message
        still on its way (a large image over a slow link) is not lost, for up to `transfer_timeout_s`.
        `seen`: None from a worker that does not echo message numbers; one above the last number sent is
        from before this router numbered its messages (a heartbeat sent before its welcome)."""
        seq, sent_at = worker.sent_in.get(key, (0, now))
        on_its_way = (seen is not None and seq > int(seen) and int(seen) <= worker.sent
                      and now - sent_at < self.config.transfer_timeout_s)
        if there or on_its_way:
            worker.missing.pop(key, None)
            return False
        if now - worker.missing.setdefault(key, now) <= self.config.dead_after_s:
            return False
        worker.missing.pop(key)
        worker.sent_in.pop(key, None)
        return True

    def _find_lost_recordings(self, worker: WorkerState, recording: set[str], seen: int | None) -> None:
        """Templates sent to the worker to record that were lost on the way (`_overdue`) are sent again.
        A one-off's recording rides on its edit (`_find_lost`)."""
        now = time.monotonic()
        for template_id in list(worker.registering):
            record = self.templates.get(template_id)
            if record is None or record.states.get(worker.name) != "recording":  # deleted, or it reported
                self._recording_over(worker, template_id)
            elif self._overdue(worker, template_id, template_id in recording, seen, now):
                bulk = template_id in worker.bulk  # sent again as it was sent
                self._recording_over(worker, template_id)
                self.counters["lost_recordings"] += 1
                del record.states[worker.name]
                record.progress.pop(worker.name, None)
                self._ensure_replicas(record, bulk=bulk)

    def _find_lost(self, worker: WorkerState, held: set[int], seen: int | None) -> None:
        """Edits sent to the worker that were lost on the way (`_overdue`) go elsewhere."""
        now = time.monotonic()
        for request_id in list(worker.assigned):
            if self._overdue(worker, request_id, request_id in held, seen, now):
                self.counters["lost_requests"] += 1
                pending = self.pending.get(request_id)
                if pending is None:
                    self._release(worker, request_id)
                else:
                    self._take_back(worker, pending)
                    self._route(pending)

    def _drop_stale(self, worker: WorkerState, held: set[int]) -> None:
        """Edits the worker holds that are not its own (it was presumed dead and they went elsewhere, or it
        came back after a pause longer than `dead_after_s`) are cancelled there: it would compute them for
        nobody, its answers dropped as duplicates. Told once each."""
        # Still waiting for an answer, from another worker: not one answered meanwhile (a heartbeat built
        # before its result, or that crossed a client's cancel), which its worker is done with anyway.
        stale = {request_id for request_id in held
                 if request_id in self.pending and self.pending[request_id].worker != worker.name}
        for request_id in stale - worker.dropping:
            self._send(worker, {"kind": "cancel", "request": request_id})
            self.counters["stale_edits_dropped"] += 1
        worker.dropping = stale

    def _release(self, worker: WorkerState, request_id: int) -> None:
        """The worker no longer holds the edit (answered, or taken back): its load leaves the worker's."""
        worker.assigned.discard(request_id)
        worker.missing.pop(request_id, None)
        worker.sent_in.pop(request_id, None)
        self.cluster.finish(worker.slot, request_id)

    def _take_back(self, worker: WorkerState, pending: Pending) -> None:
        """The edit is no longer the worker's (lost, refused, or the worker is stopping): its load leaves the
        worker's, and a recording it was making of its one-off image is no longer under way."""
        self._release(worker, pending.request_id)
        pending.worker = None
        if pending.records:
            pending.records = False
            self._recording_ended(pending.task.template_id, worker.name)

    def _on_result(self, worker: WorkerState, header: dict, blobs: dict) -> None:
        pending = self.pending.get(header["request"])
        if pending is None and header.get("error") == "Cancelled":
            return  # answered when it was cancelled
        if pending is None or pending.worker != worker.name or not _this_attempt(header, pending):
            self.counters["duplicates_dropped"] += 1
            return
        # lost it (restart race, or a delete dropped it while the edit waited there: `_route` answers 404
        # template_deleted, or runs it again if the template was registered again), stopping, or cancelled
        # by a stale-edit cancel sent before the edit came back to this worker (`_drop_stale`; the router's
        # own cancels answer the edit first)
        if header.get("error") in ("MissingTemplate", "WorkerDraining", "Cancelled"):
            record = self.templates.get(pending.task.template_id)
            if header["error"] == "WorkerDraining":
                self._draining(worker)
            elif header["error"] == "MissingTemplate" and record is not None:
                record.states.pop(worker.name, None)
            self._take_back(worker, pending)
            self._route(pending)
            return
        if pending.records and header.get("unrecorded") is not None:  # its early word was lost or overtaken
            self._recorded_nothing(worker, pending, header["unrecorded"])
        self._answer(pending, EditAnswer(blobs.get("png"), int(header.get("status", 200)), header.get("error"),
                                         header.get("message"), worker.name, header.get("metrics", {})))
        if pending.records:  # recorded (the template message came first), or failed without it
            self._recording_ended(pending.task.template_id, worker.name)

    def _on_template(self, worker: WorkerState, header: dict) -> None:
        self._recording_over(worker, header["template"])
        record = self.templates.get(header["template"])
        if record is None:
            self._send(worker, {"kind": "drop", "template": header["template"]})  # deleted meanwhile
            return
        self._changed.notify_all()
        if header.get("draining"):  # asked to record while stopping: not a failure of the template
            record.states.pop(worker.name, None)
            record.progress.pop(worker.name, None)
            self._draining(worker)
            return
        if header.get("ok"):
            record.states[worker.name] = "ready"
            record.progress[worker.name] = record.steps
            self._template_changed(record)
            self._dispatch_parked(record.template_id)
            return
        if record.added.pop(worker.name, None) is not None:  # a replica its load asked for: not the template's fault
            record.states.pop(worker.name, None)
            record.progress.pop(worker.name, None)
            logger.info(f"template {record.template_id}: worker {worker.name} could not record it as another "
                        f"replica: {header.get('message', 'recording failed')}")
            self._template_changed(record)
            return
        record.states[worker.name] = "failed"
        record.error = header.get("message", "recording failed")
        self._ensure_replicas(record)
        self._template_changed(record)
        if record.status == "failed":
            self._fail_parked(record)
