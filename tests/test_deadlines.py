"""Deadlines (SLOs): the worker admits by slack with a deterministic predictor (FIFO among equals and
among requests without one), the router refuses what it predicts cannot finish in time only when told
to (a fake StepCost makes the prediction exact), the HTTP field `slo_ms` is validated, and SLO
attainment is counted per size class (met, missed, refused) into /metrics."""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from dataclasses import replace

import httpx
import numpy as np
import pytest
from editor_inputs import square_mask, template_image
from PIL import Image
from scripted_worker import TIMEOUT_S, ScriptedWorker

from retouch.config import ServeOptions
from retouch.editor import EditRequest, MaskAwareEditor
from retouch.engine.metrics import now
from retouch.engine.policies import RequestLoad
from retouch.engine.router import (DeadlineUnattainable, EditTask, Router, RouterConfig, TemplateRecord,
                                   size_class)
from retouch.engine.worker import EngineConfig, Job, Worker
from retouch.errors import InputError
from retouch.http_api import Limits, create_app
from retouch.images import png_bytes
from retouch.models import load_pipeline
from retouch.server import Server

STEP_S = 10.0  # the fake cost model: each request in a batch adds 10 s to its step
LOAD = RequestLoad(image_tokens=16, masked_tokens=4, steps=2)


class FakeStepCost:
    """A StepCost whose step takes STEP_S per request in the batch (one feature: the request count)."""

    num_features = 1

    def request_features(self, image_tokens, masked_tokens, text_tokens=0):
        return np.ones(1)

    def marginal_seconds(self, image_tokens, masked_tokens, text_tokens=0):
        return STEP_S

    def latency(self, features):
        return np.asarray(features, dtype=float)[..., 0] * STEP_S


# ---- the worker's queue ----

def job(deadline: float | None = None) -> Job:
    return Worker.new_job(None, deadline=deadline)


@pytest.fixture(scope="module")
def flux_editor():
    return MaskAwareEditor(load_pipeline("tiny-flux-fill"))


def admission_order(worker: Worker, jobs: list[Job]) -> list[int]:
    worker.waiting = deque(jobs)
    order = []
    while worker.waiting:
        order.append(jobs.index(worker.next_waiting()))
    return order


def test_slack_orders_the_queue_deadlines_first_fifo_among_equals_and_the_rest(flux_editor):
    predicted = {}
    worker = Worker(flux_editor, EngineConfig(mode="naive"), predict_s=lambda j: predicted.get(j.id, 0.0))
    base = now() + 1000.0
    jobs = [job(), job(base + 500), job(), job(base + 500), job(base + 100), job(base + 300)]
    assert admission_order(worker, jobs) == [4, 5, 1, 3, 0, 2]
    # A long predicted run eats slack: the same deadline is admitted before a shorter request's.
    long_run, short_run = job(base + 200), job(base + 100)
    predicted[long_run.id] = 150.0
    assert admission_order(worker, [short_run, long_run]) == [1, 0]
    # No deadline in the queue: FIFO, the predictor is never asked.
    worker.predict_s = lambda j: pytest.fail("predicted without a deadline")
    assert admission_order(worker, [job(), job(), job()]) == [0, 1, 2]


def test_the_default_prediction_is_steps_times_the_measured_step(flux_editor):
    template_id = flux_editor.register_template(template_image(), prompt="a scene", steps=3, seed=1)
    worker = Worker(flux_editor, EngineConfig(mode="naive"))
    edit = Worker.new_job(EditRequest(template_id, square_mask(), "a hat"))
    assert worker.predicted_s(edit) == 0.0  # nothing measured yet
    worker.metrics.record_step(1, 0.5, 0.4, 0.0)
    worker.metrics.record_step(1, 1.5, 1.4, 0.0)
    assert worker.predicted_s(edit) == pytest.approx(3 * 1.0)


