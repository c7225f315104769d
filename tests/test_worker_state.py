"""What a worker process tells others, without a process: its health server's readiness follows its node
(`retouch worker --health-port`), and its node handles the router's word on its name."""

import math
import threading
from concurrent.futures import Future
from types import SimpleNamespace

import httpx

from retouch.engine import wire
from retouch.engine.health import HealthServer
from retouch.engine.node import Node


def test_readiness_is_lost_while_the_worker_drains():
    """A worker told to stop (SIGTERM) takes nothing new: it answered ready until its port closed."""
    health = HealthServer("127.0.0.1", 0).start()
    try:
        url = "http://{}:{}/readyz".format(*health.address)
        assert httpx.get(url).status_code == 503  # no node yet: the model loads
        welcomed = threading.Event()
        health.node = SimpleNamespace(welcomed=welcomed, draining=False)
        assert httpx.get(url).json() == {"status": "not ready"}  # not joined yet
        welcomed.set()
        assert (httpx.get(url).status_code, httpx.get(url).json()) == (200, {"status": "ready"})
        health.node.draining = True
        assert (httpx.get(url).status_code, httpx.get(url).json()) == (503, {"status": "draining"})
    finally:
        health.close()


def test_a_worker_whose_name_was_taken_meanwhile_drops_the_edits_it_holds():
    """Paused past dead_after_s (its edits sent elsewhere), it finds on waking that another process has its
    name: it can never rejoin to be told, so it computed its old edits for nobody."""
    node = Node.__new__(Node)  # the message handling only: no engine, no socket
    node.name, node.router_address, node._lock, node._seen = "w0", "tcp://head:5555", threading.Lock(), 0
    node._name_taken_said = -math.inf
    held = [Future(), Future()]
    node.futures = dict(enumerate(held))
    assert node._on_message(wire.encode({"kind": "name_taken", "pid": 7})) is False
    assert all(future.cancelled() for future in held)
