"""The HTTP frontend: validates what users send, hands edits to the router, answers.

    POST   /v1/templates          register a template image (202; recording progress via GET)
    GET    /v1/templates[/{id}]   status and progress          DELETE /v1/templates/{id}
    POST   /v1/edits              template_id (or a one-off image) + mask + prompt -> PNG or b64_json
    GET    /v1/edits/{id}         an edit in flight (X-Request-Id): parked, queued, running step k of n
    DELETE /v1/edits/{id}         cancel it
    POST   /v1/images/edits       the OpenAI Images API's edit form (alpha 0 = repaint)
    GET    /metrics  /healthz  /readyz

Every bad input is answered at once with a 4xx and a JSON body naming the field, in the OpenAI
error shape: {"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}.
Accepted edits are answered exactly once (the router guarantees it across worker failures).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import math
import re
import time
import uuid
from dataclasses import dataclass

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from PIL import Image
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from retouch import prometheus
from retouch.engine.policies import RequestLoad
from retouch.engine.router import EditTask, QueueFull, Router, TemplateRecord, Unavailable
from retouch.errors import InputError
from retouch.canvas import Canvas
from retouch.images import ImageTooLarge, as_image, as_mask, decode_image, has_alpha, png_bytes
from retouch.masks import FLUX_STRIDE, token_mask

TOKEN_STRIDE = FLUX_STRIDE  # the policies' token grid: 16 px per token (Flux/SD3 latents, patchified)
# What one request may ask for, in pixel-steps (width x height x steps, times n images): a 4096x4096
# image at the default 28 steps.
DEFAULT_MAX_WORK = 4096 * 4096 * 28
DISCONNECT_POLL_S = 0.25  # how often a waiting edit checks whether its client is still there
REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class Limits:
    max_upload_bytes: int = 32 << 20
    max_pixels: int = 4096 * 4096
    max_steps: int = 200
    default_steps: int = 28
    max_n: int = 10
    max_work: int = DEFAULT_MAX_WORK
    request_timeout_s: float = 600.0
    api_key: str | None = None


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


class BodyLimit:
    """Refuse bodies over `max_bytes`: at once from Content-Length, else while they stream in."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = ApiError(413, f"request body over the limit of {self.max_bytes} bytes", "body",
                             "body_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await too_large.response()(scope, receive, send)
        received = 0

        async def limited():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise too_large
            return message

        return await self.app(scope, limited, send)


class CountAndAuthenticate:
    """Counts every answer by endpoint and status, and refuses /v1 requests without the API key.
    Plain ASGI rather than Starlette's BaseHTTPMiddleware, which hides a client's disconnect from the
    endpoint (an edit whose client went away must be cancelled)."""

    def __init__(self, app, metrics: Metrics, api_key: str | None):
        self.app, self.metrics, self.api_key = app, metrics, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self.api_key and path.startswith("/v1/"):
            authorization = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if authorization != f"Bearer {self.api_key}":
                self.metrics.requests.inc(_endpoint(path), "401")
                refused = ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", "authorization",
                                   "invalid_api_key")
                return await refused.response()(scope, receive, send)
        status = None

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except ApiError as exc:  # raised while the body streamed in (BodyLimit), before any answer
            if status is not None:
                raise
            await exc.response()(scope, receive, counted)
        finally:
            if status is not None:
                self.metrics.requests.inc(_endpoint(path), str(status))


