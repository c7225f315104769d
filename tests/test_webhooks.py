"""Webhooks (`retouch.webhooks`): signed as Standard Webhooks says (its published test vector, and its own
library verifying), retried until a 2xx, sent only to the operator's origins, never redirected, and
sent again by a restarted server when they were not delivered."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from pathlib import Path

import httpx
import pytest
from standardwebhooks.webhooks import Webhook
from test_edit_jobs import answer_next_edit, auth, mask_file, server_with_a_template

from retouch.config import ServeOptions
from retouch.errors import InputError
from retouch.kept_answers import AnswerFolder
from retouch.server import read_webhook_secret
from retouch.webhooks import WebhookSender, allowed_origin, origin_of, secret_key, tenant_secret

SECRET = "whsec_" + base64.b64encode(b"a webhook secret of 32 bytes....").decode()
ORIGIN = "https://hooks.example.com"


class Receiver:
    """A MockTransport's handler: answers each delivery with the next of `statuses` (None: no answer)."""

    def __init__(self, *statuses: int | None):
        self.statuses, self.requests = list(statuses), []
        self.arrived = asyncio.Event()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        self.arrived.set()
        status = self.statuses.pop(0) if self.statuses else 200
        if status is None:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(status, headers={"location": "http://169.254.169.254/"} if status == 302 else {})


def counted(counts: dict) -> dict:
    return {name: value for name, value in counts.items() if value}


def deliver(receiver: Receiver, retry_delays_s=(0.01, 0.01, 0.01), payload=None) -> tuple[WebhookSender, list]:
    async def run() -> list:
        sender = WebhookSender(SECRET, (ORIGIN,), retry_delays_s=retry_delays_s,
                               transport=httpx.MockTransport(receiver))
        ended = []
        sender.send("", "msg_1", ORIGIN + "/hook", payload or {"type": "edit.completed"}, ended.append)
        while sender.pending():
            await asyncio.sleep(0.01)
        await sender.close()
        return sender, ended
    return asyncio.run(run())


def test_signatures_are_standard_webhooks(monkeypatch):
    """The spec's published test vector, through the sender, and a fresh delivery its library verifies."""
    receiver = Receiver()
    vector_secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"

    async def run():
        sender = WebhookSender(vector_secret, (ORIGIN,), transport=httpx.MockTransport(receiver))
        await sender._attempt("", "msg_p5jXN8AQM9LWM0D4loKWxJek", ORIGIN, json.dumps({"test": 2432232314}).encode())
        await sender.close()
    now = time.time
    monkeypatch.setattr(time, "time", lambda: 1614265330.5)
    asyncio.run(run())
    monkeypatch.setattr(time, "time", now)
    [request] = receiver.requests
    assert request.headers["webhook-signature"] == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    assert request.headers["webhook-timestamp"] == "1614265330"

    fresh = Receiver()
    deliver(fresh, payload={"type": "edit.completed", "data": {"id": "e1"}})
    request = fresh.requests[0]
    assert Webhook(SECRET).verify(request.content, dict(request.headers))["data"] == {"id": "e1"}
    with pytest.raises(Exception, match="signature"):
        Webhook("whsec_" + base64.b64encode(b"another secret").decode()).verify(request.content, dict(request.headers))


def test_each_tenant_has_its_own_secret():
    a, b = tenant_secret(SECRET, "tenant-a"), tenant_secret(SECRET, "tenant-b")
    assert a != b != SECRET and a == tenant_secret(SECRET, "tenant-a")
    assert len(secret_key(a)) == 32
    sender = WebhookSender(SECRET, (ORIGIN,), per_tenant=True)
    assert sender.secret_of("tenant-a") == a
    # by the tenant alone, whether the server has keys now: an edit kept across a restart that added or removed
    # them is signed as its receiver expects (tenant "": a server without keys, whose operator holds the secret)
    assert WebhookSender(SECRET, (ORIGIN,)).secret_of("tenant-a") == a
    assert sender.secret_of("") == SECRET


def test_httpx_logs_no_webhook_url(caplog):
    """httpx logs each request's URL at info; a webhook's may hold its client's token."""
    caplog.set_level(logging.INFO, logger="httpx")
    deliver(Receiver(), payload={})
    lines = [record.getMessage() for record in caplog.records if record.name == "httpx"]
    assert lines and all(ORIGIN + "/hook" not in line and ORIGIN in line for line in lines)


