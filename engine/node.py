"""A worker process: one `Engine` (one GPU) behind a DEALER socket connected to the router.

    python -m retouch.engine.node --model tiny-flux-fill --router tcp://127.0.0.1:5555 --name w0
    retouch worker --connect tcp://head:5555 --model flux-fill --device cuda:0 \
        --curve-secret keys/worker.key_secret --curve-server keys/router.key --health-port 8001

A worker is either started by `retouch serve` on its host (--supervised: it dies with the server,
its CURVE keys come in its environment) or started on its own and connects to a router on another
host (`retouch worker`), then it needs the router's public key and a secret key the router allows.

It says hello (its batch size, the templates it holds), then answers the router's messages:
    register  record a template: it joins the running batch as a member and tells the router each
              recorded step, then ok or the error; one of many sent at once ("bulk": at its hello, taking
              over from a worker that left) waits its turn, and is recorded only if its caches have room
    edit      submit an edit (with `budget_s`: seconds left of its SLO, ordering the queue by slack;
              with `lora`: its adapters, `retouch.lora.choice_header` JSON, refused with 422 LoraError);
              the router hears of each of its steps (and, with `preview_every`, sees
              a preview PNG every that many steps), then the answer: a PNG, or an error with the
              HTTP status it maps to. An edit with `one_off` carries the image: its first edit
              here records it as it runs (one generation), and the router is told the template is
              ready before the answer. Its steps and answer carry its `attempt` (the router numbers
              each sending and hears only the latest); sent an edit it still holds (it was presumed
              dead meanwhile), the worker cancels the older copy
    cancel    drop an edit whose client is gone: it leaves the batch at the next step
    drop      forget a template (a recording of it in progress stops at the next step)
    stop      finish every accepted edit ("draining": the router sends nothing new, and heartbeats go
              on meanwhile), say bye and exit (sent to a supervised worker only: a worker started on its
              own outlives the server and joins it again when it is back); SIGTERM does the same
    closing   the server is shutting down: wait for it (or its successor) and say hello again
    refused   the router will not take this worker (another model): say why and exit with status 2
    name_taken  another live worker has its name: say so (now and then) and say hello until that one is gone
    rejoin    the router removed it (it fell silent, e.g. a network cut) and hears it again: hello again
    alive     the answer to each heartbeat: a router silent for its `dead_after_s` is presumed gone
              (restarted): the worker is not ready until a router welcomes it again
and heartbeats its running batch (each request's steps left), queue and metrics (its template cache
under "cache", its LoRA cache and loader under "lora"; "loras": the adapters it holds, with their files'
digests under "lora_digests"; "held": every edit it has accepted and not yet
answered, "recording": the templates it records, and "seen": the number (`seq`) of the last router
message it received, from which the router finds edits and templates lost on the way, and tells them
from ones still on their way) every `heartbeat_s`. Sends never block: a
router that cannot be reached (down, or refusing the CURVE key) leaves the node's loop running, so it
keeps saying so and stops on SIGTERM; heartbeats that cannot go out are dropped, other messages wait.

The main thread owns the socket. Answers produced on other threads (the engine's futures and its
progress callbacks) are queued and the main thread is woken through an inproc socket.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import queue
import signal
import socket
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from concurrent.futures import Future

import torch
import zmq
from PIL import Image

from retouch.cache import CacheStore
from retouch.editor import EditRequest, Template
from retouch.engine import wire
from retouch.engine.api import Engine
from retouch.engine.curve import WorkerKeys
from retouch.engine.health import HealthServer
from retouch.engine.process_tree import die_with_parent
from retouch.engine.wakeup import Wakeup
from retouch.engine.worker import EditResult, EngineConfig, StepWatch
from retouch.config import WorkerOptions, add_arguments, from_arguments, resolve_device
from retouch.errors import InputError
from retouch.models.samplers import calls_line
from retouch.models.samplers import identity as scheduler_identity
from retouch.models.samplers import label as scheduler_label
from retouch.log_limits import setup_logging
from retouch.lora import parse_lora
from retouch.images import decode_image, png_bytes
from retouch.paths import write_whole


def status_of(exc: BaseException) -> int:
    """The HTTP status an engine error maps to: the request's fault, or ours."""
    return 422 if isinstance(exc, InputError) else 500


