"""Nothing is left behind: a helper dies with its worker, a killed worker's folder goes with it, a
server stopped with Ctrl-C leaves no process and no folder; a killed helper is replaced and the
edit it held still gets its answer."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np
import pytest
from editor_inputs import square_mask, template_image
from PIL import Image
from polling import lines_until, wait_for

from retouch.config import ServeOptions
from retouch.editor import EditRequest
from retouch.engine.api import Engine
from retouch.engine.process_tree import (descendants, read_process, remove_stale_run_dirs, scan_processes,
                                         serve_processes)
from retouch.engine.worker import EngineConfig
from retouch.images import png_bytes
from retouch.server import Server

TIMEOUT_S = 120.0


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper does not count: it holds no memory, no files)."""
    info = read_process(pid)
    return info is not None and info.alive


def descendants_of(root: int) -> set[int]:
    return {info.pid for info in descendants(scan_processes(), root)}


def test_a_killed_workers_helpers_and_folder_go_with_it_and_its_replacement_serves():
    opts = ServeOptions(model="tiny-flux-fill", workers=1, port=0, mode="disagg", helpers=1, helper_threads=1,
                        worker_threads=1, steps=2, heartbeat_s=0.2, dead_after_s=3.0)
    with Server(opts).start() as server:
        run_dir = server.run_dir
        [worker] = server.supervisor.pids().values()
        helpers = set(serve_processes(server.serve_id)) - {worker}
        assert helpers and all(pid in descendants_of(worker) for pid in helpers)
        assert any(path.name.startswith("retouch-helpers-") for path in (run_dir / "w0").iterdir())
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: not any(alive(pid) for pid in helpers), "the dead worker's helpers exit", TIMEOUT_S)
        wait_for(lambda: not (run_dir / "w0").exists(), "the dead worker's folder is removed", TIMEOUT_S)
        wait_for(lambda: "w0.1" in server.router.snapshot()["workers"], "a replacement joins", TIMEOUT_S)
        image = Image.fromarray(np.full((32, 48, 3), 120, np.uint8))
        mask = Image.new("L", (48, 32), 0)
        mask.paste(255, (8, 8, 24, 24))
        answer = httpx.post(server.url + "/v1/edits", timeout=TIMEOUT_S, data={"prompt": "a hat"},
                            files={"image": ("i.png", png_bytes(image)), "mask": ("m.png", png_bytes(mask))})
        assert answer.status_code == 200, answer.text
        serve_id = server.serve_id
    assert serve_processes(serve_id) == [] and not run_dir.exists()


@pytest.fixture
def short_tmp():
    """A temporary folder with a short path: sockets live under it (108-byte Unix socket paths)."""
    path = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_ctrl_c_stops_the_server_with_no_process_or_folder_left(short_tmp):
    tmp_path = short_tmp
    command = [sys.executable, "-m", "retouch.cli", "serve", "--model", "tiny-flux-fill", "--workers", "2",
               "--port", "0", "--mode", "disagg", "--steps", "2", "--worker-threads", "1", "--helper-threads", "1"]
    env = dict(os.environ, TMPDIR=str(tmp_path))
    server = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        said = lines_until(server.stderr, "serving tiny-flux-fill on")
        assert server.poll() is None, "the server did not start: " + "".join(said)
        # The log names where workers join (a port-0 address is chosen at bind) and each worker that joined.
        assert re.search(r"workers join at tcp://127\.0\.0\.1:[1-9]", said[-1]), said[-1]
        assert sorted(re.findall(r"worker (w\d)\S* joined", "".join(said))) == ["w0", "w1"], said
        started = descendants_of(server.pid)
        assert len(started) >= 4  # two workers and a helper each
        assert any(tmp_path.glob("retouch-serve-*/w*/retouch-helpers-*"))
        # uvicorn's own records (a malformed request here) are lines of the serving log, not of a log of its own.
        host, port = re.search(r"serving tiny-flux-fill on http://([\d.]+):(\d+)", said[-1]).groups()
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"NOT HTTP\r\n\r\n")
            sock.recv(4096)
        logged = lines_until(server.stderr, "Invalid HTTP request")[-1]
        assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING uvicorn\.error: Invalid HTTP request", logged), logged
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=TIMEOUT_S) == 0
    finally:
        if server.poll() is None:
            server.kill()
    wait_for(lambda: not any(alive(pid) for pid in started), "every process the server started exits", 30)
    assert list(tmp_path.glob("retouch-*")) == []



