"""Mask-aware UNet transformer blocks (retouch.adapters.unet) against the unmodified diffusers UNet.

Tolerance (fp32, CPU): the mask-aware path runs the block's own ops on a subset of rows, so its block
outputs differ from full compute only in summation order (a matmul or SDPA over a different number of
rows may block its dot products differently): an ulp or so per op, a few ulps per block. Unlike Flux,
where the last block's output is nearly the model output, a UNet carries those differences through
proj_out and the following resnets, convolutions and up-sampling stages, which sum them over 3x3
neighbourhoods and all channels; measured here at most 15.8 units of fp32 eps at the output's scale
(max |output|), about 2.4e-6 absolute (SDPA and Triton attention, one and two CPU threads). We allow
OUTPUT_ULPS = 64 units, 4x the worst measured, still five orders of magnitude below the difference a
wrong cached row makes (outputs move by ~1e-1).
"""

import math
import re

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from kernel_device import TRITON_DEVICE, interpreter_replay

from retouch.adapters.context import CacheMode
from retouch.adapters.unet import UNetMaskAwareContext, level_grid, patch_unet
from retouch.cache import InMemoryActivationCache
from retouch.models import build_denoiser
from retouch.models.inputs import random_unet_inputs
from replay_checks import assert_close_ulps

OUTPUT_ULPS = 64
MODELS = ["tiny-sdxl-inpaint", "tiny-sd2-inpaint"]
EDIT_MODES = [CacheMode.Y_CACHE, CacheMode.KV_CACHE]
IMAGE_SIZE = (128, 128)  # pixels: a 16 x 16 latent
TEXT_TOKENS = 7
STEPS = [0, 3, 7]


def stack_inputs(per_request: list[dict]) -> dict:
    batched = {name: torch.cat([inputs[name] for inputs in per_request])
               for name in ("sample", "timestep", "encoder_hidden_states")}
    if "added_cond_kwargs" in per_request[0]:
        batched["added_cond_kwargs"] = {name: torch.cat([inputs["added_cond_kwargs"][name] for inputs in per_request])
                                        for name in ("text_embeds", "time_ids")}
    return batched


