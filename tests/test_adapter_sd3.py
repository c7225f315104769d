"""Mask-aware SD3 blocks (retouch.adapters.sd3) against the unmodified diffusers transformer.

Tolerance (fp32, CPU), as in test_adapter_flux.py: the mask-aware path runs the same ops as the model on a
subset of rows, so the only difference is summation order (a BLAS matmul or SDPA over a different number
of rows, keys in another order). We allow OUTPUT_ULPS units of fp32 eps at the output's scale
(max |output|), the Flux suite's bound: about 3x the worst measured on this suite (2.7 units).

Two tiny configurations: tiny-sd3-inpaint itself (SD3.0: 2 blocks, the last context_pre_only) and an
SD3.5 layout built from it (3 blocks, RMS qk-norms, dual attention in block 0 and in the
context_pre_only block 2), so every branch of the block runs.
"""

import pytest
import torch
from diffusers import SD3Transformer2DModel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from kernel_device import TRITON_DEVICE, interpreter_replay

from retouch.adapters import CacheMode, MaskAwareContext
from retouch.adapters.sd3 import DUAL_KEY, patch_sd3
from retouch.cache import InMemoryActivationCache
from retouch.models import build_denoiser
from retouch.models.inputs import random_sd3_inputs
from replay_checks import assert_close_ulps, masked_indices

OUTPUT_ULPS = 8
EDIT_MODES = [CacheMode.Y_CACHE, CacheMode.KV_CACHE]
TINY_GRID = (8, 8)  # 128x128 px -> 16x16 latent -> 8x8 patches of 2x2: 64 image tokens
TINY_TEXT_TOKENS = 8
NUM_IMAGE = TINY_GRID[0] * TINY_GRID[1]
TINY_MODELS = ["sd3", "sd35"]


def build_sd35_like(base: SD3Transformer2DModel, seed: int = 0, **overrides) -> SD3Transformer2DModel:
    """`base`'s config with SD3.5's features (or `overrides`), random weights from `seed`."""
    config = {name: value for name, value in base.config.items() if not name.startswith("_")}
    config.update({"num_layers": 3, "qk_norm": "rms_norm", "dual_attention_layers": (0, 2)}, **overrides)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel.from_config(config)
    return transformer.float().eval()


def stack_inputs(per_request: list[dict]) -> dict:
    batched = dict(per_request[0])
    for name in ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"):
        batched[name] = torch.cat([inputs[name] for inputs in per_request])
    return batched