def test_a_tight_deadline_submitted_last_is_admitted_first_by_the_loop(flux_editor):
    template_id = flux_editor.register_template(template_image(), prompt="a scene", steps=2, seed=1)
    worker = Worker(flux_editor, EngineConfig(mode="naive", max_batch=1), predict_s=lambda j: 1.0)
    base = now() + 3600.0
    deadlines = [None, base + 100, None, base]  # the tight one last
    jobs = [Worker.new_job(EditRequest(template_id, square_mask(), f"thing {i}", seed=i), deadline=d)
            for i, d in enumerate(deadlines)]
    for queued in jobs:
        worker.inbox.put(("edit", queued))
    worker.inbox.put(("stop",))
    worker.run()
    admitted = [j.metrics.admitted_step for j in jobs]
    assert sorted(range(4), key=admitted.__getitem__) == [3, 1, 0, 2]
    met = [j.future.result().metrics.to_json().get("deadline_met") for j in jobs]
    assert met == [None, True, None, True]


# ---- the router's admission ----

def ready_worker(context, router: Router, max_batch: int = 4) -> ScriptedWorker:
    worker = ScriptedWorker(context, router, "w0", max_batch)
    router.register_template(TemplateRecord("t1", b"png", (64, 64), "", LOAD.steps, 0, None, 0))
    worker.register("t1")
    return worker


def task(budget_s: float) -> EditTask:
    """An edit due `budget_s` from now on the router's clock."""
    return EditTask("t1", bytes(64 * 64), (64, 64), "a cat", 0, replace(LOAD, deadline=time.monotonic() + budget_s))


def test_reject_mode_refuses_what_cannot_finish_in_time_and_accepts_the_rest(context, make_router):
    router = make_router(FakeStepCost(), slo_admission="reject")
    worker = ready_worker(context, router)
    # Idle worker: its 2 steps of a batch of one, 2 x 10 s.
    assert router.predict_finish_s(LOAD) == pytest.approx(2 * STEP_S)
    with pytest.raises(DeadlineUnattainable) as refused:
        router.submit(task(budget_s=5.0))
    assert refused.value.predicted_s == pytest.approx(20.0) and refused.value.budget_s <= 5.0
    assert router.snapshot()["pending"] == 0
    future = router.submit(task(budget_s=1000.0))
    edit = worker.receive("edit")
    assert 0 < edit["budget_s"] <= 1000.0  # the worker is sent what is left, not the router's clock
    worker.answer(edit["request"])
    assert future.result(TIMEOUT_S).metrics["deadline_met"] is True
    counts = router.snapshot()["slo"][size_class(LOAD)]
    assert counts == {"with_deadline": 2, "met": 1, "missed": 0, "refused": 1, "cancelled": 0}


def test_a_refused_one_off_leaves_no_template_and_an_accepted_one_does(context, make_router):
    router = make_router(FakeStepCost(), slo_admission="reject")
    worker = ready_worker(context, router)
    image = TemplateRecord("img-1", b"upload", (64, 64), "", LOAD.steps, 0, None, replicas=1, one_off=True)
    edit = replace(task(budget_s=5.0), template_id="img-1")
    with pytest.raises(DeadlineUnattainable):
        router.submit_many([edit], image)
    assert "img-1" not in router.templates and router.snapshot()["pending"] == 0
    [_], [future] = router.submit_many([replace(edit, load=replace(LOAD, deadline=time.monotonic() + 1000))], image)
    assert router.templates["img-1"] is image
    worker.answer(worker.receive("edit")["request"])
    assert future.result(TIMEOUT_S).status == 200


def test_the_prediction_counts_the_queue_on_a_full_worker(context, make_router):
    router = make_router(FakeStepCost(), slo_admission="reject")
    worker = ready_worker(context, router, max_batch=1)
    running = router.submit(EditTask("t1", bytes(64 * 64), (64, 64), "a dog", 0, LOAD))
    request = worker.receive("edit")["request"]
    worker.heartbeat({}, running=[[request, 1]])  # one step to go
    # Full: 1 step until its slot frees, then its own 2, at the running batch's 10 s a step.
    assert router.predict_finish_s(LOAD) == pytest.approx((1 + 2) * STEP_S)
    worker.answer(request)
    assert running.result(TIMEOUT_S).status == 200


