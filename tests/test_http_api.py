"""The frontend's limits: API key, back-pressure (429 with Retry-After), the answer to requests the
server shuts down before running, and n images of one request admitted and ended together (against
a scripted worker)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io

import anyio
import httpx
import numpy as np
import pytest
import zmq
from PIL import Image
from scripted_worker import ScriptedWorker

from retouch.engine.router import RETRY_AFTER_UNKNOWN_S, Router, RouterConfig
from retouch.http_api import MAX_ERROR_CHARS, Limits, create_app

KEY = "sk-test"


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


async def scenario() -> dict:
    router = Router(RouterConfig(address="tcp://127.0.0.1:0", policy="least-requests", max_queue=1)).start()
    app = create_app(router, Limits(api_keys=(KEY,), default_steps=2))
    auth = {"Authorization": f"Bearer {KEY}"}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://retouch") as client:
        outcome = {"no key": await client.get("/v1/templates"),
                   "wrong key": await client.get("/v1/templates", headers={"Authorization": "Bearer nope",
                                                                           "X-Request-Id": "trace-7"}),
                   "health without key": await client.get("/healthz"),
                   "not ready": await client.get("/readyz")}
        registered = await client.post("/v1/templates", headers=auth, data={"steps": "2"},
                                       files={"image": ("t.png", png(Image.new("RGB", (32, 32), "red")), "image/png")})
        outcome["registered"] = registered
        form = {"template_id": registered.json()["id"], "prompt": "a cat"}
        mask = {"mask": ("m.png", png(Image.new("L", (32, 32), 255)), "image/png")}
        # No worker will ever record the template: the first edit waits (parked), the second is refused.
        first = asyncio.create_task(client.post("/v1/edits", headers=auth, data=form, files=mask))
        while router.snapshot()["pending"] == 0:
            await asyncio.sleep(0)  # let the first request reach the router
        outcome["over the queue"] = await client.post("/v1/edits", headers=auth, data=form, files=mask)
        await asyncio.to_thread(router.close, 0)
        outcome["shut down"] = await first
    return outcome


def test_api_key_back_pressure_and_shutdown():
    outcome = asyncio.run(scenario())
    for name in ("no key", "wrong key"):
        assert outcome[name].status_code == 401 and outcome[name].json()["error"]["param"] == "authorization"
    # every answer, errors included, carries a request id to quote: the client's, else a new one
    assert outcome["wrong key"].headers["X-Request-Id"] == "trace-7"
    assert outcome["no key"].headers["X-Request-Id"].startswith("req-")
    assert outcome["health without key"].headers["X-Request-Id"] != outcome["no key"].headers["X-Request-Id"]
    assert outcome["health without key"].status_code == 200
    assert outcome["not ready"].status_code == 503
    assert outcome["registered"].status_code == 202 and outcome["registered"].json()["status"] == "recording"
    busy = outcome["over the queue"]
    # no edit answered yet to estimate the wait from: the router's default
    assert busy.status_code == 429 and busy.headers["Retry-After"] == str(RETRY_AFTER_UNKNOWN_S)
    assert busy.json()["error"]["code"] == "queue_full" and busy.json()["error"]["type"] == "rate_limit_error"
    assert busy.headers["X-Request-Id"].startswith("edit-")  # the id the refused edit would have run under
    assert outcome["shut down"].status_code == 503 and outcome["shut down"].json()["error"]["code"] == "interrupted"


@contextlib.asynccontextmanager
async def openai_edit_of_a_held_template(fields: dict, max_queue: int = RouterConfig.max_queue):
    """A scripted worker holding a registered 32x32 template, and a POST /v1/images/edits of it (an
    alpha-0 mask: repaint everything) with `fields` under way: yields (router, worker, the answer's task)."""
    router = Router(RouterConfig(address="tcp://127.0.0.1:0", policy="least-requests", heartbeat_s=0.05,
                                 dead_after_s=60.0, max_queue=max_queue)).start()
    context = zmq.Context()
    app = create_app(router, Limits(default_steps=2, request_timeout_s=20))
    try:
        worker = ScriptedWorker(context, router, "w0")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
            registered = await client.post("/v1/templates", data={"steps": "2"}, files={
                "image": ("t.png", png(Image.new("RGB", (32, 32), "red")), "image/png")})
            await asyncio.to_thread(worker.register, registered.json()["id"])
            mask = png(Image.new("RGBA", (32, 32), (0, 0, 0, 0)))  # alpha 0 = repaint
            yield router, worker, asyncio.create_task(client.post(
                "/v1/images/edits", files={"mask": ("m.png", mask, "image/png")},
                data={"template_id": registered.json()["id"], "prompt": "a cat", **fields}))
    finally:
        router.close(drain_s=0)
        context.destroy(linger=0)


async def traced_edit() -> dict:
    async with openai_edit_of_a_held_template({"n": "2"}) as (router, worker, answer):
        edits = [await asyncio.to_thread(worker.receive, "edit") for _ in range(2)]
        for edit in edits:
            worker.answer(edit["request"], png(Image.new("RGB", (32, 32), "blue")))
        return {"answer": await answer, "traces": sorted(edit["trace"] for edit in edits)}


def test_an_edit_is_traced_by_its_request_id_from_the_access_log_to_its_worker(caplog):
    """The head logs one line per answer with the request id, the template and the workers that ran it;
    each worker is told the id (#i for the i-th of n images) and logs its edit under it."""
    with caplog.at_level("INFO", logger="retouch.access"):
        outcome = asyncio.run(traced_edit())
    request_id = outcome["answer"].headers["X-Request-Id"]
    assert outcome["answer"].status_code == 200 and outcome["traces"] == [f"{request_id}#0", f"{request_id}#1"]
    [line] = [r.getMessage() for r in caplog.records if r.name == "retouch.access" and "/v1/images/edits" in
              r.getMessage()]
    assert line.startswith("POST /v1/images/edits 200 ") and f"id={request_id} template=tpl-" in line
    assert line.endswith(" workers=w0")


async def n_images(max_queue: int, fail_one: bool) -> dict:
    """POST /v1/images/edits with n=3 of a template a scripted worker holds; `fail_one`: the worker
    answers the first of the three with a 500 and never the others."""
    outcome = {}
    async with openai_edit_of_a_held_template({"n": "3"}, max_queue) as (router, worker, answer):
        if fail_one:
            edits = [(await asyncio.to_thread(worker.receive, "edit"))["request"] for _ in range(3)]
            await asyncio.to_thread(worker.fail, edits[0], 500, "RuntimeError", "out of memory")
            outcome["answer"] = await answer
            outcome["cancelled"] = sorted([(await asyncio.to_thread(worker.receive, "cancel"))["request"]
                                           for _ in range(2)])
            outcome["siblings"] = sorted(edits[1:])
        else:
            outcome["answer"] = await answer
        outcome["pending"] = router.snapshot()["pending"]
        await asyncio.to_thread(worker.sync)  # whatever the router sent before the pong has arrived
        outcome["worker got"] = worker.pending_kinds()
        outcome["counters"] = router.snapshot()["counters"]
    return outcome


async def openai_answer(fields: dict, answered: bool = True) -> httpx.Response:
    """The answer to an OpenAI edit with `fields` of a template a scripted worker holds; `answered`: the
    worker answers it with a 32x32 gradient (False: the frontend refuses it before it is routed)."""
    edited = png(Image.fromarray(np.arange(32 * 32 * 3, dtype=np.uint8).reshape(32, 32, 3)))
    async with openai_edit_of_a_held_template(fields) as (_, worker, answer):
        if answered:
            await asyncio.to_thread(lambda: worker.answer(worker.receive("edit")["request"], edited))
        return await answer


@pytest.mark.parametrize("fields, pillow_format, lossless", [
    ({}, "PNG", True),
    ({"output_format": "jpeg", "output_compression": "90"}, "JPEG", False),
    ({"output_format": "webp", "output_compression": "100"}, "WEBP", True),
    ({"output_format": "webp", "output_compression": "50", "size": "16x16"}, "WEBP", False),
])
def test_openai_output_format_encodes_the_answer(fields, pillow_format, lossless):
    answer = asyncio.run(openai_answer(fields))
    assert answer.status_code == 200, answer.text
    assert answer.json()["output_format"] == fields.get("output_format", "png")
    image = Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][0]["b64_json"])))
    assert image.format == pillow_format and image.size == ((16, 16) if "size" in fields else (32, 32))
    expected = np.arange(32 * 32 * 3, dtype=np.uint8).reshape(32, 32, 3)
    if lossless:
        assert np.array_equal(np.asarray(image.convert("RGB")), expected)


