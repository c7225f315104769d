"""Kept answers on disk (`retouch.kept_answers`): a restarted server answers the asynchronous and keyed
edits of the one before it as that one would have, and one it never finished as interrupted; a stopping
server lets its asynchronous edits finish within the drain when their answers outlive it."""

from __future__ import annotations

import asyncio
import base64
import json
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from scripted_worker import ScriptedWorker
from test_edit_jobs import answer_next_edit, auth, mask_file, png, server_with_a_template

from retouch.edit_jobs import JOB_OVERHEAD_BYTES, EditJobs, Job, Outcome, Reply
from retouch.engine.router import Router, RouterConfig
from retouch.errors import InputError
from retouch.http_api import Limits, create_app
from retouch import kept_answers
from retouch.kept_answers import FORMAT, AnswerFolder, name_of

HOOKS = "https://hooks.example.com"
SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
INTERRUPTED = Outcome("failed", 503, Reply({"Retry-After": "5"}, {"error": {"code": "interrupted"}}))

# What a job may end with: (status, http status, reply)
OUTCOMES = st.one_of(
    st.builds(lambda images, raw: Outcome("completed", 200, Reply({"X-Request-Id": "r"}, None if raw else {"n": 1},
                                                                  images[:1] if raw else images,
                                                                  "image/png" if raw else None)),
              st.lists(st.binary(min_size=1, max_size=64), min_size=1, max_size=3).map(tuple), st.booleans()),
    st.builds(lambda status, code: Outcome("failed", status, Reply({}, {"error": {"code": code}})),
              st.sampled_from([400, 422, 500, 503]), st.sampled_from(["bad", "interrupted"])),
    st.just(Outcome("cancelled", 409, Reply({"x-should-retry": "false"}, {"error": {"code": "cancelled"}}))))


def run_jobs(jobs: EditJobs, plans: list[tuple[str, str, str | None, Outcome | None]]) -> None:
    """Start each (tenant, id, key, outcome) job; an outcome of None stays running (a server killed then)."""
    async def run() -> None:
        never = asyncio.Event()
        for tenant, job_id, key, outcome in plans:
            async def produce(outcome=outcome) -> Outcome:
                if outcome is None:
                    await never.wait()
                return outcome
            job = jobs.start(Job(job_id, tenant, "tpl", key, f"f-{job_id}", runs_async=key is None), produce(),
                             lambda: INTERRUPTED)
            if outcome is not None:
                await job.task
        jobs.folder.close()  # then the server is killed: on disk, the running ones still run
    asyncio.run(run())


def view(jobs: EditJobs, tenant: str, job_id: str, key: str | None) -> tuple:
    job = jobs.find(tenant, job_id)
    held = None if key is None else jobs._keys.get((tenant, key))
    return (None if job is None else (job.status, job.outcome.http_status, job.outcome.reply, job.runs_async),
            None if held is None else held.id)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["", "t1", "../t"]), st.booleans(), st.one_of(st.none(), OUTCOMES)),
                min_size=1, max_size=8))
def test_a_restarted_store_answers_what_the_stopped_one_would_have(plans):
    """Every kept job comes back with the same reply, status and key; one that ran when the server went down
    comes back interrupted, its key given back (its retry runs again)."""
    with tempfile.TemporaryDirectory() as directory:
        before = EditJobs(ttl_s=3600, max_bytes=1 << 20, folder=AnswerFolder(directory))
        named = [(tenant, f"e{index}/..", f"k{index}" if keyed else None, outcome)
                 for index, (tenant, keyed, outcome) in enumerate(plans)]
        run_jobs(before, named)
        after = EditJobs(ttl_s=3600, max_bytes=1 << 20, folder=AnswerFolder(directory))
        assert after.restore(lambda job: INTERRUPTED) == len(named)
        for tenant, job_id, key, outcome in named:
            if outcome is None:
                expected = (("failed", 503, INTERRUPTED.reply, key is None), None)
            else:
                expected = view(before, tenant, job_id, key)
            assert view(after, tenant, job_id, key) == expected
        assert after.kept_bytes == sum(job.nbytes() for job in after._jobs.values())
        after.folder.close()
        assert all(path.parent == Path(directory) for path in Path(directory).rglob("*"))  # ids are not paths


