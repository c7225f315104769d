"""Recordings as members of the running batch, one generation per one-off edit, and cancellation at
step granularity, in the engine's loop (issue 15). The loop runs on the test's thread where the order
of events matters (`test_engine.run`)."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np
import pytest
import torch
from editor_inputs import max_diff, square_mask, template_image
from loop_runs import run_loop
from mask_strategies import random_image
from PIL import Image
from test_engine import BATCH_ATOL, TINY_MODELS, final_latents, run

from retouch.baseline import run_baseline_edit
from retouch.editor import EditRequest, MaskAwareEditor
from retouch.engine.api import Engine
from retouch.engine.processing import prepare_recording
from retouch.engine.worker import EngineConfig, StepWatch, Worker
from retouch.models import load_pipeline

STEPS = 4


def batch_bound(reference: torch.Tensor) -> float:
    """How far a result may move when its rows share a batch with others: BLAS blockings change the
    summation order (tests/test_editor.py measures it); 32 fp32 ulps at the values' scale."""
    return max(BATCH_ATOL, 32 * torch.finfo(torch.float32).eps * reference.abs().max().item())


def edits_of(template_id: str) -> list[EditRequest]:
    boxes = [(0, 0, 31, 31), (32, 32, 79, 63), (96, 16, 127, 127), (16, 80, 63, 111)]
    return [EditRequest(template_id, square_mask(box), "a red hat", seed=i) for i, box in enumerate(boxes)]


def recorded_activations(editor: MaskAwareEditor, template_id: str, steps: int) -> dict:
    with editor.cache.acquire(template_id) as handle:
        names = sorted({entry.name for entry in handle.layout.entries})
        return {(step, block, name): handle.read(step, block, name).clone()
                for step in range(steps) for block in range(editor.adapter.num_blocks) for name in names}


@pytest.mark.parametrize("cache_mode", ["y", "kv"])
@pytest.mark.parametrize("model", TINY_MODELS)
def test_a_registration_joins_the_running_batch_without_stopping_it(model, cache_mode):
    editor = MaskAwareEditor(load_pipeline(model), cache_mode=cache_mode)
    template_id = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=3)
    requests = edits_of(template_id)
    postprocessed = []  # as the helper processes would: not on the loop's thread
    _, alone = run(editor, EngineConfig(mode="naive"), requests, send_to_postprocess=postprocessed.append)

    # The same edits while another template registers: it joins at the loop's second step, prepared
    # beforehand as a helper process would, and records beside the edits in the same forwards.
    new = editor.new_template(template_image((200, 90, 30)), prompt="a room", steps=STEPS, seed=5)
    recording = Worker.new_job(None, recording=new)
    recording.ready = prepare_recording(editor, new)
    sizes = []

    def inject(worker, step):
        sizes.append(len(worker.running))
        if step == 2:
            worker.inbox.put(("ready", recording))

    worker, beside = run(editor, EngineConfig(mode="naive"), requests, inject, postprocessed.append)
    assert recording.future.result() == new.template_id
    assert worker.metrics.interruptions == 0 and worker.metrics.recorded == 1
    assert max(sizes) == 5  # the recording and the four edits in one batch
    for a, b in zip(alone, beside):
        assert max_diff(final_latents(a), final_latents(b)) <= batch_bound(final_latents(a))

    # The recording equals a standalone one, and edits of it are the same.
    standalone = MaskAwareEditor(load_pipeline(model), cache_mode=cache_mode)
    assert standalone.register_template(template_image((200, 90, 30)), prompt="a room", steps=STEPS,
                                        seed=5) == new.template_id
    calls = STEPS + (model == "tiny-sd2-inpaint")  # PNDM warms up with one more call
    ours, theirs = (recorded_activations(e, new.template_id, calls) for e in (editor, standalone))
    assert ours.keys() == theirs.keys()
    # Deep blocks accumulate the reordering of every block before them: allow 4x the bound (measured
    # up to 46 ulps at the activation's scale, SD2 KV-cache).
    assert all(max_diff(ours[k], theirs[k]) <= 4 * batch_bound(theirs[k]) for k in ours)
    edit = EditRequest(new.template_id, square_mask(), "a cat", seed=9)
    reference = standalone.edit_many([edit], output_type="latent")[0]
    assert max_diff(editor.edit_many([edit], output_type="latent")[0], reference) <= batch_bound(reference)


@pytest.mark.parametrize("model", TINY_MODELS)
def test_the_first_one_off_edit_is_the_baseline_and_the_next_one_is_mask_aware(model):
    image = random_image((61, 47), seed=2)
    first_mask = Image.new("L", image.size, 0)
    first_mask.paste(255, (8, 8, 30, 30))
    second_mask = Image.new("L", image.size, 0)
    second_mask.paste(255, (40, 20, 60, 40))
    editor = MaskAwareEditor(load_pipeline(model))
    baseline = run_baseline_edit(editor.pipe, image, first_mask, "a red hat", steps=STEPS, seed=7,
                                 call_defaults=editor.model.call_defaults)
    with Engine(editor, EngineConfig(mode="naive")) as engine:
        first = engine.submit_image(image, first_mask, "a red hat", seed=7, steps=STEPS).result(timeout=120)
        second = engine.submit_image(image, second_mask, "a blue bird", seed=8, steps=STEPS).result(timeout=120)
        metrics = engine.metrics()
    assert np.abs(np.asarray(first.image, int) - np.asarray(baseline, int)).max() <= 1  # 8-bit rounding
    assert first.recorded is not None and second.recorded is None
    assert first.metrics.computed_tokens == first.metrics.tokens  # the first run computes everything
    assert second.metrics.computed_tokens < second.metrics.tokens  # the second is mask-aware
    assert metrics["recorded"] == 1 and metrics["interruptions"] == 0
    keep = np.asarray(second_mask) == 0
    assert np.array_equal(np.asarray(second.image)[keep], np.asarray(image)[keep])