@pytest.mark.parametrize("fields, param", [({"output_format": "gif"}, "output_format"),
                                           ({"output_compression": "101"}, "output_compression")])
def test_openai_output_format_is_validated(fields, param):
    answer = asyncio.run(openai_answer(fields, answered=False))
    assert 400 <= answer.status_code < 500 and answer.json()["error"]["param"] == param


def test_n_images_over_the_queue_are_refused_all_together():
    outcome = asyncio.run(n_images(max_queue=2, fail_one=False))
    answer = outcome["answer"]
    assert answer.status_code == 429 and answer.json()["error"]["code"] == "queue_full"
    assert outcome["pending"] == 0 and "edit" not in outcome["worker got"]
    assert outcome["counters"]["routed"] == 0


def test_one_failed_image_cancels_its_siblings_at_once():
    outcome = asyncio.run(n_images(max_queue=8, fail_one=True))
    answer = outcome["answer"]  # answered while the worker still held the other two
    assert answer.status_code == 500, answer.text
    assert answer.json()["error"] == {"message": "out of memory", "type": "server_error", "param": None,
                                      "code": "internal_error"}
    assert outcome["cancelled"] == outcome["siblings"]
    assert outcome["pending"] == 0 and outcome["counters"]["cancelled"] == 2


async def long_prompts() -> dict:
    router = Router(RouterConfig(address="tcp://127.0.0.1:0", policy="least-requests")).start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(router, Limits())),
                                     base_url="http://retouch") as client:
            mask = {"mask": ("m.png", png(Image.new("L", (32, 32), 255)), "image/png")}
            return {words: await client.post("/v1/edits", data={"template_id": "tpl-x", "prompt": "a red hat " * words},
                                             files=mask) for words in (401, 120_000)}
    finally:
        await asyncio.to_thread(router.close, 0)


def multipart(prompt: bytes, charset: str | None = None) -> tuple[bytes, str]:
    """A multipart body of one template_id, a prompt given as raw bytes and a 32x32 mask; its Content-Type."""
    mask = png(Image.new("L", (32, 32), 255))
    body = (b"--b\r\nContent-Disposition: form-data; name=\"template_id\"\r\n\r\ntpl-x\r\n"
            b"--b\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\n" + prompt + b"\r\n"
            b"--b\r\nContent-Disposition: form-data; name=\"mask\"; filename=\"m.png\"\r\n"
            b"Content-Type: image/png\r\n\r\n" + mask + b"\r\n--b--\r\n")
    return body, "multipart/form-data; boundary=b" + (f"; charset={charset}" if charset else "")


