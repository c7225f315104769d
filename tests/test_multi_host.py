"""Two hosts on one machine: network namespaces joined by a veth pair. The router (with the HTTP
frontend and one local worker) lives in one, a `retouch worker` in the other joins over TCP with
CURVE. Edits run on both; a worker whose key is not allowed is refused; cutting the link re-routes
the remote worker's edits to the local one and loses none."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import zmq
from PIL import Image
from polling import wait_for

from retouch.config import ServeOptions
from retouch.engine import wire
from retouch.engine.curve import WorkerKeys, generate
from retouch.images import png_bytes
from retouch.server import Server

CLONE_NEWNET = 0x40000000
SUFFIX = f"{os.getpid() % 100000}"
NS_HEAD, NS_REMOTE = f"rt-head-{SUFFIX}", f"rt-remote-{SUFFIX}"
VETH_HEAD, VETH_REMOTE = f"rth{SUFFIX}", f"rtr{SUFFIX}"
HEAD_IP, REMOTE_IP = "10.213.7.1", "10.213.7.2"
SIZE = (48, 32)
STEPS = 120  # long enough that an edit is still running on the remote worker when the link goes down
TIMEOUT_S = 180.0


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def namespaces():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN)")
    try:
        ip("netns", "add", NS_HEAD)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot create a network namespace here: {getattr(exc, 'stderr', exc)}")
    try:
        ip("netns", "add", NS_REMOTE)
        ip("link", "add", VETH_HEAD, "type", "veth", "peer", "name", VETH_REMOTE)
        ip("link", "set", VETH_HEAD, "netns", NS_HEAD)
        ip("link", "set", VETH_REMOTE, "netns", NS_REMOTE)
        for ns, veth, address in ((NS_HEAD, VETH_HEAD, HEAD_IP), (NS_REMOTE, VETH_REMOTE, REMOTE_IP)):
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", veth)
            ip("-n", ns, "link", "set", veth, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        for ns in (NS_HEAD, NS_REMOTE):  # the veth pair goes with them
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def in_namespace(name: str, work):
    """Run `work()` on a thread inside network namespace `name`: every socket it (and any thread or
    process it starts) opens lives there. Returns its result or raises its exception."""
    outcome = {}

    def target():
        fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns failed")
        finally:
            os.close(fd)
        try:
            outcome["result"] = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def refused(address: str, keys: WorkerKeys) -> bool:
    """A worker with `keys` says hello and hears nothing back."""
    context = zmq.Context()
    try:
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IDENTITY, b"intruder:1")
        keys.apply(socket)
        socket.setsockopt(zmq.SNDTIMEO, 3000)  # a refused handshake can leave the DEALER's send blocked
        socket.connect(address)
        try:
            socket.send_multipart(wire.encode({"kind": "hello", "worker": "intruder", "max_batch": 1, "pid": 1}))
        except zmq.Again:
            return True
        return socket.poll(3000) == 0
    finally:
        context.destroy(linger=0)


def test_a_worker_on_another_host_joins_with_curve_and_a_cut_link_loses_nothing(namespaces, tmp_path):
    generate("router", tmp_path)
    generate("remote", tmp_path / "allowed")
    generate("intruder", tmp_path)
    opts = ServeOptions(model="tiny-flux-fill", workers=1, port=0, mode="naive", worker_threads=1, steps=STEPS,
                        policy="round-robin", worker_listen=f"tcp://{HEAD_IP}:0", heartbeat_s=0.2,
                        dead_after_s=2.0, curve_secret=tmp_path / "router.key_secret",
                        curve_allowed=tmp_path / "allowed")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (SIZE[1], SIZE[0], 3), np.uint8))
    mask = Image.new("L", SIZE, 0)
    mask.paste(255, (8, 8, 24, 24))
    remote = None

    def scenario() -> None:
        nonlocal remote
        with Server(opts).start() as server, httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as client:
            remote = subprocess.Popen(
                ["ip", "netns", "exec", NS_REMOTE, sys.executable, "-m", "retouch.cli", "worker",
                 "--connect", server.router.address, "--model", "tiny-flux-fill", "--mode", "naive", "--threads", "1",
                 "--name", "remote", "--curve-secret", str(tmp_path / "allowed" / "remote.key_secret"),
                 "--curve-server", str(tmp_path / "router.key")])
            wait_for(lambda: "remote" in server.router.snapshot()["workers"], "the remote worker joins", TIMEOUT_S)
            intruder = WorkerKeys.from_files(tmp_path / "intruder.key_secret", tmp_path / "router.key")
            assert in_namespace(NS_REMOTE, lambda: refused(server.router.address, intruder))
            assert server.router.snapshot()["counters"]["workers_refused"] >= 1
            assert set(server.router.snapshot()["workers"]) == {"w0", "remote"}

            registered = client.post("/v1/templates", data={"prompt": "a field"},
                                     files={"image": ("t.png", png_bytes(image))}).json()
            template = client.get(f"/v1/templates/{registered['id']}", params={"wait": 60}).json()
            wait_for(lambda: client.get(f"/v1/templates/{registered['id']}").json()["progress"]["workers_ready"] == 2,
                     "both workers record the template", TIMEOUT_S)

            def edit(seed: int) -> httpx.Response:
                return client.post("/v1/edits", data={"template_id": template["id"], "prompt": "a hat", "seed": seed},
                                   files={"mask": ("m.png", png_bytes(mask))})

            with ThreadPoolExecutor(4) as pool:  # threads started here are in the head's namespace too
                first = list(pool.map(edit, range(4)))
                assert [r.status_code for r in first] == [200] * 4
                wait_for(lambda: server.router.snapshot()["workers"]["remote"].get("completed", 0) >= 1,
                         "the remote worker answers some (its heartbeat says so)", 10)

                answers = [pool.submit(edit, 10 + seed) for seed in range(4)]
                wait_for(lambda: any(status and status.get("worker") == "remote" and status["status"] == "running"
                                     for status in map(server.router.request_status, list(server.router.pending))),
                         "an edit runs on the remote worker", TIMEOUT_S)
                ip("-n", NS_HEAD, "link", "set", VETH_HEAD, "down")
                statuses = [future.result().status_code for future in answers]
            assert statuses == [200] * 4  # lost: none; the remote worker's edits finished on w0
            snapshot = server.router.snapshot()
            assert "remote" not in snapshot["workers"] and snapshot["counters"]["rerouted"] >= 1

    try:
        in_namespace(NS_HEAD, scenario)
    finally:
        if remote is not None:
            remote.kill()
            remote.wait()
