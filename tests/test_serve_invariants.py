"""Through `retouch serve` (frontend, router, a worker process): the answer to an edit has the
image's size and every pixel the mask leaves at 0 is the template's own, for every family, at sizes
that are not whole patches, for registered templates and one-off images alike."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mask_strategies import masks, random_image, sizes
from PIL import Image

from retouch.config import ServeOptions
from retouch.images import png_bytes
from retouch.server import Server

TINY_MODELS = ["tiny-flux-fill", "tiny-flux-inpaint", "tiny-sd3-inpaint", "tiny-sdxl-inpaint", "tiny-sd2-inpaint"]
STEPS = 2


@pytest.fixture(scope="module", params=TINY_MODELS)
def client(request):
    opts = ServeOptions(model=request.param, workers=1, port=0, mode="naive", worker_threads=1, steps=STEPS,
                        heartbeat_s=0.2, dead_after_s=5.0)
    with Server(opts).start() as server, httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def decoded(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.asarray(Image.open(io.BytesIO(response.content)).convert("RGB"))


def one_off_edit(client, image, mask, seed: int = 1) -> httpx.Response:
    return client.post("/v1/edits", files={"image": ("t.png", png_bytes(image), "image/png"),
                                           "mask": ("m.png", png_bytes(mask), "image/png")},
                       data={"prompt": "a red sofa", "seed": str(seed), "steps": str(STEPS)})


@given(size=sizes(max_side=48), data=st.data())
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
def test_answers_keep_the_size_and_every_unmasked_pixel(client, size, data):
    template = random_image(size, seed=sum(size))
    mask = data.draw(masks(size))
    answer = decoded(one_off_edit(client, template, mask))
    keep = np.asarray(mask) == 0
    assert answer.shape[:2] == (size[1], size[0])
    assert np.array_equal(answer[keep], np.asarray(template)[keep])


def test_an_odd_sized_template_keeps_its_pixels_and_repaints_one_pixel(client):
    """Through a registered template and through a one-off image: an all-black mask returns the
    template's PNG; a mask of one white pixel changes that pixel and no other."""
    template = random_image((130, 97), seed=5)
    registered = client.post("/v1/templates", files={"image": ("t.png", png_bytes(template), "image/png")},
                             data={"prompt": "a room", "steps": str(STEPS)}).json()
    ready = client.get(f"/v1/templates/{registered['id']}", params={"wait": 60}).json()
    assert ready["status"] == "ready" and (ready["width"], ready["height"]) == (130, 97)
    black = Image.new("L", (130, 97), 0)
    one_pixel = black.copy()
    one_pixel.putpixel((65, 48), 255)
    for send in (lambda mask: client.post("/v1/edits", files={"mask": ("m.png", png_bytes(mask), "image/png")},
                                          data={"template_id": registered["id"], "prompt": "a red sofa"}),
                 lambda mask: one_off_edit(client, template, mask)):
        untouched = send(black)
        assert untouched.status_code == 200 and untouched.content == png_bytes(template)  # byte for byte
        repainted = decoded(send(one_pixel))
        differs = (repainted != np.asarray(template)).any(axis=2)
        assert differs[48, 65] and differs.sum() == 1


def test_the_openai_form_keeps_every_pixel_its_alpha_mask_keeps(client):
    template = random_image((61, 47), seed=9)
    mask = Image.new("RGBA", template.size, (0, 0, 0, 255))
    mask.putpixel((60, 46), (0, 0, 0, 0))  # alpha 0 = repaint: the corner pixel next to the padding
    response = client.post("/v1/images/edits", data={"prompt": "a red sofa", "size": "auto"},
                           files=[("image", ("i.png", png_bytes(template), "image/png")),
                                  ("mask", ("m.png", png_bytes(mask), "image/png"))])
    assert response.status_code == 200, response.text
    answer = np.asarray(Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"]))).convert("RGB"))
    differs = (answer != np.asarray(template)).any(axis=2)
    assert answer.shape[:2] == (47, 61) and differs[46, 60] and differs.sum() == 1
