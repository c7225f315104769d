"""The mask-aware Python API: register a template, edit it, batch edits; against the baseline pipeline."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from editor_inputs import LATENT_ATOL, max_diff, square_mask, template_image
from PIL import Image

from retouch import load
from retouch.editor import EditRequest, MaskAwareEditor
from retouch.errors import InputError, ModelError
from retouch.models import load_pipeline

STEPS = 3


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image).astype(np.int16)


TINY_MODELS = ["tiny-flux-fill", "tiny-flux-inpaint", "tiny-sd3-inpaint", "tiny-sdxl-inpaint", "tiny-sd2-inpaint"]


@pytest.fixture(scope="module", params=[(model, mode) for model in TINY_MODELS for mode in ("y", "kv")],
                ids=lambda param: "-".join(param))
def editor(request):
    model, cache_mode = request.param
    return load(model, cache_mode=cache_mode)


def test_registration_records_every_denoiser_call_and_block(editor):
    calls = []
    hook = editor.denoiser.register_forward_hook(lambda *args: calls.append(1))
    try:
        template_id = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=11)
    finally:
        hook.remove()
    assert len(calls) >= STEPS  # PNDM (SD2) warms up with one extra call
    for step in range(len(calls)):
        for block in range(editor.adapter.num_blocks):
            out = editor.cache.get(template_id, step, block, "out")
            assert out.dim() == 2 and out.shape[0] > 0
    with pytest.raises(KeyError):
        editor.cache.get(template_id, len(calls), 0, "out")  # nothing beyond the schedule


def test_registering_again_returns_the_same_id_without_compute(editor):
    template_id = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=0)
    calls = []
    hook = editor.denoiser.register_forward_hook(lambda *args: calls.append(1))
    try:
        assert editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=0) == template_id
    finally:
        hook.remove()
    assert not calls


def test_all_tokens_masked_equals_the_unmodified_pipeline(editor):
    # With every token masked, nothing comes from the cache: the edit must be the baseline computation
    # on the same initial noise.
    template_id = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=0)
    full = Image.new("L", (128, 128), 255)
    edited = editor.edit(template_id, full, "a red hat", seed=5)
    template = editor.templates[template_id]
    extra = {"strength": 1.0} if editor.model.family != "flux-fill" else {}
    latents = editor._latents_argument(editor._noise(5, 128, 128)[None])
    with torch.inference_mode():
        baseline = editor.pipe(prompt="a red hat", image=template.image, mask_image=full, height=128, width=128,
                               num_inference_steps=STEPS, latents=latents, generator=[torch.Generator().manual_seed(0)],
                               **editor.model.call_defaults, **extra).images[0]
    assert np.abs(pixels(edited) - pixels(baseline)).max() <= 1


@pytest.mark.parametrize("model", ["tiny-sd2-inpaint", "tiny-sdxl-inpaint"])
def test_a_full_mask_at_a_side_past_a_multiple_of_16_computes_every_token(model):
    """A UNet's latent pixels past a side 1-8 px over a multiple of 16 hold none of the user's pixels: they
    were left unmasked, so a full mask read them from the cache and was not the stock edit (SD2 at 129x77:
    4 levels of 255 off inside the mask). Now they are repainted with the rest."""
    editor = load(model)
    image = template_image().resize((129, 77))
    template_id = editor.register_template(image, prompt="a scene", steps=STEPS, seed=0)
    full = editor.check_request(EditRequest(template_id, Image.new("L", image.size, 255), "a red hat", seed=5))
    assert len(editor.prepare_edit(full).masked_idx) == editor.num_tokens(editor.templates[template_id])
    empty = editor.check_request(EditRequest(template_id, Image.new("L", image.size, 0), "a red hat", seed=5))
    assert len(editor.prepare_edit(empty).masked_idx) == 0  # nothing to repaint: the padding neither


def test_edit_keeps_unmasked_pixels_and_follows_the_seed(editor):
    template_id = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=0)
    mask = square_mask()
    first = editor.edit(template_id, mask, "a red hat", seed=1)
    again = editor.edit(template_id, mask, "a red hat", seed=1)
    other = editor.edit(template_id, mask, "a red hat", seed=2)
    assert first.size == (128, 128)
    assert np.array_equal(pixels(first)[:, 64:], pixels(template_image())[:, 64:])
    assert np.array_equal(pixels(first), pixels(again))
    assert not np.array_equal(pixels(first)[32:64, 32:64], pixels(other)[32:64, 32:64])


def test_an_edit_carries_its_templates_colour_profile_and_a_profile_makes_another_template(editor):
    from PIL import ImageCms

    profile = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    tagged = template_image()
    tagged.info["icc_profile"] = profile
    plain_id = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=0)
    tagged_id = editor.register_template(tagged, prompt="a scene", steps=STEPS, seed=0)
    assert tagged_id != plain_id
    assert editor.edit(tagged_id, square_mask(), "a red hat", seed=1).info["icc_profile"] == profile
    assert "icc_profile" not in editor.edit(plain_id, square_mask(), "a red hat", seed=1).info
    assert editor.edit_image(tagged, square_mask(), "a red hat", steps=STEPS).info["icc_profile"] == profile


def test_replay_identity_of_the_same_request(editor):
    # Recorded from a full-compute run of exactly this request (image, mask, prompt, seed, steps):
    # the mask-aware run must give the same latents.
    mask = square_mask((16, 40, 79, 95))
    template_id = editor.register_template(template_image(), prompt="a red hat", steps=STEPS, seed=4, mask=mask)
    mask_aware = editor.edit(template_id, mask, "a red hat", seed=4, output_type="latent")
    full = editor.edit(template_id, mask, "a red hat", seed=4, output_type="latent", full_compute=True)
    assert max_diff(mask_aware, full) <= LATENT_ATOL


def test_all_tokens_masked_and_all_full_plan_equal_full_compute(editor):
    template_id = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=0)
    full_mask = Image.new("L", (128, 128), 255)
    reference = editor.edit(template_id, full_mask, "a cat", seed=6, output_type="latent", full_compute=True)
    assert max_diff(editor.edit(template_id, full_mask, "a cat", seed=6, output_type="latent"), reference) <= LATENT_ATOL

    editor.block_plan = (False,) * editor.adapter.num_blocks  # the planner's "compute all tokens" everywhere
    try:
        mask = square_mask()
        planned = editor.edit(template_id, mask, "a cat", seed=6, output_type="latent")
        reference = editor.edit(template_id, mask, "a cat", seed=6, output_type="latent", full_compute=True)
    finally:
        editor.block_plan = None
    assert max_diff(planned, reference) == 0.0  # the unmodified blocks ran: bit for bit


def mixed_batch(editor) -> list[EditRequest]:
    """Two templates, three masks (one repainting nothing): a ragged batch."""
    first = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=0)
    second = editor.register_template(template_image((200, 40, 40)), prompt="another", steps=STEPS, seed=3)
    return [EditRequest(first, square_mask(), "a red hat", seed=1),
            EditRequest(second, square_mask((0, 0, 127, 40)), "a blue sky", seed=2),
            EditRequest(first, Image.new("L", (128, 128), 0), "nothing to repaint", seed=3)]


def test_edit_many_latents_equal_edits_one_by_one(editor):
    requests = mixed_batch(editor)

    def batch_vs_alone(full_compute: bool) -> tuple[float, float]:
        batched = editor.edit_many(requests, output_type="latent", full_compute=full_compute)
        alone = [editor.edit(r.template_id, r.mask, r.prompt, r.seed, output_type="latent", full_compute=full_compute)
                 for r in requests]
        return max(max_diff(b, a) for b, a in zip(batched, alone)), max(a.abs().max().item() for a in alone)

    # Batching changes BLAS blockings, so even the unmodified pipeline is not batch-invariant to the
    # last bit (measured up to ~5e-5 on latents of magnitude ~15). Allow twice what it shows, with a
    # floor of 32 fp32 ulps at the latents' scale.
    mask_aware_diff, scale = batch_vs_alone(full_compute=False)
    full_diff, _ = batch_vs_alone(full_compute=True)
    assert mask_aware_diff <= max(2 * full_diff, 32 * torch.finfo(torch.float32).eps * scale)


def test_edit_many_equals_edits_one_by_one(editor):
    requests = mixed_batch(editor)
    batched = editor.edit_many(requests)
    for request, image in zip(requests, batched):
        alone = editor.edit(request.template_id, request.mask, request.prompt, request.seed)
        assert np.abs(pixels(image) - pixels(alone)).max() <= 1


def test_bad_requests(editor):
    template_id = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=0)
    with pytest.raises(InputError, match="unknown template"):
        editor.edit("nope", square_mask(), "a hat")
    with pytest.raises(InputError, match="mask is 64x64"):
        editor.edit(template_id, Image.new("L", (64, 64)), "a hat")
    with pytest.raises(InputError, match="prompt is empty"):
        editor.edit(template_id, square_mask(), "  ")
    for seed in ("abc", 1.5, -1, 2**64, True):
        with pytest.raises(InputError, match="seed must be an integer"):
            editor.edit(template_id, square_mask(), "a hat", seed=seed)
    for guidance in (float("nan"), float("inf"), -1.0, "3"):
        with pytest.raises(InputError, match="guidance must be a number"):
            editor.register_template(template_image(), prompt="a scene", steps=STEPS, guidance=guidance)
    other_steps = editor.register_template(template_image(), prompt="a scene", steps=STEPS + 1, seed=0)
    with pytest.raises(InputError, match="same steps"):
        editor.edit_many([EditRequest(template_id, square_mask(), "a"), EditRequest(other_steps, square_mask(), "b")])
    with pytest.raises(InputError, match="prompt must be a string, got list"):
        editor.edit(template_id, square_mask(), ["a hat"])
    request = EditRequest(template_id, square_mask(), "a hat", seed=1)
    with pytest.raises(InputError, match="a list of EditRequests"):
        editor.edit_many(request)
    with pytest.raises(InputError, match="a list of EditRequests, got int"):
        editor.edit_many(3)


def test_numpy_integers_and_generators_are_taken_as_python_ones():
    """Seeds and step counts often come from numpy; a batch from a generator expression."""
    editor = load("tiny-flux-fill")
    template_id = editor.register_template(template_image(), prompt="a scene", steps=np.int64(STEPS), seed=np.int64(0))
    assert template_id == editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=0)
    request = EditRequest(template_id, square_mask(), "a hat", seed=np.uint32(1))
    [from_generator] = editor.edit_many(request for _ in range(1))
    assert np.array_equal(pixels(from_generator), pixels(editor.edit(template_id, square_mask(), "a hat", seed=1)))


def test_edits_from_several_threads_wait_their_turn():
    """One editor, three threads editing at once: each edit is what it is alone (the adapter holds one
    active context: without the editor's lock, 23 of 24 such edits failed with "already active")."""
    from concurrent.futures import ThreadPoolExecutor

    editor = load("tiny-flux-fill")
    template_id = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=0)
    alone = {seed: pixels(editor.edit(template_id, square_mask(), "a hat", seed=seed)) for seed in range(3)}
    with ThreadPoolExecutor(3) as pool:
        edits = [(seed, pool.submit(editor.edit, template_id, square_mask(), "a hat", seed=seed))
                 for _ in range(2) for seed in range(3)]
        assert all(np.array_equal(pixels(future.result()), alone[seed]) for seed, future in edits)


