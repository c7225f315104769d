"""A worker joining a server that has templates already: it is sent every one (most recently edited
first), records them one at a time while its caches have room beside each other, and knows the rest, each
recorded by its first edit there. Recording them all took a generation each, and the last ones pushed out
the first (with 1,000 templates and room for a few: hours of GPU, and a worker the router kept avoiding,
every recording weighed as its load)."""

from __future__ import annotations

import dataclasses
import io
import threading

from editor_inputs import square_mask, template_image
from scripted_worker import TIMEOUT_S

from retouch.cache import CacheStore, StoreConfig
from retouch.editor import MaskAwareEditor
from retouch.engine.api import Engine
from retouch.engine.node import Node
from retouch.engine.policies import RequestLoad
from retouch.engine.router import EditTask, TemplateRecord
from retouch.engine.worker import EngineConfig
from retouch.models import load_pipeline

STEPS = 4


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_joining_worker_records_what_its_caches_hold_one_at_a_time_and_the_rest_on_first_edit(make_router):
    probe = MaskAwareEditor(load_pipeline("tiny-flux-fill"))
    size = probe.cache.nbytes(probe.register_template(template_image(), prompt="a room", steps=STEPS, seed=0))
    router = make_router()
    images = [template_image((50 * i, 90, 30)) for i in range(4)]
    for i, image in enumerate(images):
        router.register_template(TemplateRecord(f"t{i}", png(image), image.size, "a room", STEPS, i, None, 0))
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"), cache=CacheStore(StoreConfig(host_bytes=2 * size + 4096)))
    engine = Engine(editor, EngineConfig(mode="naive")).start()
    overlaps = []  # per recording started: whether another was still under way
    submit_recording = engine.submit_recording

    def one_at_a_time(template, on_step=None, only_if_room=False):
        overlaps.append(any(not job.future.done() for job in list(engine._recordings.values())))
        return submit_recording(template, on_step, only_if_room)

    engine.submit_recording = one_at_a_time
    node = Node(engine, router.address, "n0", supervised=False)
    thread = threading.Thread(target=node.run, name="test-node")
    thread.start()
    try:
        assert router.wait_until(lambda r: all(r.template(f"t{i}")["status"] == "ready" for i in range(4)), TIMEOUT_S)
        assert overlaps == [False] * 4
        assert engine.metrics()["deferred_recordings"] == 2 and editor.cache.metrics()["evictions"] == 0
        recorded = [editor.is_recorded(node.templates[f"t{i}"]) for i in range(4)]
        assert sorted(recorded) == [False, False, True, True]
        deferred = f"t{recorded.index(False)}"
        mask = square_mask()
        answer = router.submit(EditTask(deferred, mask.tobytes(), mask.size, "a red hat", 5,
                                        RequestLoad(image_tokens=64, masked_tokens=16, steps=STEPS)))
        assert answer.result(TIMEOUT_S * 6).status == 200
        assert editor.recomputes == 1 and editor.is_recorded(node.templates[deferred])
    finally:
        node.stop()
        thread.join(TIMEOUT_S * 6)
    assert not thread.is_alive()


def serve_a_worker(router, cache: CacheStore, name: str = "n1") -> tuple[Engine, Node, threading.Thread]:
    engine = Engine(MaskAwareEditor(load_pipeline("tiny-flux-fill"), cache=cache), EngineConfig(mode="naive")).start()
    node = Node(engine, router.address, name, supervised=False)
    thread = threading.Thread(target=node.run, name=f"test-node-{name}")
    thread.start()
    return engine, node, thread


def test_a_restarted_worker_adopts_the_recordings_its_disk_tier_holds_though_another_holds_the_replicas(
        make_router, context, tmp_path):
    """`--template-replicas 1` and a whole server restarted: the first worker to say hello took every
    template, and the others' recordings on disk were never adopted. A worker's hello says which of the
    router's templates its disk tier holds (their names are kept beside the recordings): it is sent those
    to adopt, each one more replica at the cost of a file's header."""
    from scripted_worker import ScriptedWorker

    records = [TemplateRecord(f"t{i}", png(template_image((90 * i, 90, 30))), (128, 128), "a room", STEPS, i, None, 0)
               for i in range(2)]

    def store() -> CacheStore:
        return CacheStore(StoreConfig(host_bytes=64 << 20, disk_dir=tmp_path / "n1", disk_bytes=64 << 20))

    first = make_router(template_replicas=1)
    for record in records:
        first.register_template(record)
    engine, node, thread = serve_a_worker(first, store())
    try:
        assert first.wait_until(lambda r: all(r.template(t.template_id)["status"] == "ready" for t in records),
                                TIMEOUT_S * 6)
    finally:
        node.stop()
        thread.join(TIMEOUT_S * 6)
    engine.editor.cache.close()

    again = make_router(template_replicas=1)  # the server restarted: its registry gives back the same ids
    for record in records:
        again.register_template(dataclasses.replace(record, states={}, progress={}))
    other = ScriptedWorker(context, again, "w0")  # says hello first: sent both templates, to record
    assert sorted(other.receive("register")["template"] for _ in records) == ["t0", "t1"]
    engine, node, thread = serve_a_worker(again, store())
    try:
        assert again.wait_until(lambda r: all(r.template(t.template_id)["progress"]["workers_ready"] == 1
                                              for t in records), TIMEOUT_S)
        assert "w0" in again.snapshot()["workers"]  # still holding the replicas it was sent: not a takeover
        metrics = engine.editor.cache.metrics()
        assert metrics["adoptions"] == 2 and metrics["registrations"] == 0  # adopted, nothing recorded
        assert all(again.templates[t.template_id].states.get("n1") == "ready" for t in records)
    finally:
        node.stop()
        thread.join(TIMEOUT_S * 6)


def test_a_template_asked_for_by_name_leaves_the_bulk_queue_and_is_recorded_now(make_router):
    router = make_router()
    engine = Engine(MaskAwareEditor(load_pipeline("tiny-flux-fill")), EngineConfig(mode="naive")).start()
    node = Node(engine, router.address, "n1", supervised=False)  # not run: its messages are handed to it here
    try:
        messages = [({"template": f"t{i}", "prompt": "a room", "steps": STEPS, "seed": i, "guidance": None},
                     {"image": png(template_image((90 * i, 90, 30)))}) for i in range(3)]
        for header, blobs in messages:
            node._register({**header, "bulk": True}, blobs)
        assert [queued[0] for queued in node._bulk] == ["t1", "t2"]  # t0 records, the others wait their turn
        node._register(*messages[2])  # an edit waits for t2
        assert [queued[0] for queued in node._bulk] == ["t1"] and set(node.registrations) == {"t0", "t2"}
        for _, future in list(node.registrations.values()):
            future.result(TIMEOUT_S * 6)
    finally:
        engine.close()
        node.socket.close(linger=0)
        node._wakeup.close()
        node.context.term()
