"""FLOPs of one denoiser forward: counted (torch.utils.flop_counter) and predicted per op from the
model config (the paper's Table 1, made exact for a given architecture)."""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from retouch.adapters.context import CacheMode


def flux_forward_macs(config, num_text: int, num_image: int, num_masked: int, mode: CacheMode | None) -> int:
    """Multiply-accumulates of one forward of one request (mode None: full compute), counted per op.

    Per token a block has 12 H^2 of projections: double-stream q, k, v, out (4 H^2) + feed-forward
    H->4H->H (8 H^2); single-stream q, k, v (3 H^2) + proj_mlp H->4H (4 H^2) + proj_out 5H->H (5 H^2).
    Y-cache projects k and v for every token (2 H^2) and the other 10 H^2 for query tokens only;
    KV-cache runs all 12 H^2 on query tokens. Attention is 2 * queries * keys * H (QK^T and AV), keys
    always all P + L tokens. Text tokens are always queries. Per request, not per token: modulation
    linears (6 H^2 twice per double block, 3 H^2 per single block). Outside the blocks, always in full:
    x_embedder, context_embedder, proj_out per token; time/guidance/pooled-text embedders and norm_out.
    """
    hidden = config.num_attention_heads * config.attention_head_dim
    queries_image = num_image if mode is None else num_masked
    keys = num_text + num_image
    kv_tokens_image = num_image if mode in (None, CacheMode.Y_CACHE) else num_masked

    def projections(query_tokens, kv_tokens):
        return (2 * kv_tokens + 10 * query_tokens) * hidden * hidden

    attention = 2 * (num_text + queries_image) * keys * hidden
    double = (projections(num_text, num_text) + projections(queries_image, kv_tokens_image)
              + attention + 2 * 6 * hidden * hidden)
    single = projections(num_text + queries_image, num_text + kv_tokens_image) + attention + 3 * hidden * hidden
    timestep_channels = 256  # Flux's sinusoidal timestep (and guidance) projection
    outside = ((num_image * config.in_channels + num_text * config.joint_attention_dim
                + num_image * config.out_channels) * hidden
               + 2 * (timestep_channels * hidden + hidden * hidden)  # timestep and guidance embedders
               + (config.pooled_projection_dim * hidden + hidden * hidden)  # pooled text embedder
               + 2 * hidden * hidden)  # norm_out's modulation
    return config.num_layers * double + config.num_single_layers * single + outside


def count_flops(transformer, inputs) -> tuple[int, torch.Tensor]:
    # The math backend decomposes SDPA into matmuls that FlopCounterMode counts (it has no formula for
    # the CPU flash kernel), for the unmodified model and the ragged path alike.
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        output = transformer(**inputs)[0]
    return counter.get_total_flops(), output
