"""`retouch worker` on its own: its health port answers liveness while the model loads and readiness
once the router took it in; SIGTERM (how Kubernetes stops a pod) drains it, it says bye and the
router drops it at once instead of waiting for its heartbeats to stop."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from retouch.engine.router import Router, RouterConfig

TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_standalone_worker_reports_health_and_leaves_cleanly_on_sigterm():
    router = Router(RouterConfig(address="tcp://127.0.0.1:0", policy="least-requests", heartbeat_s=0.2,
                                 dead_after_s=60.0)).start()
    port = free_port()
    worker = subprocess.Popen([sys.executable, "-m", "retouch.cli", "worker", "--connect", router.address,
                               "--model", "tiny-flux-fill", "--mode", "naive", "--threads", "1", "--name", "solo",
                               "--health-port", str(port), "--health-host", "127.0.0.1"])
    try:
        health = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + TIMEOUT_S
        readiness = []
        while True:
            assert worker.poll() is None and time.monotonic() < deadline, "the worker never became ready"
            try:
                live = httpx.get(health + "/healthz", timeout=5)
                ready = httpx.get(health + "/readyz", timeout=5)
            except httpx.TransportError:  # the port is not open yet
                continue
            assert live.status_code == 200
            readiness.append(ready.status_code)
            if ready.status_code == 200:
                break
        assert set(readiness) <= {200, 503} and "solo" in router.snapshot()["workers"]
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(health + "/metrics").text)}
        assert families["retouch_worker_joined"].samples[0].value == 1.0
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=TIMEOUT_S) == 0
        assert router.wait_until(lambda r: "solo" not in r.workers, 10)  # its bye, not the 60 s silence
        assert router.snapshot()["counters"]["workers_removed"] == 1
    finally:
        if worker.poll() is None:
            worker.kill()
        router.close(drain_s=0)
