"""A built-in cost model of one H800-class GPU running FLUX.1 (dev size) at 1024x1024 with a bf16
Y-cache: the default of `retouch simulate`, and what routing falls back on when no worker was profiled.

It is a model derived from figures the paper prints, not a measurement; a `retouch profile` fit on the
real GPU replaces it. Shape (FLUX.1 architecture): 19 double + 38 single blocks, hidden H = 3072,
1024x1024 -> 64x64 = 4096 image tokens, 512 text tokens (T5 max_sequence_length), 28 steps (FLUX.1-dev's
default in diffusers; the paper says only that each model runs its default settings, §6.1).

Compute. Each block costs intercept + FLOPs / E. FLOPs per block: both Flux block kinds do 12*H^2
multiply-adds per token (double: per stream qkv 3, out 1, MLP 8; single: linear1 3+4, linear2 5), of
which K/V projection is 2*H^2; attention is 2*H multiply-adds per query-key pair (QK^T and PV). So
FLOPs = 2*(10*H^2*query_tokens + 2*H^2*kv_tokens + 2*H*attention_pairs) for the full and the Y-cache
variant alike (Y-cache computes Q, the projections after attention and the MLP for the masked tokens
only, K/V for all). The paper gives no split between the kinds: they get the same fit.
The two constants are solved from two figures:
  - §3 "Alternative approaches": at mask ratio 20% the Y-cache edit takes 2.27 s;
  - §6.3 (Fig. 15, right): at mask ratio 0.2 mask-aware editing is 1.9x faster than full compute,
    so the full-compute edit takes 2.27 * 1.9 = 4.31 s;
  both over STEPS steps, at batch 1. The masked step is compute-bound (checked by the tests) and so
  costs every block's Y-cache compute plus the first block's load, which no compute hides.
  This gives E ~ 621 TFLOP/s (63% of H800's ~989 dense bf16 peak) and ~0.60 ms per block: fixed costs
  the FLOPs do not explain (launches, small GEMMs, the step's non-block work) are put on the blocks.
  Latency is then linear in the mask ratio, as Fig. 15 shows.
Loads. A Y-cache row is one block output token: H * 2 bytes (bf16). Host->device at PCIE_BYTES_PER_S
  = 25 GB/s, an assumption (pinned copies of gathered rows over PCIe, below Gen5 x16's 64 GB/s
  nominal; the paper reports none), plus 5 us per copy.
Check against a figure not used in the fit: §1 says masking magnifies the batching gain at batch 4
  by 1.29x over full-image generation; this model gives 1.22x at mask ratio 0.2 (see the tests).
"""

from __future__ import annotations

from retouch.costs import CostModel, LinearModel, RequestTokens, block_features

HIDDEN = 3072
DOUBLE_BLOCKS, SINGLE_BLOCKS = 19, 38
IMAGE_TOKENS = (1024 // 16) ** 2  # VAE /8, then 2x2 patches
TEXT_TOKENS = 512
STEPS = 28
MASKED_EDIT_S = 2.27  # §3, Y-cache, mask ratio 20%
SPEEDUP_AT_20_PERCENT = 1.9  # §6.3, Fig. 15 right
PCIE_BYTES_PER_S = 25e9  # assumption, see the module docstring
COPY_OVERHEAD_S = 5e-6
ROW_BYTES = HIDDEN * 2  # bf16 block output

FEATURES = ("query_tokens", "kv_tokens", "attention_pairs", "rows")
FLOPS_PER_FEATURE = (2 * 10 * HIDDEN ** 2, 2 * 2 * HIDDEN ** 2, 2 * 2 * HIDDEN, 0)


def _flops(features: dict[str, float]) -> float:
    return sum(weight * features[name] for name, weight in zip(FEATURES, FLOPS_PER_FEATURE))


def _load_seconds(nbytes: float) -> float:
    return COPY_OVERHEAD_S + nbytes / PCIE_BYTES_PER_S


def _calibrate() -> tuple[float, float]:
    """(FLOP/s, seconds per block) so that batch-1 steps match the two figures."""
    blocks = DOUBLE_BLOCKS + SINGLE_BLOCKS
    masked = round(0.2 * IMAGE_TOKENS)
    row = RequestTokens(text=TEXT_TOKENS, image=IMAGE_TOKENS, masked=masked)
    full_flops, cached_flops = _flops(block_features([row], "full")), _flops(block_features([row], "y"))
    full_step = MASKED_EDIT_S * SPEEDUP_AT_20_PERCENT / STEPS
    masked_step = MASKED_EDIT_S / STEPS - _load_seconds((IMAGE_TOKENS - masked) * ROW_BYTES)
    # blocks * (overhead + flops / rate) = step, for both steps: two linear equations.
    rate = blocks * (full_flops - cached_flops) / (full_step - masked_step)
    overhead = full_step / blocks - full_flops / rate
    return rate, overhead


def h800_flux() -> CostModel:
    """The built-in model (see the module docstring) as a `CostModel`."""
    rate, overhead = _calibrate()
    fit = LinearModel(FEATURES, tuple(weight / rate for weight in FLOPS_PER_FEATURE), overhead, float("nan"), 0)
    load = LinearModel(("bytes",), (1 / PCIE_BYTES_PER_S,), COPY_OVERHEAD_S, float("nan"), 0)
    compute = {kind: {"full": fit, "y": fit, "kv": fit} for kind in ("double", "single")}
    # The same FLOP weights price the KV-cache variant: its features count K/V of the masked tokens only.
    return CostModel(model="flux-dev-1024 (built-in model)", device="H800 (modelled from the paper)",
                     dtype="bfloat16",
                     block_kinds=("double",) * DOUBLE_BLOCKS + ("single",) * SINGLE_BLOCKS, compute=compute,
                     row_bytes={kind: {"out": ROW_BYTES, "k": ROW_BYTES, "v": ROW_BYTES} for kind in compute},
                     load=load,
                     meta={"image_tokens": IMAGE_TOKENS, "text_tokens": TEXT_TOKENS, "steps": STEPS,
                           "flops_per_s": rate, "block_overhead_s": overhead,
                           "source": "engine/reference_costs.py: derived from InstGenIE §3, §6.3; not measured"})