logger = logging.getLogger("retouch.node")
# A worker started by hand that no router answers says so after this long, then again at this interval.
JOIN_NOTE_S = 5.0
JOIN_NOTE_REPEAT_S = 30.0
FINAL_FLUSH_S = 5.0  # at most this long, once drained, for the last answers to go out
DISK_NAMES = "router-names.json"  # in the disk tier's folder: the router's ids of its recordings (`Node._on_disk`)


def cache_dtype(editor) -> str | None:
    """How the worker's template cache stores activations (--cache-dtype; auto: the model's dtype); None
    without a CacheStore."""
    if not isinstance(editor.cache, CacheStore):
        return None
    stored = editor.cache.config.dtype
    return str(editor.dtype).removeprefix("torch.") if stored == "auto" else stored


class Node:
    def __init__(self, engine: Engine, router_address: str, name: str, heartbeat_s: float = 0.5,
                 keys: WorkerKeys | None = None, supervised: bool = True):
        """`supervised`: started by the server on this host, so it stops when the server is gone."""
        self.engine = engine
        self.name = name
        # What it says of its sampler in every hello, from the scheduler its loop steps with (never the
        # live pipeline's, which a preparation may be running): a label, an identity, its calls line.
        sampler = engine.worker.scheduler.template
        calls = calls_line(sampler)
        self._sampler = {"scheduler": scheduler_label(sampler), "scheduler_id": scheduler_identity(sampler),
                         **({"calls": list(calls)} if calls is not None else {})}
        self.router_address = router_address
        self.heartbeat_s = heartbeat_s
        self.supervised = supervised
        self.welcomed = threading.Event()  # the router took it in (readiness)
        self.refused: str | None = None  # why the router would not take it in
        self._name_taken_said = -math.inf  # when it last said another worker holds its name
        self.draining = False  # stopping: it finishes what it accepted and takes nothing new
        self._stop_requested = threading.Event()
        self.context = zmq.Context()
        self._boot = uuid.uuid4().hex  # this process: a restart may reuse the name and pid (PID 1 in a container)
        self.socket = self.context.socket(zmq.DEALER)
        # Two workers given one --name, both PID 1 in their containers, are two connections all the same.
        self.socket.setsockopt(zmq.IDENTITY, f"{name}:{os.getpid()}:{self._boot[:8]}".encode())
        self.socket.setsockopt(zmq.LINGER, 2000)
        # ZeroMQ's own heartbeats notice a dead TCP link (a cut cable sends no FIN) and reconnect.
        self.socket.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        if keys is not None:
            keys.apply(self.socket)
        self.socket.connect(router_address)
        self._wakeup = Wakeup(self.context)
        self._lock = threading.Lock()
        self._outgoing: queue.SimpleQueue = queue.SimpleQueue()  # (kind, frames), from any thread
        self._unsent: deque[tuple[str, list]] = deque()  # what the socket would not take yet, in order
        self.dead_after_s = 5.0  # the router's, told in its welcome
        self._last_heard = time.monotonic()  # the router's last message
        self._seen = 0  # the number (`seq`) of the last router message received
        self._hello_at = -math.inf
        self._session: str | None = None  # the welcoming router's (a new one: the old edits are orphans)
        self.templates: dict[str, str] = {}  # router template id -> the editor's (recorded)
        # The router's ids of the recordings in its disk tier, kept there (`DISK_NAMES`): an earlier process's
        # are said in its hello, so that the router sends it those templates to adopt (`_on_disk`)
        self._disk_names: dict[str, str] = self._read_disk_names()
        self._disk_names_changed = False
        self.registrations: dict[str, tuple[str, Future]] = {}  # router template id -> (editor's, recording)
        # The registrations sent in bulk ("bulk": at its hello, or taking over from a worker that left), in the
        # router's order (most recently edited first), not started yet: one runs at a time (`_start_bulk`),
        # each on what the caches hold by then.
        self._bulk: deque[tuple[str, dict, dict]] = deque()
        self._bulk_recording: Future | None = None
        self.requests: dict[Future, int] = {}  # engine future -> router request id
        self.futures: dict[int, Future] = {}  # router request id -> engine future
        self._parent = os.getppid()

    # ---- the main thread ----

    def run(self) -> None:
        self._hello()
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._wakeup.socket, zmq.POLLIN)
        next_heartbeat = 0.0
        next_join_note = time.monotonic() + JOIN_NOTE_S
        stopping = False
        drain: threading.Thread | None = None  # finishing the accepted edits while heartbeats go on
        if not self.supervised:  # a worker started by hand says where it is going, and when it is there
            print(f"{self.name}: connecting to {self.router_address}", file=sys.stderr, flush=True)
        while True:
            timeout_ms = max(0, int((next_heartbeat - time.monotonic()) * 1000))
            events = dict(poller.poll(timeout_ms))
            if self._wakeup.socket in events:
                self._wakeup.drain()
            if self.socket in events:
                while self.socket.poll(0):
                    stopping |= self._on_message(self.socket.recv_multipart())
            self._start_bulk()  # the end of a recording is posted, which wakes this thread
            self._save_disk_names()
            self._flush()
            if time.monotonic() >= next_heartbeat:
                self._post(self._heartbeat())
                self._flush()
                next_heartbeat = time.monotonic() + self.heartbeat_s
            if self.welcomed.is_set() and time.monotonic() - self._last_heard > self.dead_after_s:
                self._router_lost(f"no word from the router at {self.router_address} for "
                                  f"{time.monotonic() - self._last_heard:.0f} s")
            if self.welcomed.is_set():  # the note counts from the last time the router stopped answering
                next_join_note = time.monotonic() + JOIN_NOTE_S
            elif drain is None and time.monotonic() - self._hello_at > self.heartbeat_s:  # until it is heard
                self._hello()
            heard = self._name_taken_said > -math.inf  # the router answers: with name_taken, said on its own
            if (not self.welcomed.is_set() and not self.supervised and not heard
                    and time.monotonic() >= next_join_note):
                print(f"{self.name}: no router has answered at {self.router_address} yet (is `retouch serve "
                      "--worker-listen` there, with matching CURVE keys?); still trying", file=sys.stderr, flush=True)
                next_join_note = time.monotonic() + JOIN_NOTE_REPEAT_S
            if drain is None and (stopping or self._stop_requested.is_set()
                                  or (self.supervised and os.getppid() != self._parent)):
                # The router sends nothing new once told; heartbeats go on, so a drain longer than its
                # dead_after_s is not taken for a death (its edits sent elsewhere, their results dropped).
                self.draining = True
                self._post({"kind": "draining"})
                drain = threading.Thread(target=self.engine.close, name="retouch-drain", daemon=True)
                drain.start()  # finishes every accepted edit; their answers are queued
            if drain is not None and not drain.is_alive():
                break
        self._post({"kind": "bye"})
        self._flush()
        deadline = time.monotonic() + FINAL_FLUSH_S
        while self._unsent and self.welcomed.is_set() and time.monotonic() < deadline:
            self.socket.poll(100, zmq.POLLOUT)  # the drained answers, to a router that is there
            self._flush()
        # a router that is gone is not waited for
        self.socket.close(linger=0 if self._unsent or not self.welcomed.is_set() else None)
        self._wakeup.close()
        self.context.term()

    def _on_message(self, frames: list) -> bool:
        """Handle one message; True when told to stop."""
        try:
            header, _, blobs = wire.decode(frames)
            kind = header["kind"]
        except (wire.WireError, KeyError):
            return False
        self._last_heard = time.monotonic()
        # In order on one connection: with this one, every message sent before it has come (or was lost)
        self._seen = int(header.get("seq", self._seen))
        if kind == "welcome":
            self.heartbeat_s = float(header["heartbeat_s"])
            self.dead_after_s = float(header.get("dead_after_s", self.dead_after_s))
            session = header.get("session")
            if session != self._session and self._session is not None:
                # A new router took this worker in: the last one answered its edits, or died with them.
                self._forget_edits("of the previous router")
            self._session = session
            if not self.supervised and not self.welcomed.is_set():
                print(f"{self.name}: joined the router at {self.router_address}", file=sys.stderr, flush=True)
            self.welcomed.set()
        elif kind == "refused":
            self.refused = str(header.get("reason", "refused"))
            print(f"{self.name}: the router at {self.router_address} refused this worker: {self.refused}",
                  file=sys.stderr, flush=True)
            return True
        elif kind == "name_taken":  # another live worker has this --name: hellos go on until it is gone
            # It took the name while this one was presumed dead (paused, cut off): this one's edits went
            # there, or were answered; computing them here is for nobody.
            self._forget_edits("the router sent elsewhere (another worker has this name)")
            if time.monotonic() - self._name_taken_said > JOIN_NOTE_REPEAT_S:
                self._name_taken_said = time.monotonic()
                print(f"{self.name}: the router at {self.router_address} has a live worker of this name (pid "
                      f"{header.get('pid')}); this one joins once that one is gone: give each worker its own "
                      "--name", file=sys.stderr, flush=True)
        elif kind == "closing":
            self._router_lost(f"the router at {self.router_address} is shutting down")
        elif kind == "rejoin":  # one hello per episode: a burst of rejoins (stale heartbeats) is one
            self.welcomed.clear()
            if time.monotonic() - self._hello_at > self.heartbeat_s:
                self._hello()
        elif kind == "edit":
            self._edit(header, blobs)
        elif kind == "cancel":
            with self._lock:
                future = self.futures.get(header["request"])
            if future is not None:
                future.cancel()
        elif kind == "register":
            self._register(header, blobs)
        elif kind == "drop":
            self._drop(header["template"])
        return kind == "stop"

    def stop(self) -> None:
        """From a signal handler: finish the accepted edits, say bye, exit. It only sets a flag (the
        socket thread sees it within a heartbeat): the handler may interrupt this very thread inside
        `Wakeup.wake`, whose lock it would then wait for forever."""
        self._stop_requested.set()

    def _forget_edits(self, whose: str) -> None:
        """The edits this worker holds have no client any more: they leave the batch at the next step."""
        with self._lock:
            futures = list(self.futures.values())
        for future in futures:
            future.cancel()
        if futures:
            logger.info("%d edits %s cancelled", len(futures), whose)

    def _router_lost(self, why: str) -> None:
        """Not ready until a router welcomes it again (its edits were, or will be, moved elsewhere)."""
        if self.welcomed.is_set():
            self.welcomed.clear()
            print(f"{self.name}: {why}; joining again when it answers", file=sys.stderr, flush=True)
            self._hello()

    def _hello(self) -> None:
        """Who it is: the router refuses another model, and tells apart other weights or dtypes."""
        with self._lock:
            templates = list(self.templates)
        editor = self.engine.editor
        self._hello_at = time.monotonic()
        self._post({"kind": "hello", "protocol": wire.PROTOCOL, "max_batch": self.engine.config.max_batch,
                    "pid": os.getpid(),
                    "model": self.engine.model_name, "dtype": str(editor.dtype).removeprefix("torch."),
                    "weights": editor.model_fingerprint(), **self._sampler, "family": editor.model.family,
                    "supervised": self.supervised, "cache_dtype": cache_dtype(editor),
                    "lora": self.engine.worker.loras.lora_dir is not None, "boot": self._boot,
                    "draining": self.draining, "templates": templates, "on_disk": self._on_disk()})

    def _edit(self, header: dict, blobs: dict) -> None:
        request_id, router_template = header["request"], header["template"]
        # What every message about this copy of the edit carries: the router numbers each sending, and hears
        # only of the latest (a copy it sent before presuming this worker dead may still run here).
        edit = {"request": request_id} | ({"attempt": header["attempt"]} if "attempt" in header else {})
        with self._lock:
            older = self.futures.get(request_id)
        if older is not None:  # sent again (this worker was presumed dead meanwhile): the older copy is for nobody
            older.cancel()
        if self.draining:  # sent before the router heard it is draining: it goes elsewhere
            self._post({"kind": "result", **edit, "status": 503, "error": "WorkerDraining",
                        "message": "this worker is stopping"})
            return
        one_off = header.get("one_off")
        template_id = self.templates.get(router_template)
        if template_id is None and one_off is None:
            self._post({"kind": "result", **edit, "status": 409, "error": "MissingTemplate",
                        "message": "this worker does not hold the template"})
            return
        try:
            mask = Image.frombytes("L", tuple(header["mask_size"]), blobs["mask"])
            prompt, seed = header["prompt"], int(header["seed"])
            watch = self._watch(edit, int(header.get("preview_every", 0)))
            budget_s = None if header.get("budget_s") is None else float(header["budget_s"])
            lora = parse_lora(header.get("lora"))
            strength = float(header.get("strength", 1.0))
            negative_prompt = header.get("negative_prompt")
            if template_id is not None:
                future = self.engine.submit(EditRequest(template_id, mask, prompt, seed, strength=strength,
                                                        negative_prompt=negative_prompt,
                                                        guidance=header.get("guidance")), watch, budget_s, lora)
            else:
                image = decode_image(blobs["image"], f"template {router_template}")
                # The router's id of the image names its tenant: another's recording of it is not this one's. A
                # template's edit sent with its image (no worker serving its LoRA holds it) keeps its own scale.
                future = self.engine.submit_image(image, mask, prompt, seed, int(one_off["steps"]),
                                                  header.get("guidance", one_off["guidance"]), watch, budget_s, lora,
                                                  strength,
                                                  record_beside=False,  # the router asks (`_record_one_off`)
                                                  scope=router_template, negative_prompt=negative_prompt)
        except Exception as exc:  # noqa: BLE001 - answered, never dropped
            self._post({"kind": "result", **edit, "status": status_of(exc),
                        "error": type(exc).__name__, "message": str(exc)})
            if one_off is not None and one_off.get("records"):
                self._post({"kind": "template", "template": router_template, "ok": False, "message": str(exc)})
            return
        if one_off is not None and one_off.get("records"):  # the router asks for a recording beside the edit
            if template_id is None:
                self._record_one_off(router_template, image, mask, prompt, seed, one_off, negative_prompt)
            else:  # held here already (the router lost track of it)
                self._post_recorded(router_template)
        with self._lock:
            self.requests[future] = request_id
            self.futures[request_id] = future
        trace = str(header.get("trace") or request_id)
        future.add_done_callback(lambda f: self._answer(f, router_template, trace, edit))

    def _record_one_off(self, router_template: str, image: Image.Image, mask: Image.Image, prompt: str, seed: int,
                        one_off: dict, negative_prompt: str | None) -> None:
        """Record a one-off image beside an edit of it below full strength (which records nothing), as its
        edit at full strength would have: the router asks on the image's second such edit."""
        self._record(router_template, lambda: self.engine.editor.one_off_template(
            image, mask, prompt, seed, int(one_off["steps"]), one_off["guidance"], scope=router_template,
            negative_prompt=negative_prompt))

    def _watch(self, edit: dict, preview_every: int) -> StepWatch:
        """The router hears of every step of an edit (`edit`: its request and attempt; its clients may be
        streaming its progress) and sees its previews, when asked for, as PNGs."""
        def step(k: int, n: int) -> None:
            self._post({"kind": "progress", **edit, "step": k, "steps": n})

        def preview(k: int, image: Image.Image) -> None:
            self._post({"kind": "preview", **edit, "step": k}, {"png": png_bytes(image)})

        def unrecorded(reason: str) -> None:  # the router need not wait for its answer to send the next edits
            self._post({"kind": "unrecorded", **edit, "reason": reason})

        return StepWatch(step, preview_every, preview if preview_every else None, unrecorded)

    def _heartbeat(self) -> dict:
        running, queued = self.engine.load_report()
        with self._lock:
            running = [[self.requests[f], steps] for f, steps in running if f in self.requests]
            queued = [self.requests[f] for f in queued if f in self.requests]
            held = list(self.futures)  # every edit accepted and not yet answered, wherever it is
            # every template it records, or will, and has not yet reported
            recording = list(self.registrations) + [router_template for router_template, _, _ in self._bulk]
        return {"kind": "heartbeat", "running": running, "queued": queued, "held": held, "recording": recording,
                "seen": self._seen, "metrics": self.metrics(),
                "loras": self.engine.worker.loras.resident(), "lora_digests": self.engine.worker.loras.digests(),
                "cached": self._cached(),
                "draining": self.draining}

    def _disk_folder(self) -> Path | None:
        cache = self.engine.editor.cache
        return cache.disk.directory if isinstance(cache, CacheStore) and cache.disk is not None else None

    def _read_disk_names(self) -> dict[str, str]:
        folder = self._disk_folder()
        if folder is None or not (folder / DISK_NAMES).exists():
            return {}
        try:
            names = json.loads((folder / DISK_NAMES).read_bytes())
            return {str(router_id): str(editor_id) for router_id, editor_id in names.items()}
        except (OSError, ValueError, AttributeError) as exc:
            logger.warning("%s cannot be read (%s): the recordings in %s are adopted only as templates are sent "
                           "here to record", folder / DISK_NAMES, exc, folder)
            return {}

    def _on_disk(self) -> list[str]:
        """The router's ids of the templates whose recordings its disk tier holds (a restarted worker's: with
        `--template-replicas`, the router otherwise sent them to the worker that said hello first, to record)."""
        cache = self.engine.editor.cache
        if self._disk_folder() is None:
            return []
        with self._lock:
            names = list(self._disk_names.items())
        return [router_id for router_id, editor_id in names if cache.disk.contains(editor_id)]

    def _name_on_disk(self, router_template: str, template_id: str) -> None:
        """The router's id of a registered template the disk tier may hold (`_on_disk`), kept beside it by
        the socket thread (`_save_disk_names`): this runs on the loop's, which must not wait for a disk."""
        if self._disk_folder() is None:
            return
        with self._lock:
            if self._disk_names.get(router_template) != template_id:
                self._disk_names[router_template] = template_id
                self._disk_names_changed = True

    def _save_disk_names(self) -> None:
        folder = self._disk_folder()
        with self._lock:
            if not self._disk_names_changed or folder is None:
                return
            self._disk_names_changed = False
            cache = self.engine.editor.cache
            self._disk_names = {router_id: editor_id for router_id, editor_id in self._disk_names.items()
                                if editor_id in self.engine.editor.templates or cache.disk.contains(editor_id)}
            data = json.dumps(self._disk_names).encode()
        try:
            write_whole(folder / DISK_NAMES, data)
        except OSError as exc:  # a full disk: a restart records these templates again, as before
            logger.warning("the router's names of the recordings in %s could not be kept: %s", folder, exc)

    def _post_recorded(self, router_template: str) -> None:
        """Tell the router the template is recorded here, and what host memory holds now."""
        self._post({"kind": "template", "template": router_template, "ok": True, "cached": self._cached()})

    def _cached(self) -> list[str]:
        """The templates in host memory, by the router's ids (the editor names them its own way): said in
        each heartbeat, and in each answer and recording's end, after which it has likely changed."""
        cache = self.engine.editor.cache
        if not isinstance(cache, CacheStore):
            return []
        in_host = cache.in_host()
        with self._lock:
            router_ids: dict[str, list[str]] = {}
            for router_template, template_id in self.templates.items():
                router_ids.setdefault(template_id, []).append(router_template)
        return [name for template_id in in_host for name in router_ids.get(template_id, ())]

    def metrics(self) -> dict:
        """The engine's counters, with its template cache's under "cache" and its LoRA cache's under "lora"
        (what the heartbeat carries to the head, and the health port exposes)."""
        metrics = self.engine.metrics()
        cache = self.engine.editor.cache
        if isinstance(cache, CacheStore):
            metrics["cache"] = cache.metrics()  # CacheStore.metrics: cumulative counters and tier occupancy
        metrics["lora"] = self.engine.worker.loras.metrics()  # LoraManager.metrics: likewise, of the LoRA cache
        return metrics

    # ---- other threads ----

    def _answer(self, future: Future, router_template: str, trace: str, edit: dict) -> None:
        """Tell the router how an edit ended, and log it under the client's request id (`trace`). It counts
        as held (heartbeats) until its answer is queued: a slow encode is not an edit lost."""
        with self._lock:
            request_id = self.requests[future]
        try:
            self._post_answer(future, edit, router_template, trace)
        finally:
            with self._lock:
                self.requests.pop(future, None)
                if self.futures.get(request_id) is future:  # not a later copy of the same edit
                    del self.futures[request_id]

    def _post_answer(self, future: Future, edit: dict, router_template: str, trace: str) -> None:
        if future.cancelled():  # the router answered it when it cancelled; this closes the books
            logger.info("edit %s of %s cancelled", trace, router_template)
            self._post({"kind": "result", **edit, "status": 409, "error": "Cancelled",
                        "message": "the edit was cancelled"})
            return
        exc = future.exception()
        if exc is not None:
            logger.warning("edit %s of %s failed (%d): %s", trace, router_template, status_of(exc), exc)
            self._post({"kind": "result", **edit, "status": status_of(exc),
                        "error": type(exc).__name__, "message": str(exc)})
            return
        result: EditResult = future.result()
        metrics = result.metrics
        logger.info("edit %s of %s done: %d steps, %d/%d tokens computed, queued %.3fs, ran %.3fs", trace,
                    router_template, metrics.steps, metrics.computed_tokens, metrics.tokens, metrics.queue_s,
                    metrics.inference_s)
        if result.recorded is not None:  # a one-off's first edit recorded its image: later edits come here
            with self._lock:
                self.templates[router_template] = result.recorded
            self._post_recorded(router_template)
        unrecorded = {"unrecorded": result.unrecorded} if result.unrecorded is not None else {}
        self._post({"kind": "result", **edit, "status": 200, "metrics": result.metrics.to_json(), **unrecorded,
                    "cached": self._cached()}, {"png": png_bytes(result.image)})

    def _register(self, header: dict, blobs: dict) -> None:
        """Record a template as a member of the running batch; the router hears of each step and the end.
        Those sent in bulk are recorded one at a time, while the caches have room (`_start_bulk`)."""
        router_template = header["template"]
        if self.draining:  # sent before the router heard: not a failure of the template, another records it
            self._post({"kind": "template", "template": router_template, "ok": False, "draining": True})
            return
        with self._lock:
            if header.get("bulk"):
                self._bulk.append((router_template, header, blobs))
            else:  # asked for by name (an edit waits for it): not in its bulk turn any more
                self._bulk = deque(queued for queued in self._bulk if queued[0] != router_template)
        if header.get("bulk"):
            self._start_bulk()
            return
        self._record(router_template, self._template_of(router_template, header, blobs))

    def _template_of(self, router_template: str, header: dict, blobs: dict) -> Callable[[], Template]:
        return lambda: self.engine.editor.new_template(  # the router's id names its tenant
            decode_image(blobs["image"], f"template {router_template}"), header["prompt"], int(header["steps"]),
            int(header["seed"]), header["guidance"], scope=router_template,
            negative_prompt=header.get("negative_prompt"))

    def _start_bulk(self) -> None:
        """On the socket thread: start the next registration sent in bulk once none is under way (and the
        next after it, should it end at once). One at a time, so that each is recorded only if the caches
        still have room for it beside those recorded before it (`Engine.submit_recording(only_if_room=True)`);
        the others are known here and recorded by their first edit. A draining worker records none of them."""
        while self._bulk_recording is None or self._bulk_recording.done():
            with self._lock:
                if not self._bulk:
                    return
                router_template, header, blobs = self._bulk.popleft()
            if self.draining:
                self._post({"kind": "template", "template": router_template, "ok": False, "draining": True})
                continue
            self._bulk_recording = self._record(router_template, self._template_of(router_template, header, blobs),
                                                only_if_room=True)

    def _record(self, router_template: str, make_template: Callable[[], Template],
                only_if_room: bool = False) -> Future | None:
        """Record the template `make_template()` makes as a member of the running batch: the router hears
        of each step and of the end (a failure to start too); until then heartbeats say it is under way.
        The recording's future, or None when it could not start. `only_if_room`: `Engine.submit_recording`'s."""
        def progress(step: int, steps: int) -> None:
            self._post({"kind": "progress", "template": router_template, "step": step, "steps": steps})

        def recorded(future: Future) -> None:
            try:
                if future.cancelled():  # dropped meanwhile: the router forgot it already
                    return
                exc = future.exception()
                if exc is None:
                    with self._lock:
                        self.templates[router_template] = future.result()
                    self._name_on_disk(router_template, future.result())
                    self._post_recorded(router_template)
                else:
                    self._post({"kind": "template", "template": router_template, "ok": False,
                                "message": f"{type(exc).__name__}: {exc}", "draining": self.draining})
            finally:  # a recording counts as under way (heartbeats) until its end is queued
                with self._lock:
                    if self.registrations.get(router_template, (None, None))[1] is future:
                        del self.registrations[router_template]

        try:
            template = make_template()
            future = self.engine.submit_recording(template, on_step=progress, only_if_room=only_if_room)
        except Exception as exc:  # noqa: BLE001 - the router is told; the worker (and an edit beside) goes on
            self._post({"kind": "template", "template": router_template, "ok": False,
                        "message": f"{type(exc).__name__}: {exc}"})
            return None
        with self._lock:
            self.registrations[router_template] = (template.template_id, future)
        future.add_done_callback(recorded)
        return future

    def _drop(self, router_template: str) -> None:
        with self._lock:
            template_id = self.templates.pop(router_template, None)
            recording = self.registrations.pop(router_template, None)
            self._bulk = deque(queued for queued in self._bulk if queued[0] != router_template)
        for editor_template in {template_id, recording[0] if recording else None} - {None}:
            self.engine.drop_template(editor_template, wait=False)

    def _post(self, header: dict, blobs: dict | None = None) -> None:
        self._outgoing.put((header["kind"], wire.encode({**header, "worker": self.name}, blobs=blobs)))
        self._wakeup.wake()

    def _flush(self) -> None:
        """Send what is queued, in order, without blocking: what the socket will not take now (no router
        connected) waits for the next flush; heartbeats and hellos are dropped instead (newer ones follow)."""
        while True:
            try:
                self._unsent.append(self._outgoing.get_nowait())
            except queue.Empty:
                break
        while self._unsent:
            kind, frames = self._unsent[0]
            try:
                self.socket.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:  # heartbeats and hellos go out again anyway, newer
                self._unsent = deque(m for m in self._unsent if m[0] not in ("heartbeat", "hello"))
                return
            self._unsent.popleft()


