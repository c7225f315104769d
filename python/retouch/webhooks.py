"""Webhooks: a POST to the client's URL when its asynchronous edit ends (`POST /v1/edits` with
`async=true` and `webhook=URL`), so that it need not poll.

Each delivery is signed as the Standard Webhooks spec says (standardwebhooks.com, its own library signs):
headers `webhook-id` (one per edit, the same on every attempt: a receiver drops repeats by it),
`webhook-timestamp` and `webhook-signature` (`v1,` base64 HMAC-SHA256 of "id.timestamp.body" under the
server's secret, `retouch serve --webhook-secret-file`), so any Standard Webhooks library verifies it.
The body is `{"type": "edit.completed" | "edit.failed" | "edit.cancelled", "timestamp", "data"}`, `data`
being the edit's status as `GET /v1/edits/{id}` gives it (its `result_url` holds the answer).

Only URLs of the operator's origins are called (`--webhook-origins`): a URL any client chooses would make
the head call the services of its own network on the client's behalf (server-side request forgery).
Redirects are not followed, for the same reason. An attempt that fails (no answer within `timeout_s`,
a status other than 2xx) is retried after each of `retry_delays_s`; 410 Gone stops the retries.

    sender = WebhookSender(secret, ("https://hooks.example.com",))
    sender.refusal("https://hooks.example.com/retouch")     # None, or why the URL is refused
    sender.send(message_id, url, payload, delivered=...)    # on the event loop; `delivered()` once a 2xx came
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone
from urllib.parse import urlsplit

import httpx
from standardwebhooks.webhooks import Webhook

RETRY_DELAYS_S = (5.0, 30.0, 120.0, 600.0)  # five attempts over about 13 minutes
MAX_URL_CHARS = 2048
logger = logging.getLogger("retouch.webhooks")


def origin_of(url: str) -> str | None:
    """`scheme://host[:port]` of an http(s) URL, lower case; None for anything else (other schemes, user
    info, which could make one origin read as another)."""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises for a port that is not a number
    except ValueError:
        return None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname or "@" in parts.netloc:
        return None
    return f"{parts.scheme.lower()}://{parts.hostname.lower()}" + ("" if port is None else f":{port}")


class WebhookSender:
    def __init__(self, secret: str, origins: tuple[str, ...], retry_delays_s: tuple[float, ...] = RETRY_DELAYS_S,
                 timeout_s: float = 10.0, transport: httpx.AsyncBaseTransport | None = None):
        """`secret`: Standard Webhooks' form (`whsec_` + base64). ValueError for a malformed one."""
        try:
            self.signer = Webhook(secret)
        except Exception as exc:  # noqa: BLE001 - the library raises binascii errors and its own
            raise ValueError(f"a webhook secret is 'whsec_' followed by base64 ({exc})") from None
        self.origins = frozenset(origin_of(origin) or origin for origin in origins)
        self.retry_delays_s, self.timeout_s, self.transport = retry_delays_s, timeout_s, transport
        self.counts = {"delivered": 0, "retried": 0, "failed": 0}
        self._client: httpx.AsyncClient | None = None
        self._tasks: dict[asyncio.Task, bool] = {}  # delivery -> whether it waits to retry (nothing in flight)

    def refusal(self, url: str) -> str | None:
        """Why `url` may not be called, or None."""
        if len(url) > MAX_URL_CHARS:
            return f"webhook: a URL of at most {MAX_URL_CHARS} characters"
        if origin_of(url) not in self.origins:
            return f"webhook must be an http(s) URL of an allowed origin ({', '.join(sorted(self.origins))})"
        return None

    def send(self, message_id: str, url: str, payload: dict, delivered: Callable[[], None] = lambda: None) -> None:
        """Deliver `payload` to `url` (call on the event loop), retrying as the module says."""
        task = asyncio.get_running_loop().create_task(self._deliver(message_id, url, payload, delivered),
                                                      name=f"webhook-{message_id}")
        self._tasks[task] = False
        task.add_done_callback(lambda done: self._tasks.pop(done, None))

    def pending(self) -> int:
        return len(self._tasks)

    async def _deliver(self, message_id: str, url: str, payload: dict, delivered: Callable[[], None]) -> None:
        body = json.dumps(payload).encode()
        task = asyncio.current_task()
        for attempt, delay in enumerate((0.0, *self.retry_delays_s)):
            if delay:
                self.counts["retried"] += 1
                self._tasks[task] = True
                await asyncio.sleep(delay)
                self._tasks[task] = False
            status = await self._attempt(message_id, url, body)
            if status is not None and 200 <= status < 300:
                self.counts["delivered"] += 1
                delivered()
                return
            if status == 410:  # the receiver says it is gone for good
                break
            logger.info("webhook %s to %s: attempt %d failed (%s)", message_id, url, attempt + 1,
                        "no answer" if status is None else status)
        self.counts["failed"] += 1
        logger.warning("webhook %s to %s was not delivered (%d attempts)", message_id, url, attempt + 1)

    async def _attempt(self, message_id: str, url: str, body: bytes) -> int | None:
        if self._client is None:
            self._client = httpx.AsyncClient(transport=self.transport, follow_redirects=False, timeout=self.timeout_s)
        now = int(time.time())
        signature = self.signer.sign(message_id, datetime.fromtimestamp(now, tz=timezone.utc), body.decode())
        headers = {"content-type": "application/json", "user-agent": "retouch-webhooks", "webhook-id": message_id,
                   "webhook-timestamp": str(now), "webhook-signature": signature}
        try:
            answer = await self._client.post(url, content=body, headers=headers)
        except httpx.HTTPError:
            return None
        return answer.status_code

    async def close(self, deadline: float | None = None) -> int:
        """Stop (the server stops): deliveries in flight may end until `deadline` (time.monotonic; None: not
        at all); the rest, and those waiting to retry, are cancelled. How many were cancelled."""
        waiting = [task for task, waits in self._tasks.items() if waits]
        in_flight = [task for task, waits in self._tasks.items() if not waits]
        for task in waiting:
            task.cancel()
        if deadline is not None and in_flight:
            await asyncio.wait(in_flight, timeout=max(0.0, deadline - time.monotonic()))
        unfinished = waiting + [task for task in in_flight if not task.done()]
        for task in unfinished:
            task.cancel()
        await asyncio.gather(*unfinished, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        return len(unfinished)