def test_a_one_off_image_edited_below_full_strength_twice_is_recorded_as_a_full_strength_edit_would():
    """Below strength 1 an edit runs only the last steps and records nothing; the image's second such edit
    also records it, beside itself, as that edit at full strength would have: the next edit is
    mask-aware, and is what it would be after a first edit at full strength."""
    image = random_image((61, 47), seed=4)
    masks = [Image.new("L", image.size, 0) for _ in range(3)]
    for mask, box in zip(masks, [(8, 8, 30, 30), (30, 10, 50, 30), (20, 20, 40, 44)]):
        mask.paste(255, box)
    edits = [(masks[0], "a red hat", 1), (masks[1], "a blue bird", 2), (masks[2], "a green cup", 3)]
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"))
    with Engine(editor, EngineConfig(mode="naive")) as engine:
        first, second = (engine.submit_image(image, mask, prompt, seed, steps=STEPS, strength=0.5).result(timeout=120)
                         for mask, prompt, seed in edits[:2])
        template = editor.one_off_template(image, *edits[1], steps=STEPS)
        recorded = engine.submit_recording(template).result(timeout=120)  # the recording under way, or done
        third = engine.submit_image(image, *edits[2], steps=STEPS, strength=0.5).result(timeout=120)
    assert first.recorded is None and second.recorded is None and recorded == template.template_id
    assert first.metrics.computed_tokens == first.metrics.tokens == second.metrics.computed_tokens
    assert third.metrics.computed_tokens < third.metrics.tokens
    alone = MaskAwareEditor(load_pipeline("tiny-flux-fill"))
    alone.edit_image(image, *edits[1], steps=STEPS)  # a first edit at full strength records the image
    expected = alone.edit_image(image, *edits[2], steps=STEPS, strength=0.5)
    assert np.abs(np.asarray(third.image, int) - np.asarray(expected, int)).max() <= 1


def test_one_off_edits_and_templates_of_one_image_in_other_scopes_share_no_recording():
    """A server's tenants are scopes: the second tenant's first edit of an image another tenant recorded is
    computed in full (nothing tells it the image was sent before), is the stock pipeline's result for its own
    prompt, and records the image for its own later edits."""
    image = random_image((61, 47), seed=5)
    first, second = Image.new("L", image.size, 0), Image.new("L", image.size, 0)
    first.paste(255, (8, 8, 30, 30))
    second.paste(255, (30, 20, 50, 40))
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"))
    baseline = run_baseline_edit(editor.pipe, image, first, "a blue bird", steps=STEPS, seed=2,
                                 call_defaults=editor.model.call_defaults)
    with Engine(editor, EngineConfig(mode="naive")) as engine:
        theirs = engine.submit_image(image, second, "a red car", seed=1, steps=STEPS, scope="tpl-a").result(timeout=120)
        mine = engine.submit_image(image, first, "a blue bird", seed=2, steps=STEPS, scope="tpl-b").result(timeout=120)
        again = engine.submit_image(image, second, "a cup", seed=3, steps=STEPS, scope="tpl-b").result(timeout=120)
        # Registrations likewise: the same image and run in two scopes are two recordings; dropping one keeps the other.
        registered = [engine.submit_recording(editor.new_template(image, "a room", STEPS, scope=scope)).result(
            timeout=120) for scope in ("tpl-a", "tpl-b")]
        engine.drop_template(registered[0])
    assert theirs.recorded is not None and mine.recorded not in (None, theirs.recorded)
    assert mine.metrics.computed_tokens == mine.metrics.tokens
    assert np.abs(np.asarray(mine.image, int) - np.asarray(baseline, int)).max() <= 1
    assert again.recorded is None and again.metrics.computed_tokens < again.metrics.tokens  # its own recording
    assert editor.one_off_id(image, STEPS, None) not in (theirs.recorded, mine.recorded)  # no scope: another
    assert registered[0] != registered[1]
    assert not editor.is_recorded(registered[0]) and editor.is_recorded(registered[1])