def test_unsupported_family_and_options():
    model = dataclasses.replace(load_pipeline("tiny-sd2-inpaint"), family="some-other-family")
    with pytest.raises(ModelError, match="supports flux-fill, flux-inpaint, sd3, sdxl, sd2"):
        MaskAwareEditor(model)
    with pytest.raises(InputError, match="cache mode"):
        MaskAwareEditor(load_pipeline("tiny-flux-fill"), cache_mode="z")


def test_packing_matches_the_pipeline():
    from diffusers import FluxPipeline

    from retouch.editor import pack_flux_latents

    latents = torch.randn(2, 16, 8, 6)
    assert torch.equal(pack_flux_latents(latents), FluxPipeline._pack_latents(latents, 2, 16, 8, 6))


def test_guided_sd3_records_both_halves():
    editor = load("tiny-sd3-inpaint")
    template_id = editor.register_template(template_image(), prompt="a scene", steps=2, seed=0, guidance=5.0)
    with editor.cache.acquire(template_id) as handle:
        names = {entry.name for entry in handle.layout.entries}
    assert {"out", "uncond.out"} <= names  # both halves, kept together under the template
    editor.drop_template(template_id)
    assert not editor.cache.contains(template_id) and not editor.cache.contains(template_id + "/uncond")


@pytest.mark.parametrize("model", ["tiny-flux-fill", "tiny-sdxl-inpaint"])
def test_a_kv_recording_serves_y_cache_edits_after_switching(model):
    # A KV-cache recording holds every block's output too, so after switch_cache_mode("y") its edits
    # must equal those of an editor that recorded in Y-cache mode from the start: up to summation
    # order, since a KV recording runs the masked path and a Y recording the unmodified blocks.
    mask = square_mask((16, 40, 79, 95))
    latents = []
    for recorded_in in ("kv", "y"):
        editor = load(model, cache_mode=recorded_in)
        template_id = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=3)
        editor.switch_cache_mode("y")
        assert editor.mode_name == "y"
        latents.append(editor.edit(template_id, mask, "a red hat", seed=5, output_type="latent"))
    assert max_diff(latents[0], latents[1]) <= LATENT_ATOL
    with pytest.raises(InputError, match="cache mode"):
        editor.switch_cache_mode("z")