def test_kept_answers_keep_their_time_and_are_removed_with_it(tmp_path, monkeypatch):
    jobs = EditJobs(ttl_s=100, max_bytes=1 << 20, folder=AnswerFolder(tmp_path))
    done = Outcome("completed", 200, Reply({}, None, (b"\x89PNG",), "image/png"))
    run_jobs(jobs, [("", "old", None, done), ("", "gone", None, done)])
    jobs.folder = AnswerFolder(tmp_path)
    jobs.forget(jobs.find("", "gone"))  # a DELETE: its files go
    jobs.folder.close()
    assert sorted(path.suffix for path in tmp_path.iterdir() if not path.name.startswith(".")) == [".bin", ".json"]
    # 60 s later (a restart takes time): 40 s are left, not 100
    now = time.time
    monkeypatch.setattr(time, "time", lambda: now() + 60)
    restarted = EditJobs(ttl_s=100, max_bytes=1 << 20, folder=AnswerFolder(tmp_path))
    assert restarted.restore(lambda job: INTERRUPTED) == 1
    assert 35 < restarted.expires_in_s(restarted.find("", "old")) <= 40
    restarted.folder.close()
    monkeypatch.setattr(time, "time", lambda: now() + 200)
    expired = EditJobs(ttl_s=100, max_bytes=1 << 20, folder=AnswerFolder(tmp_path))
    assert expired.restore(lambda job: INTERRUPTED) == 0 and expired.find("", "old") is None  # expired: not even read
    expired.folder.close()
    assert [path for path in tmp_path.iterdir() if not path.name.startswith(".")] == []


def test_a_damaged_folder_is_read_as_far_as_it_can_be(tmp_path):
    jobs = EditJobs(ttl_s=100, max_bytes=1 << 20, folder=AnswerFolder(tmp_path))
    done = Outcome("completed", 200, Reply({}, {"created": 1}, (b"abc", b"defg")))
    run_jobs(jobs, [("", job_id, None, done) for job_id in ("whole", "cut", "typed", "status")])
    whole, cut, typed, status = (name_of(Job(job_id, "")) for job_id in ("whole", "cut", "typed", "status"))
    (tmp_path / f"{cut}.1.bin").write_bytes(b"de")  # cut short by a full disk
    for name, field, value in ((typed, "headers", ["not", "a", "dict"]), (status, "status", "odd")):
        header = json.loads((tmp_path / f"{name}.json").read_text())  # a field of another type or value
        (tmp_path / f"{name}.json").write_text(json.dumps({**header, field: value}))
    (tmp_path / f"{'0' * 32}.0.bin").write_bytes(b"x")  # an image whose header was never written (a kill)
    (tmp_path / f"{whole}.7.bin").write_bytes(b"x")  # one its header does not count
    (tmp_path / "*.json").write_text("{")  # not a kept answer's name: neither read nor removed (nor a pattern)
    folder = AnswerFolder(tmp_path)
    with pytest.raises(InputError, match="another retouch serve"):
        AnswerFolder(tmp_path)
    folder.close()
    restarted = EditJobs(ttl_s=100, max_bytes=1 << 20, folder=AnswerFolder(tmp_path))
    assert restarted.restore(lambda job: INTERRUPTED) == 1 and restarted.find("", "whole").outcome.reply == done.reply
    assert restarted.counts()["completed"] == 1  # a scrape works
    restarted.folder.close()
    assert sorted(path.name for path in tmp_path.iterdir() if path.name != ".lock") == [
        "*.json", f"{whole}.0.bin", f"{whole}.1.bin", f"{whole}.json"]


