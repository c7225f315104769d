"""The engine in-process: a step loop on its own thread, requests in, futures out.

    with Engine.load("tiny-flux-fill", EngineConfig(mode="disagg")) as engine:
        template_id = engine.register_template(image, prompt="a living room", steps=28)
        future = engine.submit(EditRequest(template_id, mask, "a red sofa", seed=1))
        edited = future.result().image

The server puts this behind the router; benchmarks and tests drive it directly.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import CancelledError, Future

import torch
from PIL import Image

from retouch.cache import CacheStore
from retouch.editor import DEFAULT_STEPS, EditRequest, MaskAwareEditor, Template, warm_up_inputs
from retouch.engine import processing, recipes
from retouch.engine.metrics import now
from retouch.engine.processing import HelperPool
from retouch.engine.worker import EditResult, EngineConfig, Job, MissingTemplate, StepWatch, Worker
from retouch.errors import InputError, RetouchError
from retouch.lora import LoraChoice, LoraError, parse_lora
from retouch.models import load_pipeline
from retouch.models.samplers import describe as describe_scheduler

logger = logging.getLogger("retouch.worker")
# One-off images an engine remembers having edited below full strength (their second such edit records them)
MAX_BELOW_FULL = 1024


class HelperError(RetouchError):
    """Pre/post-processing in a helper process failed; the message is the helper's."""