@pytest.mark.parametrize("model", ["tiny-flux-fill", "tiny-sd2-inpaint"])
def test_a_y_recording_is_recorded_again_for_kv_cache_edits(model):
    # A Y-cache recording holds block outputs only: after switch_cache_mode("kv"), registering the
    # template again, or editing it directly, records what KV-cache edits read; the edits equal those
    # of an editor that recorded in KV-cache mode from the start.
    mask = square_mask((16, 40, 79, 95))
    reference = load(model, cache_mode="kv")
    kv_id = reference.register_template(template_image(), prompt="a scene", steps=STEPS, seed=3)
    expected = reference.edit(kv_id, mask, "a red hat", seed=5, output_type="latent")

    editor = load(model, cache_mode="y")
    template_id = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=3)
    editor.switch_cache_mode("kv")
    assert editor.edit(template_id, mask, "a red hat", seed=5, output_type="latent").equal(expected)
    assert editor.recomputes == 1 and editor.templates[template_id].recorded_mode == "kv"

    editor.switch_cache_mode("y")
    other = editor.register_template(template_image((9, 9, 9)), prompt="a scene", steps=STEPS, seed=3)
    editor.switch_cache_mode("kv")
    assert editor.register_template(template_image((9, 9, 9)), prompt="a scene", steps=STEPS, seed=3) == other
    assert editor.templates[other].recorded_mode == "kv"
    editor.edit(other, mask, "a red hat", seed=5)
    assert editor.recomputes == 1  # registered again for KV, so the edit needed no recompute