async def bodies_sent(sent: dict[str, tuple[bytes, str]]) -> dict[str, httpx.Response]:
    router = Router(RouterConfig(address="tcp://127.0.0.1:0", policy="least-requests")).start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(router, Limits())),
                                     base_url="http://retouch") as client:
            return {name: await client.post("/v1/edits", content=body, headers={"Content-Type": content_type})
                    for name, (body, content_type) in sent.items()}
    finally:
        await asyncio.to_thread(router.close, 0)


def prompts_in_encodings() -> dict:
    return asyncio.run(bodies_sent({
        "utf-8": multipart("café ☕".encode()), "latin-1 undeclared": multipart("café".encode("latin-1")),
        "latin-1 declared": multipart("café".encode("latin-1"), "iso-8859-1"),
        "unknown charset": multipart("café".encode(), "bogus")}))


def test_a_prompt_not_in_the_bodys_charset_is_refused_naming_it():
    """Starlette reads a text field that is not UTF-8 as latin-1, and a body of a charset it does not know
    all as latin-1: right for a latin-1 client, mojibake for every other (cp1252, Shift JIS, GBK), and the
    client is none the wiser. Both are a 400 naming what to fix; text in the charset the body declares passes
    the form (and reaches the template lookup: 404 for this unknown one)."""
    outcome = prompts_in_encodings()
    refused = outcome["latin-1 undeclared"]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt", refused.text
    assert "utf-8" in refused.json()["error"]["message"]
    unknown = outcome["unknown charset"]
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "content-type", unknown.text
    for name in ("utf-8", "latin-1 declared"):
        assert outcome[name].status_code == 404, outcome[name].text
        assert outcome[name].json()["error"]["code"] == "template_not_found"


def test_a_body_cut_off_before_its_closing_boundary_is_refused_and_media_types_are_case_insensitive():
    """Starlette kept the fields before the cut and dropped the one cut off: a `steps=3` lost on the way ran
    the default 28 steps, answered 200."""
    whole, content_type = multipart(b"a cat")
    open_part = whole[:-len(b"--b--\r\n")] + b"--b\r\nContent-Disposition: form-data; name=\"steps\"\r\n\r\n3"
    outcome = asyncio.run(bodies_sent({
        "in a field": (open_part, content_type), "at a boundary": (whole[:-len(b"--\r\n")] + b"\r\n", content_type),
        "no closing boundary": (whole[:-len(b"\r\n--b--\r\n")], content_type),
        "capitals": (whole, content_type.replace("multipart/form-data", "Multipart/Form-Data"))}))
    for name in ("in a field", "at a boundary", "no closing boundary"):
        error = outcome[name].json()["error"]
        assert outcome[name].status_code == 400 and error["param"] == "body" and "cut off" in error["message"], name
    assert outcome["capitals"].json()["error"]["code"] == "template_not_found"  # read: on to the lookup


async def ids_asked(router: Router) -> dict[str, httpx.Response]:
    app = create_app(router, Limits(default_steps=2))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
        mask = {"mask": ("m.png", png(Image.new("L", (32, 32), 255)))}
        asked = {f"id {key}": await client.post("/v1/edits", headers={"X-Request-Id": key}, files=mask, data={
            "template_id": "tpl-x", "prompt": "a cat", "async": "true"}) for key in (".", "..", "...", "v1.2")}
        asked["no model name"] = await client.get("/v1/models/")
        return asked


def test_ids_that_urls_cannot_carry_are_refused():
    """An asynchronous edit sent as X-Request-Id ".." was accepted, and its Location, /v1/edits/../result,
    is /v1/result to every client; GET /v1/models/ answered a model named ""."""
    router = Router(RouterConfig(address="tcp://127.0.0.1:0", policy="least-requests")).start()
    try:
        asked = asyncio.run(ids_asked(router))
    finally:
        router.close(0)
    for key in (".", "..", "..."):
        answer = asked[f"id {key}"]
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "x-request-id", key
    assert asked["id v1.2"].json()["error"]["code"] == "template_not_found"  # a dot among others is fine
    assert asked["no model name"].status_code == 404


def test_a_long_prompt_is_refused_naming_it_before_any_work():
    """Over max_prompt_chars: 422 prompt_too_long. Over the multipart parser's 1 MiB per text field (it does
    not say which field): 413 field_too_large, which states the prompt limit, not "malformed body"."""
    outcome = asyncio.run(long_prompts())
    over_limit, over_parser = outcome[401].json()["error"], outcome[120_000].json()["error"]
    assert outcome[401].status_code == 422
    assert (over_limit["param"], over_limit["code"]) == ("prompt", "prompt_too_long")
    assert outcome[120_000].status_code == 413 and over_parser["code"] == "field_too_large"
    assert over_parser["param"] == "body" and "prompt may have at most 4000 characters" in over_parser["message"]


async def unknown_routes(docs: bool) -> dict:
    router = Router(RouterConfig(address="tcp://127.0.0.1:0")).start()
    app = create_app(router, Limits(docs=docs))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
            return {"generations": await client.post("/v1/images/generations", json={"prompt": "a cat"}),
                    "typo": await client.get("/v1/template"),
                    "put": await client.put("/v1/edits")}
    finally:
        await asyncio.to_thread(router.close, 0)


