"""Per-request LoRA at the user-facing boundaries: the `lora` field of both edit endpoints refused at
once when it is malformed, unknown or unservable (4xx naming the param, nothing queued); a valid one
carried router -> worker node -> `Engine.submit` as JSON and its metrics back; a worker's LoraError
answered 422 naming the param; the heartbeat's LoRA counters in the router's view; the options.

The node runs for real (its socket, its thread) in front of an engine stand-in that records what it
is asked and leaves each future to the test: no model, no sleeps."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import math
import queue
import threading
from concurrent.futures import Future
from types import SimpleNamespace

import httpx
import pytest
from diffusers import FlowMatchEulerDiscreteScheduler
from PIL import Image
from polling import free_port, until
from scripted_worker import ScriptedWorker

from retouch.config import EditOptions, ServeOptions, WorkerOptions
from retouch.engine.metrics import RequestMetrics, now
from retouch.engine.node import Node
from retouch.engine.policies import RequestLoad
from retouch.engine.router import EditTask, TemplateRecord
from retouch.engine.worker import EditResult, EngineConfig
from retouch.errors import InputError
from retouch.http_api import Limits, create_app
from retouch.lora import LoraError, LoraUse, parse_lora
from retouch.server import router_config

TIMEOUT_S = 10.0
SIZE = (32, 32)
LORA_METRICS = {"cached_bytes": 4096, "cached_adapters": 1, "budget_bytes": 1 << 30, "hits": 2, "misses": 1,
                "evictions": 0, "loads": 1, "load_failures": 0, "load_seconds": 0.25}


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@pytest.fixture
def lora_dir(tmp_path):
    """A LoRA folder with "grain" (a file) and "ink" (a diffusers folder); content is the worker's concern."""
    (tmp_path / "grain.safetensors").write_bytes(b"weights")
    (tmp_path / "ink").mkdir()
    (tmp_path / "ink" / "pytorch_lora_weights.safetensors").write_bytes(b"weights")
    return tmp_path


def one_off_edit(endpoint: str, lora: str, **fields) -> dict:
    """A one-off edit of either endpoint (the OpenAI one reads alpha 0 as repaint) with `lora`."""
    if endpoint == "/v1/images/edits":
        mask = png(Image.new("RGBA", SIZE, (0, 0, 0, 0)))
    else:
        mask = png(Image.new("L", SIZE, 255))
    return {"files": {"image": ("i.png", png(Image.new("RGB", SIZE, "red")), "image/png"),
                      "mask": ("m.png", mask, "image/png")},
            "data": {"prompt": "a cat", "lora": lora, **fields}}


def sse_events(text: str) -> list[tuple[str, dict]]:
    names = [line.removeprefix("event: ") for line in text.splitlines() if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in text.splitlines() if line.startswith("data: ")]
    return list(zip(names, data))


# case: (the lora field, status, error code)
BAD_LORAS = {
    "bad syntax": ("bad::x", 400, "invalid_lora"),
    "scale not a number": ("grain:lots", 400, "invalid_lora"),
    "scale out of range": ("grain:99", 400, "invalid_lora"),
    "too many": ("a,b,c,d,e", 400, "invalid_lora"),
    "a name twice": ("grain,grain:0.5", 400, "invalid_lora"),
    "a path": ("../grain", 400, "invalid_lora"),
    "malformed json": ('["grain"', 400, "invalid_lora"),
    "json nested past python's recursion limit": ("[" * 100_000, 400, "invalid_lora"),
    "json object with another key": ('[{"name": "grain", "weight": 1}]', 400, "invalid_lora"),
    "unknown name": ("grain,nope", 404, "lora_not_found"),
}


async def refused(router, limits: Limits, endpoint: str, lora: str) -> httpx.Response:
    app = create_app(router, limits)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
        return await client.post(endpoint, **one_off_edit(endpoint, lora))


