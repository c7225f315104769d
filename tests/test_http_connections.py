"""Slow, abusive and heavy clients against a real uvicorn server on loopback: connections that send
nothing, half their headers or part of a body are closed after their deadline while /healthz keeps
answering; connections beyond the cap are refused; request bodies beyond the in-flight budget get 503;
and hundreds of MB of b64_json answers go out without holding the event loop.

The only timings here are the /healthz latency checks (100 ms) the serving requirements name."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
import zmq
from PIL import Image
from scripted_worker import ScriptedWorker

from retouch.engine.router import Router, RouterConfig
from retouch.http_api import Limits, create_app
from retouch.http_connections import guarded_protocol

DEADLINE_S = 30.0  # for conditions polled by the tests; never reached when things work


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@contextmanager
def serving(app, limits: Limits) -> Iterator[tuple[str, int]]:
    """`app` under uvicorn with the guarded protocol, on a thread, as `retouch serve` runs it."""
    with serving_with_server(app, limits) as (address, _):
        yield address


@contextmanager
def serving_with_server(app, limits: Limits) -> Iterator[tuple[tuple[str, int], uvicorn.Server]]:
    """`serving`, and the uvicorn server (its `server_state.tasks`: the requests being handled)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(2048)  # connections wait in the backlog until uvicorn accepts: no start-up race
    server = uvicorn.Server(uvicorn.Config(
        # A keep-alive longer than any test: only the guarded protocol's deadlines close connections.
        app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5, timeout_keep_alive=600,
        http=guarded_protocol(limits.header_timeout_s, limits.body_timeout_s, limits.max_connections,
                              on_close=lambda reason: app.state.metrics.connections_closed.labels(reason).inc())))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        yield listener.getsockname(), server
    finally:
        server.should_exit = True
        thread.join(timeout=DEADLINE_S)


@contextmanager
def router_without_workers() -> Iterator[Router]:
    router = Router(RouterConfig(address="tcp://127.0.0.1:0")).start()
    try:
        yield router
    finally:
        router.close(drain_s=0)


def wait_closed(sockets: list[socket.socket]) -> tuple[list[socket.socket], dict[socket.socket, bytes]]:
    """Read from `sockets` until the server closes them (EOF or reset) or DEADLINE_S passes: those
    still open, and what each received."""
    open_, received = list(sockets), {sock: b"" for sock in sockets}
    deadline = time.monotonic() + DEADLINE_S
    while open_ and time.monotonic() < deadline:
        readable, _, _ = select.select(open_, [], [], 0.5)
        for sock in readable:
            try:
                data = sock.recv(1 << 16)
            except (ConnectionResetError, BrokenPipeError):
                data = b""
            received[sock] += data
            if not data:
                open_.remove(sock)
    return open_, received


def half_open(address: tuple[str, int], kind: int) -> socket.socket:
    """0: sends nothing; 1: half its headers; 2: headers and part of a multipart body; 3: a whole
    request, then half the headers of the next on the kept-alive connection."""
    sock = socket.create_connection(address)
    if kind == 1:
        sock.sendall(b"POST /v1/edits HTTP/1.1\r\nHost: retouch\r\nContent-Ty")
    elif kind == 2:
        sock.sendall(b"POST /v1/edits HTTP/1.1\r\nHost: retouch\r\nContent-Type: multipart/form-data; boundary=b\r\n"
                     b"Content-Length: 100000\r\n\r\n--b\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nx")
    elif kind == 3:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: retouch\r\n\r\nGET /healthz HTTP/1.1\r\nHo")
    return sock


def test_half_open_connections_are_closed_after_their_deadline_and_do_not_block_others():
    limits = Limits(header_timeout_s=1.0, body_timeout_s=1.0)
    with router_without_workers() as router, serving(app := create_app(router, limits), limits) as address:
        kinds = [i % 4 for i in range(200)]
        sockets = [half_open(address, kind) for kind in kinds]
        silent = [sock for sock, kind in zip(sockets, kinds) if kind != 3]  # kind 3 had one answer
        polls_while_open = 0
        with httpx.Client(base_url=f"http://{address[0]}:{address[1]}") as client:
            while True:
                assert client.get("/healthz").status_code == 200
                readable, _, _ = select.select(silent, [], [], 0)
                if readable:  # the deadlines have started closing them
                    break
                polls_while_open += 1
            # a server blocked by them would answer only once their deadlines closed them
            assert polls_while_open, "no poll was answered while the half-open connections were open"
            still_open, received = wait_closed(sockets)
            assert still_open == []
            assert client.get("/healthz").status_code == 200
            def closed(reason: str) -> float:
                return app.state.metrics.registry.get_sample_value("retouch_http_connections_closed_total",
                                                                   {"reason": reason})

            assert closed("header_timeout") == kinds.count(0) + kinds.count(1) + kinds.count(3)
            assert closed("body_timeout") == kinds.count(2)
        for sock, kind in zip(sockets, kinds):
            if kind == 3:
                assert received[sock].startswith(b"HTTP/1.1 200") and received[sock].count(b"HTTP/1.1") == 1
            else:
                assert received[sock] == b"", received[sock][:80]
            sock.close()


