"""The HTTP frontend: validates what users send, hands edits to the router, answers.

    POST   /v1/templates          register a template image (202; recording progress via GET)
    GET    /v1/templates[/{id}]   status and progress          DELETE /v1/templates/{id}
    POST   /v1/edits              template_id (or a one-off image) + mask + prompt -> PNG or b64_json
    GET    /v1/edits/{id}         an edit in flight (X-Request-Id): parked, queued, running step k of n;
                                  an asynchronous or keyed one (below) also once it ended
    GET    /v1/edits/{id}/result  an asynchronous or keyed edit's answer: what its POST answered (or
                                  would have); ?wait=S waits up to S seconds for it
    GET    /v1/edits/{id}/events  the same as Server-Sent Events, step by step (`retouch.http_events`;
                                  POST /v1/edits with stream=true answers that way itself)
    GET    /v1/templates/{id}/events  a template's recording as events    GET /v1/templates/{id}/image
    DELETE /v1/edits/{id}         cancel it; forget a kept answer
    POST   /v1/images/edits       the OpenAI Images API's edit form (alpha 0 = repaint)
    GET    /v1/models[/{id}]  /v1/loras  /v1/limits  /metrics  /healthz  /readyz

Every bad input is answered at once with a 4xx and a JSON body naming the field, in the OpenAI
error shape: {"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}
(type rate_limit_error for a 429, server_error for a 5xx). Every answer carries an X-Request-Id.
Accepted edits are answered exactly once (the router guarantees it across worker failures).

LoRA: an edit may carry `lora`, adapters of the server's --lora-dir (`lora_field`): "NAME[:SCALE]",
comma-separated, or a JSON list of such strings or of {"name", "scale"} objects. A malformed one, or
any on a server without --lora-dir, is 400; a name the folder lacks is 404 (code lora_not_found);
both before anything is queued. A LoRA its worker then fails to load answers 422 (code lora_failed);
each of these names the param "lora". A streamed edit's `done` metrics say from which step it applied
(`lora_applied_step`).

Deadlines: an edit may carry `slo_ms` (milliseconds from its arrival; by default
`Limits.slo_ms_per_megapixel` x its megapixels, none when 0). The router orders and, when told to,
refuses by it (429 slo_unattainable: `engine.router.DeadlineUnattainable`).

Tenants: with API keys (`Limits.api_keys`), each key is a tenant (`tenant_of`). Templates and edits
in flight belong to the tenant that made them; another key sees them as unknown (404). Without keys
everything belongs to the tenant "".

Edits that outlive their request (`retouch.edit_jobs`): POST /v1/edits with `async=true` (or the
header `Prefer: respond-async`) answers 202 with the edit's status at once; the edit runs whether or not
its client stays. An edit sent with an `Idempotency-Key` header (either edit endpoint) also runs to the
end when its client goes away, and a retry with the same key and the same request gets that edit's
answer, waiting for it if it still runs (where the IETF draft answers 409), instead of a second
generation; the same key with another request is 422 (code idempotency_key_reused). Their answers are
kept `Limits.result_ttl_s`, in memory, and given `create_app(answers=)` on disk too (`retouch.kept_answers`),
so that a restarted server answers them; a stopping server then lets its asynchronous edits finish
within its drain (`stop_async`) rather than cancelling them at once.

Nothing heavy runs on the event loop: decoding, mask conversion, hashing and base64 run in worker
threads, and large JSON answers are streamed a chunk at a time (`b64_json_response`), so /healthz
and other requests are answered while hundreds of MB of images go out.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import contextlib
import difflib
import functools
import hashlib
import hmac
import io
import json
import logging
import math
import re
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from PIL import Image
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from python_multipart.multipart import parse_options_header
from starlette.formparsers import MultiPartException, MultiPartParser

from retouch import playground
from retouch.canvas import Canvas, paste_alpha, paste_unmasked
from retouch.engine.policies import RequestLoad
from retouch.engine.router import (NO_WORKER, DeadlineUnattainable, EditAnswer, EditTask, NoWorkerConnected, QueueFull,
                                   RegistryError, Router, TemplateLimit, TemplateRecord,
                                   TemplateStorageFull, Unavailable)
from retouch.config import CORS_ORIGIN, model_label
from retouch.edit_jobs import EditJobs, Job, KeyReused, Outcome, Reply, fingerprint, wait_events
from retouch.kept_answers import AnswerFolder
from retouch.webhooks import WebhookSender, allowed_origin
from retouch.errors import InputError
from retouch.http_connections import BodyBudget, ReserveBody
from retouch.http_events import HEADERS as EVENT_HEADERS
from retouch.http_events import KEEPALIVE, KEEPALIVE_S, EventRelay, NativeEvents, OpenAIEvents, sse, with_image
from retouch.images import (ImageTooLarge, alpha_of, as_image, as_mask, check_levels, colour_profile, decode_image,
                            orientation_hint, padded_size, png_bytes, size_words)
from retouch.limits import GUIDED_FAMILIES
from retouch.lora import MAX_PER_REQUEST, LoraChoice, LoraError, choice_header, parse_lora
from retouch.lora.files import list_loras, lora_path
from retouch.lora.spec import MAX_SCALE
from retouch.masks import FLUX_STRIDE, token_mask
from retouch.serve_metrics import ServeMetrics
from retouch.strength import check_strength

TOKEN_STRIDE = FLUX_STRIDE  # the policies' token grid: 16 px per token (Flux/SD3 latents, patchified)
# What one request may ask for, in pixel-steps (width x height x steps, times n images): a 4096x4096
# image at the default 28 steps.
DEFAULT_MAX_WORK = 4096 * 4096 * 28
DISCONNECT_POLL_S = 0.25  # how often a waiting edit checks whether its client is still there
# An edit's id is a URL path segment (/v1/edits/{id}): "." and ".." would be resolved away by clients.
REQUEST_ID = re.compile(r"(?!\.+$)[A-Za-z0-9._-]{1,64}")
IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e]{1,255}")  # visible ASCII: UUIDs, base64, hashes
SF_STRING_ESCAPE = re.compile(r'\\(["\\])')  # \" and \\ inside a quoted Idempotency-Key
MAX_RESULT_WAIT_S = 60.0  # ?wait=S of a long poll (an edit's result, a template): longer meets proxies' idle timeouts
access_log = logging.getLogger("retouch.access")
QUIET_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})  # asked every few seconds: not news
# PNG bytes base64-encoded per step of a streamed answer: a multiple of 3 (chunks concatenate), and
# ~1 ms of encoding, so no step holds the GIL long.
B64_CHUNK = 3 << 18
DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
MAX_ERROR_CHARS = 1000  # of an error body's message (and param)
MAX_SLO_MS = 3_600_000  # an hour: longer is no SLO

logger = logging.getLogger("retouch.http")


MAX_TEXT_FIELD_BYTES = 1 << 20  # a multipart text field is held in memory; files spool to disk


@dataclass(frozen=True)
class Limits:
    max_upload_bytes: int = 32 << 20
    max_pixels: int = 4096 * 4096
    max_steps: int = 200
    default_steps: int = 28
    max_n: int = 10
    max_work: int = DEFAULT_MAX_WORK
    request_timeout_s: float = 600.0
    max_prompt_chars: int = 4000  # longer prompts are refused (422) before any work
    api_keys: tuple[str, ...] = ()  # each key is a tenant; none: no authentication
    docs: bool = True  # /docs, /redoc, /openapi.json (behind the key when there are keys)
    playground: bool = True  # the page at / (`retouch.playground`)
    # Connections (`http_connections.guarded_protocol`): request headers must arrive within
    # header_timeout_s, the body within body_timeout_s after them; at most max_connections open.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 120.0
    max_connections: int = 1024
    max_inflight_bytes: int = 1 << 30  # request bodies being handled at once (503 beyond)
    slo_ms_per_megapixel: float = 0.0  # an edit without slo_ms gets this x its megapixels (0: no deadline)
    slo_ms_min: float = 1000.0  # ... and never less than this
    lora_dir: Path | None = None  # the workers' LoRA folder (--lora-dir): edits' names are checked in it; None: none
    model_names: tuple[str, ...] = ()  # what a request's `model` may say; none: the served model's name
    # Browser pages of these origins (scheme://host[:port], or "*") may call the API (CORS); none: same origin only
    cors_origins: tuple[str, ...] = ()
    # Answers of asynchronous edits and of edits sent with an Idempotency-Key (`retouch.edit_jobs`): kept
    # this long after they are made, and within this many bytes in all (the oldest go first)
    result_ttl_s: float = 3600.0
    max_result_bytes: int = 512 << 20
    # Webhooks of asynchronous edits (`retouch.webhooks`): URLs of these origins only, signed with this secret
    webhook_origins: tuple[str, ...] = ()
    webhook_secret: str | None = field(default=None, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        object.__setattr__(self, "model_names", tuple(self.model_names))
        object.__setattr__(self, "cors_origins", tuple(self.cors_origins))
        bad = [origin for origin in self.cors_origins if not CORS_ORIGIN.fullmatch(origin)]
        if bad:
            raise ValueError(f"CORS origins are scheme://host[:port] or *, got {bad[0]!r}")
        object.__setattr__(self, "webhook_origins", tuple(self.webhook_origins))
        bad = [origin for origin in self.webhook_origins if allowed_origin(origin) is None]
        if bad:
            raise ValueError(f"webhook origins are http(s)://host[:port], nothing after; got {bad[0]!r}")
        if self.webhook_origins and not self.webhook_secret:
            raise ValueError("webhook origins need a webhook secret: receivers verify each delivery's signature")
        if self.lora_dir is not None:
            object.__setattr__(self, "lora_dir", Path(self.lora_dir))
        if any(not isinstance(key, str) or not key.strip() or key != key.strip() for key in self.api_keys):
            raise ValueError("API keys must be non-empty strings without surrounding whitespace")
        for name in ("max_upload_bytes", "max_pixels", "max_steps", "default_steps", "max_n", "max_work",
                     "max_prompt_chars", "max_connections", "max_inflight_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout_s", "header_timeout_s", "body_timeout_s", "result_ttl_s", "max_result_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("slo_ms_per_megapixel", "slo_ms_min"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_inflight_bytes < self.max_upload_bytes:
            raise ValueError(f"max_inflight_bytes ({self.max_inflight_bytes}) must hold one upload "
                             f"(max_upload_bytes {self.max_upload_bytes})")


# Answers a client must not repeat as they are: sending the edit again would undo a cancel, run a
# duplicate, or miss the deadline again (or, for a timeout, run a stuck edit once more).
FINAL_CODES = frozenset({"cancelled", "duplicate_request_id", "slo_unattainable", "template_limit",
                         "template_storage_full", "timeout"})


# An error's code when nothing more precise names it, so that a client can always switch on the code.
STATUS_CODES = {400: "invalid_request", 404: "not_found", 409: "conflict", 413: "too_large",
                415: "unsupported_media_type", 422: "invalid_value", 500: "internal_error"}


class ApiError(Exception):
    """An answer with an error body. Its message and param are cut short (`MAX_ERROR_CHARS`): they quote what
    the client sent, which may be a megabyte of one field's value or name."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        message, param = _cut(message), None if param is None else _cut(param)
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        kind = ("server_error" if self.status >= 500 else "rate_limit_error" if self.status == 429
                else "invalid_request_error")
        code = self.code or STATUS_CODES.get(self.status, "server_error" if self.status >= 500 else "invalid_request")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": code}}

    def reply(self) -> Reply:
        headers = dict(self.headers or {})
        if self.code in FINAL_CODES:  # OpenAI's SDKs retry 409, 429 and 5xx unless told not to
            headers["x-should-retry"] = "false"
        return Reply(headers, self.body())

    def response(self) -> Response:
        return reply_response(self.reply(), self.status)