@pytest.mark.parametrize("endpoint", ["/v1/edits", "/v1/images/edits"])
@pytest.mark.parametrize("case", BAD_LORAS)
def test_a_bad_lora_is_refused_naming_the_param_before_anything_is_queued(make_router, lora_dir, endpoint, case):
    router = make_router()
    lora, status, code = BAD_LORAS[case]
    answer = asyncio.run(refused(router, Limits(lora_dir=lora_dir), endpoint, lora))
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == "lora" and answer.json()["error"]["code"] == code
    snapshot = router.snapshot()
    assert snapshot["pending"] == 0 and snapshot["templates"] == 0  # not even the one-off image was kept


def test_an_unknown_lora_is_refused_without_naming_the_servers_folder(make_router, lora_dir):
    answer = asyncio.run(refused(make_router(), Limits(lora_dir=lora_dir), "/v1/edits", "nope"))
    assert answer.status_code == 404 and "'nope'" in answer.json()["error"]["message"]
    assert str(lora_dir) not in answer.text


def test_the_served_loras_and_model_are_listed(make_router, lora_dir):
    async def lists(limits, model):
        app = create_app(make_router(), limits, model)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
            return (await client.get("/v1/loras")).json(), (await client.get("/v1/models")).json()

    loras, models = asyncio.run(lists(Limits(lora_dir=lora_dir), str(lora_dir / "my-pipeline")))
    assert loras == {"data": [{"name": "grain"}, {"name": "ink"}]}
    assert [model["id"] for model in models["data"]] == ["my-pipeline"]  # a folder's name, not its path
    assert asyncio.run(lists(Limits(), "tiny-flux-fill"))[0] == {"data": []}
    # --served-model-name: the names a request's `model` may give, each listed
    names = ServeOptions(model=str(lora_dir / "my-pipeline"), served_model_name="flux-fill, gpt-image-1").model_names()
    assert names == ("flux-fill", "gpt-image-1")
    _, models = asyncio.run(lists(Limits(model_names=names), "my-pipeline"))
    assert [model["id"] for model in models["data"]] == ["flux-fill", "gpt-image-1"]


def test_a_lora_folder_gone_after_the_start_is_the_servers_error(make_router, tmp_path):
    """Not an empty list and 404s (a client's errors): 503, naming the field, retried later."""
    gone = tmp_path / "loras"  # never made: as if deleted after the server started
    answer = asyncio.run(refused(make_router(), Limits(lora_dir=gone), "/v1/edits", "grain"))
    error = answer.json()["error"]
    assert answer.status_code == 503 and (error["code"], error["param"]) == ("lora_folder_missing", "lora")
    assert str(gone) not in answer.text and answer.headers["retry-after"] == "30"

    async def listing():
        app = create_app(make_router(), Limits(lora_dir=gone), "tiny-flux-fill")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
            return await client.get("/v1/loras")
    listed = asyncio.run(listing())
    assert listed.status_code == 503 and listed.json()["error"]["code"] == "lora_folder_missing"


def test_spaces_around_a_lora_scale_are_allowed():
    assert parse_lora(" grain : 0.5 , ink") == (LoraUse("grain", 0.5), LoraUse("ink"))


@pytest.mark.parametrize("endpoint", ["/v1/edits", "/v1/images/edits"])
def test_a_server_without_a_lora_folder_refuses_any_lora(make_router, endpoint):
    router = make_router()
    answer = asyncio.run(refused(router, Limits(), endpoint, "grain"))
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "lora"
    assert answer.json()["error"]["code"] == "lora_unsupported" and "--lora-dir" in answer.json()["error"]["message"]
    assert router.snapshot()["pending"] == 0


def test_the_openapi_docs_show_the_lora_field(make_router):
    schema = create_app(make_router(), Limits()).openapi()
    for path in ("/v1/edits", "/v1/images/edits"):
        form = schema["paths"][path]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
        assert "NAME[:SCALE]" in form["properties"]["lora"]["description"] and "prompt" in form["required"]