def test_a_restart_reads_only_what_its_bounds_keep(tmp_path, monkeypatch):
    """A restart with a smaller --result-store-mb keeps the newest answers within it, and reads no other;
    of two kept edits naming one key (the older gave it back), the newer holds it."""
    folder = AnswerFolder(tmp_path)
    for index in range(4):
        job = Job(f"e{index}", "", "tpl", key="k", fingerprint="f")
        job.outcome = Outcome("completed", 200, Reply({}, None, (bytes(1000),), "image/png"))
        job.ended_at = time.time() - 10 + index
        folder.save(job)
    folder.close()
    read = []
    real_read = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda path: read.append(path.suffix) or real_read(path))
    restarted = EditJobs(ttl_s=100, max_bytes=2 * (1000 + JOB_OVERHEAD_BYTES), folder=AnswerFolder(tmp_path))
    assert restarted.restore(lambda job: INTERRUPTED) == 2 and read.count(".bin") == 2
    assert [job_id for job_id in ("e0", "e1", "e2", "e3") if restarted.find("", job_id)] == ["e2", "e3"]
    assert restarted.keyed("", "k", "f").id == "e3"
    restarted.folder.close()
    assert len(list(tmp_path.glob("*.bin"))) == 2


def test_a_removal_waiting_to_be_written_is_never_undone(tmp_path):
    """A DELETE, then a new edit with the same id, both waiting for a busy writer: the old images go."""
    import threading

    folder = AnswerFolder(tmp_path)
    old = Job("e1", "", "tpl")
    old.outcome, old.ended_at = Outcome("completed", 200, Reply({}, {}, (b"a", b"b"))), time.time()
    folder.save(old)
    busy = threading.Event()
    folder._submit(busy.wait)  # the writer is busy meanwhile
    folder.remove(old)
    folder.save(Job("e1", "", "tpl"))  # the new edit, admitted
    busy.set()
    folder.close()
    assert sorted(path.name for path in tmp_path.iterdir() if path.name != ".lock") == [f"{name_of(old)}.json"]


def test_a_delivery_that_ends_after_its_answer_was_forgotten_does_not_bring_it_back(tmp_path):
    jobs = EditJobs(ttl_s=100, max_bytes=1 << 20, folder=AnswerFolder(tmp_path))
    done = Outcome("completed", 200, Reply({}, None, (b"img",), "image/png"))
    run_jobs(jobs, [("", "e1", None, done)])
    jobs.folder = AnswerFolder(tmp_path)
    job = jobs.find("", "e1")
    jobs.forget(job)  # a DELETE while its webhook is being delivered
    jobs.webhook_done(job, "delivered")
    jobs.folder.close()
    assert [path for path in tmp_path.iterdir() if path.name != ".lock"] == []


def serving(app) -> tuple:
    """`app` served by `server.HttpServer` on a loopback port, in a thread: (server, thread, url). Its port
    listens before the thread runs, so a client may connect at once."""
    import socket
    import threading

    import uvicorn

    from retouch.server import HttpServer

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    server = HttpServer(uvicorn.Config(app, log_level="warning", lifespan="off"), app.state)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    return server, thread, f"http://127.0.0.1:{listener.getsockname()[1]}"


def refuse_first_unlink(monkeypatch) -> list[Path]:
    """Make the next file removal fail (a folder refusing it once); the paths refused."""
    real_unlink, refused = Path.unlink, []

    def refuse_once(path, missing_ok=False):
        if not refused:
            refused.append(path)
            raise PermissionError(1, "Operation not permitted")
        real_unlink(path, missing_ok=missing_ok)
    monkeypatch.setattr(Path, "unlink", refuse_once)
    return refused


