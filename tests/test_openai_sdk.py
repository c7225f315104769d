"""POST /v1/images/edits driven by OpenAI's own Python SDK (`openai`), as users of the OpenAI Images
API would: its edit, its edit stream (partial images, then the image), its errors and its API key all
read as the SDK expects, and the unmasked pixels come back unchanged."""

from __future__ import annotations

import base64
import contextlib
import io
import threading

import httpx
import numpy as np
import pytest
from mask_strategies import random_image
from PIL import Image
from polling import wait_for

from retouch.config import ServeOptions
from retouch.images import png_bytes
from retouch.server import Server

# requirements.txt pins it, so it is here wherever the suite is installed as CI installs it; the GPU machines'
# image lacks it and bench/run_gpu.sh carries no wheel of it (its parts never run this file).
openai = pytest.importorskip("openai", reason="OpenAI's SDK is not installed (the GPU machines' image)")

SIZE = (48, 32)
STEPS = 4
LONG_STEPS = 200  # the most a server allows: a cancel comes long before the edit ends
KEY = "sk-retouch-test-key-0123"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(KEY + "\n")
    opts = ServeOptions(model="tiny-flux-fill", workers=1, port=0, mode="naive", worker_threads=1, steps=STEPS,
                        heartbeat_s=0.1, dead_after_s=5.0, api_keys_file=keys,
                        served_model_name="tiny-flux-fill,gpt-image-1")  # an alias for clients that hard-code it
    with Server(opts).start() as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120) as client:
        yield client


def with_hole(image: Image.Image, rect=(8, 8, 24, 24)) -> tuple[bytes, np.ndarray]:
    """`image` as an RGBA PNG whose alpha is 0 in `rect` (OpenAI's way to say: repaint here), and the
    boolean map of the pixels to keep."""
    rgba = image.convert("RGBA")
    rgba.paste((0, 0, 0, 0), rect)
    keep = np.asarray(rgba)[..., 3] == 255
    return png_bytes(rgba), keep


def decoded(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_the_sdk_edit_answers_the_image_with_its_unmasked_pixels_unchanged(client):
    image = random_image(SIZE, seed=1)
    holed, keep = with_hole(image)
    answer = client.images.edit(image=("t.png", holed, "image/png"), prompt="a cat", model="gpt-image-1", n=2)
    assert len(answer.data) == 2 and answer.size == "48x32" and answer.output_format == "png"
    first, second = (np.asarray(decoded(item.b64_json).convert("RGB")) for item in answer.data)
    assert first.shape == second.shape == (32, 48, 3)
    assert np.array_equal(first[keep], np.asarray(image)[keep])
    assert not np.array_equal(first[~keep], second[~keep])  # n images are n seeds


def test_the_sdk_stream_gives_partial_images_then_the_image_it_would_have_answered(client):
    image = random_image(SIZE, seed=2)
    holed, keep = with_hole(image)
    plain = client.images.edit(image=("t.png", holed, "image/png"), prompt="a cat", output_format="webp",
                               output_compression=100)
    events = list(client.images.edit(image=("t.png", holed, "image/png"), prompt="a cat", stream=True,
                                     partial_images=2, output_format="webp", output_compression=100))
    assert [event.type for event in events] == ["image_edit.partial_image"] * 2 + ["image_edit.completed"]
    assert [event.partial_image_index for event in events[:2]] == [0, 1]
    for partial in events[:2]:  # whole pictures in the asked format: the preview inside the mask, the template outside
        preview = decoded(partial.b64_json)
        assert preview.format == "WEBP" and preview.size == (48, 32) and partial.size == "48x32"
        assert np.array_equal(np.asarray(preview.convert("RGB"))[keep], np.asarray(image)[keep])
    completed = events[-1]
    assert completed.size == "48x32" and completed.output_format == "webp" and completed.background == "opaque"
    assert type(completed).model_validate(completed.model_dump()).usage.total_tokens == 0  # the whole type holds
    streamed = np.asarray(decoded(completed.b64_json).convert("RGB"))
    assert np.array_equal(streamed, np.asarray(decoded(plain.data[0].b64_json).convert("RGB")))  # webp lossless
    assert np.array_equal(streamed[keep], np.asarray(image)[keep])


def test_the_sdk_stream_resizes_its_image_to_the_asked_size(client):
    holed, _ = with_hole(random_image(SIZE, seed=3))
    [completed] = client.images.edit(image=("t.png", holed, "image/png"), prompt="a cat", stream=True, size="24x16")
    assert completed.type == "image_edit.completed" and completed.size == "24x16"
    assert decoded(completed.b64_json).size == (24, 16)


@contextlib.contextmanager
def long_template(server, seed: int):
    """A ready template of LONG_STEPS steps and an HTTP client with the key: (client, template id, the
    template's image with a hole, as the SDK sends it)."""
    image = random_image(SIZE, seed=seed)
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        registered = http.post("/v1/templates", files={"image": ("t.png", png_bytes(image), "image/png")},
                               data={"prompt": "a room", "steps": str(LONG_STEPS)})
        template_id = registered.json()["id"]
        assert http.get(f"/v1/templates/{template_id}", params={"wait": 60}).json()["status"] == "ready"
        yield http, template_id, with_hole(image)[0]


def test_an_edit_cancelled_mid_stream_raises_the_sdk_error(server, client):
    """The stream's headers come once the edit is accepted: cancelled then (DELETE by its X-Request-Id),
    well before its 200 steps end, the stream's error event is the SDK's APIError with our code."""
    with long_template(server, seed=4) as (http, template_id, holed):
        stream = client.images.edit(image=("t.png", holed, "image/png"), prompt="a cat", stream=True,
                                    partial_images=1, extra_body={"template_id": template_id},
                                    extra_headers={"X-Request-Id": "cancel-me"})
        deleted = http.delete("/v1/edits/cancel-me")
        assert deleted.status_code == 200 and deleted.json()["cancelled"] is True, deleted.text
        seen = []
        with pytest.raises(openai.APIError, match="cancelled") as raised:
            for event in stream:
                seen.append(event.type)
        assert "image_edit.completed" not in seen and raised.value.body["code"] == "cancelled"


def test_a_cancelled_edit_is_not_sent_again_by_the_sdks_retries(server):
    """The SDK retries a 409 (up to max_retries) unless the answer says not to: a cancel must stay one."""
    with long_template(server, seed=8) as (http, template_id, holed):
        retrying = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=2, timeout=120)
        answer = {}

        def edit():
            try:
                retrying.images.edit(image=("t.png", holed, "image/png"), prompt="a cat",
                                     extra_body={"template_id": template_id}, extra_headers={"X-Request-Id": "once"})
            except openai.APIStatusError as exc:
                answer["error"] = exc

        editing = threading.Thread(target=edit)
        editing.start()
        wait_for(lambda: http.get("/v1/edits/once").status_code == 200, "the edit in flight", 60)
        assert http.delete("/v1/edits/once").json()["cancelled"] is True
        editing.join(120)
    assert answer["error"].status_code == 409 and answer["error"].body["code"] == "cancelled"
    assert answer["error"].response.headers["x-should-retry"] == "false"  # a retried edit would have answered 200