def test_sigterm_while_the_workers_load_stops_everything_it_started(short_tmp):
    """Before it serves, a stopping server has nothing to drain: SIGTERM stops it as Ctrl-C does, with its
    workers and its folder (the default action left the folder behind)."""
    command = [sys.executable, "-m", "retouch.cli", "serve", "--model", "tiny-flux-fill", "--workers", "1",
               "--port", "0", "--mode", "disagg", "--steps", "2", "--worker-threads", "1", "--helper-threads", "1"]
    server = subprocess.Popen(command, env=dict(os.environ, TMPDIR=str(short_tmp)), stderr=subprocess.PIPE,
                              text=True)
    try:
        # its folder is made before its process: wait for both (a busy machine once ran the check between)
        wait_for(lambda: any(short_tmp.glob("retouch-serve-*/w0")) and descendants_of(server.pid),
                 "the worker starts", TIMEOUT_S)
        started = descendants_of(server.pid)
        assert started and server.poll() is None  # loading: "workers ready" not said yet
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=TIMEOUT_S) == 130
    finally:
        if server.poll() is None:
            server.kill()
    said = server.stderr.read()
    assert "Traceback" not in said and "serving tiny-flux-fill" not in said, said
    wait_for(lambda: not any(alive(pid) for pid in started), "every process the server started exits", 30)
    assert list(short_tmp.glob("retouch-*")) == []

def test_a_server_killed_outright_leaves_a_folder_the_next_one_removes(tmp_path):
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stale, live = tmp_path / f"retouch-serve-{orphan.pid}-x", tmp_path / f"retouch-serve-{os.getpid()}-y"
    (stale / "w0").mkdir(parents=True)
    live.mkdir()
    orphan.kill()
    orphan.wait()
    assert remove_stale_run_dirs(str(tmp_path)) == [stale]
    assert live.exists() and not stale.exists()
    # a worker started on its own keeps its helpers' sockets in a folder of its own, named likewise
    from retouch.engine.process_tree import HELPERS_DIR_PREFIX

    helpers_stale, helpers_live = (tmp_path / f"{HELPERS_DIR_PREFIX}{pid}-z" for pid in (orphan.pid, os.getpid()))
    helpers_stale.mkdir()
    helpers_live.mkdir()
    assert remove_stale_run_dirs(str(tmp_path), prefix=HELPERS_DIR_PREFIX) == [helpers_stale]
    assert helpers_live.exists() and live.exists()


def test_a_killed_helper_is_replaced_and_the_edit_it_held_is_answered(caplog):
    caplog.set_level("WARNING", logger="retouch.helpers")
    with Engine.load("tiny-flux-fill", EngineConfig(mode="disagg", max_batch=2, helpers=1, helper_threads=1)) as engine:
        template_id = engine.register_template(template_image(), prompt="a scene", steps=2, seed=3)
        request = EditRequest(template_id, square_mask(), "a hat", seed=1)
        before = engine.submit(request).result(timeout=TIMEOUT_S)
        helper = engine.helpers.processes[0]
        future = engine.submit(request)  # pre-processing, most likely in the helper we now kill
        helper.kill()
        helper.wait()
        after = future.result(timeout=TIMEOUT_S)
        assert engine.helpers.restarts == 1 and engine.helpers.processes[0].pid != helper.pid
    assert np.array_equal(np.asarray(after.image), np.asarray(before.image))
    # a warning, timestamped in a server's log, that a --log-level warning keeps
    assert [r.getMessage() for r in caplog.records if r.name == "retouch.helpers"] == [
        f"helper 0 exited with {helper.returncode}; starting a replacement"]