def pixel_masks(image_size: tuple[int, int]) -> list[torch.Tensor]:
    """Three requests: ~20% of the pixels in scattered 8x8 squares, a ~20% rectangle, nothing."""
    height, width = image_size
    generator = torch.Generator().manual_seed(7)
    cells = height // 8 * (width // 8)
    scattered = torch.zeros(cells, dtype=torch.bool)
    scattered[torch.randperm(cells, generator=generator)[: cells // 5]] = True
    scattered = scattered.view(height // 8, width // 8).repeat_interleave(8, 0).repeat_interleave(8, 1)
    rectangle = torch.zeros(image_size, dtype=torch.bool)
    rectangle[height // 8: height // 8 + height // 2, width // 4: width // 4 + (2 * width) // 5] = True
    return [scattered, rectangle, torch.zeros(image_size, dtype=torch.bool)]


def record(adapter, inputs: dict, template_ids: list[str], steps: list[int], cache,
           guidance_copies: int = 1, device: torch.device | str = "cpu") -> torch.Tensor:
    context = UNetMaskAwareContext.record(template_ids, steps, IMAGE_SIZE, adapter.num_levels, cache,
                                          guidance_copies=guidance_copies, device=device)
    with torch.no_grad(), adapter.run(context):
        return adapter.unet(**inputs).sample


@pytest.fixture(scope="module", params=MODELS)
def tiny(request):
    """(unet, adapter, cache, templates): three templates recorded one by one at different steps, each
    (inputs, step, unmodified output, recorded output)."""
    unet = build_denoiser(request.param).eval()
    adapter = patch_unet(unet)
    cache = InMemoryActivationCache()
    templates = []
    for index, step in enumerate(STEPS):
        inputs = random_unet_inputs(unet, 1, IMAGE_SIZE, TEXT_TOKENS, seed=index)
        with torch.no_grad():
            unmodified = unet(**inputs).sample
        recorded = record(adapter, inputs, [f"template-{index}"], [step], cache)
        templates.append((inputs, step, unmodified, recorded))
    yield unet, adapter, cache, templates
    adapter.unpatch()


@pytest.mark.parametrize("name", MODELS)
def test_patch_keeps_weights_and_unpatched_behaviour(name):
    unet = build_denoiser(name).eval()
    inputs = random_unet_inputs(unet, 2, IMAGE_SIZE, TEXT_TOKENS, seed=0)
    keys = list(unet.state_dict())
    pointers = [p.data_ptr() for p in unet.parameters()]
    with torch.no_grad():
        expected = unet(**inputs).sample
        adapter = patch_unet(unet)
        patched = unet(**inputs).sample
    assert torch.equal(patched, expected)
    assert list(unet.state_dict()) == keys
    assert [p.data_ptr() for p in unet.parameters()] == pointers
    assert adapter.num_blocks == {"tiny-sdxl-inpaint": 11, "tiny-sd2-inpaint": 10}[name]
    with pytest.raises(RuntimeError, match="already patched"):
        patch_unet(unet)
    adapter.unpatch()
    assert all("forward" not in block.__dict__ for block in adapter.blocks)


def test_level_grids_follow_the_unet():
    """Token masks of level l have the grid of the UNet's level-l feature maps (odd sizes round up)."""
    unet = build_denoiser("tiny-sd2-inpaint").eval()
    adapter = patch_unet(unet)
    image_size = (136, 88)  # a 17 x 11 latent: 9 x 6, 5 x 3, 3 x 2 below it
    context = UNetMaskAwareContext.edit(CacheMode.Y_CACHE, [torch.ones(image_size, dtype=torch.bool)], ["t"], [0],
                                        adapter.num_levels, InMemoryActivationCache())
    assert [level_grid(image_size, level) for level in range(4)] == [(17, 11), (9, 6), (5, 3), (3, 2)]
    assert context.level_tokens == (17 * 11, 9 * 6, 5 * 3, 3 * 2)
    inputs = random_unet_inputs(unet, 1, image_size, TEXT_TOKENS, seed=1)
    with torch.no_grad():
        expected = unet(**inputs).sample
        with adapter.run(context):
            assert_close_ulps(unet(**inputs).sample, expected, OUTPUT_ULPS)


@pytest.mark.parametrize("mode", EDIT_MODES + [CacheMode.RECORD])
def test_all_tokens_masked_equals_unmodified_model(tiny, mode):
    unet, adapter, _, _ = tiny
    inputs = random_unet_inputs(unet, 2, IMAGE_SIZE, TEXT_TOKENS, seed=11)
    with torch.no_grad():
        expected = unet(**inputs).sample
    cache = InMemoryActivationCache()  # empty: with every token masked nothing is read
    if mode is CacheMode.RECORD:
        context = UNetMaskAwareContext.record(["a", "b"], [0, 0], IMAGE_SIZE, adapter.num_levels, cache)
    else:
        context = UNetMaskAwareContext.edit(mode, [torch.ones(IMAGE_SIZE, dtype=torch.bool)] * 2, ["a", "b"], [0, 0],
                                            adapter.num_levels, cache)
    with torch.no_grad(), adapter.run(context):
        actual = unet(**inputs).sample
    if mode is CacheMode.RECORD:
        assert torch.equal(actual, expected)  # the class forward's ops, in its order
    else:
        assert_close_ulps(actual, expected, OUTPUT_ULPS)
    assert (cache.nbytes() > 0) == (mode is CacheMode.RECORD)


def test_record_equals_unmodified_model(tiny):
    for _, _, unmodified, recorded in tiny[3]:
        assert torch.equal(recorded, unmodified)


def block_plans(num_blocks: int) -> list:
    alternate = tuple(b % 2 == 0 for b in range(num_blocks))
    first_full = tuple(b > 0 for b in range(num_blocks))
    last_full = tuple(b < num_blocks - 1 for b in range(num_blocks))
    return [None, alternate, first_full, last_full]


@pytest.mark.parametrize("plan", range(4))
@pytest.mark.parametrize("mode", EDIT_MODES)
def test_replay_identity_ragged_batch(tiny, mode, plan):
    """Same inputs as recorded, three requests with different masks (one empty) and templates."""
    unet, adapter, cache, templates = tiny
    block_plan = block_plans(adapter.num_blocks)[plan]
    context = UNetMaskAwareContext.edit(mode, pixel_masks(IMAGE_SIZE), [f"template-{b}" for b in range(3)], STEPS,
                                        adapter.num_levels, cache, block_plan=block_plan)
    counts = context.levels[0].query_counts()  # 256 tokens at level 0
    assert counts[2] == 0 and all(0.15 < count / 256 <= 0.25 for count in counts[:2])
    with torch.no_grad(), adapter.run(context):
        actual = unet(**stack_inputs([t[0] for t in templates])).sample
    for request, (_, _, _, recorded) in enumerate(templates):
        assert_close_ulps(actual[request: request + 1], recorded, OUTPUT_ULPS)


@pytest.mark.parametrize("mode", EDIT_MODES)
def test_new_content_changes_the_output(tiny, mode):
    """Other latents under the mask: the output moves (the cache does not hide the edit)."""
    unet, adapter, cache, templates = tiny
    inputs, step, _, recorded = templates[0]
    edited = dict(inputs, sample=inputs["sample"].clone())
    edited["sample"][:, :, 4:8, 4:8] = torch.randn(1, edited["sample"].shape[1], 4, 4)
    mask = torch.zeros(IMAGE_SIZE, dtype=torch.bool)
    mask[32:64, 32:64] = True
    context = UNetMaskAwareContext.edit(mode, [mask], ["template-0"], [step], adapter.num_levels, cache)
    with torch.no_grad(), adapter.run(context):
        actual = unet(**edited).sample
    assert (actual - recorded).abs().max() > 1e-2
    assert torch.isfinite(actual).all()


@pytest.mark.parametrize("mode", EDIT_MODES)
def test_classifier_free_guidance_batch(tiny, mode):
    """A doubled batch [uncond; cond]: one mask and template per request, both halves recorded."""
    unet, adapter, _, templates = tiny
    cache = InMemoryActivationCache()
    cond = stack_inputs([t[0] for t in templates[:2]])
    uncond = dict(cond, encoder_hidden_states=torch.zeros_like(cond["encoder_hidden_states"]))
    doubled = stack_inputs([uncond, cond])
    recorded = record(adapter, doubled, ["cfg-0", "cfg-1"], [1, 2], cache, guidance_copies=2)
    assert cache.nbytes("cfg-0") == cache.nbytes("cfg-1") > 0
    context = UNetMaskAwareContext.edit(mode, pixel_masks(IMAGE_SIZE)[:2], ["cfg-0", "cfg-1"], [1, 2],
                                        adapter.num_levels, cache, guidance_copies=2)
    with torch.no_grad(), adapter.run(context):
        actual = unet(**doubled).sample
    assert_close_ulps(actual, recorded, OUTPUT_ULPS)
    with pytest.raises(ValueError, match="guidance copies"), torch.no_grad(), adapter.run(context):
        unet(**cond)


def test_context_is_checked_and_released(tiny):
    unet, adapter, cache, templates = tiny
    masks = pixel_masks(IMAGE_SIZE)
    context = UNetMaskAwareContext.edit(CacheMode.Y_CACHE, masks[:1], ["template-0"], [0], adapter.num_levels, cache,
                                        block_plan=(True, False))
    with pytest.raises(ValueError, match="block_plan"):
        with adapter.run(context):
            pass
    with pytest.raises(ValueError, match="steps"):
        UNetMaskAwareContext.edit(CacheMode.Y_CACHE, masks[:2], ["a", "b"], [0], adapter.num_levels, cache)
    with pytest.raises(ValueError, match="one size"):
        UNetMaskAwareContext.edit(CacheMode.Y_CACHE, [masks[0], torch.ones(64, 64)], ["a", "b"], [0, 0],
                                  adapter.num_levels, cache)
    other_size = UNetMaskAwareContext.edit(CacheMode.Y_CACHE, [torch.ones(64, 64)], ["template-0"], [0],
                                           adapter.num_levels, cache)
    with pytest.raises(ValueError, match="levels"), torch.no_grad(), adapter.run(other_size):
        unet(**templates[0][0])
    assert adapter.active_context is None
    with torch.no_grad():
        assert torch.equal(unet(**templates[0][0]).sample, templates[0][2])


# ---- FLOPs of the transformer blocks (Table 1): counted per op and falling with the mask ratio ----

FLOP_IMAGE_SIZE = (256, 256)  # a 32 x 32 latent: 1024 tokens at level 0


def predicted_block_macs(adapter, context: UNetMaskAwareContext | None, num_text: int,
                         level_tokens: list[int]) -> int:
    """Multiply-accumulates of every transformer block of one forward (context None: full compute).

    `level_tokens[b]` is block b's token count L. Per row of the batch with n_q query tokens (L in full
    compute, the masked count m otherwise) and n_kv self-attention key tokens whose K/V are projected (L in
    full and Y-cache, m in KV-cache): self-attention q and out (2 n_q C^2), k and v (2 n_kv C^2), QK^T and
    AV (2 n_q L C); cross-attention q and out (2 n_q C^2), k and v of the S text tokens (2 S D C, always),
    QK^T and AV (2 n_q S C); feed-forward GEGLU C -> 2F then F -> C (3 n_q C F).
    """
    total = 0
    for index, (block, num_tokens) in enumerate(zip(adapter.blocks, level_tokens)):
        width = block.attn1.to_q.in_features
        text_width = block.attn2.to_k.in_features
        ff_width = block.ff.net[2].in_features
        if context is None:
            rows = [(num_tokens, num_tokens)]
        else:
            counts = context.levels[adapter.block_levels[index]].query_counts()
            kv = (lambda m: num_tokens) if context.mode is CacheMode.Y_CACHE else (lambda m: m)
            rows = [(m, kv(m)) for m in counts]
        for queries, kv_tokens in rows:
            total += (4 * queries * width * width + 2 * kv_tokens * width * width + 2 * queries * num_tokens * width
                      + 2 * num_text * text_width * width + 2 * queries * num_text * width
                      + 3 * queries * width * ff_width)
    return total


def count_block_flops(unet, inputs) -> tuple[int, torch.Tensor]:
    """FLOPs inside the transformer blocks (the modules named ...transformer_blocks.N) and the output."""
    # The math backend decomposes SDPA into matmuls that FlopCounterMode counts, as in the Flux tests.
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        output = unet(**inputs).sample
    return sum(sum(ops.values()) for name, ops in counter.get_flop_counts().items()
               if re.search(r"transformer_blocks\.\d+$", name)), output


@pytest.mark.parametrize("name", MODELS)
def test_block_flops_fall_with_mask_ratio(name):
    unet = build_denoiser(name).eval()
    inputs = random_unet_inputs(unet, 1, FLOP_IMAGE_SIZE, TEXT_TOKENS, seed=3)
    full_flops, unmodified = count_block_flops(unet, inputs)

    adapter = patch_unet(unet)
    level_tokens = [math.prod(level_grid(FLOP_IMAGE_SIZE, level)) for level in adapter.block_levels]
    # FlopCounterMode counts 2 FLOPs per multiply-accumulate of every matmul; the per-op count is exact.
    assert full_flops == 2 * predicted_block_macs(adapter, None, TEXT_TOKENS, level_tokens)
    cache = InMemoryActivationCache()
    context = UNetMaskAwareContext.record(["t"], [0], FLOP_IMAGE_SIZE, adapter.num_levels, cache)
    with adapter.run(context):
        recorded_flops, recorded = count_block_flops(unet, inputs)
    assert recorded_flops == full_flops and torch.equal(recorded, unmodified)

    ratios = {}
    for fraction in (0.5, 0.2):
        mask = torch.zeros(FLOP_IMAGE_SIZE, dtype=torch.bool)
        mask[: round(FLOP_IMAGE_SIZE[0] * fraction)] = True  # whole pixel rows: ~that fraction of each level
        for mode in EDIT_MODES:
            context = UNetMaskAwareContext.edit(mode, [mask], ["t"], [0], adapter.num_levels, cache)
            with adapter.run(context):
                flops, edited = count_block_flops(unet, inputs)
            assert_close_ulps(edited, unmodified, OUTPUT_ULPS)
            assert flops == 2 * predicted_block_macs(adapter, context, TEXT_TOKENS, level_tokens)
            ratios[mode, fraction] = flops / full_flops
    for mode in EDIT_MODES:
        assert ratios[mode, 0.2] < ratios[mode, 0.5] < 1
    for fraction in (0.5, 0.2):
        assert ratios[CacheMode.KV_CACHE, fraction] < ratios[CacheMode.Y_CACHE, fraction]
    # From the count at 256 x 256 px with the top 20% of pixel rows masked (22% of level-0 tokens, 25% of
    # the coarser levels'): SDXL Y-cache 0.318, KV-cache 0.256; SD2 0.245 and 0.226 of full compute. Y-cache
    # keeps its K/V projections and every query's keys on all tokens, a larger share in SDXL's wider levels.
    assert ratios[CacheMode.KV_CACHE, 0.2] < 0.27
    assert ratios[CacheMode.Y_CACHE, 0.2] < 0.33


# On a GPU the masked path's matmuls run other kernels than full compute's (other row counts); this bound
# awaits the first GPU run of this test.
KERNEL_DEVICE_ULPS = OUTPUT_ULPS if TRITON_DEVICE.type == "cpu" else 1024


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("mode", EDIT_MODES)
def test_replay_identity_on_the_kernel_device(name, mode, monkeypatch):
    """Record and replay on the GPU where there is one (else the CPU) with the attention the engine picks
    there ("auto"): the replay matches the unmodified model. cuDNN's TF32 convolutions (torch's default)
    would round each conv's inputs to 10 bits, far coarser than the few ULPs the masked path differs by."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    unet = build_denoiser(name).eval().to(TRITON_DEVICE)
    adapter = patch_unet(unet, attention_backend="auto")
    cache, templates = InMemoryActivationCache(), []
    for index, step in enumerate(STEPS):
        inputs = random_unet_inputs(unet, 1, IMAGE_SIZE, TEXT_TOKENS, seed=index, device=TRITON_DEVICE)
        with torch.no_grad():
            unmodified = unet(**inputs).sample
        record(adapter, inputs, [f"template-{index}"], [step], cache, device=TRITON_DEVICE)
        templates.append((inputs, unmodified))
    context = UNetMaskAwareContext.edit(mode, pixel_masks(IMAGE_SIZE), [f"template-{b}" for b in range(3)], STEPS,
                                        adapter.num_levels, cache, device=TRITON_DEVICE)
    with torch.no_grad(), adapter.run(context):
        actual = unet(**stack_inputs([t[0] for t in templates])).sample
    assert actual.device.type == TRITON_DEVICE.type
    for index, (_, unmodified) in enumerate(templates):
        assert_close_ulps(actual[index: index + 1], unmodified, KERNEL_DEVICE_ULPS)


@interpreter_replay
@pytest.mark.parametrize("mode", EDIT_MODES)
def test_replay_identity_with_triton_attention(tiny, mode, request):
    """The Triton ragged-attention kernel in place of SDPA (interpreted on the CPU, see conftest) for self-
    and cross-attention; templates recorded by another patched copy of the same (seeded) weights."""
    _, _, cache, templates = tiny
    unet = build_denoiser(request.node.callspec.params["tiny"]).eval()
    adapter = patch_unet(unet, attention_backend="triton")
    context = UNetMaskAwareContext.edit(mode, pixel_masks(IMAGE_SIZE), [f"template-{b}" for b in range(3)], STEPS,
                                        adapter.num_levels, cache)
    with torch.no_grad(), adapter.run(context):
        actual = unet(**stack_inputs([t[0] for t in templates])).sample
    for request_index, (_, _, unmodified, _) in enumerate(templates):
        assert_close_ulps(actual[request_index: request_index + 1], unmodified, OUTPUT_ULPS)
