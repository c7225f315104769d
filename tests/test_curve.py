"""Router-worker authentication with ZeroMQ CURVE: allowed workers join over an encrypted link,
others are refused; the router will not listen beyond loopback without keys."""

from __future__ import annotations

import pytest
import zmq
from scripted_worker import curve_router

from retouch.engine import wire
from retouch.engine.curve import AllowedKeys, RouterSecurity, WorkerKeys, generate, is_loopback, read_public
from retouch.engine.router import Router, RouterConfig
from retouch.errors import InputError


@pytest.mark.parametrize("address, loopback", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.3.2.1:0", True), ("tcp://localhost:1", True),
    ("tcp://[::1]:5555", True), ("ipc:///tmp/router", True), ("inproc://x", True),
    ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False), ("tcp://10.0.0.1:5555", False),
    ("tcp://[::]:5555", False), ("tcp://head.example:5555", False), ("tcp://eth0:5555", False),
])
def test_which_addresses_other_hosts_can_reach(address, loopback):
    assert is_loopback(address) is loopback


def test_the_router_refuses_to_listen_beyond_loopback_without_keys():
    with pytest.raises(InputError, match="without CURVE keys"):
        Router(RouterConfig(address="tcp://0.0.0.0:0"))


def test_keys_are_never_overwritten_and_bad_files_are_named(tmp_path):
    public, secret = generate("router", tmp_path)
    assert public.exists() and secret.stat().st_mode & 0o077 == 0  # the secret is the owner's alone
    with pytest.raises(InputError, match="exists"):
        generate("router", tmp_path)
    (tmp_path / "junk.key").write_text("not a certificate")
    with pytest.raises(InputError, match="junk.key"):
        read_public(tmp_path / "junk.key")
    with pytest.raises(InputError, match="secret"):
        RouterSecurity(public, AllowedKeys())  # a public file where the secret one belongs
    with pytest.raises(InputError, match="not a folder"):
        AllowedKeys.from_dir(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no \\*.key"):
        AllowedKeys.from_dir(tmp_path / "empty")


def hello(context: zmq.Context, address: str, keys: WorkerKeys | None, name: str) -> dict | None:
    """Say hello as worker `name`; the router's first answer, or None if it never answers."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.IDENTITY, f"{name}:1".encode())
    if keys is not None:
        keys.apply(socket)
    # A DEALER's send blocks while it has no connection, which a refused CURVE handshake can leave it
    # without: bounded, as a worker's own sends are (NOBLOCK), or the test hangs (it once held CI).
    socket.setsockopt(zmq.SNDTIMEO, 2000)
    socket.connect(address)
    try:
        socket.send_multipart(wire.encode({"kind": "hello", "protocol": wire.PROTOCOL, "worker": name, "max_batch": 1,
                                           "pid": 1}))
    except zmq.Again:
        socket.close()
        return None
    answer = wire.decode(socket.recv_multipart())[0] if socket.poll(2000) else None
    socket.close()
    return answer


def test_allowed_workers_join_and_others_are_refused(tmp_path, caplog):
    router = curve_router(tmp_path, "intruder")
    security = router.security
    context = zmq.Context()
    try:
        server = tmp_path / "router.key"
        allowed = WorkerKeys.from_files(tmp_path / "allowed" / "worker.key_secret", server)
        assert hello(context, router.address, allowed, "good")["kind"] == "welcome"
        intruder = WorkerKeys.from_files(tmp_path / "intruder.key_secret", server)
        with caplog.at_level("WARNING", logger="retouch.curve"):
            assert hello(context, router.address, intruder, "bad") is None
            assert hello(context, router.address, intruder, "bad") is None
        # the head says whom it refused, once per key (a refused worker retries every second)
        intruder_key = read_public(tmp_path / "intruder.key").decode()
        assert [r.getMessage() for r in caplog.records if intruder_key in r.getMessage()] == [
            f"refused a worker whose CURVE public key {intruder_key} is not in --curve-allowed"]
        assert hello(context, router.address, None, "plain") is None  # no CURVE at all
        snapshot = router.snapshot()
        assert set(snapshot["workers"]) == {"good"} and snapshot["counters"]["workers_refused"] >= 1
        # The server's own workers get a pair made for the run, allowed for it alone.
        env = security.local_worker_env()
        local = WorkerKeys(env["RETOUCH_CURVE_PUBLIC"].encode(), env["RETOUCH_CURVE_SECRET"].encode(),
                           env["RETOUCH_CURVE_SERVER"].encode())
        assert hello(context, router.address, local, "local")["kind"] == "welcome"
    finally:
        context.destroy(linger=0)
        router.close(drain_s=0)