class RecordingEngine:
    """What `Node` asks of an `Engine`: each submit is recorded as (kind, request or image, lora, future)
    and its future left to the test; templates are recorded at once."""

    model_name = "stand-in"
    config = EngineConfig(max_batch=4)

    def __init__(self):
        self.submitted: queue.Queue = queue.Queue()
        self.scopes: list[str] = []  # of the templates made and one-off edits submitted, in order
        self.watches: list = []  # of the one-off edits submitted, in order
        self.one_off_settings: list[tuple] = []  # (steps, guidance, negative_prompt) of each, in order

        def new_template(*args, scope="", negative_prompt=None):
            self.scopes.append(scope)
            return SimpleNamespace(template_id="e-1")

        self.editor = SimpleNamespace(cache=None, new_template=new_template,
                                      dtype="float32", model_fingerprint=lambda: "stand-in-weights",
                                      model=SimpleNamespace(family="flux-fill"))
        self.worker = SimpleNamespace(loras=SimpleNamespace(metrics=lambda: dict(LORA_METRICS),
                                                            resident=lambda: ["grain", "ink"], lora_dir="loras",
                                                            digests=lambda: {"grain": "g1", "ink": "i1"}),
                                      # the sampler its loop steps with (what a hello says of it)
                                      scheduler=SimpleNamespace(template=FlowMatchEulerDiscreteScheduler()))

    def submit(self, request, watch=None, budget_s=None, lora=()) -> Future:
        return self._recorded("submit", request, lora)

    def submit_image(self, image, mask, prompt, seed=0, steps=28, guidance=None, watch=None, budget_s=None,
                     lora=(), strength=1.0, record_beside=None, scope="", negative_prompt=None) -> Future:
        self.scopes.append(scope)
        self.watches.append(watch)
        self.one_off_settings.append((steps, guidance, negative_prompt))
        return self._recorded("submit_image", image, lora)

    def submit_recording(self, template, on_step=None, only_if_room=False) -> Future:
        done = Future()
        done.set_result(template.template_id)
        return done

    def _recorded(self, kind: str, what, lora) -> Future:
        future = Future()
        self.submitted.put((kind, what, lora, future))
        return future

    def next_submit(self) -> tuple:
        return self.submitted.get(timeout=TIMEOUT_S)

    def load_report(self):
        return [], []

    def metrics(self) -> dict:
        return {"steps": 0}

    def close(self) -> None:
        pass


def edited(lora_applied_step: int) -> EditResult:
    t = now()
    metrics = RequestMetrics(submitted=t, admitted=t, denoised=t, completed=t, steps=2,
                             lora_applied_step=lora_applied_step)
    return EditResult(Image.new("RGB", SIZE, "blue"), metrics)


