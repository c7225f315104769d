"""A worker process: one `Engine` (one GPU) behind a DEALER socket connected to the router.

    python -m retouch.engine.node --model tiny-flux-fill --router tcp://127.0.0.1:5555 --name w0

It says hello (its batch size), then answers the router's messages:
    register  record a template (on a thread of its own: recording is a whole generation), telling
              the router each recorded step, then ok or the error
    edit      submit an edit; the answer is a PNG, or an error with the HTTP status it maps to
    drop      forget a template
    stop      finish every accepted edit, say bye and exit
and heartbeats its running batch (each request's steps left) and queue every `heartbeat_s`.

The main thread owns the socket. Answers produced on other threads (the engine's futures, the
recording thread) are queued and the main thread is woken through an inproc socket.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future

import torch
import zmq
from PIL import Image

from retouch.cache import CacheStore
from retouch.editor import EditRequest
from retouch.engine import wire
from retouch.engine.api import Engine
from retouch.engine.wakeup import Wakeup
from retouch.engine.worker import EditResult, EngineConfig
from retouch.errors import InputError
from retouch.images import decode_image, png_bytes


def status_of(exc: BaseException) -> int:
    """The HTTP status an engine error maps to: the request's fault, or ours."""
    return 422 if isinstance(exc, InputError) else 500


class Node:
    def __init__(self, engine: Engine, router_address: str, name: str, heartbeat_s: float = 0.5):
        self.engine = engine
        self.name = name
        self.heartbeat_s = heartbeat_s
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, f"{name}:{os.getpid()}".encode())
        self.socket.setsockopt(zmq.LINGER, 2000)
        self.socket.connect(router_address)
        self._wakeup = Wakeup(self.context)
        self._lock = threading.Lock()
        self._outgoing: queue.SimpleQueue = queue.SimpleQueue()
        self.templates: dict[str, str] = {}  # router template id -> the editor's
        self.requests: dict[Future, int] = {}  # engine future -> router request id
        self._recordings: queue.SimpleQueue = queue.SimpleQueue()
        self._parent = os.getppid()

    # ---- the main thread ----

    def run(self) -> None:
        recorder = threading.Thread(target=self._record_templates, name="retouch-recorder", daemon=True)
        recorder.start()
        self._post({"kind": "hello", "max_batch": self.engine.config.max_batch, "pid": os.getpid(),
                    "model": self.engine.model_name})
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._wakeup.socket, zmq.POLLIN)
        next_heartbeat = 0.0
        stopping = False
        while True:
            timeout_ms = max(0, int((next_heartbeat - time.monotonic()) * 1000))
            events = dict(poller.poll(timeout_ms))
            if self._wakeup.socket in events:
                self._wakeup.drain()
            if self.socket in events:
                while self.socket.poll(0):
                    stopping |= self._on_message(self.socket.recv_multipart())
            self._flush()
            if time.monotonic() >= next_heartbeat:
                self._post(self._heartbeat())
                self._flush()
                next_heartbeat = time.monotonic() + self.heartbeat_s
            if stopping or os.getppid() != self._parent:  # told to stop, or the server is gone
                break
        self.engine.close()  # finishes every accepted edit; their answers are queued
        self._recordings.put(None)
        self._post({"kind": "bye"})
        self._flush()
        self.socket.close()
        self._wakeup.close()
        self.context.term()

    def _on_message(self, frames: list) -> bool:
        """Handle one message; True when told to stop."""
        try:
            header, _, blobs = wire.decode(frames)
            kind = header["kind"]
        except (wire.WireError, KeyError):
            return False
        if kind == "welcome":
            self.heartbeat_s = float(header["heartbeat_s"])
        elif kind == "edit":
            self._edit(header, blobs)
        elif kind in ("register", "drop"):
            self._recordings.put((header, blobs))
        return kind == "stop"

    def _edit(self, header: dict, blobs: dict) -> None:
        request_id = header["request"]
        template_id = self.templates.get(header["template"])
        if template_id is None:
            self._post({"kind": "result", "request": request_id, "status": 409, "error": "MissingTemplate",
                        "message": "this worker does not hold the template"})
            return
        try:
            mask = Image.frombytes("L", tuple(header["mask_size"]), blobs["mask"])
            future = self.engine.submit(EditRequest(template_id, mask, header["prompt"], int(header["seed"])))
        except Exception as exc:  # noqa: BLE001 - answered, never dropped
            self._post({"kind": "result", "request": request_id, "status": status_of(exc),
                        "error": type(exc).__name__, "message": str(exc)})
            return
        with self._lock:
            self.requests[future] = request_id
        future.add_done_callback(self._answer)

    def _heartbeat(self) -> dict:
        running, queued = self.engine.load_report()
        with self._lock:
            running = [[self.requests[f], steps] for f, steps in running if f in self.requests]
            queued = [self.requests[f] for f in queued if f in self.requests]
        metrics = self.engine.metrics()
        cache = self.engine.editor.cache
        if isinstance(cache, CacheStore):
            counters = cache.metrics()
            metrics.update(cache_hits=counters["hits"], cache_misses=counters["misses"],
                           cache_host_bytes=counters["host_bytes_used"], cache_disk_bytes=counters.get("disk_bytes_used", 0))
        return {"kind": "heartbeat", "running": running, "queued": queued, "metrics": metrics}

    # ---- other threads ----

    def _answer(self, future: Future) -> None:
        with self._lock:
            request_id = self.requests.pop(future)
        exc = future.exception()
        if exc is not None:
            self._post({"kind": "result", "request": request_id, "status": status_of(exc),
                        "error": type(exc).__name__, "message": str(exc)})
            return
        result: EditResult = future.result()
        self._post({"kind": "result", "request": request_id, "status": 200, "metrics": result.metrics.to_json()},
                   {"png": png_bytes(result.image)})

    def _record_templates(self) -> None:
        while (item := self._recordings.get()) is not None:
            header, blobs = item
            template = header["template"]
            if header["kind"] == "drop":
                if template in self.templates:
                    self.engine.drop_template(self.templates.pop(template))
                continue
            try:
                image = decode_image(blobs["image"], f"template {template}")
                self.templates[template] = self.engine.register_template(
                    image, header["prompt"], int(header["steps"]), int(header["seed"]), header["guidance"],
                    on_step=lambda step: self._post({"kind": "progress", "template": template, "step": step}))
                self._post({"kind": "template", "template": template, "ok": True})
            except Exception as exc:  # noqa: BLE001 - the router is told; the worker goes on
                self._post({"kind": "template", "template": template, "ok": False,
                            "message": f"{type(exc).__name__}: {exc}"})

    def _post(self, header: dict, blobs: dict | None = None) -> None:
        self._outgoing.put(wire.encode({**header, "worker": self.name}, blobs=blobs))
        self._wakeup.wake()

    def _flush(self) -> None:
        while True:
            try:
                frames = self._outgoing.get_nowait()
            except queue.Empty:
                return
            self.socket.send_multipart(frames)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m retouch.engine.node")
    parser.add_argument("--model", required=True)
    parser.add_argument("--router", required=True, help="the router's address (tcp://host:port or ipc://path)")
    parser.add_argument("--name", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--mode", default="disagg", choices=("static", "naive", "disagg"))
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--helpers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args(argv)
    # Ctrl-C reaches the whole process group; the parent drains and stops this process itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig(mode=args.mode, max_batch=args.max_batch, helpers=args.helpers)
    engine = Engine.load(args.model, config, device=args.device, dtype=getattr(torch, args.dtype)).start()
    Node(engine, args.router, args.name).run()


if __name__ == "__main__":
    main()
