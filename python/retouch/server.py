"""`retouch serve`: the router, the worker processes and the HTTP frontend on one host.

    with Server(ServeOptions(model="tiny-flux-fill", workers=2, port=0)).start() as server:
        httpx.post(server.url + "/v1/templates", files=...)

The frontend and the router share this process (the router on its own thread: one hop less for
every image); each worker is a process of its own (`retouch.engine.node`), started and, if it exits,
replaced by the supervisor. Workers on other hosts join with `retouch worker --connect` when the
router listens beyond loopback (`--worker-listen`, CURVE keys required).

Everything the server starts carries its id (`serve_id`, $RETOUCH_SERVE_ID) and lives under its run
folder; both are gone when it stops (`engine.process_tree`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import uvicorn

from retouch.config import ServeOptions, comma_list, model_label, resolve_device
from retouch.engine import process_tree
from retouch.engine.curve import AllowedKeys, RouterSecurity
from retouch.engine.reference_costs import h800_flux
from retouch.engine.registry import TemplateRegistry
from retouch.engine.router import Router, RouterConfig
from retouch.engine.step_cost import StepCost
from retouch.engine.supervisor import Supervisor
from retouch.edit_jobs import wait_events
from retouch.errors import InputError, RetouchError
from retouch.http_api import Limits, create_app
from retouch.http_connections import guarded_protocol
from retouch.kept_answers import AnswerFolder
from retouch.log_limits import cap_log_messages
from retouch.webhooks import secret_key

# After the drain: how long workers get to say bye and exit, then (still there: hung) to die of SIGTERM.
WORKER_EXIT_S = 5.0


def step_cost(opts: ServeOptions) -> StepCost | None:
    """The cost model of mask-aware and least-work routing and of SLO admission (--slo-admission reject): the fitted
    one given (`retouch profile`), else the built-in model of an H800-class worker running Flux -- a
    stand-in whose ranking of batches (by masked tokens and cache bytes) carries over, not its seconds
    (so SLO admission needs the fitted one to mean anything)."""
    if opts.policy not in ("mask-aware", "least-work") and opts.slo_admission != "reject":
        return None
    if opts.cost_model is not None:
        return StepCost.from_json(opts.cost_model)
    print("retouch: mask-aware routing and SLO admission with the built-in H800 Flux cost model; fit this "
          "model's with `retouch profile` and pass --cost-model", file=sys.stderr)
    return StepCost(h800_flux())


def router_config(opts: ServeOptions) -> RouterConfig:
    return RouterConfig(address=opts.worker_listen, policy=opts.policy, heartbeat_s=opts.heartbeat_s,
                        dead_after_s=opts.dead_after_s, transfer_timeout_s=opts.transfer_timeout_s,
                        max_queue=opts.max_queue, slo_admission=opts.slo_admission,
                        lora_affinity=None if opts.lora_affinity < 0 else opts.lora_affinity,
                        template_affinity=None if opts.template_affinity < 0 else opts.template_affinity,
                        template_replicas=opts.template_replicas,
                        template_replicas_grow=None if opts.template_replicas_grow < 0 else opts.template_replicas_grow,
                        no_worker_s=opts.no_worker_s, max_templates_per_tenant=opts.max_templates_per_tenant,
                        max_template_bytes=max(1, int(opts.max_templates_mb * 2**20)),
                        max_one_off_bytes=max(1, int(opts.max_one_off_mb * 2**20)),
                        model=model_label(opts.model), max_queue_per_tenant=opts.max_queue_per_tenant or None)


def served_model(config: RouterConfig, opts: ServeOptions) -> RouterConfig:
    """`config` knowing what the model's workers will say when they join: its family and its sampler's
    calls line, read from the model's files (no weights)."""
    from retouch.models.loading import model_family, scheduler_for
    from retouch.models.samplers import calls_line

    return dataclasses.replace(config, family=model_family(opts.model),
                               calls=calls_line(scheduler_for(opts.model, opts.scheduler)))