async def a_stopping_http_server(directory: Path) -> dict:
    """A real uvicorn server (`server.HttpServer`) told to stop while a keyed edit whose client went away and
    an asynchronous one run at the worker."""
    router = Router(RouterConfig(address="tcp://127.0.0.1:0", policy="least-requests", heartbeat_s=0.05,
                                 dead_after_s=60.0)).start()
    context = zmq.Context()
    folder = AnswerFolder(directory)
    app = create_app(router, Limits(default_steps=2, request_timeout_s=30, webhook_origins=(HOOKS,),
                                    webhook_secret=SECRET), answers=folder)
    deliveries = []
    app.state.webhooks.transport = httpx.MockTransport(
        lambda request: deliveries.append(request) or httpx.Response(200))
    server, thread, url = serving(app)
    try:
        worker = ScriptedWorker(context, router, "w0")
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            registered = await client.post("/v1/templates", data={"steps": "2"}, files={
                "image": ("t.png", png(Image.new("RGB", (32, 32), "red")), "image/png")})
            await asyncio.to_thread(worker.register, registered.json()["id"])
            form = {"template_id": registered.json()["id"], "prompt": "a cat"}
            with pytest.raises(httpx.ReadTimeout):  # its client gives up: the keyed edit runs on, detached
                await client.post("/v1/edits", headers={"Idempotency-Key": "k", "X-Request-Id": "keyed"}, data=form,
                                  files=mask_file(), timeout=httpx.Timeout(10, read=0.5))
            await client.post("/v1/edits", headers={"X-Request-Id": "async"}, data={
                **form, "async": "true", "webhook": HOOKS + "/retouch"}, files=mask_file())
        await asyncio.to_thread(worker.receive, "edit")
        edit = await asyncio.to_thread(worker.receive, "edit")
        # the asynchronous edit is cancelled at once; its webhook may be delivered within 10 s
        server.stop(async_deadline=time.monotonic(), webhook_deadline=time.monotonic() + 10)
        cancel = await asyncio.to_thread(worker.answer_cancel)
        await asyncio.to_thread(thread.join, 15)
        folder.close()
        headers = {header["id"]: header for header in map(json.loads, map(Path.read_bytes, directory.glob("*.json")))}
        return {"alive": thread.is_alive(), "headers": headers, "deliveries": deliveries,
                "cancelled": cancel["request"] == edit["request"]}
    finally:
        router.close(drain_s=0)
        context.destroy(linger=0)


def test_a_server_stopping_with_nothing_to_cancel_closes_its_webhooks():
    """The stop waits for the edits it cancelled (none here) before it closes the webhook sender."""
    from retouch.edit_jobs import wait_events

    asyncio.run(wait_events([], 1.0))
    router = Router(RouterConfig(address="tcp://127.0.0.1:0")).start()
    try:
        app = create_app(router, Limits(webhook_origins=(HOOKS,), webhook_secret=SECRET))
        server, thread, url = serving(app)
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
        server.stop(async_deadline=time.monotonic(), webhook_deadline=time.monotonic() + 5)
        thread.join(10)
        assert not thread.is_alive() and app.state.webhooks.closed
    finally:
        router.close(drain_s=0)


def test_edits_still_running_when_the_server_stops_are_kept_interrupted(tmp_path):
    """Whatever the stop cancels (an asynchronous edit past the drain, a keyed one its client left) is the
    server's doing: 503 interrupted, send it again; never a client's 409 cancelled."""
    seen = asyncio.run(a_stopping_http_server(tmp_path))
    assert not seen["alive"] and seen["cancelled"]
    assert {job_id: (header["http_status"], header["body"]["error"]["code"]) for job_id, header in
            seen["headers"].items()} == {"keyed": (503, "interrupted"), "async": (503, "interrupted")}
    # the cancelled edit's webhook went out within the drain, and the restarted server will not send it again
    [delivery] = seen["deliveries"]
    assert json.loads(delivery.content)["type"] == "edit.failed"
    assert seen["headers"]["async"]["webhook_state"] == "delivered"


async def before_a_restart(directory: Path) -> dict:
    """A server that answers an asynchronous and a keyed edit, and stops with one still running."""
    async with server_with_a_template(AnswerFolder(directory)) as (client, router, worker, form):
        app = client._transport.app
        seen = {"async": await client.post("/v1/edits", headers=auth(), data={**form, "async": "true"},
                                           files=mask_file())}
        await answer_next_edit(worker)
        seen["async result"] = await client.get(f"/v1/edits/{seen['async'].json()['id']}/result?wait=10",
                                                headers=auth())
        keyed = auth(**{"Idempotency-Key": "k-1"})
        seen["keyed"] = asyncio.create_task(client.post("/v1/edits", headers=keyed, data=form, files=mask_file()))
        await answer_next_edit(worker, "green")
        seen["keyed"] = await seen["keyed"]
        seen["running"] = await client.post("/v1/edits", headers=auth(**{"Idempotency-Key": "k-2"}),
                                            data={**form, "async": "true"}, files=mask_file())
        await asyncio.to_thread(worker.receive, "edit")
        app.state.jobs.folder.close()  # then the server is killed: its running edit's end is never written
    seen["form"] = form
    return seen