async def through_a_node(router, lora_dir) -> dict:
    engine = RecordingEngine()
    node = Node(engine, router.address, "n0", supervised=False)
    thread = threading.Thread(target=node.run, name="test-node")
    thread.start()
    app = create_app(router, Limits(default_steps=2, lora_dir=lora_dir, request_timeout_s=TIMEOUT_S))
    seen = {}
    try:
        await asyncio.to_thread(router.wait_for_workers, 1, TIMEOUT_S)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
            registered = await client.post("/v1/templates", data={"steps": "2"}, files={
                "image": ("t.png", png(Image.new("RGB", SIZE, "red")), "image/png")})
            template_id = registered.json()["id"]
            await asyncio.to_thread(router.wait_until, lambda r: r.template(template_id)["status"] == "ready",
                                    TIMEOUT_S)
            mask = {"mask": ("m.png", png(Image.new("L", SIZE, 255)), "image/png")}
            # A template's edit: Engine.submit gets the parsed choice; the answer is the engine's image.
            answer = asyncio.create_task(client.post("/v1/edits", files=mask, data={
                "template_id": template_id, "prompt": "a cat", "lora": "grain:0.5, ink"}))
            seen["registered"] = (template_id, engine.scopes[-1])
            kind, request, lora, future = await asyncio.to_thread(engine.next_submit)
            seen["template edit"] = (kind, request.template_id, lora)
            future.set_result(edited(0))
            seen["template answer"] = await answer
            # A one-off image, streamed, with the list form: Engine.submit_image gets it; `done` has its metrics.
            answer = asyncio.create_task(client.post("/v1/edits", **one_off_edit(
                "/v1/edits", '[{"name": "ink", "scale": -2}]', stream="true")))
            kind, _, lora, future = await asyncio.to_thread(engine.next_submit)
            seen["one-off edit"] = (kind, lora)
            seen["one-off scope"] = engine.scopes[-1]
            future.set_result(edited(1))
            seen["one-off events"] = sse_events((await answer).text)
            # The OpenAI form, and a LoRA the worker then fails to load.
            answer = asyncio.create_task(client.post("/v1/images/edits", **one_off_edit("/v1/images/edits", "ink")))
            kind, _, lora, future = await asyncio.to_thread(engine.next_submit)
            seen["openai edit"] = lora
            future.set_exception(LoraError("ink is not a LoRA of this model"))
            seen["load failure"] = await answer
            answer = asyncio.create_task(client.post("/v1/edits", **one_off_edit("/v1/edits", "ink", stream="true")))
            *_, future = await asyncio.to_thread(engine.next_submit)
            future.set_exception(LoraError("ink is not a LoRA of this model"))
            seen["streamed load failure"] = sse_events((await answer).text)
        await asyncio.to_thread(router.wait_until, lambda r: "lora" in r.snapshot()["workers"].get("n0", {}),
                                TIMEOUT_S)
        seen["heartbeat"] = router.snapshot()["workers"]["n0"]["lora"]
        seen["held"] = router.workers["n0"].loras  # what LoRA affinity routes by
    finally:
        await asyncio.to_thread(router.close, 0)
        # a worker started on its own is told the router is closing, and stays up for the next one
        seen["told closing"] = await asyncio.to_thread(lambda: until(lambda: not node.welcomed.is_set(), TIMEOUT_S))
        node.stop()
        await asyncio.to_thread(thread.join, TIMEOUT_S)
    seen["node stopped"] = not thread.is_alive()
    return seen


def test_a_template_edit_sent_with_its_image_keeps_its_own_guidance_and_negative_prompt(context, make_router):
    """A template ready only where LoRAs are not served: an edit of it with a LoRA goes to a worker that serves
    them, with the image, and is computed in full there (`Router._route`). It runs at its own guidance scale,
    not the template's, and with its negative prompt."""
    router = make_router(template_replicas=1)
    plain = ScriptedWorker(context, router, "plain", lora=False)
    router.register_template(TemplateRecord("t1", png(Image.new("RGB", SIZE, "red")), SIZE, "a scene", 2, 0, 6.0, 1,
                                            negative_prompt="dark"))
    plain.register("t1")
    engine = RecordingEngine()
    node = Node(engine, router.address, "n0", supervised=False)
    thread = threading.Thread(target=node.run, name="test-node")
    thread.start()
    try:
        sent = router.submit(EditTask("t1", bytes(SIZE[0] * SIZE[1]), SIZE, "a cat", 0, RequestLoad(4, 1, 2),
                                      lora=parse_lora("grain"), negative_prompt="green", guidance=9.0))
        kind, _, lora, future = engine.next_submit()
        future.set_result(edited(0))
        assert sent.result(TIMEOUT_S).status == 200
    finally:
        router.close(0)
        node.stop()
        thread.join(TIMEOUT_S)
    assert (kind, lora) == ("submit_image", (LoraUse("grain", 1.0),))
    assert engine.one_off_settings == [(2, 9.0, "green")]


