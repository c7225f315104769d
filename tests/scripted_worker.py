"""A worker driven by the test: a DEALER socket that speaks the router's wire protocol (hello,
heartbeat, template, result, ping) and keeps what the router sends it in an inbox."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import zmq

from retouch.engine import wire
from retouch.engine.router import Router, RouterConfig

TIMEOUT_S = 10.0


class ScriptedWorker:
    def __init__(self, context: zmq.Context, router: Router, name: str, max_batch: int = 4, welcome: str = "welcome",
                 identity: str | None = None, **hello):
        """Joins the router (`hello`: more of what a worker says: model, dtype, weights, lora, ...) and
        waits for its answer, `welcome` or (refused) `refused`. `identity`: its socket's (a process's),
        "NAME:1" by default."""
        self.name = name
        self.inbox: list[dict] = []
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, (identity or f"{name}:1").encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(router.address)
        self.send({"kind": "hello", "protocol": wire.PROTOCOL, "max_batch": max_batch, "pid": 1, **hello})
        self.answer_to_hello = self.receive(welcome)

    def send(self, header: dict, blobs: dict | None = None) -> None:
        self.socket.send_multipart(wire.encode({**header, "worker": self.name}, blobs=blobs))

    def receive(self, kind: str, keepalive: list[ScriptedWorker] = ()) -> dict:
        """The next message of `kind` (others stay in the inbox); `keepalive` workers heartbeat meanwhile."""
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            for index, message in enumerate(self.inbox):
                if message["kind"] == kind:
                    return self.inbox.pop(index)
            for worker in keepalive:
                worker.send({"kind": "heartbeat", "running": [], "queued": []})
            if self.socket.poll(50):
                header, _, blobs = wire.decode(self.socket.recv_multipart())
                self.inbox.append({**header, "blobs": blobs})
        raise AssertionError(f"{self.name} got no {kind!r} message")

    def pending_kinds(self) -> list[str]:
        while self.socket.poll(0):
            header, _, blobs = wire.decode(self.socket.recv_multipart())
            self.inbox.append({**header, "blobs": blobs})
        return [message["kind"] for message in self.inbox]

    def sync(self) -> None:
        """Return once the router has handled everything this worker sent."""
        self.send({"kind": "ping"})
        self.receive("pong")

    def register(self, template: str, ok: bool = True) -> None:
        message = self.receive("register")
        assert message["template"] == template
        self.send({"kind": "template", "template": template, "ok": ok, "message": "out of memory"})
        self.sync()

    def answer(self, request: int, png: bytes = b"png", attempt: int | None = None) -> None:
        """`attempt`: which sending of the edit this answers, as a node says (None: said not)."""
        self.send({"kind": "result", "request": request, "status": 200} | _attempt(attempt), {"png": png})

    def fail(self, request: int, status: int = 500, error: str = "RuntimeError", message: str = "it broke",
             attempt: int | None = None) -> None:
        self.send({"kind": "result", "request": request, "status": status, "error": error, "message": message}
                  | _attempt(attempt))

    def step(self, request: int, step: int, steps: int, attempt: int | None = None) -> None:
        self.send({"kind": "progress", "request": request, "step": step, "steps": steps} | _attempt(attempt))

    def answer_cancel(self) -> dict:
        """Receive the next cancel and answer it as a worker does (409 Cancelled); the cancel."""
        cancel = self.receive("cancel")
        self.fail(cancel["request"], 409, "Cancelled", "cancelled")
        return cancel

    def heartbeat(self, metrics: dict, running: list = (), queued: list = (), loras: list = (),
                  cached: list = ()) -> None:
        """A heartbeat carrying `metrics` (the worker's summary, with "cache": CacheStore.metrics()), the
        LoRAs it holds (`LoraManager.resident`) and the templates in its host memory (`CacheStore.in_host`)."""
        self.send({"kind": "heartbeat", "running": list(running), "queued": list(queued), "metrics": metrics,
                   "loras": list(loras), "cached": list(cached)})
        self.sync()


@contextmanager
def router_and_context() -> Iterator[tuple[Router, zmq.Context]]:
    """A router on loopback that scripted workers (made in the context) join; both closed after."""
    router = Router(RouterConfig(address="tcp://127.0.0.1:0", policy="least-requests", heartbeat_s=0.05,
                                 dead_after_s=60.0)).start()
    context = zmq.Context()
    try:
        yield router, context
    finally:
        router.close(drain_s=0)
        context.destroy(linger=0)


def curve_router(folder, outsider: str) -> Router:
    """A started router with CURVE keys made in `folder`: its own (router.key[_secret]), an allowed worker's
    (allowed/worker.key[_secret]) and `outsider`'s, which it does not allow."""
    from retouch.engine.curve import AllowedKeys, RouterSecurity, generate

    generate("router", folder)
    generate("worker", folder / "allowed")
    generate(outsider, folder)
    security = RouterSecurity(folder / "router.key_secret", AllowedKeys.from_dir(folder / "allowed"))
    return Router(RouterConfig(address="tcp://127.0.0.1:0", policy="least-requests", dead_after_s=60),
                  security=security).start()


def _attempt(attempt: int | None) -> dict:
    return {} if attempt is None else {"attempt": attempt}