async def after_a_restart(directory: Path, seen: dict) -> dict:
    """A new server on the same folder, with no worker: nothing it answers is generated."""
    router = Router(RouterConfig(address="tcp://127.0.0.1:0", heartbeat_s=0.05, dead_after_s=60.0)).start()
    app = create_app(router, Limits(api_keys=("sk-a", "sk-b"), default_steps=2), answers=AnswerFolder(directory))
    after = {"restored": app.state.restored}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
            form = seen["form"]
            after["async"] = await client.get(f"/v1/edits/{seen['async'].json()['id']}/result", headers=auth())
            after["keyed"] = await client.post("/v1/edits", headers=auth(**{"Idempotency-Key": "k-1"}), data=form,
                                               files=mask_file())
            running_id = seen["running"].json()["id"]
            after["running"] = await client.get(f"/v1/edits/{running_id}/result", headers=auth())
            after["running status"] = await client.get(f"/v1/edits/{running_id}", headers=auth())
            after["other tenant"] = await client.get(f"/v1/edits/{running_id}", headers=auth("sk-b"))
            after["routed"] = router.snapshot()["counters"]["routed"]
    finally:
        app.state.jobs.folder.close()
        router.close(drain_s=0)
    return after


def test_a_restarted_server_answers_the_edits_of_the_one_before(tmp_path):
    seen = asyncio.run(before_a_restart(tmp_path))
    after = asyncio.run(after_a_restart(tmp_path, seen))
    assert after["restored"] == 3 and after["routed"] == 0
    assert after["async"].status_code == 200 and after["async"].content == seen["async result"].content
    assert after["async"].headers["content-type"] == "image/png"
    keyed = after["keyed"]  # the retry of a keyed edit: its answer, not a second generation
    assert keyed.status_code == 200 and keyed.content == seen["keyed"].content
    assert keyed.headers["Idempotent-Replayed"] == "true"
    assert keyed.headers["X-Request-Id"] == seen["keyed"].headers["X-Request-Id"]
    # the edit the killed server never finished: send it again (its key was given back)
    assert after["running"].status_code == 503 and after["running"].json()["error"]["code"] == "interrupted"
    assert after["running"].headers["X-Request-Id"] == seen["running"].json()["id"]  # the edit's, not the GET's
    assert after["running status"].json()["status"] == "failed" and after["other tenant"].status_code == 404


async def stopping_with_a_folder(directory: Path) -> dict:
    async with server_with_a_template(AnswerFolder(directory)) as (client, router, worker, form):
        app = client._transport.app
        accepted = [await client.post("/v1/edits", headers=auth(), data={**form, "async": "true"},
                                      files=mask_file()) for _ in range(2)]
        edits = [await asyncio.to_thread(worker.receive, "edit") for _ in accepted]
        stopping = asyncio.create_task(app.state.stop_async(time.monotonic() + 2.0))
        worker.answer(edits[0]["request"], png(Image.new("RGB", (32, 32), "blue")))  # done within the drain
        seen = {"cancelled": len(await stopping)}
        cancel = await asyncio.to_thread(worker.answer_cancel)
        seen["results"] = [await client.get(f"/v1/edits/{a.json()['id']}/result?wait=10", headers=auth())
                           for a in accepted]
        seen["cancelled id"] = (cancel["request"], edits[1]["request"])
        app.state.jobs.folder.close()
    return seen


def test_a_stopping_server_lets_asynchronous_edits_finish_when_their_answers_outlive_it(tmp_path):
    seen = asyncio.run(stopping_with_a_folder(tmp_path))
    assert seen["cancelled"] == 1 and seen["cancelled id"][0] == seen["cancelled id"][1]
    done, stopped = seen["results"]
    assert done.status_code == 200 and stopped.status_code == 503
    assert stopped.json()["error"]["code"] == "interrupted"
    headers = [json.loads(path.read_bytes()) for path in tmp_path.glob("*.json")]
    assert sorted(header["http_status"] for header in headers) == [200, 503]  # both kept for the next server


def test_serve_keeps_answers_beside_its_templates(tmp_path):
    from retouch.config import ServeOptions
    from retouch.server import answer_folder

    folder = answer_folder(ServeOptions(model="m", cache_disk_dir=tmp_path))
    assert folder.directory == tmp_path / "edits"
    folder.close()
    assert answer_folder(ServeOptions(model="m")) is None