def test_a_deadline_waits_only_for_the_queued_edits_its_worker_admits_first(context, make_router):
    router = make_router(FakeStepCost(), slo_admission="reject")
    worker = ready_worker(context, router, max_batch=1)
    edit = EditTask("t1", bytes(64 * 64), (64, 64), "a dog", 0, LOAD)
    futures = [router.submit(edit)]
    running = worker.receive("edit")["request"]
    worker.heartbeat({}, running=[[running, 1]])  # one step to go; then 3 queued edits without a deadline
    futures += [router.submit(edit) for _ in range(3)]
    queued = [worker.receive("edit")["request"] for _ in range(3)]
    # Without a deadline: behind the 3 queued (2 steps each), one at a time: 1 + 3 x 2 steps, then its own 2.
    assert router.predict_finish_s(LOAD) == pytest.approx((1 + 6 + 2) * STEP_S)
    # With one: the worker admits it first, so only the running edit is ahead (the old prediction: 90 s).
    urgent = replace(LOAD, deadline=time.monotonic() + 1000)
    assert router.predict_finish_s(urgent) == pytest.approx((1 + 2) * STEP_S)
    futures.append(router.submit(replace(edit, load=replace(LOAD, deadline=time.monotonic() + 45))))
    queued.append(worker.receive("edit")["request"])
    # A queued edit with less slack is ahead of a later deadline, one with more slack is not.
    assert router.predict_finish_s(urgent) == pytest.approx((1 + 2 + 2) * STEP_S)
    assert router.predict_finish_s(replace(LOAD, deadline=time.monotonic() + 40)) == pytest.approx(3 * STEP_S)
    for request in (running, *queued):
        worker.answer(request)
    assert [future.result(TIMEOUT_S).status for future in futures] == [200] * 5


@pytest.mark.parametrize("budget_s, admitted", [(50.0, False), (70.0, True)])
def test_the_images_of_one_request_are_predicted_one_after_another(context, make_router, budget_s, admitted):
    router = make_router(FakeStepCost(), slo_admission="reject")
    worker = ready_worker(context, router, max_batch=1)
    # Three images on one idle worker of batch 1: the third ends after 3 x 2 steps of 10 s, not 2.
    tasks = [task(budget_s)] * 3
    if not admitted:
        with pytest.raises(DeadlineUnattainable) as refused:
            router.submit_many(tasks)
        assert refused.value.predicted_s == pytest.approx(60.0)
        assert router.snapshot()["slo"][size_class(LOAD)]["refused"] == 3
        return
    _, futures = router.submit_many(tasks)
    for _ in tasks:
        worker.answer(worker.receive("edit")["request"])
    assert [future.result(TIMEOUT_S).status for future in futures] == [200] * 3


def test_accept_mode_runs_what_will_miss_and_counts_it_missed(context, make_router):
    router = make_router(FakeStepCost(), slo_admission="accept")
    worker = ready_worker(context, router)
    future = router.submit(task(budget_s=-1.0))  # already late: accepted all the same
    worker.answer(worker.receive("edit")["request"])
    answer = future.result(TIMEOUT_S)
    assert answer.status == 200 and answer.metrics["deadline_met"] is False
    assert router.snapshot()["slo"][size_class(LOAD)]["missed"] == 1