def test_a_one_off_edit_whose_recording_does_not_fit_the_host_cache_answers_unrecorded(caplog):
    """The recording is the edit's by-product: when the host cache cannot hold it, the edit still answers
    (computed in full, the stock pipeline's result) and records nothing; a registration fails saying why.
    The operator hears of it once (a warning naming the flag) and counts every one (`unrecorded`)."""
    from retouch.cache import CacheStore, StoreConfig

    image = random_image((61, 47), seed=3)
    mask = Image.new("L", image.size, 0)
    mask.paste(255, (8, 8, 30, 30))
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"), cache=CacheStore(StoreConfig(host_bytes=4096)))
    baseline = run_baseline_edit(editor.pipe, image, mask, "a red hat", steps=STEPS, seed=7,
                                 call_defaults=editor.model.call_defaults)
    said = []
    watch = StepWatch(on_unrecorded=said.append)
    with Engine(editor, EngineConfig(mode="naive")) as engine, caplog.at_level("WARNING", "retouch.worker"):
        answer = engine.submit_image(image, mask, "a red hat", seed=7, steps=STEPS, watch=watch).result(timeout=120)
        assert said == ["too_large"]  # once, with the reason, as the router hears it
        def broken(reason: str) -> None:
            raise RuntimeError("the watcher broke")

        again = engine.submit_image(image, mask, "a blue hat", seed=8, steps=STEPS,
                                    watch=StepWatch(on_unrecorded=broken)).result(timeout=120)
        assert engine.worker.metrics.watch_errors == 1  # the watcher's failure: counted, the edit answered
        with pytest.raises(Exception, match=r"host cache .*--cache-host-gib"):
            engine.submit_template(image, "a room", steps=STEPS).result(timeout=120)
        summary = engine.worker.metrics.summary()
        assert summary["unrecorded"] == 2 and summary["recorded"] == 0
        # the registration's failure is the operator's (the cache is too small), not an edit's
        assert (summary["failed"], summary["failed_recordings"], summary["completed"]) == (0, 1, 2)
    warnings = [record.getMessage() for record in caplog.records if record.name == "retouch.worker"]
    assert len(warnings) == 1 and "--cache-host-gib" in warnings[0] and "not be mask-aware" in warnings[0]
    assert again.recorded is None and (answer.unrecorded, again.unrecorded) == ("too_large", "too_large")
    assert answer.recorded is None and answer.metrics.computed_tokens == answer.metrics.tokens
    assert np.abs(np.asarray(answer.image, int) - np.asarray(baseline, int)).max() <= 1
    assert not editor.is_recorded(editor.one_off_id(image, STEPS, None))
    inline = editor.edit_image(image, mask, "a red hat", seed=7, steps=STEPS)  # the editor's own, likewise
    assert np.abs(np.asarray(inline, int) - np.asarray(baseline, int)).max() <= 1
    assert not editor.is_recorded(editor.one_off_id(image, STEPS, None))


def test_later_one_off_edits_recompute_the_region_the_first_one_repainted():
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"))
    image = random_image((64, 64), seed=4)
    repainted = Image.new("L", image.size, 0)
    repainted.paste(255, (0, 0, 16, 16))
    editor.edit_image(image, repainted, "a red hat", seed=1, steps=STEPS)
    template_id = editor.one_off_id(image, STEPS, None)
    other = Image.new("L", image.size, 0)
    other.paste(255, (48, 48, 64, 64))
    inputs = editor.prepare_edit(editor.check_request(EditRequest(template_id, other, "a cat", seed=2)))
    assert inputs.masked_idx.tolist() == [0, 15]  # its own token and the one the recording repainted
    # Replay identity: the recorded request again, mask-aware, is its full computation.
    replay = EditRequest(template_id, repainted, "a red hat", seed=1)
    assert max_diff(editor.edit_many([replay], output_type="latent")[0],
                    editor.edit_many([replay], output_type="latent", full_compute=True)[0]) <= 1e-5


def test_cancelled_requests_leave_the_batch_at_the_next_step():
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"))
    template_id = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=3)
    requests = edits_of(template_id)[:3]
    _, alone = run(editor, EngineConfig(mode="naive"), requests)
    new = editor.new_template(template_image((1, 2, 3)), prompt="a room", steps=STEPS, seed=5)
    recording = Worker.new_job(None, recording=new)
    recording.ready = prepare_recording(editor, new)
    seen = {}

    def inject(worker, step):
        if step == 1:
            worker.inbox.put(("ready", recording))
        if step == 2:
            assert worker.running[0].future.cancel() and recording.future.cancel()
        seen[step] = len(worker.running)

    worker, jobs = run(editor, EngineConfig(mode="naive"), requests, inject)
    assert seen[2] == 4 and seen[3] == 2  # both left before the next step ran
    assert jobs[0].metrics.steps == 2 and recording.metrics.steps == 1
    assert worker.metrics.cancelled == 2 and not editor.cache.contains(new.template_id)
    assert editor.cache.metrics()["host_bytes_used"] == editor.cache.nbytes(template_id)  # its steps were freed
    for a, b in zip(alone[1:], jobs[1:]):
        assert max_diff(final_latents(a), final_latents(b)) <= batch_bound(final_latents(a))


def test_drop_template_stops_its_recording():
    with Engine(MaskAwareEditor(load_pipeline("tiny-flux-fill")), EngineConfig(mode="naive")) as engine:
        progress, recording = [], threading.Event()

        def on_step(step: int, steps: int) -> None:
            progress.append(step)
            recording.set()

        future = engine.submit_template(template_image(), prompt="a scene", steps=50, seed=1, on_step=on_step)
        template_id = engine.editor.new_template(template_image(), prompt="a scene", steps=50, seed=1).template_id
        assert recording.wait(60)
        engine.drop_template(template_id)  # returns between two steps; the recording is gone before the next
        assert future.cancelled()
        stopped_at = len(progress)
        engine.edit(engine.register_template(template_image((5, 5, 5)), steps=2), square_mask(), "a hat")
        assert len(progress) == stopped_at <= 50 - 1
        assert not engine.editor.cache.contains(template_id) and template_id not in engine.editor.templates
        assert engine.metrics()["cancelled"] == 1