def test_a_stopped_helper_is_killed_and_replaced_and_the_edit_it_held_is_answered(caplog):
    """A helper that says nothing for `helper_silence_s` (here SIGSTOPped while it holds an edit's
    pre-processing) is killed and replaced, and the edit is answered: it waited for the request's timeout."""
    caplog.set_level("WARNING", logger="retouch.helpers")
    config = EngineConfig(mode="disagg", max_batch=2, helpers=1, helper_threads=1, helper_silence_s=2.0)
    with Engine.load("tiny-flux-fill", config) as engine:
        template_id = engine.register_template(template_image(), prompt="a scene", steps=2, seed=3)
        request = EditRequest(template_id, square_mask(), "a hat", seed=1)
        before = engine.submit(request).result(timeout=TIMEOUT_S)
        helper = engine.helpers.processes[0]
        os.kill(helper.pid, signal.SIGSTOP)
        after = engine.submit(request).result(timeout=TIMEOUT_S)
        assert helper.returncode == -signal.SIGKILL and engine.metrics()["helper_restarts"] == 1
    assert engine.metrics()["helper_restarts"] == 1  # a counter: closing the pool keeps it
    assert np.array_equal(np.asarray(after.image), np.asarray(before.image))
    said = [r.getMessage() for r in caplog.records if r.name == "retouch.helpers"]
    assert re.fullmatch(r"helper 0 has said nothing for \d+ s \(stopped or hung\); killing it", said[0]), said
    assert said[1:] == [f"helper 0 exited with {-signal.SIGKILL}; starting a replacement"]


def test_helpers_are_not_taken_for_silent_after_their_worker_was_paused():
    """A worker stopped (SIGSTOP, a frozen VM) for longer than the bound finds, on resuming, helpers it has
    not heard from: their messages wait unread. It gives them a fresh bound rather than killing them."""
    config = EngineConfig(mode="disagg", max_batch=2, helpers=1, helper_threads=1, helper_silence_s=30.0)
    with Engine.load("tiny-flux-fill", config) as engine:
        pool = engine.helpers
        template_id = engine.register_template(template_image(), prompt="a scene", steps=2, seed=3)
        with pool._lock:  # as if the whole process had been stopped for a minute
            pool._judged_at -= 60
            pool._heard = [heard - 60 for heard in pool._heard]
        pool._kill_the_silent()
        assert pool.processes[0].poll() is None and pool.restarts == 0
        engine.submit(EditRequest(template_id, square_mask(), "a hat", seed=1)).result(timeout=TIMEOUT_S)
        assert pool.restarts == 0


def test_a_busy_helper_is_not_taken_for_a_silent_one():
    """A helper's 'alive' messages come from a thread of their own: one busy with the VAE and the text
    encoders for longer than its silence bound (1536 px pictures, ~2 s a job here; 1 s) is left alone."""
    config = EngineConfig(mode="disagg", max_batch=2, helpers=1, helper_threads=1, helper_silence_s=1.0)
    side = 1536
    image = template_image().resize((side, side))
    mask = square_mask().resize((side, side))
    with Engine.load("tiny-flux-fill", config) as engine:
        template_id = engine.register_template(image, prompt="a scene", steps=2, seed=3)
        engine.submit(EditRequest(template_id, mask, "a hat", seed=1)).result(timeout=TIMEOUT_S)
        assert engine.helpers.restarts == 0