class Metrics:
    def __init__(self):
        self.requests = prometheus.Counter("retouch_requests_total", "HTTP requests by endpoint and status",
                                           ("endpoint", "status"))
        self.latency = prometheus.Histogram("retouch_request_seconds", "end-to-end edit latency by outcome",
                                            ("endpoint", "outcome"))

    def render(self, snapshot: dict) -> str:
        workers = snapshot["workers"]
        decisions = sorted(snapshot["decision_s"])
        lines = [*self.requests.render(), *self.latency.render()]
        lines += prometheus.gauge("retouch_queue_depth", "edits accepted and not yet answered",
                                  [({}, snapshot["pending"])])
        lines += prometheus.gauge("retouch_parked_edits", "edits waiting for their template's recording",
                                  [({}, snapshot["parked"])])
        lines += prometheus.gauge("retouch_workers", "live workers", [({}, len(workers))])
        lines += prometheus.gauge("retouch_templates", "registered templates", [({}, snapshot["templates"])])
        for field, help_text in (("running", "requests in the worker's running batch"),
                                 ("queued", "requests queued at the worker"),
                                 ("mean_batch_size", "mean batch size over the worker's steps"),
                                 ("mean_step_s", "mean seconds per denoising step"),
                                 ("interruptions", "pre/post-processing tasks run mid-denoising"),
                                 ("cache_hits", "template activation cache hits"),
                                 ("cache_misses", "template activation cache misses"),
                                 ("cache_host_bytes", "bytes of activations in pinned host memory"),
                                 ("cache_disk_bytes", "bytes of activations on disk")):
            samples = [({"worker": name}, w[field]) for name, w in sorted(workers.items()) if field in w]
            lines += prometheus.gauge(f"retouch_worker_{field}", help_text, samples)
        lines += prometheus.gauge("retouch_router_events_total", "router events",
                                  [({"event": k}, v) for k, v in sorted(snapshot["counters"].items())], "counter")
        quantiles = [({"quantile": str(q)}, decisions[min(len(decisions) - 1, int(q * len(decisions)))])
                     for q in (0.5, 0.95, 0.99)] if decisions else []
        lines += prometheus.gauge("retouch_router_decision_seconds", "routing policy time per request "
                                  "(last 10000 decisions)", quantiles, "summary")
        return "\n".join(lines) + "\n"


# ---- parsing the form ----

class Form:
    """A multipart form's fields with typed, validated access; errors name the field."""

    def __init__(self, form):
        self.form = form

    def file(self, name: str, *aliases: str) -> bytes | None:
        for key in (name, *aliases):
            value = self.form.get(key)
            if value is not None:
                if not isinstance(value, UploadFile):
                    raise ApiError(400, f"{name} must be a file upload (multipart/form-data)", name)
                return value
        return None

    def text(self, name: str, default: str | None = None) -> str | None:
        value = self.form.get(name)
        if value is None:
            return default
        if isinstance(value, UploadFile):
            raise ApiError(400, f"{name} must be a text field, not a file", name)
        return value

    def integer(self, name: str, default: int | None, low: int, high: int) -> int | None:
        return self._parsed(name, int, "an integer", default, low, high)

    def number(self, name: str, low: float, high: float) -> float | None:
        return self._parsed(name, float, "a number", None, low, high)

    def _parsed(self, name: str, kind: type, noun: str, default, low, high):
        """The field as `kind` in [low, high]: 400 if it does not parse, 422 if it is out of range."""
        value = self.text(name)
        if value is None or value == "":
            return default
        try:
            number = kind(value)
        except ValueError:
            raise ApiError(400, f"{name} must be {noun}, got {value!r}", name) from None
        if not (math.isfinite(number) and low <= number <= high):
            raise ApiError(422, f"{name} must be in [{low}, {high}], got {value}", name)
        return number


@dataclass(frozen=True)
class Upload:
    image: Image.Image  # decoded, EXIF orientation applied
    data: bytes  # as the client sent it (a one-off image travels on to its worker as it came)


async def read_upload(upload: UploadFile, name: str, max_pixels: int) -> Upload:
    data = await upload.read()
    if not data:
        raise ApiError(400, f"{name} is empty", name)
    try:
        return Upload(await anyio.to_thread.run_sync(decode_image, data, name, max_pixels), data)
    except ImageTooLarge as exc:
        raise ApiError(413, str(exc), name, "image_too_large") from None
    except InputError as exc:
        raise ApiError(400, str(exc), name, "invalid_image") from None


def template_id_of(image: Image.Image, prompt: str, steps: int, seed: int, guidance: float | None) -> str:
    digest = hashlib.sha256(image.tobytes())
    digest.update(f"|{image.size}|{prompt}|{steps}|{seed}|{guidance}".encode())
    return "tpl-" + digest.hexdigest()[:24]


def one_off_id_of(image: Image.Image, steps: int, guidance: float | None) -> str:
    """A one-off image's template: its content and schedule, not the prompt, seed or mask of the
    request that first sent it."""
    digest = hashlib.sha256(image.tobytes())
    digest.update(f"|{image.size}|{steps}|{guidance}".encode())
    return "img-" + digest.hexdigest()[:24]