def test_edits_run_the_templates_steps_or_say_why_not():
    editor = load("tiny-flux-fill")
    template_id = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=0)
    same = editor.edit(template_id, square_mask(), "a hat", seed=1, steps=STEPS)
    assert same.tobytes() == editor.edit(template_id, square_mask(), "a hat", seed=1).tobytes()
    with pytest.raises(InputError, match=f"recorded with {STEPS} steps"):
        editor.edit(template_id, square_mask(), "a hat", seed=1, steps=STEPS + 2)
    with pytest.raises(InputError, match=f"recorded with {STEPS} steps"):
        editor.edit_many([EditRequest(template_id, square_mask(), "a hat", steps=1)])
    for steps in (0, 10**10):  # 10^10: the schedule's tables alone were a 75 GiB allocation
        with pytest.raises(InputError, match=r"steps must be an integer in \[1, 10000\]"):
            editor.register_template(template_image(), steps=steps)


def test_masks_come_in_any_documented_form():
    editor = load("tiny-flux-fill")
    template_id = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=0)
    expected = editor.edit(template_id, square_mask(), "a hat", seed=1).tobytes()
    as_bool = np.asarray(square_mask()) > 0
    for form in (square_mask().convert("1"), square_mask().convert("RGB"), as_bool, torch.from_numpy(as_bool),
                 as_bool.astype(np.float32), (as_bool * 65535).astype(np.uint16)):
        assert editor.edit(template_id, form, "a hat", seed=1).tobytes() == expected
    with pytest.raises(InputError, match="mask is missing"):
        editor.edit(template_id, None, "a hat")
    with pytest.raises(InputError, match=r"2-D \[H, W\]"):
        editor.edit(template_id, np.zeros((2, 128, 128)), "a hat")


