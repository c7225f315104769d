"""Progress as Server-Sent Events (text/event-stream): what the playground shows, for any client.

    POST /v1/edits  stream=true [preview_every=K]   the edit itself, answered as events
    GET  /v1/edits/{X-Request-Id}/events            an edit in flight, from where it is now
    GET  /v1/templates/{id}/events                  a template's recording

An edit's events, in order (each `event: NAME` and one `data: {json}` line):
    accepted  {id, template_id, steps, mask_ratio, masked_tokens, image_tokens, output_format[, lora]}
                (POST only; output_format: done's image encoding; lora: the request's adapters as
                [{name, scale}], when it names any)
    parked    {steps}           its template is not ready on any worker yet (it is being recorded)
    queued    {worker, attempt, steps}   sent to a worker
    step      {step, steps}     after each denoising step: 1..n, each once, in order
    preview   {step, image}     with preview_every=K, every K steps: a PNG (base64) of the latents
                                through a linear latent->RGB map (`engine.previews`), 1/8 the side
    done      POST: {template_id, b64_json, latency_s, mask_ratio}; GET: {status}
    error     {status, error: {message, type, param, code}}   the edit failed or was cancelled
A worker that dies mid-edit: `queued` again (attempt 2) and the steps start over from 1.
A template's: `template` {id, status, progress: {step, steps, workers_ready, ...}} at each change,
ending when its status is ready or failed; `deleted` if it is deleted meanwhile; `stopping` {message} if
the server stops first (watch again once it is back: the recording goes on on its workers, or starts over).
A comment line (`: keep-alive`) goes out after KEEPALIVE_S without an event, so proxies keep the
connection open. A client that goes away from a POST stream cancels its edit.

POST /v1/images/edits stream=true [partial_images=K] answers in the OpenAI Images API's stream format
instead (what its SDKs parse; `OpenAIEvents`): up to K `image_edit.partial_image` events (K in 0..3,
spread over the steps: the previews, scaled up inside the mask over the template), then
`image_edit.completed`, or `error` {type, error}.
"""

from __future__ import annotations

import asyncio
import base64
import json

import time
from collections.abc import Callable

import anyio

KEEPALIVE_S = 15.0
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # nginx: pass events on at once


async def with_image(preview: dict) -> dict:
    """A `preview` event's data: its PNG as base64 `image`, encoded off the event loop."""
    png = preview.pop("png")
    return {**preview, "image": (await anyio.to_thread.run_sync(base64.b64encode, png)).decode()}


def sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


KEEPALIVE = b": keep-alive\n\n"


class EventRelay:
    """Router events for one stream, handed from the router's threads to the event loop. `tell` is
    what the router calls (its lock held): it only schedules the put."""

    def __init__(self):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[dict] = asyncio.Queue()
        self._stops: list = []

    def tell(self, event: dict) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def tell_tagged(self, request_id: int, event: dict) -> None:
        """`tell` for `Router.submit_many(on_event=...)`, which names the request."""
        self.tell({**event, "request": request_id})

    def watch(self, router, kind: str, key, tag: int | None = None) -> bool:
        """Watch request or template `key` on `router`; False if it is unknown or already answered."""
        callback = self.tell if tag is None else (lambda event: self.tell({**event, "image": tag}))
        stop = router.watch(kind, key, callback)
        if stop is None:
            return False
        self._stops.append(stop)
        return True

    async def next(self, timeout_s: float) -> dict | None:
        """The next event; None if none came within `timeout_s`."""
        try:
            return await asyncio.wait_for(self._queue.get(), max(0.0, timeout_s))
        except TimeoutError:
            return None

    def close(self) -> None:
        for stop in self._stops:
            stop()
        self._stops.clear()


class NativeEvents:
    """How a POST /v1/edits stream writes an edit's life: retouch's own events (above)."""

    def __init__(self, accepted: dict):
        self.accepted = accepted
        self.started = time.perf_counter()

    def opening(self) -> bytes | None:
        return sse("accepted", self.accepted)

    def progress(self, name: str, event: dict) -> bytes | None:
        return sse(name, event)

    async def preview(self, event: dict) -> bytes | None:
        return sse("preview", await with_image(event))

    async def done(self, png: bytes, metrics: dict) -> bytes:
        return sse("done", {"id": self.accepted["id"], "template_id": self.accepted["template_id"],
                            "b64_json": (await anyio.to_thread.run_sync(base64.b64encode, png)).decode(),
                            "latency_s": round(time.perf_counter() - self.started, 3),
                            "mask_ratio": self.accepted["mask_ratio"], "metrics": metrics})

    def error(self, status: int, body: dict) -> bytes:
        return sse("error", {"status": status, **body})


NO_USAGE = {"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}, "output_tokens": 0,
            "total_tokens": 0}


class OpenAIEvents:
    """How a POST /v1/images/edits stream writes it: the OpenAI Images API's edit events. `encode(png,
    final)` turns a preview (final False) or the answer into the requested output format and returns
    (bytes, (width, height)); it runs in a worker thread."""

    def __init__(self, partial_images: int, output_format: str,
                 encode: Callable[[bytes, bool], tuple[bytes, tuple[int, int]]]):
        self.partial_images, self.output_format, self.encode = partial_images, output_format, encode
        self.partials = 0

    def opening(self) -> bytes | None:
        return None

    def progress(self, name: str, event: dict) -> bytes | None:
        return None  # the format has no queue or step events; keep-alives hold the connection

    async def preview(self, event: dict) -> bytes | None:
        if self.partials >= self.partial_images:
            return None
        image = await self._image("image_edit.partial_image", event["png"], False)
        self.partials += 1
        return sse("image_edit.partial_image", {**image, "partial_image_index": self.partials - 1})

    async def done(self, png: bytes, metrics: dict) -> bytes:
        # usage: the SDK's type requires it; retouch meters no tokens, so every count is 0
        return sse("image_edit.completed", {**await self._image("image_edit.completed", png, True),
                                            "usage": NO_USAGE})

    def error(self, status: int, body: dict) -> bytes:
        return sse("error", {"type": "error", **body})

    async def _image(self, kind: str, png: bytes, final: bool) -> dict:
        def encoded() -> tuple[str, tuple[int, int]]:
            data, size = self.encode(png, final)
            return base64.b64encode(data).decode(), size

        b64, (width, height) = await anyio.to_thread.run_sync(encoded)
        # background: retouch answers opaque images; quality: it has no quality setting to report
        return {"type": kind, "b64_json": b64, "created_at": int(time.time()), "size": f"{width}x{height}",
                "output_format": self.output_format, "background": "opaque", "quality": "auto"}
