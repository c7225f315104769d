"""A worker's health server (`retouch worker --health-port`): readiness follows its node, without a process."""

import threading
from types import SimpleNamespace

import httpx

from retouch.engine.health import HealthServer


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
