"""Webhooks: a POST to the client's URL when its asynchronous edit ends (`POST /v1/edits` with
`async=true` and `webhook=URL`), so that it need not poll.

Each delivery is signed as the Standard Webhooks spec says (standardwebhooks.com, its own library signs):
headers `webhook-id` (one per edit, the same on every attempt: a receiver drops repeats by it),
`webhook-timestamp` and `webhook-signature` (`v1,` base64 HMAC-SHA256 of "id.timestamp.body"), so any
Standard Webhooks library verifies it. The body is `{"type": "edit.completed" | "edit.failed" |
"edit.cancelled", "timestamp", "data"}`, `data` being the edit's status as `GET /v1/edits/{id}` gives it
(its `result_url` holds the answer).

Each tenant's deliveries are signed with a secret of its own (`tenant_secret`: derived from the server's,
`retouch serve --webhook-secret-file`, and given to the tenant's API key by GET /v1/webhooks/secret), so
that one tenant cannot make the server sign an event for another's receiver. A server without API keys has
one tenant, and its deliveries are signed with the server's secret itself.

Only URLs of the operator's origins are called (`--webhook-origins`): a URL any client chooses would make
the head call the services of its own network on the client's behalf (server-side request forgery). The
URL is checked and sent as httpx parses it (one parser: no URL means one host to the check and another to
the request), and redirects are not followed. An attempt that fails (no status within `timeout_s`, a
status other than 2xx) is retried after each of `retry_delays_s`; 410 Gone stops the retries.

    sender = WebhookSender(secret, ("https://hooks.example.com",), per_tenant=True)
    sender.refusal("https://hooks.example.com/retouch")     # None, or why the URL is refused
    sender.send(tenant, message_id, url, payload, done=...)  # on the loop; done("delivered", "gone", ...)
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone

import httpx
from standardwebhooks.webhooks import Webhook

RETRY_DELAYS_S = (5.0, 30.0, 120.0, 600.0)  # five attempts over about 13 minutes
MAX_URL_CHARS = 2048
SECRET_BYTES = (24, 64)  # what the Standard Webhooks spec asks of a secret
DEFAULT_PORTS = {"http": 80, "https": 443}
logger = logging.getLogger("retouch.webhooks")


class OriginsOnly(logging.Filter):
    """httpx logs each request's whole URL (at info), and a webhook's may hold its client's token: its
    records name the origin only."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(f"{arg.scheme}://{arg.netloc.decode()}/..." if isinstance(arg, httpx.URL) else arg
                                for arg in record.args)
        return True