def run_worker(opts: WorkerOptions) -> None:
    """Load the model, join the router, run the step loop until told to stop."""
    if opts.supervised:
        die_with_parent()  # the server is gone: so is this worker (and, with it, its helpers)
    name = opts.name or f"{socket.gethostname()}-{os.getpid()}"
    setup_logging(opts.log_level, process=name)
    # Ctrl-C reaches the whole process group; a supervised worker is drained and stopped by the
    # server, one on its own by the signal handler below.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keys = WorkerKeys.from_env()
    if opts.curve_secret is not None:
        keys = WorkerKeys.from_files(opts.curve_secret, opts.curve_server)
    device, dtype = resolve_device(opts.device, opts.dtype)
    health = HealthServer(opts.health_host, opts.health_port).start() if opts.health_port else None
    if opts.threads:
        torch.set_num_threads(opts.threads)
    config = EngineConfig(mode=opts.mode, max_batch=opts.max_batch, edit_slots=opts.edit_slots,
                          helpers=opts.helpers, helper_threads=opts.helper_threads,
                          helper_silence_s=opts.helper_silence_s,
                          run_dir=None if opts.run_dir is None else str(opts.run_dir),
                          lora_dir=None if opts.lora_dir is None else str(opts.lora_dir),
                          lora_cache_mb=opts.lora_cache_mb, lora_device_mb=opts.lora_device_mb,
                          lora_latest_step=opts.lora_latest_step)
    engine = Engine.load(opts.model, config, device=device, dtype=dtype, scheduler=opts.scheduler,
                         cache=CacheStore(opts.cache_config()),
                         compile=opts.compile, cuda_graphs=opts.cuda_graphs)
    if opts.compile or opts.cuda_graphs:
        # Before the worker says hello: the router sends it nothing while it compiles.
        print(f"{name}: compiling the mask-aware blocks (once per process)", file=sys.stderr, flush=True)
        engine.warm_up()
    # The step loop runs on this, the main thread, which loaded the model (see Engine.start); the
    # node's socket gets a thread of its own and closes the engine when told to stop.
    engine.start(own_thread=False)
    node = Node(engine, opts.connect, name, keys=keys, supervised=opts.supervised)
    if health is not None:
        health.node = node
    if not opts.supervised:
        signal.signal(signal.SIGTERM, lambda *_: node.stop())  # Kubernetes stops pods with SIGTERM
        signal.signal(signal.SIGINT, lambda *_: node.stop())
    thread = threading.Thread(target=node.run, name="retouch-node")
    thread.start()
    engine.run_loop()
    thread.join()
    if health is not None:
        health.close()
    if node.refused is not None:  # a configuration error: exit status 2, the reason in one line
        raise InputError(f"the router refused this worker: {node.refused}")


def main(argv: list[str] | None = None) -> int:
    """A worker `retouch serve` starts: its errors (a model that will not load, memory it cannot have) in one
    line, as `retouch worker` says them, not as tracebacks in the server's log."""
    from retouch.cli import reported

    parser = argparse.ArgumentParser(prog="python -m retouch.engine.node")
    add_arguments(parser, WorkerOptions)
    opts = from_arguments(WorkerOptions, parser.parse_args(argv))
    return reported(lambda: run_worker(opts) or 0)


if __name__ == "__main__":
    sys.exit(main())