def test_a_cancelled_delivery_ends_without_an_outcome():
    async def run() -> tuple:
        sender = WebhookSender(SECRET, (ORIGIN,), retry_delays_s=(60.0,), transport=httpx.MockTransport(Receiver(500)))
        ended = []
        sender.send("", "msg_gone", ORIGIN, {}, ended.append)
        while not any(sender._tasks.values()):
            await asyncio.sleep(0.01)
        cancelled = sender.cancel("msg_gone"), sender.cancel("msg_unknown")
        while sender.pending():
            await asyncio.sleep(0.01)
        await sender.close()
        return cancelled, ended, sender.counts
    cancelled, ended, counts = asyncio.run(run())
    assert cancelled == (True, False) and ended == [] and counted(counts) == {"cancelled": 1}


def test_a_delivery_is_retried_until_a_2xx_and_keeps_its_id():
    receiver = Receiver(500, None, 302, 204)
    sender, ended = deliver(receiver)
    assert len(receiver.requests) == 4 and ended == ["delivered"]
    assert {request.headers["webhook-id"] for request in receiver.requests} == {"msg_1"}
    assert counted(sender.counts) == {"delivered": 1, "retried": 3}
    assert all(str(request.url) == ORIGIN + "/hook" for request in receiver.requests)  # the 302 was not followed


def test_a_delivery_gives_up_after_its_attempts_or_at_410():
    sender, ended = deliver(Receiver(500, 500, 500, 500))
    assert ended == ["failed"] and counted(sender.counts) == {"retried": 3, "failed": 1}
    gone = Receiver(410, 200)
    sender, ended = deliver(gone)
    assert len(gone.requests) == 1 and ended == ["gone"] and counted(sender.counts) == {"gone": 1}


def test_closing_cancels_the_retries_and_waits_for_deliveries_in_flight():
    async def run() -> tuple:
        release = asyncio.Event()

        async def slow(request):
            await release.wait()
            return httpx.Response(200)
        sender = WebhookSender(SECRET, (ORIGIN,), retry_delays_s=(60.0,), transport=httpx.MockTransport(slow))
        sender.send("", "msg_slow", ORIGIN, {})
        failing = WebhookSender(SECRET, (ORIGIN,), retry_delays_s=(60.0,), transport=httpx.MockTransport(Receiver(500)))
        failing.send("", "msg_retry", ORIGIN, {})
        while not any(failing._tasks.values()):  # it waits to retry
            await asyncio.sleep(0.01)
        asyncio.get_running_loop().call_later(0.05, release.set)
        in_flight = await sender.close(time.monotonic() + 60)
        # one waiting to retry is cancelled at once, not at the deadline
        retrying = await asyncio.wait_for(failing.close(time.monotonic() + 60), 10)
        return in_flight, sender.counts, retrying, failing.send("", "msg_late", ORIGIN, {}), failing.pending()
    in_flight, counts, retrying, sent_after_close, pending = asyncio.run(run())
    assert in_flight == 0 and counts["delivered"] == 1 and retrying == 1
    assert sent_after_close is False and pending == 0  # a closed sender sends nothing: a restart will


def test_an_attempt_failing_while_closing_is_not_retried_and_counts_as_cancelled():
    async def run() -> tuple:
        release = asyncio.Event()
        attempts = []

        async def failing_late(request):
            attempts.append(request)
            await release.wait()
            return httpx.Response(500)
        sender = WebhookSender(SECRET, (ORIGIN,), retry_delays_s=(60.0,), transport=httpx.MockTransport(failing_late))
        sender.send("", "msg_failing", ORIGIN, {})
        while not attempts:
            await asyncio.sleep(0.01)
        asyncio.get_running_loop().call_later(0.05, release.set)
        # the closing must not wait out the 60 s retry delay until the deadline
        cancelled = await asyncio.wait_for(sender.close(time.monotonic() + 60), 10)
        return cancelled, len(attempts), sender.counts
    cancelled, attempts, counts = asyncio.run(run())
    assert cancelled == 1 and attempts == 1 and counted(counts) == {"cancelled": 1}


