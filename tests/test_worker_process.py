"""`retouch worker` on its own: it says where it connects and when it joined (or that nobody answers yet);
its health port answers liveness while the model loads and readiness
once the router took it in; SIGTERM (how Kubernetes stops a pod) drains it, it says bye and the
router drops it at once instead of waiting for its heartbeats to stop."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
from polling import free_port, lines_until, wait_for
from scripted_worker import curve_router
from prometheus_client.parser import text_string_to_metric_families

from PIL import Image

from retouch.engine.policies import RequestLoad
from retouch.engine.router import EditTask, Router, RouterConfig, TemplateRecord
from retouch.images import png_bytes

TIMEOUT_S = 120.0


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
        # an edit, logged by the worker under the client's request id (the head's access log carries it too)
        router.register_template(TemplateRecord("tpl-traced", png_bytes(Image.new("RGB", (32, 32), "red")),
                                                (32, 32), "a room", 2, 0, None, replicas=0))
        mask = Image.new("L", (32, 32), 0)
        mask.paste(255, (0, 0, 16, 16))
        task = EditTask("tpl-traced", mask.tobytes(), (32, 32), "a hat", 1,
                        RequestLoad(image_tokens=4, masked_tokens=1, steps=2), trace="trace-7")
        assert router.submit(task).result(TIMEOUT_S).status == 200
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=TIMEOUT_S) == 0
        log.close()
        said = (tmp_path / "worker.log").read_text()
        assert f"solo: connecting to {router.address}" in said
        assert f"solo: joined the router at {router.address}" in said
        assert "INFO [solo] retouch.node: edit trace-7 of tpl-traced done: 2 steps" in said  # which worker
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


def worker_command(address: str, model: str, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "retouch.cli", "worker", "--connect", address, "--model", model, "--mode", "naive",
            "--threads", "1", "--name", name, *extra]


def test_a_worker_outlives_its_server_joins_the_next_once_and_another_model_is_refused(tmp_path):
    """A head restart (a new image, a crash) must not take the GPU fleet down with it: the head tells a
    worker started on its own that it is closing, the worker stays up and joins the head that follows on
    the same address, once (stale heartbeats once made it leave and join hundreds of times). A worker
    of another model is refused by name and exits with status 2, rather than serving other images."""
    address = f"tcp://127.0.0.1:{free_port()}"
    config = RouterConfig(address=address, policy="least-requests", heartbeat_s=0.2, dead_after_s=2.0,
                          model="tiny-flux-fill")
    first = Router(config).start()
    worker = subprocess.Popen(worker_command(address, "tiny-flux-fill", "solo"),
                              stderr=(log := open(tmp_path / "worker.log", "w")))
    second = None
    try:
        wait_for(lambda: "solo: joined the router" in (tmp_path / "worker.log").read_text(), "the worker's join",
                 TIMEOUT_S)
        assert first.snapshot()["workers"]["solo"]["info"]["model"] == "tiny-flux-fill"
        first.close(drain_s=0)
        second = Router(config).start()
        assert second.wait_until(lambda r: "solo" in r.workers, TIMEOUT_S), "the worker did not join the next head"
        # a few heartbeats later it is still there, never removed and joined again
        assert not second.wait_until(lambda r: r.snapshot()["counters"]["workers_removed"] > 0, 2.0)
        assert worker.poll() is None and "solo" in second.workers
        other = subprocess.run(worker_command(address, "tiny-sd3-inpaint", "other"), capture_output=True,
                               text=True, timeout=TIMEOUT_S)
        assert other.returncode == 2, other.stderr
        assert "it serves the model 'tiny-sd3-inpaint', this server 'tiny-flux-fill'" in other.stderr
        assert "Traceback" not in other.stderr and set(second.workers) == {"solo"}
        assert second.snapshot()["counters"]["workers_mismatched"] == 1
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=TIMEOUT_S) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
        log.close()
        for router in (first, second):
            if router is not None:
                router.close(drain_s=0)
    said = (tmp_path / "worker.log").read_text()
    assert f"solo: the router at {address} is shutting down; joining again when it answers" in said, said
    assert said.count(f"solo: joined the router at {address}") == 2


def test_a_worker_the_router_refuses_by_its_curve_key_says_so_and_stops_on_sigterm(tmp_path):
    """The router drops a worker whose key it does not allow: the worker's sends once blocked forever,
    so it never said it was not joining and ignored SIGTERM."""
    router = curve_router(tmp_path, "rogue")
    worker = subprocess.Popen(worker_command(router.address, "tiny-flux-fill", "rogue", "--curve-secret",
                                             str(tmp_path / "rogue.key_secret"), "--curve-server",
                                             str(tmp_path / "router.key")), stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(TIMEOUT_S, worker.kill)
    watchdog.start()
    try:
        said = lines_until(worker.stderr, "no router has answered")
        assert said and "matching CURVE keys?" in said[-1], said
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
        assert router.snapshot()["counters"]["workers_refused"] >= 1 and not router.workers
    finally:
        watchdog.cancel()
        if worker.poll() is None:
            worker.kill()
        router.close(drain_s=0)


def test_sigterm_drains_the_accepted_edits_while_the_router_sends_nothing_new(tmp_path, caplog):
    """Kubernetes stops a worker with SIGTERM (a rolling update): it finishes what it accepted. Its
    heartbeats went silent meanwhile, so a drain longer than dead_after_s got it removed and its edits
    computed again elsewhere; and the router kept sending it new ones."""
    caplog.set_level("INFO", logger="retouch.router")
    router = Router(RouterConfig(address="tcp://127.0.0.1:0", policy="least-requests", heartbeat_s=0.1,
                                 dead_after_s=1.0)).start()
    worker = subprocess.Popen(worker_command(router.address, "tiny-flux-fill", "solo"),
                              stderr=(log := open(tmp_path / "worker.log", "w")))
    try:
        assert router.wait_until(lambda r: "solo" in r.workers, TIMEOUT_S), "the worker never joined"
        steps = 600  # seconds of denoising on this CPU: a drain longer than dead_after_s
        image = png_bytes(Image.new("RGB", (128, 128), "red"))
        router.register_template(TemplateRecord("tpl-long", image, (128, 128), "a room", steps, 0, None, replicas=0))
        assert router.wait_until(lambda r: r.template("tpl-long")["status"] == "ready", TIMEOUT_S)
        mask = Image.new("L", (128, 128), 0)
        mask.paste(255, (0, 0, 64, 64))
        task = EditTask("tpl-long", mask.tobytes(), (128, 128), "a hat", 1,
                        RequestLoad(image_tokens=64, masked_tokens=16, steps=steps))
        accepted = router.submit(task)
        [request_id] = router.pending
        wait_for(lambda: (router.request_status(request_id) or {}).get("status") == "running", "the edit runs",
                 TIMEOUT_S)
        worker.send_signal(signal.SIGTERM)
        assert router.wait_until(lambda r: r.workers["solo"].draining, TIMEOUT_S)
        later = router.submit(task)  # not for a worker that is stopping: it waits for another
        assert accepted.result(TIMEOUT_S).status == 200
        assert worker.wait(timeout=TIMEOUT_S) == 0
        assert later.done() is False
        lines = [r.getMessage() for r in caplog.records if r.name == "retouch.router"]
        assert any("solo left: it said bye" in line for line in lines), lines
        assert "worker solo is draining: it finishes its 1 edits and 0 recordings" in lines, lines
        assert not any("no heartbeat" in line for line in lines), lines
    finally:
        if worker.poll() is None:
            worker.kill()
        log.close()
        router.close(drain_s=0)
