"""Kept answers on disk (`retouch.kept_answers`): a restarted server answers the asynchronous and keyed
edits of the one before it as that one would have, and one it never finished as interrupted; a stopping
server lets its asynchronous edits finish within the drain when their answers outlive it."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from test_edit_jobs import answer_next_edit, auth, mask_file, png, server_with_a_template

from retouch.edit_jobs import EditJobs, Job, Outcome, Reply
from retouch.engine.router import Router, RouterConfig
from retouch.errors import InputError
from retouch.http_api import Limits, create_app
from retouch.kept_answers import AnswerFolder

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
        assert after.restore(INTERRUPTED) == len(named)
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
    assert restarted.restore(INTERRUPTED) == 1
    assert 35 < restarted.expires_in_s(restarted.find("", "old")) <= 40
    restarted.folder.close()
    monkeypatch.setattr(time, "time", lambda: now() + 200)
    expired = EditJobs(ttl_s=100, max_bytes=1 << 20, folder=AnswerFolder(tmp_path))
    assert expired.restore(INTERRUPTED) == 1 and expired.find("", "old") is None
    expired.folder.close()
    assert [path for path in tmp_path.iterdir() if not path.name.startswith(".")] == []


def test_a_damaged_folder_is_read_as_far_as_it_can_be(tmp_path):
    jobs = EditJobs(ttl_s=100, max_bytes=1 << 20, folder=AnswerFolder(tmp_path))
    done = Outcome("completed", 200, Reply({}, {"created": 1}, (b"abc", b"defg")))
    run_jobs(jobs, [("", "whole", None, done), ("", "cut", None, done)])
    cut = AnswerFolder._name(Job("cut", ""))
    (tmp_path / f"{cut}.1.bin").write_bytes(b"de")  # cut short by a full disk
    (tmp_path / "0123.0.bin").write_bytes(b"x")  # an image whose header was never written (a kill)
    (tmp_path / "garbage.json").write_text("{")
    folder = AnswerFolder(tmp_path)
    with pytest.raises(InputError, match="another retouch serve"):
        AnswerFolder(tmp_path)
    folder.close()
    restarted = EditJobs(ttl_s=100, max_bytes=1 << 20, folder=AnswerFolder(tmp_path))
    assert restarted.restore(INTERRUPTED) == 1 and restarted.find("", "whole").outcome.reply == done.reply
    restarted.folder.close()
    whole = AnswerFolder._name(Job("whole", ""))
    assert sorted(path.name for path in tmp_path.iterdir() if not path.name.startswith(".")) == [
        f"{whole}.0.bin", f"{whole}.1.bin", f"{whole}.json"]


async def before_a_restart(directory: Path) -> dict:
    """A server that answers an asynchronous and a keyed edit, and stops with one still running."""
    async with server_with_a_template(result_dir=directory) as (client, router, worker, form):
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
    app = create_app(router, Limits(api_keys=("sk-a", "sk-b"), default_steps=2, result_dir=directory))
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
    assert after["running status"].json()["status"] == "failed" and after["other tenant"].status_code == 404


async def stopping_with_a_folder(directory: Path) -> dict:
    async with server_with_a_template(result_dir=directory) as (client, router, worker, form):
        app = client._transport.app
        accepted = [await client.post("/v1/edits", headers=auth(), data={**form, "async": "true"},
                                      files=mask_file()) for _ in range(2)]
        edits = [await asyncio.to_thread(worker.receive, "edit") for _ in accepted]
        stopping = asyncio.create_task(app.state.stop_async(time.monotonic() + 2.0))
        worker.answer(edits[0]["request"], png(Image.new("RGB", (32, 32), "blue")))  # done within the drain
        seen = {"cancelled": await stopping}
        cancel = await asyncio.to_thread(worker.receive, "cancel")
        worker.send({"kind": "result", "request": cancel["request"], "status": 409, "error": "Cancelled",
                     "message": "cancelled"})
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
    from retouch.server import http_limits

    assert http_limits(ServeOptions(model="m", cache_disk_dir=tmp_path)).result_dir == tmp_path / "edits"
    assert http_limits(ServeOptions(model="m")).result_dir is None


def test_a_full_disk_keeps_the_answer_in_memory_and_says_so(tmp_path, monkeypatch):
    from retouch.serve_metrics import JobCollector

    def no_space(path, data):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("retouch.kept_answers.write_whole", no_space)
    jobs = EditJobs(ttl_s=100, max_bytes=1 << 20, folder=AnswerFolder(tmp_path))
    done = Outcome("completed", 200, Reply({}, None, (b"img",), "image/png"))
    run_jobs(jobs, [("", "e1", None, done)])
    assert jobs.find("", "e1").outcome == done and jobs.folder.write_errors == 2  # admitted, then ended
    metrics = {metric.name: metric.samples[0].value for metric in JobCollector(jobs).collect() if metric.samples}
    assert metrics["retouch_edit_job_disk_errors"] == 2
