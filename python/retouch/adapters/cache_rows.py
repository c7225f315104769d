"""Rows of recorded activations merged with computed ones: shared by the mask-aware adapters whose
blocks see one image-token matrix per block (Flux, SD3): `[B, L, ...]`, or `[sum L_b, ...]` packed in a
mixed-resolution batch.

Each request of a `MaskAwareContext` reads its own template at its own step; computed rows (the masked
tokens, packed across the batch) are scattered over the recorded ones.
"""

from __future__ import annotations

import math

import torch

from retouch import ops
from retouch.adapters.context import OUT, CacheMode, MaskAwareContext


def recorded_rows(context: MaskAwareContext, block: int, name: str, like: torch.Tensor) -> torch.Tensor:
    """[B, L, ...] (packed: [sum L_b, ...]) recorded `name` of each request's template at its step;
    requests with every image token masked read nothing (their rows are all overwritten by computed ones)."""
    keys = [(template_id, step, name)
            if context.mode is not CacheMode.RECORD and context.request_reuses_tokens(request) else None
            for request, (template_id, step) in enumerate(zip(context.template_ids, context.steps))]
    return context.cache.read_rows(block, name, keys, like, context.image_lens if context.mixed
                                   else context.num_image_tokens)


def rows_with_recorded(context: MaskAwareContext, block: int, name: str, computed: torch.Tensor,
                       image_query_rows: torch.Tensor) -> torch.Tensor:
    """The image matrix of `name`: recorded at unmasked image tokens, `computed: [T_img, ...]` at masked ones."""
    full = recorded_rows(context, block, name, computed)
    ops.scatter_rows_(full.view(-1, math.prod(computed.shape[1:])), image_query_rows, computed.flatten(1))
    return full


def block_output(adapter, context: MaskAwareContext, index: int, hidden_states: torch.Tensor,
                 image_rows: torch.Tensor, image_query_rows: torch.Tensor) -> torch.Tensor:
    """The block's image output, shaped as its input `hidden_states` ([B, L, H] or packed [sum L_b, H]):
    computed `image_rows` at masked tokens; at unmasked ones the block's recorded output where it is read
    (Y-cache, or a KV-cache block whose next reader needs every row); otherwise the stale input rows,
    which no later op reads."""
    hidden = hidden_states.shape[-1]
    if context.mode is CacheMode.KV_CACHE and not adapter.needs_all_output_rows(context, index):
        out = adapter.output_over_stale_rows(hidden_states, bool(context.recording_requests))
        ops.scatter_rows_(out.view(-1, hidden), image_query_rows, image_rows)
        return out
    return rows_with_recorded(context, index, OUT, image_rows, image_query_rows)


def record_activations(context: MaskAwareContext, block: int, image_activations: dict[str, torch.Tensor]) -> None:
    """Keep each recording request's [L, ...] image-token activations under its template and step."""
    for name, tensor in image_activations.items():
        for request in context.recording_requests:
            context.record_to.put(context.template_ids[request], context.steps[request], block, name,
                                  context.request_image_rows(tensor, request))