def threads_of(opts: ServeOptions, device: str) -> tuple[int, int]:
    """torch CPU threads of each worker and of each helper process (0: torch's default, every core).
    Several workers on a CPU share its cores, and their helpers take one each, unless told otherwise:
    each with every core, their OpenMP teams spin against each other (on 2 cores, two workers ran
    concurrent edits 20-100x slower)."""
    if device != "cpu" or opts.workers < 2:
        return opts.worker_threads, opts.helper_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return opts.worker_threads or max(1, cores // opts.workers), opts.helper_threads or 1


def http_limits(opts: ServeOptions, api_keys: tuple[str, ...] = (), webhook_secret: str | None = None) -> Limits:
    """The HTTP front end's limits from the server's options. `n` (images per request) is capped at
    --max-queue: a larger `n` could never be accepted, and is refused naming `n`, not answered "busy"."""
    return Limits(max_upload_bytes=int(opts.max_upload_mb * (1 << 20)), max_pixels=opts.max_pixels,
                  max_steps=opts.max_steps, default_steps=opts.steps, max_work=opts.max_work, api_keys=api_keys,
                  docs=opts.docs, playground=opts.playground, max_prompt_chars=opts.max_prompt_chars,
                  header_timeout_s=opts.header_timeout_s, body_timeout_s=opts.body_timeout_s,
                  max_connections=opts.max_connections, max_inflight_bytes=int(opts.max_inflight_mb * (1 << 20)),
                  slo_ms_per_megapixel=opts.slo_ms_per_megapixel, slo_ms_min=opts.slo_ms_min,
                  lora_dir=opts.lora_dir,
                  max_n=min(Limits.max_n, opts.max_queue, opts.max_queue_per_tenant or opts.max_queue),
                  model_names=opts.model_names(),
                  cors_origins=tuple(comma_list(opts.cors_origins)), result_ttl_s=opts.result_ttl_s,
                  max_result_bytes=int(opts.result_store_mb * (1 << 20)),
                  webhook_origins=tuple(comma_list(opts.webhook_origins)), webhook_secret=webhook_secret)


def _bind(host: str, port: int) -> socket.socket:
    """The HTTP port, taken (not yet listening: connections are refused until the workers are ready)."""
    # IPPROTO_TCP spelled out: asyncio turns on TCP_NODELAY only for sockets that say they are TCP.
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                             socket.IPPROTO_TCP)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise InputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}"
                         f"{' (--port 0 picks a free one)' if port else ''}") from None
    return listener