@pytest.mark.parametrize("docs", [True, False])
def test_an_unknown_endpoint_or_method_is_a_json_error_saying_what_there_is(docs):
    outcome = asyncio.run(unknown_routes(docs))
    generations, typo, put = (outcome[name] for name in ("generations", "typo", "put"))
    assert generations.status_code == typo.status_code == 404
    assert generations.json()["error"]["code"] == typo.json()["error"]["code"] == "unknown_endpoint"
    assert "POST /v1/images/generations" in generations.json()["error"]["message"]
    assert "POST /v1/images/edits" in generations.json()["error"]["message"]  # an OpenAI client's way here
    assert ("/docs" in typo.json()["error"]["message"]) == docs
    assert put.status_code == 405 and put.json()["error"]["code"] == "method_not_allowed"
    assert "POST" in put.headers["allow"]


async def repeated_fields() -> dict:
    router = Router(RouterConfig(address="tcp://127.0.0.1:0")).start()
    app = create_app(router, Limits(default_steps=2))
    image = ("t.png", png(Image.new("RGB", (32, 32), "red")), "image/png")
    mask = ("m.png", png(Image.new("L", (32, 32), 255)), "image/png")
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
            return {
                "two loras": await client.post("/v1/edits", files=[("mask", mask), ("image", image)],
                                               data={"prompt": "a cat", "lora": ["style", "grain"]}),
                "two prompts": await client.post("/v1/edits", files=[("mask", mask), ("image", image)],
                                                 data={"prompt": ["a cat", "a dog"]}),
                "two masks": await client.post("/v1/edits", files=[("mask", mask), ("mask", mask), ("image", image)],
                                               data={"prompt": "a cat"}),
                "template lora": await client.post("/v1/templates", files={"image": image},
                                                   data={"lora": "style"}),
                "templates": router.snapshot()["templates"], "pending": router.snapshot()["pending"]}
    finally:
        await asyncio.to_thread(router.close, 0)


def test_a_field_sent_twice_or_a_lora_on_a_template_is_refused_naming_it():
    """Multipart lets a field repeat; the last value silently winning (two `lora` fields: only the second
    adapter applied) is refused instead, as is a `lora` on a template (recorded without LoRA)."""
    outcome = asyncio.run(repeated_fields())
    for name, param in (("two loras", "lora"), ("two prompts", "prompt"), ("two masks", "mask")):
        assert outcome[name].status_code == 400 and outcome[name].json()["error"]["param"] == param, name
        assert "sent 2 times" in outcome[name].json()["error"]["message"]
    assert "NAME,NAME" in outcome["two loras"].json()["error"]["message"]
    refused = outcome["template lora"]
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "lora_unsupported"
    assert outcome["templates"] == 0 and outcome["pending"] == 0


async def unknown_fields() -> dict:
    router = Router(RouterConfig(address="tcp://127.0.0.1:0")).start()
    app = create_app(router, Limits(default_steps=2))
    image = ("t.png", png(Image.new("RGB", (32, 32), "red")), "image/png")
    mask = ("m.png", png(Image.new("L", (32, 32), 255)), "image/png")
    clear = ("m.png", png(Image.new("RGBA", (32, 32), (0, 0, 0, 0))), "image/png")
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
            return {
                "misspelt": await client.post("/v1/edits", files={"mask": mask, "image": image},
                                              data={"prompt": "a cat", "strenght": "0.5"}),
                "a file field unknown": await client.post("/v1/edits", files={"mask": mask, "image": image,
                                                                              "mask2": mask}, data={"prompt": "a"}),
                "openai unknown": await client.post("/v1/images/edits", files={"image": image, "mask": clear},
                                                    data={"prompt": "a cat", "style": "vivid"}),
                "template misspelt": await client.post("/v1/templates", files={"image": image},
                                                       data={"prompt": "a room", "seeds": "3"}),
                "in the query": await client.post("/v1/edits?strength=0.5", files={"mask": mask, "image": image},
                                                  data={"prompt": "a cat"}),
                "openai query": await client.post("/v1/images/edits?stream=true", files={"image": image, "mask": clear},
                                                  data={"prompt": "a cat"}),
                "template strength": await client.post("/v1/templates", files={"image": image},
                                                       data={"strength": "0.5"}),
                "a huge name": await client.post("/v1/edits", files={"mask": mask, "image": image},
                                                 data={"prompt": "a cat", "x" * 1500: "1"}),
                "a huge value": await client.post("/v1/edits", files={"mask": mask, "image": image},
                                                  data={"prompt": "a cat", "model": "m" * 100_000}),
                "templates": router.snapshot()["templates"], "pending": router.snapshot()["pending"]}
    finally:
        await asyncio.to_thread(router.close, 0)


def test_a_field_the_endpoint_does_not_read_is_refused_naming_it():
    """A misspelt field would be ignored and the edit run without it (the client finds out from the
    picture): every form endpoint refuses it, suggesting the field meant, before any work."""
    outcome = asyncio.run(unknown_fields())
    for name, param, hint in (("misspelt", "strenght", "did you mean 'strength'?"),
                              ("a file field unknown", "mask2", "did you mean 'mask'?"),
                              ("openai unknown", "style", "its fields: "),
                              ("template misspelt", "seeds", "did you mean 'seed'?"),
                              ("in the query", "strength", "the query string"),
                              ("openai query", "stream", "the query string")):
        error = outcome[name].json()["error"]
        assert outcome[name].status_code == 400 and error["param"] == param and error["code"] == "unknown_field", name
        assert hint in error["message"], name
    assert "template_id" in outcome["openai unknown"].json()["error"]["message"]  # the list names retouch's extras
    refused = outcome["template strength"]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "strength"
    assert "each edit" in refused.json()["error"]["message"]
    assert outcome["templates"] == 0 and outcome["pending"] == 0
    for name, status in (("a huge name", 400), ("a huge value", 404)):  # quoted, but cut short
        answer = outcome[name]
        error = answer.json()["error"]
        assert answer.status_code == status and len(answer.content) < 2 * MAX_ERROR_CHARS + 500, name
        assert error["message"].endswith("more characters cut]"), name
    assert outcome["a huge name"].json()["error"]["param"].startswith("x" * MAX_ERROR_CHARS)


