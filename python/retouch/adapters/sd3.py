"""Mask-aware SD3 / SD3.5: only masked image tokens (and the text tokens) are computed in each block.

`patch_sd3(transformer)` overrides `forward` on each JointTransformerBlock instance of a loaded
SD3Transformer2DModel, with the same contract as `retouch.adapters.flux.patch_flux`: the overrides use
the blocks' own submodules (no weight copies; state_dict keys unchanged); with no context active they
call the class forward; inside `with adapter.run(context):` each block computes per the context:

- RECORD: every token is computed; the block's image-token output, keys and values are cached.
- Y_CACHE (paper Fig. 5): K and V come from all tokens, whose unmasked rows are the previous block's
  recorded outputs; Q, attention output, feed-forward and the gated residuals run on the masked image
  tokens and the text only. Unmasked rows of the output are this block's recorded output.
- KV_CACHE (paper Fig. 7): norms, projections, attention and feed-forward run on the masked image
  tokens and the text only; unmasked image keys and values come from the cache. Unmasked output rows
  are filled from the recorded output only where something reads them.
- Blocks whose `block_plan` entry is False run the class forward (all tokens, no cache traffic).

What differs from Flux: no RoPE (SD3's position embedding is added by pos_embed before the blocks), so
keys need no positions and each request's keys are its [image; text] tokens, the order in which
JointAttnProcessor2_0 concatenates them. The last block is context_pre_only: its text output is
discarded, so there only the masked image tokens are queries (text gives keys and values). SD3.5's dual
attention (`use_dual_attention`: attn2, self-attention over the image tokens only) runs mask-aware as a
second ragged attention whose keys are the request's image tokens; in KV-cache mode its keys and values
are cached as "k2"/"v2". qk norms (norm_q, norm_k, norm_added_q, norm_added_k) act per head, so they
apply to packed tokens unchanged.

`skip_layers` of SD3Transformer2DModel.forward is not seen by a block hook: do not pass it inside a
mask-aware context (a skipped block records nothing, and in KV-cache mode the block before it would not
fill the rows its reader needs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from diffusers.models.attention import JointTransformerBlock
from diffusers.models.attention_processor import JointAttnProcessor2_0
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

from retouch import ops
from retouch.adapters.base import MaskAwareAdapter
from retouch.adapters.block_math import (continuous_norm_rows, feed_forward, flat_rows, head_dim, heads, joint,
                                         layer_norm, linear, modulation, norm_rope, output, pack_queries, per_row,
                                         split_queries, with_rows)
from retouch.adapters.cache_rows import block_output, record_activations, recorded_rows
from retouch.adapters.context import DUAL_KEY, DUAL_VALUE, KEY, OUT, VALUE, CacheMode, MaskAwareContext


class SD3Rows(NamedTuple):
    """One forward's index tensors, shared by its masked blocks (tensors only: a compiled core takes them
    as inputs, so a new mask is new data, not a new graph)."""

    image_query_rows: torch.Tensor  # [T_img] rows of the masked image tokens in the image matrix
    text_query_slots: torch.Tensor  # [B * P] where each text token sits among the T_q queries
    image_query_slots: torch.Tensor  # [T_img] where each masked image token does
    request_image_queries: torch.Tensor | None  # [T_img] each masked token's request; None: a batch of one, eager
    # A mixed-resolution batch only (image rows packed, `TokenLayout`; None otherwise): each image row's
    # request [sum L_b], and the (text, image) rows of the packed [image; text] key matrix.
    request_image: torch.Tensor | None = None
    joint_rows: tuple[torch.Tensor, torch.Tensor] | None = None


class SD3Plans(NamedTuple):
    """The ragged attentions of one forward (`retouch.ops.plan_attention`), planned before its first block.

    joint:       text and masked image queries against each request's [image; text] keys
    image_joint: masked image queries only (the context_pre_only block) against the same keys
    image_only:  masked image queries against the request's image tokens (SD3.5's attn2)
    """

    joint: ops.AttentionPlan
    image_joint: ops.AttentionPlan
    image_only: ops.AttentionPlan


class SD3MaskAwareAdapter(MaskAwareAdapter):
    """Handle of a patched SD3Transformer2DModel; `run(context)` makes one or more forwards mask-aware.

    Blocks are numbered in execution order (`transformer.transformer_blocks`).
    """

    def __init__(self, transformer: SD3Transformer2DModel, attention_backend: str = "auto"):
        self.transformer = transformer
        super().__init__(transformer.transformer_blocks, attention_backend)

    def block_kinds(self) -> tuple[str, ...]:
        return tuple("joint-last" if block.context_pre_only else "joint" for block in self.blocks)

    def forward_packed(self, hidden_states: list[torch.Tensor], encoder_hidden_states: torch.Tensor,
                       pooled_projections: torch.Tensor, timestep: torch.Tensor) -> list[torch.Tensor]:
        """SD3Transformer2DModel.forward over requests of different image sizes in one forward, inside
        `run(context)` with a mixed-resolution context: row r's latents `hidden_states[r]: [C, h_r, w_r]`
        and its row of the batched inputs -> its `[C_out, h_r, w_r]`. Rows of one size are patch-embedded
        together (each size has its own position crop); the image tokens are then packed `[sum L_r, H]`
        through every block (per-token ops on the packed rows, attention within a request), the text is
        `[R, P, H]`."""
        context = self.active_context
        if context is None or not context.mixed:
            raise RuntimeError("forward_packed runs inside run(context) with a mixed-resolution context")
        model = self.transformer
        by_shape: dict[tuple, list[int]] = {}
        for row, latents in enumerate(hidden_states):
            by_shape.setdefault(tuple(latents.shape), []).append(row)
        embedded: list[torch.Tensor | None] = [None] * len(hidden_states)
        for rows in by_shape.values():
            for row, tokens in zip(rows, model.pos_embed(torch.stack([hidden_states[r] for r in rows]))):
                embedded[row] = tokens
        hidden = torch.cat(embedded)
        temb = model.time_text_embed(timestep, pooled_projections)
        text = model.context_embedder(encoder_hidden_states)
        for block in self.blocks:
            text, hidden = block(hidden_states=hidden, encoder_hidden_states=text, temb=temb)
        hidden = model.proj_out(continuous_norm_rows(model.norm_out, hidden, temb, context.layout.image_request))
        patch, channels = model.config.patch_size, model.out_channels
        outputs = []
        for tokens, latents in zip(hidden.split(list(context.image_lens)), hidden_states):
            height, width = latents.shape[-2] // patch, latents.shape[-1] // patch
            tokens = tokens.reshape(height, width, patch, patch, channels)
            outputs.append(torch.einsum("hwpqc->chpwq", tokens).reshape(channels, height * patch, width * patch))
        return outputs


def patch_sd3(transformer: SD3Transformer2DModel, attention_backend: str = "auto") -> SD3MaskAwareAdapter:
    """Patch `transformer`'s blocks in place; returns the adapter whose `run(context)` activates them.

    `attention_backend` is the `retouch.ops.ragged_attention` backend of masked blocks ("auto": flash-attn
    or Triton on CUDA, per-request SDPA on the CPU).
    """
    adapter = SD3MaskAwareAdapter(transformer, attention_backend)
    for index, block in enumerate(adapter.blocks):
        if not isinstance(block, JointTransformerBlock):
            raise NotImplementedError(f"block {index}: mask-aware SD3 patches JointTransformerBlock, "
                                      f"got {type(block).__name__}")
        if "forward" in block.__dict__:
            raise RuntimeError(f"block {index} of the transformer is already patched")
        for attn in (block.attn, block.attn2):
            if attn is None:
                continue
            if type(attn.processor) is not JointAttnProcessor2_0 or attn.fused_projections:
                # The masked path re-implements JointAttnProcessor2_0's math (unfused projections) on packed tokens.
                raise NotImplementedError(f"block {index}: mask-aware SD3 supports JointAttnProcessor2_0 with "
                                          f"unfused projections, got {type(attn.processor).__name__}")
    for index, block in enumerate(adapter.blocks):
        # A plain callable, not an nn.Module: the instance attribute must not register as a submodule.
        block.forward = functools.partial(_dispatch, adapter, block, index, type(block).forward)
    return adapter


def _dispatch(adapter: SD3MaskAwareAdapter, block: JointTransformerBlock, index: int, original_forward: Callable,
              hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
              joint_attention_kwargs: dict | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    context = adapter.active_context
    if context is None or not context.uses_cache(index):
        if context is not None and context.mixed:
            def unmodified(key, requests, image_rows, num_image):
                return adapter.core(original_forward)(
                    block, hidden_states[image_rows].unflatten(0, (len(requests), num_image)),
                    encoder_hidden_states[requests], temb[requests], joint_attention_kwargs)
            outputs = adapter.by_size(context, unmodified, hidden_states, encoder_hidden_states)
        else:
            outputs = adapter.core(original_forward)(block, hidden_states, encoder_hidden_states, temb,
                                                     joint_attention_kwargs)
        if context is not None and context.recording_requests:  # an unmodified block keeps its output only
            record_activations(context, index, {OUT: outputs[1]})
        return outputs
    if joint_attention_kwargs:
        raise NotImplementedError("mask-aware SD3 takes no joint_attention_kwargs (IP-Adapter), "
                                  f"got {sorted(joint_attention_kwargs)}")
    context.check_shapes(hidden_states, encoder_hidden_states)
    return _joint_block_forward(block, adapter, context, index, hidden_states, encoder_hidden_states, temb)


def _forward_plan(adapter: SD3MaskAwareAdapter, context: MaskAwareContext, dtype: torch.dtype, heads: int,
                  width: int) -> tuple[SD3Rows, SD3Plans]:
    """The rows and attention plans every masked block of the active context shares, made once."""
    def plan() -> tuple[SD3Rows, SD3Plans]:
        layout, batch = adapter.computed_layout(context), adapter.computed_batch(context.batch)
        device = batch.cu_seqlens_q.device
        image_counts = layout.image_counts
        planned = functools.partial(ops.plan_attention, device=device, dtype=dtype, head_dim=width,
                                    backend=adapter.attention_backend, heads=heads)
        plans = SD3Plans(
            joint=planned(batch.query_counts(), batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q,
                          cu_seqlens_k=batch.cu_seqlens_k),
            image_joint=planned(image_counts, batch.seq_lens, cu_seqlens_k=batch.cu_seqlens_k),
            image_only=planned(image_counts, list(context.image_lens)))
        batched = adapter.compiling or batch.batch_size > 1  # a compiled core takes one path
        packed = {"request_image": layout.image_request, "joint_rows": layout.joint_rows(text_first=False)
                  } if layout.packed else {}
        rows = SD3Rows(layout.image_query_rows, layout.text_query_slots, layout.image_query_slots,
                       layout.image_query_request if batched else None, **packed)
        return rows, plans
    return adapter.memo(("sd3", dtype, width), plan)


# ---- the joint block (separate text and image weights, joint attention; optional attn2 on the image) ----

def _joint_block_forward(block: JointTransformerBlock, adapter: SD3MaskAwareAdapter, context: MaskAwareContext,
                         index: int, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                         temb: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """hidden_states: [B, L, H] image tokens (packed [sum L_b, H] in a mixed-resolution batch),
    encoder_hidden_states: [B, P, H] text -> (text or None, image).
    Eager around a tensors-only core: the recorded keys and values are read before it, the block's
    output filled and its activations recorded after it."""
    rows, plans = _forward_plan(adapter, context, hidden_states.dtype, block.attn.heads, head_dim(block.attn))
    recorded = None
    if context.mode is not CacheMode.Y_CACHE:
        like = adapter.key_rows_like(hidden_states, block.attn.heads, head_dim(block.attn))
        names = (KEY, VALUE, DUAL_KEY, DUAL_VALUE) if block.use_dual_attention else (KEY, VALUE)
        recorded = tuple(recorded_rows(context, index, name, like) for name in names)
    encoder_hidden_states, image_rows, keys = adapter.core(joint_block_core)(
        block, hidden_states, encoder_hidden_states, temb, rows, recorded, plans)
    image_out = block_output(adapter, context, index, hidden_states, image_rows, rows.image_query_rows)
    if context.recording_requests:
        record_activations(context, index, {OUT: image_out, **dict(zip((KEY, VALUE, DUAL_KEY, DUAL_VALUE), keys))})
    return encoder_hidden_states, image_out


def joint_block_core(block: JointTransformerBlock, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                     temb: torch.Tensor, rows: SD3Rows, recorded: tuple[torch.Tensor, ...] | None, plans: SD3Plans):
    """JointTransformerBlock's math on the masked image tokens and the text -> (text output [B, P, H] or
    None, masked image rows [T_img, H], image (keys, values[, attn2 keys, attn2 values]) shaped as the
    image matrix ([B, L, heads, d], or packed [sum L_b, heads, d])).
    Y-cache without `recorded` (K and V from every token: unmasked rows of the input are recorded
    outputs, Fig. 5); KV-cache with the recorded keys and values (Fig. 7), whose masked rows are
    overwritten by computed ones."""
    parts = block._modules  # submodules without nn.Module.__getattr__ (block_math)
    attn, dual = parts["attn"], block.use_dual_attention
    mods = attn._modules
    hidden = hidden_states.shape[-1]
    batched = rows.request_image_queries is not None

    # Text stream: every token, the block's own ops on [B, P, H].
    if block.context_pre_only:
        norm_text = parts["norm1_context"].forward(encoder_hidden_states, temb)
    else:
        norm_text, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = parts["norm1_context"].forward(
            encoder_hidden_states, emb=temb)
    text_k = _qk_norm(mods.get("norm_added_k"), heads(attn, linear(mods["add_k_proj"], norm_text)))
    text_v = heads(attn, linear(mods["add_v_proj"], norm_text))

    # Image stream: the masked tokens, packed across the batch, modulated per request (AdaLayerNormZero:
    # shift, scale, gate for attention, then the feed-forward, then SD3.5's attn2).
    chunks = 9 if dual else 6
    per_request, modulation_rows = modulation(parts["norm1"], temb, chunks, (1, 4, 7) if dual else (1, 4),
                                              rows.request_image_queries)
    modulated = modulation_rows.chunk(chunks, dim=-1)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = modulated[:6]
    image_rows = ops.gather_rows(hidden_states.reshape(-1, hidden), rows.image_query_rows)  # [T_img, H]
    keys2 = ()
    if recorded is None:
        shift, scale = per_row(per_request[..., :2 * hidden], rows.request_image).chunk(2, dim=-1)
        normed = layer_norm(parts["norm1"]._modules["norm"], hidden_states)
        norm_image = torch.addcmul(shift, normed, scale)
        image_k = _qk_norm(mods.get("norm_k"), heads(attn, linear(mods["to_k"], norm_image)))
        image_v = heads(attn, linear(mods["to_v"], norm_image))
        norm_rows = ops.gather_rows(norm_image.reshape(-1, hidden), rows.image_query_rows)
        if dual:
            attn2 = parts["attn2"]
            mods2 = attn2._modules
            shift2, scale2 = per_row(per_request[..., 6 * hidden:8 * hidden], rows.request_image).chunk(2, dim=-1)
            norm_image2 = torch.addcmul(shift2, normed, scale2)
            keys2 = (_qk_norm(mods2.get("norm_k"), heads(attn2, linear(mods2["to_k"], norm_image2))),
                     heads(attn2, linear(mods2["to_v"], norm_image2)))
            norm_rows2 = ops.gather_rows(norm_image2.reshape(-1, hidden), rows.image_query_rows)
    else:
        normed_rows = layer_norm(parts["norm1"]._modules["norm"], image_rows)
        norm_rows = torch.addcmul(shift_msa, normed_rows, scale_msa)
        image_k = with_rows(recorded[0], rows.image_query_rows,
                            _qk_norm(mods.get("norm_k"), heads(attn, linear(mods["to_k"], norm_rows))))
        image_v = with_rows(recorded[1], rows.image_query_rows, heads(attn, linear(mods["to_v"], norm_rows)))
        if dual:
            attn2 = parts["attn2"]
            mods2 = attn2._modules
            norm_rows2 = torch.addcmul(modulated[6], normed_rows, modulated[7])
            keys2 = (with_rows(recorded[2], rows.image_query_rows,
                               _qk_norm(mods2.get("norm_k"), heads(attn2, linear(mods2["to_k"], norm_rows2)))),
                     with_rows(recorded[3], rows.image_query_rows,
                               heads(attn2, linear(mods2["to_v"], norm_rows2))))
    image_q = _qk_norm(mods.get("norm_q"), heads(attn, linear(mods["to_q"], norm_rows)))

    # Joint attention: per request, queries against [all image; text] keys (JointAttnProcessor2_0's order).
    key = flat_rows(joint(text_k, image_k, rows.joint_rows, text_first=False))
    value = flat_rows(joint(text_v, image_v, rows.joint_rows, text_first=False))
    if block.context_pre_only:
        # The text output of this block is discarded, so only masked image tokens are queries.
        image_attn = ops.planned_attention(image_q, key, value, plans.image_joint).flatten(1)
        text_attn = None
    else:
        text_q = _qk_norm(mods.get("norm_added_q"), heads(attn, linear(mods["add_q_proj"], norm_text)))
        query = pack_queries(text_q, image_q, rows.text_query_slots, rows.image_query_slots, batched)
        attn_out = ops.planned_attention(query, key, value, plans.joint).flatten(1)
        text_out, image_attn = split_queries(attn_out, rows.text_query_slots, rows.image_query_slots,
                                             text_q.shape[0], text_q.shape[1], batched)
        text_attn = linear(mods["to_add_out"], text_out)

    # Image residuals and feed-forward, modulated per request (JointTransformerBlock's order).
    image_rows = torch.addcmul(image_rows, gate_msa, output(attn, image_attn))
    if dual:
        query2 = _qk_norm(mods2.get("norm_q"), heads(attn2, linear(mods2["to_q"], norm_rows2)))
        image_attn2 = ops.planned_attention(query2, flat_rows(keys2[0]), flat_rows(keys2[1]), plans.image_only).flatten(1)
        image_rows = torch.addcmul(image_rows, modulated[8], output(attn2, image_attn2))
    norm_rows = torch.addcmul(shift_mlp, layer_norm(parts["norm2"], image_rows), scale_mlp)
    image_rows = torch.addcmul(image_rows, gate_mlp, feed_forward(parts["ff"], norm_rows))

    if block.context_pre_only:
        encoder_hidden_states = None
    else:
        encoder_hidden_states = torch.addcmul(encoder_hidden_states, c_gate_msa.unsqueeze(1), text_attn)
        norm_text = layer_norm(parts["norm2_context"], encoder_hidden_states)
        norm_text = norm_text * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
        encoder_hidden_states = torch.addcmul(encoder_hidden_states, c_gate_mlp.unsqueeze(1),
                                              feed_forward(parts["ff_context"], norm_text))
    return encoder_hidden_states, image_rows, (image_k, image_v, *keys2)


def _qk_norm(norm: torch.nn.Module | None, heads: torch.Tensor) -> torch.Tensor:
    """An optional qk norm (RMSNorm or LayerNorm over head_dim, so per token and head)."""
    return norm_rope(norm, heads)


__all__ = ["SD3MaskAwareAdapter", "patch_sd3"]
