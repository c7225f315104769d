"""Progress as Server-Sent Events through `retouch serve` (`retouch.http_events`): an edit streams
every step once, in order, then its image; a watcher of an edit in flight and of a template's
recording see them to the end; cancelling or leaving a stream stops the edit; previews picture the
latents."""

from __future__ import annotations

import base64
import io
import json
import logging
import threading
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
from mask_strategies import random_image
from PIL import Image
from polling import wait_for

from retouch.config import ServeOptions
from retouch.engine.previews import LatentPreviewer
from retouch.images import png_bytes
from retouch.models import load_pipeline
from retouch.noise import pack_flux_latents
from retouch.server import Server

SIZE = (48, 32)
STEPS = 4
LONG_STEPS = 40  # long enough to cancel or leave mid-way
WATCHED_STEPS = 200  # long enough that the edit is still running when the watcher comes, under load too


@pytest.fixture(scope="module")
def server():
    opts = ServeOptions(model="tiny-flux-fill", workers=1, port=0, mode="naive", worker_threads=1, steps=STEPS,
                        heartbeat_s=0.1, dead_after_s=5.0)
    with Server(opts).start() as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def box(rect=(8, 8, 24, 24)) -> Image.Image:
    mask = Image.new("L", SIZE, 0)
    mask.paste(255, rect)
    return mask


def register(client, image: Image.Image, steps: int) -> str:
    response = client.post("/v1/templates", files={"image": ("t.png", png_bytes(image), "image/png")},
                           data={"prompt": "a room", "steps": str(steps)})
    assert response.status_code in (200, 202), response.text
    template_id = response.json()["id"]
    assert client.get(f"/v1/templates/{template_id}", params={"wait": 60}).json()["status"] == "ready"
    return template_id


def stream_events(lines) -> Iterator[tuple[str, dict]]:
    """(event, data) pairs of an event stream as they come, keep-alive comments skipped."""
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            yield name, json.loads(line.removeprefix("data: "))


def events(lines) -> list[tuple[str, dict]]:
    return list(stream_events(lines))


def edit_form(template_id: str, **fields) -> dict:
    return {"files": {"mask": ("m.png", png_bytes(box()), "image/png")},
            "data": {"template_id": template_id, "prompt": "a cat", "seed": "3", **fields}}


def test_a_streamed_edit_tells_every_step_once_in_order_then_its_image(client):
    image = random_image(SIZE, seed=1)
    template_id = register(client, image, STEPS)
    with client.stream("POST", "/v1/edits", **edit_form(template_id, stream="true", preview_every="2")) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        seen = events(response.iter_lines())
    names = [name for name, _ in seen]
    assert names[:2] == ["accepted", "queued"] and names[-1] == "done"
    assert [data["step"] for name, data in seen if name == "step"] == list(range(1, STEPS + 1))
    assert all(data["steps"] == STEPS for name, data in seen if name == "step")
    previews = [data for name, data in seen if name == "preview"]
    assert [p["step"] for p in previews] == [2]  # every 2 steps, before the last (the last is the image)
    assert Image.open(io.BytesIO(base64.b64decode(previews[0]["image"]))).size == (6, 4)  # 1/8 of 48x32
    assert names.index("preview") == names.index("step") + 2  # after step 2, before step 3
    accepted, done = seen[0][1], seen[-1][1]
    assert accepted["mask_ratio"] == done["mask_ratio"] == pytest.approx(4 / 6, abs=1e-4)  # 2x2 of 3x2 tokens
    streamed = Image.open(io.BytesIO(base64.b64decode(done["b64_json"])))
    plain = client.post("/v1/edits", **edit_form(template_id))
    assert plain.status_code == 200
    assert np.array_equal(np.asarray(streamed), np.asarray(Image.open(io.BytesIO(plain.content))))
    keep = np.asarray(box()) == 0
    assert np.array_equal(np.asarray(streamed.convert("RGB"))[keep], np.asarray(image)[keep])


def test_a_template_streams_its_recording_until_ready(client):
    response = client.post("/v1/templates", files={"image": ("t.png", png_bytes(random_image(SIZE, 2)), "image/png")},
                           data={"prompt": "a hall", "steps": str(STEPS)})
    template_id = response.json()["id"]
    with client.stream("GET", f"/v1/templates/{template_id}/events") as stream:
        seen = events(stream.iter_lines())
    assert {name for name, _ in seen} == {"template"} and seen[-1][1]["status"] == "ready"
    steps = [data["progress"]["step"] for _, data in seen]
    assert steps == sorted(steps) and steps[-1] == STEPS
    assert client.get(f"/v1/templates/{template_id}/image").content == png_bytes(random_image(SIZE, 2))
    assert client.get("/v1/templates/tpl-unknown/events").status_code == 404


def test_an_edit_in_flight_is_watched_from_where_it_is_to_the_end(client):
    template_id = register(client, random_image(SIZE, seed=4), WATCHED_STEPS)
    answered = {}
    posting = threading.Thread(target=lambda: answered.setdefault(
        "response", client.post("/v1/edits", headers={"X-Request-Id": "watched"}, **edit_form(template_id))))
    posting.start()
    wait_for(lambda: client.get("/v1/edits/watched").status_code == 200, "the edit in flight", 60)
    with client.stream("GET", "/v1/edits/watched/events") as stream:
        assert stream.status_code == 200
        seen = events(stream.iter_lines())
    posting.join()
    assert answered["response"].status_code == 200
    assert seen[0][0] in ("parked", "queued", "running") and seen[-1] == ("done", {"id": "watched", "status": 200})
    steps = [data["step"] for name, data in seen if name == "step"]
    assert steps == list(range(steps[0], WATCHED_STEPS + 1))
    assert client.get("/v1/edits/watched/events").status_code == 404  # answered: nothing in flight