async def transparent_edits() -> dict:
    """An RGBA template registered and edited (a scripted worker answers with a gradient), and the same
    image as a one-off; a half-transparent cut-out, repainted in its top-left quarter."""
    router = Router(RouterConfig(address="tcp://127.0.0.1:0", policy="least-requests", heartbeat_s=0.05,
                                 dead_after_s=60.0)).start()
    context = zmq.Context()
    app = create_app(router, Limits(default_steps=2))
    cutout = np.zeros((32, 32, 4), np.uint8)
    cutout[..., :3] = 200
    cutout[8:24, 8:24, 3] = 255
    cutout[:, :8, 3] = 128
    mask = Image.new("L", (32, 32), 0)
    mask.paste(255, (0, 0, 16, 16))
    answer = np.arange(32 * 32 * 3, dtype=np.uint8).reshape(32, 32, 3)
    outcome = {"cutout": cutout, "mask": np.asarray(mask), "worker answer": answer}
    try:
        worker = ScriptedWorker(context, router, "w0")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
            registered = await client.post("/v1/templates", data={"steps": "2"},
                                           files={"image": ("t.png", png(Image.fromarray(cutout)), "image/png")})
            await asyncio.to_thread(worker.register, registered.json()["id"])
            edit_template = {"template_id": registered.json()["id"], "prompt": "a cat"}
            outcome["as jpeg"] = await client.post("/v1/edits", data={**edit_template, "output_format": "jpeg"},
                                                   files={"mask": ("m.png", png(mask), "image/png")})
            for name, fields in (("template", {"data": edit_template}),
                                 ("one-off", {"data": {"prompt": "a cat"},
                                              "files": {"image": ("t.png", png(Image.fromarray(cutout)))}}),
                                 ("as webp", {"data": {**edit_template, "output_format": "webp"}})):
                files = {**fields.get("files", {}), "mask": ("m.png", png(mask), "image/png")}
                posted = asyncio.create_task(client.post("/v1/edits", data=fields["data"], files=files))
                edit = await asyncio.to_thread(worker.receive, "edit")
                await asyncio.to_thread(worker.answer, edit["request"], png(Image.fromarray(answer)))
                outcome[name] = await posted
            outcome["its image"] = await client.get(f"/v1/templates/{registered.json()['id']}/image")
            opaque = await client.post("/v1/templates", data={"steps": "2"},
                                       files={"image": ("t.png", png(Image.fromarray(cutout[..., :3])))})
            outcome["ids"] = (registered.json()["id"], opaque.json()["id"])
    finally:
        router.close(drain_s=0)
        context.destroy(linger=0)
    return outcome


def test_a_transparent_template_is_answered_with_its_alpha_outside_the_mask():
    outcome = asyncio.run(transparent_edits())
    keep = outcome["mask"] == 0
    for name in ("template", "one-off", "as webp"):
        assert outcome[name].status_code == 200, outcome[name].text
        decoded = Image.open(io.BytesIO(outcome[name].content))
        assert decoded.format == ("WEBP" if name == "as webp" else "PNG")  # lossless: the same pixels
        assert outcome[name].headers["content-type"] == f"image/{decoded.format.lower()}"
        answer = np.asarray(decoded)
        assert answer.shape == (32, 32, 4), name
        assert (answer[..., 3][keep] == outcome["cutout"][..., 3][keep]).all()  # the cut-out's own alpha
        assert (answer[..., 3][~keep] == 255).all()  # what the model painted is opaque
        assert (answer[..., :3] == outcome["worker answer"]).all()
    its_image = np.asarray(Image.open(io.BytesIO(outcome["its image"].content)))
    assert (its_image == outcome["cutout"]).all()  # the template as it was sent, transparency and all
    template_id, opaque_id = outcome["ids"]
    assert template_id != opaque_id  # the same colours, another alpha: another template
    refused = outcome["as jpeg"]  # JPEG has no alpha: said, not flattened
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "output_format"


async def over_the_template_limit(**config) -> httpx.Response:
    router = Router(RouterConfig(address="tcp://127.0.0.1:0", **config)).start()
    app = create_app(router, Limits(default_steps=2))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
            for shade in range(2):
                answer = await client.post("/v1/templates", data={"steps": "2"}, files={
                    "image": ("t.png", png(Image.new("RGB", (32, 32), (shade, 0, 0))), "image/png")})
            limits = (await client.get("/v1/limits")).json()
            return answer, limits
    finally:
        await asyncio.to_thread(router.close, 0)


def test_a_template_over_the_tenants_limit_is_refused_for_good():
    refused, limits = asyncio.run(over_the_template_limit(max_templates_per_tenant=1))
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "template_limit"
    assert refused.headers["x-should-retry"] == "false"  # deleting templates makes room, not retrying
    assert limits["max_templates"] == 1


def test_a_template_the_head_has_no_memory_left_for_is_refused_naming_the_image():
    refused, _ = asyncio.run(over_the_template_limit(max_template_bytes=1))  # no image fits
    error = refused.json()["error"]
    assert refused.status_code == 507 and (error["code"], error["param"]) == ("template_storage_full", "image")
    assert "--max-templates-mb" in error["message"] and refused.headers["x-should-retry"] == "false"


