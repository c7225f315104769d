"""What a request costs through `retouch serve`: one generation per one-off edit, registrations that
run beside edits, cancellation at step granularity (DELETE, a client that goes away), and refusals
before any work (no template, nothing queued)."""

from __future__ import annotations

import io
import socket
import threading

import httpx
import numpy as np
import pytest
from mask_strategies import random_image
from PIL import Image

from retouch.config import ServeOptions
from retouch.images import png_bytes
from retouch.server import Server

SIZE = (48, 32)
MAX_STEPS = 2000  # a recording of SIZE this long lasts a second or more: time to delete it while it runs
MAX_WORK = 48 * 32 * MAX_STEPS  # the long recordings below fit; the refused requests do not


@pytest.fixture(scope="module")
def server():
    opts = ServeOptions(model="tiny-flux-fill", workers=1, port=0, mode="naive", worker_threads=1, steps=2,
                        heartbeat_s=0.1, dead_after_s=5.0, max_work=MAX_WORK, max_steps=MAX_STEPS)
    with Server(opts).start() as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def box(size=SIZE, rect=(8, 8, 24, 24)) -> Image.Image:
    mask = Image.new("L", size, 0)
    mask.paste(255, rect)
    return mask


def files(image=None, mask=None) -> dict:
    parts = {}
    if image is not None:
        parts["image"] = ("i.png", png_bytes(image), "image/png")
    if mask is not None:
        parts["mask"] = ("m.png", png_bytes(mask), "image/png")
    return parts


def worker_report(server, field: str, predicate) -> int:
    """The worker's heartbeat metric `field`, once `predicate(value)` holds (heartbeats every 0.1 s)."""
    def value(router):
        return next(iter(router.snapshot()["workers"].values()), {}).get(field)

    assert server.router.wait_until(lambda r: value(r) is not None and predicate(value(r)), 30), field
    return value(server.router)


def test_one_off_edits_cost_one_generation_and_the_next_is_mask_aware(server, client):
    image = random_image(SIZE, seed=11)
    recorded_before = worker_report(server, "recorded", lambda v: True)
    first = client.post("/v1/edits", files=files(image, box()), data={"prompt": "a hat", "seed": "1"})
    assert first.status_code == 200, first.text
    template_id = first.headers["X-Template-Id"]
    assert template_id.startswith("img-") and client.get(f"/v1/templates/{template_id}").json()["status"] == "ready"
    second = client.post("/v1/edits", files=files(image, box(rect=(30, 10, 46, 30))),
                         data={"prompt": "a cat", "seed": "2"})
    assert second.status_code == 200 and second.headers["X-Template-Id"] == template_id
    assert worker_report(server, "recorded", lambda v: v >= recorded_before + 1) == recorded_before + 1
    keep = np.asarray(box(rect=(30, 10, 46, 30))) == 0
    edited = np.asarray(Image.open(io.BytesIO(second.content)).convert("RGB"))
    assert np.array_equal(edited[keep], np.asarray(image)[keep])


def openai_mask(size) -> Image.Image:
    mask = Image.new("RGBA", size, (0, 0, 0, 255))
    mask.putpixel((3, 3), (0, 0, 0, 0))  # alpha 0 = repaint
    return mask


