"""Edits that outlive their request: asynchronous edits (202, fetched later) and Idempotency-Key retries
that get the first request's answer instead of a second generation (`retouch.edit_jobs`), over HTTP
against a scripted worker, and the store's bounds on its own."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json

import httpx
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from scripted_worker import ScriptedWorker

from retouch.edit_jobs import JOB_OVERHEAD_BYTES, EditJobs, Job, KeyReused, Outcome, Reply, fingerprint
from retouch.engine.router import Router, RouterConfig
from retouch.http_api import Limits, create_app, tenant_of

KEYS = ("sk-a", "sk-b")
TIMEOUT = 10.0
SIZE = (32, 32)


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def auth(key: str = KEYS[0], **headers) -> dict:
    return {"Authorization": f"Bearer {key}", **headers}


@contextlib.asynccontextmanager
async def server_with_a_template(answers=None, **limits):
    """A scripted worker holding a registered red 32x32 template: yields (client, router, worker, form).
    `answers`: the app's AnswerFolder (the caller closes it)."""
    router = Router(RouterConfig(address="tcp://127.0.0.1:0", policy="least-requests", heartbeat_s=0.05,
                                 dead_after_s=60.0)).start()
    context = zmq.Context()
    app = create_app(router, Limits(api_keys=KEYS, default_steps=2, request_timeout_s=20, **limits), answers=answers)
    try:
        worker = ScriptedWorker(context, router, "w0")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
            registered = await client.post("/v1/templates", headers=auth(), data={"steps": "2"}, files={
                "image": ("t.png", png(Image.new("RGB", SIZE, "red")), "image/png")})
            await asyncio.to_thread(worker.register, registered.json()["id"])
            yield client, router, worker, {"template_id": registered.json()["id"], "prompt": "a cat"}
    finally:
        router.close(drain_s=0)
        context.destroy(linger=0)


def mask_file(box=(0, 0, 16, 16)) -> dict:
    mask = Image.new("L", SIZE, 0)
    mask.paste(255, box)
    return {"mask": ("m.png", png(mask), "image/png")}


async def answer_next_edit(worker: ScriptedWorker, colour: str = "blue") -> int:
    edit = await asyncio.to_thread(worker.receive, "edit")
    worker.answer(edit["request"], png(Image.new("RGB", SIZE, colour)))
    return edit["request"]


async def asynchronous_edit() -> dict:
    async with server_with_a_template(result_ttl_s=120) as (client, router, worker, form):
        seen = {"limits": await client.get("/v1/limits", headers=auth())}
        seen["accepted"] = await client.post("/v1/edits", headers=auth(), data={**form, "async": "true"},
                                           files=mask_file())
        edit_id = seen["accepted"].json()["id"]
        seen["running"] = await client.get(f"/v1/edits/{edit_id}", headers=auth())
        seen["result too early"] = await client.get(f"/v1/edits/{edit_id}/result", headers=auth())
        seen["other tenant"] = await client.get(f"/v1/edits/{edit_id}/result", headers=auth(KEYS[1]))
        waiting = asyncio.create_task(client.get(f"/v1/edits/{edit_id}/result?wait=20", headers=auth()))
        await answer_next_edit(worker)
        seen["result"] = await waiting
        seen["again"] = await client.get(f"/v1/edits/{edit_id}/result", headers=auth())
        seen["status"] = await client.get(f"/v1/edits/{edit_id}", headers=auth())
        seen["events"] = await client.get(f"/v1/edits/{edit_id}/events", headers=auth())
        seen["same id"] = await client.post("/v1/edits", headers=auth(**{"X-Request-Id": edit_id}), data=form,
                                            files=mask_file())
        seen["metrics"] = await client.get("/metrics", headers=auth())
        seen["deleted"] = await client.delete(f"/v1/edits/{edit_id}", headers=auth())
        seen["after delete"] = await client.get(f"/v1/edits/{edit_id}/result", headers=auth())
        # Prefer: respond-async (RFC 7240) asks the same
        seen["preferred"] = await client.post("/v1/edits", headers=auth(Prefer="respond-async"), data=form,
                                              files=mask_file())
        await answer_next_edit(worker)
        seen["routed"] = router.snapshot()["counters"]["routed"]
    return seen