def test_a_lora_reaches_the_engine_through_router_and_node_and_its_failure_names_the_param(make_router, lora_dir):
    seen = asyncio.run(through_a_node(make_router(), lora_dir))
    assert seen["told closing"] and seen["node stopped"]
    router_id, scope = seen["registered"]
    assert scope == router_id  # which names its tenant: the worker's recording is that tenant's only
    assert seen["template edit"] == ("submit", "e-1", (LoraUse("grain", 0.5), LoraUse("ink", 1.0)))
    assert seen["template answer"].status_code == 200
    assert seen["template answer"].headers["content-type"] == "image/png"

    assert seen["one-off edit"] == ("submit_image", (LoraUse("ink", -2.0),))
    events = seen["one-off events"]
    assert [name for name, _ in events][0] == "accepted" and events[-1][0] == "done"
    assert events[0][1]["lora"] == [{"name": "ink", "scale": -2.0}]
    # the router's id of the image, which names its tenant: the worker's recording of it is that tenant's only
    assert seen["one-off scope"] == events[0][1]["template_id"] and seen["one-off scope"].startswith("img-")
    assert events[-1][1]["metrics"]["lora_applied_step"] == 1

    assert seen["openai edit"] == (LoraUse("ink", 1.0),)
    failure = seen["load failure"]
    assert failure.status_code == 422
    assert failure.json()["error"] == {"message": "ink is not a LoRA of this model", "type": "invalid_request_error",
                                       "param": "lora", "code": "lora_failed"}
    name, error = seen["streamed load failure"][-1]
    assert name == "error" and error["status"] == 422 and error["error"]["param"] == "lora"
    assert seen["heartbeat"] == LORA_METRICS
    assert seen["held"] == {"grain", "ink"}


def test_lora_options_are_validated_naming_their_flag(tmp_path):
    missing = tmp_path / "missing"
    for options, fields in ((ServeOptions, {"model": "m"}), (WorkerOptions, {"model": "m", "connect": "tcp://h:1"})):
        assert options(**fields, lora_dir=tmp_path).lora_latest_step == 0.3
        for bad, flag in (({"lora_dir": missing}, "--lora-dir"), ({"lora_cache_mb": 0.0}, "--lora-cache-mb"),
                          ({"lora_latest_step": 1.5}, "--lora-latest-step"),
                          ({"lora_latest_step": -0.1}, "--lora-latest-step")) + (
                          (({"lora_affinity": -2}, "--lora-affinity"),
                           ({"template_replicas": -1}, "--template-replicas"),
                           ({"template_affinity": -2}, "--template-affinity")) if options is ServeOptions else ()):
            with pytest.raises(InputError, match=flag):
                options(**fields, **bad)
    edit = {"model": "m", "image": tmp_path / "i.png", "mask": tmp_path / "m.png", "prompt": "a hat"}
    assert EditOptions(**edit, lora="grain:0.5,ink", lora_dir=tmp_path).lora_choice() == (
        LoraUse("grain", 0.5), LoraUse("ink", 1.0))
    assert EditOptions(**edit).lora_choice() == ()
    for bad, message in (({"lora": "bad::x", "lora_dir": tmp_path}, "--lora: "),
                         ({"lora": "grain"}, "add --lora-dir"),
                         ({"lora": "grain", "lora_dir": missing}, "--lora-dir"),
                         ({"lora": "grain", "lora_dir": tmp_path, "strength": 1.5}, "--strength"),
                         ({"lora": "grain", "lora_dir": tmp_path, "paste_back": False}, "--no-paste-back")):
        with pytest.raises(InputError, match=message):
            EditOptions(**edit, **bad)