def test_a_full_disk_keeps_the_answer_in_memory_and_says_so(tmp_path, monkeypatch):
    """The answer's images cannot be written: it is served from memory, and what its admission wrote goes,
    so that a restart does not call an edit that ended interrupted."""
    from retouch.serve_metrics import JobCollector

    real_write = kept_answers.write_whole

    def no_room_for_images(path, data):
        if path.suffix == ".bin":
            raise OSError(28, "No space left on device")
        real_write(path, data)
    monkeypatch.setattr(kept_answers, "write_whole", no_room_for_images)
    jobs = EditJobs(ttl_s=100, max_bytes=1 << 20, folder=AnswerFolder(tmp_path))
    done = Outcome("completed", 200, Reply({}, None, (b"img",), "image/png"))
    run_jobs(jobs, [("", "e1", None, done)])
    assert jobs.find("", "e1").outcome == done and jobs.folder.write_errors == 1
    metrics = {metric.name: metric.samples[0].value for metric in JobCollector(jobs).collect() if metric.samples}
    assert metrics["retouch_edit_job_disk_errors"] == 1
    assert [path for path in tmp_path.iterdir() if path.name != ".lock"] == []


def test_a_failed_rewrite_leaves_the_kept_answer_whole(tmp_path, monkeypatch):
    """An edit whose end is on disk is written again (its webhook delivered); that write fails (a full disk):
    the answer on disk stays, for the restarted server."""
    jobs = EditJobs(ttl_s=100, max_bytes=1 << 20, folder=AnswerFolder(tmp_path))
    done = Outcome("completed", 200, Reply({}, None, (b"img",), "image/png"))
    run_jobs(jobs, [("", "e1", None, done)])
    jobs.folder = AnswerFolder(tmp_path)
    jobs.restore(lambda job: INTERRUPTED)

    def no_space(path, data):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(kept_answers, "write_whole", no_space)
    jobs.webhook_done(jobs.find("", "e1"), "delivered")
    jobs.folder.close()
    monkeypatch.undo()
    restarted = EditJobs(ttl_s=100, max_bytes=1 << 20, folder=AnswerFolder(tmp_path))
    assert restarted.restore(lambda job: INTERRUPTED) == 1 and restarted.find("", "e1").outcome == done
    restarted.folder.close()