def test_an_asynchronous_edit_is_answered_at_once_and_fetched_later():
    seen = asyncio.run(asynchronous_edit())
    accepted = seen["accepted"]
    assert accepted.status_code == 202 and accepted.json()["status"] == "in_progress"
    edit_id = accepted.json()["id"]
    assert accepted.headers["Location"] == f"/v1/edits/{edit_id}" and accepted.headers["X-Request-Id"] == edit_id
    assert seen["running"].json()["status"] == "in_progress" and len(seen["running"].json()["images"]) == 1
    early = seen["result too early"]  # the status, as the POST answered it
    assert early.status_code == 202 and early.json()["status"] == "in_progress" and "Retry-After" in early.headers
    assert seen["other tenant"].status_code == 404
    result = seen["result"]
    assert result.status_code == 200 and result.headers["content-type"] == "image/png"
    image = Image.open(io.BytesIO(result.content)).convert("RGB")
    assert image.getpixel((0, 0)) == (0, 0, 255)  # the worker's image
    assert seen["again"].content == result.content and seen["again"].headers["X-Request-Id"] == edit_id
    status = seen["status"].json()
    assert status["status"] == "completed" and status["result_url"] == f"/v1/edits/{edit_id}/result"
    assert 0 < status["expires_in_s"] <= 120 and seen["limits"].json()["result_ttl_s"] == 120
    assert seen["events"].text == f'event: done\ndata: {{"id":"{edit_id}","status":200}}\n\n'
    assert seen["same id"].status_code == 409 and seen["same id"].json()["error"]["code"] == "duplicate_request_id"
    assert 'retouch_edit_jobs{status="completed"} 1.0' in seen["metrics"].text
    assert seen["deleted"].json() == {"id": edit_id, "deleted": True}
    assert seen["after delete"].status_code == 404
    assert seen["preferred"].status_code == 202 and seen["routed"] == 2
    assert seen["preferred"].headers["Preference-Applied"] == "respond-async"
    assert "Preference-Applied" not in accepted.headers  # async=true asked, not a preference


async def keyed_retries() -> dict:
    async with server_with_a_template() as (client, router, worker, form):
        key = auth(**{"Idempotency-Key": "retry-me-1"})
        quoted = auth(**{"Idempotency-Key": '"retry-me-1"'})  # the draft's sf-string form: the same key
        first = asyncio.create_task(client.post("/v1/edits", headers=key, data=form, files=mask_file()))
        while router.snapshot()["pending"] == 0:
            await asyncio.sleep(0.01)
        first.cancel()  # the client went away: a keyed edit goes on, for its retry
        with contextlib.suppress(asyncio.CancelledError):
            await first
        retry = asyncio.create_task(client.post("/v1/edits", headers=key, data=form, files=mask_file()))
        await answer_next_edit(worker)
        seen = {"retry": await retry}
        seen["after"] = await client.post("/v1/edits", headers=quoted, data=form, files=mask_file())
        seen["other request"] = await client.post("/v1/edits", headers=key, data={**form, "prompt": "a dog"},
                                                  files=mask_file())
        # another tenant's same key is its own request: of a template it cannot see
        seen["other tenant"] = await client.post("/v1/edits", data=form, files=mask_file(),
                                                 headers=auth(KEYS[1], **{"Idempotency-Key": "retry-me-1"}))
        seen["bad key"] = await client.post("/v1/edits", headers=auth(**{"Idempotency-Key": "no spaces"}),
                                            data=form, files=mask_file())
        two_keys = [*auth().items(), ("Idempotency-Key", "a"), ("Idempotency-Key", "b")]
        seen["two keys"] = await client.post("/v1/edits", headers=two_keys, data=form, files=mask_file())
        seen["openai async"] = await client.post("/v1/images/edits", headers=auth(), data={**form, "async": "true"},
                                                 files=mask_file())
        seen["streamed"] = await client.post("/v1/edits", headers=key, data={**form, "stream": "true"},
                                             files=mask_file())
        seen["stream and async"] = await client.post("/v1/edits", headers=auth(), files=mask_file(),
                                                     data={**form, "stream": "true", "async": "true"})
        seen["routed"] = router.snapshot()["counters"]["routed"]
        seen["metrics"] = (await client.get("/metrics", headers=auth())).text
    return seen