def test_size_classes():
    def of(side):
        tokens = (side // 16) ** 2
        return size_class(RequestLoad(image_tokens=tokens, masked_tokens=1, steps=1))
    assert [of(48), of(512), of(528), of(1024), of(8192)] == ["256", "512", "768", "1024", "larger"]


# ---- HTTP: the field, the default, the 429 ----

async def http_scenario(context) -> dict:
    router = Router(RouterConfig(address="tcp://127.0.0.1:0", policy="least-requests", heartbeat_s=0.05,
                                 dead_after_s=60.0, slo_admission="reject"), FakeStepCost()).start()
    app = create_app(router, Limits(default_steps=2, slo_ms_per_megapixel=1.0, slo_ms_min=5000.0))
    outcome = {}
    try:
        worker = await asyncio.to_thread(ScriptedWorker, context, router, "w0")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
            image = {"image": ("t.png", png_bytes(Image.new("RGB", (32, 32), "red")), "image/png")}
            registered = await client.post("/v1/templates", data={"steps": "2"}, files=image)
            await asyncio.to_thread(worker.register, registered.json()["id"])
            form = {"template_id": registered.json()["id"], "prompt": "a cat"}
            mask = {"mask": ("m.png", png_bytes(Image.new("L", (32, 32), 255)), "image/png")}
            for name, slo_ms in (("not a number", "soon"), ("python's digits", "1_000"), ("spaced", " 5 "),
                                 ("zero", "0"), ("over an hour", "3600001"), ("tight", "1"), ("default", None)):
                data = form if slo_ms is None else {**form, "slo_ms": slo_ms}
                outcome[name] = await client.post("/v1/edits", data=data, files=mask)
            metrics = await client.get("/metrics")
            outcome["metrics"] = metrics.text
    finally:
        await asyncio.to_thread(router.close, 0)
    return outcome


def test_slo_ms_is_validated_and_an_unattainable_deadline_is_refused_with_429(context):
    outcome = asyncio.run(http_scenario(context))
    for name in ("not a number", "python's digits", "spaced"):
        assert outcome[name].status_code == 400, name
    for name in ("not a number", "python's digits", "spaced", "zero", "over an hour"):
        assert outcome[name].json()["error"]["param"] == "slo_ms", name
    assert outcome["zero"].status_code == 422 and outcome["over an hour"].status_code == 422
    # 20 s predicted; 1 ms asked, and the default of 1 ms per megapixel, 5 s at least: both refused.
    for name in ("tight", "default"):
        error = outcome[name].json()["error"]
        assert outcome[name].status_code == 429 and error["code"] == "slo_unattainable", name
        assert "20.000 s" in error["message"]
    assert "its deadline" in outcome["tight"].json()["error"]["message"]
    default = outcome["default"].json()["error"]["message"]
    assert "the server's default deadline for its size" in default
    assert 4.5 < float(re.search(r"budget of (\S+) s", default).group(1)) <= 5.0  # the floor, not 1 ms
    assert 'retouch_slo_requests_total{class="256",outcome="refused"} 2.0' in outcome["metrics"]


# ---- through `retouch serve`: met and missed ----

def test_a_served_edit_meets_a_huge_slo_and_misses_a_one_ms_one():
    opts = ServeOptions(model="tiny-flux-fill", workers=1, port=0, mode="naive", worker_threads=1, steps=2,
                        heartbeat_s=0.1, dead_after_s=5.0)
    size = (48, 32)
    mask = Image.new("L", size, 0)
    mask.paste(255, (8, 8, 24, 24))
    parts = {"image": ("i.png", png_bytes(template_image().resize(size)), "image/png"),
             "mask": ("m.png", png_bytes(mask), "image/png")}
    with Server(opts).start() as server, httpx.Client(base_url=server.url, timeout=120) as client:
        met = client.post("/v1/edits", files=parts, data={"prompt": "a hat", "slo_ms": "3600000"})
        missed = client.post("/v1/edits", files=parts, data={"prompt": "a cat", "slo_ms": "1"})
        plain = client.post("/v1/edits", files=parts, data={"prompt": "a cup"})
        assert met.status_code == missed.status_code == plain.status_code == 200
        assert (met.headers["x-deadline-met"], missed.headers["x-deadline-met"]) == ("true", "false")
        assert "x-deadline-met" not in plain.headers
        streamed = client.post("/v1/edits", files=parts, data={"prompt": "a hat", "slo_ms": "3600000",
                                                               "stream": "true"})
        assert '"deadline_met":true' in streamed.text
        exposition = client.get("/metrics").text
    counts = {outcome: float(value) for outcome, value in
              re.findall(r'retouch_slo_requests_total\{class="256",outcome="(\w+)"\} (\S+)', exposition)}
    assert counts == {"with_deadline": 3.0, "met": 2.0, "missed": 1.0, "refused": 0.0, "cancelled": 0.0}
    assert 'retouch_slo_goodput{class="256"} 0.666' in exposition


def test_serve_options_check_the_slo_default():
    with pytest.raises(InputError, match="slo-ms-per-megapixel"):
        ServeOptions(model="tiny-flux-fill", slo_ms_per_megapixel=-1.0)
    with pytest.raises(InputError, match="slo-ms-min"):
        ServeOptions(model="tiny-flux-fill", slo_ms_min=-1.0)