def test_a_helper_skips_work_cancelled_before_it_starts_it():
    """A dropped recording or a cancelled edit still queued at a helper costs no VAE encode: the helper skips
    it. The helper is stopped (SIGSTOP) while two edits queue behind each other and the second is cancelled."""
    with Engine.load("tiny-flux-fill", EngineConfig(mode="disagg", max_batch=2, helpers=1, helper_threads=1)) as engine:
        template_id = engine.register_template(template_image(), prompt="a scene", steps=2, seed=3)
        request = EditRequest(template_id, square_mask(), "a hat", seed=1)
        helper = engine.helpers.processes[0]
        os.kill(helper.pid, signal.SIGSTOP)
        try:
            kept, cancelled = engine.submit(request), engine.submit(request)
            assert cancelled.cancel()
        finally:
            os.kill(helper.pid, signal.SIGCONT)
        kept.result(timeout=TIMEOUT_S)  # post-processed by the same helper, after it passed the cancelled job
        assert engine.helpers.skipped == 1 and engine.helpers.restarts == 0


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_helper_dies_with_its_parent_however_the_parent_dies(tmp_path, signum):
    """The parent-death signal, alone: a parent that cannot clean up (SIGKILL) still takes its child."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "from retouch.engine.process_tree import child_env\n"
        "child = subprocess.Popen([sys.executable, '-c', 'from retouch.engine.process_tree import die_with_parent;"
        " die_with_parent(); import time; time.sleep(120)'], env=child_env())\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.send_signal(signum)
    parent.wait(timeout=30)
    wait_for(lambda: not alive(child), "the child exits with its parent", 30)


def disk_tier_server(tmp_path) -> Server:
    return Server(ServeOptions(model="tiny-flux-fill", workers=1, port=0, mode="naive", worker_threads=1, steps=2,
                               heartbeat_s=0.2, dead_after_s=3.0, cache_disk_dir=tmp_path / "cache"))


def register_and_edit(client: httpx.Client, tmp_path) -> tuple[dict, httpx.Response]:
    """A template registered and ready, and an edit of it, once its recording is on disk: (the edit's
    request, to send again, and its answer)."""
    image = Image.fromarray(np.arange(32 * 48 * 3, dtype=np.uint8).reshape(32, 48, 3))
    mask = Image.new("L", (48, 32), 0)
    mask.paste(255, (8, 8, 24, 24))
    template_id = client.post("/v1/templates", files={"image": ("t.png", png_bytes(image))},
                              data={"prompt": "a room"}).json()["id"]
    assert client.get(f"/v1/templates/{template_id}", params={"wait": 60}).json()["status"] == "ready"
    edit = {"data": {"template_id": template_id, "prompt": "a hat", "seed": "3"},
            "files": {"mask": ("m.png", png_bytes(mask))}}
    answer = client.post("/v1/edits", **edit)
    assert answer.status_code == 200, answer.text
    wait_for(lambda: list((tmp_path / "cache" / "w0").glob("*.rtc")), "the recording's file", TIMEOUT_S)
    return edit, answer


def assert_adopted_and_edited_as_before(server: Server, client: httpx.Client, worker: str, edit: dict,
                                        before: httpx.Response) -> None:
    template_id = edit["data"]["template_id"]
    assert client.get(f"/v1/templates/{template_id}", params={"wait": 60}).json()["status"] == "ready"
    after = client.post("/v1/edits", **edit)
    assert after.status_code == 200 and after.content == before.content

    def worker_cache() -> dict:  # as of its last heartbeat
        return server.router.snapshot()["workers"][worker].get("cache", {})

    wait_for(lambda: worker_cache().get("disk_hits") == 1, "the edit read the recording's file", TIMEOUT_S)
    assert worker_cache()["registrations"] == 0  # adopted, not recorded again


def test_a_replacement_worker_adopts_the_templates_its_disk_tier_kept(tmp_path):
    """With --cache-disk-dir each template is written through to the worker's own subfolder; a worker
    killed outright is replaced, the router registers its templates on the replacement, which finds them
    there instead of recording them again, and edits them as before."""
    with disk_tier_server(tmp_path).start() as server, httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as client:
        edit, before = register_and_edit(client, tmp_path)
        os.kill(server.supervisor.pids()["w0"], signal.SIGKILL)
        wait_for(lambda: "w0.1" in server.router.snapshot()["workers"], "a replacement joins", TIMEOUT_S)
        assert_adopted_and_edited_as_before(server, client, "w0.1", edit, before)


def test_a_restarted_server_serves_the_templates_registered_before(tmp_path):
    """--cache-disk-dir keeps the registered templates (DIR/templates) and each worker's recordings
    (DIR/w0): a server started again lists them, its worker adopts the recording instead of recording it,
    and an edit by the old template id is the same image."""
    with disk_tier_server(tmp_path).start() as server, httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as client:
        edit, before = register_and_edit(client, tmp_path)
    with disk_tier_server(tmp_path).start() as server, httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as client:
        assert [t["id"] for t in client.get("/v1/templates").json()["data"]] == [edit["data"]["template_id"]]
        assert_adopted_and_edited_as_before(server, client, "w0", edit, before)