def test_a_retry_with_the_same_idempotency_key_gets_the_first_answer_without_a_second_generation():
    seen = asyncio.run(keyed_retries())
    retry, after = seen["retry"], seen["after"]
    assert retry.status_code == 200 and after.status_code == 200 and retry.content == after.content
    assert Image.open(io.BytesIO(retry.content)).convert("RGB").getpixel((0, 0)) == (0, 0, 255)
    assert retry.headers["X-Request-Id"] == after.headers["X-Request-Id"]
    assert retry.headers["Idempotent-Replayed"] == after.headers["Idempotent-Replayed"] == "true"
    assert seen["routed"] == 1  # one generation for the three requests with the key
    assert seen["other tenant"].json()["error"]["code"] == "template_not_found"
    reused = seen["other request"]
    assert reused.status_code == 422 and reused.json()["error"]["code"] == "idempotency_key_reused"
    assert reused.json()["error"]["param"] == "idempotency-key"
    assert seen["bad key"].status_code == 400 and seen["bad key"].json()["error"]["param"] == "idempotency-key"
    assert seen["two keys"].status_code == 400 and "more than once" in seen["two keys"].json()["error"]["message"]
    assert seen["openai async"].status_code == 400 and seen["openai async"].json()["error"]["param"] == "async"
    assert seen["streamed"].status_code == 422  # the key names the unstreamed request: another request
    assert seen["stream and async"].status_code == 400
    assert seen["stream and async"].json()["error"]["param"] == "async"
    assert "retouch_idempotent_replays_total 2.0" in seen["metrics"]


async def cancelled_and_failed() -> dict:
    async with server_with_a_template() as (client, router, worker, form):
        accepted = await client.post("/v1/edits", headers=auth(), data={**form, "async": "true"}, files=mask_file())
        edit_id = accepted.json()["id"]
        await asyncio.to_thread(worker.receive, "edit")
        seen = {"cancel": await client.delete(f"/v1/edits/{edit_id}", headers=auth())}
        await asyncio.to_thread(worker.answer_cancel)
        seen["cancelled"] = await client.get(f"/v1/edits/{edit_id}/result?wait=20", headers=auth())
        seen["cancelled status"] = await client.get(f"/v1/edits/{edit_id}", headers=auth())
        failing = await client.post("/v1/edits", headers=auth(), data={**form, "async": "true"}, files=mask_file())
        edit = await asyncio.to_thread(worker.receive, "edit")
        worker.fail(edit["request"], 500, "RuntimeError", "CUDA error")
        seen["failed"] = await client.get(f"/v1/edits/{failing.json()['id']}/result?wait=20", headers=auth())
        seen["failed status"] = await client.get(f"/v1/edits/{failing.json()['id']}", headers=auth())
        seen["bad wait"] = await client.get(f"/v1/edits/{edit_id}/result?wait=600", headers=auth())
        # nothing to repaint: answered (the template) without a worker, and kept all the same
        empty = {"mask": ("m.png", png(Image.new("L", SIZE, 0)), "image/png")}
        nothing = await client.post("/v1/edits", headers=auth(), data={**form, "async": "true"}, files=empty)
        seen["nothing"] = await client.get(f"/v1/edits/{nothing.json()['id']}/result?wait=20", headers=auth())
    return seen


def test_cancelled_and_failed_asynchronous_edits_keep_their_errors():
    seen = asyncio.run(cancelled_and_failed())
    assert seen["cancel"].json()["cancelled"] is True
    assert seen["cancelled"].status_code == 409 and seen["cancelled"].json()["error"]["code"] == "cancelled"
    assert seen["cancelled status"].json()["status"] == "cancelled"
    assert seen["failed"].status_code == 500 and "CUDA error" in seen["failed"].json()["error"]["message"]
    failed = seen["failed status"].json()
    assert failed["status"] == "failed" and failed["error"]["message"] == "CUDA error"
    assert seen["bad wait"].status_code == 422 and seen["bad wait"].json()["error"]["param"] == "wait"
    assert seen["nothing"].status_code == 200
    assert Image.open(io.BytesIO(seen["nothing"].content)).convert("RGB").getpixel((0, 0)) == (255, 0, 0)


