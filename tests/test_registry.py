"""The template registry: registered templates saved whole and read back (the router's records across
a restart); one-offs not kept; a template saved in part, or damaged, skipped; a deleted one gone; one
that cannot be saved is not registered, one whose files cannot be removed is not deleted."""

from __future__ import annotations

import asyncio
import errno
import io
import json

import httpx
import pytest
import zmq
from PIL import Image
from scripted_worker import ScriptedWorker

from retouch.engine.registry import TemplateRegistry
from retouch.engine.router import RegistryError, Router, RouterConfig, TemplateRecord, TemplateStorageFull
from retouch.http_api import Limits, create_app


def record(template_id: str, **fields) -> TemplateRecord:
    values = {"image": b"\x89PNG image of " + template_id.encode(), "size": (48, 32), "prompt": "a room",
              "steps": 4, "seed": 7, "guidance": None, "replicas": 0, "owner": "0123abcd", **fields}
    return TemplateRecord(template_id, values.pop("image"), values.pop("size"), values.pop("prompt"),
                          values.pop("steps"), values.pop("seed"), values.pop("guidance"), **values)


def fields(template: TemplateRecord) -> tuple:
    return (template.template_id, template.image, template.size, template.prompt, template.steps, template.seed,
            template.guidance, template.replicas, template.owner, template.created, template.alpha,
            template.negative_prompt)


def test_saved_templates_are_read_back_whole_oldest_first_and_one_offs_are_not_kept(tmp_path):
    registry = TemplateRegistry(tmp_path)
    registry.close()  # the folder's lock; saving and loading do not need it held
    kept = [record("tpl-00aa11bb", created=2.0, guidance=3.5, alpha=b"alpha png", negative_prompt="blurry"),
            record("tpl-00cc22dd", created=1.0)]  # no negative prompt: saved as earlier releases saved it
    for template in kept:
        registry.save(template)
    registry.save(record("img-00ee33ff", one_off=True))
    assert [fields(t) for t in TemplateRegistry(tmp_path).load()] == [fields(kept[1]), fields(kept[0])]
    plain = json.loads((tmp_path / "tpl-00cc22dd.json").read_bytes())
    assert "negative_prompt" not in plain and plain["format"] == 1
    # An earlier release reads format 1 only: it skips a record it would read without its negative prompt.
    assert json.loads((tmp_path / "tpl-00aa11bb.json").read_bytes())["format"] == 2
    registry.remove("tpl-00aa11bb")
    assert [t.template_id for t in registry.load()] == ["tpl-00cc22dd"]
    assert sorted(p.name for p in tmp_path.glob("tpl-*")) == ["tpl-00cc22dd.json", "tpl-00cc22dd.png"]


def test_a_template_saved_in_part_or_damaged_is_skipped(tmp_path, caplog):
    registry = TemplateRegistry(tmp_path)
    for template_id in ("tpl-00000001", "tpl-00000002", "tpl-00000003"):
        registry.save(record(template_id))
    registry.save(record("tpl-00000005", alpha=b"alpha png"))
    (tmp_path / "tpl-00000001.json").unlink()  # stopped before its header: not saved whole
    (tmp_path / "tpl-00000002.json").write_text("{not json")
    (tmp_path / "tpl-00000004.png").write_bytes(b"an image without a header")
    (tmp_path / "tpl-00000005.alpha.png").unlink()  # answered opaque, it would not be the template it was
    assert [t.template_id for t in registry.load()] == ["tpl-00000003"]
    assert "tpl-00000002" in caplog.text and "transparency file is missing" in caplog.text


def test_one_server_at_a_time_uses_a_folder(tmp_path):
    import pytest

    from retouch.errors import InputError

    first = TemplateRegistry(tmp_path)
    with pytest.raises(InputError, match="another retouch serve uses"):
        TemplateRegistry(tmp_path)
    first.close()
    TemplateRegistry(tmp_path).close()  # free again once the first has closed


def test_the_router_starts_with_the_kept_templates_and_keeps_what_changes(tmp_path):
    """A router on a registry registers what it held on each worker that joins; a new registration is
    saved, a deletion removed."""
    kept = TemplateRegistry(tmp_path)
    kept.save(record("tpl-0000aaaa"))
    kept.close()
    router = Router(RouterConfig(address="tcp://127.0.0.1:0", heartbeat_s=0.05, dead_after_s=60.0),
                    registry=TemplateRegistry(tmp_path)).start()
    context = zmq.Context()
    try:
        assert router.template("tpl-0000aaaa", "0123abcd")["status"] == "recording"
        assert router.template("tpl-0000aaaa", "another tenant") is None
        worker = ScriptedWorker(context, router, "w0")
        assert worker.receive("register")["template"] == "tpl-0000aaaa"
        router.register_template(record("tpl-0000bbbb"))
        assert router.drop_template("tpl-0000aaaa")
    finally:
        router.close(drain_s=0)
        context.destroy(linger=0)
    registry = TemplateRegistry(tmp_path)  # the router's, closed with it
    assert [t.template_id for t in registry.load()] == ["tpl-0000bbbb"]


