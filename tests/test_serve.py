"""`retouch serve` end to end on loopback: a real router, two worker processes with the tiny Flux Fill
model and the HTTP frontend. Bad input of every kind gets a 4xx JSON error naming the field and the
server goes on serving; the OpenAI-compatible form works; killing a worker loses nothing."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import struct
import threading
import zlib

import httpx
import numpy as np
import pytest
from mask_strategies import random_image
from PIL import Image

from retouch.bench import serve as bench_serve
from retouch.config import ServeOptions
from retouch.server import Server

SIZE = (64, 48)
STEPS = 2


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def template_image() -> Image.Image:
    pixels = np.zeros((SIZE[1], SIZE[0], 3), np.uint8)
    pixels[..., 0] = np.linspace(0, 255, SIZE[0], dtype=np.uint8)[None, :]
    pixels[..., 1] = np.linspace(255, 0, SIZE[1], dtype=np.uint8)[:, None]
    pixels[..., 2] = 90
    return Image.fromarray(pixels)


def box_mask(box=(16, 16, 40, 40), size=SIZE) -> Image.Image:
    mask = Image.new("L", size, 0)
    mask.paste(255, box)
    return mask


def huge_png_header(width: int, height: int) -> bytes:
    """A valid PNG signature and IHDR claiming width x height, then a tiny (wrong) image: what a
    decompression bomb looks like before decoding."""
    data = png(Image.new("L", (1, 1)))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return data[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + data[33:]


@pytest.fixture(scope="module")
def server():
    opts = ServeOptions(model="tiny-flux-fill", workers=2, port=0, mode="naive", worker_threads=1, steps=STEPS,
                        max_upload_mb=1.0, heartbeat_s=0.2, dead_after_s=3.0)
    with Server(opts).start() as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def template_id(server, client):
    response = client.post("/v1/templates", files={"image": ("t.png", png(template_image()), "image/png")},
                           data={"prompt": "a living room", "steps": str(STEPS)})
    assert response.status_code in (200, 202)
    body = response.json()
    assert body["progress"]["steps"] == STEPS and (body["width"], body["height"]) == SIZE
    ready = client.get(f"/v1/templates/{body['id']}", params={"wait": 60}).json()  # ready on one worker
    assert ready["status"] == "ready" and ready["progress"]["workers_ready"] >= 1
    assert server.router.wait_until(lambda r: r.template(body["id"])["progress"]["workers_ready"] == 2, 60)
    return body["id"]


def edit(client, template_id, mask: Image.Image, **fields) -> httpx.Response:
    data = {"template_id": template_id, "prompt": "a red sofa", **fields}
    return client.post("/v1/edits", files={"mask": ("m.png", png(mask), "image/png")}, data=data)


def assert_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["param"] == param


def test_edit_repaints_the_mask_and_keeps_the_rest(client, template_id):
    response = edit(client, template_id, box_mask(), seed="3")
    assert response.status_code == 200 and response.headers["content-type"] == "image/png"
    edited = np.asarray(Image.open(io.BytesIO(response.content)).convert("RGB")).astype(int)
    original = np.asarray(template_image()).astype(int)
    assert edited.shape == original.shape
    outside = np.asarray(box_mask()) == 0
    assert np.array_equal(edited[outside], original[outside])  # the template's own pixels, exactly
    assert np.abs(edited[20:36, 20:36] - original[20:36, 20:36]).mean() > 1  # repainted

    as_json = edit(client, template_id, box_mask(), seed="3", response_format="b64_json")
    assert as_json.status_code == 200
    decoded = Image.open(io.BytesIO(base64.b64decode(as_json.json()["data"][0]["b64_json"])))
    assert decoded.size == SIZE

    as_jpeg = edit(client, template_id, box_mask(), seed="3", output_format="jpeg", output_compression="80")
    assert as_jpeg.status_code == 200 and as_jpeg.headers["content-type"] == "image/jpeg"
    jpeg = Image.open(io.BytesIO(as_jpeg.content))
    assert jpeg.format == "JPEG" and jpeg.size == SIZE
    assert np.abs(np.asarray(jpeg).astype(int) - edited).mean() < 8  # the same picture, lossy
    assert_error(edit(client, template_id, box_mask(), output_format="gif"), 400, "output_format")


def test_all_zero_mask_returns_the_template_and_all_one_repaints_everything(client, template_id):
    nothing = edit(client, template_id, Image.new("L", SIZE, 0))
    assert nothing.status_code == 200
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(nothing.content)).convert("RGB")),
                          np.asarray(template_image()))
    everything = edit(client, template_id, Image.new("L", SIZE, 255))
    assert everything.status_code == 200
    repainted = np.asarray(Image.open(io.BytesIO(everything.content)).convert("RGB")).astype(int)
    assert np.abs(repainted - np.asarray(template_image()).astype(int)).mean() > 1


def truncated_png() -> bytes:
    data = png(template_image())
    return data[: len(data) // 2]


BAD_MASKS = {
    "malformed PNG": (b"\x89PNG\r\n\x1a\n" + os.urandom(200), 400),
    "truncated PNG": (truncated_png(), 400),
    "non-image bytes": (b"this is not an image at all", 400),
    "20000x20000 header": (huge_png_header(20000, 20000), 413),
    "mask of another size": (png(box_mask(size=(32, 32))), 422),
}


@pytest.mark.parametrize("case", list(BAD_MASKS))
def test_bad_images_get_a_4xx_naming_the_field(client, template_id, case):
    data, status = BAD_MASKS[case]
    response = client.post("/v1/edits", files={"mask": ("m.png", data, "image/png")},
                           data={"template_id": template_id, "prompt": "a red sofa"})
    assert_error(response, status, "mask")
    # A bad template image is refused the same way.
    if case != "mask of another size":
        response = client.post("/v1/templates", files={"image": ("t.png", data, "image/png")})
        assert_error(response, status, "image")


@pytest.mark.parametrize("fields, status, param", [
    ({"template_id": "tpl-nope"}, 404, "template_id"),
    ({"steps": "0"}, 422, "steps"),
    ({"steps": str(10**6)}, 422, "steps"),
    ({"steps": "3"}, 422, "steps"),  # not the template's schedule
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "   "}, 400, "prompt"),
    ({"seed": "one"}, 400, "seed"),
    ({"response_format": "gif"}, 400, "response_format"),
    ({"prompt": "a red hat " * 401}, 422, "prompt"),
])
def test_bad_fields_get_a_4xx_naming_the_field(client, template_id, fields, status, param):
    fields = {"template_id": template_id, **fields}
    assert_error(edit(client, fields.pop("template_id"), box_mask(), **fields), status, param)


def test_missing_parts_and_wrong_encodings(client, template_id):
    no_prompt = client.post("/v1/edits", files={"mask": ("m.png", png(box_mask()), "image/png")},
                            data={"template_id": template_id})
    assert_error(no_prompt, 400, "prompt")
    no_mask = client.post("/v1/edits", files={"template_id": (None, template_id), "prompt": (None, "x")})  # multipart
    assert_error(no_mask, 400, "mask")
    as_json = client.post("/v1/edits", json={"template_id": template_id, "prompt": "x"})
    assert_error(as_json, 415, "content-type")
    garbage = client.post("/v1/edits", content=b"--xx\r\nnot multipart", headers={
        "content-type": "multipart/form-data; boundary=zz"})
    assert garbage.status_code == 400 and "error" in garbage.json()


def test_oversized_body_is_refused(client, template_id):
    big = os.urandom(3 << 20)
    response = client.post("/v1/edits", files={"mask": ("m.png", big, "image/png")},
                           data={"template_id": template_id, "prompt": "x"})
    assert_error(response, 413, "body")

    def chunks():  # no Content-Length: refused while it streams in
        yield b'--b\r\nContent-Disposition: form-data; name="mask"; filename="m.png"\r\n\r\n'
        for _ in range(3):
            yield bytes(1 << 20)
    streamed = client.post("/v1/edits", content=chunks(), headers={"content-type": "multipart/form-data; boundary=b"})
    assert_error(streamed, 413, "body")


def test_server_still_serves_after_bad_input(client, template_id):
    assert edit(client, template_id, box_mask()).status_code == 200


def test_openai_images_edit_form(client, template_id):
    image = template_image().convert("RGBA")
    mask = Image.new("RGBA", SIZE, (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (16, 16, 40, 40))  # alpha 0 = repaint
    # The multipart form the OpenAI client sends for images.edit(...).
    files = [("image", ("image.png", png(image), "image/png")), ("mask", ("mask.png", png(mask), "image/png"))]
    data = {"prompt": "a red sofa", "n": "2", "size": "32x24", "response_format": "b64_json", "model": "tiny-flux-fill"}
    response = client.post("/v1/images/edits", files=files, data=data)
    assert response.status_code == 200, response.text
    body = response.json()
    assert isinstance(body["created"], int) and len(body["data"]) == 2
    images = [Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))) for item in body["data"]]
    assert all(i.size == (32, 24) for i in images)

    # Full size, and the mask honoured: alpha-255 pixels keep the image.
    response = client.post("/v1/images/edits", files=files, data={**data, "n": "1", "size": "auto"})
    edited = np.asarray(Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"])))
                        .convert("RGB")).astype(int)
    kept = np.asarray(mask.getchannel("A")) == 255
    assert np.array_equal(edited[kept], np.asarray(template_image())[kept].astype(int))

    # The extra field reuses a registered template; the image may then be left out.
    reuse = client.post("/v1/images/edits", files=[files[1]], data={**data, "n": "1", "template_id": template_id,
                                                                    "size": ""})
    assert reuse.status_code == 200, reuse.text
    small = ("image", ("s.png", png(image.resize((32, 24))), "image/png"))
    other_size = client.post("/v1/images/edits", files=[small, files[1]], data={**data, "n": "1",
                                                                             "template_id": template_id})
    assert_error(other_size, 422, "image")
    # the native endpoint edits one or the other: both is ambiguous
    both = client.post("/v1/edits", files={"image": ("t.png", png(template_image()), "image/png"),
                                           "mask": ("m.png", png(box_mask()), "image/png")},
                       data={"template_id": template_id, "prompt": "a cat"})
    assert_error(both, 400, "image")

    no_alpha = client.post("/v1/images/edits", files=[files[0], ("mask", ("m.png", png(box_mask()), "image/png"))],
                           data=data)
    assert_error(no_alpha, 400, "mask")
    assert_error(client.post("/v1/images/edits", files=files, data={**data, "n": "0"}), 422, "n")
    assert_error(client.post("/v1/images/edits", files=files, data={**data, "size": "big"}), 400, "size")
    stretched = client.post("/v1/images/edits", files=files, data={**data, "size": "32x32"})  # the image is 64x48
    assert_error(stretched, 400, "size")
    assert "32x24" in stretched.json()["error"]["message"]  # a size of the image's aspect ratio, suggested
    # a model this server does not serve is refused, not answered by the one it does
    other_model = client.post("/v1/images/edits", files=files, data={**data, "model": "dall-e-2"})
    assert_error(other_model, 404, "model")
    assert other_model.json()["error"]["code"] == "model_not_found"
    assert client.get("/v1/models/tiny-flux-fill").json()["id"] == "tiny-flux-fill"
    assert_error(client.get("/v1/models/dall-e-2"), 404, "model_id")
    assert_error(client.post("/v1/images/edits", files=files, data={**data, "response_format": "url"}), 400,
                 "response_format")


def test_a_colour_profile_goes_into_every_answer_and_names_another_template(client, template_id):
    """A Display P3 photo's pixels kept by an edit must look as they did: the answer carries the image's
    ICC profile, whatever its encoding; the same pixels with a profile are another template."""
    from PIL import ImageCms

    profile = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    tagged = io.BytesIO()
    template_image().save(tagged, format="PNG", icc_profile=profile)
    files = {"image": ("p3.png", tagged.getvalue(), "image/png"), "mask": ("m.png", png(box_mask()), "image/png")}
    for encoding in ({}, {"output_format": "webp"}, {"output_format": "jpeg"}):
        answer = client.post("/v1/edits", files=files, data={"prompt": "a hat", **encoding})
        assert answer.status_code == 200, answer.text
        assert Image.open(io.BytesIO(answer.content)).info.get("icc_profile") == profile, encoding
    alpha_mask = Image.new("RGBA", SIZE, (0, 0, 0, 255))
    alpha_mask.paste((0, 0, 0, 0), (16, 16, 40, 40))
    openai = client.post("/v1/images/edits", data={"prompt": "a hat", "output_format": "jpeg"},
                         files={"image": files["image"], "mask": ("m.png", png(alpha_mask), "image/png")})
    encoded = base64.b64decode(openai.json()["data"][0]["b64_json"])
    assert Image.open(io.BytesIO(encoded)).info.get("icc_profile") == profile
    registered = client.post("/v1/templates", files={"image": files["image"]},
                             data={"prompt": "a living room", "steps": str(STEPS)}).json()
    assert registered["id"] != template_id  # the fixture's template: the same pixels, prompt and steps, no profile
    assert Image.open(io.BytesIO(client.get(f"/v1/templates/{registered['id']}/image").content)
                      ).info.get("icc_profile") == profile
    client.delete(f"/v1/templates/{registered['id']}")


def test_templates_list_delete_and_metrics(client, template_id):
    other = client.post("/v1/templates", files={"image": ("t.png", png(Image.new("RGB", (32, 32), "blue")), "image/png")},
                        data={"steps": str(STEPS)}).json()
    assert {t["id"] for t in client.get("/v1/templates").json()["data"]} >= {template_id, other["id"]}
    assert client.delete(f"/v1/templates/{other['id']}").json() == {"id": other["id"], "deleted": True}
    assert_error(client.get(f"/v1/templates/{other['id']}"), 404, "template_id")
    assert_error(client.delete(f"/v1/templates/{other['id']}"), 404, "template_id")

    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").json()["workers"] == 2
    metrics = client.get("/metrics").text
    assert 'retouch_http_requests_total{endpoint="/v1/edits",status="200"}' in metrics
    assert 'retouch_request_seconds_count{endpoint="/v1/edits",outcome="ok"}' in metrics
    assert 'retouch_worker_mean_batch_size{worker="w0"}' in metrics
    assert "retouch_router_decision_seconds_count" in metrics
    assert "retouch_queue_depth 0.0" in metrics


def test_killing_a_worker_loses_no_request(server, template_id):
    """SIGKILL a worker while it holds requests: every request is still answered, once."""
    router = server.router
    report = {}

    def load():
        report.update(bench_serve.main(["--url", server.url, "--template-id", template_id, "--requests", "40",
                                        "--concurrency", "8", "--timeout", "120"]))

    thread = threading.Thread(target=load)
    thread.start()
    victim = "w0"
    assert router.wait_until(lambda r: victim in r.workers and len(r.workers[victim].assigned) > 0, 60)
    os.kill(server.supervisor.pids()[victim], signal.SIGKILL)
    thread.join(timeout=300)
    assert report["sent"] == 40 and report["ok"] == 40 and report["lost"] == 0 and report["errors"] == {}
    snapshot = router.snapshot()
    assert snapshot["counters"]["rerouted"] >= 1
    assert victim not in snapshot["workers"]
    # The supervisor's replacement joins and records the template again.
    assert router.wait_until(lambda r: len(r.workers) == 2, 120)
    assert router.wait_until(lambda r: r.template(template_id)["progress"]["workers_ready"] == 2, 120)


def test_a_one_off_image_edited_below_full_strength_twice_is_recorded_and_then_edited_mask_aware(client):
    """Its second edit below strength 1 has its worker record it beside that edit: the third edit computes
    only its masked tokens, and keeps every unmasked pixel."""
    template = random_image(SIZE, seed=21)  # an image no other test edits
    mask = Image.new("L", template.size, 0)
    mask.paste(255, (8, 8, 24, 24))

    def edit(prompt: str, **fields) -> httpx.Response:
        return client.post("/v1/edits", files={"image": ("t.png", png(template), "image/png"),
                                               "mask": ("m.png", png(mask), "image/png")},
                           data={"prompt": prompt, "steps": str(STEPS), "strength": "0.5", **fields})

    first, second = edit("a red sofa"), edit("a blue sofa")
    assert first.status_code == second.status_code == 200
    template_id = second.headers["X-Template-Id"]
    assert client.get(f"/v1/templates/{template_id}", params={"wait": 60}).json()["status"] == "ready"
    streamed = edit("a green sofa", stream="true")
    done = [block for block in streamed.text.split("\n\n") if block.startswith("event: done")]
    metrics = json.loads(done[0].split("data: ", 1)[1])["metrics"]
    assert metrics["computed_tokens"] < metrics["tokens"]
    answer = np.asarray(Image.open(io.BytesIO(edit("a green sofa").content)).convert("RGB"))
    keep = np.asarray(mask) == 0
    assert np.array_equal(answer[keep], np.asarray(template)[keep])
