"""`strength` over HTTP (against a scripted worker): it reaches the worker, progress and the work limit count
the steps that run (as the worker's family rounds them), a one-off image below strength 1 is not recorded,
and a bad value is refused naming the field."""

from __future__ import annotations

import asyncio
import io
import json

import httpx
import pytest
import zmq
from PIL import Image
from scripted_worker import ScriptedWorker

from retouch.engine.router import Router, RouterConfig
from retouch.http_api import Limits, create_app


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


MASK = {"mask": ("m.png", png(Image.new("L", (32, 32), 255)), "image/png")}


async def with_worker(family: str, scenario, max_work: int = 32 * 32 * 8):
    """`scenario(client, worker, template_id)` against a scripted worker of `family` holding an 8-step template."""
    router = Router(RouterConfig(address="tcp://127.0.0.1:0", policy="least-requests", heartbeat_s=0.05,
                                 dead_after_s=60.0)).start()
    context = zmq.Context()
    app = create_app(router, Limits(default_steps=8, request_timeout_s=20, max_work=max_work))
    try:
        worker = ScriptedWorker(context, router, "w0", family=family)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
            registered = await client.post("/v1/templates", data={"steps": "8"}, files={
                "image": ("t.png", png(Image.new("RGB", (32, 32), "red")), "image/png")})
            if registered.status_code != 202:  # over the work limit: the scenario edits one-off images
                return await scenario(client, worker, None)
            await asyncio.to_thread(worker.register, registered.json()["id"])
            return await scenario(client, worker, registered.json()["id"])
    finally:
        router.close(drain_s=0)
        context.destroy(linger=0)