async def listed_pages() -> dict:
    router = Router(RouterConfig(address="tcp://127.0.0.1:0")).start()
    app = create_app(router, Limits(default_steps=2))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
            registered = []
            for shade in range(5):
                answer = await client.post("/v1/templates", data={"steps": "2"}, files={
                    "image": ("t.png", png(Image.new("RGB", (32, 32), (shade, 0, 0))), "image/png")})
                registered.append(answer.json()["id"])
            pages, after = [], None
            while True:
                page = (await client.get("/v1/templates", params={"limit": 2, **({"after": after} if after else {})}))
                pages.append(page.json())
                if not page.json()["has_more"]:
                    break
                after = page.json()["last_id"]
            return {"registered": registered, "pages": pages, "everything": (await client.get("/v1/templates")).json(),
                    "bad limit": await client.get("/v1/templates", params={"limit": 0}),
                    "bad after": await client.get("/v1/templates", params={"after": "tpl-gone"})}
    finally:
        await asyncio.to_thread(router.close, 0)


def test_templates_are_listed_newest_first_a_page_at_a_time():
    outcome = asyncio.run(listed_pages())
    newest_first = outcome["registered"][::-1]
    assert [[t["id"] for t in page["data"]] for page in outcome["pages"]] == [newest_first[:2], newest_first[2:4],
                                                                            newest_first[4:]]
    assert [page["has_more"] for page in outcome["pages"]] == [True, True, False]
    assert outcome["pages"][0]["first_id"] == newest_first[0] and outcome["pages"][0]["object"] == "list"
    assert [t["id"] for t in outcome["everything"]["data"]] == newest_first  # the default page holds them all
    assert outcome["bad limit"].status_code == 422 and outcome["bad limit"].json()["error"]["param"] == "limit"
    assert outcome["bad after"].status_code == 400 and outcome["bad after"].json()["error"]["param"] == "after"


async def from_a_browser() -> dict:
    router = Router(RouterConfig(address="tcp://127.0.0.1:0")).start()
    app = create_app(router, Limits(api_keys=(KEY,), cors_origins=("https://shop.example.com",)))
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
            return {
                "preflight": await client.options("/v1/edits", headers={"Origin": "https://shop.example.com",
                                                                        **preflight}),
                "other origin": await client.options("/v1/edits", headers={"Origin": "https://evil.example",
                                                                           **preflight}),
                "refused": await client.get("/v1/templates", headers={"Origin": "https://shop.example.com"}),
                "listed": await client.get("/v1/templates", headers={"Origin": "https://shop.example.com",
                                                                     "Authorization": f"Bearer {KEY}"})}
    finally:
        await asyncio.to_thread(router.close, 0)


def test_pages_of_the_allowed_origins_may_call_the_api_and_read_its_errors():
    outcome = asyncio.run(from_a_browser())
    preflight = outcome["preflight"]  # carries no key: answered before authentication
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://shop.example.com"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-origin" not in outcome["other origin"].headers
    for name, status in (("refused", 401), ("listed", 200)):  # a page reads its 401 and the request id too
        answer = outcome[name]
        assert answer.status_code == status
        assert answer.headers["access-control-allow-origin"] == "https://shop.example.com"
        assert "x-request-id" in answer.headers["access-control-expose-headers"].lower()
    with pytest.raises(ValueError, match="CORS origins"):
        Limits(cors_origins=("shop.example.com",))


async def uncoded_errors() -> list[httpx.Response]:
    router = Router(RouterConfig(address="tcp://127.0.0.1:0")).start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(router)),
                                     base_url="http://retouch") as client:
            return [await client.post("/v1/edits", json={"prompt": "a cat"}),
                    await client.post("/v1/edits", data={"prompt": "a cat"}, files={"image": ("i.png", b"x")}),
                    await client.get("/v1/templates/tpl-none")]
    finally:
        await asyncio.to_thread(router.close, 0)


def test_every_error_has_a_code_to_switch_on_and_its_request_id_is_the_logged_one(caplog):
    with caplog.at_level("INFO", logger="retouch.access"):
        answers = asyncio.run(uncoded_errors())
    assert [answer.json()["error"]["code"] for answer in answers] == ["unsupported_media_type", "invalid_request",
                                                                      "template_not_found"]
    logged = " ".join(r.getMessage() for r in caplog.records if r.name == "retouch.access")
    for answer in answers:  # the id a client quotes is the one in the log
        assert f"id={answer.headers['X-Request-Id']}" in logged


def test_every_field_a_form_endpoint_takes_is_in_its_openapi_schema_but_those_it_refuses(make_router):
    """/docs shows every field the endpoint reads; what it accepts beyond them is read only to refuse it
    saying why (a LoRA or strength on a template, async on the OpenAI form)."""
    from retouch.http_api import FORM_FIELDS, REFUSED_FIELDS

    schema = create_app(make_router(), Limits()).openapi()
    for path, fields in FORM_FIELDS.items():
        form = schema["paths"][path]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
        assert set(form["properties"]) == fields and not fields & REFUSED_FIELDS[path], path


