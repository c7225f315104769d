"""The step loop: continuous batching at denoising-step granularity (paper §4.3, Fig. 10).

One thread owns the model and the running batch and repeats, top to bottom:

    receive   new requests and ready (pre-processed) ones; block only when there is nothing to run
    admit     cancelled requests leave; waiting ones join the running batch, up to `max_batch`
              (static: only into an empty one), least slack first (`Worker.next_waiting`)
    step      one denoising step of the whole ragged batch: each request at its own step of its own
              schedule with its own mask, in one mask-aware forward (planned per forward) -- requests of
              different image sizes too for Flux and SD3 (image tokens packed, `recipes.denoise_mixed_step`);
              UNets run one forward per size
    retire    requests whose schedule is done leave at once; their latents go to post-processing

A template's recording is a request like an edit (`Job.recording`): it joins the batch at the next
step, its rows compute every token and write the cache beside the edits' mask-aware rows in the same
forward, and it leaves when its schedule is done; the loop never stops for it. A one-off edit of an
image nobody recorded is such a recording that also answers: its result is the stock pipeline's.
Any request can be cancelled (`Future.cancel()`): it leaves the batch before the next step, and a
cancelled recording frees what it wrote.

Deadlines (SLOs, after PatchedServe's SLO-aware scheduling): an edit may carry a deadline
(`Job.deadline`, this process's `metrics.now()` clock). While any waiting request has one, the queue
is admitted by slack -- deadline - now - predicted remaining time (`predict_s(job)`: by default its
steps x the loop's measured mean step time) -- and requests without a deadline (recordings among
them) follow in arrival order. Without deadlines the queue is FIFO, as it always was.

Batching modes (one switch, for the ablation):
    static   a batch runs to completion before the next is admitted; pre/post-processing inline
    naive    continuous; pre/post-processing inline, so the loop stalls while it runs
    disagg   continuous; pre/post-processing in helper processes (`retouch.engine.processing`)
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import torch
from PIL import Image

from retouch.cache import ActivationCache, CacheFull
from retouch.cache.keys import stored_key
from retouch.cache.staging import StagedActivations
from retouch.editor import EditRequest, MaskAwareEditor, Template
from retouch.engine import recipes
from retouch.engine.metrics import RequestMetrics, WorkerMetrics, now
from retouch.engine.processing import ReadyEdit, postprocess, prepare_recording, preprocess
from retouch.engine.previews import LatentPreviewer
from retouch.engine.policies import denoiser_calls
from retouch.engine.schedulers import BatchScheduler
from retouch.errors import InputError, RetouchError
from retouch.models.samplers import calls_line
from retouch.strength import steps_run
from retouch.lora import LoraChoice, LoraError
from retouch.lora.layers import AmbiguousRows, EntryAdapters
from retouch.lora.manager import LoraManager
from retouch.lora.text_encoders import TextEncoderLoras

MODES = ("static", "naive", "disagg")
MEMORY_RETRIES = 3  # restarts of a registration whose host cache was held by templates in use
logger = logging.getLogger("retouch.worker")


class MissingTemplate(InputError):
    """The edit's template was dropped (deleted) before the edit ran. The router knows the name: it answers
    404 template_deleted, or runs the edit again where the template is registered anew."""


@dataclass(frozen=True)
class EngineConfig:
    mode: str = "disagg"
    max_batch: int = 8  # requests per step (a guided request is two denoiser rows)
    # Batch slots registrations leave to edits: a burst of registrations would otherwise fill the batch, and
    # an edit arriving after it wait a whole generation for a slot. None: a quarter of max_batch.
    edit_slots: int | None = None
    helpers: int = 1  # pre/post-processing processes of the disaggregated mode
    helper_threads: int = 0  # torch CPU threads of each helper (0: torch's default); 1 keeps them off the loop's cores
    run_dir: str | None = None  # where the helpers' socket folder goes (default: the system's temporary folder)
    helper_silence_s: float = 30.0  # a helper silent this long (stopped, frozen) is killed and replaced
    mixed_sizes: bool = True  # Flux/SD3: requests of different image sizes share one forward (False: one per size)
    lora_dir: str | None = None  # the folder of LoRA files requests name (`retouch.lora.files`); None: no LoRA
    lora_cache_mb: float = 2048.0  # host memory of the LRU cache of loaded LoRAs
    lora_device_mb: float | None = None  # device memory of LoRA copies kept for later requests (None: lora_cache_mb)
    # A request's LoRA applies from the first step after it is loaded, at the latest before this fraction
    # of its steps (it waits there if still loading); 0: before its first step (synchronous loading).
    lora_latest_step: float = 0.3

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"batching mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for name, least in (("max_batch", 1), ("helpers", 1 if self.mode == "disagg" else 0), ("helper_threads", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")
        if self.edit_slots is not None and not (isinstance(self.edit_slots, int)
                                                and 0 <= self.edit_slots < self.max_batch):
            raise ValueError(f"edit_slots must be a whole number from 0 to max_batch - 1 ({self.max_batch - 1}), "
                             f"got {self.edit_slots!r}")
        if not (math.isfinite(self.helper_silence_s) and self.helper_silence_s > 0):
            raise ValueError(f"helper_silence_s must be a finite number > 0, got {self.helper_silence_s}")
        for name in ("lora_cache_mb", "lora_device_mb"):
            mb = getattr(self, name)
            if mb is not None and not (math.isfinite(mb) and int(mb * 2**20) >= 1):
                raise ValueError(f"{name} must be a finite number of at least one byte, got {mb!r}")
        if not 0.0 <= self.lora_latest_step <= 1.0:
            raise ValueError(f"lora_latest_step must be in [0, 1], got {self.lora_latest_step}")


@dataclass(frozen=True)
class EditResult:
    image: Image.Image
    metrics: RequestMetrics
    recorded: str | None = None  # the template this request recorded as it ran (a one-off's first edit)
    # A one-off edit that was to record its image and could not: "too_large" (more than the whole host
    # cache) or "held" (other requests' templates held the memory); None otherwise.
    unrecorded: str | None = None


@dataclass(frozen=True)
class StepWatch:
    """A request's progress as it denoises: `on_step(k, n)` after its step k of n (1..n, each once; n
    counts denoiser calls, which is `steps` for most samplers, one more for PNDM, about twice as many
    for second-order ones such as Heun's); with
    `preview_every`, `on_preview(k, image)` after every that many steps before the last (a linear
    latent->RGB picture of its latents, `retouch.previews`: no decoder runs). A one-off edit that was to
    record its image and cannot goes on unrecorded, and says why at once: `on_unrecorded(reason)`
    (`EditResult.unrecorded`)."""

    on_step: Callable[[int, int], None] | None = None
    preview_every: int = 0
    on_preview: Callable[[int, Image.Image], None] | None = None
    on_unrecorded: Callable[[str], None] | None = None

    def __post_init__(self):
        if self.preview_every < 0:
            raise ValueError(f"preview_every must be >= 0, got {self.preview_every}")


@dataclass(eq=False)
class Job:
    """A request on its way through the engine: an edit (`request`), a template's recording
    (`recording`, no request: its result is the template id), or both (a one-off edit that records).

    records:  with `recording`, whether its rows write the cache (False: a one-off edit computed in
              full while another request records the same image)
    watch:    what its owner is told as it denoises (`StepWatch`): each step, and previews
    deadline: when it should be answered (`metrics.now()` clock); None: no SLO
    lora:     its LoRA adapters (`retouch.lora.LoraChoice`); () for none
    """

    id: int
    request: EditRequest | None
    recording: Template | None = None
    records: bool = True
    watch: StepWatch | None = None
    deadline: float | None = None
    lora: LoraChoice = ()
    future: Future = field(default_factory=Future)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    ready: ReadyEdit | None = None
    row: recipes.Running | None = None
    handles: dict = field(default_factory=dict)
    lora_loads: list[Future] = field(default_factory=list)  # its adapters' loads (`LoraManager.acquire`)
    lora_entry: EntryAdapters = ()  # what its rows bind, from the step its LoRA applies
    template_load: Future | None = None  # its template's read from disk (`MaskAwareEditor.prefetch`)
    # A registration restarted because templates in use held the host memory its recording needed: how
    # many times, and the count of jobs that had left the batch then (it waits for one more to leave).
    memory_retries: int = 0
    waits_for_departures: int | None = None
    unrecorded: str | None = None  # why a one-off edit that was to record its image did not (`EditResult`)
    # The recording of its template that an edit which found the template lost waited for (`Worker.admit`):
    # once it has ended, recorded or not, the edit goes on to `acquire`, and never starts another.
    waited_for: Job | None = None

    @property
    def strength(self) -> float:
        """Its edit's (`retouch.strength`); a recording's is 1: it runs every step."""
        return self.request.strength if self.request is not None else 1.0

    def lora_latest_step(self, fraction: float) -> int:
        """The step (0-based) from which its LoRA must apply: it waits there while still loading. A step of
        the whole schedule: a LoRA is imperceptible in its noisiest steps only, so an edit below strength 1
        that starts past them waits for its LoRA at its first step."""
        return math.floor(fraction * self.row.schedule.num_steps + 1e-9)

    @property
    def template(self) -> Template:
        return self.ready.inputs.template if self.ready is not None else self.recording

    @property
    def writes_cache(self) -> bool:
        return self.recording is not None and self.records

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            try:
                self.future.set_exception(exc)
            except InvalidStateError:  # cancelled meanwhile (another thread)
                pass


def non_finite_error(job: Job) -> Exception:
    """The error of an edit whose latents came out NaN or infinite: its LoRA's, when it names one (an
    adapter whose weights or scale overflow; 422), else the model's (500)."""
    if job.lora:
        names = ", ".join(f"{use.name}:{use.scale:g}" for use in job.lora)
        return LoraError(f"the edit's values overflowed (NaN or infinite) with LoRA {names}: the adapter's "
                         "weights, or its scale, are too large")
    return RuntimeError("the model's values overflowed (NaN or infinite) in this edit")