def test_a_request_that_is_not_http_gets_a_json_400():
    """h11's refusal of bytes that are not HTTP (uvicorn answers plain text) has the API's error body."""
    limits = Limits()
    with router_without_workers() as router, serving(create_app(router, limits), limits) as address:
        with socket.create_connection(address) as sock:
            sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            answer = bytearray()
            read_all(sock, answer)
    head, _, body = bytes(answer).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "malformed_http" and error["type"] == "invalid_request_error" and error["message"]


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("path", ["/v1/edits", "/healthz"])
def test_a_body_that_is_not_http_after_parsed_headers_gets_one_400_and_no_traceback(path):
    """The handler of a request whose headers parsed ran on after h11 refused its body: its own answer
    (415 here, or /healthz's 200) then failed inside h11, logged as "Exception in ASGI application"."""
    limits = Limits()
    logged = Records()
    try:
        with router_without_workers() as router, serving_with_server(create_app(router, limits), limits) as (
                address, server):
            logging.getLogger("uvicorn.error").addHandler(logged)  # after uvicorn's dictConfig, which clears them
            with socket.create_connection(address) as sock:
                sock.sendall(f"POST {path} HTTP/1.1\r\nHost: retouch\r\nContent-Type: application/json\r\n"
                             "Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n".encode())
                answer = bytearray()
                read_all(sock, answer)
            # The handler's end, after whatever it logs (its task was made before the 400 was sent).
            handlers = list(server.server_state.tasks)
            if handlers:
                asyncio.run_coroutine_threadsafe(asyncio.wait(handlers), handlers[0].get_loop()).result(DEADLINE_S)
    finally:
        logging.getLogger("uvicorn.error").removeHandler(logged)
    assert bytes(answer).startswith(b"HTTP/1.1 400") and bytes(answer).count(b"HTTP/1.1") == 1
    assert json.loads(bytes(answer).partition(b"\r\n\r\n")[2])["error"]["code"] == "malformed_http"
    assert [record.getMessage() for record in logged.records if record.levelno >= logging.ERROR] == []


@pytest.mark.parametrize("framing", [b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
                                     b"Content-Length: 5\r\nContent-Length: 6\r\n"])
def test_a_body_framed_two_ways_is_refused(framing):
    """A proxy in front could read where such a body ends otherwise than the server, and pass a request
    hidden in it (request smuggling)."""
    limits = Limits()
    body = b"0\r\n\r\n" if b"chunked" in framing else b"hello"
    with router_without_workers() as router, serving(create_app(router, limits), limits) as address:
        with socket.create_connection(address) as sock:
            sock.sendall(b"POST /v1/templates HTTP/1.1\r\nHost: retouch\r\n" + framing + b"Connection: close\r\n\r\n"
                         + body)
            answer = bytearray()
            read_all(sock, answer)
    head, _, rest = bytes(answer).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), head
    assert json.loads(rest)["error"]["code"] in ("ambiguous_body", "malformed_http")


def test_connections_beyond_the_cap_are_refused_until_one_closes():
    limits = Limits(header_timeout_s=60.0, max_connections=8)
    with router_without_workers() as router, serving(app := create_app(router, limits), limits) as address:
        held = [socket.create_connection(address) for _ in range(8)]
        refused = socket.create_connection(address)
        assert wait_closed([refused]) == ([], {refused: b""})
        assert app.state.metrics.registry.get_sample_value("retouch_http_connections_closed_total",
                                                           {"reason": "over_cap"}) >= 1
        readable, _, _ = select.select(held, [], [], 0)
        assert readable == []  # the eight are still open
        held.pop().close()
        deadline = time.monotonic() + DEADLINE_S
        while True:  # the server sees the close on its own time: retry until a connection is taken
            assert time.monotonic() < deadline, "no connection was taken after one closed"
            with socket.create_connection(address) as sock:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: retouch\r\nConnection: close\r\n\r\n")
                try:
                    answer = sock.recv(1 << 16)
                except ConnectionResetError:
                    answer = b""
            if answer:
                assert answer.startswith(b"HTTP/1.1 200")
                break
        for sock in [refused, *held]:
            sock.close()


async def over_the_body_budget() -> dict:
    limits = Limits(max_upload_bytes=1 << 20, max_inflight_bytes=1 << 20)
    router = Router(RouterConfig(address="tcp://127.0.0.1:0")).start()
    app = create_app(router, limits)
    go_on = asyncio.Event()

    async def slow_body():  # chunked: reserves max_upload_bytes until the request ends
        yield b'--b\r\nContent-Disposition: form-data; name="prompt"\r\n\r\n'
        await go_on.wait()
        yield b"x\r\n--b--\r\n"

    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
            holding = asyncio.create_task(client.post("/v1/edits", content=slow_body(), headers={
                "content-type": "multipart/form-data; boundary=b"}))
            deadline = time.monotonic() + DEADLINE_S
            while not app.state.metrics.registry.get_sample_value("retouch_http_inflight_body_bytes"):
                assert time.monotonic() < deadline, "the first request never reserved its body"
                await asyncio.sleep(0)  # let the first request reach the budget
            outcome = {"busy": await client.post("/v1/edits", data={"prompt": "x"}),
                       "bodiless while busy": await client.get("/healthz")}
            go_on.set()
            outcome["holding"] = await holding
            outcome["after"] = await client.post("/v1/edits", data={"prompt": "x"})
            outcome["metrics"] = (await client.get("/metrics")).text
    finally:
        await asyncio.to_thread(router.close, 0)
    return outcome