def test_the_serve_flags_reach_the_options(tmp_path):
    from retouch.cli import build_parser
    from retouch.config import from_arguments

    args = build_parser().parse_args(["serve", "--model", "m", "--lora-dir", str(tmp_path), "--lora-cache-mb", "64",
                                      "--lora-latest-step", "0"])
    opts = from_arguments(ServeOptions, args)
    assert (opts.lora_dir, opts.lora_cache_mb, opts.lora_latest_step) == (tmp_path, 64.0, 0.0)
    # LoRA affinity: on by default (bound 0), a bound, or off (the policy alone: RouterConfig None).
    for flags, affinity in (([], 0), (["--lora-affinity", "2"], 2), (["--lora-affinity", "-1"], None)):
        args = build_parser().parse_args(["serve", "--model", "m", *flags])
        assert router_config(from_arguments(ServeOptions, args)).lora_affinity == affinity
        # template affinity: the same flag grammar
        args = build_parser().parse_args(["serve", "--model", "m", *(f.replace("lora", "template") for f in flags)])
        assert router_config(from_arguments(ServeOptions, args)).template_affinity == affinity
    args = build_parser().parse_args(["serve", "--model", "m", "--template-replicas", "2"])
    assert router_config(from_arguments(ServeOptions, args)).template_replicas == 2
    # every router flag reaches its own field (a field added in the middle once shifted --max-queue)
    args = build_parser().parse_args(["serve", "--model", "m", "--max-queue", "7", "--transfer-timeout-s", "30",
                                      "--heartbeat-s", "0.25", "--dead-after-s", "3", "--policy", "round-robin"])
    config = router_config(from_arguments(ServeOptions, args))
    assert (config.max_queue, config.transfer_timeout_s, config.heartbeat_s, config.dead_after_s, config.policy) == (
        7, 30.0, 0.25, 3.0, "round-robin")
    for bad in ({"drain_s": -1.0}, {"drain_s": math.nan}, {"transfer_timeout_s": 0.0}, {"result_ttl_s": 0.0}):
        with pytest.raises(InputError, match=f"--{next(iter(bad)).replace('_', '-')} must be"):
            ServeOptions(model="m", **bad)


def test_a_worker_that_joins_a_new_router_drops_the_old_ones_edits(make_router):
    """Their clients were answered by the router that died (or it died with them): the worker cancels them
    when another router (another session) welcomes it, instead of computing them for nobody."""
    address = f"tcp://127.0.0.1:{free_port()}"
    old = make_router(address=address)
    engine = RecordingEngine()
    node = Node(engine, address, "n0", supervised=False)
    thread = threading.Thread(target=node.run, name="test-node")
    thread.start()
    try:
        assert old.wait_for_workers(1, TIMEOUT_S)
        old.register_template(TemplateRecord("t1", png(Image.new("RGB", SIZE, "red")), SIZE, "", 2, 0, None, 0))
        assert old.wait_until(lambda r: r.template("t1")["status"] == "ready", TIMEOUT_S)
        old.submit(EditTask("t1", bytes(SIZE[0] * SIZE[1]), SIZE, "a cat", 0,
                            RequestLoad(image_tokens=4, masked_tokens=1, steps=2)))
        *_, orphan = engine.next_submit()
        old.close(drain_s=0)
        new = make_router(address=address)
        assert new.wait_for_workers(1, TIMEOUT_S)
        assert until(orphan.cancelled, TIMEOUT_S)
    finally:
        node.stop()
        thread.join(TIMEOUT_S)


def test_a_worker_tells_the_router_which_one_off_image_its_host_cache_cannot_hold(make_router):
    """An edit that cannot record its one-off image says so at the step it finds out (`StepWatch.on_unrecorded`)
    and in its answer (`EditResult.unrecorded`); the router then sends the image's edits side by side rather
    than one at a time (`test_router`), counting the image once."""
    router = make_router()
    engine = RecordingEngine()
    node = Node(engine, router.address, "n0", supervised=False)
    thread = threading.Thread(target=node.run, name="test-node")
    thread.start()
    try:
        assert router.wait_for_workers(1, TIMEOUT_S)
        image = TemplateRecord("img-1", png(Image.new("RGB", SIZE, "red")), SIZE, "", 2, 0, None, 1, one_off=True)
        _, [answer] = router.submit_many([EditTask("img-1", bytes(SIZE[0] * SIZE[1]), SIZE, "a cat", 0,
                                                   RequestLoad(image_tokens=4, masked_tokens=1, steps=2))], image)
        kind, *_, future = engine.next_submit()
        assert kind == "submit_image"
        engine.watches[-1].on_unrecorded("too_large")  # at the step it found out: before its answer
        assert router.wait_until(lambda r: r.snapshot()["counters"]["one_offs_too_large"] == 1, TIMEOUT_S)
        assert router.templates["img-1"].too_large_for == {"n0"} and not answer.done()
        future.set_result(dataclasses.replace(edited(0), unrecorded="too_large"))
        assert answer.result(TIMEOUT_S).status == 200
        assert router.snapshot()["counters"]["one_offs_too_large"] == 1  # counted once
    finally:
        node.stop()
        thread.join(TIMEOUT_S)


