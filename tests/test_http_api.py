"""The frontend's limits without any worker: API key, back-pressure (429 with Retry-After) and the
answer to requests the server shuts down before running."""

from __future__ import annotations

import asyncio
import io

import httpx
from PIL import Image

from retouch.engine.router import Router, RouterConfig
from retouch.http_api import Limits, create_app

KEY = "sk-test"


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


async def scenario() -> dict:
    router = Router(RouterConfig(address="tcp://127.0.0.1:0", policy="least-requests", max_queue=1)).start()
    app = create_app(router, Limits(api_key=KEY, default_steps=2))
    auth = {"Authorization": f"Bearer {KEY}"}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://retouch") as client:
        outcome = {"no key": await client.get("/v1/templates"),
                   "wrong key": await client.get("/v1/templates", headers={"Authorization": "Bearer nope"}),
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
    assert outcome["health without key"].status_code == 200
    assert outcome["not ready"].status_code == 503
    assert outcome["registered"].status_code == 202 and outcome["registered"].json()["status"] == "recording"
    busy = outcome["over the queue"]
    assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
    assert busy.json()["error"]["code"] == "queue_full"
    assert outcome["shut down"].status_code == 503 and "shut down" in outcome["shut down"].json()["error"]["message"]
