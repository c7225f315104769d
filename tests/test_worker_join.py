"""A worker joining a server that has templates already: it is sent every one (most recently edited
first), records them one at a time while its caches have room beside each other, and knows the rest, each
recorded by its first edit there. Recording them all took a generation each, and the last ones pushed out
the first (with 1,000 templates and room for a few: hours of GPU, and a worker the router kept avoiding,
every recording weighed as its load)."""

from __future__ import annotations

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
