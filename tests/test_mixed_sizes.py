"""Mixed-resolution batches (Flux, SD3): requests of different image sizes run in ONE forward -- image
tokens packed, positions and attention per request -- and each gets what it gets alone (the batch
invariance bound: fp32 summation order), in both cache modes, with requests joining mid-way, with
recordings and one-off edits in the batch, with blocks the plan runs in full, and through the copy
engine. The loop runs on the test's thread, as in test_engine.py."""

import pytest
import torch
from editor_inputs import max_diff
from PIL import Image, ImageDraw

from retouch.adapters.context import CacheMode, MaskAwareContext
from retouch.cache import CacheStore, InMemoryActivationCache, StoreConfig
from retouch.editor import EditRequest, MaskAwareEditor
from retouch.engine import recipes
from retouch.engine.worker import EngineConfig, Worker
from retouch.models import load_pipeline

BATCH_ATOL = 1e-5  # fp32: a request's rows in a bigger batch differ only in summation order


def batch_bound(reference: torch.Tensor) -> float:
    """How far a result may move when its rows share a batch with others (as test_engine_recording.py):
    BLAS blockings change the summation order; 32 fp32 ulps at the values' scale."""
    return max(BATCH_ATOL, 32 * torch.finfo(torch.float32).eps * reference.abs().max().item())
SIZES = ((128, 128), (96, 160), (64, 64))  # (width, height): three token counts, two aspect ratios