def patch_tokens(output: torch.Tensor, patch: int) -> torch.Tensor:
    """[B, C, h*p, w*p] -> [B, h*w, p*p*C]: the model output per image token (row-major patches)."""
    batch, channels, height, width = output.shape
    tokens = output.reshape(batch, channels, height // patch, patch, width // patch, patch)
    return tokens.permute(0, 2, 4, 3, 5, 1).reshape(batch, (height // patch) * (width // patch), -1)


@pytest.fixture(scope="module", params=TINY_MODELS)
def tiny(request):
    """(transformer, adapter): tiny-sd3-inpaint or its SD3.5-like variant, patched."""
    transformer = build_denoiser("tiny-sd3-inpaint").eval()
    if request.param == "sd35":
        transformer = build_sd35_like(transformer)
    adapter = patch_sd3(transformer)
    yield transformer, adapter
    adapter.unpatch()


def record(adapter, inputs: dict, template_id: str, step: int, num_text: int, num_image: int, cache,
           device: torch.device | str = "cpu") -> torch.Tensor:
    context = MaskAwareContext.record([template_id], [step], num_text, num_image, cache, device=device)
    with torch.no_grad(), adapter.run(context):
        return adapter.transformer(**inputs)[0]


@pytest.fixture(scope="module")
def tiny_templates(tiny):
    """Three templates recorded one by one at different steps: (inputs, step, model output, recorded output)."""
    transformer, adapter = tiny
    cache = InMemoryActivationCache()
    templates = []
    for request, step in enumerate([0, 3, 7]):
        inputs = random_sd3_inputs(transformer, 1, TINY_GRID, TINY_TEXT_TOKENS, seed=request)
        with torch.no_grad():
            unmodified = transformer(**inputs)[0]
        recorded = record(adapter, inputs, f"template-{request}", step, TINY_TEXT_TOKENS, NUM_IMAGE, cache)
        templates.append((inputs, step, unmodified, recorded))
    return cache, templates


@pytest.mark.parametrize("variant", TINY_MODELS)
def test_patch_keeps_weights_and_unpatched_behaviour(variant):
    transformer = build_denoiser("tiny-sd3-inpaint").eval()
    if variant == "sd35":
        transformer = build_sd35_like(transformer)
    inputs = random_sd3_inputs(transformer, 2, TINY_GRID, TINY_TEXT_TOKENS, seed=0)
    keys = list(transformer.state_dict())
    pointers = [p.data_ptr() for p in transformer.parameters()]
    with torch.no_grad():
        expected = transformer(**inputs)[0]
        adapter = patch_sd3(transformer)
        patched = transformer(**inputs)[0]
    assert torch.equal(patched, expected)
    assert list(transformer.state_dict()) == keys
    assert [p.data_ptr() for p in transformer.parameters()] == pointers
    with pytest.raises(RuntimeError, match="already patched"):
        patch_sd3(transformer)
    adapter.unpatch()
    assert all("forward" not in block.__dict__ for block in adapter.blocks)


def test_unsupported_processor_is_refused_at_patch_time():
    transformer = build_denoiser("tiny-sd3-inpaint").eval()
    transformer.fuse_qkv_projections()
    with pytest.raises(NotImplementedError, match="unfused projections"):
        patch_sd3(transformer)
    assert all("forward" not in block.__dict__ for block in transformer.transformer_blocks)


@pytest.mark.parametrize("mode", EDIT_MODES + [CacheMode.RECORD])
def test_all_tokens_masked_equals_unmodified_model(tiny, mode):
    transformer, adapter = tiny
    inputs = random_sd3_inputs(transformer, 2, TINY_GRID, TINY_TEXT_TOKENS, seed=11)
    with torch.no_grad():
        expected = transformer(**inputs)[0]
    cache = InMemoryActivationCache()  # empty: with every token masked nothing is read
    if mode is CacheMode.RECORD:
        context = MaskAwareContext.record(["a", "b"], [0, 0], TINY_TEXT_TOKENS, NUM_IMAGE, cache)
    else:
        context = MaskAwareContext.edit(mode, [torch.arange(NUM_IMAGE)] * 2, ["a", "b"], [0, 0],
                                        TINY_TEXT_TOKENS, NUM_IMAGE, cache)
    with torch.no_grad(), adapter.run(context):
        actual = transformer(**inputs)[0]
    assert_close_ulps(actual, expected, OUTPUT_ULPS)
    assert (cache.nbytes() > 0) == (mode is CacheMode.RECORD)


def test_record_equals_unmodified_model(tiny, tiny_templates):
    transformer, _ = tiny
    cache, templates = tiny_templates
    for _, _, unmodified, recorded in templates:
        assert_close_ulps(recorded, unmodified, OUTPUT_ULPS)
    head_dim = transformer.config.attention_head_dim
    for index, block in enumerate(transformer.transformer_blocks):
        if block.use_dual_attention:
            assert cache.get("template-0", 0, index, DUAL_KEY).shape == (NUM_IMAGE, block.attn2.heads, head_dim)
        else:
            with pytest.raises(KeyError):
                cache.get("template-0", 0, index, DUAL_KEY)


def block_plans(num_blocks: int) -> list:
    """Every block cached, and each mix of full and cached blocks that starts or ends with either."""
    mixed = [(False,) + (True,) * (num_blocks - 1), (True,) * (num_blocks - 1) + (False,),
             tuple(b % 2 == 1 for b in range(num_blocks)), tuple(b % 2 == 0 for b in range(num_blocks))]
    return [None] + mixed


@pytest.mark.parametrize("plan_index", range(5))
@pytest.mark.parametrize("mode", EDIT_MODES)
def test_replay_identity_ragged_batch(tiny, tiny_templates, mode, plan_index):
    """Same inputs as recorded, three requests with different masks (one empty) and templates."""
    transformer, adapter = tiny
    cache, templates = tiny_templates
    block_plan = block_plans(adapter.num_blocks)[plan_index]
    context = MaskAwareContext.edit(mode, masked_indices(NUM_IMAGE, TINY_GRID), [f"template-{b}" for b in range(3)],
                                    [t[1] for t in templates], TINY_TEXT_TOKENS, NUM_IMAGE, cache,
                                    block_plan=block_plan)
    with torch.no_grad(), adapter.run(context):
        actual = transformer(**stack_inputs([t[0] for t in templates]))[0]
    for request, (_, _, unmodified, recorded) in enumerate(templates):
        assert_close_ulps(actual[request: request + 1], recorded, OUTPUT_ULPS)
        assert_close_ulps(actual[request: request + 1], unmodified, OUTPUT_ULPS)


# On a GPU the masked path's matmuls run other cuBLAS kernels than full compute's (other row counts); this
# bound awaits the first GPU run of this test.
KERNEL_DEVICE_ULPS = OUTPUT_ULPS if TRITON_DEVICE.type == "cpu" else 256


@pytest.mark.parametrize("variant", TINY_MODELS)
@pytest.mark.parametrize("mode", EDIT_MODES)
def test_replay_identity_on_the_kernel_device(variant, mode):
    """Record and replay on the GPU where there is one (else the CPU) with the attention the engine picks
    there ("auto"): the replay matches the unmodified model."""
    transformer = build_denoiser("tiny-sd3-inpaint").eval()
    if variant == "sd35":
        transformer = build_sd35_like(transformer)
    transformer = transformer.to(TRITON_DEVICE)
    adapter = patch_sd3(transformer, attention_backend="auto")
    cache, templates = InMemoryActivationCache(), []
    for request, step in enumerate([0, 3, 7]):
        inputs = random_sd3_inputs(transformer, 1, TINY_GRID, TINY_TEXT_TOKENS, seed=request, device=TRITON_DEVICE)
        with torch.no_grad():
            unmodified = transformer(**inputs)[0]
        record(adapter, inputs, f"template-{request}", step, TINY_TEXT_TOKENS, NUM_IMAGE, cache, TRITON_DEVICE)
        templates.append((inputs, step, unmodified))
    context = MaskAwareContext.edit(mode, masked_indices(NUM_IMAGE, TINY_GRID), [f"template-{b}" for b in range(3)],
                                    [t[1] for t in templates], TINY_TEXT_TOKENS, NUM_IMAGE, cache,
                                    device=TRITON_DEVICE)
    with torch.no_grad(), adapter.run(context):
        actual = transformer(**stack_inputs([t[0] for t in templates]))[0]
    assert actual.device.type == TRITON_DEVICE.type
    for request, (_, _, unmodified) in enumerate(templates):
        assert_close_ulps(actual[request: request + 1], unmodified, KERNEL_DEVICE_ULPS)


@interpreter_replay
@pytest.mark.parametrize("mode", EDIT_MODES)
def test_replay_identity_with_triton_attention(tiny, tiny_templates, mode):
    """The Triton ragged-attention kernel in place of SDPA (interpreted on the CPU, see conftest);
    templates recorded by another patched copy of the same weights."""
    transformer, _ = tiny
    copy = SD3Transformer2DModel.from_config(transformer.config).eval()
    copy.load_state_dict(transformer.state_dict())
    adapter = patch_sd3(copy, attention_backend="triton")
    cache, templates = tiny_templates
    context = MaskAwareContext.edit(mode, masked_indices(NUM_IMAGE, TINY_GRID), [f"template-{b}" for b in range(3)],
                                    [t[1] for t in templates], TINY_TEXT_TOKENS, NUM_IMAGE, cache)
    with torch.no_grad(), adapter.run(context):
        actual = copy(**stack_inputs([t[0] for t in templates]))[0]
    for request, (_, _, unmodified, _) in enumerate(templates):
        assert_close_ulps(actual[request: request + 1], unmodified, OUTPUT_ULPS)


@pytest.mark.parametrize("mode", EDIT_MODES)
def test_new_content_changes_only_masked_tokens(tiny, tiny_templates, mode):
    """Other latents under the mask: the output changes there and, with every block cached, unmasked
    tokens keep the recorded output (they come from the template's recorded final hidden state)."""
    transformer, adapter = tiny
    cache, templates = tiny_templates
    inputs, step, _, recorded = templates[0]
    patch = transformer.config.patch_size
    masked = masked_indices(NUM_IMAGE, TINY_GRID)[1]
    token_mask = torch.zeros(NUM_IMAGE, dtype=torch.bool)
    token_mask[masked] = True
    # The latent pixels of the masked patches.
    pixel_mask = token_mask.reshape(TINY_GRID).repeat_interleave(patch, 0).repeat_interleave(patch, 1)
    edited = dict(inputs)
    latents = inputs["hidden_states"]
    edited["hidden_states"] = torch.where(pixel_mask, torch.randn(latents.shape), latents)
    context = MaskAwareContext.edit(mode, [masked], ["template-0"], [step], TINY_TEXT_TOKENS, NUM_IMAGE, cache)
    with torch.no_grad(), adapter.run(context):
        actual = patch_tokens(transformer(**edited)[0], patch)
    expected = patch_tokens(recorded, patch)
    assert_close_ulps(actual[:, ~token_mask], expected[:, ~token_mask], OUTPUT_ULPS)
    assert (actual[:, token_mask] - expected[:, token_mask]).abs().max() > 1e-2


def test_context_is_checked_and_released(tiny, tiny_templates):
    transformer, adapter = tiny
    cache, templates = tiny_templates
    context = MaskAwareContext.edit(CacheMode.Y_CACHE, [torch.arange(5)], ["template-0"], [0],
                                    TINY_TEXT_TOKENS, NUM_IMAGE, cache, block_plan=(True,) * (adapter.num_blocks + 1))
    with pytest.raises(ValueError, match="block_plan"):
        with adapter.run(context):
            pass
    wrong_batch = MaskAwareContext.edit(CacheMode.Y_CACHE, [torch.arange(5)] * 2, ["template-0"] * 2, [0, 0],
                                        TINY_TEXT_TOKENS, NUM_IMAGE, cache)
    with pytest.raises(ValueError, match="requests"), torch.no_grad(), adapter.run(wrong_batch):
        transformer(**templates[0][0])
    assert adapter.active_context is None
    with torch.no_grad():
        assert torch.equal(transformer(**templates[0][0])[0], templates[0][2])


# ---- a wider SD3.5-like model: replay identity and the FLOPs of Table 1 ----

WIDE_GRID = (16, 16)  # 256 image tokens
WIDE_TEXT_TOKENS = 32
WIDE_MASK_RATIO = 0.2
WIDE_CONFIG = dict(num_layers=4, num_attention_heads=8, attention_head_dim=32, caption_projection_dim=256,
                   sample_size=32, dual_attention_layers=(0, 1))


def predicted_macs(transformer, num_text: int, num_image: int, num_masked: int, mode: CacheMode | None) -> int:
    """Multiply-accumulates of one forward of one request, counted per op. mode None: the unmodified
    model; RECORD (num_masked = num_image): every token, without the last block's discarded text queries.

    Per image token a joint block has q, k, v, out (4 H^2) + feed-forward H->4H->H (8 H^2); Y-cache projects
    k and v for every token (2 H^2) and the other 10 H^2 for query tokens only; KV-cache runs all 12 H^2
    on query tokens. Dual attention (attn2) adds q, k, v, out (4 H^2), split the same way, and an
    image-only attention. Text tokens run add_q/k/v, to_add_out and ff_context (12 H^2) in full; in the
    context_pre_only block only add_k/v (2 H^2), plus add_q (H^2) in the unmodified model, which also
    runs the discarded text queries through attention there. Attention is 2 * queries * keys * H (QK^T
    and AV). Per request, not per token: modulation linears (6 H^2, or 9 H^2 with attn2, for the image;
    6 H^2 for the text, 2 H^2 in the context_pre_only block). Outside the blocks, in full: pos_embed's
    patch conv, context_embedder and proj_out per token; time and pooled-text embedders and norm_out.
    """
    config = transformer.config
    hidden = config.num_attention_heads * config.attention_head_dim
    image_queries = num_image if mode is None else num_masked
    kv_image = num_masked if mode is CacheMode.KV_CACHE else num_image
    keys = num_text + num_image
    macs = 0
    for block in transformer.transformer_blocks:
        image = (2 * kv_image + 10 * image_queries) * hidden ** 2
        if block.use_dual_attention:
            image += (2 * kv_image + 2 * image_queries) * hidden ** 2 + 2 * image_queries * num_image * hidden
        image += (9 if block.use_dual_attention else 6) * hidden ** 2
        if block.context_pre_only:
            text_queries = num_text if mode is None else 0
            text = (2 * num_text + text_queries) * hidden ** 2 + 2 * hidden ** 2
        else:
            text_queries = num_text
            text = 12 * num_text * hidden ** 2 + 6 * hidden ** 2
        macs += image + text + 2 * (text_queries + image_queries) * keys * hidden
    patch_pixels = config.patch_size ** 2
    timestep_channels = 256  # SD3's sinusoidal timestep projection
    outside = ((num_image * patch_pixels * config.in_channels + num_text * config.joint_attention_dim
                + num_image * patch_pixels * config.out_channels) * hidden
               + timestep_channels * hidden + hidden * hidden  # timestep embedder
               + config.pooled_projection_dim * hidden + hidden * hidden  # pooled-text embedder
               + 2 * hidden * hidden)  # norm_out's modulation
    return macs + outside


def count_flops(transformer, inputs) -> tuple[int, torch.Tensor]:
    # The math backend decomposes SDPA into matmuls that FlopCounterMode counts (it has no formula for
    # the CPU flash kernel), for the unmodified model and the ragged path alike.
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        output = transformer(**inputs)[0]
    return counter.get_total_flops(), output


def test_wide_replay_identity_and_flops():
    transformer = build_sd35_like(build_denoiser("tiny-sd3-inpaint"), seed=1, **WIDE_CONFIG)
    num_image = WIDE_GRID[0] * WIDE_GRID[1]
    inputs = random_sd3_inputs(transformer, 1, WIDE_GRID, WIDE_TEXT_TOKENS, seed=3)
    full_flops, unmodified = count_flops(transformer, inputs)
    # FlopCounterMode counts 2 FLOPs per multiply-accumulate of every matmul; the per-op count is exact.
    assert full_flops == 2 * predicted_macs(transformer, WIDE_TEXT_TOKENS, num_image, num_image, None)

    adapter = patch_sd3(transformer)
    cache = InMemoryActivationCache()
    context = MaskAwareContext.record(["template"], [5], WIDE_TEXT_TOKENS, num_image, cache)
    with adapter.run(context):
        record_flops, recorded = count_flops(transformer, inputs)
    assert_close_ulps(recorded, unmodified, OUTPUT_ULPS)
    # Recording computes every image token but skips the discarded text queries of the last block.
    assert record_flops == 2 * predicted_macs(transformer, WIDE_TEXT_TOKENS, num_image, num_image, CacheMode.RECORD)

    num_masked = round(WIDE_MASK_RATIO * num_image)
    masked = torch.randperm(num_image, generator=torch.Generator().manual_seed(0))[:num_masked]
    ratios = {}
    for mode in EDIT_MODES:
        context = MaskAwareContext.edit(mode, [masked], ["template"], [5], WIDE_TEXT_TOKENS, num_image, cache)
        with adapter.run(context):
            flops, edited = count_flops(transformer, inputs)
        assert_close_ulps(edited, recorded, OUTPUT_ULPS)
        assert flops == 2 * predicted_macs(transformer, WIDE_TEXT_TOKENS, num_image, num_masked, mode)
        ratios[mode] = flops / full_flops
    # From the count at H=256, P=32, L=256, m=0.2, 4 blocks (2 with attn2, the last context_pre_only):
    # Y-cache 0.392, KV-cache 0.265 of the unmodified model's FLOPs (1/m = 5x on the image tokens'
    # linears; text tokens, attention keys and Y's K/V projections stay).
    assert ratios[CacheMode.Y_CACHE] < 0.40
    assert ratios[CacheMode.KV_CACHE] < 0.27