@pytest.mark.parametrize("url, allowed", [
    (ORIGIN + "/a/b?c=1", True), ("HTTPS://Hooks.Example.com/x", True), (ORIGIN + ":443/x", True),
    ("http://hooks.example.com/x", False), ("https://hooks.example.com.evil.io/x", False),
    ("https://hooks.example.com@evil.io/x", False), ("https://evil.io#@hooks.example.com", False),
    (ORIGIN + "/x#frag", False), ("https://hooks.example.com\\@evil.io/", False),
    (ORIGIN + "/x\t", False), (ORIGIN + "/x\x00", False), (" " + ORIGIN, False), (ORIGIN + "/x y", False),
    ("ftp://hooks.example.com/x", False), ("https://hooks.example.com:99999/", False), ("/relative", False),
    (ORIGIN + "/" + "a" * 3000, False),
    ("https://[fd00::10]:8443/x", True), ("https://[fd00::10:8443]/x", False), ("https://[fd00::10]/x", False)])
def test_only_urls_of_the_allowed_origins_are_called(url, allowed):
    sender = WebhookSender(SECRET, (ORIGIN, "https://[fd00::10]:8443"))
    assert (sender.refusal(url) is None) == allowed
    if not allowed and len(url) < 2048:  # the refusal says what is wrong: the URL's shape, or its origin
        assert ("origin is not one" in sender.refusal(url)) == (origin_of(url) is not None)


def test_an_allowed_origin_is_only_an_origin():
    assert allowed_origin("https://h.io:8443") == ("https", "h.io", 8443) == allowed_origin("https://h.io:8443/")
    for bad in ("https://h.io/tenant-a", "https://h.io?x=1", "h.io", "https://u@h.io", "ftp://h.io"):
        assert allowed_origin(bad) is None, bad
        with pytest.raises(ValueError, match="origins"):
            WebhookSender(SECRET, (bad,))