class ClientGone(Exception):
    """The client disconnected before its answer was ready; its edits were cancelled."""


def request_load(mask: Image.Image, steps: int, text_tokens: int = 0) -> RequestLoad:
    """What the policies weigh: the mask's tokens on the 16-px grid of its canvas."""
    canvas = Canvas.of(mask.size, TOKEN_STRIDE, TOKEN_STRIDE)
    grid = token_mask(canvas.mask(mask), TOKEN_STRIDE)
    return RequestLoad(image_tokens=grid.numel(), masked_tokens=int(grid.sum()), steps=steps, text_tokens=text_tokens)


# ---- the app ----

def create_app(router: Router, limits: Limits = Limits(), model: str = "") -> FastAPI:
    app = FastAPI(title="retouch", summary="mask-aware generative image editing", version="0.1")
    metrics = Metrics()
    app.state.router, app.state.limits, app.state.metrics = router, limits, metrics

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone):
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        return ApiError(422, first.get("msg", "invalid request"), ".".join(map(str, first.get("loc", [])[1:])) or None
                        ).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return ApiError(exc.status_code, str(exc.detail)).response()

    app.add_middleware(CountAndAuthenticate, metrics=metrics, api_key=limits.api_key)
    app.add_middleware(BodyLimit, max_bytes=limits.max_upload_bytes)

    async def read_form(request: Request) -> Form:
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise ApiError(415, "send multipart/form-data (files: image, mask; text fields)", "content-type")
        try:
            return Form(await request.form(max_files=8, max_fields=32, max_part_size=1 << 20))
        except ApiError:
            raise
        except ExceptionGroup as group:  # the body limit fired inside the parser's task group
            limit, _ = group.split(ApiError)
            if limit is not None:
                raise limit.exceptions[0] from None
            raise ApiError(400, f"malformed multipart body: {group.exceptions[0]}", "body") from None
        except Exception as exc:  # noqa: BLE001 - a malformed body is the client's error
            raise ApiError(400, f"malformed multipart body: {exc}", "body") from None

    def template_or_404(template_id: str) -> dict:
        record = router.template(template_id)
        if record is None:
            raise ApiError(404, f"unknown template_id {template_id!r}; register it with POST /v1/templates",
                           "template_id", "template_not_found")
        return record

    async def register(image: Image.Image, prompt: str, steps: int, seed: int, guidance: float | None) -> dict:
        image = as_image(image)
        template_id = template_id_of(image, prompt, steps, seed, guidance)
        png = await anyio.to_thread.run_sync(png_bytes, image)
        router.register_template(TemplateRecord(template_id, png, image.size, prompt, steps, seed, guidance,
                                                replicas=0))
        return router.template(template_id)

    # ---- templates ----

    @app.post("/v1/templates", status_code=202)
    async def create_template(request: Request):
        form = await read_form(request)
        upload = form.file("image")
        if upload is None:
            raise ApiError(400, "image is required (a file field)", "image")
        image = (await read_upload(upload, "image", limits.max_pixels)).image
        prompt = form.text("prompt", "")
        steps = form.integer("steps", limits.default_steps, 1, limits.max_steps)
        seed = form.integer("seed", 0, 0, 2**63 - 1)
        guidance = form.number("guidance", 0.0, 100.0)
        check_work(image.size, steps, 1, "image")
        record = await register(image, prompt, steps, seed, guidance)
        return JSONResponse(record, status_code=200 if record["status"] == "ready" else 202,
                            headers={"Location": f"/v1/templates/{record['id']}"})

    @app.get("/v1/templates")
    async def list_templates():
        return {"data": router.list_templates()}

    @app.get("/v1/templates/{template_id}")
    async def get_template(template_id: str, wait: float = 0.0):
        """`?wait=S` long-polls: answers once the template is no longer recording, or after S seconds."""
        record = template_or_404(template_id)
        if record["status"] == "recording" and wait > 0:
            await anyio.to_thread.run_sync(lambda: router.wait_until(
                lambda r: (r.template(template_id) or {}).get("status") != "recording", min(wait, 60.0)))
            record = template_or_404(template_id)
        return record

    @app.delete("/v1/templates/{template_id}")
    async def delete_template(template_id: str):
        if not router.drop_template(template_id):
            template_or_404(template_id)
        return {"id": template_id, "deleted": True}

    # ---- edits ----

    in_flight: dict[str, list[int]] = {}  # X-Request-Id -> router request ids of an edit being answered

    def check_work(size: tuple[int, int], steps: int, n: int, param: str) -> None:
        work = size[0] * size[1] * steps * n
        if work > limits.max_work:
            images = f" x {n} images" if n > 1 else ""
            raise ApiError(413, f"this request asks for {work} pixel-steps ({size[0]}x{size[1]} pixels x {steps} "
                           f"steps{images}), over the limit of {limits.max_work} (--max-work)", param, "too_much_work")

    async def edit_target(form: Form, steps: int | None, guidance: float | None, upload: Upload | None,
                          mask: Image.Image, n: int) -> tuple[str, TemplateRecord | None, int]:
        """What an edit repaints, checked before anything is created: (template id, the one-off
        image's record to create with the edit or None, steps)."""
        template_id = form.text("template_id")
        if template_id:
            template = template_or_404(template_id)
            check_mask_size(mask, (template["width"], template["height"]), "the template")
            if template["status"] == "failed":
                raise ApiError(422, f"template {template_id!r} failed to record: {template['error']}", "template_id")
            if steps is not None and steps != template["steps"]:
                raise ApiError(422, f"template {template_id!r} was recorded with {template['steps']} steps; "
                               f"edits of it run the same schedule (omit steps or send {template['steps']})", "steps")
            if guidance is not None and guidance != template["guidance"]:
                raise ApiError(422, f"template {template_id!r} was recorded with guidance {template['guidance']}",
                               "guidance")
            check_work(mask.size, template["steps"], n, "n" if n > 1 else "template_id")
            return template_id, None, template["steps"]
        if upload is None:
            raise ApiError(400, "send image (a file) or template_id", "image")
        check_mask_size(mask, upload.image.size, "the image")
        steps = steps or limits.default_steps
        check_work(upload.image.size, steps, n, "n" if n > 1 else "image")
        # A one-off image: its first edit records it as it runs, and later edits of the same image
        # (whatever their prompt, seed or mask) find that recording. It travels as the client sent it.
        image = as_image(upload.image)
        template_id = one_off_id_of(image, steps, guidance)
        if router.template(template_id) is not None:
            return template_id, None, steps
        return template_id, TemplateRecord(template_id, upload.data, image.size, "", steps, 0, guidance, replicas=1,
                                           one_off=True), steps

    async def edit(request: Request, endpoint: str, template_id: str, one_off: TemplateRecord | None,
                   steps: int, mask: Image.Image, prompt: str, seed: int, n: int = 1) -> list[bytes]:
        """Run `n` edits (seeds seed, seed+1, ...) of a validated request; PNG bytes each. A client
        that goes away cancels them: they leave their worker's batch at its next step."""
        if mask.getbbox() is None:  # nothing to repaint: the answer is the template itself
            record = one_off if one_off is not None else router.templates.get(template_id)
            if not record.one_off:
                return [record.image] * n
            # A one-off's image is the client's upload, in whatever format it came.
            png = await anyio.to_thread.run_sync(lambda: png_bytes(as_image(decode_image(record.image, "image"))))
            return [png] * n
        load = await anyio.to_thread.run_sync(request_load, mask, steps)
        tasks = [EditTask(template_id, mask.tobytes(), mask.size, prompt, seed + i, load) for i in range(n)]
        started = time.perf_counter()
        try:
            ids, futures = router.submit_many(tasks, one_off)
        except QueueFull as exc:
            raise ApiError(429, f"server busy: {exc}; retry later", None, "queue_full", {"Retry-After": "1"}) from None
        except Unavailable as exc:
            raise ApiError(503, str(exc), None, "unavailable", {"Retry-After": "5"}) from None
        except KeyError:
            raise ApiError(404, f"template {template_id!r} was deleted", "template_id", "template_not_found") from None
        key = request.state.request_id
        in_flight[key] = ids
        try:
            answers = await answers_or_cancel(request, ids, futures)
        except TimeoutError:
            metrics.latency.observe(time.perf_counter() - started, endpoint, "timeout")
            raise ApiError(504, f"the edit took longer than {limits.request_timeout_s:.0f} s", None,
                           "timeout") from None
        finally:
            in_flight.pop(key, None)
        failed = next((a for a in answers if a.status != 200), None)
        metrics.latency.observe(time.perf_counter() - started, endpoint, "ok" if failed is None else "error")
        if failed is not None:
            raise ApiError(failed.status, failed.message or "the edit failed", None,
                           "cancelled" if failed.error == "Cancelled" else failed.error)
        return [a.png for a in answers]

    async def answers_or_cancel(request: Request, ids: list[int], futures: list) -> list:
        """The router's answers; if the client disconnects or the timeout passes first, the edits are
        cancelled (ClientGone, TimeoutError)."""
        waiting = [asyncio.wrap_future(f) for f in futures]
        deadline = time.monotonic() + limits.request_timeout_s
        while True:
            _, pending = await asyncio.wait(waiting, timeout=DISCONNECT_POLL_S)
            if not pending:
                return [w.result() for w in waiting]
            gone = await request.is_disconnected()
            if gone or time.monotonic() > deadline:
                for request_id in ids:
                    router.cancel(request_id, "the client went away" if gone else "it timed out")
                if gone:
                    raise ClientGone()
                raise TimeoutError

    def client_request_id(request: Request) -> str:
        """The client's X-Request-Id (GET/DELETE /v1/edits/{id} while it runs), or a new one."""
        key = request.headers.get("x-request-id")
        if key is None:
            return f"edit-{uuid.uuid4().hex}"
        if not REQUEST_ID.fullmatch(key):
            raise ApiError(400, "X-Request-Id must be 1-64 letters, digits, '.', '_' or '-'", "x-request-id")
        if key in in_flight:
            raise ApiError(409, f"an edit with X-Request-Id {key!r} is already running", "x-request-id",
                           "duplicate_request_id")
        return key

    @app.post("/v1/edits")
    async def create_edit(request: Request):
        request.state.request_id = client_request_id(request)
        form = await read_form(request)
        prompt = (form.text("prompt") or "").strip()
        if not prompt:
            raise ApiError(400, "prompt is required: say what to paint into the masked region", "prompt")
        response_format = form.text("response_format", "png")
        if response_format not in ("png", "b64_json"):
            raise ApiError(400, f"response_format must be png or b64_json, got {response_format!r}",
                           "response_format")
        steps = form.integer("steps", None, 1, limits.max_steps)
        seed = form.integer("seed", 0, 0, 2**63 - 1)
        guidance = form.number("guidance", 0.0, 100.0)
        mask_upload = form.file("mask")
        if mask_upload is None:
            raise ApiError(400, "mask is required (a file field; white = repaint)", "mask")
        upload = form.file("image")
        image = None if upload is None else await read_upload(upload, "image", limits.max_pixels)
        mask = read_mask((await read_upload(mask_upload, "mask", limits.max_pixels)).image)
        template_id, one_off, steps = await edit_target(form, steps, guidance, image, mask, 1)
        [png] = await edit(request, "/v1/edits", template_id, one_off, steps, mask, prompt, seed)
        headers = {"X-Template-Id": template_id, "X-Request-Id": request.state.request_id}
        if response_format == "png":
            return Response(png, media_type="image/png", headers=headers)
        return JSONResponse({"created": int(time.time()), "template_id": template_id,
                             "data": [{"b64_json": base64.b64encode(png).decode()}]}, headers=headers)

    @app.post("/v1/images/edits")
    async def openai_edit(request: Request):
        """The OpenAI Images API edit: `image` (or `image[]`), optional `mask` whose alpha 0 marks
        the region to repaint (without one, the image's own alpha does), `prompt`, `n`, `size`,
        `response_format` (b64_json); retouch's extra `template_id` reuses a registered template."""
        request.state.request_id = client_request_id(request)
        form = await read_form(request)
        prompt = (form.text("prompt") or "").strip()
        if not prompt:
            raise ApiError(400, "prompt is required", "prompt")
        n = form.integer("n", 1, 1, limits.max_n)
        response_format = form.text("response_format", "b64_json")
        if response_format != "b64_json":
            raise ApiError(400, "response_format must be b64_json (this server does not host image URLs)",
                           "response_format")
        size = form.text("size")
        target = None if size in (None, "", "auto") else _parse_size(size, limits.max_pixels)
        seed = form.integer("seed", 0, 0, 2**63 - 1)
        upload = form.file("image", "image[]")
        image = None if upload is None else await read_upload(upload, "image", limits.max_pixels)
        mask_upload = form.file("mask")
        if mask_upload is not None:
            mask = read_mask((await read_upload(mask_upload, "mask", limits.max_pixels)).image, alpha=True)
        elif image is not None and has_alpha(image.image):
            mask = read_mask(image.image, alpha=True)
        else:
            raise ApiError(400, "send a mask, or an image with transparency (alpha 0 = repaint)", "mask")
        template_id, one_off, steps = await edit_target(form, None, None, image, mask, n)
        pngs = await edit(request, "/v1/images/edits", template_id, one_off, steps, mask, prompt, seed, n)
        if target is not None:
            pngs = await anyio.to_thread.run_sync(
                lambda: [png_bytes(Image.open(io.BytesIO(p)).resize(target, Image.Resampling.LANCZOS)) for p in pngs])
        return JSONResponse({"created": int(time.time()),
                             "data": [{"b64_json": base64.b64encode(p).decode()} for p in pngs]},
                            headers={"X-Request-Id": request.state.request_id})

    @app.get("/v1/edits/{request_id}")
    async def edit_status(request_id: str):
        """An edit in flight (by its X-Request-Id): per image, parked, queued at a worker, or running
        step k of n."""
        ids = in_flight.get(request_id)
        if ids is None:
            raise ApiError(404, f"no edit with X-Request-Id {request_id!r} is running (unknown, or answered)",
                           "request_id", "edit_not_found")
        images = [router.request_status(i) or {"status": "done"} for i in ids]
        return {"id": request_id, "images": images}

    @app.delete("/v1/edits/{request_id}")
    async def cancel_edit(request_id: str):
        """Cancel an edit in flight: it leaves its worker's batch at the next step; its POST is answered
        409 (code "cancelled")."""
        ids = in_flight.get(request_id)
        if ids is None:
            raise ApiError(404, f"no edit with X-Request-Id {request_id!r} is running (unknown, or answered)",
                           "request_id", "edit_not_found")
        cancelled = [router.cancel(i, "DELETE /v1/edits") for i in ids]
        return {"id": request_id, "cancelled": any(cancelled)}

    # ---- operations ----

    @app.get("/metrics")
    async def metrics_text():
        return PlainTextResponse(metrics.render(router.snapshot()), media_type="text/plain; version=0.0.4")

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():
        workers = len(router.snapshot()["workers"])
        if workers == 0:
            return JSONResponse({"status": "not ready", "workers": 0}, status_code=503, headers={"Retry-After": "1"})
        return {"status": "ready", "workers": workers, "model": model}

    return app