async def at_and_past_the_bounds(router: Router, limits: Limits) -> list[tuple[str, str, str, httpx.Response]]:
    """Every number field with bounds in /openapi.json, sent at each bound and one past it."""
    app = create_app(router, limits)
    forms = {path: operation["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]["properties"]
             for path, operation in app.openapi()["paths"].items() if "requestBody" in operation.get("post", {})}
    transparent = png(Image.new("RGBA", (32, 32), (255, 0, 0, 0)))
    sent = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
        for path, fields in forms.items():
            for name, field in fields.items():
                kind = int if field["type"] == "integer" else float
                values = {"past": [], "at": []}
                if "minimum" in field:
                    values["at"].append(field["minimum"])
                    values["past"].append(field["minimum"] - 1)
                if "exclusiveMinimum" in field:
                    values["past"].append(field["exclusiveMinimum"])
                if "maximum" in field:
                    values["at"].append(field["maximum"])
                    values["past"].append(field["maximum"] + 1)
                for where, numbers in values.items():
                    for number in numbers:
                        data = {name: str(kind(number))} | ({} if path == "/v1/templates" else {"prompt": "a cat"})
                        if name in ("preview_every", "partial_images"):
                            data["stream"] = "true"
                        files = {"image": ("i.png", transparent)}  # OpenAI's form: its alpha is the mask
                        if path == "/v1/edits":
                            files["mask"] = ("m.png", png(Image.new("L", (32, 32), 255)))
                        sent.append((path, name, where, await client.post(path, data=data, files=files)))
    return sent


def test_the_openapi_bounds_of_every_number_field_are_the_ones_the_server_enforces(make_router):
    """A client generated from /openapi.json validates what the server would: each bound is accepted and
    one past it is refused (422 naming the field); the maxima follow the server's limits."""
    limits = Limits(max_steps=40, max_n=3)
    sent = asyncio.run(at_and_past_the_bounds(make_router(no_worker_s=0.01), limits))
    bounded = {(path, name) for path, name, _, _ in sent}
    assert {("/v1/edits", "steps"), ("/v1/edits", "strength"), ("/v1/images/edits", "n"),
            ("/v1/templates", "guidance"), ("/v1/images/edits", "partial_images")} <= bounded
    for path, name, where, answer in sent:
        refused = answer.status_code == 422 and answer.json()["error"]["param"] == name
        assert refused == (where == "past"), (path, name, where, answer.text)
    past_the_maximum = {(path, name): answer for path, name, where, answer in sent if where == "past"}
    assert "[1, 40]" in past_the_maximum[("/v1/edits", "steps")].json()["error"]["message"]
    assert "[1, 3]" in past_the_maximum[("/v1/images/edits", "n")].json()["error"]["message"]


async def long_polls(router: Router) -> dict:
    app = create_app(router, Limits(default_steps=2))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
        registered = await client.post("/v1/templates", data={"steps": "2"},
                                       files={"image": ("t.png", png(Image.new("RGB", (32, 32), "red")))})
        path = f"/v1/templates/{registered.json()['id']}"
        return {wait: await client.get(path, params={"wait": wait})
                for wait in ("nan", "inf", "-5", "61", "soon", "0.01")}


def test_a_long_polls_wait_is_refused_outside_0_to_60_seconds(make_router):
    """?wait=inf held the connection for as long as the recording ran; nan answered at once."""
    answers = asyncio.run(long_polls(make_router()))
    for wait in ("nan", "inf", "-5", "61", "soon"):  # as the form's numbers: 400 if not one, 422 out of range
        assert answers[wait].status_code == (400 if wait == "soon" else 422), wait
        assert answers[wait].json()["error"]["param"] == "wait", wait
    assert answers["0.01"].status_code == 200 and answers["0.01"].json()["status"] == "recording"


async def polls_of_a_recording(router: Router) -> tuple[int, httpx.Response, list[httpx.Response]]:
    """More ?wait polls of a recording template than the threads anyio lends, then its deletion."""
    threads = anyio.to_thread.current_default_thread_limiter()
    polls = int(threads.total_tokens) + 10
    app = create_app(router, Limits(default_steps=2))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
        registered = await client.post("/v1/templates", data={"steps": "2"},
                                       files={"image": ("t.png", png(Image.new("RGB", (32, 32), "red")))})
        template_id = registered.json()["id"]
        waiting = [asyncio.create_task(client.get(f"/v1/templates/{template_id}", params={"wait": 20}))
                   for _ in range(polls)]
        for _ in range(100_000):  # until every poll waits (each watches the template), or never
            if len(router._watchers.get(("template", template_id), ())) == polls:
                break
            await asyncio.sleep(0)
        threads_held = threads.borrowed_tokens
        dropped = await client.delete(f"/v1/templates/{template_id}")
        return threads_held, dropped, await asyncio.gather(*waiting)


def test_long_polls_hold_no_thread_and_end_when_the_template_does(make_router):
    """Each ?wait poll of a recording template held one of the threads every upload is decoded in, for up
    to 60 s: forty polls (anyio's default) stalled every edit of every client."""
    threads_held, dropped, answers = asyncio.run(polls_of_a_recording(make_router()))
    assert threads_held == 0
    assert dropped.status_code == 200
    assert len(answers) > 40 and {answer.status_code for answer in answers} == {404}  # deleted while they waited


async def watches_of_a_recording_when_the_server_stops(router: Router) -> tuple[httpx.Response, list[str]]:
    """A long-poll and a template's event stream of a recording template, then the server stops."""
    app = create_app(router, Limits(default_steps=2))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
        registered = await client.post("/v1/templates", data={"steps": "2"},
                                       files={"image": ("t.png", png(Image.new("RGB", (32, 32), "red")))})
        template_id = registered.json()["id"]
        poll = asyncio.create_task(client.get(f"/v1/templates/{template_id}", params={"wait": 60}))

        async def stream() -> list[str]:
            async with client.stream("GET", f"/v1/templates/{template_id}/events") as answer:
                return [line async for line in answer.aiter_lines() if line.startswith("event:")]
        streamed = asyncio.create_task(stream())
        for _ in range(100_000):  # until both watch the template, or never
            if len(router._watchers.get(("template", template_id), ())) == 2:
                break
            await asyncio.sleep(0)
        app.state.stop_template_watches()  # what the stopping server does first
        return await asyncio.wait_for(poll, 10), await asyncio.wait_for(streamed, 10)


def test_a_stopping_server_answers_long_polls_and_ends_template_streams(make_router):
    """They have no edit to drain for: they held a stopping server for its whole drain, then were cut off
    without an answer."""
    poll, events = asyncio.run(watches_of_a_recording_when_the_server_stops(make_router()))
    assert poll.status_code == 200 and poll.json()["status"] == "recording"
    assert events[-1] == "event: stopping"


async def padded_sizes_sent(router: Router) -> dict[str, httpx.Response]:
    app = create_app(router, Limits(max_pixels=1100, max_work=1000, default_steps=2))
    answers = {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
        for name, size in (("strip", (1, 300)), ("odd", (17, 17)), ("whole", (16, 16))):
            files = {"image": ("i.png", png(Image.new("RGB", size, "red"))),
                     "mask": ("m.png", png(Image.new("L", size, 255)))}
            answers[name] = await client.post("/v1/edits", data={"prompt": "a cat"}, files=files)
    return answers


def test_pixel_and_work_limits_count_the_padded_canvas(make_router):
    """A 1x300 strip is edited as 16x304 (4864 pixels, over 1100); 17x17 as 32x32 (2 steps: 2048
    pixel-steps, over 1000). Counted by their own pixels, both passed."""
    answers = asyncio.run(padded_sizes_sent(make_router(no_worker_s=0.01)))
    strip = answers["strip"].json()["error"]
    assert answers["strip"].status_code == 413 and strip["code"] == "image_too_large" and strip["param"] == "image"
    assert "padded to 16x304" in strip["message"]
    odd = answers["odd"].json()["error"]
    assert answers["odd"].status_code == 413 and odd["code"] == "too_much_work" and "padded to 32x32" in odd["message"]
    assert answers["whole"].status_code == 503  # within both: on to the router, which has no worker


def encoded(image: Image.Image, format: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format=format, **options)
    return out.getvalue()


UPLOADS = {  # what decodes, but was refused (or failed) only where the image was first read: 500s
    "32-bit out of range": encoded(Image.fromarray(np.full((32, 32), 10**8, np.int32), mode="I"), "TIFF"),
    "float NaN": encoded(Image.fromarray(np.full((32, 32), np.nan, np.float32), mode="F"), "TIFF"),
    "float negative": encoded(Image.fromarray(np.full((32, 32), -1.0, np.float32), mode="F"), "TIFF"),
    "damaged EXIF": encoded(Image.new("RGB", (32, 32), "red"), "JPEG", exif=b"Exif\x00\x00garbagegarbage"),
}


async def uploads_sent(router: Router) -> dict[tuple[str, str], httpx.Response]:
    app = create_app(router, Limits(default_steps=2))
    masks = {"/v1/edits": png(Image.new("L", (32, 32), 255)),  # white = repaint; OpenAI's: alpha 0 = repaint
             "/v1/images/edits": png(Image.new("RGBA", (32, 32), (0, 0, 0, 0)))}
    answers = {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
        for name, data in UPLOADS.items():
            image = {"image": ("i", data)}
            answers[name, "/v1/templates"] = await client.post("/v1/templates", data={"steps": "2"}, files=image)
            for path, mask in masks.items():
                answers[name, path] = await client.post(path, data={"prompt": "a cat"},
                                                        files={**image, "mask": ("m.png", mask)})
    return answers


def test_an_image_is_checked_when_it_arrives_and_a_damaged_exif_block_is_no_reason_to_refuse_it(make_router):
    for (name, path), answer in asyncio.run(uploads_sent(make_router(no_worker_s=0.01))).items():
        if name == "damaged EXIF":  # accepted: registered, or on to the router (which has no worker)
            assert answer.status_code == (202 if path == "/v1/templates" else 503), (name, path, answer.text)
        else:
            error = answer.json()["error"]
            assert answer.status_code == 400 and error["param"] == "image", (name, path, answer.text)
            assert error["code"] == "invalid_image", (name, path)


async def numbers_sent(router: Router, fields: list[dict]) -> list[httpx.Response]:
    app = create_app(router, Limits(default_steps=2))
    files = {"image": ("i.png", png(Image.new("RGB", (32, 32), "red"))),
             "mask": ("m.png", png(Image.new("L", (32, 32), 255)))}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
        return [await client.post("/v1/edits", data={"prompt": "a cat", **field}, files=files) for field in fields]


@pytest.mark.parametrize("field, value", [("seed", "1_0"), ("seed", " 7"), ("seed", "１"), ("seed", "٣"),
                                          ("seed", "0x10"), ("seed", "1e3"), ("strength", "０.5"),
                                          ("strength", "0,5"), ("output_compression", "9\u00a0")])
def test_a_number_is_written_as_clients_write_numbers_in_ascii(make_router, field, value):
    """Python's int() and float() read underscores, spaces and any script's digits; a client that sent them
    meant something else, or nothing."""
    refused, taken = asyncio.run(numbers_sent(make_router(no_worker_s=0.01), [{field: value}, {field: "1"}]))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == field
    assert taken.status_code == 503  # read, and on to the router (which has no worker)
