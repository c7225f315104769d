"""Tenants by API key: a template belongs to the key that registered it, and another key can neither
see, list, edit nor delete it (404, as for an id that never was), nor see its edits in flight. The
Authorization scheme is read in any case, the header only once; the API docs are behind the key, or off; over-long
prompts are refused before any work."""

from __future__ import annotations

import asyncio
import io

import httpx
import zmq
from PIL import Image
from scripted_worker import ScriptedWorker, router_and_context

from retouch.engine.router import Router, RouterConfig
from retouch.http_api import Limits, create_app, one_off_id_of, template_id_of

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
A, B = {"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {KEY_B}"}


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


TEMPLATE = png(Image.new("RGB", (32, 32), "red"))
MASK = {"mask": ("m.png", png(Image.new("L", (32, 32), 255)), "image/png")}


async def two_tenants(router: Router, context: zmq.Context) -> dict:
    app = create_app(router, Limits(api_keys=(KEY_A, KEY_B), default_steps=2))
    worker = ScriptedWorker(context, router, "w0")
    seen = {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
        registered = await client.post("/v1/templates", headers=A, data={"steps": "2"},
                                       files={"image": ("t.png", TEMPLATE, "image/png")})
        template_id = registered.json()["id"]
        await asyncio.to_thread(worker.register, template_id)
        url = f"/v1/templates/{template_id}"
        edit = {"template_id": template_id, "prompt": "a cat"}
        seen["B get"] = await client.get(url, headers=B)
        seen["B list"] = await client.get("/v1/templates", headers=B)
        seen["B edit"] = await client.post("/v1/edits", headers=B, data=edit, files=MASK)
        seen["B delete"] = await client.delete(url, headers=B)
        seen["A get, lowercase scheme"] = await client.get(url, headers={"Authorization": f"bearer {KEY_A}"})
        seen["A list, uppercase scheme"] = await client.get("/v1/templates", headers={"Authorization": f"BEARER {KEY_A}"})
        seen["two keys"] = await client.get(url, headers=[("Authorization", f"Bearer {KEY_B}"),
                                                          ("Authorization", f"Bearer {KEY_A}")])

        running = asyncio.create_task(client.post("/v1/edits", headers={**A, "X-Request-Id": "a-1"}, data=edit,
                                                  files=MASK))
        message = await asyncio.to_thread(worker.receive, "edit")
        seen["B edit status"] = await client.get("/v1/edits/a-1", headers=B)
        seen["B cancel"] = await client.delete("/v1/edits/a-1", headers=B)
        seen["A edit status"] = await client.get("/v1/edits/a-1", headers=A)
        await asyncio.to_thread(worker.answer, message["request"], png(Image.new("RGB", (32, 32), "blue")))
        seen["A edit"] = await running

        same_image = await client.post("/v1/templates", headers=B, data={"steps": "2"},
                                       files={"image": ("t.png", TEMPLATE, "image/png")})
        seen["B registers the same image"] = same_image
        seen["A list after"] = await client.get("/v1/templates", headers=A)
        seen["A delete"] = await client.delete(url, headers=A)
        seen["too long prompt"] = await client.post("/v1/edits", headers=A, files=MASK, data={
            "template_id": same_image.json()["id"], "prompt": "x" * 4001})
        seen["openapi without key"] = await client.get("/openapi.json")
        seen["openapi with key"] = await client.get("/openapi.json", headers=B)
        seen["docs without key"] = await client.get("/docs")
    return {"template_id": template_id, **seen}


def test_a_tenant_sees_only_its_own_templates_and_edits():
    with router_and_context() as (router, context):
        seen = asyncio.run(two_tenants(router, context))
    template_id = seen["template_id"]
    for name in ("B get", "B edit", "B delete"):
        assert seen[name].status_code == 404, name
        assert seen[name].json()["error"]["param"] == "template_id"
        assert seen[name].json()["error"]["code"] == "template_not_found"
    assert seen["B list"].status_code == 200 and seen["B list"].json()["data"] == []
    for name in ("B edit status", "B cancel"):
        assert seen[name].status_code == 404 and seen[name].json()["error"]["code"] == "edit_not_found", name
    assert seen["A get, lowercase scheme"].json()["id"] == template_id
    assert [t["id"] for t in seen["A list, uppercase scheme"].json()["data"]] == [template_id]
    assert seen["A edit status"].status_code == 200
    # which one a proxy in front checked is not which one would count here
    assert seen["two keys"].status_code == 400 and seen["two keys"].json()["error"]["param"] == "authorization"
    assert seen["A edit"].status_code == 200 and seen["A edit"].headers["content-type"] == "image/png"

    theirs = seen["B registers the same image"].json()["id"]
    assert theirs != template_id  # no record shared across tenants
    assert [t["id"] for t in seen["A list after"].json()["data"]] == [template_id]
    assert seen["A delete"].json() == {"id": template_id, "deleted": True}
    too_long = seen["too long prompt"]
    assert too_long.status_code == 422 and too_long.json()["error"]["param"] == "prompt"
    assert seen["openapi without key"].status_code == 401 and seen["docs without key"].status_code == 401
    assert seen["openapi with key"].status_code == 200 and "/v1/edits" in seen["openapi with key"].json()["paths"]


def test_template_ids_differ_by_tenant():
    image = Image.new("RGB", (16, 16), "green")
    assert template_id_of(image, "", 2, 0, None, "a") != template_id_of(image, "", 2, 0, None, "b")
    assert one_off_id_of(image, 2, None, "a") != one_off_id_of(image, 2, None, "b")
    assert one_off_id_of(image, 2, None, "a") == one_off_id_of(image.copy(), 2, None, "a")


async def docs_off() -> list[httpx.Response]:
    router = Router(RouterConfig(address="tcp://127.0.0.1:0")).start()
    try:
        app = create_app(router, Limits(api_keys=(KEY_A,), docs=False))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
            return [await client.get(path, headers=A) for path in ("/openapi.json", "/docs", "/redoc")]
    finally:
        await asyncio.to_thread(router.close, 0)


def test_docs_can_be_turned_off():
    assert [r.status_code for r in asyncio.run(docs_off())] == [404, 404, 404]