async def openai_keyed() -> dict:
    async with server_with_a_template() as (client, router, worker, form):
        mask = {"mask": ("m.png", png(Image.new("RGBA", SIZE, (0, 0, 0, 0))), "image/png")}
        key = auth(**{"Idempotency-Key": "openai-1"})
        data = {**form, "n": "2"}
        first = asyncio.create_task(client.post("/v1/images/edits", headers=key, data=data, files=mask))
        await answer_next_edit(worker)
        await answer_next_edit(worker, "green")
        seen = {"first": await first}
        seen["retry"] = await client.post("/v1/images/edits", headers=key, data=data, files=mask)
        seen["routed"] = router.snapshot()["counters"]["routed"]
    return seen


def test_the_openai_endpoint_replays_a_keyed_answer():
    seen = asyncio.run(openai_keyed())
    assert seen["first"].status_code == 200 and seen["first"].json()["data"] == seen["retry"].json()["data"]
    assert len(seen["first"].json()["data"]) == 2 and seen["routed"] == 2


# ---- the store on its own ----

class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def finished(jobs: EditJobs, job_id: str, nbytes: int = 0, key: str | None = None, digest: str = "d") -> Job:
    async def run() -> Job:
        job = jobs.start(Job(job_id, "t", "tpl", key, digest), produce(), lambda: Outcome("cancelled", 409, Reply({})))
        await job.task
        return job

    async def produce() -> Outcome:
        return Outcome("completed", 200, Reply({}, {}, (bytes(nbytes),)))
    return asyncio.run(run())


def test_kept_answers_expire_and_keys_name_one_request():
    clock = Clock()
    jobs = EditJobs(ttl_s=10, max_bytes=1 << 20, clock=clock)
    finished(jobs, "e1", key="k", digest="first")
    assert jobs.keyed("t", "k", "first").id == "e1" and jobs.keyed("other", "k", "first") is None
    with pytest.raises(KeyReused, match="another request"):
        jobs.keyed("t", "k", "second")
    clock.now = 10.5
    assert jobs.find("t", "e1") is None and jobs.keyed("t", "k", "second") is None  # the key is free again
    assert jobs.counts()["kept_bytes"] == 0


def test_a_cancelled_job_keeps_its_cancelled_outcome():
    async def run() -> Job:
        jobs = EditJobs(ttl_s=10, max_bytes=1 << 20)
        never = asyncio.Event()

        async def produce() -> Outcome:
            await never.wait()
        job = jobs.start(Job("e1", "t", "tpl"), produce(), lambda: Outcome("cancelled", 409, Reply({})))
        await asyncio.sleep(0)
        job.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await job.task
        return jobs.find("t", "e1")
    assert asyncio.run(run()).status == "cancelled"


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=12), st.integers(1, 8000))
def test_kept_answers_stay_within_the_budget_and_the_newest_is_never_evicted(sizes, budget):
    jobs = EditJobs(ttl_s=1e9, max_bytes=budget)
    for index, size in enumerate(sizes):
        finished(jobs, f"e{index}", size)
        newest = jobs.find("t", f"e{index}")
        assert newest is not None and newest.status == "completed"
        kept = [job for i in range(index + 1) if (job := jobs.find("t", f"e{i}")) is not None]
        assert jobs.kept_bytes == sum(job.nbytes() for job in kept)
        assert jobs.kept_bytes <= budget or len(kept) == 1
        # the oldest go first: what is kept is a suffix of what finished
        assert [job.id for job in kept] == [f"e{i}" for i in range(index + 1 - len(kept), index + 1)]
    assert JOB_OVERHEAD_BYTES > 0