def origin_of(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an http(s) URL as httpx reads it; None for anything else: other schemes,
    user info, a fragment, whitespace or control characters (parsers disagree on them)."""
    if any(ord(char) <= 32 or ord(char) == 127 for char in url):
        return None
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError):
        return None
    if parsed.scheme not in DEFAULT_PORTS or not parsed.host or parsed.userinfo or parsed.fragment:
        return None
    return parsed.scheme, parsed.host, parsed.port or DEFAULT_PORTS[parsed.scheme]


def allowed_origin(origin: str) -> tuple[str, str, int] | None:
    """An operator's origin (`http(s)://host[:port]`, nothing after it) as `origin_of` reads it, else None."""
    parsed = origin_of(origin)
    if parsed is None or httpx.URL(origin).raw_path not in (b"/", b"") or httpx.URL(origin).query:
        return None
    return parsed


def secret_key(secret: str) -> bytes:
    """The key of a Standard Webhooks secret (`whsec_` + base64 of 24-64 bytes); ValueError otherwise."""
    encoded = secret.removeprefix("whsec_")
    try:
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except binascii.Error as exc:
        raise ValueError(f"a webhook secret is 'whsec_' followed by base64 ({exc})") from None
    if not SECRET_BYTES[0] <= len(key) <= SECRET_BYTES[1]:
        raise ValueError(f"a webhook secret holds {SECRET_BYTES[0]}-{SECRET_BYTES[1]} bytes (base64), not {len(key)}")
    return key


def tenant_secret(secret: str, tenant: str) -> str:
    """A tenant's own webhook secret, derived from the server's (HMAC-SHA256 of the tenant's id)."""
    derived = hmac.new(secret_key(secret), b"retouch-webhooks\0" + tenant.encode(), hashlib.sha256).digest()
    return "whsec_" + base64.b64encode(derived).decode()


class WebhookSender:
    def __init__(self, secret: str, origins: tuple[str, ...], per_tenant: bool = False,
                 retry_delays_s: tuple[float, ...] = RETRY_DELAYS_S, timeout_s: float = 10.0,
                 transport: httpx.AsyncBaseTransport | None = None):
        """`secret`: Standard Webhooks' form (ValueError for another). `per_tenant`: the tenants are API keys,
        each told its secret (`secret_of`) by GET /v1/webhooks/secret."""
        secret_key(secret)
        bad = [origin for origin in origins if allowed_origin(origin) is None]
        if bad:
            raise ValueError(f"webhook origins are http(s)://host[:port], nothing after; got {bad[0]!r}")
        self.secret, self.per_tenant = secret, per_tenant
        httpx_logger = logging.getLogger("httpx")
        if not any(isinstance(f, OriginsOnly) for f in httpx_logger.filters):
            httpx_logger.addFilter(OriginsOnly())
        self.origins = {allowed_origin(origin): origin for origin in origins}
        self.retry_delays_s, self.timeout_s, self.transport = retry_delays_s, timeout_s, transport
        # how deliveries ended (cancelled: by a DELETE, or by the stop, which leaves them to a restarted server),
        # and the attempts made after a first
        self.counts = dict.fromkeys(("delivered", "failed", "gone", "refused", "cancelled", "retried"), 0)
        self.closed = False
        self._signers: dict[str, Webhook] = {}
        self._client: httpx.AsyncClient | None = None
        self._tasks: dict[asyncio.Task, bool] = {}  # delivery -> whether it waits to retry (nothing in flight)

    def secret_of(self, tenant: str) -> str:
        """The tenant's secret, by the tenant alone (an edit kept across a restart that added or removed API
        keys is signed as its receiver expects): an API key's own, or the server's for the one tenant ("") of
        a server without keys."""
        return tenant_secret(self.secret, tenant) if tenant else self.secret

    def refusal(self, url: str) -> str | None:
        """Why `url` may not be called (a message naming no origin: any tenant reads it), or None."""
        if len(url) > MAX_URL_CHARS:
            return f"webhook: a URL of at most {MAX_URL_CHARS} characters"
        origin = origin_of(url)
        if origin is None:
            return "webhook must be an http(s) URL without user info, fragment, spaces or control characters"
        if origin not in self.origins:
            return "webhook's origin is not one the server allows (--webhook-origins)"
        return None

    def send(self, tenant: str, message_id: str, url: str, payload: dict,
             done: Callable[[str], None] = lambda state: None, label: str = "") -> bool:
        """Deliver `payload` to `url` (call on the event loop), retrying as the module says; `done(state)` once
        it is over: delivered, gone (410), failed, or refused (its origin is not allowed, as after a restart
        with fewer). False when refused, or when the sender is closed (nothing is sent, and `done` is not
        called: a restarted server sends it). `label` names it in the logs (an edit's id)."""
        if self.closed:
            return False
        refusal = self.refusal(url)
        if refusal is not None:
            logger.warning("the webhook of %s is not sent: %s", label or message_id, refusal)
            self.counts["refused"] += 1
            done("refused")
            return False
        task = asyncio.get_running_loop().create_task(
            self._deliver(tenant, message_id, url, payload, done, label or message_id), name=f"webhook-{message_id}")
        self._tasks[task] = False
        task.add_done_callback(lambda finished: self._tasks.pop(finished, None))
        return True

    def cancel(self, message_id: str) -> bool:
        """Stop delivering `message_id` (its edit's answer was deleted: its result_url would answer 404)."""
        tasks = [task for task in self._tasks if task.get_name() == f"webhook-{message_id}"]
        for task in tasks:
            task.cancel()
        return bool(tasks)

    def pending(self) -> int:
        return len(self._tasks)

    async def _deliver(self, tenant: str, message_id: str, url: str, payload: dict,
                       done: Callable[[str], None], label: str) -> None:
        try:
            await self._deliver_or_give_up(tenant, message_id, url, payload, done, label)
        except asyncio.CancelledError:
            self.counts["cancelled"] += 1
            raise

    async def _deliver_or_give_up(self, tenant: str, message_id: str, url: str, payload: dict,
                                  done: Callable[[str], None], label: str) -> None:
        body = json.dumps(payload).encode()
        task = asyncio.current_task()
        state, origin = "failed", self.origins.get(origin_of(url), "?")  # the logs name the origin, not the URL
        for attempt, delay in enumerate((0.0, *self.retry_delays_s)):
            if delay:
                if self.closed:  # the server stops: no retry; close() counts this delivery among those cancelled
                    raise asyncio.CancelledError
                self._tasks[task] = True
                await asyncio.sleep(delay)
                self._tasks[task] = False
                self.counts["retried"] += 1  # attempts made after a first
            status = await self._attempt(tenant, message_id, url, body)
            if isinstance(status, int) and 200 <= status < 300:
                state = "delivered"
                break
            if status == 410:  # the receiver says it is gone for good
                state = "gone"
                break
            logger.info("webhook of %s to %s: attempt %d failed (%s)", label, origin, attempt + 1, status)
        self.counts[state] += 1
        if state != "delivered":
            logger.warning("webhook of %s to %s was not delivered (%s; %d attempt%s)", label, origin, state,
                           attempt + 1, "s" * (attempt > 0))
        done(state)

    async def _attempt(self, tenant: str, message_id: str, url: str, body: bytes) -> int | str:
        """The receiver's status, or why there is none (the exception's name: ConnectError, a timeout, ...)."""
        if self._client is None:
            self._client = httpx.AsyncClient(transport=self.transport, follow_redirects=False, timeout=self.timeout_s)
        signer = self._signers.get(tenant)
        if signer is None:
            signer = self._signers[tenant] = Webhook(self.secret_of(tenant))
        now = int(time.time())
        headers = {"content-type": "application/json", "user-agent": "retouch-webhooks", "webhook-id": message_id,
                   "webhook-timestamp": str(now),
                   "webhook-signature": signer.sign(message_id, datetime.fromtimestamp(now, tz=timezone.utc),
                                                    body.decode())}
        try:
            async with asyncio.timeout(self.timeout_s):  # in all: a receiver trickling its answer is cut too
                async with self._client.stream("POST", httpx.URL(url), content=body, headers=headers) as answer:
                    return answer.status_code  # its body is not read
        except TimeoutError:
            return "no status within the time limit"
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, this attempt has no answer
            return type(exc).__name__

    async def close(self, deadline: float | None = None) -> int:
        """Stop (the server stops): deliveries in flight may end until `deadline` (time.monotonic; None: not
        at all); the rest, and those waiting to retry, are cancelled, and later ones are not sent. How many
        were cancelled."""
        self.closed = True
        live = {task: waits for task, waits in self._tasks.items() if not task.cancelling()}  # not cancel()ed
        waiting = [task for task, waits in live.items() if waits]
        in_flight = [task for task, waits in live.items() if not waits]
        for task in waiting:
            task.cancel()
        if deadline is not None and in_flight:
            await asyncio.wait(in_flight, timeout=max(0.0, deadline - time.monotonic()))
        unfinished = waiting + [task for task in in_flight if not task.done() or task.cancelled()]
        for task in unfinished:
            task.cancel()
        await asyncio.gather(*unfinished, *self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        return len(unfinished)