def access_status(caplog, request_id: str) -> int | None:
    """The status the access log gave the request's answer (None: not logged yet)."""
    lines = [r.getMessage() for r in caplog.records if r.name == "retouch.access"]
    lines = [line for line in lines if f"id={request_id}" in line]
    return int(lines[-1].split()[2]) if lines else None


def test_a_stream_cancelled_by_delete_ends_with_an_error_event(client, server, caplog):
    caplog.set_level(logging.INFO, logger="retouch.access")
    template_id = register(client, random_image(SIZE, seed=5), LONG_STEPS)
    form = edit_form(template_id, stream="true")
    with client.stream("POST", "/v1/edits", headers={"X-Request-Id": "to-cancel"}, **form) as response:
        seen = []
        for name, data in stream_events(response.iter_lines()):
            seen.append((name, data))
            if name == "step" and data["step"] == 1:
                deleted = client.delete("/v1/edits/to-cancel")
                assert deleted.status_code == 200 and deleted.json()["cancelled"] is True, deleted.text
    assert seen[-1][0] == "error" and seen[-1][1]["status"] == 409
    assert seen[-1][1]["error"]["code"] == "cancelled"
    # the stream began 200; its access line says how it ended
    wait_for(lambda: access_status(caplog, "to-cancel") is not None, "the access line", 30)
    assert access_status(caplog, "to-cancel") == 409


def test_a_client_that_leaves_a_stream_cancels_its_edit(client, server, caplog):
    caplog.set_level(logging.INFO, logger="retouch.access")
    template_id = register(client, random_image(SIZE, seed=6), LONG_STEPS)
    cancelled = server.router.snapshot()["counters"]["cancelled"]
    form = edit_form(template_id, stream="true")
    with client.stream("POST", "/v1/edits", headers={"X-Request-Id": "leaves"}, **form) as response:
        for line in response.iter_lines():
            if line == "event: step":
                break  # and the connection closes
    assert server.router.wait_until(lambda r: r.counters["cancelled"] == cancelled + 1 and not r.pending, 30)
    wait_for(lambda: access_status(caplog, "leaves") is not None, "the access line", 30)
    assert access_status(caplog, "leaves") == 499  # nginx's "client closed request", as for an edit not streamed


@pytest.mark.parametrize("fields, param", [({"stream": "maybe"}, "stream"), ({"preview_every": "2"}, "preview_every"),
                                           ({"stream": "true", "preview_every": "-1"}, "preview_every")])
def test_bad_stream_fields_are_refused_before_any_work(client, fields, param):
    response = client.post("/v1/edits", **edit_form("tpl-whatever", **fields))
    assert 400 <= response.status_code < 500 and response.json()["error"]["param"] == param


class LinearVAE(torch.nn.Module):
    """An encoder that is exactly linear per 8x8 patch (as the published VAEs nearly are for flat
    colours): latents = mix @ mean RGB + offset, C channels."""

    def __init__(self, channels: int = 16):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.mix = torch.nn.Parameter(torch.randn(channels, 3, generator=generator))
        self.offset = torch.nn.Parameter(torch.randn(channels, generator=generator))
        self.config = type("Config", (), {"scaling_factor": 1.5, "shift_factor": 0.1})()

    def encode(self, images):
        pooled = torch.nn.functional.avg_pool2d(images, 8)
        mean = torch.einsum("bchw,kc->bkhw", pooled, self.mix) + self.offset[None, :, None, None]
        return type("Encoded", (), {"latent_dist": type("Dist", (), {"mean": mean})()})()


def test_previews_recover_the_colours_of_a_linear_vae():
    """The fitted map inverts an encoder that is linear: a picture of its latents is the image."""
    pipe = type("Pipe", (), {"vae": LinearVAE(), "vae_scale_factor": 8})()
    previewer = LatentPreviewer.fit(pipe, "sd3")
    rng = np.random.default_rng(1)
    pixels = rng.uniform(-1, 1, (3, 4, 6)).repeat(8, 1).repeat(8, 2)  # 48x32, flat 8x8 squares
    with torch.inference_mode():
        latents = pipe.vae.encode(torch.tensor(pixels, dtype=torch.float32)[None]).latent_dist.mean
        normalised = latents * pipe.vae.config.scaling_factor  # as the SD3 pipelines hand latents to the denoiser
    canvas = type("Canvas", (), {"size": (44, 30), "padded": (48, 32)})  # the user's part of the canvas
    preview = previewer.image(pipe, normalised, canvas)
    assert preview.size == (6, 4)  # ceil(44/8) x ceil(30/8)
    expected = (pixels[:, ::8, ::8].transpose(1, 2, 0) + 1) * 127.5
    assert np.abs(np.asarray(preview, np.float64) - expected).max() <= 1.0


def test_previews_of_a_built_in_model_are_small_rgb_pictures():
    pipe = load_pipeline("tiny-flux-fill", "cpu", torch.float32).pipe
    previewer = LatentPreviewer.fit(pipe, "flux-fill")
    latents = pack_flux_latents(torch.randn(1, 16, 8, 12))
    preview = previewer.image(pipe, latents, type("Canvas", (), {"size": (90, 60), "padded": (96, 64)}))
    assert preview.mode == "RGB" and preview.size == (12, 8)
