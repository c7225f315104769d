"""/metrics through prometheus_client: every HTTP answer counted (refusals by the middleware
included), edit latency and routing decisions as histograms, and the router's and each worker's
state (its template and LoRA caches included) read from a scripted worker's heartbeat. Both exposition formats
are parsed by prometheus_client's own parsers, OpenMetrics by its strict one."""

from __future__ import annotations

import asyncio
import io

import httpx
import zmq
from PIL import Image
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text
from scripted_worker import ScriptedWorker, router_and_context

from retouch.engine.router import Router, RouterConfig
from retouch.http_api import Limits, create_app

KEY = "sk-metrics"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_UPLOAD = 64 << 10
OPENMETRICS = "application/openmetrics-text; version=1.0.0"
# A worker's heartbeat: engine.metrics summary keys, CacheStore.metrics() under "cache" and
# LoraManager.metrics() under "lora".
WORKER_REPORT = {"steps": 12, "completed": 5, "failed": 1, "failed_recordings": 4, "cancelled": 2, "recorded": 1,
                 "interruptions": 3, "helper_restarts": 1, "mixed_size_steps": 6,
                 "mean_batch_size": 1.5, "mean_step_s": 0.25, "step_seconds": 3.0, "batch_rows": 18,
                 "cache": {"hits": 7, "misses": 2, "disk_hits": 1, "evictions": 0, "prefetches": 1,
                           "prefetch_bytes": 4096, "disk_reads": 1, "disk_writes": 2, "disk_bytes_read": 4096,
                           "disk_bytes_written": 8192, "corrupt_files": 0, "registrations": 1, "adoptions": 1,
                           "host_bytes_used": 1 << 20, "host_bytes_budget": 1 << 30, "host_templates": 1,
                           "disk_bytes_used": 8192, "disk_bytes_budget": 1 << 32},
                 "lora": {"cached_bytes": 1 << 20, "cached_adapters": 2, "budget_bytes": 1 << 31, "hits": 9,
                          "misses": 3, "evictions": 1, "loads": 3, "load_failures": 1,
                          "load_seconds": 0.75, "load_cpu_seconds": 0.25, "read_fallbacks": 1}}
# heartbeat key -> its gauge's name (Prometheus: the unit last); the other cache keys are counters
CACHE_GAUGES = {"host_bytes_used": "host_used_bytes", "host_bytes_budget": "host_budget_bytes",
                "host_templates": "host_templates", "disk_bytes_used": "disk_used_bytes",
                "disk_bytes_budget": "disk_budget_bytes"}
LORA_GAUGES = {"cached_bytes", "cached_adapters", "budget_bytes"}


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def samples(families) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value for family in families for s in family.samples}


def sample(found: dict, name: str, **labels) -> float:
    return found[(name, frozenset(labels.items()))]