def test_disaggregated_engine_records_and_edits_one_offs_with_no_interruptions():
    """End to end through a helper process: registrations and one-off edits are prepared there and
    recorded in the loop beside running edits."""
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"))
    image = random_image((61, 47), seed=8)
    mask = Image.new("L", image.size, 0)
    mask.paste(255, (5, 5, 25, 25))
    with Engine(editor, EngineConfig(mode="disagg", max_batch=8)) as engine:
        template_id = engine.register_template(template_image(), prompt="a scene", steps=STEPS, seed=3)
        edits = [engine.submit(request) for request in edits_of(template_id)]
        registration = engine.submit_template(template_image((9, 99, 9)), prompt="a room", steps=STEPS, seed=4)
        one_offs = [engine.submit_image(image, mask, "a hat", seed=5, steps=STEPS) for _ in range(2)]
        results = [future.result(timeout=300) for future in edits + one_offs]
        assert registration.result(timeout=300) in engine.editor.templates
        later = engine.submit_image(image, mask, "a hat", seed=6, steps=STEPS).result(timeout=300)
        metrics = engine.metrics()
    assert metrics["interruptions"] == 0 and metrics["recorded"] == 3  # the template, the image, the registration
    first, duplicate = results[-2:]
    # The second, sent while the first records the image, is computed in full without recording.
    assert [first.recorded is not None, duplicate.recorded is not None] == [True, False]
    assert np.abs(np.asarray(first.image, int) - np.asarray(duplicate.image, int)).max() <= 2
    assert later.metrics.computed_tokens < later.metrics.tokens
    keep = np.asarray(mask) == 0
    assert all(np.array_equal(np.asarray(r.image)[keep], np.asarray(image)[keep]) for r in (first, duplicate, later))