def test_an_opaque_image_without_a_mask_is_refused_not_answered_unchanged(client):
    opaque = png_bytes(random_image(SIZE, seed=9).convert("RGBA"))  # alpha 255 everywhere: nothing marked
    with pytest.raises(openai.BadRequestError) as raised:
        client.images.edit(image=("t.png", opaque, "image/png"), prompt="make it a watercolor")
    assert raised.value.body["param"] == "mask" and "has none" in raised.value.body["message"]


@pytest.mark.parametrize("fields, status, param", [
    ({"image": [("a.png", b"A"), ("b.png", b"B")]}, 400, "image"),  # reference images: retouch edits one
    ({"background": "transparent"}, 400, "background"),
    ({"stream": True, "n": 2}, 400, "n"),
    ({"partial_images": 2}, 400, "partial_images"),  # without stream
    ({"stream": True, "partial_images": 4}, 422, "partial_images"),  # out of range, as every number field
    ({"response_format": "url"}, 400, "response_format"),
    ({"output_format": "gif"}, 400, "output_format"),
    ({"size": "48x48"}, 400, "size"),  # the image is 48x32: it would be stretched
    ({"size": "3072x2048", "n": 3}, 413, "size"),  # answers over --max-pixels in all: scaled on the head's threads
    ({"size": "4_8x3_2"}, 400, "size"),  # int() would read it
    ({"model": "dall-e-2"}, 404, "model"),  # not served here (nor listed as an alias)
    ({"frame_count": 4}, 400, "frame_count"),  # an OpenAI field retouch cannot honour: refused, not ignored
    ({"extra_body": {"strenght": "0.5"}}, 400, "strenght"),  # a misspelt extra
])
def test_what_retouch_cannot_do_is_an_sdk_error_naming_the_field(client, fields, status, param):
    holed, _ = with_hole(random_image(SIZE, seed=5))
    request = {"image": ("t.png", holed, "image/png"), "prompt": "a cat", **fields}
    with pytest.raises(openai.APIStatusError) as raised:
        client.images.edit(**request)
    assert raised.value.status_code == status and raised.value.body["param"] == param


def test_what_only_describes_the_request_is_taken_and_ignored(client):
    """OpenAI's quality and input fidelity, and the end-user ids OpenAI asks clients to send (user,
    safety_identifier), change nothing here: the edit answers as without them."""
    image = random_image(SIZE, seed=6)
    holed, keep = with_hole(image)
    answer = client.images.edit(image=("t.png", holed, "image/png"), prompt="a cat", quality="high",
                                input_fidelity="high", user="customer-7", safety_identifier="hashed-customer-7")
    plain = client.images.edit(image=("t.png", holed, "image/png"), prompt="a cat")
    assert answer.data[0].b64_json == plain.data[0].b64_json


def test_the_sdk_lists_and_retrieves_the_served_model_by_each_name(client):
    assert [model.id for model in client.models.list()] == ["tiny-flux-fill", "gpt-image-1"]
    assert client.models.retrieve("gpt-image-1").id == "gpt-image-1"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("dall-e-2")


def test_a_wrong_key_is_the_sdk_authentication_error(server):
    holed, _ = with_hole(random_image(SIZE, seed=6))
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            stranger.images.edit(image=("t.png", holed, "image/png"), prompt="a cat")