async def traffic(router: Router, context: zmq.Context) -> dict:
    app = create_app(router, Limits(api_keys=(KEY,), default_steps=2, max_upload_bytes=MAX_UPLOAD))
    cached = ScriptedWorker(context, router, "w0", model="tiny-flux-fill", dtype="bfloat16", weights="0a1b",
                            scheduler="EulerDiscreteScheduler")
    plain = ScriptedWorker(context, router, "w1")
    await asyncio.to_thread(cached.heartbeat, WORKER_REPORT)
    await asyncio.to_thread(plain.heartbeat, {"steps": 3})  # no CacheStore: no "cache"; an older worker: no "lora"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
        registered = await client.post("/v1/templates", headers=AUTH, data={"steps": "2"},
                                       files={"image": ("t.png", png(Image.new("RGB", (32, 32), "red")), "image/png")})
        template_id = registered.json()["id"]
        await asyncio.to_thread(cached.register, template_id)
        mask = {"mask": ("m.png", png(Image.new("L", (32, 32), 255)), "image/png")}
        edit = asyncio.create_task(client.post("/v1/edits", headers=AUTH, files=mask,
                                               data={"template_id": template_id, "prompt": "a cat"}))
        message = await asyncio.to_thread(cached.receive, "edit")
        await asyncio.to_thread(cached.answer, message["request"], png(Image.new("RGB", (32, 32), "blue")))
        statuses = {"edit": (await edit).status_code,
                    "no prompt": (await client.post("/v1/edits", headers=AUTH, files=mask,
                                                    data={"template_id": template_id})).status_code,
                    "no key": (await client.get("/v1/templates")).status_code,
                    "unknown template": (await client.get("/v1/templates/tpl-nope", headers=AUTH)).status_code,
                    "over Content-Length": (await client.post("/v1/edits", headers=AUTH, files={
                        "mask": ("m.png", bytes(MAX_UPLOAD + 1), "image/png")})).status_code}

        async def streamed():  # no Content-Length: refused while it streams in
            yield b'--b\r\nContent-Disposition: form-data; name="mask"; filename="m.png"\r\n\r\n'
            for _ in range(4):
                yield bytes(MAX_UPLOAD // 2)

        statuses["streamed over"] = (await client.post("/v1/edits", content=streamed(), headers={
            **AUTH, "content-type": "multipart/form-data; boundary=b"})).status_code
        openmetrics = await client.get("/metrics", headers={"Accept": OPENMETRICS})
        text = await client.get("/metrics")
    return {"statuses": statuses, "openmetrics": openmetrics, "text": text}


def test_metrics_count_every_answer_and_expose_router_and_worker_state():
    with router_and_context() as (router, context):
        outcome = asyncio.run(traffic(router, context))
    assert outcome["statuses"] == {"edit": 200, "no prompt": 400, "no key": 401, "unknown template": 404,
                                   "over Content-Length": 413, "streamed over": 413}

    scraped = outcome["openmetrics"]
    assert scraped.headers["content-type"].startswith("application/openmetrics-text")
    found = samples(parse_openmetrics(scraped.text))
    requests = "retouch_http_requests_total"
    assert sample(found, requests, endpoint="/v1/edits", status="200") == 1
    assert sample(found, requests, endpoint="/v1/edits", status="400") == 1
    assert sample(found, requests, endpoint="/v1/edits", status="413") == 2
    assert sample(found, requests, endpoint="/v1/templates", status="401") == 1
    assert sample(found, requests, endpoint="/v1/templates/{id}", status="404") == 1
    assert sample(found, requests, endpoint="/v1/templates", status="202") == 1
    assert sample(found, "retouch_request_seconds_count", endpoint="/v1/edits", outcome="ok") == 1
    assert sample(found, "retouch_request_seconds_sum", endpoint="/v1/edits", outcome="ok") > 0
    assert sample(found, "retouch_router_decision_seconds_count") == 1
    assert sample(found, "retouch_workers") == 2 and sample(found, "retouch_queue_depth") == 0
    assert sample(found, "retouch_router_events_total", event="routed") == 1
    assert sample(found, "retouch_http_inflight_body_bytes") == 0
    assert sample(found, "retouch_template_bytes", kind="registered") == router.held_bytes(one_off=False) > 0
    assert sample(found, "retouch_template_bytes", kind="one_off") == 0

    assert sample(found, "retouch_worker_mean_batch_size", worker="w0") == WORKER_REPORT["mean_batch_size"]
    assert sample(found, "retouch_worker_mean_step_seconds", worker="w0") == WORKER_REPORT["mean_step_s"]
    for key in ("steps", "step_seconds", "batch_rows", "completed", "failed", "failed_recordings", "cancelled",
                "recorded", "interruptions", "helper_restarts", "mixed_size_steps"):
        assert sample(found, f"retouch_worker_{key}_total", worker="w0") == WORKER_REPORT[key]
    for key, value in WORKER_REPORT["cache"].items():
        name = "retouch_worker_cache_" + (CACHE_GAUGES[key] if key in CACHE_GAUGES else f"{key}_total")
        assert sample(found, name, worker="w0") == value, name
    for key, value in WORKER_REPORT["lora"].items():
        name = f"retouch_worker_lora_{key}" + ("" if key in LORA_GAUGES else "_total")
        assert sample(found, name, worker="w0") == value, name
    assert sample(found, "retouch_worker_steps_total", worker="w1") == 3
    # what each worker serves, so that two fleets' weights apart show (and one that said nothing shows empty)
    assert sample(found, "retouch_worker_info", worker="w0", model="tiny-flux-fill", dtype="bfloat16",
                  weights="0a1b", scheduler="EulerDiscreteScheduler") == 1
    assert sample(found, "retouch_worker_info", worker="w1", model="", dtype="", weights="", scheduler="") == 1
    assert sample(found, "retouch_worker_queued", worker="w1") == 1  # the template it was sent and never recorded
    assert sample(found, "retouch_worker_queued", worker="w0") == 0
    assert sample(found, "retouch_worker_running", worker="w0") == 0
    assert not any(name.startswith(("retouch_worker_cache_", "retouch_worker_lora_")) and ("worker", "w1") in labels
                   for name, labels in found)

    text = outcome["text"]
    assert text.headers["content-type"].startswith("text/plain; version=0.0.4")
    plain = samples(parse_text(text.text))
    assert sample(plain, requests, endpoint="/v1/edits", status="413") == 2
    assert sample(plain, "retouch_worker_cache_hits_total", worker="w0") == 7
    assert sample(plain, "retouch_worker_lora_loads_total", worker="w0") == 3
    assert sample(plain, "retouch_request_seconds_count", endpoint="/v1/edits", outcome="ok") == 1


async def a_bug() -> dict:
    router = Router(RouterConfig(address="tcp://127.0.0.1:0")).start()
    app = create_app(router, Limits())

    def broken(owner=None):
        raise RuntimeError("a bug")

    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
            router.list_templates = broken
            answer = await client.get("/v1/templates")
            del router.list_templates
            scraped = await client.get("/metrics", headers={"Accept": OPENMETRICS})
    finally:
        await asyncio.to_thread(router.close, 0)
    return {"answer": answer, "metrics": samples(parse_openmetrics(scraped.text))}


def test_a_bug_is_answered_with_a_json_500_and_counted():
    outcome = asyncio.run(a_bug())
    assert outcome["answer"].status_code == 500
    assert outcome["answer"].json()["error"]["code"] == "internal_error"
    assert sample(outcome["metrics"], "retouch_http_requests_total", endpoint="/v1/templates", status="500") == 1


def test_a_replacement_worker_keeps_its_slots_label():
    """`retouch serve` names a worker's replacement w0.1: its series stay worker="w0" (a counter reset for
    rate()), and while the dead w0 is still connected, only the replacement's report is exposed."""
    from retouch.serve_metrics import RouterCollector

    with router_and_context() as (router, context):
        old, replacement = ScriptedWorker(context, router, "w0"), ScriptedWorker(context, router, "w0.1")
        other = ScriptedWorker(context, router, "host-7.1")  # not a local worker's name: kept as it is
        old.heartbeat({"steps": 40})
        replacement.heartbeat({"steps": 2})
        other.heartbeat({"steps": 5})
        assert router.wait_until(lambda r: all(r.workers[name].report for name in ("w0", "w0.1", "host-7.1")), 30)
        found = samples(RouterCollector(router).collect())
    assert sample(found, "retouch_worker_steps_total", worker="w0") == 2
    assert sample(found, "retouch_worker_steps_total", worker="host-7.1") == 5
    assert not any(("worker", "w0.1") in labels for _, labels in found)