def test_a_cost_model_of_another_model_is_refused_when_the_editor_is_built():
    from retouch.costs import CostModel
    from retouch.profile import build_target

    flux = build_target("tiny-flux-fill", torch.device("cpu"), torch.float32)
    fitted = CostModel.from_json(Path(__file__).parents[1] / "bench/results/cpu/cost_tiny_flux_fill.json")
    assert fitted.block_kinds == flux.adapter.block_kinds()  # what `retouch profile` writes is what is checked
    assert MaskAwareEditor(load_pipeline("tiny-flux-fill"), cost_model=fitted).cost_model is fitted
    for other in ("tiny-sd2-inpaint", "tiny-sd3-inpaint"):
        pipeline = load_pipeline(other)
        with pytest.raises(InputError, match="profiled on tiny-flux-fill"):
            MaskAwareEditor(pipeline, cost_model=fitted)
        assert all("forward" not in block.__dict__ for block in pipeline.pipe.components.get(
            "transformer", pipeline.pipe.components.get("unet")).modules())  # left unpatched


@pytest.mark.parametrize("options, says", [({"cache": "x"}, "cache must be an ActivationCache"),
                                           ({"attention_backend": "foo"}, "attention_backend must be one of"),
                                           ({"cost_model": "cost.json"}, "cost_model must be a CostModel"),
                                           ({"block_plan": [True]}, "block_plan has 1 entries; tiny-flux-fill has 3"),
                                           ({"dilation": 1.5}, "dilation must be a whole number")])
def test_editor_options_given_wrong_are_named_before_anything_runs(options, says):
    """A cost model's path, a cache's name, a plan of the wrong length and a fractional dilation were accepted,
    then failed at the first edit (AttributeError, IndexError, numpy's TypeError)."""
    pipeline = load_pipeline("tiny-flux-fill")
    with pytest.raises(InputError, match=says):
        MaskAwareEditor(pipeline, **options)
    blocks = [*pipeline.pipe.transformer.transformer_blocks, *pipeline.pipe.transformer.single_transformer_blocks]
    assert not any("forward" in vars(block) for block in blocks)  # refused: the model is left unpatched


def test_a_closed_editor_gives_its_model_back_and_refuses_work():
    """`close` (or leaving a `with` block) unpatches the denoiser, so another editor can take the model; a
    closed editor says so. Its repr names the model and mode."""
    from retouch.errors import RetouchError

    with load("tiny-flux-fill", cache_mode="kv") as editor:
        template_id = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=0)
        first = pixels(editor.edit(template_id, square_mask(), "a hat", seed=1))
        assert repr(editor).startswith("MaskAwareEditor('tiny-flux-fill', family='flux-fill', cache_mode='kv'")
        with pytest.raises(TypeError, match="unexpected keyword argument 'foo'"):
            editor.edit(template_id, square_mask(), "a hat", foo=1)
    assert "closed" in repr(editor)
    with pytest.raises(RetouchError, match="editor is closed"):
        editor.edit(template_id, square_mask(), "a hat", seed=1)
    editor.close()  # twice is harmless
    again = MaskAwareEditor(editor.model, cache_mode="kv")
    template_id = again.register_template(template_image(), prompt="a scene", steps=STEPS, seed=0)
    assert np.array_equal(pixels(again.edit(template_id, square_mask(), "a hat", seed=1)), first)