def events_of(text: str) -> list[tuple[str, dict]]:
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if not line.startswith(":"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events


@pytest.mark.parametrize("family,strength,steps_run", [("sdxl", "0.3", 2), ("flux-fill", "0.3", 3),
                                                       ("sd3", "1", 8)])
def test_a_streamed_edit_counts_the_steps_its_workers_family_runs(family, strength, steps_run):
    async def scenario(client, worker, template_id):
        answer = asyncio.create_task(client.post("/v1/edits", files=MASK, data={
            "template_id": template_id, "prompt": "a cat", "strength": strength, "stream": "true"}))
        edit = await asyncio.to_thread(worker.receive, "edit")
        await asyncio.to_thread(worker.answer, edit["request"], png(Image.new("RGB", (32, 32), "blue")))
        return edit, await answer

    edit, answer = asyncio.run(with_worker(family, scenario))
    assert answer.status_code == 200
    assert edit.get("strength", 1.0) == float(strength)
    accepted = dict(events_of(answer.text))["accepted"]
    assert accepted["steps"] == steps_run


def test_the_openai_edit_takes_strength():
    async def scenario(client, worker, template_id):
        mask = {"mask": ("m.png", png(Image.new("RGBA", (32, 32), (0, 0, 0, 0))), "image/png")}
        answer = asyncio.create_task(client.post("/v1/images/edits", files=mask, data={
            "template_id": template_id, "prompt": "a cat", "strength": "0.5"}))
        edit = await asyncio.to_thread(worker.receive, "edit")
        await asyncio.to_thread(worker.answer, edit["request"], png(Image.new("RGB", (32, 32), "blue")))
        return edit, await answer

    edit, answer = asyncio.run(with_worker("sdxl", scenario))
    assert answer.status_code == 200 and edit["strength"] == 0.5


def test_the_work_limit_counts_the_steps_that_run():
    async def scenario(client, worker, template_id):
        assert template_id is None  # 8 steps of 32x32 are over the limit of 4
        image = {"image": ("i.png", png(Image.new("RGB", (32, 32), "green")), "image/png")}
        over = await client.post("/v1/edits", files={**image, **MASK}, data={"prompt": "a cat"})
        answer = asyncio.create_task(client.post("/v1/edits", files={**image, **MASK}, data={
            "prompt": "a cat", "strength": "0.5"}))
        edit = await asyncio.to_thread(worker.receive, "edit")
        await asyncio.to_thread(worker.answer, edit["request"], png(Image.new("RGB", (32, 32), "blue")))
        return over, edit, await answer

    over, edit, answer = asyncio.run(with_worker("sdxl", scenario, max_work=32 * 32 * 4))
    assert over.status_code == 413 and over.json()["error"]["code"] == "too_much_work"
    assert answer.status_code == 200 and edit["strength"] == 0.5


def test_a_one_off_image_below_full_strength_is_computed_in_full_and_not_recorded():
    async def scenario(client, worker, template_id):
        image = {"image": ("i.png", png(Image.new("RGB", (32, 32), "green")), "image/png")}
        answer = asyncio.create_task(client.post("/v1/edits", files={**image, **MASK}, data={
            "prompt": "a cat", "strength": "0.5"}))
        edit = await asyncio.to_thread(worker.receive, "edit")
        # it records nothing: another edit of the image meanwhile carries it too (else it would wait for it)
        second = asyncio.create_task(client.post("/v1/edits", files={**image, **MASK}, data={"prompt": "a dog"}))
        again = await asyncio.to_thread(worker.receive, "edit")
        for sent in (edit, again):
            await asyncio.to_thread(worker.answer, sent["request"], png(Image.new("RGB", (32, 32), "blue")))
        return edit, await answer, again, await second

    edit, first, again, second = asyncio.run(with_worker("sd2", scenario))
    assert first.status_code == second.status_code == 200
    assert edit["one_off"] == {"steps": 8, "guidance": None} and edit["strength"] == 0.5
    assert again["one_off"] == {"steps": 8, "guidance": None} and "strength" not in again


@pytest.mark.parametrize("recorded", [True, False])
def test_a_one_off_image_edited_below_full_strength_again_is_recorded_beside_that_edit(recorded):
    """Its second edit below strength 1 asks its worker to record it too; edits meanwhile wait for that
    recording, then are mask-aware edits of it (sent without the image). A failed recording sends them
    on with the image, and is not asked for again."""
    blue = png(Image.new("RGB", (32, 32), "blue"))

    async def scenario(client, worker, template_id):
        image = {"image": ("i.png", png(Image.new("RGB", (32, 32), "green")), "image/png")}

        def edit(prompt):
            return asyncio.create_task(client.post("/v1/edits", files={**image, **MASK}, data={
                "prompt": prompt, "strength": "0.5"}))

        sent, answers = [], []
        for prompt in ("a cat", "a dog"):
            answers.append(edit(prompt))
            sent.append(await asyncio.to_thread(worker.receive, "edit"))
            await asyncio.to_thread(worker.answer, sent[-1]["request"], blue)
        template = (await client.get(f"/v1/templates/{(await answers[0]).headers['X-Template-Id']}")).json()
        answers.append(edit("a bird"))
        await asyncio.to_thread(worker.sync)
        parked = "edit" not in worker.pending_kinds()
        worker.send({"kind": "template", "template": sent[1]["template"], "ok": recorded, "message": "out of memory"})
        sent.append(await asyncio.to_thread(worker.receive, "edit"))
        await asyncio.to_thread(worker.answer, sent[-1]["request"], blue)
        answers.append(edit("a fish"))
        sent.append(await asyncio.to_thread(worker.receive, "edit"))
        await asyncio.to_thread(worker.answer, sent[-1]["request"], blue)
        return sent, [await answer for answer in answers], template, parked

    sent, answers, template, parked = asyncio.run(with_worker("flux-fill", scenario))
    assert all(answer.status_code == 200 for answer in answers)
    assert "records" not in sent[0]["one_off"] and sent[1]["one_off"] == {"steps": 8, "guidance": None,
                                                                          "records": True}
    assert template["status"] == "recording" and parked
    if recorded:
        assert "one_off" not in sent[2] and "one_off" not in sent[3]  # the worker holds it: mask-aware edits
    else:
        assert all(edit["one_off"] == {"steps": 8, "guidance": None} for edit in sent[2:])


def test_n_images_of_one_request_are_one_edit_of_the_image_not_two():
    """n=2 below full strength on a new image asks for no recording (both images compute in full at once);
    the next request of the image does."""
    blue = png(Image.new("RGB", (32, 32), "blue"))

    async def scenario(client, worker, template_id):
        image = ("i.png", png(Image.new("RGB", (32, 32), "green")), "image/png")
        clear = ("m.png", png(Image.new("RGBA", (32, 32), (0, 0, 0, 0))), "image/png")
        sent = []
        for n in ("2", "1"):
            answer = asyncio.create_task(client.post("/v1/images/edits", files={"image": image, "mask": clear},
                                                     data={"prompt": "a cat", "strength": "0.5", "n": n}))
            for _ in range(int(n)):
                sent.append(await asyncio.to_thread(worker.receive, "edit"))
                await asyncio.to_thread(worker.answer, sent[-1]["request"], blue)
            answered = await answer
            assert answered.status_code == 200 and answered.headers["X-Template-Id"] == sent[-1]["template"]
        return sent

    sent = asyncio.run(with_worker("flux-fill", scenario))
    assert [edit["one_off"].get("records", False) for edit in sent] == [False, False, True]


@pytest.mark.parametrize("value,status,says", [
    ("0", 422, "strength must be in (0, 1], got 0.0"), ("-1", 422, "strength must be in (0, 1], got -1.0"),
    ("1.5", 422, "strength must be in (0, 1], got 1.5"), ("nan", 422, "strength must be a number in (0, 1]"),
    ("half", 400, "strength must be a number, got 'half'"), (" 0.5", 400, "strength must be a number"),
    ("0.1", 422, "strength 0.1 of 8 steps is less than one step's worth")])
def test_a_bad_strength_is_refused_naming_it_before_any_work(value, status, says):
    async def scenario(client, worker, template_id):
        answer = await client.post("/v1/edits", files=MASK, data={"template_id": template_id, "prompt": "a cat",
                                                                  "strength": value})
        await asyncio.to_thread(worker.sync)
        return answer, worker.pending_kinds()

    answer, sent = asyncio.run(with_worker("sdxl", scenario))
    assert answer.status_code == status
    error = answer.json()["error"]
    assert error["param"] == "strength" and says in error["message"]
    assert "edit" not in sent