class RecordingWrites(ActivationCache):
    """Where a forward's recording rows write: the editor's cache, except that one recording's failure
    (its step does not fit the host budget, say) is kept for the loop to fail that request alone,
    instead of failing the whole forward and every edit beside it."""

    def __init__(self, cache: ActivationCache):
        self.cache = cache
        self.failures: dict[str, BaseException] = {}

    def put(self, template_id, step, block, name, tensor):
        base, _ = stored_key(template_id, "")
        if base in self.failures:
            return
        try:
            self.cache.put(template_id, step, block, name, tensor)
        except Exception as exc:  # noqa: BLE001 - handed to the loop, which fails that request
            self.failures[base] = exc

    def get(self, template_id, step, block, name):
        return self.cache.get(template_id, step, block, name)

    def contains(self, template_id):
        return self.cache.contains(template_id)

    def drop(self, template_id):
        self.cache.drop(template_id)

    def nbytes(self, template_id=None):
        return self.cache.nbytes(template_id)


class Worker:
    """The loop; `inbox` takes ("edit", job) (not yet pre-processed), ("ready", job), ("call", fn,
    future) (run fn on the loop thread, between steps) and ("stop",)."""

    _ids = itertools.count()

    def __init__(self, editor: MaskAwareEditor, config: EngineConfig,
                 send_to_postprocess: Callable[[Job], None] | None = None,
                 predict_s: Callable[[Job], float] | None = None,
                 send_to_prepare: Callable[[Job], None] | None = None,
                 recording_of: Callable[[str, Callable[[], Job]], Job] | None = None):
        """`predict_s(job)`: seconds the job still needs once admitted, for slack ordering (default:
        `predicted_s`, its steps x the measured mean step time). `send_to_prepare(job)`: prepares a recording
        the loop starts itself (a lost template's) elsewhere, the job coming back to the inbox as "ready"
        (the disaggregated mode's helpers); None: on the loop thread. `recording_of(template_id, make)`: the
        recording of the template already under way (a registration, a one-off image's first edit), else
        `make()`, known as the template's recording from then on (`Engine._recordings`): two recordings of
        one template in a batch write over each other, and both fail."""
        self.editor = editor
        self.config = config
        self.scheduler = BatchScheduler.for_scheduler(editor.pipe.scheduler)
        self._calls = calls_line(self.scheduler.template) or (1, 0)  # denoiser calls of n steps (`_steps_of`)
        self.send_to_postprocess = send_to_postprocess
        self.send_to_prepare = send_to_prepare
        self.recording_of = recording_of
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.metrics = WorkerMetrics()
        self._counts_lock = threading.Lock()  # answers and failures are counted on helpers' receiver threads too
        self.stopping = False
        self._forward_s = self._inline_s = 0.0
        self._previewer: LatentPreviewer | None = None
        self.predict_s = predict_s or self.predicted_s
        self.loras = LoraManager(config.lora_dir, int(config.lora_cache_mb * 2**20), editor,
                                 None if config.lora_device_mb is None else int(config.lora_device_mb * 2**20))
        # Prompts encoded here (no helpers) apply the text-encoder parts of the same files.
        self.text_encoder_loras = TextEncoderLoras(config.lora_dir, editor.pipe) if config.lora_dir else None
        self._recording_again: dict[str, Job] = {}  # template id -> its recording, for the edits that found it lost

    @classmethod
    def new_job(cls, request: EditRequest | None, recording: Template | None = None, records: bool = True,
                watch: StepWatch | None = None, deadline: float | None = None, lora: LoraChoice = ()) -> Job:
        job = Job(next(cls._ids), request, recording, records, watch, deadline, lora)
        job.metrics.deadline = deadline
        return job

    # ---- the loop ----

    def run(self) -> None:
        with torch.inference_mode():
            while self.receive():
                started = now()
                self._forward_s = self._inline_s = 0.0
                self.drop_cancelled()
                self.admit()
                if not self.running:
                    continue
                batch_size = len(self.running)
                if not self.step():  # every running request waited for its LoRA
                    continue
                self.retire()
                self.metrics.record_step(batch_size, now() - started, self._forward_s, self._inline_s)

    def receive(self) -> bool:
        """Take everything in the inbox, blocking while there is nothing to run; False once stopped
        and drained (every accepted request answered)."""
        while True:
            if not self.running and not self.waiting and self.stopping:
                return False
            idle = not self.running and all(map(self._waits_elsewhere, self.waiting))
            try:
                message = self.inbox.get(block=idle)
            except queue.Empty:
                return True
            kind = message[0]
            if kind == "ready" and self._records_again(message[1]):
                self.waiting.appendleft(message[1])  # the edits that found its template lost wait for it
            elif kind in ("edit", "ready"):
                self.waiting.append(message[1])
            elif kind == "call":
                self._call(message[1], message[2])
            elif kind == "stop":
                self.stopping = True

    def drop_cancelled(self) -> None:
        """Requests whose future was cancelled leave now, freeing their slot (and, for a recording,
        the steps it wrote); nothing else in the batch changes."""
        for queue_ in (self.waiting, self.running):
            for job in [job for job in queue_ if job.future.cancelled()]:
                queue_.remove(job)
                self._release(job)
                if job.writes_cache and job.row is not None:
                    self.editor.abort_recording(job.recording.template_id)
                self.metrics.cancelled += 1

    def admit(self) -> None:
        if self.config.mode == "static" and self.running:
            return
        loading = []  # jobs whose template is still being read from disk: admitted at a later step
        try:
            while self.waiting and len(self.running) < self.config.max_batch:
                job = self.next_waiting()
                if self._is_registration(job) and sum(map(self._is_registration, self.running)) >= \
                        self.registration_slots:
                    loading.append(job)  # the rest of the batch is the edits'
                    continue
                still_loading = job.template_load is not None and not job.template_load.done()
                if still_loading and (self.running or self.waiting):
                    loading.append(job)
                    continue
                if job.waits_for_departures is not None:
                    if self.running and self._departures() == job.waits_for_departures:
                        loading.append(job)  # the memory it needs is still held: no one has left since
                        continue
                    job.waits_for_departures = None
                if job.ready is None:  # static and naive: pre-processing inline
                    ready = self._inline(lambda: self._prepare(job), job)
                    if ready is None:
                        continue
                    job.ready = ready
                if job.recording is None and self._dropped(job):
                    continue
                if job.recording is None and self._waits_for_recording(job):
                    loading.append(job)
                    continue
                if job.ready is None:  # prepared again after its wait, and that failed (`_waits_for_recording`)
                    continue
                try:
                    self.scheduler.admit(job.ready.prepared.schedule, self.editor.device)
                    if job.recording is not None:
                        if job.writes_cache:
                            self.editor.begin_recording(job.recording)
                    else:
                        recomputes = self.editor.recomputes
                        job.handles = self.editor.acquire([job.template])
                        if self.editor.recomputes != recomputes and self._mid_denoising():
                            self.metrics.interruptions += 1  # the template was lost and recorded again
                except CacheFull:
                    if self.running:  # host memory is held by the running batch: wait for it to shrink
                        self.waiting.appendleft(job)
                        return
                    self._fail(job, RetouchError("the template's activations do not fit the host cache"))
                    continue
                except Exception as exc:
                    self._fail(job, exc)
                    continue
                job.row = recipes.Running(job.ready.prepared, job.ready.prepared.latents)
                if job.lora:
                    job.lora_loads = self.loras.acquire(job.lora)
                job.metrics.tokens = self.editor.num_tokens(job.template)
                job.metrics.computed_tokens = len(job.ready.inputs.masked_idx)
                job.metrics.admitted = now()
                job.metrics.admitted_step = self.metrics.steps
                self.running.append(job)
        finally:
            self.waiting.extendleft(reversed(loading))  # first in line again, in their order

    def _dropped(self, job: Job) -> bool:
        """Whether the edit's template was dropped (deleted) after the edit was prepared: it fails with
        MissingTemplate, which the router answers, rather than record a deleted template again."""
        template = job.template
        if template.one_off or template.template_id in self.editor.templates:
            return False
        self._fail(job, MissingTemplate(f"template {job.request.template_id!r} was dropped before the edit ran"))
        return True

    def _waits_for_recording(self, job: Job) -> bool:
        """Whether the edit waits for its template to be recorded again, as a job of the batch: the store lost
        it (`MaskAwareEditor.lost`: evicted without a disk tier). `acquire` would record it inline, holding
        every running request for a whole generation. The first edit to find it lost starts the recording,
        at the head of the queue with the edit's deadline, and the others of it wait for the same one. Once it
        has ended, recorded or not (failed, cancelled by a drop), the edit goes on to `acquire`, which finds
        it, records it inline, or says why it cannot. The recording is prepared by `send_to_prepare` where
        there is one (the helpers): its text encoding then does not hold the batch either."""
        if job.waited_for is not None:
            if not job.waited_for.future.done():
                return True
            self._prepared_for(job)
            return False
        template_id = job.request.template_id
        recording = self._recording_again.get(template_id)
        if recording is None:
            if self.config.mode == "static" or not self.editor.lost(job.template):
                return False
            made = []

            def make() -> Job:
                made.append(self.new_job(None, self.editor.to_record_again(job.template, missed=True),
                                         deadline=job.deadline))
                return made[0]

            recording = make() if self.recording_of is None else self.recording_of(template_id, make)
            # else under way already (a registration, a one-off's first edit): the edit waits for that one
            if made and not self._record_again(recording, template_id, job):
                return False
        if recording.request is None and job.deadline is not None and (
                recording.deadline is None or job.deadline < recording.deadline):
            recording.deadline = job.deadline  # queued by the most urgent of the edits that wait for it
        job.waited_for = recording
        return True

    def _record_again(self, recording: Job, template_id: str, job: Job) -> bool:
        """Start `recording`, of the template that edit `job` found lost, as a member of the batch; False when
        its preparation on the loop failed."""
        if self.send_to_prepare is None:
            recording.ready = self._inline(lambda: self._prepare(recording), recording)
            if recording.ready is None:
                return False
        self._recording_again[template_id] = recording

        def ended(_) -> None:  # recorded, failed or cancelled (a helper's failure: on its thread)
            if self._recording_again.get(template_id) is recording:
                del self._recording_again[template_id]
            self.inbox.put(("wake",))  # a loop idle until it came back (`_waits_elsewhere`) admits its edits

        recording.future.add_done_callback(ended)
        if self.send_to_prepare is None:
            self.waiting.appendleft(recording)
        else:
            try:
                self.send_to_prepare(recording)
            except Exception as exc:  # noqa: BLE001 - it fails alone; its edits go on to `acquire`
                self._fail(recording, exc)
        logger.info("template %s is in no cache tier any more: recorded again beside the batch, for edit %d",
                    template_id, job.id)
        return True

    def _prepared_for(self, job: Job) -> None:
        """After the recording its edit waited for: an edit prepared for another recording of the template
        than the one now cached (a one-off image recorded anew by another edit, with that edit's prompt, seed
        and mask) is prepared again, on the loop: its inputs (its start, the region it recomputes) follow
        the recording it reads. `job.ready` is None if that failed (the job failed)."""
        now_recorded = self.editor.templates.get(job.request.template_id)
        prepared = job.ready.inputs.template
        if now_recorded is None or now_recorded is prepared or (
                (now_recorded.seed, now_recorded.prompt, now_recorded.recorded_mask.tobytes())
                == (prepared.seed, prepared.prompt, prepared.recorded_mask.tobytes())):
            return
        job.ready = self._inline(lambda: self._prepare(job), job)

    def cancel_recording_again(self, template_id: str) -> None:
        """The template is being dropped: its recording for lost-template edits stops at the next step (they
        then fail as edits of a dropped template do)."""
        recording = self._recording_again.get(template_id)
        if recording is not None:
            recording.future.cancel()

    @property
    def registration_slots(self) -> int:
        """The batch slots registrations may take (`EngineConfig.edit_slots`); all of them in static mode,
        where no edit joins a running batch."""
        config = self.config
        if config.mode == "static":
            return config.max_batch
        return config.max_batch - (config.max_batch // 4 if config.edit_slots is None else config.edit_slots)

    def _is_registration(self, job: Job) -> bool:
        """A recording no edit waits for (an edit that found its template lost waits for its own)."""
        return job.request is None and not self._records_again(job)

    def _waits_elsewhere(self, job: Job) -> bool:
        """Whether a waiting edit waits for a recording of its template that is being prepared outside the loop
        (`send_to_prepare`): with nothing running, the loop sleeps until a message comes instead of spinning."""
        recording = job.waited_for
        return recording is not None and not recording.future.done() and recording.ready is None

    def _records_again(self, job: Job) -> bool:
        """Whether the job is the recording of a lost template that edits wait for (`_waits_for_recording`)."""
        return job.request is None and self._recording_again.get(job.recording.template_id) is job

    def next_waiting(self) -> Job:
        """Take the waiting job to admit next: the least slack (deadline - now - `predict_s`) among
        those with a deadline, then those without in arrival order; FIFO among equals. A queue without
        deadlines is plain FIFO (no prediction is made)."""
        if all(job.deadline is None for job in self.waiting):
            return self.waiting.popleft()
        at = now()

        def urgency(job: Job) -> tuple[int, float]:
            if job.deadline is None:
                return (1, 0.0)
            return (0, job.deadline - at - self.predict_s(job))

        job = min(self.waiting, key=urgency)  # min keeps the first of equals: FIFO
        self.waiting.remove(job)
        return job

    def predicted_s(self, job: Job) -> float:
        """Seconds `job` needs once admitted: its steps x the mean step time measured so far (0 before
        the first step: then slack is the time to the deadline)."""
        return self._steps_of(job) * self.metrics.mean_step_s()

    def _steps_of(self, job: Job) -> int:
        """The denoiser calls a waiting job will make (a second-order sampler makes about two a step)."""
        if job.recording is not None:
            steps = job.recording.steps
        else:
            template = self.editor.templates.get(job.request.template_id)
            steps = template.steps if template is not None else (job.request.steps or 0)
        return denoiser_calls(self._calls, steps_run(self.editor.model.family, steps, job.strength), steps)

    def step(self) -> bool:
        """One denoising step of the running batch: a forward per guidance setting (and text length), and
        per image size unless the family packs sizes into one forward (`recipes.PACKED`). False when no
        request stepped (each waited for its LoRA)."""
        packs = self.config.mixed_sizes and self.editor.model.family in recipes.PACKED
        groups: dict[tuple, list[Job]] = {}
        stepping = self.with_loras()
        for job in stepping:
            template = job.template
            size = template.num_text_tokens if packs else template.canvas.padded
            groups.setdefault((size, job.ready.prepared.copies), []).append(job)
        for jobs in groups.values():
            try:
                self._step_group(jobs)
            except Exception as exc:  # the group's requests fail; the loop and the others go on
                for job in jobs:
                    self._fail(job, exc)
                    self.running.remove(job)
        for job in stepping:
            if job.watch is not None and job in self.running:
                self._tell(job)
        return bool(groups)

    def with_loras(self) -> list[Job]:
        """The running requests that step now. A request's LoRA applies from the first step after its load
        completed (`lora_applied_step`); at its latest step (`EngineConfig.lora_latest_step`) a request still
        loading sits the step out. When all of them would, the loop waits for a load to complete."""
        stepping, waiting = [], []
        for job in list(self.running):
            if job.lora and not job.lora_entry:
                ready = self.loras.ready(job.lora_loads)
                if isinstance(ready, BaseException):
                    self.running.remove(job)
                    self._fail(job, ready)
                    continue
                if ready:
                    job.lora_entry = self.loras.entry(job.lora, job.lora_loads)
                    job.metrics.lora_applied_step = job.row.schedule.calls_made
                elif job.row.schedule.index >= job.lora_latest_step(self.config.lora_latest_step):
                    waiting.append(job)
                    continue
            stepping.append(job)
        if waiting and not stepping:
            self.loras.wait([future for job in waiting for future in job.lora_loads], timeout_s=0.5)
        return stepping

    def _step_group(self, jobs: list[Job]) -> None:
        try:
            self._step_jobs(jobs)
        except AmbiguousRows:  # raised before the forward: nothing has run; halves are never ambiguous at one
            half = len(jobs) // 2
            self._step_group(jobs[:half])
            self._step_group(jobs[half:])

    def _step_jobs(self, jobs: list[Job]) -> None:
        editor = self.editor
        inputs = [job.ready.inputs for job in jobs]
        handles = {key: handle for job in jobs for key, handle in job.handles.items()}
        writes = RecordingWrites(editor.cache)
        context = editor.staged_edit_context(inputs, [job.row.schedule.index for job in jobs], handles,
                                             record_to=writes)
        try:
            self._step_in(jobs, context, writes)
        finally:
            if isinstance(context.cache, StagedActivations):
                # Its copies have started: a step that fails or splits before its forward must end them (a
                # no-op after the forward), or on the CPU a gated copy holds the copy thread, and every later step.
                context.cache.abandon()

    def _step_in(self, jobs: list[Job], context, writes: RecordingWrites) -> None:
        """One step of `jobs` under their staged context (`_step_jobs`)."""
        editor = self.editor
        mixed = len({job.template.canvas.padded for job in jobs}) > 1
        forward = (editor.adapter.forward_packed if mixed
                   else lambda **kwargs: editor.denoiser(**kwargs, return_dict=False)[0])

        # Per-row LoRA: each denoiser row (request, guidance copy) binds its request's adapters.
        copies = jobs[0].ready.prepared.copies
        entries = [job.lora_entry for _ in range(copies) for job in jobs]
        lora_batch = None
        if any(entries):  # AmbiguousRows is raised here, before anything runs
            lora_batch = self.loras.layers.batch(entries, editor.adapter.row_layouts(context))
        # Per-row LoRA runs the blocks eagerly (its segments are host values a compiled graph would bake in).
        eager = editor.adapter.eager() if lora_batch is not None else contextlib.nullcontext()

        def denoiser(**kwargs):
            started = now()
            bind = self.loras.layers.bind(lora_batch) if lora_batch is not None else contextlib.nullcontext()
            with editor.adapter.run(context), bind, eager:
                if isinstance(context.cache, StagedActivations):
                    with context.cache:
                        output = forward(**kwargs)
                else:
                    output = forward(**kwargs)
            self._forward_s += now() - started
            return output

        step = recipes.denoise_mixed_step if mixed else recipes.denoise_step
        step(editor.model.family, self.scheduler, [job.row for job in jobs], denoiser)
        self.metrics.mixed_size_steps += mixed
        for job in jobs:
            job.metrics.steps += 1
            failure = writes.failures.get(job.template.template_id) if job.writes_cache else None
            if failure is not None:  # its recording could not be kept
                editor.abort_recording(job.recording.template_id)
                if job.request is not None and isinstance(failure, CacheFull):
                    self._answer_unrecorded(job, failure)
                    continue
                self.running.remove(job)
                if self._restarts_for_memory(job, failure, shared=len(jobs) > 1):
                    continue
                self._fail(job, failure)  # a registration fails, alone

    def retire(self) -> None:
        finished = [job for job in self.running if job.row.schedule.done]
        if not finished:
            return
        self.running = [job for job in self.running if not job.row.schedule.done]
        for job in finished:
            job.metrics.denoised = now()
            self._release(job)
            if job.request is not None and not bool(torch.isfinite(job.row.latents).all()):
                # NaN or inf decode to a black region: an error, not an image (nor a recording)
                if job.writes_cache:
                    self.editor.abort_recording(job.recording.template_id)
                self._fail(job, non_finite_error(job))
                continue
            if job.writes_cache:
                try:
                    self.editor.commit_recording(job.recording)  # writes its last step
                except Exception as exc:
                    self.editor.abort_recording(job.recording.template_id)
                    if job.request is not None and isinstance(exc, CacheFull):
                        self._answer_unrecorded(job, exc)
                    else:
                        if not self._restarts_for_memory(job, exc, shared=len(finished) > 1 or bool(self.running)):
                            self._fail(job, exc)
                        continue
                else:
                    self.editor.templates[job.recording.template_id] = job.recording
                    self.metrics.recorded += 1
            if job.request is None:  # a registration: done once recorded
                job.metrics.completed = now()
                self._set_result(job, job.recording.template_id)
                continue
            if self.send_to_postprocess is not None:
                self.send_to_postprocess(job)
                continue
            image = self._inline(lambda: postprocess(self.editor, job.template, job.request.mask,
                                                     job.row.latents), job)
            if image is not None:
                self.complete(job, image)

    # ---- helpers ----

    def _preview(self, job: Job) -> Image.Image:
        if self._previewer is None:  # fitted once, on the first preview anyone asks for
            self._previewer = LatentPreviewer.fit(self.editor.pipe, self.editor.model.family)
        return self._previewer.image(self.editor.pipe, job.row.latents, job.template.canvas)

    def _tell(self, job: Job) -> None:
        """Its watcher hears of the step (and sees a preview when one is due). A watcher's failure is
        the watcher's: the edit goes on."""
        watch, schedule = job.watch, job.row.schedule
        try:
            if watch.on_step is not None:
                watch.on_step(schedule.calls_made, schedule.calls_in_all)
            if (watch.on_preview is not None and watch.preview_every and not schedule.done
                    and schedule.calls_made % watch.preview_every == 0):
                watch.on_preview(schedule.calls_made, self._preview(job))
        except Exception as exc:  # noqa: BLE001 - progress is best effort; the answer is not
            self._watch_failed(exc)

    def _watch_failed(self, exc: Exception) -> None:
        """A watcher's callback raised: counted, the edit goes on."""
        self.metrics.watch_errors += 1
        self.metrics.last_watch_error = f"{type(exc).__name__}: {exc}"

    def complete(self, job: Job, image: Image.Image) -> None:
        """Answer `job` (any thread: post-processing helpers answer from their receiver)."""
        job.metrics.completed = now()
        recorded = job.recording.template_id if job.writes_cache else None
        if self._set_result(job, EditResult(image, job.metrics, recorded, job.unrecorded)):
            with self._counts_lock:
                self.metrics.completed += 1

    def _set_result(self, job: Job, result) -> bool:
        try:
            job.future.set_result(result)
        except InvalidStateError:  # cancelled after its last step: nobody waits for it
            return False
        return True

    def _prepare(self, job: Job) -> ReadyEdit:
        if job.recording is not None:
            return prepare_recording(self.editor, job.recording, job.records, job.strength)
        template = self.editor.templates.get(job.request.template_id)
        if template is None:  # known when submitted (`Engine.submit` checks): dropped since
            raise MissingTemplate(f"template {job.request.template_id!r} was dropped before the edit ran")
        if job.lora and self.text_encoder_loras is None:
            raise LoraError("this engine serves no LoRAs (start it with a LoRA folder: --lora-dir)")
        lora = self.text_encoder_loras.of(job.lora) if job.lora else ()
        return preprocess(self.editor, job.request, template, lora)

    def _answer_unrecorded(self, job: Job, failure: CacheFull) -> None:
        """A one-off edit whose recording does not fit the host cache answers all the same: computed in
        full, unrecorded."""
        job.records = False
        job.unrecorded = "held" if failure.held else "too_large"
        if job.watch is not None and job.watch.on_unrecorded is not None:
            try:
                job.watch.on_unrecorded(job.unrecorded)
            except Exception as exc:  # noqa: BLE001 - the watcher's failure is the watcher's, as in `_tell`
                self._watch_failed(exc)
        self.metrics.unrecorded += 1
        if self.metrics.unrecorded == 1:  # an operator's mistake, not the user's: said once
            logger.warning("a one-off image is answered unrecorded, so its later edits will not be mask-aware "
                           "(counted in retouch_worker_unrecorded_total): %s", failure)

    def _departures(self) -> int:
        """Jobs that have left the batch so far (each releases the host memory its template held)."""
        metrics = self.metrics
        return metrics.completed + metrics.failed + metrics.failed_recordings + metrics.cancelled

    def _restarts_for_memory(self, job: Job, failure: BaseException, shared: bool) -> bool:
        """Whether a registration (no edit) whose recording found the host cache held by templates in use starts
        over once a job leaves (its own steps were freed), rather than failing: under load a registration
        must not fail for memory that is only lent. It fails where it needs more than the whole budget,
        where it ran alone (`shared`: its step's batch had other rows; alone, it held the memory itself)
        and after MEMORY_RETRIES restarts. Restarted jobs are admitted one at a time while others run
        (`admit`), so two that failed together do not fail together again."""
        if (job.request is not None or not isinstance(failure, CacheFull) or not failure.held or not shared
                or job.memory_retries >= MEMORY_RETRIES):
            return False
        self._release(job)
        job.memory_retries += 1
        job.waits_for_departures = self._departures()
        job.ready = job.row = None  # prepared again at its next admission: its schedule had advanced
        job.metrics.steps = 0
        self.metrics.recording_retries += 1
        self.waiting.appendleft(job)
        logger.info("template %s: the host cache is held by templates in use; its recording starts over once "
                    "one of them leaves (retry %d of %d)", job.recording.template_id, job.memory_retries,
                    MEMORY_RETRIES)
        return True

    def _fail(self, job: Job, exc: BaseException) -> None:
        self._release(job)
        self.count_failure(job)
        job.fail(exc)

    def count_failure(self, job: Job) -> None:
        """An edit's failure is the user's to see; a recording's (a registration, or the loop's own of a lost
        template) the operator's, in a counter of its own."""
        with self._counts_lock:
            if job.request is None:
                self.metrics.failed_recordings += 1
            else:
                self.metrics.failed += 1

    def _release(self, job: Job) -> None:
        """The job leaves the batch: its template handles and its LoRA leases go now, not when the Job
        object is collected (its future's callbacks may keep it in a reference cycle for long)."""
        self.editor.release(job.handles.values())
        job.handles = {}
        if job.lora_loads:
            job.lora_loads, job.lora_entry = [], ()
            self.loras.settle()

    def _mid_denoising(self) -> bool:
        return any(job.metrics.steps for job in self.running)

    def _inline(self, work: Callable, job: Job):
        """Pre/post-processing on the loop thread: an interruption when others are mid-denoising."""
        if self._mid_denoising():
            self.metrics.interruptions += 1
        started = now()
        try:
            return work()
        except Exception as exc:
            self._fail(job, exc)
            return None
        finally:
            self._inline_s += now() - started

    def _call(self, fn: Callable, future: Future) -> None:
        """A short call on the loop thread between steps (dropping a template): not an interruption."""
        started = now()
        try:
            future.set_result(fn())
        except Exception as exc:
            future.set_exception(exc)
        finally:
            self._inline_s += now() - started