def _cut(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else f"{text[:MAX_ERROR_CHARS]}... [{len(text) - MAX_ERROR_CHARS} " \
                                                     "more characters cut]"


def parse_wait(text: str) -> float:
    """A long poll's `?wait=S`, as the form's numbers are checked: 400 for what is not a number, 422 for a
    number out of range (NaN and infinity among them)."""
    try:
        wait = float(text)
    except ValueError:
        raise ApiError(400, f"wait must be a number of seconds, got {text[:40]!r}", "wait") from None
    if not 0 <= wait <= MAX_RESULT_WAIT_S:
        raise ApiError(422, f"wait must be 0-{MAX_RESULT_WAIT_S:g} seconds, got {wait:g}", "wait")
    return wait


def reply_response(reply: Reply, status: int = 200) -> Response:
    """An answer kept as data (`retouch.edit_jobs.Reply`) as the response that gives it."""
    if reply.media_type is not None:
        return Response(reply.images[0], status_code=status, media_type=reply.media_type, headers=reply.headers)
    if status >= 400 or not reply.images:
        return JSONResponse(reply.body, status_code=status, headers=reply.headers)
    return b64_json_response(reply.body, list(reply.images), reply.headers)


# ---- middleware (plain ASGI rather than Starlette's BaseHTTPMiddleware, which hides a client's
# disconnect from the endpoint: an edit whose client went away must be cancelled) ----

class CountAnswers:
    """Outermost: counts every answer by endpoint and status, those of the middleware inside it
    included; answers an ApiError raised before any answer (BodyLimit while the body streams in), and
    a bug with a JSON 500. Every answer carries an X-Request-Id, errors included, so a client can quote
    one: an edit's own id (`client_request_id`), else the client's header when it is a valid id, else a
    new one."""

    def __init__(self, app, metrics: ServeMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = None
        started = time.perf_counter()

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", ()))
                if not any(name.lower() == b"x-request-id" for name, _ in headers):
                    message["headers"] = [*headers, (b"x-request-id", answer_request_id(scope).encode())]
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except ApiError as exc:
            if status is not None:
                raise
            await exc.response()(scope, receive, counted)
        except Exception:
            if status is not None:
                raise
            logger.exception("%s %s failed", scope["method"], scope["path"])
            await ApiError(500, "internal server error", None, "internal_error").response()(scope, receive, counted)
        finally:
            if status is not None:
                status = scope.get("state", {}).get("streamed_status", status)  # an event stream's end
                self.metrics.count(scope["path"], status)
                log_answer(scope, status, time.perf_counter() - started)


def log_answer(scope, status: int, seconds: float) -> None:
    """The access log: one line per answer (probes and scrapes only at debug level), with the request id
    to trace it by and, for an edit, its template and the workers that ran it."""
    state = scope.get("state", {})
    details = "".join(f" {name}={state[name]}" for name in ("template", "workers") if state.get(name))
    level = logging.DEBUG if scope["path"] in QUIET_PATHS else logging.INFO
    access_log.log(level, "%s %s %d %.3fs id=%s%s", scope["method"], scope["path"], status, seconds,
                   answer_request_id(scope), details)


def answer_request_id(scope) -> str:
    """The X-Request-Id an answer carries when its endpoint set none (see `CountAnswers`); made once, so
    the answer and its access-log line say the same."""
    state = scope.setdefault("state", {})
    if not state.get("request_id"):
        sent = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        state["request_id"] = sent if REQUEST_ID.fullmatch(sent) else f"req-{uuid.uuid4().hex}"
    return state["request_id"]


def tenant_of(api_key: str) -> str:
    """A tenant's stable id: not the key itself (ids end up in logs and template ids)."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


class Authenticate:
    """Refuses /v1 and the API docs without one of `api_keys` (`Authorization: Bearer KEY`, the
    scheme in any case), and names the request's tenant in `request.state.tenant` ("" without keys)."""

    def __init__(self, app, api_keys: tuple[str, ...]):
        self.app = app
        self.keys = [(key.encode(), tenant_of(key)) for key in api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        tenant = ""
        path = scope["path"]
        if self.keys and (path.startswith("/v1/") or path in DOCS_PATHS):
            sent = [value for name, value in scope["headers"] if name == b"authorization"]
            if len(sent) > 1:  # a proxy that checks one of them and this server would disagree on the tenant
                refused = ApiError(400, f"Authorization was sent {len(sent)} times; send it once", "authorization")
                return await refused.response()(scope, receive, send)
            tenant = self.tenant(sent[0] if sent else b"")
            if tenant is None:
                refused = ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", "authorization",
                                   "invalid_api_key")
                return await refused.response()(scope, receive, send)
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)

    def tenant(self, authorization: bytes) -> str | None:
        scheme, _, credentials = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        credentials = credentials.strip()
        match = None
        for key, tenant in self.keys:  # every key compared, in constant time each
            if hmac.compare_digest(key, credentials):
                match = tenant
        return match


class BodyLimit:
    """Refuse bodies over `max_bytes`: at once from Content-Length, else while they stream in. And bodies
    framed two ways (Transfer-Encoding and Content-Length; h11 refuses two Content-Lengths that differ): a
    proxy in front may read where such a body ends otherwise than this server, and pass a second request
    hidden in it (request smuggling; RFC 9112 6.3 lets a server refuse them)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = ApiError(413, f"request body over the limit of {self.max_bytes} bytes", "body",
                             "body_too_large")
        lengths = [value for name, value in scope["headers"] if name == b"content-length"]
        if len(lengths) > 1 or lengths and any(name == b"transfer-encoding" for name, _ in scope["headers"]):
            ambiguous = ApiError(400, "the body is framed both by Transfer-Encoding and Content-Length, or by "
                                 "Content-Length twice: send one", "content-length", "ambiguous_body")
            return await ambiguous.response()(scope, receive, send)
        length = lengths[0] if lengths else None
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


def server_busy() -> JSONResponse:
    return ApiError(503, "the server is handling as many request bodies as it holds at once; retry later",
                    "body", "server_busy", {"Retry-After": "1"}).response()


# ---- parsing the form ----

class UndecodableField(MultiPartException):
    def __init__(self, field: str, charset: str):
        super().__init__(f"{field} is not {charset} text (the body's charset: UTF-8 unless its Content-Type "
                         "names another)")
        self.field = field


class StrictMultiPartParser(MultiPartParser):
    """Starlette's multipart parser, except that a text field whose bytes are not in the body's charset
    (UTF-8 unless the Content-Type names another) is refused: starlette reads it as latin-1 instead, and a
    prompt sent in another encoding would run as mojibake, the client none the wiser; and a body that ends
    before its closing boundary is refused: starlette kept the fields it had and dropped the one cut off,
    so a truncated `steps=3` ran the default 28 steps."""

    ended = False

    def on_end(self) -> None:  # python-multipart calls it at the closing boundary only
        self.ended = True

    async def parse(self) -> FormData:
        form = await super().parse()
        if not self.ended:
            raise MultiPartException("the body ends before its closing boundary (--BOUNDARY--): it was cut off")
        return form

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is None:
            try:
                bytes(part.data).decode(self._charset)
            except UnicodeDecodeError:
                raise UndecodableField(part.field_name, self._charset) from None
        super().on_part_end()


async def parse_multipart(request: Request, **limits) -> FormData:
    """`request.form(**limits)` through `StrictMultiPartParser`; a charset Python does not know is refused
    (starlette would read the fields as latin-1)."""
    _, params = parse_options_header(request.headers.get("content-type", ""))
    charset = params.get(b"charset")
    if charset is not None:
        try:
            codecs.lookup(charset.decode("latin-1"))
        except LookupError:
            raise ApiError(400, f"unknown charset {charset.decode('latin-1')!r} in Content-Type; send UTF-8",
                           "content-type") from None
    async with contextlib.aclosing(request.stream()) as stream:
        return await StrictMultiPartParser(request.headers, stream, **limits).parse()


class Form:
    """A multipart form's fields with typed, validated access; errors name the field."""

    def __init__(self, form):
        self.form = form

    def once(self, name: str) -> None:
        """A field sent more than once is refused: which of its values was meant is not ours to guess."""
        if len(self.form.getlist(name)) > 1:
            raise ApiError(400, f"{name} was sent {len(self.form.getlist(name))} times; send it once"
                           + (" (several adapters go in one field: NAME,NAME)" if name == "lora" else ""), name)

    def only(self, endpoint: str, query: Collection[str] = ()) -> None:
        """Every field sent is one the endpoint reads (`FORM_FIELDS`, `REFUSED_FIELDS`), in the body: a
        misspelt one ("strenght"), or one put in the query string (`query`: its names), would otherwise be
        ignored and the edit run without it, which the client learns only from the picture."""
        fields = FORM_FIELDS[endpoint]
        for name in query:
            raise ApiError(400, f"{endpoint} reads its fields from the multipart body; {name!r} was sent in the "
                           "query string", name, "unknown_field")
        for name in self.form.keys():
            if name not in fields and name not in REFUSED_FIELDS[endpoint]:
                close = difflib.get_close_matches(name, fields, n=1)
                raise ApiError(400, f"{endpoint} has no field {name!r}"
                               + (f" (did you mean {close[0]!r}?)" if close else "")
                               + f"; its fields: {', '.join(sorted(fields))}", name, "unknown_field")

    def file(self, name: str, *aliases: str) -> bytes | None:
        for key in (name, *aliases):
            self.once(key)
            value = self.form.get(key)
            if value is not None:
                if not isinstance(value, UploadFile):
                    raise ApiError(400, f"{name} must be a file upload (multipart/form-data)", name)
                return value
        return None

    def files(self, name: str, *aliases: str) -> list:
        """Every upload under `name` and its aliases (a field may repeat)."""
        values = [value for key in (name, *aliases) for value in self.form.getlist(key)]
        if any(not isinstance(value, UploadFile) for value in values):
            raise ApiError(400, f"{name} must be a file upload (multipart/form-data)", name)
        return values

    def text(self, name: str, default: str | None = None) -> str | None:
        self.once(name)
        value = self.form.get(name)
        if value is None:
            return default
        if isinstance(value, UploadFile):
            raise ApiError(400, f"{name} must be a text field, not a file", name)
        return value

    def prompt(self, max_chars: int, required: str | None, name: str = "prompt") -> str:
        """The prompt (or the field `name`: negative_prompt), stripped; 400 with `required` as the message if
        it must be there and is not, 422 if it is over `max_chars` (a prompt that long only ends up copied into
        logs)."""
        prompt = (self.text(name) or "").strip()
        if not prompt and required:
            raise ApiError(400, required, name)
        if len(prompt) > max_chars:
            raise ApiError(422, f"{name} is {len(prompt)} characters, over the limit of {max_chars}", name,
                           "prompt_too_long")
        return prompt

    def boolean(self, name: str) -> bool:
        value = (self.text(name) or "false").strip().lower()
        if value not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            raise ApiError(400, f"{name} must be true or false, got {value!r}", name)
        return value in ("true", "1", "yes", "on")

    def integer(self, name: str, default: int | None, low: int, high: int) -> int | None:
        return self._parsed(name, int, "an integer", default, low, high)

    def number(self, name: str, low: float, high: float) -> float | None:
        return self._parsed(name, float, "a number", None, low, high)

    def parsed(self, name: str, kind: type, noun: str, default):
        """The field as `kind` (`default` when absent or empty); 400 if it does not parse."""
        value = self.text(name)
        if value is None or value == "":
            return default
        try:
            # Python's int("1_0"), int(" 7 ") and int("１") (a full-width digit) are no client's number
            if "_" in value or value != value.strip() or not value.isascii():
                raise ValueError(value)
            return kind(value)
        except ValueError:
            raise ApiError(400, f"{name} must be {noun}, got {value!r}", name) from None

    def _parsed(self, name: str, kind: type, noun: str, default, low, high):
        """The field as `kind` in [low, high]: 400 if it does not parse, 422 if it is out of range."""
        number = self.parsed(name, kind, noun, None)
        if number is None:
            return default
        value = self.text(name)
        if not (math.isfinite(number) and low <= number <= high):
            raise ApiError(422, f"{name} must be in [{low}, {high}], got {value}", name)
        return number


# The edit endpoints read their multipart forms themselves; these describe them in /openapi.json.
def _field(kind: str, description: str, **extra) -> dict:
    schema = {"type": "string", "format": "binary"} if kind == "file" else {"type": kind}
    return {**schema, "description": description, **extra}


LORA_FIELD = _field("string", "LoRA adapters of the server's --lora-dir: NAME[:SCALE] (scale 1 by default), "
                    "comma-separated, or a JSON list of names or of {\"name\", \"scale\"} objects; at most "
                    f"{MAX_PER_REQUEST}, scales in [-{MAX_SCALE:g}, {MAX_SCALE:g}]. 400 if malformed, 404 for a name "
                    "the folder lacks, 422 if the worker cannot load it", example="film-grain:0.8,watercolor")
OUTPUT_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}  # OpenAI's output_format -> Pillow's
EDIT_FIELDS = {
    "template_id": _field("string", "a registered template (POST /v1/templates); or send image"),
    "image": _field("file", "a one-off image to edit (its first edit without a LoRA records it)"),
    "mask": _field("file", "white = repaint; the size of the image or template"),
    "prompt": _field("string", "what to paint into the masked region"),
    "negative_prompt": _field("string", "what to steer the masked region away from (models with classifier-free "
                              "guidance: SD3, SDXL, SD2; 400 on Flux or at guidance <= 1)"),
    "steps": _field("integer", "denoising steps of a one-off image (a template's edits run its own)", minimum=1),
    "seed": _field("integer", "random seed of the initial noise, 0 to 2^63-1", default=0, minimum=0),
    "strength": _field("number", "how much of the masked region is re-noised, in (0, 1]: below 1 it keeps the "
                       "structure under the mask and runs only the last steps x strength of the schedule "
                       "(at least one: steps x strength >= 1)", default=1.0, exclusiveMinimum=0, maximum=1),
    "guidance": _field("number", "guidance scale of a one-off image; of a template's edit, another scale > 1 than its "
                       "recording's on the models with classifier-free guidance (SD3, SDXL, SD2)", minimum=0,
                       maximum=100),
    "response_format": _field("string", "the image itself (in its output_format), or JSON with its base64",
                              enum=["png", "b64_json"], default="png"),
    "output_format": _field("string", "encoding of the answer (jpeg: not for a transparent image)",
                            enum=list(OUTPUT_FORMATS), default="png"),
    "output_compression": _field("integer", "quality of jpeg and webp answers, 0-100 (100: webp lossless)",
                                 default=100, minimum=0, maximum=100),
    "stream": _field("boolean", "answer with Server-Sent Events: accepted, steps, then done with the image "
                     "and the edit's metrics", default=False),
    "preview_every": _field("integer", "with stream: a preview image every that many steps (as the stream's "
                            "step events count them: the sampler's denoiser calls)", default=0, minimum=0),
    "slo_ms": _field("integer", "answer within this many milliseconds of arrival (the router orders by it)",
                     minimum=1, maximum=MAX_SLO_MS),
    "lora": LORA_FIELD,
    "model": _field("string", "one of the served names (GET /v1/models; 404 otherwise); by default the served model"),
    "async": _field("boolean", "answer 202 with the edit's status at once; GET /v1/edits/{id}/result answers it "
                    "later (also: header Prefer: respond-async)", default=False),
    "webhook": _field("string", "with async=true: a URL (of the server's --webhook-origins) POSTed the edit's status "
                      "when it ends, signed as Standard Webhooks says"),
}

