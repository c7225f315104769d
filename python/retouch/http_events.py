"""Progress as Server-Sent Events (text/event-stream): what the playground shows, for any client.

    POST /v1/edits  stream=true [preview_every=K]   the edit itself, answered as events
    GET  /v1/edits/{X-Request-Id}/events            an edit in flight, from where it is now
    GET  /v1/templates/{id}/events                  a template's recording

An edit's events, in order (each `event: NAME` and one `data: {json}` line):
    accepted  {id, template_id, steps, mask_ratio, masked_tokens, image_tokens[, lora]}   (POST only; lora:
                the request's adapters as [{name, scale}], when it names any)
    parked    {steps}           its template is not ready on any worker yet (it is being recorded)
    queued    {worker, attempt, steps}   sent to a worker
    step      {step, steps}     after each denoising step: 1..n, each once, in order
    preview   {step, image}     with preview_every=K, every K steps: a PNG (base64) of the latents
                                through a linear latent->RGB map (`engine.previews`), 1/8 the side
    done      POST: {template_id, b64_json, latency_s, mask_ratio}; GET: {status}
    error     {status, error: {message, type, param, code}}   the edit failed or was cancelled
A worker that dies mid-edit: `queued` again (attempt 2) and the steps start over from 1.
A template's: `template` {id, status, progress: {step, steps, workers_ready, ...}} at each change,
ending when its status is ready or failed; `deleted` if it is deleted meanwhile.
A comment line (`: keep-alive`) goes out after KEEPALIVE_S without an event, so proxies keep the
connection open. A client that goes away from a POST stream cancels its edit.
"""

from __future__ import annotations

import asyncio
import base64
import json

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