# case: (endpoint, image size, mask, form fields, status, the field the error names)
REFUSED = {
    "mask of another size": ("/v1/edits", SIZE, box(size=(20, 20)), {}, 422, "mask"),
    "too much work": ("/v1/edits", (64, 64), box(size=(64, 64)), {"steps": "1999"}, 413, "image"),
    "bad response_format": ("/v1/edits", SIZE, box(), {"response_format": "gif"}, 400, "response_format"),
    "openai: n=0": ("/v1/images/edits", SIZE, openai_mask(SIZE), {"n": "0"}, 422, "n"),
    "openai: bad size": ("/v1/images/edits", SIZE, openai_mask(SIZE), {"size": "big"}, 400, "size"),
    "openai: too much work": ("/v1/images/edits", (640, 640), openai_mask((640, 640)), {"n": "4"}, 413, "n"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refused_request_leaves_no_template_and_nothing_queued(server, client, case):
    endpoint, size, mask, fields, status, param = REFUSED[case]
    templates = {t["id"] for t in client.get("/v1/templates").json()["data"]}
    response = client.post(endpoint, files=files(random_image(size, seed=len(case)), mask),
                           data={"prompt": "a hat", **fields})
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    if status == 413:
        assert str(MAX_WORK) in error["message"] and "--max-work" in error["message"]
    assert {t["id"] for t in client.get("/v1/templates").json()["data"]} == templates
    assert server.router.snapshot()["pending"] == 0


def test_an_all_black_mask_costs_nothing_and_creates_nothing(client):
    image = random_image((33, 21), seed=5)
    templates = client.get("/v1/templates").json()["data"]
    response = client.post("/v1/edits", files=files(image, Image.new("L", image.size, 0)), data={"prompt": "x"})
    assert response.status_code == 200 and response.content == png_bytes(image)
    assert client.get("/v1/templates").json()["data"] == templates


def long_template(client, steps: int, seed: int | None = None) -> str:
    """A new template (202: recording) of `steps` steps; one image per (steps, seed)."""
    response = client.post("/v1/templates", files=files(random_image(SIZE, seed=steps if seed is None else seed)),
                           data={"prompt": "a room", "steps": str(steps)})
    assert response.status_code == 202
    return response.json()["id"]


def test_delete_stops_a_recording_within_one_step(server, client):
    cancelled = worker_report(server, "cancelled", lambda v: True)
    # 200 steps of this model at this size once ended between two heartbeats: nothing was left to delete
    template_id = long_template(client, steps=MAX_STEPS)
    assert server.router.wait_until(lambda r: (r.template(template_id) or {}).get("progress", {}).get("step", 0) >= 3,
                                    60)
    steps_before = worker_report(server, "steps", lambda v: True)
    assert client.delete(f"/v1/templates/{template_id}").status_code == 200
    assert worker_report(server, "cancelled", lambda v: v == cancelled + 1) == cancelled + 1
    steps_after = worker_report(server, "steps", lambda v: True)
    # A heartbeat is at most 0.1 s old and a step of this model takes a millisecond or less; the recording
    # had most of its steps to go. It stopped within one step of the drop reaching the worker.
    assert steps_after - steps_before < MAX_STEPS // 2
    assert client.get(f"/v1/templates/{template_id}").status_code == 404
    assert client.post("/v1/edits", files=files(random_image(SIZE, seed=3), box()),
                       data={"prompt": "a hat"}).status_code == 200  # the worker goes on serving


def test_a_client_that_goes_away_cancels_its_edit(server, client):
    template_id = long_template(client, steps=200, seed=2)
    assert client.get(f"/v1/templates/{template_id}", params={"wait": 60}).json()["status"] == "ready"
    # The worker's count may still lack an earlier test's cancel (counted when its job leaves the batch, told
    # a heartbeat later): so "more than before", and the router's own count, which is synchronous, exactly.
    cancelled = worker_report(server, "cancelled", lambda v: True)
    router_cancelled = server.router.snapshot()["counters"]["cancelled"]
    # A raw connection that closes once the worker runs the edit: no guess at how long an edit takes.
    request = client.build_request("POST", "/v1/edits", files=files(mask=box()),
                                   data={"template_id": template_id, "prompt": "x"})
    head = "".join(f"{name}: {value}\r\n" for name, value in request.headers.items())
    url = httpx.URL(server.url)
    with socket.create_connection((url.host, url.port)) as connection:
        connection.sendall(f"POST /v1/edits HTTP/1.1\r\n{head}\r\n".encode() + request.read())
        assert server.router.wait_until(lambda r: any(p.steps_left is not None and p.steps_left < 200
                                                      for p in r.pending.values()), 60)
    assert worker_report(server, "cancelled", lambda v: v > cancelled) > cancelled
    assert server.router.wait_until(lambda r: r.snapshot()["pending"] == 0, 10)
    assert server.router.snapshot()["counters"]["cancelled"] == router_cancelled + 1


def test_progress_and_cancel_by_request_id(server, client):
    template_id = long_template(client, steps=200, seed=1)  # time to look at it
    assert client.get(f"/v1/templates/{template_id}", params={"wait": 60}).json()["status"] == "ready"
    answer = {}

    def post():
        answer["response"] = client.post("/v1/edits", files=files(mask=box()), headers={"X-Request-Id": "mine-1"},
                                         data={"template_id": template_id, "prompt": "x"})

    thread = threading.Thread(target=post)
    thread.start()
    assert server.router.wait_until(lambda r: any(p.steps_left is not None and p.steps_left < 195
                                                  for p in r.pending.values()), 60)
    status = client.get("/v1/edits/mine-1").json()
    [image] = status["images"]
    assert image["status"] == "running" and 0 < image["step"] < image["steps"] == 200
    assert client.delete("/v1/edits/mine-1").json() == {"id": "mine-1", "cancelled": True}
    thread.join(60)
    response = answer["response"]
    assert response.status_code == 409 and response.json()["error"]["code"] == "cancelled"
    assert client.get("/v1/edits/mine-1").status_code == 404
    assert client.post("/v1/edits", headers={"X-Request-Id": "bad id!"},
                       files=files(mask=box()), data={"template_id": template_id, "prompt": "x"}).status_code == 400


def test_the_url_takes_connections_as_soon_as_start_returns():
    """start() hands out the URL before uvicorn's loop runs: the kernel must already queue connections
    (a client that registered at once used to be refused)."""
    opts = ServeOptions(model="tiny-flux-fill", workers=0, port=0)
    for _ in range(3):
        with Server(opts).start() as running:
            host, port = running.url.removeprefix("http://").rsplit(":", 1)
            socket.create_connection((host, int(port)), timeout=5).close()
            assert httpx.get(f"{running.url}/healthz", timeout=30).status_code == 200


def test_least_work_routing_serves_edits():
    """--policy least-work prices a worker's remaining work with the step cost model the server builds."""
    opts = ServeOptions(model="tiny-flux-fill", workers=1, port=0, mode="naive", worker_threads=1, steps=2,
                        policy="least-work")
    image = random_image(SIZE, seed=21)
    with Server(opts).start() as running, httpx.Client(base_url=running.url, timeout=120) as client:
        answer = client.post("/v1/edits", files=files(image, box()), data={"prompt": "a hat"})
        assert answer.status_code == 200, answer.text
        keep = np.asarray(box()) == 0
        edited = np.asarray(Image.open(io.BytesIO(answer.content)).convert("RGB"))
        assert np.array_equal(edited[keep], np.asarray(image)[keep])


def test_several_cpu_workers_share_its_cores_unless_told_otherwise(monkeypatch):
    """Each worker at torch's default takes every core: several of them (and their helpers) spin against
    each other. On a CPU they split the cores and helpers take one; a GPU's workers, a single worker and
    explicit counts are left alone."""
    from retouch.server import threads_of

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    assert threads_of(ServeOptions(model="m", workers=2), "cpu") == (4, 1)
    assert threads_of(ServeOptions(model="m", workers=3), "cpu") == (2, 1)
    assert threads_of(ServeOptions(model="m", workers=16), "cpu") == (1, 1)
    assert threads_of(ServeOptions(model="m", workers=2, worker_threads=6, helper_threads=2), "cpu") == (6, 2)
    assert threads_of(ServeOptions(model="m", workers=1), "cpu") == (0, 0)
    assert threads_of(ServeOptions(model="m", workers=4), "cuda") == (0, 0)