def test_a_fingerprint_tells_requests_apart():
    def fields(prompt: str = "a cat", name: str = "mask", data: bytes = b"\x00\x01") -> list:
        return [("prompt", prompt), (name, io.BytesIO(data))]

    base = fingerprint("/v1/edits", fields(), False)
    upload = io.BytesIO(bytes(range(256)) * 5000)  # read in chunks, and left where a later read starts
    assert fingerprint("/v1/edits", [("mask", upload)], False) == fingerprint("/v1/edits", [("mask", upload)], False)
    assert upload.tell() == 0
    assert base == fingerprint("/v1/edits", fields(), False) == fingerprint("/v1/edits", fields()[::-1], False)
    repeated = [("lora", "a"), ("lora", "b")]  # the order of a repeated field is part of the request
    assert fingerprint("/v1/edits", repeated, False) != fingerprint("/v1/edits", repeated[::-1], False)
    for other in (fields(prompt="a dog"), fields(data=b"\x00\x02"), fields(prompt="a ca", name="tmask")):
        assert fingerprint("/v1/edits", other, False) != base
    assert fingerprint("/v1/edits", fields(), True) != base
    assert fingerprint("/v1/images/edits", fields(), False) != base
    # a retry may send the time it has left: the deadline is not what it asked for
    assert fingerprint("/v1/edits", [*fields(), ("slo_ms", "900")], False) == base


async def concurrent_and_failing() -> dict:
    async with server_with_a_template() as (client, router, worker, form):
        app_jobs = client._transport.app.state.jobs
        key = auth(**{"Idempotency-Key": "twice-at-once"})
        both = [asyncio.create_task(client.post("/v1/edits", headers=key, data=form, files=mask_file()))
                for _ in range(2)]
        await answer_next_edit(worker)
        seen = {"both": await asyncio.gather(*both)}
        same_id = auth(**{"X-Request-Id": "one-id"})
        seen["same id"] = await asyncio.gather(*[client.post("/v1/edits", headers=same_id, data={**form, "async": "1"},
                                                             files=mask_file()) for _ in range(2)])
        await answer_next_edit(worker)
        # a GPU error is the server's: its key is given back, and the retry generates again
        failing = auth(**{"Idempotency-Key": "flaky"})
        first = asyncio.create_task(client.post("/v1/edits", headers=failing, data=form, files=mask_file()))
        edit = await asyncio.to_thread(worker.receive, "edit")
        worker.fail(edit["request"], 500, "RuntimeError", "CUDA error")
        seen["failed"] = await first
        failed_job = app_jobs.find(tenant_of(KEYS[0]), seen["failed"].headers["X-Request-Id"])
        seen["kept error"] = failed_job.outcome.reply
        retry = asyncio.create_task(client.post("/v1/edits", headers=failing, data=form, files=mask_file()))
        await answer_next_edit(worker, "green")
        seen["retried"] = await retry
        # a DELETE of a kept answer gives its key back too
        seen["deleted"] = await client.delete(f"/v1/edits/{seen['retried'].headers['X-Request-Id']}", headers=auth())
        again = asyncio.create_task(client.post("/v1/edits", headers=failing, data=form, files=mask_file()))
        await answer_next_edit(worker)
        seen["after delete"] = await again
        # a DELETE of a running keyed edit gives its key back: the retry (its own id again) runs again
        deleting = auth(**{"Idempotency-Key": "changed-my-mind", "X-Request-Id": "del-1"})
        running = asyncio.create_task(client.post("/v1/edits", headers=deleting, data=form, files=mask_file()))
        await asyncio.to_thread(worker.receive, "edit")
        await client.delete("/v1/edits/del-1", headers=auth())
        await asyncio.to_thread(worker.answer_cancel)
        seen["deleted while running"] = await running
        rerun = asyncio.create_task(client.post("/v1/edits", headers=deleting, data=form, files=mask_file()))
        await answer_next_edit(worker)
        seen["rerun"] = await rerun
        # an explicit async=false outweighs a Prefer header
        explicit = asyncio.create_task(client.post("/v1/edits", headers=auth(Prefer="respond-async"),
                                                   data={**form, "async": "false"}, files=mask_file()))
        await answer_next_edit(worker)
        seen["explicit"] = await explicit
        # a streamed edit ignores a preference to run asynchronously
        seen["preferred stream"] = asyncio.create_task(client.post(
            "/v1/edits", headers=auth(Prefer="respond-async"), data={**form, "stream": "true"}, files=mask_file()))
        await answer_next_edit(worker)
        seen["preferred stream"] = await seen["preferred stream"]
        seen["routed"] = router.snapshot()["counters"]["routed"]
    return seen


