"""`retouch worker` on its own: it says where it connects and when it joined (or that nobody answers yet);
its health port answers liveness while the model loads and readiness
once the router took it in; SIGTERM (how Kubernetes stops a pod) drains it, it says bye and the
router drops it at once instead of waiting for its heartbeats to stop."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
from polling import lines_until
from prometheus_client.parser import text_string_to_metric_families

from retouch.engine.router import Router, RouterConfig

TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_standalone_worker_reports_health_and_leaves_cleanly_on_sigterm(tmp_path):
    router = Router(RouterConfig(address="tcp://127.0.0.1:0", policy="least-requests", heartbeat_s=0.2,
                                 dead_after_s=60.0)).start()
    port = free_port()
    worker = subprocess.Popen([sys.executable, "-m", "retouch.cli", "worker", "--connect", router.address,
                               "--model", "tiny-flux-fill", "--mode", "naive", "--threads", "1", "--name", "solo",
                               "--health-port", str(port), "--health-host", "127.0.0.1"],
                              stderr=(log := open(tmp_path / "worker.log", "w")))  # a file: a pipe could fill up
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
        # what the head shows of it, under the same names: its loop, its template cache, its LoRA cache
        [budget] = families["retouch_worker_cache_host_budget_bytes"].samples
        assert budget.labels == {"worker": "solo"} and budget.value == 4 << 30  # --cache-host-gib's default
        assert families["retouch_worker_steps"].type == "counter"
        assert families["retouch_worker_queued"].samples[0].value == 0
        assert families["retouch_worker_cache_adoptions"].samples[0].value == 0
        assert "retouch_worker_lora_budget_bytes" in families
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=TIMEOUT_S) == 0
        log.close()
        said = (tmp_path / "worker.log").read_text()
        assert f"solo: connecting to {router.address}" in said
        assert f"solo: joined the router at {router.address}" in said
        assert "no router has answered" not in said
        assert router.wait_until(lambda r: "solo" not in r.workers, 10)  # its bye, not the 60 s silence
        assert router.snapshot()["counters"]["workers_removed"] == 1
    finally:
        if worker.poll() is None:
            worker.kill()
        router.close(drain_s=0)


def test_a_worker_no_router_answers_says_so_and_a_bad_address_is_refused():
    """Nothing listens at the port: the worker says it is still trying (it was silent forever), and SIGTERM
    still stops it. An address without a valid port is refused before the model loads (it was an internal
    error after it, or a silent hang)."""
    port = free_port()
    worker = subprocess.Popen([sys.executable, "-m", "retouch.cli", "worker", "--connect", f"tcp://127.0.0.1:{port}",
                               "--model", "tiny-flux-fill", "--mode", "naive", "--threads", "1", "--name", "alone"],
                              stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(TIMEOUT_S, worker.kill)  # a worker that stalls silently ends the read below
    watchdog.start()
    try:
        said = lines_until(worker.stderr, "no router has answered")
        assert said and said[-1].startswith(f"alone: no router has answered at tcp://127.0.0.1:{port}"), said
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=TIMEOUT_S) == 0
    finally:
        watchdog.cancel()
        if worker.poll() is None:
            worker.kill()
    for address in ("tcp://127.0.0.1", "tcp://127.0.0.1:0", "tcp://127.0.0.1:99999"):
        refused = subprocess.run([sys.executable, "-m", "retouch.cli", "worker", "--connect", address, "--model",
                                  "tiny-flux-fill"], capture_output=True, text=True, timeout=TIMEOUT_S)
        assert refused.returncode == 2 and "--connect must be tcp://HOST:PORT" in refused.stderr, refused.stderr