def test_a_registration_whose_host_cache_is_held_by_another_starts_over_instead_of_failing():
    """Two registrations admitted together into a host cache that holds one recording: their last steps
    no longer fit, and they used to fail ("do not fit the host cache") although the memory was only lent
    to each other. One now starts over once the other has left, and both answer; the first's template is
    then evicted (no disk tier here) to make room, as any least recently used template would be."""
    from retouch.cache import CacheStore, StoreConfig

    def registrations(editor, images):
        return [Worker.new_job(None, recording=editor.new_template(image, "a room", STEPS)) for image in images]

    images = [random_image((64, 64), seed=seed) for seed in (21, 22)]
    sizing = MaskAwareEditor(load_pipeline("tiny-flux-fill"), cache=CacheStore(StoreConfig(host_bytes=256 << 20)))
    run_loop(sizing, EngineConfig(mode="naive"), registrations(sizing, images[:1]))
    one_recording = sizing.cache.arena.used
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"),
                             cache=CacheStore(StoreConfig(host_bytes=one_recording * 3 // 2)))
    jobs = registrations(editor, images)
    worker = run_loop(editor, EngineConfig(mode="naive", max_batch=2), jobs)
    registered = [job.future.result(timeout=0) for job in jobs]
    assert len(set(registered)) == 2 and worker.metrics.failed == worker.metrics.failed_recordings == 0
    assert worker.metrics.recording_retries == 1 and worker.metrics.summary()["recording_retries"] == 1
    assert [job.memory_retries for job in jobs].count(1) == 1
    assert [editor.is_recorded(template_id) for template_id in registered].count(True) == 1


@pytest.mark.parametrize("first", ["registration", "one-off"])
def test_a_one_off_edit_and_a_registration_sharing_a_cache_for_one_both_answer(first):
    """A one-off edit recording beside a registration in a host cache that holds one recording: whichever
    write no longer fits (a step's, or the last one, written as the recording is committed), the edit
    answers unrecorded (it failed when it was its last step) and the registration is kept or starts over."""
    from retouch.cache import CacheStore, StoreConfig

    images = [random_image((64, 64), seed=seed) for seed in (31, 32)]
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (8, 8, 40, 40))
    sizing = MaskAwareEditor(load_pipeline("tiny-flux-fill"), cache=CacheStore(StoreConfig(host_bytes=256 << 20)))
    run_loop(sizing, EngineConfig(mode="naive"),
             [Worker.new_job(None, recording=sizing.new_template(images[0], "a room", STEPS))])
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"),
                             cache=CacheStore(StoreConfig(host_bytes=sizing.cache.arena.used * 3 // 2)))
    registration = Worker.new_job(None, recording=editor.new_template(images[0], "a room", STEPS))
    template = editor.one_off_template(images[1], mask, "a red hat", 7, STEPS)
    one_off = Worker.new_job(EditRequest(template.template_id, mask, "a red hat", seed=7), recording=template)
    jobs = [registration, one_off] if first == "registration" else [one_off, registration]
    worker = run_loop(editor, EngineConfig(mode="naive", max_batch=2), jobs)
    assert worker.metrics.failed == worker.metrics.failed_recordings == 0
    assert registration.future.result(timeout=0) == registration.recording.template_id
    edited = one_off.future.result(timeout=0)
    assert edited.image.size == images[1].size
    assert edited.unrecorded in (None, "held")  # it would fit the cache alone
    assert worker.metrics.unrecorded + worker.metrics.recording_retries >= 1  # someone did not fit
    assert editor.is_recorded(registration.recording.template_id) or worker.metrics.recording_retries == 0


def run_lost_beside(editor: MaskAwareEditor, running: EditRequest, lost):
    """The loop over `running`, with the edit of a lost template (`lost`, a job) arriving at its second step:
    (worker, running's job), once the lost template's recording was seen running beside `running`."""
    beside = []  # per loop step: whether a recording ran beside the running edit

    def inject(worker, step):
        beside.append(any(job.request is None for job in worker.running)
                      and any(job.request == running for job in worker.running))
        if step == 1:
            worker.inbox.put(("edit", lost))

    worker, (first,) = run(editor, EngineConfig(mode="naive"), [running], inject)
    assert any(beside), "the recording did not run beside the edit"
    return worker, first


def test_a_template_the_store_lost_is_recorded_again_beside_the_running_batch():
    """With no disk tier, a template evicted from host memory is recorded again for its next edit. That
    recording joins the batch as a registration does: the running edit keeps stepping beside it (recorded
    inline, it would wait through a whole generation), and the edit that found it lost waits for it,
    then reads it mask-aware and gets what it gets with the template never lost."""
    from retouch.cache import CacheStore, StoreConfig

    reference = MaskAwareEditor(load_pipeline("tiny-flux-fill"))
    colours = [(200, 90, 30), (30, 90, 200), (90, 200, 30)]
    ids = [reference.register_template(template_image(c), prompt="a room", steps=STEPS, seed=i)
           for i, c in enumerate(colours)]
    size = reference.cache.nbytes(ids[0])
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"), cache=CacheStore(StoreConfig(host_bytes=2 * size + 4096)))
    for i, colour in enumerate(colours):  # the third evicts the first
        assert editor.register_template(template_image(colour), prompt="a room", steps=STEPS, seed=i) == ids[i]
    assert editor.lost(editor.templates[ids[0]]) and not editor.lost(editor.templates[ids[2]])

    running = EditRequest(ids[2], square_mask(), "a red hat", seed=5)
    lost = Worker.new_job(EditRequest(ids[0], square_mask((32, 32, 79, 63)), "a blue door", seed=6))
    worker, first = run_lost_beside(editor, running, lost)
    assert editor.recomputes == 1 and worker.metrics.recorded == 1 and worker.metrics.completed == 2
    assert editor.cache.metrics()["misses"] == 1  # found lost, as `acquire` would have counted it
    assert worker._recording_again == {}  # forgotten once it ended
    assert lost.metrics.computed_tokens < lost.metrics.tokens  # mask-aware once recorded
    expected = [reference.edit_many([request], output_type="latent")[0] for request in (lost.request, running)]
    # The recording was made beside another request, so it carries that batch's reordering, up to 4x the
    # bound at the activations (the registration test above), which the edit reads.
    assert max_diff(final_latents(lost), expected[0]) <= 4 * batch_bound(expected[0])
    assert max_diff(final_latents(first), expected[1]) <= batch_bound(expected[1])


def test_a_one_off_image_the_store_lost_is_recorded_again_as_its_first_edit_recorded_it():
    """A one-off image's recording is its first edit's run (that edit's prompt, seed and mask). Evicted, it
    is recorded again beside the running batch (it was recorded inline, every running edit waiting a whole
    generation), the same run, so a later edit of it reads what it read before the image was lost."""
    from retouch.cache import CacheStore, StoreConfig

    image, first_mask = template_image((40, 160, 220)), square_mask((8, 8, 40, 40))
    reference = MaskAwareEditor(load_pipeline("tiny-flux-fill"))
    reference.edit_image(image, first_mask, "a red hat", seed=3, steps=STEPS)
    one_off_id = reference.one_off_template(image, first_mask, "a red hat", 3, STEPS).template_id
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"),
                             cache=CacheStore(StoreConfig(host_bytes=2 * reference.cache.nbytes(one_off_id) + 4096)))
    editor.edit_image(image, first_mask, "a red hat", seed=3, steps=STEPS)
    ids = [editor.register_template(template_image(colour), prompt="a room", steps=STEPS, seed=i)
           for i, colour in enumerate([(200, 90, 30), (30, 90, 200)])]  # the second evicts the image
    assert editor.lost(editor.templates[one_off_id]) and not editor.lost(editor.templates[ids[1]])

    running = EditRequest(ids[1], square_mask(), "a green hat", seed=5)
    lost = Worker.new_job(EditRequest(one_off_id, square_mask((32, 32, 79, 63)), "a blue door", seed=6))
    worker, _ = run_lost_beside(editor, running, lost)
    assert editor.recomputes == 1 and worker.metrics.recorded == 1 and worker._recording_again == {}
    assert lost.metrics.computed_tokens < lost.metrics.tokens
    expected = reference.edit_many([lost.request], output_type="latent")[0]
    assert max_diff(final_latents(lost), expected) <= 4 * batch_bound(expected)  # as the registered one's


@pytest.mark.parametrize("kind", ["registered", "one-off"])
def test_a_template_recorded_again_is_the_only_recording_of_it_in_the_batch(kind):
    """While the loop records a lost template again, a registration of it gets that recording's answer, and a
    one-off edit of the image is computed in full without recording: a second recording of one template id
    beside the first wrote over it, and both failed ("steps are recorded in order"), the edit with them."""
    from retouch.cache import CacheStore, StoreConfig

    image, first_mask = template_image((40, 160, 220)), square_mask((8, 8, 40, 40))
    probe = MaskAwareEditor(load_pipeline("tiny-flux-fill"))
    size = probe.cache.nbytes(probe.register_template(image, prompt="a room", steps=STEPS, seed=0))
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"), cache=CacheStore(StoreConfig(host_bytes=2 * size + 4096)))
    beside = {}
    with Engine(editor, EngineConfig(mode="naive")) as engine:
        if kind == "registered":
            template_id = engine.register_template(image, prompt="a room", steps=STEPS, seed=0)
        else:
            template_id = engine.submit_image(image, first_mask, "a cat", seed=3, steps=STEPS).result(120).recorded
        others = [engine.register_template(template_image((60 * i, 90, 30)), prompt="a room", steps=STEPS, seed=i)
                  for i in (1, 2)]  # the second evicts the first
        assert editor.lost(editor.templates[template_id])
        submitted = threading.Event()

        def on_step(step, steps):  # on the loop thread, between two admissions
            if step == 1:
                submitted.wait(120)
            if step == 2:  # the lost edit was admitted at the last admission: its recording is under way
                beside["again"] = engine.worker._recording_again[template_id]
                beside["second"] = (engine.submit_recording(editor.templates[template_id]) if kind == "registered"
                                    else engine.submit_image(image, square_mask(), "a hat", seed=9, steps=STEPS))

        running = engine.submit(EditRequest(others[1], square_mask(), "a red hat", seed=5), watch=StepWatch(on_step))
        lost = engine.submit(EditRequest(template_id, square_mask((32, 32, 79, 63)), "a blue door", seed=6))
        submitted.set()
        results = [running.result(120), lost.result(120)]
        assert engine.metrics()["watch_errors"] == 0, engine.worker.metrics.last_watch_error
        results.append(beside["second"].result(120))
        metrics = engine.metrics()
    assert metrics["failed"] == 0 and editor.recomputes == 1 and metrics["recorded"] == 4
    assert results[1].metrics.computed_tokens < results[1].metrics.tokens  # mask-aware, once recorded
    if kind == "registered":
        assert beside["second"] is beside["again"].future and results[2] == template_id
    else:  # the stock pipeline's edit, as a one-off edit sent while its image is being recorded is
        assert results[2].recorded is None and results[2].metrics.computed_tokens == results[2].metrics.tokens


def test_an_edit_that_waited_for_another_recording_of_its_one_off_image_reads_that_one():
    """A one-off image lost while an edit of it waited, and recorded anew by a later one-off edit (with that
    edit's prompt, seed and mask): the waiting edit waits for that recording rather than record a second
    beside it, and is prepared again for it, so it is the edit of the image as recorded now."""
    image = template_image((40, 160, 220))
    first, a, b = ((square_mask(box), prompt, seed) for box, prompt, seed in (
        ((8, 8, 40, 40), "a cat", 3), ((32, 32, 79, 63), "a blue door", 6), ((0, 0, 31, 31), "a red hat", 7)))
    reference = MaskAwareEditor(load_pipeline("tiny-flux-fill"))
    reference.edit_image(image, b[0], b[1], seed=b[2], steps=STEPS)  # b's recording
    expected = reference.edit_image(image, a[0], a[1], seed=a[2], steps=STEPS)
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"))
    with Engine(editor, EngineConfig(mode="naive")) as engine:
        image_id = engine.submit_image(image, first[0], first[1], seed=first[2], steps=STEPS).result(120).recorded
        other = engine.register_template(template_image((9, 99, 9)), prompt="a room", steps=STEPS, seed=1)
        held = threading.Event()

        def on_step(step, steps):
            if step == 1:
                held.wait(120)

        running = engine.submit(EditRequest(other, square_mask(), "a hat", seed=5), watch=StepWatch(on_step))
        waiting = engine.submit_image(image, a[0], a[1], seed=a[2], steps=STEPS)  # an edit of the recorded image
        assert editor.cache.evict(image_id)
        anew = engine.submit_image(image, b[0], b[1], seed=b[2], steps=STEPS)  # records it, with its own mask
        held.set()
        results = [future.result(120) for future in (running, waiting, anew)]
        metrics = engine.metrics()
    assert metrics["failed"] == 0 and editor.recomputes == 0 and results[2].recorded == image_id  # its only recording
    assert results[1].metrics.computed_tokens < results[1].metrics.tokens
    assert np.abs(np.asarray(results[1].image, int) - np.asarray(expected, int)).max() <= 2


def test_a_disaggregated_engine_prepares_a_lost_templates_recording_in_a_helper():
    """The recording of a lost template is prepared (text encoding, the template's latents) by a helper as a
    registration is, not on the loop thread: the running edit is not interrupted, and the loop sleeps
    while nothing else can run (it spun, waiting for the helper, on the CPU the helper needs)."""
    from retouch.cache import CacheStore, StoreConfig

    probe = MaskAwareEditor(load_pipeline("tiny-flux-fill"))
    size = probe.cache.nbytes(probe.register_template(template_image(), prompt="a room", steps=STEPS, seed=0))
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"), cache=CacheStore(StoreConfig(host_bytes=2 * size + 4096)))
    with Engine(editor, EngineConfig(mode="disagg", max_batch=8)) as engine:
        ids = [engine.register_template(template_image((60 * i, 90, 30)), prompt="a room", steps=STEPS, seed=i)
               for i in range(3)]
        assert editor.lost(editor.templates[ids[0]])  # the third evicted the first
        stepped, arrived = threading.Event(), threading.Event()
        put = engine.worker.inbox.put

        def put_and_tell(message, *args, **kwargs):  # the lost edit, prepared, reaches the loop's inbox
            put(message, *args, **kwargs)
            if message[0] == "ready" and message[1].request is not None and message[1].request.template_id == ids[0]:
                arrived.set()

        def on_step(step, steps):  # the loop holds the running edit mid-denoising until the lost edit is there
            if step == 1:
                stepped.set()
                arrived.wait(120)

        engine.worker.inbox.put = put_and_tell
        running = engine.submit(EditRequest(ids[2], square_mask(), "a red hat", seed=5), watch=StepWatch(on_step))
        assert stepped.wait(120)
        lost = engine.submit(EditRequest(ids[0], square_mask((32, 32, 79, 63)), "a blue door", seed=6))
        lost_result, running_result = lost.result(300), running.result(300)
        metrics = engine.metrics()
        assert arrived.is_set() and editor.recomputes == 1 and metrics["recorded"] == 4
        assert metrics["interruptions"] == 0  # prepared on the loop, it interrupted the running edit
        assert lost_result.metrics.computed_tokens < lost_result.metrics.tokens

        assert editor.lost(editor.templates[ids[1]])  # evicted by the recording again of the first
        admits = []
        admit = engine.worker.admit
        engine.worker.admit = lambda: (admits.append(1), admit())[1]
        alone = engine.submit(EditRequest(ids[1], square_mask(), "a hat", seed=8)).result(300)
    assert alone.metrics.computed_tokens < alone.metrics.tokens and editor.recomputes == 2
    assert len(admits) < 4 * STEPS, f"the loop ran {len(admits)} times for two runs of {STEPS} steps"


def test_a_recording_only_if_room_is_left_to_its_first_edit_once_the_caches_are_full():
    """What a joining worker does with the templates it is sent (`Node._start_joins`): it records them while
    its caches have room beside each other and knows the rest, each recorded by its first edit beside the
    batch. Recording them all pushed out the ones it had just recorded (here: every one but the last two)."""
    from retouch.cache import CacheStore, StoreConfig

    reference = MaskAwareEditor(load_pipeline("tiny-flux-fill"))
    images = [template_image((50 * i, 90, 30)) for i in range(4)]
    size = reference.cache.nbytes(reference.register_template(images[0], prompt="a room", steps=STEPS, seed=0))
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"), cache=CacheStore(StoreConfig(host_bytes=2 * size + 4096)))
    with Engine(editor, EngineConfig(mode="naive")) as engine:
        templates = [editor.new_template(image, prompt="a room", steps=STEPS, seed=i) for i, image in enumerate(images)]
        ids = [engine.submit_recording(t, only_if_room=True).result(120) for t in templates]
        assert [editor.is_recorded(template_id) for template_id in ids] == [True, True, False, False]
        assert editor.cache.metrics()["evictions"] == 0 and engine.metrics()["deferred_recordings"] == 2
        assert editor.lost(editor.templates[ids[2]])  # known: its first edit records it
        request = EditRequest(ids[2], square_mask(), "a red hat", seed=5)
        edited = engine.submit(request).result(120)
        assert editor.recomputes == 1 and edited.metrics.computed_tokens < edited.metrics.tokens
        # A registration asked for by name records, room or not (the least recently used one goes).
        assert engine.submit_recording(templates[3]).result(120) == ids[3] and editor.is_recorded(ids[3])
        assert engine.metrics()["deferred_recordings"] == 2
    reference.register_template(images[2], prompt="a room", steps=STEPS, seed=2)
    expected = reference.edit_many([request], output_type="pil")[0]
    assert np.abs(np.asarray(edited.image, int) - np.asarray(expected, int)).max() <= 2


def test_a_recordings_size_is_foreseen_per_denoiser_row_and_by_what_the_caches_hold():
    """What `only_if_room` judges by: classifier-free guidance doubles SD3's rows, so a template recorded
    with it takes twice one recorded without (taken as the same size, one pushed out the template just
    recorded); a shape never recorded is taken as large as the largest recording held (an earlier process's
    files, which recording first would push out), and unknown when the caches hold none."""
    from retouch.cache import CacheStore, StoreConfig

    editor = MaskAwareEditor(load_pipeline("tiny-sd3-inpaint"), cache=CacheStore(StoreConfig(host_bytes=64 << 20)))
    unguided = editor.new_template(template_image(), prompt="a room", steps=STEPS, seed=0, guidance=1.0)
    guided = editor.new_template(template_image((9, 99, 9)), prompt="a room", steps=STEPS, seed=0, guidance=5.0)
    other_shape = editor.new_template(template_image().resize((64, 64)), prompt="a room", steps=STEPS, seed=0)
    assert editor.recording_bytes(unguided) is None  # nothing held to tell
    editor.register_template(template_image(), prompt="a room", steps=STEPS, seed=0, guidance=1.0)
    one_row = editor.cache.nbytes(unguided.template_id)
    assert editor.recording_bytes(unguided) == one_row and editor.recording_bytes(guided) == 2 * one_row
    assert editor.recording_bytes(other_shape) == one_row  # the largest held
    editor.register_template(template_image((9, 99, 9)), prompt="a room", steps=STEPS, seed=0, guidance=5.0)
    assert editor.cache.nbytes(guided.template_id) == 2 * one_row


def test_registrations_leave_edits_their_slots_and_an_edit_joins_at_the_next_step():
    """A burst of registrations fills the batch only up to `max_batch - edit_slots`: an edit arriving
    behind it joins at the next step instead of waiting a generation for a slot, and the registrations
    all complete, the same as recorded alone."""
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"))
    template_id = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=3)
    templates = [editor.new_template(template_image((40 * i, 90, 30)), prompt="a room", steps=STEPS, seed=i)
                 for i in range(5)]
    registrations = [Worker.new_job(None, recording=t) for t in templates]
    for job in registrations:
        job.ready = prepare_recording(editor, job.recording)
    late = Worker.new_job(EditRequest(template_id, square_mask(), "a red hat", seed=5))
    registering = []  # per step: registrations in the batch

    def inject(worker, step):
        registering.append(sum(job.request is None for job in worker.running))
        if step == 1:
            worker.inbox.put(("edit", late))

    config = EngineConfig(mode="naive", max_batch=4, edit_slots=1)
    worker = run_loop(editor, config, registrations, inject)
    assert worker.registration_slots == 3 and max(registering) == 3
    assert late.metrics.admitted_step == 1  # the step it arrived before, not after the first registrations
    assert [job.future.result() for job in registrations] == [t.template_id for t in templates]
    assert late.future.result().image is not None and worker.metrics.recorded == 5
    default = Worker(editor, EngineConfig(mode="naive", max_batch=8))
    assert default.registration_slots == 6  # a quarter of the batch is the edits' by default
    default.loras.close()


def test_a_template_dropped_while_it_is_recorded_again_stays_dropped():
    """A DELETE between steps (what `Engine.drop_template` runs on the loop) stops the recording of a lost
    template, and the edit that waited for it fails as an edit of a dropped template does (the router
    answers 404), instead of recording the deleted template inline; nothing of it stays cached."""
    from retouch.cache import CacheStore, StoreConfig
    from retouch.engine.worker import MissingTemplate

    probe = MaskAwareEditor(load_pipeline("tiny-flux-fill"))
    size = probe.cache.nbytes(probe.register_template(template_image(), prompt="a room", steps=STEPS, seed=0))
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"), cache=CacheStore(StoreConfig(host_bytes=2 * size + 4096)))
    ids = [editor.register_template(template_image((60 * i, 90, 30)), prompt="a room", steps=STEPS, seed=i)
           for i in range(3)]  # the third evicts the first
    running = Worker.new_job(EditRequest(ids[2], square_mask(), "a red hat", seed=5))
    lost = Worker.new_job(EditRequest(ids[0], square_mask((32, 32, 79, 63)), "a blue door", seed=6))
    cancelled = []

    def inject(worker, step):
        if step == 1:
            worker.inbox.put(("edit", lost))
        if step == 2:  # the recording has joined the batch
            (recording,) = [job for job in worker.running if job.request is None]
            cancelled.append(recording)
            worker.cancel_recording_again(ids[0])
            editor.drop_template(ids[0])

    worker = run_loop(editor, EngineConfig(mode="naive"), [running], inject)
    assert cancelled and cancelled[0].future.cancelled()
    with pytest.raises(MissingTemplate, match="dropped before the edit ran"):
        lost.future.result()
    assert running.future.result().image is not None
    assert not editor.cache.contains(ids[0]) and editor.recomputes == 1 and worker._recording_again == {}


def test_a_template_deleted_and_registered_again_before_the_loop_drops_it_is_recorded_anew():
    """A worker's node drops a template without waiting for the loop; the same template registered again
    meanwhile (the router's ids are content hashes: the same id) found the recording the queued drop was
    about to remove, answered at once, and every later edit failed "unknown template". It is recorded anew."""
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"))
    with Engine(editor, EngineConfig(mode="naive")) as engine:
        template_id = engine.submit_template(template_image(), prompt="a room", steps=STEPS, seed=1).result(120)
        gate, held = threading.Event(), threading.Event()
        blocked = Future()

        def hold_the_loop():  # a step in progress, in effect: the loop reads its inbox when it ends
            held.set()
            gate.wait(60)

        engine.worker.inbox.put(("call", hold_the_loop, blocked))
        assert held.wait(60)
        engine.drop_template(template_id, wait=False)
        again = engine.submit_template(template_image(), prompt="a room", steps=STEPS, seed=1)
        assert not again.done()  # it waits for its own recording, after the drop
        gate.set()
        assert again.result(120) == template_id and editor.is_recorded(template_id)
        edit = engine.submit(EditRequest(template_id, square_mask(), "a hat", seed=2)).result(120)
    assert edit.image is not None and edit.metrics.computed_tokens < edit.metrics.tokens


def test_a_recording_for_lost_template_edits_is_queued_by_the_most_urgent_of_them():
    """The first edit to find its template lost starts the recording with its own deadline (none here); a
    later edit of it with a deadline makes it that urgent, or it would wait behind edits with deadlines."""
    from retouch.cache import CacheStore, StoreConfig

    probe = MaskAwareEditor(load_pipeline("tiny-flux-fill"))
    size = probe.cache.nbytes(probe.register_template(template_image(), prompt="a room", steps=STEPS, seed=0))
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"), cache=CacheStore(StoreConfig(host_bytes=2 * size + 4096)))
    ids = [editor.register_template(template_image((60 * i, 90, 30)), prompt="a room", steps=STEPS, seed=i)
           for i in range(3)]  # the third evicts the first
    worker = Worker(editor, EngineConfig(mode="naive", max_batch=1))
    try:
        first, urgent = (Worker.new_job(EditRequest(ids[0], square_mask(), "a hat", seed=s), deadline=d)
                         for s, d in ((1, None), (2, 5.0)))
        worker.waiting.append(first)
        worker.admit()  # starts the recording, which takes the only slot
        (recording,) = worker.running
        assert recording.request is None and recording.deadline is None and first.waited_for is recording
        worker.running.clear()  # a slot frees
        worker.waiting.remove(first)
        worker.waiting.append(urgent)
        worker.admit()
        assert urgent.waited_for is recording and recording.deadline == 5.0
    finally:
        worker.loras.close()
