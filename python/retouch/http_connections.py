"""Connections and request bodies that must not hold the server: slow or abusive clients.

uvicorn's h11 protocol (0.54) has no read timeouts: a client that connects and sends nothing, half
its headers, or headers and part of a body holds a connection (and, with a body, a handler) forever.
`guarded_protocol` closes such connections and refuses connections beyond a maximum:

    uvicorn.Config(app, http=guarded_protocol(header_timeout_s=10, body_timeout_s=120, max_connections=1024))

`ReserveBody` is an ASGI middleware that keeps the bytes of request bodies in flight under a
budget: a request reserves its Content-Length (a body of unknown length, the most an upload may be)
when it starts, and gets 503 when that would exceed the budget.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("retouch.http")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with deadlines on reading a request (h11's `their_state` tells the
    phase: IDLE = headers, SEND_BODY = body, DONE = read) and a cap on open connections.

    headers: complete `header_timeout_s` after the connection opened or, on a kept-alive
             connection, after the first byte of the next request (an idle kept-alive connection is
             closed by uvicorn's own `timeout_keep_alive`).
    body:    complete `body_timeout_s` after its headers.
    A connection beyond `max_connections` is closed as soon as it is accepted.
    Every connection gets TCP_NODELAY: asyncio sets it only on sockets whose `proto` says TCP, and a
    listener made with socket.socket(AF_INET) has proto 0; without it an answer's body waits for the
    ACK of its headers, and the client's delayed ACK adds 40 ms to every small answer."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 120.0
    max_connections: int = 1024
    on_close: Callable[[str], None] | None = None  # told why it closed one (metrics)

    _deadline: asyncio.TimerHandle | None = None
    _phase: str | None = None  # "headers", "body" or None: which deadline is armed

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse gets the API's JSON error body (uvicorn's is plain text)."""
        body = json.dumps({"error": {"message": msg, "type": "invalid_request_error", "param": None,
                                     "code": "malformed_http"}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
        if self.cycle is not None and not self.cycle.response_complete:
            # A request whose headers parsed and whose body did not: its handler runs. This 400 is its
            # answer, so the handler's own one must go nowhere (as after a disconnect, which uvicorn only
            # marks once the close is processed) instead of failing in h11 with a logged traceback.
            self.cycle.disconnected = True
            self.cycle.message_event.set()

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:  # this one is already counted
            logger.debug("refusing a connection: %d open", len(self.connections) - 1)
            transport.close()
            self._closed("over_cap")
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm("headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.transport.is_closing():
            self._arm(None)
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            # Between requests nothing is armed until bytes of the next one arrive.
            started = self._phase == "headers" or bool(self.conn.trailing_data[0])
            self._arm("headers" if started else None)
        elif state is h11.SEND_BODY:
            self._arm("body")
        else:
            self._arm(None)

    def _arm(self, phase: str | None) -> None:
        if phase == self._phase:
            return
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None:
            timeout = self.header_timeout_s if phase == "headers" else self.body_timeout_s
            self._deadline = self.loop.call_later(timeout, self._timed_out, phase)

    def _timed_out(self, phase: str) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            logger.debug("closing a connection whose request %s did not arrive in time", phase)
            # Closing reaches a handler reading the body as a disconnect.
            self.transport.close()
            self._closed("header_timeout" if phase == "headers" else "body_timeout")

    def _closed(self, reason: str) -> None:
        if self.on_close is not None:
            self.on_close(reason)


def guarded_protocol(header_timeout_s: float, body_timeout_s: float, max_connections: int,
                     on_close: Callable[[str], None] | None = None) -> type[H11Protocol]:
    """An h11 protocol class for `uvicorn.Config(http=...)` with these read deadlines and cap;
    `on_close(reason)` is told of every connection it closes (header_timeout, body_timeout, over_cap)."""
    if header_timeout_s <= 0 or body_timeout_s <= 0:
        raise ValueError(f"timeouts must be positive, got {header_timeout_s} and {body_timeout_s}")
    if max_connections < 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections}")
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {
        "header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s, "max_connections": max_connections,
        "on_close": staticmethod(on_close) if on_close is not None else None})


@dataclass
class BodyBudget:
    """Bytes of request bodies the server is handling at once. Touched only from the event loop."""

    max_bytes: int
    reserved: int = 0

    def reserve(self, nbytes: int) -> bool:
        if self.reserved + nbytes > self.max_bytes:
            return False
        self.reserved += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.reserved -= nbytes


def body_bytes(headers: list[tuple[bytes, bytes]], unknown_length_bytes: int) -> int:
    """What a request's body may bring: its Content-Length; `unknown_length_bytes` for a chunked body;
    0 without either (no body)."""
    fields = dict(headers)
    length = fields.get(b"content-length")
    if length is not None and length.isdigit():
        return int(length)
    return unknown_length_bytes if b"transfer-encoding" in fields else 0


class ReserveBody:
    """Reserve each request's body in `budget` for as long as the request is handled; answer with
    `refusal()` (an ASGI app: 503 and Retry-After) when it does not fit."""

    def __init__(self, app, budget: BodyBudget, unknown_length_bytes: int, refusal: Callable,
                 on_change: Callable[[int], None] | None = None):
        self.app, self.budget, self.unknown_length_bytes = app, budget, unknown_length_bytes
        self.refusal, self.on_change = refusal, on_change

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        nbytes = body_bytes(scope["headers"], self.unknown_length_bytes)
        if nbytes == 0:
            return await self.app(scope, receive, send)
        if not self.budget.reserve(nbytes):
            return await self.refusal()(scope, receive, send)
        self._changed()
        try:
            await self.app(scope, receive, send)
        finally:
            self.budget.release(nbytes)
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.budget.reserved)