def test_request_bodies_beyond_the_in_flight_budget_get_503():
    outcome = asyncio.run(over_the_body_budget())
    busy = outcome["busy"]
    assert busy.status_code == 503 and busy.headers["Retry-After"] == "1"
    assert busy.json()["error"]["param"] == "body" and busy.json()["error"]["code"] == "server_busy"
    assert outcome["bodiless while busy"].status_code == 200
    assert outcome["holding"].status_code == 400  # its mask is missing: it got through
    assert outcome["after"].status_code == 415  # not multipart, but past the budget: released
    assert 'retouch_http_requests_total{endpoint="/v1/edits",status="503"} 1.0' in outcome["metrics"]
    assert "retouch_http_inflight_body_bytes 0.0" in outcome["metrics"]


IMAGES = 10
ANSWER_BYTES = 8 << 20  # per image: what a 4096x4096 PNG may weigh; the router does not decode it


def big_request(address: tuple[str, int], template_id: str) -> bytes:
    """The raw HTTP of POST /v1/images/edits, n=10, b64_json, Connection: close."""
    mask = png(Image.new("RGBA", (64, 64), (0, 0, 0, 0)))
    request = httpx.Client().build_request(
        "POST", f"http://{address[0]}:{address[1]}/v1/images/edits", headers={"Connection": "close"},
        data={"template_id": template_id, "prompt": "a cat", "n": str(IMAGES), "response_format": "b64_json"},
        files={"mask": ("m.png", mask, "image/png")})
    head = f"POST {request.url.raw_path.decode()} HTTP/1.1\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in request.headers.items()) + "\r\n"
    return head.encode() + request.read()


def read_all(sock: socket.socket, into: bytearray) -> None:
    """Receive until the server closes, with the GIL released in recv and little Python per MB."""
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    while received := sock.recv_into(buffer):
        into += view[:received]


def on_an_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def test_large_b64_json_answers_leave_the_event_loop_free(monkeypatch):
    """n large answers as b64_json: every large encode runs off the event loop (anyio's worker threads),
    and the server answers /healthz while it sends them."""
    limits = Limits(default_steps=2)
    router = Router(RouterConfig(address="tcp://127.0.0.1:0", policy="least-requests", heartbeat_s=0.05,
                                 dead_after_s=60.0)).start()
    context = zmq.Context()
    blob = os.urandom(ANSWER_BYTES)
    large_encodes = []  # per base64 encode of 64 KiB or more: did it run on the event loop?
    b64encode = base64.b64encode

    def recorded_b64encode(data, *args):
        if len(data) >= 1 << 16:
            large_encodes.append(on_an_event_loop())
        return b64encode(data, *args)

    monkeypatch.setattr(base64, "b64encode", recorded_b64encode)
    try:
        worker = ScriptedWorker(context, router, "w0")
        with serving(create_app(router, limits), limits) as address, \
                httpx.Client(base_url=f"http://{address[0]}:{address[1]}") as client:
            registered = client.post("/v1/templates", data={"steps": "2"},
                                     files={"image": ("t.png", png(Image.new("RGB", (64, 64), "red")), "image/png")})
            worker.register(registered.json()["id"])

            def answer_all():
                for _ in range(IMAGES):
                    worker.answer(worker.receive("edit")["request"], blob)

            answering = threading.Thread(target=answer_all)
            answering.start()
            response = bytearray()
            big = socket.create_connection(address)
            big.sendall(big_request(address, registered.json()["id"]))
            reading = threading.Thread(target=read_all, args=(big, response))
            reading.start()
            while_sending = 0
            while reading.is_alive():
                answered = not answering.is_alive() and router.snapshot()["pending"] == 0
                assert client.get("/healthz").status_code == 200
                while_sending += answered and reading.is_alive()
            reading.join()
            answering.join()
            big.close()
    finally:
        router.close(drain_s=0)
        context.destroy(linger=0)
    assert while_sending > 0, "no poll happened while the answers were encoded and sent"
    assert len(large_encodes) >= IMAGES * ANSWER_BYTES // (1 << 20)  # in chunks, not one call per image
    assert not any(large_encodes), f"{sum(large_encodes)} large base64 encodes ran on the event loop"

    body_starts = response.index(b"\r\n\r\n") + 4
    head = bytes(response[:body_starts])
    del response[:body_starts]  # the body, in place: 100+ MB are not copied again
    assert head.startswith(b"HTTP/1.1 200")
    assert f"content-length: {len(response)}".encode() in head.lower()
    data = json.loads(response)["data"]
    assert len(data) == IMAGES and all(base64.b64decode(item["b64_json"]) == blob for item in data)