def test_webhook_options_are_checked(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    assert read_webhook_secret(secret) == SECRET
    for bad, message in (("whsec_not base64!", "base64"), ("whsec_AA==", "24-64 bytes"),
                         (SECRET + "\n" + SECRET, "one line")):
        secret.write_text(bad)
        with pytest.raises(InputError, match=message):
            read_webhook_secret(secret)
    with pytest.raises(InputError, match="--webhook-secret-file"):
        ServeOptions(model="m", webhook_origins=ORIGIN)
    with pytest.raises(InputError, match="nothing after"):
        ServeOptions(model="m", webhook_origins=ORIGIN + "/tenant-a", webhook_secret_file=secret)
    secret.write_text(SECRET)
    with pytest.raises(InputError, match="without --webhook-origins"):
        ServeOptions(model="m", webhook_secret_file=secret)


ORIGIN2 = "https://hooks2.example.com"


async def webhooked_edits(directory: Path) -> dict:
    limits = {"webhook_origins": (ORIGIN, ORIGIN2), "webhook_secret": SECRET}
    async with server_with_a_template(AnswerFolder(directory), **limits) as (client, router, worker, form):
        app = client._transport.app
        receiver = Receiver(200, 410, 503, 503, 503)  # delivered; gone; then down (they wait to be retried)
        app.state.webhooks.transport = httpx.MockTransport(receiver)
        app.state.webhooks.retry_delays_s = (60.0,)
        secret = await client.get("/v1/webhooks/secret", headers=auth())
        seen = {"secret": secret.json()["secret"], "no-store": secret.headers["Cache-Control"] == "no-store",
                "other secret": (await client.get("/v1/webhooks/secret", headers=auth("sk-b"))).json()["secret"]}
        for url in (ORIGIN + "/done?job=1", ORIGIN + "/gone", ORIGIN + "/late", ORIGIN2 + "/late", ORIGIN + "/del"):
            seen[url] = await client.post("/v1/edits", headers=auth(), data={**form, "async": "true", "webhook": url},
                                          files=mask_file())
            await answer_next_edit(worker)
            while len(receiver.requests) < len(seen) - 3:
                await asyncio.sleep(0.01)
        seen["requests"] = receiver.requests
        # a DELETE of an answer stops its webhook's retries (its result_url would answer 404)
        pending = app.state.webhooks.pending()
        await client.delete(f"/v1/edits/{seen[ORIGIN + '/del'].json()['id']}", headers=auth())
        async with asyncio.timeout(10):
            while app.state.webhooks.pending() == pending:
                await asyncio.sleep(0.01)
        for name, data, endpoint in (("not async", {**form, "webhook": ORIGIN}, "/v1/edits"),
                                     ("other origin", {**form, "async": "1", "webhook": "http://10.0.0.1/"},
                                      "/v1/edits"),
                                     ("openai", {"prompt": "p", "webhook": ORIGIN}, "/v1/images/edits")):
            seen[name] = await client.post(endpoint, headers=auth(), data=data, files=mask_file())
        seen["cancelled deliveries"] = await app.state.webhooks.close(time.monotonic())
        app.state.jobs.folder.close()
    return seen


def test_an_asynchronous_edit_calls_its_webhook_and_a_restart_sends_an_undelivered_one(tmp_path):
    seen = asyncio.run(webhooked_edits(tmp_path))
    request = seen["requests"][0]
    assert str(request.url) == ORIGIN + "/done?job=1" and seen["no-store"]
    payload = Webhook(seen["secret"]).verify(request.content, dict(request.headers))  # the tenant's own secret
    with pytest.raises(Exception, match="signature"):
        Webhook(seen["other secret"]).verify(request.content, dict(request.headers))
    assert payload["type"] == "edit.completed" and payload["data"]["id"] == seen[str(request.url)].json()["id"]
    assert payload["data"]["status"] == "completed" and payload["data"]["result_url"].endswith("/result")
    for name in ("not async", "other origin", "openai"):
        assert seen[name].status_code == 400 and seen[name].json()["error"]["param"] == "webhook", name
    assert seen["cancelled deliveries"] == 2
    # A restarted server sends the undelivered ones (not the delivered one, nor the one whose receiver is gone)
    # once it runs, and only to the origins it still allows (the other is refused for good).
    restarted = asyncio.run(restart_and_resume(tmp_path))
    assert [str(request.url) for request in restarted["requests"]] == [ORIGIN + "/late"]
    assert restarted["resumed"] == 1 and restarted["resumed again"] == 0
    Webhook(seen["secret"]).verify(restarted["requests"][0].content, dict(restarted["requests"][0].headers))


async def restart_and_resume(directory: Path) -> dict:
    from retouch.engine.router import Router, RouterConfig
    from retouch.http_api import Limits, create_app

    seen = {}
    for attempt, origins in (("resumed", (ORIGIN,)), ("resumed again", (ORIGIN, ORIGIN2))):
        router = Router(RouterConfig(address="tcp://127.0.0.1:0")).start()
        app = create_app(router, Limits(api_keys=("sk-a", "sk-b"), webhook_origins=origins, webhook_secret=SECRET),
                         answers=AnswerFolder(directory))
        receiver = Receiver()
        app.state.webhooks.transport = httpx.MockTransport(receiver)
        seen[attempt] = app.state.resume_webhooks()
        while app.state.webhooks.pending():
            await asyncio.sleep(0.01)
        await app.state.webhooks.close()
        seen.setdefault("requests", receiver.requests)
        await asyncio.to_thread(app.state.jobs.folder.close)
        router.close(drain_s=0)
    return seen


def test_one_webhook_that_cannot_be_sent_does_not_stop_the_others(tmp_path):
    """A restarted server sends its held webhooks as it starts: one failing must not fail its start."""
    from retouch.edit_jobs import Job, Outcome, Reply
    from retouch.engine.router import Router, RouterConfig
    from retouch.http_api import Limits, create_app

    folder = AnswerFolder(tmp_path)
    for job_id in ("e1", "e2"):
        job = Job(job_id, "", "tpl", runs_async=True, webhook=ORIGIN + "/" + job_id)
        job.outcome, job.ended_at = Outcome("completed", 200, Reply({}, None, (b"img",), "image/png")), time.time()
        folder.save(job)
    folder.close()
    router = Router(RouterConfig(address="tcp://127.0.0.1:0")).start()
    answers = AnswerFolder(tmp_path)
    try:
        app = create_app(router, Limits(webhook_origins=(ORIGIN,), webhook_secret=SECRET), answers=answers)
        calls = []

        def send(*args, **kwargs):
            calls.append(args[2])
            if len(calls) == 1:
                raise OSError(75, "Value too large")
            return True
        app.state.webhooks.send = send
        assert app.state.resume_webhooks() == 1 and len(calls) == 2
    finally:
        answers.close()
        router.close(drain_s=0)