def test_concurrent_retries_share_one_edit_and_server_failures_give_the_key_back():
    seen = asyncio.run(concurrent_and_failing())
    first, second = seen["both"]
    assert first.status_code == second.status_code == 200 and first.content == second.content
    assert first.headers["X-Request-Id"] == second.headers["X-Request-Id"]
    statuses = sorted(answer.status_code for answer in seen["same id"])
    assert statuses == [202, 409] and "duplicate_request_id" in min(seen["same id"], key=lambda a: -a.status_code).text
    assert seen["failed"].status_code == 500
    kept = seen["kept error"]  # plain data (no traceback holding the request's images), as the client saw it
    assert kept.images == () and json.loads(json.dumps(kept.body)) == kept.body == seen["failed"].json()
    assert kept.headers["X-Request-Id"] == seen["failed"].headers["X-Request-Id"]
    assert seen["retried"].status_code == 200 and "Idempotent-Replayed" not in seen["retried"].headers
    assert seen["retried"].headers["X-Request-Id"] != seen["failed"].headers["X-Request-Id"]
    assert seen["deleted"].json()["deleted"] is True
    assert seen["after delete"].status_code == 200 and "Idempotent-Replayed" not in seen["after delete"].headers
    assert seen["preferred stream"].headers["content-type"].startswith("text/event-stream")
    assert seen["deleted while running"].json()["error"]["code"] == "cancelled"
    assert seen["rerun"].status_code == 200 and "Idempotent-Replayed" not in seen["rerun"].headers
    assert seen["rerun"].headers["X-Request-Id"] == "del-1"  # resending its own id, as a retry does
    assert seen["explicit"].status_code == 200 and seen["explicit"].headers["content-type"] == "image/png"
    # twice-at-once 1, one-id 1, flaky 3 (failed, retried, after the delete), deleted and rerun 2, explicit 1,
    # the stream 1
    assert seen["routed"] == 9


async def evicted() -> dict:
    async with server_with_a_template(max_result_bytes=1) as (client, router, worker, form):
        seen = {}
        for name in ("first", "second", "first again"):
            key = auth(**{"Idempotency-Key": name.split()[0]})
            answer = asyncio.create_task(client.post("/v1/edits", headers=key, data=form, files=mask_file()))
            await answer_next_edit(worker)
            seen[name] = await answer
        seen["newest"] = await client.get(f"/v1/edits/{seen['first again'].headers['X-Request-Id']}/result",
                                          headers=auth())
        seen["metrics"] = (await client.get("/metrics", headers=auth())).text
        seen["routed"] = router.snapshot()["counters"]["routed"]
    return seen


def test_an_evicted_answer_gives_its_key_back_and_the_newest_stays():
    """Over the byte budget the oldest answers go first (and their keys: a retry generates again); the
    newest stays, even alone over the budget."""
    seen = asyncio.run(evicted())
    assert seen["routed"] == 3 and "Idempotent-Replayed" not in seen["first again"].headers
    assert seen["newest"].status_code == 200 and seen["newest"].content == seen["first again"].content
    assert 'retouch_edit_jobs_dropped_total{reason="evicted"} 2.0' in seen["metrics"]


def test_a_job_cancelled_before_it_first_ran_ends_cancelled_and_lets_go_of_its_task():
    """A DELETE or a stopping server may cancel a job's task before the loop first ran it: its coroutine
    never starts, and the job must end all the same (waiters, its id and key), holding no task (a cancelled
    task keeps the request's frames)."""
    async def run() -> tuple[Job, list]:
        jobs = EditJobs(ttl_s=10, max_bytes=1 << 20)
        started = []

        async def produce() -> Outcome:
            started.append(True)
            return Outcome("completed", 200, Reply({}))

        job = jobs.start(Job("e1", "t", key="k", fingerprint="f", runs_async=True), produce(),
                         lambda: Outcome("cancelled", 409, Reply({})))
        assert jobs.running_async() == [job]
        job.task.cancel()
        await asyncio.wait_for(job.ended.wait(), TIMEOUT)
        assert jobs.running_async() == [] and jobs.keyed("t", "k", "f") is None  # a cancel gives the key back
        return job, started
    job, started = asyncio.run(run())
    assert job.status == "cancelled" and job.task is None and started == []