ENDPOINTS = ("/v1/templates", "/v1/edits", "/v1/images/edits", "/metrics", "/healthz", "/readyz")


def read_mask(upload: Image.Image, alpha: bool = False) -> Image.Image:
    """The uploaded mask as `retouch.images.as_mask` reads it; 400 naming the field if it cannot be."""
    try:
        return as_mask(upload, alpha=alpha)
    except InputError as exc:
        raise ApiError(400, str(exc), "mask", "invalid_mask") from None


def check_mask_size(mask: Image.Image, size: tuple[int, int], what: str) -> None:
    if mask.size != tuple(size):
        raise ApiError(422, f"mask is {mask.width}x{mask.height} but {what} is {size[0]}x{size[1]}; they must match",
                       "mask", "mask_size")


def _endpoint(path: str) -> str:
    """A label per route, not per URL: unknown paths must not grow the series."""
    for prefix in ("/v1/templates/", "/v1/edits/"):
        if path.startswith(prefix):
            return prefix + "{id}"
    return path if path in ENDPOINTS else "other"


def _parse_size(size: str, max_pixels: int) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in size.lower().split("x"))
    except ValueError:
        raise ApiError(400, f"size must be WIDTHxHEIGHT (e.g. 1024x1024), got {size!r}", "size") from None
    if width < 1 or height < 1 or width * height > max_pixels:
        raise ApiError(422, f"size {size} is outside 1..{max_pixels} pixels", "size")
    return width, height