def test_a_read_only_disk_counts_each_failure_once(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(kept_answers, "write_whole", read_only)
    monkeypatch.setattr(Path, "unlink", read_only)
    folder = AnswerFolder(tmp_path)
    for index in range(30):
        folder.save(Job(f"e{index}", "", "tpl"))
    folder.close()
    assert folder.write_errors == 30 and folder._unremoved == {}


def test_a_removal_that_failed_is_tried_again_and_a_newer_format_is_left_alone(tmp_path, monkeypatch):
    jobs = EditJobs(ttl_s=100, max_bytes=1 << 20, folder=AnswerFolder(tmp_path))
    done = Outcome("completed", 200, Reply({}, None, (b"img",), "image/png"))
    run_jobs(jobs, [("", "deleted", None, done), ("", "later", None, done)])
    (tmp_path / f"{'f' * 32}.json").write_text(json.dumps({"format": FORMAT + 1}))  # a newer version's
    jobs.folder = AnswerFolder(tmp_path)
    refused = refuse_first_unlink(monkeypatch)
    deleted = jobs.find("", "deleted")
    jobs.forget(deleted)  # a DELETE whose removal fails at first
    jobs.forget(jobs.find("", "later"))
    again = Job("again", "", "tpl")  # a new edit under another id: its write succeeds
    jobs.folder.save(again)
    jobs.folder.close()  # tries the failed removal again
    assert refused and sorted(path.name for path in tmp_path.iterdir()) == sorted(
        [".lock", f"{'f' * 32}.json", f"{name_of(again)}.json"])
    restarted = EditJobs(ttl_s=100, max_bytes=1 << 20, folder=AnswerFolder(tmp_path))
    assert restarted.restore(lambda job: INTERRUPTED) == 1 and restarted.find("", "deleted") is None
    restarted.folder.close()
    assert (tmp_path / f"{'f' * 32}.json").exists()


def test_a_new_edit_under_an_id_whose_removal_failed_is_kept(tmp_path, monkeypatch):
    """A DELETE whose removal fails, then a new edit under the same id: the removal tried again later must not
    take the new edit's files."""
    folder = AnswerFolder(tmp_path)
    old = Job("e1", "", "tpl")
    old.outcome, old.ended_at = Outcome("completed", 200, Reply({}, {}, (b"a",))), time.time()
    folder.save(old)
    folder.close()
    folder = AnswerFolder(tmp_path)
    refused = refuse_first_unlink(monkeypatch)
    folder.remove(old)
    new = Job("e1", "", "tpl", key="k2")
    new.outcome, new.ended_at = Outcome("completed", 200, Reply({}, {}, (b"b",))), time.time()
    folder.save(new)
    folder.close()  # tries failed removals again
    jobs = EditJobs(ttl_s=100, max_bytes=1 << 20, folder=AnswerFolder(tmp_path))
    assert refused and jobs.restore(lambda job: INTERRUPTED) == 1 and jobs.find("", "e1").key == "k2"
    jobs.folder.close()


def test_a_second_ctrl_c_stops_at_once_and_removes_its_run_folder(tmp_path, monkeypatch):
    from retouch.config import ServeOptions
    from retouch.server import Server

    exits = []
    monkeypatch.setattr("os._exit", exits.append)
    server = Server(ServeOptions(model="m"))
    server.run_dir = tmp_path / "run"
    server.run_dir.mkdir()
    server._stop_now()
    assert exits == [1] and not server.run_dir.exists()


def test_odd_files_do_not_stop_a_restart(tmp_path):
    """What a user test put in the folder: each is removed or left alone, and the rest is read."""
    import os

    jobs = EditJobs(ttl_s=100, max_bytes=1 << 20, folder=AnswerFolder(tmp_path))
    done = Outcome("completed", 200, Reply({"X-Request-Id": "r"}, None, (b"img",), "image/png"))
    ids = ("whole", "future", "crlf", "state", "newer")
    run_jobs(jobs, [("", job_id, None, done) for job_id in ids])
    names = {job_id: name_of(Job(job_id, "")) for job_id in ids}
    for job_id, change in (("future", {"ended_at": 1e18}), ("crlf", {"headers": {"X": "a\r\nSet-Cookie: x=1"}}),
                           ("state", {"webhook_state": "bogus"}), ("newer", {"format": FORMAT + 1})):
        path = tmp_path / f"{names[job_id]}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    (tmp_path / f"{'d' * 32}.json").write_text("[" * 200_000)  # deeper than the JSON reader goes
    os.mkfifo(tmp_path / f"{'e' * 32}.json")  # reading it would block
    restarted = EditJobs(ttl_s=100, max_bytes=1 << 20, folder=AnswerFolder(tmp_path))
    assert restarted.restore(lambda job: INTERRUPTED) == 1 and restarted.find("", "whole").outcome == done
    restarted.folder.close()
    left = sorted(path.name for path in tmp_path.iterdir() if path.name != ".lock")
    assert left == sorted([f"{names['whole']}.json", f"{names['whole']}.0.bin", f"{names['newer']}.json",
                           f"{names['newer']}.0.bin", f"{'e' * 32}.json"])  # a newer version's images stay too


def test_a_server_whose_http_thread_died_stops_rather_than_hang(monkeypatch):
    """An error in the HTTP thread (at its start, say) must not leave a head holding its port, answering
    nothing, for as long as nobody looks."""
    import signal
    import threading
    from types import SimpleNamespace

    from retouch.config import ServeOptions
    from retouch.server import Server

    monkeypatch.setattr(signal, "signal", lambda *args: None)
    server = Server(ServeOptions(model="m"))
    server.router = SimpleNamespace(address="tcp://127.0.0.1:1")
    server._http_thread = threading.Thread(target=lambda: None)
    server._http_thread.start()
    server._http_thread.join()
    closed = []
    monkeypatch.setattr(server, "close", lambda drain_s=None: closed.append(drain_s))
    with pytest.raises(RuntimeError, match="stopped by itself"):
        server.serve_forever()
    assert closed == [0]