class Server:
    def __init__(self, opts: ServeOptions):
        self.opts = opts
        self.serve_id = uuid.uuid4().hex
        self.run_dir: Path | None = None
        self.router: Router | None = None
        self.supervisor: Supervisor | None = None
        self._http: uvicorn.Server | None = None
        self._http_thread: threading.Thread | None = None
        self._answers: AnswerFolder | None = None
        self.url = ""

    def start(self, ready_timeout_s: float | None = None) -> Server:
        """Router, workers, then HTTP. `ready_timeout_s`: how long workers may take to load (and, with
        --compile, to compile: default 30 min then, else 10). The port is taken first, so a port in use
        fails before any worker loads the model; whatever fails, what was started is stopped."""
        opts = self.opts
        cap_log_messages()
        api_keys = read_api_keys(opts.api_keys_file)
        webhook_secret = None if opts.webhook_secret_file is None else read_webhook_secret(opts.webhook_secret_file)
        device, dtype = resolve_device(opts.device, opts.dtype)
        if opts.cuda_graphs and device != "cuda":
            raise InputError("--cuda-graphs needs a CUDA device; none is here")
        if ready_timeout_s is None:
            ready_timeout_s = 1800.0 if opts.compile or opts.cuda_graphs else 600.0
        limits = http_limits(opts, api_keys, webhook_secret)
        listener = _bind(opts.host, opts.port)
        try:
            self._start(listener, limits, device, dtype, ready_timeout_s)
        except BaseException:
            listener.close()
            self.close()
            raise
        return self

    def _start(self, listener: socket.socket, limits: Limits, device: str, dtype, ready_timeout_s: float) -> None:
        opts = self.opts
        security = None
        if opts.curve_secret is not None:
            security = RouterSecurity(opts.curve_secret, AllowedKeys.from_dir(opts.curve_allowed))
        registry = None if opts.cache_disk_dir is None else TemplateRegistry(Path(opts.cache_disk_dir) / "templates")
        try:
            self.router = Router(served_model(router_config(opts), opts), step_cost(opts), security=security,
                                 registry=registry).start()
        except BaseException:
            if registry is not None:
                registry.close()
            raise
        if self.router.templates:
            print(f"retouch: {len(self.router.templates)} templates kept in {registry.directory}; workers record "
                  "them (or find them in their disk tier) as they join", file=sys.stderr, flush=True)
        process_tree.remove_stale_run_dirs()
        self.run_dir = process_tree.new_run_dir()
        worker_threads, helper_threads = threads_of(opts, device)
        node_args = ["--model", opts.model, "--device", device, "--dtype", str(dtype).removeprefix("torch."),
                     "--mode", opts.mode,
                     "--max-batch", str(opts.max_batch), "--helpers", str(opts.helpers),
                     *(["--edit-slots", str(opts.edit_slots)] if opts.edit_slots is not None else []),
                     "--helper-threads", str(helper_threads), "--helper-silence-s", repr(opts.helper_silence_s),
                     "--threads", str(worker_threads), "--log-level", opts.log_level]
        node_args += ["--compile"] * opts.compile + ["--cuda-graphs"] * opts.cuda_graphs
        node_args += ["--scheduler", opts.scheduler] if opts.scheduler is not None else []
        node_args += ["--lora-cache-mb", str(opts.lora_cache_mb), "--lora-latest-step", str(opts.lora_latest_step)]
        if opts.lora_device_mb is not None:
            node_args += ["--lora-device-mb", repr(opts.lora_device_mb)]
        node_args += ["--cache-host-gib", repr(opts.cache_host_gib), "--cache-disk-gib", repr(opts.cache_disk_gib),
                      "--cache-dtype", opts.cache_dtype]
        if opts.lora_dir is not None:
            node_args += ["--lora-dir", str(Path(opts.lora_dir).resolve())]
        self.supervisor = Supervisor(opts.workers, node_args, self.router.address, self.router.worker_exited,
                                     self.run_dir, restart=opts.restart, gpus=device == "cuda", serve_id=self.serve_id,
                                     extra_env=security.local_worker_env() if security is not None else None,
                                     cache_disk_dir=None if opts.cache_disk_dir is None
                                     else Path(opts.cache_disk_dir).resolve())
        self.router.on_worker_lost = self.supervisor.presumed_dead
        self._await_workers(ready_timeout_s)
        self._answers = answer_folder(opts)
        app = create_app(self.router, limits, opts.model, self._answers)
        if app.state.restored:
            print(f"retouch: {app.state.restored} answers of edits made before the restart are kept in "
                  f"{self._answers.directory} and answered again", file=sys.stderr, flush=True)
        # Listen now, not when uvicorn's loop gets to it: start() returns the URL, and a client that
        # connects at once must be queued by the kernel rather than refused.
        listener.listen(2048)
        port = listener.getsockname()[1]
        self.url = f"http://{opts.host}:{port}"
        closed = app.state.metrics.connections_closed
        protocol = guarded_protocol(limits.header_timeout_s, limits.body_timeout_s, limits.max_connections,
                                    on_close=lambda reason: closed.labels(reason).inc())
        # log_config=None: uvicorn's records (a malformed request, its own tracebacks) go to the serving log's
        # handler and formatter (`setup_logging`: escaped, tracebacks indented) instead of handlers of its own.
        self._http = HttpServer(uvicorn.Config(app, log_level="warning", lifespan="off", http=protocol,
                                               timeout_keep_alive=30, log_config=None), app.state)
        self._http_thread = threading.Thread(target=self._http.run, kwargs={"sockets": [listener]},
                                             name="retouch-http", daemon=True)
        self._http_thread.start()

    def _await_workers(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        ready = 0
        while ready < self.opts.workers:
            if self.supervisor.exits:
                raise RetouchError("a worker process exited while loading the model (see its error above)")
            if time.monotonic() > deadline:
                raise RetouchError(f"only {ready} of {self.opts.workers} workers were ready after {timeout_s:.0f} s")
            self.router.wait_for_workers(ready + 1, 1.0)
            now_ready = len(self.router.snapshot()["workers"])
            if now_ready != ready:
                ready = now_ready
                print(f"retouch: {ready}/{self.opts.workers} workers ready", file=sys.stderr)

    def close(self, drain_s: float | None = None) -> None:
        """Stop taking connections, answer every accepted edit within `drain_s` (default --drain-s; the rest
        are answered 503), stop the workers."""
        drain_s = self.opts.drain_s if drain_s is None else drain_s
        deadline = time.monotonic() + drain_s
        margin = min(2.0, drain_s / 4)  # for what must follow the edits within the drain
        if self._http is not None:
            # asynchronous edits kept on disk may finish until shortly before the drain ends (`stop_async`)
            self._http.stop(async_deadline=deadline - 2 * margin, webhook_deadline=deadline - margin)
            self._http_thread.join(timeout=max(0.0, deadline - margin - time.monotonic()))
        told_to_stop: set[str] = set()
        if self.router is not None:
            told_to_stop = set(self.router.snapshot()["workers"])
            self.router.close(max(0.0, deadline - margin - time.monotonic()))
        if self._http is not None:
            # The router answered what it held: those edits' tasks end now (an edit still running when the loop
            # ends is interrupted), and their outcomes are written.
            self._http_thread.join(timeout=max(0.0, deadline - time.monotonic()))
            self._http = None
        if self._answers is not None:
            self._answers.close(timeout_s=max(0.5, deadline - time.monotonic()))
            self._answers = None
        if self.supervisor is not None:
            # A replacement still loading never joined, so nobody told it to stop: no waiting for it.
            # What is left of the drain, and a few seconds for workers that drained to say bye and exit.
            self.supervisor.close(max(WORKER_EXIT_S, deadline - time.monotonic()), stopping=told_to_stop,
                                  grace_s=WORKER_EXIT_S)
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        self.router = self.supervisor = self.run_dir = None

    def serve_forever(self) -> None:
        stop = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        print(f"retouch: serving {self.opts.model} on {self.url} ({self.opts.workers} workers, "
              f"policy {self.opts.policy}); workers join at {self.router.address}; Ctrl-C drains and stops",
              file=sys.stderr)
        while not stop.wait(1.0):
            if not self._http_thread.is_alive():  # it failed (its error is above): nothing would answer
                print("retouch: the HTTP server stopped by itself; stopping", file=sys.stderr)
                self.close(drain_s=0)
                raise RuntimeError("the HTTP server stopped by itself (its error is above)")
        # Ctrl-C only: a second SIGTERM may be a process manager's repeat, which must not skip the drain.
        signal.signal(signal.SIGINT, lambda *_: self._stop_now())
        signal.signal(signal.SIGTERM, lambda *_: os.write(2, b"retouch: still draining (Ctrl-C stops at once)\n"))
        print(f"retouch: draining (up to {self.opts.drain_s:g} s; Ctrl-C again stops at once)", file=sys.stderr)
        self.close()

    def _stop_now(self) -> None:
        """A second Ctrl-C: stop without the drain, as a kill would (the workers end with this process; edits
        kept on disk that still ran answer 503 interrupted after a restart)."""
        os.write(2, b"retouch: stopping now\n")  # not print: the signal may have cut a write to stderr short
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        os._exit(1)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class HttpServer(uvicorn.Server):
    """uvicorn's server that, once it runs, sends the webhooks a stopped server left undelivered, and, told to
    stop (`stop`), drains the connections as uvicorn does while it stops the asynchronous edits (the app's
    `stop_async`: at once, or, their answers kept on disk, those still running at `async_deadline`), then
    its webhooks: those in flight, and those of the edits it cancelled, may end until `webhook_deadline`."""

    def __init__(self, config: uvicorn.Config, app_state):
        super().__init__(config)
        self.app_state = app_state
        self.async_deadline: float | None = None
        self.webhook_deadline: float | None = None

    def stop(self, async_deadline: float | None = None, webhook_deadline: float | None = None) -> None:
        """Tell it to stop (from another thread); deadlines on time.monotonic, None: at once."""
        self.async_deadline, self.webhook_deadline = async_deadline, webhook_deadline
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        resumed = self.app_state.resume_webhooks()
        if resumed:
            print(f"retouch: sending {resumed} webhooks left undelivered before the restart", file=sys.stderr)

    async def shutdown(self, sockets=None) -> None:
        waiting = len(self.app_state.jobs.running_async())
        if waiting and self.app_state.jobs.folder is not None and self.async_deadline is not None:
            print(f"retouch: {waiting} asynchronous edits may finish within "
                  f"{max(0.0, self.async_deadline - time.monotonic()):.0f} s", file=sys.stderr)
        stopping = asyncio.ensure_future(self.app_state.stop_async(self.async_deadline))
        self.app_state.stop_template_watches()  # long-polls and template streams answer now
        await super().shutdown(sockets)
        cancelled = await stopping
        if cancelled:
            print(f"retouch: {len(cancelled)} asynchronous edits cancelled (503 interrupted)", file=sys.stderr)
        webhooks = self.app_state.webhooks
        if webhooks is None:
            return
        deadline = self.webhook_deadline
        if deadline is not None:  # the cancelled edits' webhooks are sent once they end
            await wait_events([job.ended for job in cancelled], deadline - time.monotonic())
        dropped = await webhooks.close(deadline)
        if dropped:
            kept = self.app_state.jobs.folder is not None
            again = " (sent again after the restart)" if kept else ""
            print(f"retouch: {dropped} webhook{'s' * (dropped > 1)} not delivered{again}", file=sys.stderr)


def answer_folder(opts: ServeOptions) -> AnswerFolder | None:
    """Where the answers of asynchronous and keyed edits are kept, so that they outlive a restart: beside the
    templates, in --cache-disk-dir/edits (None without one: memory only)."""
    return None if opts.cache_disk_dir is None else AnswerFolder(Path(opts.cache_disk_dir) / "edits")


def read_webhook_secret(path: Path) -> str:
    """The webhooks' signing secret: the file's one line (Standard Webhooks' whsec_ + base64)."""
    lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    if len(lines) != 1:
        raise InputError(f"--webhook-secret-file {path}: one line (whsec_ + base64), not {len(lines)}")
    try:
        secret_key(lines[0])
    except ValueError as exc:
        raise InputError(f"--webhook-secret-file {path}: {exc}") from None
    return lines[0]


def read_api_keys(path: Path | None) -> tuple[str, ...]:
    """The API keys: one per line of `path` (blank lines and #comments skipped), else the
    comma-separated $RETOUCH_API_KEYS; none means an open server."""
    if path is not None:
        lines = Path(path).read_text().splitlines()
        keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not keys:
            raise InputError(f"--api-keys-file {path} holds no key")
    else:
        keys = [key.strip() for key in os.environ.get("RETOUCH_API_KEYS", "").split(",") if key.strip()]
    for key in keys:
        if len(key) < 16 or any(c.isspace() for c in key):
            raise InputError("an API key must be 16 or more characters without spaces")
    return tuple(dict.fromkeys(keys))