def scene(size, color=(40, 120, 200)) -> Image.Image:
    image = Image.new("RGB", size, color)
    width, height = size
    ImageDraw.Draw(image).ellipse((width // 6, height // 5, width * 3 // 4, height * 4 // 5), fill=(230, 200, 60))
    return image


def box_mask(size, box) -> Image.Image:
    mask = Image.new("L", size, 0)
    ImageDraw.Draw(mask).rectangle(box, fill=255)
    return mask


@pytest.fixture(scope="module", params=[("tiny-flux-fill", "y"), ("tiny-flux-fill", "kv"),
                                        ("tiny-sd3-inpaint", "y"), ("tiny-sd3-inpaint", "kv")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def editor(request):
    model, mode = request.param
    return MaskAwareEditor(load_pipeline(model), cache_mode=mode)


def templates(editor, steps=(4, 3, 5)):
    return [editor.register_template(scene(size, color), prompt="a scene", steps=n, seed=i)
            for i, (size, color, n) in enumerate(zip(SIZES, ((40, 120, 200), (200, 90, 30), (10, 200, 90)), steps))]


def edits(editor, ids):
    boxes = ((16, 16, 63, 47), (0, 40, 95, 79), (8, 8, 40, 30))
    return [EditRequest(template_id, box_mask(size, box), prompt, seed=seed)
            for template_id, size, box, prompt, seed in zip(ids, SIZES, boxes, ("a hat", "a door", "a cat"), (3, 4, 5))]


def run(editor, requests, inject=None, config=EngineConfig(mode="naive")):
    worker = Worker(editor, config)
    jobs = [Worker.new_job(r) for r in requests]
    for job in jobs:
        worker.inbox.put(("edit", job))
    step = worker.step
    forwards = []

    def counted_step():
        sizes = {job.template.canvas.padded for job in worker.running}
        forwards.append(len(sizes))
        editor.in_step = True  # what packed_calls counts: the step's forwards, not preparations
        try:
            stepped = step()
        finally:
            editor.in_step = False
        if inject is not None:
            inject(worker, worker.metrics.steps + 1)
        return stepped

    worker.step = counted_step
    worker.inbox.put(("stop",))
    worker.run()
    for job in jobs:
        job.future.result()  # raises what the loop failed it with
    return worker, jobs, forwards


def alone(editor, request) -> torch.Tensor:
    _, (job,), _ = run(editor, [request])
    return job.row.latents[0]


def assert_each_as_alone(editor, requests):
    """The requests, of three sizes, batched from the first step, each within the bound of it run alone."""
    expected = [alone(editor, r) for r in requests]
    _, jobs, sizes = run(editor, requests)
    assert sizes[0] == 3
    for job, reference in zip(jobs, expected):
        assert max_diff(job.row.latents[0], reference) <= batch_bound(reference)


def packed_calls(editor):
    """Count the adapter's packed forwards (one per mixed step) and the denoiser's per-size forwards."""
    calls = {"packed": 0, "stock": 0}
    forward_packed = editor.adapter.forward_packed

    def counting(**kwargs):
        calls["packed"] += 1
        return forward_packed(**kwargs)

    editor.adapter.forward_packed = counting
    def stock(*args):
        if getattr(editor, "in_step", False):
            calls["stock"] += 1

    hook = editor.denoiser.register_forward_pre_hook(stock)
    return calls, lambda: (hook.remove(), editor.adapter.__dict__.pop("forward_packed"))


def test_three_sizes_in_one_forward_equal_each_run_alone(editor):
    requests = edits(editor, templates(editor))
    expected = [alone(editor, r) for r in requests]
    calls, restore = packed_calls(editor)
    try:
        worker, jobs, sizes_per_step = run(editor, requests)
    finally:
        restore()
    assert sizes_per_step[:3] == [3, 3, 3]  # the first steps batch all three sizes
    # One forward per step: the packed one while sizes differ, the stock call once one size is left.
    assert calls["packed"] == sum(1 for n in sizes_per_step if n > 1)
    assert calls["packed"] + calls["stock"] == worker.metrics.steps
    assert worker.metrics.summary()["mixed_size_steps"] == calls["packed"] > 0  # retouch_worker_mixed_size_steps
    for job, reference in zip(jobs, expected):
        assert job.row.latents[0].shape == reference.shape
        assert max_diff(job.row.latents[0], reference) <= batch_bound(reference)


def test_a_request_of_another_size_joining_mid_way_equals_it_run_alone(editor):
    ids = templates(editor, steps=(5, 3, 3))
    first, joiner, _ = edits(editor, ids)
    expected = alone(editor, joiner)
    late = Worker.new_job(joiner)

    def inject(worker, steps_run):
        if steps_run == 2:
            worker.inbox.put(("edit", late))

    worker, (job,), sizes = run(editor, [first], inject)
    assert late.metrics.admitted_step == 2 and sizes[2] == 2
    assert max_diff(late.row.latents[0], expected) <= batch_bound(expected)
    reference = alone(editor, first)
    assert max_diff(job.row.latents[0], reference) <= batch_bound(reference)


def test_a_recording_and_a_one_off_edit_of_other_sizes_share_the_forward(editor):
    """A template's registration records (every token computed, activations written) beside an edit of
    another size; what it records then serves an edit exactly as a recording made alone does."""
    (template_id,) = templates(editor, steps=(3,))[:1]
    edit = edits(editor, [template_id])[0]
    recorded_alone = editor.register_template(scene(SIZES[1], (90, 20, 160)), prompt="a room", steps=3, seed=9)
    later = EditRequest(recorded_alone, box_mask(SIZES[1], (10, 10, 60, 60)), "a lamp", seed=2)
    expected_later = alone(editor, later)
    expected_edit = alone(editor, edit)
    editor.drop_template(recorded_alone)

    worker = Worker(editor, EngineConfig(mode="naive"))
    recording = Worker.new_job(None, recording=editor.new_template(scene(SIZES[1], (90, 20, 160)),
                                                                    prompt="a room", steps=3, seed=9))
    edit_job = Worker.new_job(edit)
    for job in (recording, edit_job):
        worker.inbox.put(("edit", job))
    worker.inbox.put(("stop",))
    worker.run()
    assert recording.future.result() == recorded_alone
    assert max_diff(edit_job.row.latents[0], expected_edit) <= batch_bound(expected_edit)
    assert max_diff(alone(editor, later), expected_later) <= batch_bound(expected_later)


def test_one_forward_per_size_when_mixing_is_off(editor):
    requests = edits(editor, templates(editor))
    calls, restore = packed_calls(editor)
    try:
        worker, jobs, _ = run(editor, requests, config=EngineConfig(mode="naive", mixed_sizes=False))
    finally:
        restore()
    assert calls["packed"] == 0 and calls["stock"] > worker.metrics.steps
    assert worker.metrics.mixed_size_steps == 0


def test_blocks_the_plan_runs_in_full_run_per_size_inside_the_packed_forward():
    """A plan with full blocks: in a mixed batch they run the class forward once per size; results equal
    each request alone under the same plan."""
    pipe = load_pipeline("tiny-flux-fill")
    blocks = len(pipe.pipe.transformer.transformer_blocks) + len(pipe.pipe.transformer.single_transformer_blocks)
    editor = MaskAwareEditor(pipe, cache_mode="y", block_plan=tuple(b % 2 == 0 for b in range(blocks)))
    assert_each_as_alone(editor, edits(editor, templates(editor)))


@pytest.mark.parametrize("cache", ["in-memory", "fp8-store"])
def test_mixed_batches_read_any_cache(cache):
    """The packed reads of a plain ActivationCache (no copy engine) and of an fp8 store (a scale per
    batch row, applied per packed token row) give each request what it reads alone."""
    store = (InMemoryActivationCache() if cache == "in-memory"
             else CacheStore(StoreConfig(host_bytes=64 << 20, dtype="float8_e4m3fn")))
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"), cache=store, cache_mode="kv")
    assert_each_as_alone(editor, edits(editor, templates(editor)))


def test_packed_forward_refuses_a_one_size_context():
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"))
    context = MaskAwareContext.edit(CacheMode.Y_CACHE, [torch.arange(3)] * 2, ["a", "b"], [0, 0], 4, 16,
                                    InMemoryActivationCache())
    with editor.adapter.run(context), pytest.raises(RuntimeError, match="mixed-resolution"):
        editor.adapter.forward_packed(hidden_states=[], encoder_hidden_states=None, pooled_projections=None,
                                      timestep=None, img_ids=[], txt_ids=None)


def test_unet_families_do_not_pack():
    with pytest.raises(ValueError, match="one forward per image size"):
        recipes.denoise_mixed_step("sdxl", None, [], None)


def test_padding_the_computed_tokens_changes_nothing_in_a_mixed_batch(editor):
    """`--cuda-graphs` pads the computed tokens to buckets (repeats of a computed token, test_token_padding.py);
    in a batch of three sizes in one forward too, every request gets what it gets unpadded."""
    requests = edits(editor, templates(editor))
    _, jobs, _ = run(editor, requests)
    expected = [job.row.latents[0] for job in jobs]
    padded = []
    editor.adapter.pad_tokens(lambda count: padded.append(count) or count + 7)
    try:
        _, jobs, forwards = run(editor, requests)
    finally:
        editor.adapter.pad_tokens(None)
    assert forwards[0] == 3 and padded  # one forward of the three sizes, its computed tokens padded
    for job, reference in zip(jobs, expected):
        assert max_diff(job.row.latents[0], reference) <= batch_bound(reference)