def test_a_restarted_router_sends_a_joining_worker_the_templates_most_recently_edited_first(tmp_path):
    """The order in which templates were edited is kept when the router closes: after a restart a joining
    worker records the ones in use first (it got them newest registered first, each a generation). A
    template registered after the order was kept comes first."""
    from retouch.engine.policies import RequestLoad
    from retouch.engine.router import EditTask

    config = RouterConfig(address="tcp://127.0.0.1:0", policy="least-requests", heartbeat_s=0.05, dead_after_s=60.0)
    router = Router(config, registry=TemplateRegistry(tmp_path)).start()
    context = zmq.Context()
    try:
        worker = ScriptedWorker(context, router, "w0")
        for i, template_id in enumerate(("tpl-0000aaaa", "tpl-0000bbbb", "tpl-0000cccc")):
            router.register_template(record(template_id, created=float(i)))
            worker.register(template_id)
        answer = router.submit(EditTask("tpl-0000aaaa", bytes(48 * 32), (48, 32), "a cat", 0,
                                        RequestLoad(image_tokens=6, masked_tokens=2, steps=4)))
        worker.answer(worker.receive("edit")["request"])
        assert answer.result(10).status == 200
    finally:
        router.close(drain_s=0)
    late = TemplateRegistry(tmp_path)
    late.save(record("tpl-0000dddd", created=3.0))  # as if registered after the order was kept
    late.close()
    router = Router(config, registry=TemplateRegistry(tmp_path)).start()
    try:
        worker = ScriptedWorker(context, router, "w0")
        sent = [worker.receive("register")["template"] for _ in range(4)]
        assert sent == ["tpl-0000dddd", "tpl-0000aaaa", "tpl-0000cccc", "tpl-0000bbbb"]
    finally:
        router.close(drain_s=0)
        context.destroy(linger=0)


def test_a_damaged_order_of_edits_is_said_and_the_registration_order_used(tmp_path, caplog):
    registry = TemplateRegistry(tmp_path)
    registry.save_recency(["tpl-0000bbbb", "../escape", "tpl-0000aaaa"])
    assert registry.recency() == ["tpl-0000bbbb", "tpl-0000aaaa"]  # only template ids are kept
    (tmp_path / "recency.json").write_text('{"format": 1, "ids": 7}')
    assert registry.recency() == [] and "recency.json cannot be read" in caplog.text
    registry.close()


def test_kept_templates_over_the_memory_bound_are_all_served_and_new_ones_refused(tmp_path, caplog):
    """A server restarted with a smaller --max-templates-mb keeps every template its clients registered
    (said in the log) and refuses new ones until deletions bring it under the bound."""
    kept = TemplateRegistry(tmp_path)
    for template_id in ("tpl-0000aaaa", "tpl-0000bbbb"):
        kept.save(record(template_id))
    kept.close()
    size = len(record("tpl-0000aaaa").image)
    router = Router(RouterConfig(address="tcp://127.0.0.1:0", max_template_bytes=size),
                    registry=TemplateRegistry(tmp_path)).start()
    try:
        assert "hold 0 MiB, over the 0 MiB allowed (--max-templates-mb)" in caplog.text
        assert {t["id"] for t in router.list_templates("0123abcd")} == {"tpl-0000aaaa", "tpl-0000bbbb"}
        with pytest.raises(TemplateStorageFull):
            router.register_template(record("tpl-0000cccc"))
        assert router.drop_template("tpl-0000aaaa") and router.drop_template("tpl-0000bbbb")
        router.register_template(record("tpl-0000cccc"))
    finally:
        router.close(drain_s=0)


class FailingRegistry(TemplateRegistry):
    """A registry on a full disk (saves fail) whose files cannot be removed either, while `failing`."""

    failing = True

    def save(self, record):
        if self.failing:
            raise OSError(errno.ENOSPC, "No space left on device")
        super().save(record)

    def remove(self, template_id):
        if self.failing:
            raise OSError(errno.EACCES, "Permission denied")
        super().remove(template_id)


def test_a_template_that_cannot_be_saved_is_refused_and_one_that_cannot_be_removed_stays(tmp_path):
    registry = FailingRegistry(tmp_path)
    router = Router(RouterConfig(address="tcp://127.0.0.1:0"), registry=registry).start()
    try:
        with pytest.raises(RegistryError, match="No space left on device"):
            router.register_template(record("tpl-0000aaaa"))
        assert router.template("tpl-0000aaaa") is None  # its id would not outlive the server: not handed out
        registry.failing = False
        router.register_template(record("tpl-0000aaaa", owner=""))  # the tenant of a server without keys
        registry.failing = True
        with pytest.raises(RegistryError, match="could not be removed"):
            router.drop_template("tpl-0000aaaa")
        assert router.template("tpl-0000aaaa") is not None  # not forgotten now to come back after a restart
        assert router.snapshot()["counters"]["registry_failures"] == 2

        async def over_http() -> tuple[httpx.Response, httpx.Response]:
            app = create_app(router, Limits(default_steps=4))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
                image = io.BytesIO()
                Image.new("RGB", (16, 16), "red").save(image, format="PNG")
                registered = await client.post("/v1/templates", files={"image": ("t.png", image.getvalue())})
                return registered, await client.delete("/v1/templates/tpl-0000aaaa")

        registered, deleted = asyncio.run(over_http())
        assert registered.status_code == 507 and registered.json()["error"]["code"] == "storage_error"
        assert router.list_templates() == [router.template("tpl-0000aaaa")]  # nothing registered
        assert deleted.status_code == 500 and "still registered" in deleted.json()["error"]["message"]
        registry.failing = False
        assert router.drop_template("tpl-0000aaaa") and router.template("tpl-0000aaaa") is None
    finally:
        router.close(drain_s=0)
    assert TemplateRegistry(tmp_path).load() == []