class Engine:
    def __init__(self, editor: MaskAwareEditor, config: EngineConfig = EngineConfig(), model_name: str | None = None,
                 predict_s: Callable[[Job], float] | None = None):
        """`model_name`: what the helper processes of the disaggregated mode load (default: the editor's).
        `predict_s`: the step loop's prediction of a job's remaining seconds (slack ordering, `Worker`)."""
        if not isinstance(config, EngineConfig):  # a dict of its fields failed later, as an AttributeError
            raise TypeError(f"config must be an EngineConfig (EngineConfig(mode=...)), got {type(config).__name__}")
        self.editor = editor
        self.config = config
        self.model_name = model_name or editor.model.name
        self.helpers: HelperPool | None = None
        self._helper_restarts = 0  # of the helper pools closed before (`metrics`)
        self._jobs: dict[int, Job] = {}  # in the helpers (disaggregated mode), until answered
        self._unanswered: set[Future] = set()  # every accepted request's, until done (`cancel_all`)
        self._recordings: dict[str, Job] = {}  # template id -> the job recording it
        # template id -> drops of it queued for the loop and not yet run (`drop_template(wait=False)`): a
        # registration of it meanwhile must record it anew, not take the recording about to go for its own
        self._dropping: dict[str, int] = {}
        # One-off images edited below full strength and not recorded (`submit_image`), least recent first
        self._below_full: OrderedDict[str, None] = OrderedDict()
        self._jobs_lock = threading.Lock()
        disaggregated = config.mode == "disagg"
        self.worker = Worker(editor, config, self._send_to_postprocess if disaggregated else None, predict_s,
                             self._send_to_prepare if disaggregated else None, self._recording_of)
        self._running = False
        self._loop_done = threading.Event()
        self._closing = False

    @classmethod
    def load(cls, model: str, config: EngineConfig = EngineConfig(), device: str = "cpu",
             dtype: torch.dtype = torch.float32, scheduler: str | None = None, **editor_options) -> Engine:
        """An engine on a built-in model or pipeline folder (`scheduler`: as `retouch.load`'s)."""
        pipeline = load_pipeline(model, device=device, dtype=dtype, scheduler=scheduler)
        return cls(MaskAwareEditor(pipeline, **editor_options), config, model)

    # ---- lifecycle ----

    def start(self, own_thread: bool = True) -> Engine:
        """Start the helpers and the step loop: on a thread of its own, or (`own_thread=False`) on the
        thread that then calls `run_loop()`. On a CPU the model computes fastest on the thread that
        loaded it: a second thread's OpenMP team ran the same forward about 2x slower (measured on a
        2-core host), so the worker process runs the loop on its main thread."""
        if self._running:
            return self
        if self.config.mode == "disagg":
            self.helpers = HelperPool(self.model_name, str(self.editor.device), self.editor.dtype,
                                      self.editor.dilation, self.config.helpers, self._on_helper_message,
                                      build_in_memory=self.editor.model.built_in_memory,
                                      scheduler=self.editor.model.scheduler,
                                      scheduler_description=describe_scheduler(self.worker.scheduler.template),
                                      threads=self.config.helper_threads, run_dir=self.config.run_dir,
                                      silence_s=self.config.helper_silence_s, lora_dir=self.config.lora_dir)
        self._running = True
        self._loop_done.clear()
        self.worker.stopping = False  # the last close's stop: a loop started again returned at once
        if own_thread:
            threading.Thread(target=self.run_loop, name="retouch-step-loop", daemon=True).start()
        return self

    def run_loop(self) -> None:
        """The step loop, on this thread, until `close()` (after `start(own_thread=False)`)."""
        try:
            self.worker.run()
        finally:
            self._loop_done.set()

    def close(self) -> None:
        """Finish every accepted request, then stop the loop and the helpers."""
        if not self._running:
            return
        self._closing = True
        if self.helpers is not None:
            # Requests still in the helpers are not in the loop's inbox yet: the loop must outlive them.
            self._await_helper_jobs()
        self.worker.inbox.put(("stop",))
        self._loop_done.wait()
        if self.helpers is not None:
            self.helpers.close()
            self._helper_restarts += self.helpers.restarts  # a counter: it outlives the pool
            self.helpers = None
        self.worker.loras.close()
        if self.editor.copy_engine is not None:  # its thread, idle until the editor is collected otherwise
            self.editor.copy_engine.close()
        if isinstance(self.editor.cache, CacheStore):
            self.editor.cache.flush()  # recordings still being written to disk: a restart adopts them
        self._running = False
        self._closing = False

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:  # left on an error or Ctrl-C: nobody waits for the answers
            self.cancel_all()
        self.close()

    def warm_up(self) -> None:
        """Compile now what the first requests would compile (an editor built with `compile`): the editor's
        warm-up (`MaskAwareEditor.warm_up`), then, where requests of different sizes share a forward (Flux
        and SD3, `EngineConfig.mixed_sizes`), a batch of two sizes through a step loop of its own. Before
        `start` (one loop at a time runs the model): the router sends a worker nothing until it says hello."""
        if self._running:
            raise RuntimeError("Engine.warm_up runs before Engine.start")
        self.editor.warm_up()
        if not (self.config.mixed_sizes and self.editor.model.family in recipes.PACKED):
            return
        loop = Worker(self.editor, EngineConfig(mode="naive", max_batch=max(2, self.config.max_batch)))
        ids, jobs = [], []
        try:
            for size in ((64, 64), (64, 96)):
                image, corner = warm_up_inputs(size)
                ids.append(self.editor.register_template(image, prompt="warm-up", steps=1))
                jobs.append(Worker.new_job(EditRequest(ids[-1], corner, "warm-up")))
                loop.inbox.put(("edit", jobs[-1]))
            loop.inbox.put(("stop",))
            loop.run()
            for job in jobs:
                job.future.result()
        finally:
            loop.loras.close()
            for template_id in ids:
                self.editor.drop_template(template_id)

    # ---- requests ----

    def register_template(self, image: Image.Image, prompt: str = "", steps: int = DEFAULT_STEPS, seed: int = 0,
                          guidance: float | None = None, mask: Image.Image | None = None,
                          on_step: Callable[[int, int], None] | None = None,
                          negative_prompt: str | None = None) -> str:
        """Record a template and return its id once recorded (`submit_template`, waited for)."""
        if not self._running:
            return self.editor.register_template(image, prompt, steps, seed, guidance, mask, negative_prompt)
        return self.submit_template(image, prompt, steps, seed, guidance, mask, on_step, negative_prompt).result()

    def submit_template(self, image: Image.Image, prompt: str = "", steps: int = DEFAULT_STEPS, seed: int = 0,
                        guidance: float | None = None, mask: Image.Image | None = None,
                        on_step: Callable[[int, int], None] | None = None,
                        negative_prompt: str | None = None) -> Future[str]:
        """Record a template as a member of the running batch: it joins at the next step and advances
        one step per loop iteration beside the edits; its future holds the template id once recorded.
        `on_step(k, n)` is told after each of its steps (progress: `StepWatch`). Registering a template that is
        recorded, or being recorded, costs nothing more."""
        template = self.editor.new_template(image, prompt, steps, seed, guidance, mask, negative_prompt=negative_prompt)
        return self.submit_recording(template, on_step)

    def submit_recording(self, template: Template, on_step: Callable[[int, int], None] | None = None,
                         only_if_room: bool = False) -> Future[str]:
        """`submit_template` of a template already made (`MaskAwareEditor.new_template`). `only_if_room`: record
        it only if the caches have room for it beside what they hold (as the last recording of its shape took,
        `MaskAwareEditor.recording_bytes`), else leave it to its first edit (`defer_recording`). A worker that
        joins a server is sent every template the server has: recording those its caches cannot hold would
        push out the ones it has just recorded, a generation each for nothing."""
        self._check_running()
        with self._jobs_lock:
            dropping = template.template_id in self._dropping
        if not dropping and (self.editor.is_recorded(template.template_id) or self.editor.adopt(template)):
            return _done(template.template_id)
        with self._jobs_lock:
            recording = self._recordings.get(template.template_id)
            if recording is not None and not dropping:
                return recording.future
            if only_if_room and not dropping and not self._has_room(template):
                self.editor.defer_recording(template)
                self.worker.metrics.deferred_recordings += 1
                logger.info("template %s: the caches have no room for it beside those they hold; its first edit "
                            "here records it", template.template_id)
                return _done(template.template_id)
            job = Worker.new_job(None, recording=template, watch=None if on_step is None else StepWatch(on_step))
            self._track_recording(job)
        self._enqueue(job)
        return job.future

    def submit_image(self, image: Image.Image, mask: Image.Image, prompt: str, seed: int = 0,
                     steps: int = DEFAULT_STEPS, guidance: float | None = None,
                     watch: StepWatch | None = None, budget_s: float | None = None,
                     lora: LoraChoice | str | list = (), strength: float = 1.0,
                     record_beside: bool | None = None, scope: str = "",
                     negative_prompt: str | None = None) -> Future[EditResult]:
        """A one-off edit of `image`. Its first edit on this engine runs in full, the stock pipeline's
        result, and records the image as it goes (`EditResult.recorded` names the template); later
        ones, whatever their prompt, seed or mask, are mask-aware edits of that recording. While the
        image is being recorded another one-off edit of it is computed in full without recording; so is
        one with a LoRA (the cache holds the base model's activations, which its rows are not), and one
        below `strength` 1 (it runs only the schedule's last steps, where a recording needs them all).
        The second edit of an image below strength 1 also starts its recording beside it, as its edit at full
        strength would have recorded it (`submit_recording` of its `one_off_template`): an image edited that
        way is likely edited again, and its later edits are then mask-aware. `record_beside` decides it
        instead where the caller counts (a worker process: the router counts edits on every worker).
        Edits of one image under other `scope`s (a server's tenants) share nothing (`Editor.one_off_id`)."""
        self._check_running()
        template = self.editor.one_off_template(image, mask, prompt, seed, steps, guidance, scope, negative_prompt)
        request = self.editor.check_request(EditRequest(template.template_id, mask, prompt, seed, strength=strength,
                                                        negative_prompt=negative_prompt), template)
        lora = self.check_lora(lora)  # looked up once the request is known to be good
        if self.editor.is_recorded(template.template_id):
            return self._submit_checked(request, self.editor.templates[template.template_id], watch, budget_s, lora)
        with self._jobs_lock:
            recording = template.template_id in self._recordings
            records = not recording and not lora and request.strength == 1.0
            job = Worker.new_job(request, recording=template, records=records, watch=watch,
                                 deadline=_deadline(budget_s), lora=lora)
            if records:
                self._track_recording(job)
            records_beside = not (recording or lora or records) and (
                self._edited_below_full(template.template_id) if record_beside is None else record_beside)
        self._enqueue(job)
        if records_beside:
            self.submit_recording(template)
        return job.future

    def _has_room(self, template: Template) -> bool:
        """Whether a recording of `template` fits the caches' free bytes (`MaskAwareEditor.recording_bytes`;
        True when the caches hold no recording to tell its size by)."""
        cache, nbytes = self.editor.cache, self.editor.recording_bytes(template)
        return nbytes is None or not isinstance(cache, CacheStore) or cache.free_bytes() >= nbytes

    def _edited_below_full(self, template_id: str) -> bool:
        """With the jobs lock held: whether the one-off image was edited below full strength before; it
        is remembered now (the last MAX_BELOW_FULL images)."""
        seen = template_id in self._below_full
        self._below_full[template_id] = None
        self._below_full.move_to_end(template_id)
        while len(self._below_full) > MAX_BELOW_FULL:
            self._below_full.popitem(last=False)
        return seen

    def drop_template(self, template_id: str, wait: bool = True) -> None:
        """Forget a template; a recording of it in progress stops at the next step and frees its
        memory. Runs on the loop thread, between steps (running edits hold their own handles)."""
        with self._jobs_lock:
            recording = self._recordings.get(template_id)
        if recording is not None:
            recording.future.cancel()
        if not self._running:
            self.editor.drop_template(template_id)
            return
        future: Future = Future()
        with self._jobs_lock:
            self._dropping[template_id] = self._dropping.get(template_id, 0) + 1

        def drop() -> None:
            try:
                self.worker.cancel_recording_again(template_id)
                self.editor.drop_template(template_id)
            finally:
                with self._jobs_lock:
                    self._dropping[template_id] -= 1
                    if not self._dropping[template_id]:
                        del self._dropping[template_id]

        self.worker.inbox.put(("call", drop, future))  # before any registration of it that follows
        if wait:
            future.result()

    def load_report(self) -> tuple[list[tuple[Future, int]], list[Future]]:
        """The running batch as (future, steps left), and the futures of requests accepted but not
        running (waiting for the loop, or being pre-processed): what the router balances on. Read
        from another thread, so the lists are copied first."""
        running = [(job.future, job.row.schedule.num_steps - job.row.schedule.index)
                   for job in list(self.worker.running) if job.row is not None]
        with self._jobs_lock:
            in_helpers = [job for job in self._jobs.values() if job.row is None]  # not yet pre-processed
        waiting = {job.id: job for job in list(self.worker.waiting) + in_helpers}
        return running, [job.future for job in waiting.values() if job.row is None]

    def submit(self, request: EditRequest, watch: StepWatch | None = None,
               budget_s: float | None = None, lora: LoraChoice | str | list = ()) -> Future[EditResult]:
        """Queue an edit; its future holds an `EditResult` or the error that stopped it.
        `future.cancel()` takes it out of the batch at the next step. `watch`: told each step, and
        shown previews (`StepWatch`). `budget_s`: seconds from now it should be answered within (its
        SLO: the queue is ordered by slack, `Worker.next_waiting`); None: no deadline. `lora`: its LoRA
        adapters (names in `EngineConfig.lora_dir`, with scales: `retouch.lora.parse_lora`), loaded while
        it already denoises (`EngineConfig.lora_latest_step`)."""
        self._check_running()
        if not isinstance(request, EditRequest):
            raise InputError(f"submit takes an EditRequest (submit_image: an image), got {type(request).__name__}")
        template = self.editor.templates.get(request.template_id)
        if template is None:
            raise InputError(f"unknown template {request.template_id!r}; register it first")
        request = self.editor.check_request(request, template)
        return self._submit_checked(request, template, watch, budget_s, self.check_lora(lora))

    def _submit_checked(self, request: EditRequest, template: Template, watch: StepWatch | None,
                        budget_s: float | None, lora: LoraChoice) -> Future[EditResult]:
        """`submit` of a request and LoRA choice already checked (and the LoRA looked up: once per request)."""
        job = Worker.new_job(request, watch=watch, deadline=_deadline(budget_s), lora=lora)
        # A template evicted to disk is read back while the request is pre-processed and queued; the
        # loop admits it once it is in host memory, stepping the running batch meanwhile.
        job.template_load = self.editor.prefetch(template)
        self._enqueue(job)
        return job.future

    def check_lora(self, lora: LoraChoice | str | list) -> LoraChoice:
        """A request's `lora`, parsed, with every name found in the LoRA folder (`LoraError` otherwise)."""
        lora = parse_lora(lora)
        if lora:
            self.worker.loras.check(lora)
            self.worker.loras.prefetch(lora)  # loads while the request is pre-processed and queued
        return lora

    def _check_running(self) -> None:
        if not self._running or self._closing:
            raise RuntimeError("the engine is not running (Engine.start or `with Engine(...)`)")

    def _track_recording(self, job: Job) -> None:
        """With the jobs lock held: `job` records its template until its future is done."""
        template_id = job.recording.template_id
        self._recordings[template_id] = job

        def forget(_) -> None:
            with self._jobs_lock:
                if self._recordings.get(template_id) is job:
                    del self._recordings[template_id]

        job.future.add_done_callback(forget)

    def _recording_of(self, template_id: str, make: Callable[[], Job]) -> Job:
        """The loop's (`Worker.recording_of`): the recording of the template under way, or `make()`'s, tracked
        from now on, so that a registration or a one-off edit of the template meanwhile does not record it
        a second time beside it."""
        with self._jobs_lock:
            under_way = self._recordings.get(template_id)
            if under_way is not None and not under_way.future.done():
                return under_way
            job = make()
            self._track_recording(job)
            return job

    def _enqueue(self, job: Job) -> None:
        """To the loop, or first to a helper for pre-processing (disaggregated mode)."""
        with self._jobs_lock:
            self._unanswered.add(job.future)
        job.future.add_done_callback(self._answered)
        if self.helpers is None:
            self.worker.inbox.put(("edit", job))
            return
        self._send_to_prepare(job)

    def _send_to_prepare(self, job: Job) -> None:
        """To a helper for pre-processing; it comes back to the loop's inbox as "ready" (`_on_helper_message`).
        The loop sends its own recordings of lost templates this way too."""
        with self._jobs_lock:
            self._jobs[job.id] = job
        job.future.add_done_callback(lambda _: self._forget_job(job))
        if job.recording is not None:
            self.helpers.send(job.id, processing.recording_message(job.id, job.recording, job.records, job.strength))
        else:
            template = self.editor.templates[job.request.template_id]
            self.helpers.send(job.id, processing.prepare_message(job.id, job.request, template, job.lora))

    def _answered(self, future: Future) -> None:
        with self._jobs_lock:
            self._unanswered.discard(future)

    def cancel_all(self) -> None:
        """Cancel every accepted request that is not answered yet: each leaves its batch at the next step."""
        with self._jobs_lock:
            futures = list(self._unanswered)
        for future in futures:
            future.cancel()

    def _forget_job(self, job: Job) -> None:
        with self._jobs_lock:
            held = self._jobs.pop(job.id, None) is not None
        helpers = self.helpers
        if held and job.future.cancelled() and helpers is not None:
            helpers.cancel(job.id)  # its helper skips it unless it has started it

    def edit(self, template_id: str, mask: Image.Image, prompt: str, seed: int = 0,
             steps: int | None = None, strength: float = 1.0) -> Image.Image:
        return self.submit(EditRequest(template_id, mask, prompt, seed, steps, strength)).result().image

    def metrics(self) -> dict:
        """The step loop's counters, and how many helper processes were replaced (died, or fell silent)."""
        restarts = self._helper_restarts + (self.helpers.restarts if self.helpers is not None else 0)
        return {**self.worker.metrics.summary(), "helper_restarts": restarts}

    # ---- the disaggregated mode's helpers ----

    def _send_to_postprocess(self, job: Job) -> None:
        self.helpers.send(job.id, processing.finish_message(job.id, job.template, job.request.mask, job.row.latents))

    def _on_helper_message(self, header: dict, tensors: dict, blobs: dict) -> None:
        """On the helpers' receiver thread: a prepared edit joins the loop's inbox; a finished image
        answers its request."""
        with self._jobs_lock:
            job = self._jobs.get(header["job"])
        if job is None:
            return
        kind = header["kind"]
        template = job.recording if job.recording is not None else self.editor.templates.get(job.request.template_id)
        if kind == "prepared" and template is not None:
            try:
                job.ready = processing.ready_from_message(header, tensors, blobs, template, self.editor.pipe.device)
            except Exception as exc:  # noqa: BLE001 - a malformed message fails its job, not this receiver thread
                with self._jobs_lock:
                    self._jobs.pop(job.id, None)
                self.worker.count_failure(job)
                job.fail(HelperError(f"the helper's preparation could not be read: {type(exc).__name__}: {exc}"))
                return
            self.worker.inbox.put(("ready", job))
            return
        with self._jobs_lock:
            self._jobs.pop(job.id, None)
        if kind == "finished":
            image = processing.finished_image(header, blobs)
            self.worker.complete(job, image)
        elif kind == "prepared":
            self.worker.count_failure(job)
            job.fail(MissingTemplate(f"template {job.request.template_id!r} was dropped before the edit ran"))
        elif header["error"] == LoraError.__name__:  # its adapter's text-encoder part: the client's to fix
            self.worker.count_failure(job)
            job.fail(LoraError(header["message"]))
        else:
            self.worker.count_failure(job)
            job.fail(HelperError(f"{header['error']}: {header['message']}"))

    def _await_helper_jobs(self) -> None:
        with self._jobs_lock:
            pending = [job.future for job in self._jobs.values()]
        for future in pending:
            if not future.cancelled():
                try:
                    future.exception()  # waits; the outcome is the caller's
                except CancelledError:  # cancelled while we waited
                    pass


def _done(result) -> Future:
    done: Future = Future()
    done.set_result(result)
    return done


def _deadline(budget_s: float | None) -> float | None:
    """A budget (seconds from now, as the router sends it: clocks differ across hosts) as a deadline
    on this process's clock (`metrics.now`)."""
    if budget_s is None:
        return None
    if isinstance(budget_s, bool) or not isinstance(budget_s, int | float) or not math.isfinite(budget_s):
        raise InputError(f"budget_s must be a finite number of seconds (or None), got {budget_s!r}")
    return now() + budget_s