def test_a_worker_echoes_the_number_of_the_last_router_message_it_received():
    """The router tells an edit still on its way (a large image over a slow link) from one lost with a
    dropped link by the number its heartbeats echo."""
    from retouch.engine import wire

    node = Node(RecordingEngine(), f"tcp://127.0.0.1:{free_port()}", "n0", supervised=False)
    try:
        assert node._heartbeat()["seen"] == 0
        for seq in (1, 2, 7):
            node._on_message(wire.encode({"kind": "alive", "seq": seq}))
            assert node._heartbeat()["seen"] == seq
        node._on_message(wire.encode({"kind": "alive"}))  # a router that does not number them: unchanged
        assert node._heartbeat()["seen"] == 7
    finally:
        node.context.destroy(linger=0)


def test_a_worker_heartbeat_names_the_templates_in_its_host_memory_by_the_routers_ids():
    """The router's template affinity reads `cached`: the editor names templates its own way, so each is
    said by every router id the worker serves it under; one not in host memory is not said."""
    import torch

    from retouch.cache import CacheStore, StoreConfig

    engine = RecordingEngine()
    engine.editor.cache = store = CacheStore(StoreConfig(host_bytes=1 << 20))
    for template_id in ("e-1", "e-2"):
        store.begin(template_id)
        store.put(template_id, 0, 0, "out", torch.zeros(4, 8))
        store.commit(template_id)
    node = Node(engine, f"tcp://127.0.0.1:{free_port()}", "n0", supervised=False)
    node.templates.update({"t1": "e-1", "t2": "e-2", "t3": "e-1", "t4": "e-3"})
    try:
        assert sorted(node._heartbeat()["cached"]) == ["t1", "t2", "t3"]
        store.drop("e-1")
        assert node._heartbeat()["cached"] == ["t2"]
    finally:
        node.context.destroy(linger=0)
        store.close()


def test_a_worker_sent_an_edit_again_cancels_its_older_copy_and_tags_each_answer_with_its_attempt():
    """Sent again by a router that presumed it dead, a worker ran both copies: twice the compute, and the
    older one's steps in the edit's stream."""
    from retouch.engine import wire

    engine = RecordingEngine()
    node = Node(engine, f"tcp://127.0.0.1:{free_port()}", "n0", supervised=False)
    node.templates["t1"] = "e-1"
    edit = {"kind": "edit", "request": 5, "template": "t1", "prompt": "a cat", "seed": 0, "mask_size": [2, 2]}
    try:
        node._on_message(wire.encode(edit | {"attempt": 1}, blobs={"mask": bytes(4)}))
        *_, older = engine.next_submit()
        node._on_message(wire.encode(edit | {"attempt": 2}, blobs={"mask": bytes(4)}))
        *_, newer = engine.next_submit()
        assert older.cancelled() and not newer.done()
        newer.set_result(edited(0))
        posted = []
        while not node._outgoing.empty():
            header, _, _ = wire.decode(node._outgoing.get_nowait()[1])
            posted.append(header)
        results = [(header["attempt"], header["status"]) for header in posted if header["kind"] == "result"]
        assert results == [(1, 409), (2, 200)]
        assert node._heartbeat()["held"] == []
    finally:
        node.context.destroy(linger=0)