# A worker's error (its exception's class name) -> the code of the answer's error body.
WORKER_ERROR_CODES = {"Cancelled": "cancelled", LoraError.__name__: "lora_failed",
                      "MissingTemplate": "template_missing"}
LIST_LIMIT, LIST_MAX = 100, 1000  # templates per page of GET /v1/templates: by default, at most
OPENAI_EDIT_FIELDS = {
    "image": _field("file", "the image to edit (also as image[])"),
    "mask": _field("file", "alpha 0 = repaint (without a mask, the image's own alpha)"),
    "prompt": _field("string", "what to paint into the masked region"),
    "n": _field("integer", "images to make (seeds seed, seed+1, ...)", default=1, minimum=1),
    "size": _field("string", "WIDTHxHEIGHT of the answer, or auto"),
    "response_format": _field("string", "only b64_json", enum=["b64_json"], default="b64_json"),
    "output_format": _field("string", "encoding of the answers", enum=list(OUTPUT_FORMATS), default="png"),
    "output_compression": EDIT_FIELDS["output_compression"],
    "background": _field("string", "auto or opaque (retouch answers opaque images)", enum=["auto", "opaque"],
                         default="auto"),
    "stream": _field("boolean", "answer with the OpenAI edit stream's events: image_edit.partial_image, then "
                     "image_edit.completed (n=1)", default=False),
    "partial_images": _field("integer", "with stream: pictures of the edit under way sent before the image, 0-3",
                             default=0, minimum=0, maximum=3),
    "seed": EDIT_FIELDS["seed"],
    "strength": EDIT_FIELDS["strength"],
    "negative_prompt": EDIT_FIELDS["negative_prompt"],
    "guidance": EDIT_FIELDS["guidance"],
    "template_id": EDIT_FIELDS["template_id"],
    "slo_ms": EDIT_FIELDS["slo_ms"],
    "lora": LORA_FIELD,
    "model": EDIT_FIELDS["model"],
    "image[]": _field("file", "the image to edit, as OpenAI's SDKs name it"),
    # OpenAI's, describing the request: taken so that its clients' requests are answered, and ignored
    "quality": _field("string", "ignored (retouch's quality is the served model's)"),
    "input_fidelity": _field("string", "ignored (unmasked pixels are the image's own)"),
    "user": _field("string", "ignored (an end-user id)"),
    "safety_identifier": _field("string", "ignored (an end-user id)"),
}

TEMPLATE_FIELDS = {
    "image": _field("file", "the template image"),
    "prompt": _field("string", "what the image shows (its recorded run's prompt)", default=""),
    "negative_prompt": _field("string", "its recorded run's negative prompt (as on edits), which edits keep outside "
                              "their masks"),
    "steps": _field("integer", "denoising steps of the template's schedule (its edits run them)", minimum=1),
    "seed": _field("integer", "random seed of the template's noise, 0 to 2^63-1", default=0, minimum=0),
    "guidance": _field("number", "guidance scale", minimum=0, maximum=100),
}
# What each form endpoint reads (its /openapi.json fields), and the fields it reads only to refuse them saying
# why (a LoRA or a strength belongs to each edit; asynchronous edits are /v1/edits's). What OpenAI's other
# fields ask for (svg, frames, ...) retouch cannot make.
FORM_FIELDS = {"/v1/templates": frozenset(TEMPLATE_FIELDS), "/v1/edits": frozenset(EDIT_FIELDS),
               "/v1/images/edits": frozenset(OPENAI_EDIT_FIELDS)}
REFUSED_FIELDS = {"/v1/templates": frozenset({"lora", "strength"}), "/v1/edits": frozenset(),
                  "/v1/images/edits": frozenset({"async", "webhook"})}


def multipart_body(fields: dict[str, dict], required: tuple[str, ...], limits: Limits) -> dict:
    """An endpoint's multipart form as an OpenAPI request body (`openapi_extra`), with the maxima this
    server's limits set."""
    maxima = {"steps": limits.max_steps, "preview_every": limits.max_steps, "n": limits.max_n}
    fields = {name: field | ({"maximum": maxima[name]} if name in maxima else {}) for name, field in fields.items()}
    schema = {"type": "object", "properties": fields, "required": list(required)}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}}}


@dataclass(frozen=True)
class Upload:
    image: Image.Image  # decoded, EXIF orientation applied
    data: bytes  # as the client sent it (a one-off image travels on to its worker as it came)


async def read_upload(upload: UploadFile, name: str, max_pixels: int) -> Upload:
    data = await upload.read()
    if not data:
        raise ApiError(400, f"{name} is empty", name)

    def decoded() -> Image.Image:
        image = decode_image(data, name, max_pixels, TOKEN_STRIDE)
        if name == "image":  # its values, as every later reading takes them (masks have a reading of their own)
            check_levels(image, name)
        return image
    try:
        return Upload(await anyio.to_thread.run_sync(decoded), data)
    except ImageTooLarge as exc:
        raise ApiError(413, str(exc), name, "image_too_large") from None
    except InputError as exc:
        raise ApiError(400, str(exc), name, "invalid_image") from None


async def read_mask_upload(upload: UploadFile, max_pixels: int, alpha: bool = False) -> Image.Image:
    image = (await read_upload(upload, "mask", max_pixels)).image
    return await anyio.to_thread.run_sync(lambda: read_mask(image, alpha))


def lora_folder_missing() -> ApiError:
    """The LoRA folder went away after the server started: the operator's error, not the request's."""
    return ApiError(503, "the server's LoRA folder is missing (an operator's error, not the request's)", "lora",
                    "lora_folder_missing", {"Retry-After": "30"})


def lora_field(form: Form, lora_dir: Path | None) -> LoraChoice:
    """The edit's `lora` field: "NAME[:SCALE]", comma-separated, or a JSON list of names or of
    {"name", "scale"} objects (`retouch.lora.parse_lora`), each name a file of `lora_dir`. 400 if it is
    malformed or the server has no LoRA folder, 404 for a name the folder lacks; () without one."""
    text = (form.text("lora") or "").strip()
    if not text:
        return ()
    value = text
    if text[0] in "[{":
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ApiError(400, f"lora is not valid JSON: {exc}", "lora", "invalid_lora") from None
        except RecursionError:  # json's decoder recurses per level: "[[[[..." of a few thousand
            raise ApiError(400, "lora is JSON nested too deeply (a list of names or of {name, scale})", "lora",
                           "invalid_lora") from None
        value = [value] if isinstance(value, dict) else value
    try:
        choice = parse_lora(value)
    except LoraError as exc:
        raise ApiError(400, str(exc), "lora", "invalid_lora") from None
    if lora_dir is None:
        raise ApiError(400, "this server serves no LoRAs (start it with --lora-dir)", "lora", "lora_unsupported")
    if choice and not lora_dir.is_dir():
        raise lora_folder_missing()
    for use in choice:
        try:
            lora_path(lora_dir, use.name)
        except LoraError:  # its message names the server's folder, which clients must not learn
            raise ApiError(404, f"no LoRA {use.name!r} on this server (GET /v1/loras lists them)", "lora",
                           "lora_not_found") from None
    return choice


def template_id_of(image: Image.Image, prompt: str, steps: int, seed: int, guidance: float | None,
                   owner: str, alpha: Image.Image | None = None, negative_prompt: str | None = None) -> str:
    """A registered template's id: its content (transparency and colour profile included), recording parameters and
    tenant (two tenants registering the same image never share a record). Hashes the pixels: call it
    off the loop."""
    digest = hashlib.sha256(image.tobytes())
    digest.update(f"|{owner}|{image.size}|{prompt}|{steps}|{seed}|{guidance}".encode())
    if negative_prompt is not None:  # the ids of templates without one stay as earlier releases made them
        digest.update(f"|negative|{len(negative_prompt)}|{negative_prompt}".encode())
    _digest_extras(digest, image, alpha)
    return "tpl-" + digest.hexdigest()[:24]


def _digest_extras(digest, image: Image.Image, alpha: Image.Image | None) -> None:
    """What an answer carries besides the RGB pixels: the transparency and the colour profile (the same
    pixels in Display P3 and in sRGB are two pictures)."""
    if alpha is not None:
        digest.update(b"|alpha|" + alpha.tobytes())
    profile = colour_profile(image)
    if profile is not None:
        digest.update(b"|icc|" + profile)


def one_off_id_of(image: Image.Image, steps: int, guidance: float | None, owner: str,
                  alpha: Image.Image | None = None) -> str:
    """A one-off image's template: its content (transparency, colour profile), schedule and tenant, not the
    prompt, seed or mask of the request that first sent it. Hashes the pixels: call it off the loop."""
    digest = hashlib.sha256(image.tobytes())
    digest.update(f"|{owner}|{image.size}|{steps}|{guidance}".encode())
    _digest_extras(digest, image, alpha)
    return "img-" + digest.hexdigest()[:24]


class ClientGone(Exception):
    """The client disconnected before its answer was ready; its edits were cancelled."""