async def stopping() -> dict:
    async with server_with_a_template() as (client, router, worker, form):
        app = client._transport.app
        accepted = await client.post("/v1/edits", headers=auth(), data={**form, "async": "true"}, files=mask_file())
        async_edit = await asyncio.to_thread(worker.receive, "edit")
        keyed = asyncio.create_task(client.post("/v1/edits", headers=auth(**{"Idempotency-Key": "stay"}), data=form,
                                                files=mask_file()))
        keyed_edit = await asyncio.to_thread(worker.receive, "edit")
        seen = {"cancelled": len(await app.state.stop_async(None))}
        cancel = await asyncio.to_thread(worker.answer_cancel)
        worker.answer(keyed_edit["request"])
        seen["keyed"] = await keyed
        seen["async"] = await client.get(f"/v1/edits/{accepted.json()['id']}/result?wait=20", headers=auth())
        seen["ids"] = (cancel["request"], async_edit["request"])
        # a 5xx gives the key back also to a retry that resends its own X-Request-Id
        flaky = auth(**{"Idempotency-Key": "flaky", "X-Request-Id": "mine-1"})
        first = asyncio.create_task(client.post("/v1/edits", headers=flaky, data=form, files=mask_file()))
        edit = await asyncio.to_thread(worker.receive, "edit")
        worker.fail(edit["request"], 500, "RuntimeError", "CUDA error")
        seen["failed"] = await first
        retry = asyncio.create_task(client.post("/v1/edits", headers=flaky, data=form, files=mask_file()))
        await answer_next_edit(worker)
        seen["retried"] = await retry
    return seen


def test_a_stopping_server_cancels_the_asynchronous_edits_and_lets_keyed_ones_finish():
    """Nobody can fetch an asynchronous edit's answer once the server is down (answers live in its memory):
    stopping cancels them at their workers at once; a keyed synchronous edit's client is connected and
    waits, so it goes on."""
    seen = asyncio.run(stopping())
    assert seen["cancelled"] == 1 and seen["ids"][0] == seen["ids"][1]
    # the server's stop, not the client's doing: 503, send it again
    assert seen["async"].status_code == 503 and seen["async"].json()["error"]["code"] == "interrupted"
    assert seen["keyed"].status_code == 200
    assert seen["failed"].status_code == 500
    assert seen["retried"].status_code == 200 and seen["retried"].headers["X-Request-Id"] == "mine-1"


def test_a_stream_cleans_up_even_when_it_never_began():
    """Starlette cancels the stream of a client already gone before its generator starts, and the
    generator's `finally` never runs: the edit's cleanup is the response's."""
    from retouch.http_api import ClosingStreamingResponse

    closed, began = [], []

    async def events():
        began.append(True)
        yield b"event: done\n\n"

    async def gone(message):
        raise OSError("the client went away")

    async def receive():
        return {"type": "http.disconnect"}

    response = ClosingStreamingResponse(events(), lambda: closed.append(True), media_type="text/event-stream")
    with pytest.raises(OSError):
        asyncio.run(response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, gone))
    assert closed == [True] and began == []


async def an_edit_of_a_deleted_template() -> httpx.Response:
    async with server_with_a_template() as (client, router, worker, form):
        posted = asyncio.create_task(client.post("/v1/edits", headers=auth(), data=form, files=mask_file()))
        edit = await asyncio.to_thread(worker.receive, "edit")
        worker.fail(edit["request"], 404, "template_deleted", f"template {form['template_id']!r} was deleted")
        return await posted


def test_an_edit_whose_template_was_deleted_names_the_template_id():
    answer = asyncio.run(an_edit_of_a_deleted_template())
    error = answer.json()["error"]
    assert answer.status_code == 404 and (error["code"], error["param"]) == ("template_deleted", "template_id")