class ClosingStreamingResponse(StreamingResponse):
    """A stream that calls `on_close()` however it ends: Starlette cancels the stream of a client already
    gone before its generator starts, and then the generator's own `finally` never runs."""

    def __init__(self, content, on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


@dataclass
class EditClaim:
    """What an edit request holds once its id (and Idempotency-Key) are checked (`claimed`)."""
    replay: Job | None = None  # the edit its key made earlier: it is answered from that
    job: Job | None = None  # a keyed request's own job, held from its arrival on
    runs_async: bool = False
    webhook: str | None = None  # an asynchronous edit's (`retouch.webhooks`)


class EditFailed(Exception):
    """One of a request's edits was answered with an error; its siblings were cancelled."""

    def __init__(self, answer: EditAnswer):
        super().__init__(answer.message)
        self.answer = answer


def request_load(mask: Image.Image, steps: int, text_tokens: int = 0) -> RequestLoad:
    """What the policies weigh: the mask's tokens on the 16-px grid of its canvas."""
    canvas = Canvas.of(mask.size, TOKEN_STRIDE, TOKEN_STRIDE)
    grid = token_mask(canvas.mask(mask), TOKEN_STRIDE)
    return RequestLoad(image_tokens=grid.numel(), masked_tokens=int(grid.sum()), steps=steps, text_tokens=text_tokens)


def mask_payload(mask: Image.Image, steps: int) -> tuple[bytes, RequestLoad] | None:
    """What the router carries of a mask (raw "L" pixels and the policies' load); None when nothing
    is to be repainted. Runs in a worker thread: a 4096x4096 mask is 16 MB of pixels."""
    if mask.getbbox() is None:
        return None
    return mask.tobytes(), request_load(mask, steps)


def b64_json_response(envelope: dict, pngs: list[bytes], headers: dict) -> StreamingResponse:
    """`{**envelope, "data": [{"b64_json": ...}, ...]}` streamed: each chunk of base64 is encoded in a
    worker thread, and the loop only passes chunks on (n images at 4096x4096 come to hundreds of MB,
    which one json.dumps would build in one step). The length is known up front: Content-Length."""
    head = json.dumps(envelope)[:-1].encode() + (b', "data": [' if envelope else b'"data": [')
    opening, closing, tail = b'{"b64_json": "', b'"}', b"]}"
    length = len(head) + len(tail) + 2 * max(0, len(pngs) - 1)
    length += sum(len(opening) + 4 * math.ceil(len(png) / 3) + len(closing) for png in pngs)

    async def chunks() -> AsyncIterator[bytes]:
        yield head
        for index, png in enumerate(pngs):
            yield (b", " if index else b"") + opening
            view = memoryview(png)
            for start in range(0, len(png), B64_CHUNK):
                yield await anyio.to_thread.run_sync(base64.b64encode, view[start:start + B64_CHUNK])
            yield closing
        yield tail

    return StreamingResponse(chunks(), media_type="application/json",
                             headers={**headers, "Content-Length": str(length)})


def reencoded(png: bytes, size: tuple[int, int] | None, output_format: str, compression: int) -> bytes:
    """An answer's PNG resized to `size` (None: as it is) and encoded as `output_format`; `compression`
    is OpenAI's output_compression, the quality of JPEG and WebP (100: WebP lossless)."""
    if size is None and output_format == "png":
        return png
    image = Image.open(io.BytesIO(png))
    if size is not None:
        image = image.resize(size, Image.Resampling.LANCZOS)
    if output_format == "png":
        return png_bytes(image)
    out = io.BytesIO()
    lossless = output_format == "webp" and compression == 100
    options = {"lossless": True, "exact": True} if lossless else {"quality": compression}
    if output_format == "jpeg" and compression >= 90:  # 4:2:0 moved unmasked colour edges by tens of levels
        options["subsampling"] = 0
    profile = colour_profile(image)
    if profile is not None:
        options["icc_profile"] = profile
    keeps_alpha = output_format == "webp" and image.mode == "RGBA"  # a transparent template's answer
    image.convert("RGBA" if keeps_alpha else "RGB").save(out, format=OUTPUT_FORMATS[output_format], **options)
    return out.getvalue()


def output_encoding(form: Form) -> tuple[str, int]:
    """The answer's `output_format` (png, jpeg, webp) and `output_compression` (their quality, 0-100)."""
    output_format = form.text("output_format", "png")
    if output_format not in OUTPUT_FORMATS:
        raise ApiError(400, f"output_format must be one of {', '.join(OUTPUT_FORMATS)}, got {output_format!r}",
                       "output_format")
    return output_format, form.integer("output_compression", 100, 0, 100)


# ---- the app ----

def create_app(router: Router, limits: Limits = Limits(), model: str = "",
               answers: AnswerFolder | None = None) -> FastAPI:
    """The HTTP API over `router`. `answers`: where the kept answers are written too (`retouch.kept_answers`;
    the caller opens and closes it), and read back from now."""
    docs = {} if limits.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="retouch", summary="mask-aware generative image editing", version="0.1", **docs)
    metrics = ServeMetrics(router)
    router.on_decision = metrics.decisions.observe
    webhooks = None
    if limits.webhook_origins:
        webhooks = WebhookSender(limits.webhook_secret, limits.webhook_origins, per_tenant=bool(limits.api_keys))
        metrics.watch_webhooks(webhooks)
    jobs = EditJobs(limits.result_ttl_s, limits.max_result_bytes,
                    folder=answers, on_end=lambda job: send_webhook(job))
    metrics.watch_jobs(jobs)
    app.state.webhooks = webhooks
    app.state.router, app.state.limits, app.state.metrics, app.state.jobs = router, limits, metrics, jobs
    model_names = limits.model_names or (model_label(model) or "retouch",)

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
        route = f"{request.method} {request.url.path}"
        if exc.status_code == 404 and exc.detail == "Not Found":
            hint = ("; retouch edits images: POST /v1/images/edits or /v1/edits"
                    if request.url.path.startswith("/v1/images/")
                    else "; the endpoints are listed at /docs" if limits.docs else "")
            return ApiError(404, f"no endpoint {route}{hint}", None, "unknown_endpoint").response()
        if exc.status_code == 405:
            return ApiError(405, f"{route} is not allowed here", None, "method_not_allowed", exc.headers).response()
        return ApiError(exc.status_code, str(exc.detail)).response()

    # Added innermost first: CountAnswers sees every answer, Authenticate's 401 and BodyLimit's 413
    # included (and CORS headers on them, so a page can read its errors); a request is authenticated
    # before its body is reserved.
    app.add_middleware(ReserveBody, budget=BodyBudget(limits.max_inflight_bytes),
                       unknown_length_bytes=limits.max_upload_bytes, refusal=server_busy,
                       on_change=metrics.inflight_body_bytes.set)
    app.add_middleware(BodyLimit, max_bytes=limits.max_upload_bytes)
    app.add_middleware(Authenticate, api_keys=limits.api_keys)
    if limits.cors_origins:  # outside Authenticate: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(limits.cors_origins), allow_methods=["GET", "POST",
                           "DELETE"], allow_headers=["Authorization", "Content-Type", "X-Request-Id",
                           "Idempotency-Key", "Prefer"],
                           expose_headers=["X-Request-Id", "X-Template-Id", "X-Deadline-Met", "Retry-After", "Location",
                                           "Idempotent-Replayed", "Preference-Applied"], max_age=600)
    app.add_middleware(CountAnswers, metrics=metrics)

    async def read_form(request: Request) -> Form:
        media_type, _ = parse_options_header(request.headers.get("content-type", ""))
        if media_type != b"multipart/form-data":  # lower-cased by the parser: media types are case-insensitive
            raise ApiError(415, "send multipart/form-data (files: image, mask; text fields)", "content-type")
        try:
            return Form(await parse_multipart(request, max_files=8, max_fields=32,
                                              max_part_size=MAX_TEXT_FIELD_BYTES))
        except ApiError:
            raise
        except ExceptionGroup as group:  # the body limit fired inside the parser's task group
            limit, _ = group.split(ApiError)
            if limit is not None:
                raise limit.exceptions[0] from None
            raise unparsable(group.exceptions[0]) from None
        except Exception as exc:  # noqa: BLE001 - a malformed body is the client's error
            raise unparsable(exc) from None

    def unparsable(exc: BaseException) -> ApiError:
        if isinstance(exc, UndecodableField):
            return ApiError(400, exc.message, exc.field)
        detail = getattr(exc, "detail", None) or getattr(exc, "message", None) or str(exc)
        if isinstance(exc, (MultiPartException, StarletteHTTPException)) and "exceeded maximum size" in detail:
            # The parser does not say which field; the only long one a client writes is the prompt.
            return ApiError(413, f"a text field is over {MAX_TEXT_FIELD_BYTES >> 10} KiB; a prompt may have at "
                            f"most {limits.max_prompt_chars} characters", "body", "field_too_large")
        return ApiError(400, f"malformed multipart body: {detail}", "body")

    def template_or_404(template_id: str, tenant: str) -> dict:
        """The tenant's template; another tenant's is as unknown as one that never was."""
        record = router.template(template_id, tenant)
        if record is None:
            raise ApiError(404, f"unknown template_id {template_id!r}; register it with POST /v1/templates",
                           "template_id", "template_not_found")
        return record

    async def register(tenant: str, image: Image.Image, prompt: str, steps: int, seed: int,
                       guidance: float | None, negative_prompt: str | None = None) -> dict:
        def identify() -> tuple[str, bytes, tuple[int, int], bytes | None]:
            rgb, alpha = as_image(image), alpha_of(image)
            return (template_id_of(rgb, prompt, steps, seed, guidance, tenant, alpha, negative_prompt), png_bytes(rgb),
                    rgb.size, None if alpha is None else png_bytes(alpha))

        template_id, png, size, alpha = await anyio.to_thread.run_sync(identify)
        record = TemplateRecord(template_id, png, size, prompt, steps, seed, guidance, replicas=0, owner=tenant,
                                alpha=alpha, negative_prompt=negative_prompt)
        try:
            await anyio.to_thread.run_sync(router.register_template, record)  # it may save it to disk
        except RegistryError as exc:
            raise ApiError(507, str(exc), None, "storage_error") from None
        except TemplateLimit as exc:
            raise ApiError(409, str(exc), "image", "template_limit") from None
        except TemplateStorageFull as exc:
            raise ApiError(507, str(exc), "image", "template_storage_full") from None
        except QueueFull as exc:
            raise ApiError(429, f"server busy: {exc}; retry in {exc.retry_after_s} s", None, "queue_full",
                           {"Retry-After": str(exc.retry_after_s)}) from None
        return template_or_404(template_id, tenant)

    # ---- templates ----

    @app.post("/v1/templates", status_code=202, openapi_extra=multipart_body(TEMPLATE_FIELDS, ("image",), limits))
    async def create_template(request: Request):
        form = await read_form(request)
        form.only("/v1/templates", request.query_params.keys())
        if form.text("lora") is not None:  # a client may think the template carries the adapter
            raise ApiError(400, "templates are recorded without LoRA (the cache holds the base model's "
                           "activations); name the adapters on each edit", "lora", "lora_unsupported")
        if form.text("strength") is not None:
            raise ApiError(400, "templates are recorded at full strength (every step); send strength with each "
                           "edit", "strength")
        upload = form.file("image")
        if upload is None:
            raise ApiError(400, "image is required (a file field)", "image")
        prompt = form.prompt(limits.max_prompt_chars, required=None)
        steps = form.integer("steps", limits.default_steps, 1, limits.max_steps)
        seed = form.integer("seed", 0, 0, 2**63 - 1)
        guidance = form.number("guidance", 0.0, 100.0)
        negative_prompt = negative_prompt_of(form, guidance)
        image = (await read_upload(upload, "image", limits.max_pixels)).image
        check_work(image.size, steps, 1, "image")
        record = await register(request.state.tenant, image, prompt, steps, seed, guidance, negative_prompt)
        return JSONResponse(record, status_code=200 if record["status"] == "ready" else 202,
                            headers={"Location": f"/v1/templates/{record['id']}"})

    @app.get("/v1/templates")
    async def list_templates(request: Request, limit: int = LIST_LIMIT, after: str | None = None):
        """The tenant's templates, newest first, a page at a time (OpenAI's list shape): `limit` (1 to
        LIST_MAX) of them after the id `after`; `has_more` says whether a next page exists (ask for it
        with `after=last_id`)."""
        if not 1 <= limit <= LIST_MAX:
            raise ApiError(422, f"limit must be in [1, {LIST_MAX}], got {limit}", "limit")
        templates = router.list_templates(request.state.tenant)
        start = 0
        if after is not None:
            ids = [t["id"] for t in templates]
            if after not in ids:
                raise ApiError(400, f"after: no template {after!r} to list after (deleted, or not yours)", "after")
            start = ids.index(after) + 1
        page = templates[start:start + limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(templates)}

    @app.get("/v1/loras")
    async def list_served_loras():
        """The adapters an edit's `lora` may name (the files of the server's --lora-dir); none without one."""
        if limits.lora_dir is None:
            return {"data": []}
        try:
            names = await anyio.to_thread.run_sync(list_loras, limits.lora_dir)
        except LoraError:  # the folder went away after start
            raise lora_folder_missing() from None
        return {"data": [{"name": name} for name in names]}

    @app.get("/v1/webhooks/secret")
    async def webhook_secret(request: Request):
        """The secret this API key's webhooks are signed with (`retouch.webhooks`: each key has its own, so
        that no other tenant can make the server sign an event for this one's receiver)."""
        if webhooks is None:
            raise ApiError(404, "this server sends no webhooks (retouch serve --webhook-origins)", None, "not_found")
        if not webhooks.per_tenant:
            raise ApiError(404, "this server has no API keys: its webhooks are signed with the operator's secret "
                           "(--webhook-secret-file)", None, "not_found")
        return JSONResponse({"object": "webhook_secret", "secret": webhooks.secret_of(request.state.tenant)},
                            headers={"Cache-Control": "no-store"})

    @app.get("/v1/limits")
    async def list_limits():
        """What a request may ask for here (clients, the playground among them, size their forms by it):
        steps, pixels, upload bytes, work (pixel-steps), images per request, prompt characters, templates
        kept per API key, whether edits may name LoRAs, give a negative prompt (`negative_prompt_of`) and their own
        guidance scale (`edit_guidance`; neither on Flux), and how long an asynchronous edit's answer is kept."""
        return {"default_steps": limits.default_steps, "max_steps": limits.max_steps,
                "max_pixels": limits.max_pixels, "max_upload_bytes": limits.max_upload_bytes,
                "max_work": limits.max_work, "max_n": limits.max_n, "max_prompt_chars": limits.max_prompt_chars,
                "max_templates": router.config.max_templates_per_tenant, "lora": limits.lora_dir is not None,
                # whether edits may give a negative prompt, and a template's edit its own guidance scale
                "negative_prompt": router.config.family in (None, *GUIDED_FAMILIES),
                "edit_guidance": router.config.family in (None, *GUIDED_FAMILIES),
                "result_ttl_s": limits.result_ttl_s}

    def model_entry(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "retouch"}

    def check_model(name: str | None, param: str = "model") -> None:
        """404 for a model not served here; None (a request that names none) passes."""
        if name is not None and name not in model_names:
            raise ApiError(404, f"the model {name!r} is not served here; this server serves "
                           f"{', '.join(map(repr, model_names))} (GET /v1/models)", param, "model_not_found")

    @app.get("/v1/models")
    async def list_models():
        """OpenAI's model list (clients ask it first): the model this server serves, under each name a
        request's `model` may give (--served-model-name)."""
        return {"object": "list", "data": [model_entry(name) for name in model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        """OpenAI's model retrieval: the served model under `model_id`, else 404."""
        check_model(model_id, "model_id")
        return model_entry(model_id)

    template_relays: weakref.WeakSet[EventRelay] = weakref.WeakSet()

    def template_relay() -> EventRelay:
        """A relay of template events, ended when the server stops: a long-poll or a template's stream has
        no edit to drain for, and held the stopping server for its whole drain before it was cut."""
        relay = EventRelay()
        template_relays.add(relay)
        return relay

    def stop_template_watches() -> None:
        for relay in list(template_relays):
            relay.tell({"event": "stopping", "message": "the server is stopping"})

    app.state.stop_template_watches = stop_template_watches

    @app.get("/v1/templates/{template_id}")
    async def get_template(request: Request, template_id: str, wait: str = "0"):
        """`?wait=S` long-polls: answers once the template is no longer recording, or after S seconds."""
        wait = parse_wait(wait)
        tenant = request.state.tenant
        record = template_or_404(template_id, tenant)
        if record["status"] == "recording" and wait > 0:
            # Waited for on the event loop, not in a thread: each poll held one of the threads that decode
            # every upload, so forty polls stalled all edits.
            relay = template_relay()
            try:
                if relay.watch(router, "template", template_id):
                    deadline = time.monotonic() + wait
                    while (event := await relay.next(deadline - time.monotonic())) is not None:
                        if event.get("status") != "recording":  # ready, failed, deleted; or the server stops
                            break
            finally:
                relay.close()
            record = template_or_404(template_id, tenant)
        return record

    @app.get("/v1/templates/{template_id}/image")
    async def template_image(request: Request, template_id: str):
        """The template's image as PNG (what every edit of it keeps outside its mask), with its transparency."""
        template_or_404(template_id, request.state.tenant)
        size = record_of(template_id, None).size
        return Response(await with_template_alpha(template_id, None, Image.new("L", size, 0),
                                                  await unchanged(template_id, None)), media_type="image/png")

    @app.get("/v1/templates/{template_id}/events")
    async def template_events(request: Request, template_id: str):
        """The template's recording as events (`retouch.http_events`): `template` at each change,
        until it is ready, failed or deleted."""
        template_or_404(template_id, request.state.tenant)
        relay = template_relay()
        if not relay.watch(router, "template", template_id):
            template_or_404("", request.state.tenant)  # deleted meanwhile: 404

        async def events() -> AsyncIterator[bytes]:
            try:
                while True:
                    event = await relay.next(KEEPALIVE_S)
                    if event is None:
                        yield KEEPALIVE
                        continue
                    name = event.pop("event")
                    yield sse(name, event)
                    # "pending": a one-off image nobody records now (its next edit will)
                    if name in ("deleted", "stopping") or event.get("status") in ("ready", "failed", "pending"):
                        return
            finally:
                relay.close()

        return StreamingResponse(events(), media_type="text/event-stream", headers=EVENT_HEADERS)

    @app.delete("/v1/templates/{template_id}")
    async def delete_template(request: Request, template_id: str):
        try:
            dropped = await anyio.to_thread.run_sync(router.drop_template, template_id, request.state.tenant)
        except RegistryError as exc:
            raise ApiError(500, f"{exc}; it is still registered", None, "storage_error") from None
        if not dropped:
            template_or_404(template_id, request.state.tenant)
        return {"id": template_id, "deleted": True}

    # ---- edits ----

    # (tenant, X-Request-Id) -> router request ids of an edit being answered
    in_flight: dict[tuple[str, str], list[int]] = {}
    arriving: set[tuple[str, str]] = set()  # (tenant, X-Request-Id) of edits being checked (`claimed`)

    def check_work(size: tuple[int, int], steps: int, n: int, param: str) -> None:
        """`steps`: those the edit runs (fewer than its schedule's below strength 1); `size`: the image's,
        counted as the canvas it is edited on (sides padded to whole tokens)."""
        width, height = padded_size(size, TOKEN_STRIDE)
        work = width * height * steps * n
        if work > limits.max_work:
            images = f" x {n} images" if n > 1 else ""
            raise ApiError(413, f"this request asks for {work} pixel-steps ({size_words(size, TOKEN_STRIDE)} pixels x "
                           f"{steps} steps{images}), over the limit of {limits.max_work} (--max-work)", param,
                           "too_much_work")

    def negative_prompt_of(form: Form, guidance: float | None) -> str | None:
        """The request's `negative_prompt` (None when absent or blank), where the guidance it runs at (a
        template's, a one-off image's; None: the model's default) has an unconditional branch for it to steer:
        400 on a Flux model (guidance-distilled) or at guidance <= 1, as the workers' check
        (`MaskAwareEditor.check_negative_prompt`) would refuse it after queueing."""
        negative_prompt = form.prompt(limits.max_prompt_chars, None, "negative_prompt") or None
        if negative_prompt is None:
            return None
        family = router.config.family
        if family is not None and family not in GUIDED_FAMILIES:
            raise ApiError(400, "negative_prompt: the served model is a Flux model, guidance-distilled: it runs no "
                           "unconditional branch for a negative prompt to steer", "negative_prompt")
        if guidance is not None and guidance <= 1:
            raise ApiError(400, f"negative_prompt needs classifier-free guidance (guidance > 1); the guidance here "
                           f"is {guidance:g}", "negative_prompt")
        return negative_prompt

    def edit_negative_prompt(request: Request, form: Form, template_id: str, one_off: TemplateRecord | None) -> None:
        """An edit's `negative_prompt_of` (`request.state.negative_prompt`, which `accept` sends), at the scale it
        runs: its own (`edit_guidance`), else its template's or one-off image's."""
        own = getattr(request.state, "guidance", None)
        request.state.negative_prompt = negative_prompt_of(
            form, record_of(template_id, one_off).guidance if own is None else own)

    def edit_guidance(template_id: str, recorded: float | None, guidance: float | None) -> float | None:
        """A template's edit's own guidance scale (None: the recording's), or 422 naming `guidance` where the
        workers would refuse it (`MaskAwareEditor.check_edit_guidance`): classifier-free guidance mixes the
        denoiser's predictions after its blocks, so its scale may differ from the recording's where both run it
        (> 1; None: the model's default, which is); Flux takes guidance as an input of every block."""
        if guidance is None or guidance == recorded:
            return None
        family = router.config.family
        if family not in GUIDED_FAMILIES:
            why = (" (Flux models take guidance as an input of every block: its edits run its recording's)"
                   if family is not None else "")
            scale = "the model's default" if recorded is None else f"{recorded:g}"
            raise ApiError(422, f"template {template_id!r} was recorded with guidance {scale}{why}", "guidance")
        if recorded is not None and recorded <= 1:
            raise ApiError(422, f"template {template_id!r} was recorded without classifier-free guidance (guidance "
                           f"{recorded:g}), so its edits run without it", "guidance")
        if guidance <= 1:
            raise ApiError(422, f"the edits of template {template_id!r} run classifier-free guidance, as its "
                           f"recording: send a guidance > 1, got {guidance:g}", "guidance")
        return guidance

    def strength_of(form: Form) -> float:
        """The edit's `strength` field as a number (1 when absent; 400 if it is not one); `checked_strength`
        checks its range, (0, 1], and its steps (422)."""
        return form.parsed("strength", float, "a number", 1.0)

    def checked_strength(strength: float, steps: int) -> float:
        try:
            return check_strength(strength, steps)
        except InputError as exc:
            raise ApiError(422, str(exc), "strength") from None

    async def edit_target(request: Request, form: Form, steps: int | None, guidance: float | None,
                          upload: Upload | None, mask: Image.Image, n: int,
                          image_carries_mask: bool = False,
                          strength: float = 1.0) -> tuple[str, TemplateRecord | None, int]:
        """What an edit repaints, checked before anything is created: (template id, the one-off
        image's record to create with the edit or None, steps). An image sent with a template_id is
        refused, since which of the two to edit is not ours to guess; unless the endpoint reads the
        mask from it (`image_carries_mask`, OpenAI's form, whose clients must send an image). `strength`
        must leave at least one of the steps to run."""
        tenant = request.state.tenant
        template_id = form.text("template_id")
        if template_id:
            template = template_or_404(template_id, tenant)
            size = (template["width"], template["height"])
            if upload is not None and not image_carries_mask:
                raise ApiError(400, "send image (a one-off edit) or template_id (a registered template), not both",
                               "image")
            if upload is not None and upload.image.size != size:
                raise ApiError(422, f"image is {upload.image.width}x{upload.image.height} but template "
                               f"{template_id!r} is {size[0]}x{size[1]}; with a template_id the template is "
                               "edited, and the image serves only as the mask (its transparency)", "image",
                               "mask_size")
            check_mask_size(mask, size, "the template")
            if template["status"] == "failed":
                raise ApiError(422, f"template {template_id!r} failed to record: {template['error']}", "template_id")
            if steps is not None and steps != template["steps"]:
                raise ApiError(422, f"template {template_id!r} was recorded with {template['steps']} steps; "
                               f"edits of it run the same schedule (omit steps or send {template['steps']})", "steps")
            request.state.guidance = edit_guidance(template_id, template["guidance"], guidance)
            checked_strength(strength, template["steps"])
            check_work(mask.size, router.steps_run(template["steps"], strength), n, "n" if n > 1 else "template_id")
            return template_id, None, template["steps"]
        if upload is None:
            raise ApiError(400, "send image (a file) or template_id", "image")
        check_mask_size(mask, upload.image.size, "the image")
        steps = steps or limits.default_steps
        checked_strength(strength, steps)
        check_work(upload.image.size, router.steps_run(steps, strength), n, "n" if n > 1 else "image")
        # A one-off image: its first edit records it as it runs, and later edits of the same image
        # (whatever their prompt, seed or mask) find that recording. It travels as the client sent it.
        alpha = await anyio.to_thread.run_sync(alpha_of, upload.image)
        template_id = await anyio.to_thread.run_sync(
            lambda: one_off_id_of(as_image(upload.image), steps, guidance, tenant, alpha))
        if router.template(template_id, tenant) is not None:
            return template_id, None, steps
        return template_id, TemplateRecord(template_id, upload.data, upload.image.size, "", steps, 0, guidance,
                                           replicas=1, one_off=True, owner=tenant,
                                           alpha=None if alpha is None else png_bytes(alpha)), steps

    async def with_template_alpha(template_id: str, one_off: TemplateRecord | None, mask: Image.Image,
                                  png: bytes) -> bytes:
        """A native answer of a transparent template: its alpha back outside the mask (`paste_alpha`)."""
        record = one_off if one_off is not None else router.templates.get(template_id)
        if record is None or record.alpha is None:
            return png

        def attach() -> bytes:
            alpha = Image.open(io.BytesIO(record.alpha))
            return png_bytes(paste_alpha(Image.open(io.BytesIO(png)), alpha.convert("L"), mask))
        return await anyio.to_thread.run_sync(attach)

    async def native_answer(template_id: str, one_off: TemplateRecord | None, mask: Image.Image, png: bytes,
                            encoding: tuple[str, int]) -> bytes:
        """A /v1/edits answer: the worker's PNG with the template's alpha back, in the asked encoding."""
        png = await with_template_alpha(template_id, one_off, mask, png)
        return await anyio.to_thread.run_sync(reencoded, png, None, *encoding)

    def record_of(template_id: str, one_off: TemplateRecord | None) -> TemplateRecord:
        """The edit's template (the one-off record it brings, or the registered one), or 404 when a DELETE
        took it since the edit was checked."""
        record = one_off if one_off is not None else router.templates.get(template_id)
        if record is None:
            raise ApiError(404, f"template {template_id!r} was deleted", "template_id", "template_not_found")
        return record

    async def unchanged(template_id: str, one_off: TemplateRecord | None) -> bytes:
        """The answer to a mask that repaints nothing: the template itself, as PNG."""
        record = record_of(template_id, one_off)
        if not record.one_off:
            return record.image
        # A one-off's image is the client's upload, in whatever format it came.
        return await anyio.to_thread.run_sync(lambda: png_bytes(as_image(decode_image(record.image, "image"))))

    def slo_deadline(request: Request, form: Form, size: tuple[int, int]) -> None:
        """The edit's deadline on the router's clock (`request.state.deadline`, None: no SLO): its
        arrival plus `slo_ms`, or plus the server's default for its size (`request.state.default_slo`)."""
        slo_ms = form.integer("slo_ms", None, 1, MAX_SLO_MS)
        request.state.default_slo = slo_ms is None and limits.slo_ms_per_megapixel > 0
        if request.state.default_slo:
            slo_ms = max(1.0, limits.slo_ms_min, limits.slo_ms_per_megapixel * size[0] * size[1] / 1e6)
        request.state.deadline = None if slo_ms is None else request.state.arrived + slo_ms / 1000

    def accept(request: Request, template_id: str, one_off: TemplateRecord | None, mask: Image.Image,
               payload: tuple[bytes, RequestLoad], prompt: str, seed: int, n: int = 1, preview_every: int = 0,
               on_event=None, lora: LoraChoice = (), strength: float = 1.0) -> tuple[list[int], list]:
        """`n` edits (seeds seed, seed+1, ...) to the router, all or none; they are in flight under
        the request's X-Request-Id until the caller pops them. (ids, futures)."""
        mask_bytes, load = payload
        load = replace(load, deadline=getattr(request.state, "deadline", None))
        trace = request.state.request_id
        negative_prompt = getattr(request.state, "negative_prompt", None)  # `negative_prompt_of`
        guidance = getattr(request.state, "guidance", None)  # `edit_guidance`
        tasks = [EditTask(template_id, mask_bytes, mask.size, prompt, seed + i, load, preview_every, lora,
                          trace=trace if n == 1 else f"{trace}#{i}", strength=strength,
                          negative_prompt=negative_prompt, guidance=guidance) for i in range(n)]
        request.state.template = template_id
        try:
            ids, futures = router.submit_many(tasks, one_off, on_event)
        except QueueFull as exc:
            raise ApiError(429, f"server busy: {exc}; retry in {exc.retry_after_s} s", None, "queue_full",
                           {"Retry-After": str(exc.retry_after_s)}) from None
        except DeadlineUnattainable as exc:
            whose = ("the server's default deadline for its size (--slo-ms-per-megapixel; slo_ms sets another)"
                     if getattr(request.state, "default_slo", False) else "its deadline")
            raise ApiError(429, f"the edit cannot meet {whose}: {exc}", "slo_ms", "slo_unattainable") from None
        except Unavailable as exc:
            code = NO_WORKER if isinstance(exc, NoWorkerConnected) else "unavailable"
            raise ApiError(503, str(exc), None, code, {"Retry-After": "5"}) from None
        except KeyError:
            raise ApiError(404, f"template {template_id!r} was deleted", "template_id", "template_not_found") from None
        in_flight[(request.state.tenant, request.state.request_id)] = ids
        return ids, futures

    async def submit_edit(request: Request, endpoint: str, template_id: str, one_off: TemplateRecord | None,
                          steps: int, mask: Image.Image, prompt: str, seed: int, n: int = 1, lora: LoraChoice = (),
                          strength: float = 1.0):
        """Send `n` edits (seeds seed, seed+1, ...) of a validated request to the router, all or none
        (refusals are raised here: 429, 503, ...); returns `answers(watch_client)`, which waits for them:
        PNG bytes each. A client that goes away cancels them (unless not `watch_client`: a job's edit goes
        on): they leave their worker's batch at its next step."""
        # The router's costs count denoiser calls, as its workers' heartbeats do (Heun: 2 x steps - 1).
        payload = await anyio.to_thread.run_sync(mask_payload, mask, router.denoiser_calls(steps, strength=strength))
        if payload is None:  # nothing to repaint: the answer is the template itself
            png = await unchanged(template_id, one_off)

            async def unchanged_answers(watch_client: bool) -> list[bytes]:
                return [png] * n
            return unchanged_answers
        started = time.perf_counter()
        ids, futures = accept(request, template_id, one_off, mask, payload, prompt, seed, n, lora=lora,
                              strength=strength)
        key = (request.state.tenant, request.state.request_id)

        async def answers(watch_client: bool) -> list[bytes]:
            outcome = "error"
            try:
                answered = await answers_or_cancel(request if watch_client else None, ids, futures)
                request.state.workers = ",".join(sorted({a.worker for a in answered if a.worker}))
                outcome = "ok"
            except TimeoutError:
                outcome = "timeout"
                raise ApiError(504, f"the edit took longer than {limits.request_timeout_s:.0f} s", None,
                               "timeout") from None
            except ClientGone:
                outcome = "client_gone"
                raise
            except EditFailed as failure:
                request.state.workers = failure.answer.worker
                raise answer_error(failure.answer) from None
            finally:
                in_flight.pop(key, None)
                metrics.latency.labels(endpoint, outcome).observe(time.perf_counter() - started)
            met = [answer.metrics.get("deadline_met") for answer in answered]
            if any(value is not None for value in met):  # each image's, in order (X-Deadline-Met)
                request.state.deadline_met = ",".join("true" if value else "false" for value in met)
            return [a.png for a in answered]
        return answers

    def answer_headers(request: Request, template_id: str) -> dict[str, str]:
        """An edit's answer headers: its template, its id, and for an edit with a deadline whether each
        image met it (the streamed `done` event's metrics say it too)."""
        headers = {"X-Template-Id": template_id, "X-Request-Id": request.state.request_id}
        met = getattr(request.state, "deadline_met", None)
        if met is not None:
            headers["X-Deadline-Met"] = met
        return headers

    async def answers_or_cancel(request: Request | None, ids: list[int], futures: list) -> list[EditAnswer]:
        """The router's answers, in order. The first that is not a success cancels the others at once
        (EditFailed: their images would be thrown away); so do a client that disconnects (ClientGone;
        None: nobody watches) and the timeout (TimeoutError), and the task's cancellation."""
        waiting = {asyncio.wrap_future(f): index for index, f in enumerate(futures)}
        answers: list[EditAnswer | None] = [None] * len(futures)
        remaining = set(waiting)
        deadline = time.monotonic() + limits.request_timeout_s
        try:
            while remaining:
                done, remaining = await asyncio.wait(remaining, timeout=DISCONNECT_POLL_S,
                                                     return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    answer = answers[waiting[future]] = future.result()
                    if answer.status != 200:
                        cancel(ids, "another image of the same request failed")
                        raise EditFailed(answer)
                if not remaining:
                    break
                gone = request is not None and await request.is_disconnected()
                if gone or time.monotonic() > deadline:
                    cancel(ids, "the client went away" if gone else "it timed out")
                    if gone:
                        raise ClientGone()
                    raise TimeoutError
        except asyncio.CancelledError:  # the server stops (or a job is dropped): nobody will read them
            cancel(ids, "the server is stopping")
            raise
        return answers

    def cancel(ids: list[int], why: str) -> None:
        for request_id in ids:
            router.cancel(request_id, why)

    def client_request_id(request: Request) -> str:
        """The client's X-Request-Id (GET/DELETE /v1/edits/{id} while it runs), or a new one."""
        key = request.headers.get("x-request-id")
        if key is None:
            return f"edit-{uuid.uuid4().hex}"
        if not REQUEST_ID.fullmatch(key):
            raise ApiError(400, "X-Request-Id must be 1-64 letters, digits, '.', '_' or '-', not dots alone",
                           "x-request-id")
        return key

    def check_new_request_id(request: Request) -> None:
        """An edit's id names one edit from its arrival (`claimed` holds it meanwhile), while it runs, and
        while its answer is kept."""
        key = (request.state.tenant, request.state.request_id)
        kept = jobs.find(*key)
        if key in in_flight or key in arriving or kept is not None:
            where = "; its answer is kept: GET /v1/edits/{id}/result" if kept is not None else ""
            raise ApiError(409, f"an edit with X-Request-Id {key[1]!r} is already running or answered{where}",
                           "x-request-id", "duplicate_request_id")

    # ---- edits that outlive their request (`retouch.edit_jobs`) ----

    def idempotency_key(request: Request) -> str | None:
        if len(request.headers.getlist("idempotency-key")) > 1:
            raise ApiError(400, "Idempotency-Key was sent more than once; send it once", "idempotency-key")
        key = request.headers.get("idempotency-key")
        if key is not None and len(key) > 2 and key[0] == key[-1] == '"':  # the draft's sf-string form
            key = SF_STRING_ESCAPE.sub(r"\1", key[1:-1])
        if key is not None and not IDEMPOTENCY_KEY.fullmatch(key):
            raise ApiError(400, "Idempotency-Key must be 1-255 visible ASCII characters", "idempotency-key")
        return key

    def prefers_async(request: Request) -> bool:
        """RFC 7240's `Prefer: respond-async` (a preference: a streamed edit ignores it)."""
        preferences = {part.split(";")[0].strip().lower() for part in request.headers.get("prefer", "").split(",")}
        return "respond-async" in preferences

    def runs_async(request: Request, form: Form) -> bool:
        """`async`, when sent, decides; else a Prefer header does, for an edit not streamed."""
        if form.text("async") is not None:
            return form.boolean("async")
        return prefers_async(request) and not form.boolean("stream")

    @contextlib.asynccontextmanager
    async def claimed(request: Request, endpoint: str, form: Form, key: str | None,
                      run_async: bool) -> AsyncIterator[EditClaim]:
        """An edit's id (and key) held from its arrival, before any await lets another request in: a retry
        with the key finds the edit the key made (`EditClaim.replay`), and one that comes while the first is
        still being checked waits for it. A keyed request's own job is held at once (`EditClaim.job`); one
        refused before it ran gives its id and key back, and whoever waited for it gets the refusal."""
        tenant, request_id = request.state.tenant, request.state.request_id
        digest = None
        if key is not None:
            fields = [(name, value.file if isinstance(value, UploadFile) else value)
                      for name, value in form.form.multi_items()]
            digest = await anyio.to_thread.run_sync(fingerprint, endpoint, fields, run_async)
            try:
                replay = jobs.keyed(tenant, key, digest)
            except KeyReused as exc:
                raise ApiError(422, str(exc), "idempotency-key", "idempotency_key_reused") from None
            if replay is not None:  # the answers of this request carry the edit's own id
                request.state.request_id, request.state.template = replay.id, replay.template_id
                yield EditClaim(replay=replay)
                return
            # The edit this key made gave the key back (a 5xx, a cancel) but is kept under its id: its retry,
            # resending that id, runs again as the key promises.
            released = jobs.find(tenant, request_id)
            if released is not None and (released.key, released.fingerprint) == (key, digest):
                jobs.forget(released)
        check_new_request_id(request)
        claim = EditClaim(runs_async=run_async)
        if key is not None:
            claim.job = jobs.add(Job(request_id, tenant, key=key, fingerprint=digest, runs_async=run_async))
        arriving.add((tenant, request_id))
        try:
            yield claim
        except BaseException as exc:
            if claim.job is not None and not claim.job.admitted.is_set():
                jobs.abandon(claim.job, failure_outcome(exc, claim.job.id))
            raise
        finally:
            arriving.discard((tenant, request_id))

    def failure_outcome(exc: BaseException, job_id: str) -> Outcome:
        """A failure as a job's outcome, as plain data: never the raised exception, whose traceback holds
        the request's frames (its images) for as long as the answer is kept. It names the job's id, as its
        other answers do (a fetch of it is another request, with an id of its own)."""
        if isinstance(exc, asyncio.CancelledError):  # the server stopped while it was being checked
            exc = ApiError(503, "the server stopped before this edit was done; send it again", None, "interrupted",
                           {"Retry-After": "5"})
        elif not isinstance(exc, ApiError):
            exc = ApiError(500, "internal server error", None, "internal_error")
        reply = exc.reply()
        return Outcome("cancelled" if exc.code == "cancelled" else "failed", exc.status,
                       replace(reply, headers={**reply.headers, "X-Request-Id": job_id}))

    def start_job(request: Request, claim: EditClaim, template_id: str, answer) -> Job:
        """Run `answer(watch_client=False)` (-> the POST's answer, `Reply`) as the claim's job
        (a keyed request's), or a new one."""
        job = claim.job or jobs.add(Job(request.state.request_id, request.state.tenant, runs_async=claim.runs_async))
        job.template_id, job.webhook = template_id, claim.webhook

        async def produce() -> Outcome:
            try:
                reply = await answer(False)
            except Exception as exc:  # noqa: BLE001 - every failure is this edit's answer, kept like any other
                if not isinstance(exc, ApiError):
                    logger.exception("edit %s failed", job.id)
                if job.interrupted and not job.deleted and isinstance(exc, ApiError) and exc.code == "cancelled":
                    return failure_outcome(asyncio.CancelledError(), job.id)  # the server's stop, not the client's
                return failure_outcome(exc, job.id)
            return Outcome("completed", 200, reply)

        cancelled = failure_outcome(ApiError(409, "the edit was cancelled (DELETE /v1/edits/{id})", None, "cancelled"),
                                    job.id)
        stopped = failure_outcome(asyncio.CancelledError(), job.id)
        # a task is cancelled by a DELETE, or else by the server's stop (its loop ends with the task running)
        return jobs.run(job, produce(), lambda: cancelled if job.deleted else stopped)

    def job_view(job: Job, status_code: int = 200, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(job_fields(job), status_code=status_code, headers=headers)

    def job_fields(job: Job) -> dict:
        """A job's status: in_progress (with its images' progress), completed, failed (with the error) or
        cancelled; `result_url` answers what its POST would have."""
        view = {"id": job.id, "object": "edit", "status": job.status, "created": int(job.created),
                "template_id": job.template_id, "result_url": f"/v1/edits/{job.id}/result"}
        if job.outcome is None:
            view["images"] = image_statuses(in_flight.get((job.tenant, job.id), []))
        else:
            if job.outcome.error is not None:
                view["error"] = job.outcome.error.get("error", job.outcome.error)
            view["ended_at"] = int(job.ended_at)
            view["expires_in_s"] = round(jobs.expires_in_s(job), 1)
        return view

    def send_webhook(job: Job) -> bool:
        """An ended job's webhook, if it has one (`retouch.webhooks`); how its delivery ends is kept with the
        job. Whether one was sent (not: none, delivered before, the sender closed, or its origin no longer
        allowed after a restart, which ends it `refused`)."""
        if job.webhook is None or job.webhook_state is not None or webhooks is None:
            return False
        payload = {"type": f"edit.{job.status}", "data": job_fields(job),
                   "timestamp": datetime.fromtimestamp(job.ended_at, timezone.utc).isoformat()}
        return webhooks.send(job.tenant, webhook_id(job), job.webhook, payload,
                             lambda state: jobs.webhook_done(job, state), label=job.id)

    def webhook_id(job: Job) -> str:
        """Its deliveries' `webhook-id`: one per edit, whoever made it (ids are per tenant), however often sent."""
        return "msg_" + hashlib.sha256(f"{job.tenant}\0{job.id}\0{job.created!r}".encode()).hexdigest()[:32]

    def resume_webhooks() -> int:
        """The server runs (its event loop): send the webhooks a stopped one left undelivered. How many."""
        unsent = jobs.unsent_webhooks()
        if unsent and webhooks is None:
            logger.warning("%d webhooks left undelivered are held: this server sends none (--webhook-origins)",
                           len(unsent))
        sent = 0
        for job in unsent:
            try:
                sent += send_webhook(job)
            except Exception:  # noqa: BLE001 - one kept edit must not keep the others (or the server) from running
                logger.exception("the webhook of edit %s cannot be sent", job.id)
        return sent

    app.state.resume_webhooks = resume_webhooks

    def image_statuses(ids: list[int]) -> list[dict]:
        """Per image of an edit in flight: parked, queued at a worker, running step k of n, or done."""
        return [router.request_status(i) or {"status": "done"} for i in ids]

    def accepted_view(job: Job) -> JSONResponse:
        return job_view(job, 202, {"Location": f"/v1/edits/{job.id}", "Retry-After": "1"})

    async def waited_answer(request: Request, job: Job) -> Response:
        """A synchronous keyed edit's answer once its job ends. A client that goes away leaves the job
        running: its retry will want the answer."""
        while not await job.wait_ended(DISCONNECT_POLL_S):
            if await request.is_disconnected():
                raise ClientGone()
        return reply_response(job.outcome.reply, job.outcome.http_status)

    async def replayed(request: Request, job: Job) -> Response:
        """A retry's answer: an asynchronous edit's status once it runs (or its refusal), or a synchronous
        one's answer (Stripe's `Idempotent-Replayed` header says it is not a new edit's)."""
        if job.runs_async:
            await job.settled(limits.request_timeout_s)
        answer = accepted_view(job) if job.runs_async and job.admitted.is_set() else await waited_answer(request, job)
        if job.admitted.is_set():  # not the first request's refusal (bad input, a full queue): nothing ran
            answer.headers["Idempotent-Replayed"] = "true"
        return answer

    async def edit_request(request: Request, endpoint: str, edit) -> Response:
        """An edit endpoint: its id, key and form, the claim on them, then `edit(request, form, claim)`, or
        the answer of the edit the key made."""
        request.state.arrived = time.monotonic()
        request.state.request_id = client_request_id(request)
        key = idempotency_key(request)
        form = await read_form(request)
        form.only(endpoint, request.query_params.keys())
        run_async = runs_async(request, form) if endpoint == "/v1/edits" else False
        async with claimed(request, endpoint, form, key, run_async) as claim:
            answer = await (replayed(request, claim.replay) if claim.replay is not None else edit(request, form, claim))
        if run_async and answer.status_code == 202 and prefers_async(request):
            answer.headers["Preference-Applied"] = "respond-async"
        return answer

    async def answered(request: Request, claim: EditClaim, template_id: str, answer) -> Response:
        """The answer of an admitted edit: at once (a plain edit, its client watched), or through a job (an
        asynchronous one's status, a keyed one's answer once it ends)."""
        if claim.job is None and not claim.runs_async:
            return reply_response(await answer(True))
        job = start_job(request, claim, template_id, answer)
        return accepted_view(job) if claim.runs_async else await waited_answer(request, job)

    def cancel_job(job: Job, why: str) -> bool:
        """Cancel a running job: its edits at their workers (it then ends cancelled), or, with none there
        (nothing to repaint, or its answer being encoded), its task. False for one still being checked."""
        ids = in_flight.get((job.tenant, job.id))
        if ids:
            return any([router.cancel(i, why) for i in ids])
        if job.task is not None:
            job.task.cancel()
            return True
        return False

    async def stop_async(deadline: float | None) -> list[Job]:
        """The server is stopping. Answers kept in memory only: the asynchronous edits that run are cancelled
        at once, since nobody could fetch their answers once it is down, and their workers are freed for the
        edits whose clients wait. Kept on disk too: they may finish until `deadline` (time.monotonic; None:
        cancelled at once), and the restarted server answers them. Those cancelled (returned) end
        `interrupted` (503, their key runs again) once their workers say so. Keyed synchronous edits go on
        either way: their clients are connected."""
        if jobs.folder is not None and deadline is not None:
            while (running := jobs.running_async()) and time.monotonic() < deadline:  # also those admitted meanwhile
                await wait_events([job.ended for job in running], min(1.0, deadline - time.monotonic()))
        running = jobs.running_async()
        for job in running:
            job.interrupted = True
        return [job for job in running if cancel_job(job, "the server is stopping")]

    app.state.stop_async = stop_async
    app.state.restored = jobs.restore(lambda job: failure_outcome(asyncio.CancelledError(), job.id))

    def webhook_field(form: Form, claim: EditClaim) -> str | None:
        url = form.text("webhook")
        if url is None:
            return None
        if webhooks is None:
            raise ApiError(400, "this server sends no webhooks (retouch serve --webhook-origins); poll GET "
                           "/v1/edits/{id}/result?wait=S instead", "webhook")
        if not claim.runs_async:
            raise ApiError(400, "webhook needs async=true (a synchronous edit's answer is its POST's)", "webhook")
        refusal = webhooks.refusal(url)
        if refusal is not None:
            raise ApiError(400, refusal, "webhook")
        return url

    def check_not_streamed(claim: EditClaim, stream: bool) -> None:
        if stream and claim.job is not None:
            raise ApiError(400, "a streamed edit cannot be replayed: send it without Idempotency-Key (or, on "
                           "/v1/edits, send async=true and stream GET /v1/edits/{id}/events)", "idempotency-key")

    @app.post("/v1/edits", openapi_extra=multipart_body(EDIT_FIELDS, ("mask", "prompt"), limits))
    async def create_edit(request: Request):
        """Repaint the masked region of a registered template (`template_id`) or of a one-off `image`:
        the PNG, its base64 (`response_format=b64_json`), or its progress as events (`stream=true`);
        with `async=true`, its status at once (202) and the answer later from GET /v1/edits/{id}/result."""
        return await edit_request(request, "/v1/edits", native_edit)

    async def native_edit(request: Request, form: Form, claim: EditClaim) -> Response:
        check_model(form.text("model") or None)  # an empty field, as some clients send for "unset"
        prompt = form.prompt(limits.max_prompt_chars, "prompt is required: say what to paint into the masked region")
        lora = lora_field(form, limits.lora_dir)
        response_format = form.text("response_format", "png")
        if response_format not in ("png", "b64_json"):
            raise ApiError(400, f"response_format must be png (the image itself, in its output_format) or "
                           f"b64_json, got {response_format!r}", "response_format")
        output_format, compression = output_encoding(form)
        steps = form.integer("steps", None, 1, limits.max_steps)
        seed = form.integer("seed", 0, 0, 2**63 - 1)
        strength = strength_of(form)
        guidance = form.number("guidance", 0.0, 100.0)
        mask_upload = form.file("mask")
        if mask_upload is None:
            raise ApiError(400, "mask is required (a file field; white = repaint)", "mask")
        upload = form.file("image")
        image = None if upload is None else await read_upload(upload, "image", limits.max_pixels)
        stream = form.boolean("stream")
        preview_every = form.integer("preview_every", 0, 0, limits.max_steps)
        if preview_every and not stream:
            raise ApiError(400, "preview_every needs stream=true (previews are events of the stream)", "preview_every")
        if stream and form.boolean("async"):
            raise ApiError(400, "send stream=true (events as it runs) or async=true (fetch it later), not both; "
                           "GET /v1/edits/{id}/events streams an asynchronous edit", "async")
        check_not_streamed(claim, stream)
        claim.webhook = webhook_field(form, claim)
        mask = await read_mask_upload(mask_upload, limits.max_pixels)
        slo_deadline(request, form, mask.size)
        template_id, one_off, steps = await edit_target(request, form, steps, guidance, image, mask, 1,
                                                        strength=strength)
        edit_negative_prompt(request, form, template_id, one_off)
        transparent = record_of(template_id, one_off).alpha is not None
        if transparent and output_format == "jpeg":
            raise ApiError(400, "this image is transparent and JPEG has no alpha: ask for png or webp",
                           "output_format")
        encoding = (output_format, compression)
        if stream:
            return await streamed_edit(request, template_id, one_off, steps, mask, prompt, seed, preview_every, lora,
                                       encoding=encoding, strength=strength)
        answers = await submit_edit(request, "/v1/edits", template_id, one_off, steps, mask, prompt, seed, lora=lora,
                                    strength=strength)

        async def answer(watch_client: bool) -> Reply:
            [png] = await answers(watch_client)
            image = await native_answer(template_id, one_off, mask, png, encoding)
            headers = answer_headers(request, template_id)
            if response_format == "png":
                return Reply(headers, images=(image,), media_type=f"image/{output_format}")
            envelope = {"created": int(time.time()), "template_id": template_id, "output_format": output_format}
            return Reply(headers, envelope, (image,))

        return await answered(request, claim, template_id, answer)

    @app.post("/v1/images/edits", openapi_extra=multipart_body(OPENAI_EDIT_FIELDS, ("prompt",), limits))
    async def openai_edit(request: Request):
        """The OpenAI Images API edit: `image` (or `image[]`), optional `mask` whose alpha 0 marks
        the region to repaint (without one, the image's own alpha does), `prompt`, `n`, `size`,
        `response_format` (b64_json), `output_format` (png, jpeg, webp), `output_compression`, and
        `stream` with `partial_images`; `model` must be a served name (404 otherwise); `quality`,
        `input_fidelity`, `user` and `safety_identifier` are accepted and ignored, other fields refused.
        retouch's extras: `template_id` reuses a registered template, `lora` names LoRA adapters, and `strength`,
        `negative_prompt` and `guidance` are /v1/edits's."""
        return await edit_request(request, "/v1/images/edits", openai_images_edit)

    async def openai_images_edit(request: Request, form: Form, claim: EditClaim) -> Response:
        for name in ("async", "webhook"):
            if form.text(name) is not None:
                raise ApiError(400, "asynchronous edits (and their webhooks) are POST /v1/edits's (async=true); the "
                               "OpenAI edit answers when done (an Idempotency-Key makes its retries safe)", name)
        check_model(form.text("model") or None)  # an empty field, as some clients send for "unset"
        prompt = form.prompt(limits.max_prompt_chars, "prompt is required")
        lora = lora_field(form, limits.lora_dir)
        n = form.integer("n", 1, 1, limits.max_n)
        response_format = form.text("response_format", "b64_json")
        if response_format != "b64_json":
            raise ApiError(400, "response_format must be b64_json (this server does not host image URLs)",
                           "response_format")
        size = form.text("size")
        target = None if size in (None, "", "auto") else _parse_size(size, limits.max_pixels)
        output_format, compression = output_encoding(form)
        seed = form.integer("seed", 0, 0, 2**63 - 1)
        strength = strength_of(form)
        if form.text("background", "auto") not in ("auto", "opaque"):
            raise ApiError(400, "background must be auto or opaque: retouch answers opaque images", "background")
        stream = form.boolean("stream")
        partial_images = form.integer("partial_images", 0, 0, 3)
        if stream and n > 1:
            raise ApiError(400, "stream=true answers one image: send n=1", "n")
        if partial_images and not stream:
            raise ApiError(400, "partial_images needs stream=true (they are events of the stream)", "partial_images")
        check_not_streamed(claim, stream)
        images = form.files("image", "image[]")
        if len(images) > 1:
            raise ApiError(400, f"image: send one image (the one to edit), got {len(images)}; retouch takes no "
                           "reference images", "image")
        upload = images[0] if images else None
        image = None if upload is None else await read_upload(upload, "image", limits.max_pixels)
        mask_upload = form.file("mask")
        if mask_upload is not None:
            mask = await read_mask_upload(mask_upload, limits.max_pixels, alpha=True)
        elif image is not None and await anyio.to_thread.run_sync(alpha_of, image.image) is not None:
            mask = await anyio.to_thread.run_sync(lambda: read_mask(image.image, alpha=True))
        else:  # an alpha channel that is opaque everywhere marks nothing to repaint: say so, not answer the image
            raise ApiError(400, "send a mask, or an image with transparent pixels (alpha 0 = repaint)"
                           + ("; this image has none" if image is not None else ""), "mask")
        if target is not None:
            check_aspect(target, mask.size)
            # scaled and encoded on this process's threads (an answer of the image's own size is not scaled)
            if target != mask.size and n * target[0] * target[1] > limits.max_pixels:
                raise ApiError(413, f"{n} answers of {target[0]}x{target[1]} are {n * target[0] * target[1]} pixels, "
                               f"over the limit of {limits.max_pixels} a request (--max-pixels): ask for a smaller "
                               "size or fewer images", "size", "too_much_work")
        slo_deadline(request, form, mask.size)
        template_id, one_off, steps = await edit_target(request, form, None, form.number("guidance", 0.0, 100.0),
                                                        image, mask, n, image_carries_mask=True, strength=strength)
        edit_negative_prompt(request, form, template_id, one_off)
        width, height = target or mask.size
        if stream:
            record = record_of(template_id, one_off)

            @functools.cache
            def template_rgb() -> Image.Image:
                return as_image(decode_image(record.image, "template"))

            def encoded(png: bytes, final: bool) -> tuple[bytes, tuple[int, int]]:
                if not final:
                    # OpenAI's partial images are whole pictures: the preview (1/8 of the side), scaled up,
                    # inside the mask, over the template, which is what the answer keeps outside it
                    preview = Image.open(io.BytesIO(png)).convert("RGB").resize(mask.size, Image.Resampling.BILINEAR)
                    png = png_bytes(paste_unmasked(template_rgb(), preview, mask))
                return reencoded(png, target, output_format, compression), (width, height)

            # K partial images spread over the steps (denoiser calls, as progress counts them): a preview
            # every calls // (K + 1), the first K of them
            calls = router.denoiser_calls(steps, strength=strength)
            preview_every = max(1, calls // (partial_images + 1)) if partial_images else 0
            return await streamed_edit(request, template_id, one_off, steps, mask, prompt, seed, preview_every, lora,
                                       OpenAIEvents(partial_images, output_format, encoded), strength=strength)
        answers = await submit_edit(request, "/v1/images/edits", template_id, one_off, steps, mask, prompt, seed, n,
                                    lora, strength)

        async def answer(watch_client: bool) -> Reply:
            pngs = await answers(watch_client)
            images = [await anyio.to_thread.run_sync(reencoded, png, target, output_format, compression)
                      for png in pngs]
            envelope = {"created": int(time.time()), "output_format": output_format, "size": f"{width}x{height}",
                        "background": "opaque"}
            return Reply(answer_headers(request, template_id), envelope, tuple(images))

        return await answered(request, claim, template_id, answer)

    async def streamed_edit(request: Request, template_id: str, one_off: TemplateRecord | None, steps: int,
                            mask: Image.Image, prompt: str, seed: int, preview_every: int,
                            lora: LoraChoice = (), openai: OpenAIEvents | None = None,
                            encoding: tuple[str, int] = ("png", 100), strength: float = 1.0) -> StreamingResponse:
        """An edit's progress and then its image, as events (`retouch.http_events`): retouch's own
        (POST /v1/edits stream=true), or with `openai`, the OpenAI Images API's (POST /v1/images/edits
        stream=true). Validation and admission errors were answered before: once the stream starts,
        the edit was accepted, and a failure is an `error` event."""
        calls = router.denoiser_calls(steps, strength=strength)
        payload = await anyio.to_thread.run_sync(mask_payload, mask, calls)
        request_id, tenant = request.state.request_id, request.state.tenant
        load = payload[1] if payload is not None else request_load(mask, calls)
        # Steps as progress counts them: the sampler's denoiser calls (Heun's make about two a step), of
        # the steps it runs (fewer below strength 1).
        accepted = {"id": request_id, "template_id": template_id, "steps": calls,
                    "mask_ratio": round(load.masked_tokens / load.image_tokens, 4),
                    "masked_tokens": load.masked_tokens, "image_tokens": load.image_tokens}
        if lora:
            accepted["lora"] = choice_header(lora)
        if not openai:
            accepted["output_format"] = encoding[0]
        style = openai or NativeEvents(accepted)
        endpoint = "/v1/images/edits" if openai else "/v1/edits"
        headers = {**EVENT_HEADERS, "X-Template-Id": template_id, "X-Request-Id": request_id}
        started = time.perf_counter()

        def written(*events: bytes | None) -> list[bytes]:
            return [event for event in events if event is not None]

        async def answer_png(png: bytes) -> bytes:
            return png if openai else await native_answer(template_id, one_off, mask, png, encoding)

        if payload is None:  # nothing to repaint
            png = await answer_png(await unchanged(template_id, one_off))

            async def unchanged_events() -> AsyncIterator[bytes]:
                for event in written(style.opening(), await style.done(png, {})):
                    yield event
            return StreamingResponse(unchanged_events(), media_type="text/event-stream", headers=headers)

        relay = EventRelay()
        [router_id], [future] = accept(request, template_id, one_off, mask, payload, prompt, seed, 1, preview_every,
                                       relay.tell_tagged, lora, strength)

        async def events() -> AsyncIterator[bytes]:
            outcome = "client_gone"  # until the stream ends otherwise: a client that leaves cancels it
            deadline = time.monotonic() + limits.request_timeout_s
            try:
                for event in written(style.opening()):
                    yield event
                while True:
                    event = await relay.next(min(KEEPALIVE_S, deadline - time.monotonic()))
                    if event is None:
                        if time.monotonic() < deadline:
                            yield KEEPALIVE
                            continue
                        router.cancel(router_id, "it timed out")
                        outcome = "timeout"
                        timed_out = ApiError(504, f"the edit took longer than {limits.request_timeout_s:.0f} s", None,
                                             "timeout")
                        yield style.error(504, timed_out.body())
                        return
                    name = event.pop("event")
                    event.pop("request", None)
                    if name == "answered":
                        break
                    if name == "preview":
                        told = await style.preview(event)
                    elif name in ("parked", "queued", "step"):
                        told = style.progress(name, event)
                    else:
                        told = None
                    if told is not None:
                        yield told
                answer = await asyncio.wrap_future(future)
                request.state.workers = answer.worker
                if answer.status == 200:
                    outcome = "ok"
                    yield await style.done(await answer_png(answer.png), answer.metrics)
                else:
                    outcome = "error"
                    request.state.streamed_status = answer.status
                    yield style.error(answer.status, answer_error(answer).body())
            except Exception:  # a bug of ours, not the client leaving (that is a BaseException here)
                outcome = "error"
                request.state.streamed_status = 500
                raise
            finally:
                metrics.latency.labels(endpoint, outcome).observe(time.perf_counter() - started)
                # the stream began 200; its access line and count say how it ended (`CountAnswers`)
                if outcome in ("client_gone", "timeout"):
                    request.state.streamed_status = 499 if outcome == "client_gone" else 504

        def closed() -> None:  # however the stream ended, even before it began (a client already gone)
            if not future.done():
                router.cancel(router_id, "the client went away")
                request.state.streamed_status = 499  # also when the stream was left at a yield, closed later
            in_flight.pop((tenant, request_id), None)

        return ClosingStreamingResponse(events(), closed, media_type="text/event-stream", headers=headers)

    def answer_error(answer: EditAnswer) -> ApiError:
        """A worker's failed answer, its error (an exception's class name) as a snake_case code; a LoRA it
        could not load (`retouch.lora.LoraError`) names the param."""
        code = WORKER_ERROR_CODES.get(answer.error) or (
            answer.error if answer.error and answer.error.islower()  # the router's own: no_worker, ...
            else "internal_error" if answer.status >= 500 else "invalid_request")
        param = {LoraError.__name__: "lora", "template_deleted": "template_id"}.get(answer.error or "")
        return ApiError(answer.status, answer.message or "the edit failed", param, code,
                        {"Retry-After": "5"} if answer.status == 503 else None)

    def edit_in_flight(request: Request, request_id: str) -> list[int]:
        ids = in_flight.get((request.state.tenant, request_id))
        if ids is None:
            raise ApiError(404, f"no edit with X-Request-Id {request_id!r} is running or kept (unknown; answered; "
                           "or its kept answer expired, or was dropped for room)", "request_id", "edit_not_found")
        return ids

    @app.get("/v1/edits/{request_id}")
    async def edit_status(request: Request, request_id: str):
        """An edit in flight (by its X-Request-Id): per image, parked, queued at a worker, or running
        step k of n. An asynchronous or keyed edit (a job) also once it ended: its status
        (in_progress, completed, failed, cancelled), and where its answer is."""
        job = jobs.find(request.state.tenant, request_id)
        if job is not None:
            return job_view(job, headers=None if job.ended.is_set() else {"Retry-After": "1"})
        ids = edit_in_flight(request, request_id)
        return {"id": request_id, "images": image_statuses(ids)}

    @app.get("/v1/edits/{request_id}/result")
    async def edit_result(request: Request, request_id: str, wait: str = "0"):
        """An asynchronous or keyed edit's answer, as its POST answered it (or would have): the image, its
        JSON, or its error with the error's status. Still running after waiting up to `wait` seconds for
        it: 202 with its status (and Retry-After), as the POST of an asynchronous edit answered."""
        wait = parse_wait(wait)
        job = jobs.find(request.state.tenant, request_id)
        if job is None:
            known = (request.state.tenant, request_id) in in_flight
            raise ApiError(404, f"no answer is kept for edit {request_id!r}: "
                           + ("it is a synchronous edit (its POST answers it; send async=true or an Idempotency-Key "
                              "to fetch one later)" if known else "unknown, or it expired, or was dropped for room"),
                           "request_id", "edit_not_found")
        request.state.template = job.template_id
        if not await job.wait_ended(wait):
            return accepted_view(job)
        return reply_response(job.outcome.reply, job.outcome.http_status)

    @app.get("/v1/edits/{request_id}/events")
    async def edit_events(request: Request, request_id: str):
        """An edit in flight as events (`retouch.http_events`), from where it is now: its first event
        is its status (parked, queued, or running at step k), then steps, then done or error. With
        n > 1 images, every event names its `image`. An asynchronous or keyed edit that ended: its error
        (if it failed), then done."""
        job = jobs.find(request.state.tenant, request_id)
        if job is not None and (job.ended.is_set() or (job.tenant, request_id) not in in_flight):
            async def ended() -> AsyncIterator[bytes]:  # or about to: no edit of it is at a worker
                while not await job.wait_ended(KEEPALIVE_S):
                    yield KEEPALIVE
                outcome = job.outcome
                if outcome.error is not None:
                    yield sse("error", {"status": outcome.http_status, **outcome.error})
                yield sse("done", {"id": request_id, "status": outcome.http_status})
            return StreamingResponse(ended(), media_type="text/event-stream", headers=EVENT_HEADERS)
        ids = edit_in_flight(request, request_id)
        relay = EventRelay()
        watched = [i for index, i in enumerate(ids) if relay.watch(router, "request", i, tag=index)]

        async def events() -> AsyncIterator[bytes]:
            remaining, statuses = set(watched), {}
            try:
                while remaining:
                    event = await relay.next(KEEPALIVE_S)
                    if event is None:
                        yield KEEPALIVE
                        continue
                    name, index = event.pop("event"), event.pop("image")
                    tag = {"image": index} if len(ids) > 1 else {}
                    if name == "answered":
                        remaining.discard(ids[index])
                        statuses[index] = event["status"]
                        if event["status"] != 200:
                            failed = EditAnswer(None, event["status"], event["error"], event["message"])
                            yield sse("error", {"status": event["status"], **tag, **answer_error(failed).body()})
                        continue
                    if name == "preview":
                        event = await with_image(event)
                    yield sse(name, {**event, **tag})
                ok = all(status == 200 for status in statuses.values())
                yield sse("done", {"id": request_id, "status": 200 if ok else max(statuses.values(), default=200)})
            finally:
                relay.close()

        return StreamingResponse(events(), media_type="text/event-stream", headers=EVENT_HEADERS)

    @app.delete("/v1/edits/{request_id}")
    async def cancel_edit(request: Request, request_id: str):
        """Cancel an edit in flight: it leaves its worker's batch at the next step; its POST is answered
        409 (code "cancelled"), and so is its result. An ended asynchronous or keyed edit: its kept answer
        is forgotten (and its Idempotency-Key with it)."""
        job = jobs.find(request.state.tenant, request_id)
        if job is not None and job.ended.is_set():
            jobs.forget(job)
            if webhooks is not None:  # its webhook would point to an answer that is gone
                webhooks.cancel(webhook_id(job))
            return {"id": request_id, "deleted": True}
        if job is not None and not job.admitted.is_set():
            raise ApiError(409, f"edit {request_id!r} is still being checked; send DELETE again", "request_id",
                           "edit_arriving", {"Retry-After": "1"})
        if job is not None:
            job.deleted = cancel_job(job, "DELETE /v1/edits")  # read when it ends, which is later
            return {"id": request_id, "cancelled": job.deleted}
        ids = edit_in_flight(request, request_id)
        cancelled = [router.cancel(i, "DELETE /v1/edits") for i in ids]
        return {"id": request_id, "cancelled": any(cancelled)}

    # ---- the playground (public: it holds no data; its requests carry the key the user types) ----

    if limits.playground:
        @app.get("/", include_in_schema=False)
        async def playground_page():
            return playground_asset("index.html")

        @app.get("/playground/{name}", include_in_schema=False)
        async def playground_file(name: str):
            return playground_asset(name)

    # ---- operations ----

    @app.get("/metrics")
    async def metrics_exposition(request: Request):
        """Prometheus text 0.0.4, or OpenMetrics when the scraper's Accept asks for it."""
        body, content_type = await anyio.to_thread.run_sync(metrics.exposition, request.headers.get("accept", ""))
        return Response(body, headers={"Content-Type": content_type})

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():
        workers = sum(1 for report in router.snapshot()["workers"].values() if not report.get("draining"))
        if workers == 0:  # none, or only workers that are stopping
            return JSONResponse({"status": "not ready", "workers": 0}, status_code=503, headers={"Retry-After": "1"})
        return {"status": "ready", "workers": workers, "model": model}

    return app


def playground_asset(name: str) -> Response:
    found = playground.asset(name)
    if found is None:
        raise ApiError(404, f"no such file: {name!r}", "name")
    content, media_type = found
    return Response(content, media_type=media_type, headers={"Cache-Control": "no-cache"})


def read_mask(upload: Image.Image, alpha: bool = False) -> Image.Image:
    """The uploaded mask as `retouch.images.as_mask` reads it; 400 naming the field if it cannot be."""
    try:
        return as_mask(upload, alpha=alpha)
    except InputError as exc:
        raise ApiError(400, str(exc), "mask", "invalid_mask") from None


def check_mask_size(mask: Image.Image, size: tuple[int, int], what: str) -> None:
    if mask.size != tuple(size):
        raise ApiError(422, f"mask is {mask.width}x{mask.height} but {what} is {size[0]}x{size[1]}; they must match"
                       + orientation_hint(mask.size, size), "mask", "mask_size")


def check_aspect(target: tuple[int, int], size: tuple[int, int]) -> None:
    """A `size` answer is the edit scaled, never stretched: its sides must keep the image's aspect ratio
    (within the rounding of one side to whole pixels)."""
    (width, height), (image_width, image_height) = target, size
    if round(width * image_height / image_width) != height and round(height * image_width / image_height) != width:
        keep = (width, max(1, round(width * image_height / image_width)))
        raise ApiError(400, f"size {width}x{height} would stretch the {image_width}x{image_height} image; send "
                       f"size=auto, or one of its aspect ratio (e.g. {keep[0]}x{keep[1]})", "size", "size_aspect")


def _parse_size(size: str, max_pixels: int) -> tuple[int, int]:
    sides = size.lower().split("x")
    # ASCII digits only: int() also reads "1_024", " 64" and other scripts' digits
    if len(sides) != 2 or not size.isascii() or not all(side.isdigit() for side in sides):
        raise ApiError(400, f"size must be WIDTHxHEIGHT (e.g. 1024x1024), got {size!r}", "size")
    width, height = map(int, sides)
    if width < 1 or height < 1 or width * height > max_pixels:
        raise ApiError(422, f"size {size} is outside 1..{max_pixels} pixels", "size")
    return width, height
