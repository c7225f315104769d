"""Mask-aware Flux: only masked image tokens (and the text tokens) are computed in each block.

`patch_flux(transformer)` overrides `forward` on each FluxTransformerBlock and
FluxSingleTransformerBlock instance of a loaded FluxTransformer2DModel. The overrides use the blocks'
own submodules (no weight copies; state_dict keys unchanged). With no context active they call the
original forward, so the unmodified pipeline behaves exactly as before; inside
`with adapter.run(context):` each block computes per the context (`retouch.adapters.context`):

- RECORD: every token is computed; the block's image-token output, keys and values are cached.
- Y_CACHE (paper Fig. 5): K and V come from all tokens, whose unmasked rows are the previous block's
  recorded outputs; Q, attention output, feed-forward and the gated residuals run on the masked image
  tokens and the text only. Unmasked rows of the output are this block's recorded output.
- KV_CACHE (paper Fig. 7): norms, projections, attention and feed-forward run on the masked image
  tokens and the text only; unmasked image keys and values come from the cache. Unmasked hidden rows
  are never computed; they are filled from the recorded output only where something reads them (the
  input of a block that runs in full, and the final hidden state that norm_out/proj_out read).
- Blocks whose `block_plan` entry is False run the original forward (all tokens, no cache traffic).

Per-token ops run on tokens packed across the batch ([T, hidden]); per-request modulation vectors are
indexed by each token's request; RoPE tables are indexed by each token's position; attention is ragged
(each request's queries against that request's keys).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import (
    FluxAttnProcessor,
    FluxSingleTransformerBlock,
    FluxTransformer2DModel,
    FluxTransformerBlock,
)

from retouch import ops
from retouch.adapters.base import MaskAwareAdapter
from retouch.adapters.cache_rows import block_output, record_activations, recorded_rows, rows_with_recorded
from retouch.adapters.context import KEY, OUT, VALUE, CacheMode, MaskAwareContext

RotaryEmbedding = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [text + image tokens, head_dim]


class FluxMaskAwareAdapter(MaskAwareAdapter):
    """Handle of a patched FluxTransformer2DModel; `run(context)` makes one or more forwards mask-aware.

    Blocks are numbered in execution order: double-stream blocks, then single-stream blocks.
    """

    def __init__(self, transformer: FluxTransformer2DModel, attention_backend: str = "auto"):
        self.transformer = transformer
        self.double_blocks = list(transformer.transformer_blocks)
        self.single_blocks = list(transformer.single_transformer_blocks)
        super().__init__(self.double_blocks + self.single_blocks, attention_backend)


def patch_flux(transformer: FluxTransformer2DModel, attention_backend: str = "auto") -> FluxMaskAwareAdapter:
    """Patch `transformer`'s blocks in place; returns the adapter whose `run(context)` activates them.

    `attention_backend` is the `retouch.ops.ragged_attention` backend of masked blocks ("auto": flash-attn
    or Triton on CUDA, per-request SDPA on the CPU).
    """
    adapter = FluxMaskAwareAdapter(transformer, attention_backend)
    blocks = [(block, _double_block_forward) for block in adapter.double_blocks]
    blocks += [(block, _single_block_forward) for block in adapter.single_blocks]
    for index, (block, masked_forward) in enumerate(blocks):
        if "forward" in block.__dict__:
            raise RuntimeError(f"block {index} of the transformer is already patched")
        processor = block.attn.processor
        if type(processor) is not FluxAttnProcessor or block.attn.fused_projections:
            # The masked path re-implements FluxAttnProcessor's math (unfused projections) on packed tokens.
            raise NotImplementedError(f"block {index}: mask-aware Flux supports FluxAttnProcessor with unfused "
                                      f"projections, got {type(processor).__name__}")
        # A plain callable, not an nn.Module: the instance attribute must not register as a submodule.
        block.forward = functools.partial(_dispatch, adapter, block, index, masked_forward, type(block).forward)
    return adapter


def _dispatch(adapter: FluxMaskAwareAdapter, block: torch.nn.Module, index: int, masked_forward: Callable,
              original_forward: Callable, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
              temb: torch.Tensor, image_rotary_emb: RotaryEmbedding | None = None,
              joint_attention_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    context = adapter.active_context
    if context is None or not context.uses_cache(index):
        outputs = original_forward(block, hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                   joint_attention_kwargs)
        if context is not None and context.recording_requests:  # an unmodified block keeps its output only
            record_activations(context, index, {OUT: outputs[1]})
        return outputs
    if joint_attention_kwargs:
        raise NotImplementedError("mask-aware Flux takes no joint_attention_kwargs (IP-Adapter, LoRA scale), "
                                  f"got {sorted(joint_attention_kwargs)}")
    if image_rotary_emb is None:
        raise ValueError("mask-aware Flux needs image_rotary_emb (FluxTransformer2DModel always passes it)")
    context.check_shapes(hidden_states, encoder_hidden_states)
    return masked_forward(block, adapter, context, index, hidden_states, encoder_hidden_states, temb,
                          image_rotary_emb)


# ---- the double-stream block (separate text and image weights, joint attention) ----

def _double_block_forward(block: FluxTransformerBlock, adapter: FluxMaskAwareAdapter, context: MaskAwareContext,
                          index: int, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                          temb: torch.Tensor, image_rotary_emb: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden_states: [B, L, H] image tokens, encoder_hidden_states: [B, P, H] text -> (text, image) outputs."""
    layout, attn = context.layout, block.attn
    batch, num_image, hidden = hidden_states.shape
    num_text = layout.num_text_tokens
    cos, sin = image_rotary_emb

    # Text stream: every token, the block's own ops on [B, P, H].
    norm_text, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(encoder_hidden_states, emb=temb)
    text_q = attn.norm_added_q(_heads(attn, attn.add_q_proj(norm_text)))
    text_k = attn.norm_added_k(_heads(attn, attn.add_k_proj(norm_text)))
    text_v = _heads(attn, attn.add_v_proj(norm_text))
    text_q = apply_rotary_emb(text_q, (cos[:num_text], sin[:num_text]), sequence_dim=1)
    text_k = apply_rotary_emb(text_k, (cos[:num_text], sin[:num_text]), sequence_dim=1)

    # Image stream: the masked tokens, packed across the batch.
    modulation = block.norm1.linear(block.norm1.silu(temb))  # AdaLayerNormZero's, per request: [B, 6H]
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = modulation.chunk(6, dim=1)
    request = layout.image_query_request
    image_rows = ops.gather_rows(hidden_states.reshape(-1, hidden), layout.image_query_rows)  # [T_img, H]
    if context.mode is CacheMode.Y_CACHE:
        # K and V from every image token: unmasked rows of the input are recorded outputs (Fig. 5).
        norm_image = block.norm1.norm(hidden_states) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        image_k = apply_rotary_emb(attn.norm_k(_heads(attn, attn.to_k(norm_image))),
                                   (cos[num_text:], sin[num_text:]), sequence_dim=1)
        image_v = _heads(attn, attn.to_v(norm_image))
        norm_rows = ops.gather_rows(norm_image.reshape(-1, hidden), layout.image_query_rows)
        image_q = attn.norm_q(_heads(attn, attn.to_q(norm_rows)))
    else:
        norm_rows = block.norm1.norm(image_rows) * (1 + scale_msa[request]) + shift_msa[request]
        image_q = attn.norm_q(_heads(attn, attn.to_q(norm_rows)))
        k_rows = _rope_rows(attn.norm_k(_heads(attn, attn.to_k(norm_rows))), image_rotary_emb,
                            layout.image_query_positions)
        v_rows = _heads(attn, attn.to_v(norm_rows))
        # Unmasked keys/values from the cache (Fig. 7), computed ones written over the masked rows.
        image_k = rows_with_recorded(context, index, KEY, k_rows, layout.image_query_rows, (batch, num_image))
        image_v = rows_with_recorded(context, index, VALUE, v_rows, layout.image_query_rows, (batch, num_image))
    image_q = _rope_rows(image_q, image_rotary_emb, layout.image_query_positions)

    # Joint attention: per request, [text; masked image] queries against [text; all image] keys.
    num_queries = layout.query_positions.numel()
    query = image_q.new_empty((num_queries, *image_q.shape[1:]))
    query.index_copy_(0, layout.text_query_slots, text_q.reshape(-1, *text_q.shape[2:]))
    query.index_copy_(0, layout.image_query_slots, image_q)
    key = torch.cat([text_k, image_k], dim=1).flatten(0, 1)
    value = torch.cat([text_v, image_v], dim=1).flatten(0, 1)
    attn_out = _ragged_attention(adapter, query, key, value, context).flatten(1).to(query.dtype)
    text_attn = attn.to_add_out(attn_out.index_select(0, layout.text_query_slots).reshape(batch, num_text, -1))
    image_attn = attn.to_out[1](attn.to_out[0](attn_out.index_select(0, layout.image_query_slots)))

    # Image residuals and feed-forward, modulated per request (same op order as FluxTransformerBlock).
    image_rows = image_rows + gate_msa[request] * image_attn
    norm_rows = block.norm2(image_rows) * (1 + scale_mlp[request]) + shift_mlp[request]
    image_rows = image_rows + gate_mlp[request] * block.ff(norm_rows)

    encoder_hidden_states = encoder_hidden_states + c_gate_msa.unsqueeze(1) * text_attn
    norm_text = block.norm2_context(encoder_hidden_states) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
    encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * block.ff_context(norm_text)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)

    image_out = block_output(adapter, context, index, hidden_states, image_rows, layout.image_query_rows)
    if context.recording_requests:
        record_activations(context, index, {OUT: image_out, KEY: image_k, VALUE: image_v})
    return encoder_hidden_states, image_out


# ---- the single-stream block (shared weights for text and image, joint attention) ----

def _single_block_forward(block: FluxSingleTransformerBlock, adapter: FluxMaskAwareAdapter,
                          context: MaskAwareContext, index: int, hidden_states: torch.Tensor,
                          encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                          image_rotary_emb: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `_double_block_forward`. Text and image share weights here, so the query tokens
    (text and masked image) are packed together, in `RaggedBatch.query_rows` order."""
    layout, attn, ragged = context.layout, block.attn, context.batch
    batch, num_image, hidden = hidden_states.shape
    num_text = layout.num_text_tokens
    joint = torch.cat([encoder_hidden_states, hidden_states], dim=1)  # [B, P + L, H]

    shift, scale, gate = block.norm.linear(block.norm.silu(temb)).chunk(3, dim=1)
    request = layout.query_request
    rows = ops.gather_rows(joint.reshape(-1, hidden), ragged.query_rows)  # [T_q, H]
    if context.mode is CacheMode.Y_CACHE:
        norm_joint = block.norm.norm(joint) * (1 + scale[:, None]) + shift[:, None]
        key = apply_rotary_emb(attn.norm_k(_heads(attn, attn.to_k(norm_joint))), image_rotary_emb, sequence_dim=1)
        value = _heads(attn, attn.to_v(norm_joint))
        norm_rows = ops.gather_rows(norm_joint.reshape(-1, hidden), ragged.query_rows)
    else:
        norm_rows = block.norm.norm(rows) * (1 + scale[request]) + shift[request]
        k_rows = _rope_rows(attn.norm_k(_heads(attn, attn.to_k(norm_rows))), image_rotary_emb, layout.query_positions)
        v_rows = _heads(attn, attn.to_v(norm_rows))
        # Every text row is a query row, so only image rows come from the cache.
        key = _joint_rows_with(context, index, KEY, k_rows, num_text)
        value = _joint_rows_with(context, index, VALUE, v_rows, num_text)
    query = _rope_rows(attn.norm_q(_heads(attn, attn.to_q(norm_rows))), image_rotary_emb, layout.query_positions)
    mlp_rows = block.act_mlp(block.proj_mlp(norm_rows))
    attn_rows = _ragged_attention(adapter, query, key.flatten(0, 1), value.flatten(0, 1), context)
    attn_rows = attn_rows.flatten(1).to(query.dtype)

    rows = rows + gate[request] * block.proj_out(torch.cat([attn_rows, mlp_rows], dim=1))
    if rows.dtype == torch.float16:
        rows = rows.clip(-65504, 65504)

    text_rows = rows.index_select(0, layout.text_query_slots)
    image_rows = rows.index_select(0, layout.image_query_slots)
    image_out = block_output(adapter, context, index, hidden_states, image_rows, layout.image_query_rows)
    if context.recording_requests:
        record_activations(context, index, {OUT: image_out, KEY: key[:, num_text:], VALUE: value[:, num_text:]})
    return text_rows.reshape(batch, num_text, hidden), image_out


# ---- shared pieces ----

def _heads(attn, projected: torch.Tensor) -> torch.Tensor:
    """[..., heads * head_dim] -> [..., heads, head_dim], as FluxAttnProcessor splits heads."""
    return projected.unflatten(-1, (-1, attn.head_dim))


def _rope_rows(rows: torch.Tensor, image_rotary_emb: RotaryEmbedding, positions: torch.Tensor) -> torch.Tensor:
    """RoPE on packed tokens `rows: [T, heads, head_dim]` at sequence `positions: [T]`; the same
    elementwise math as diffusers' apply_rotary_emb, with the tables gathered per token."""
    if rows.shape[0] == 0:  # apply_rotary_emb cannot reshape an empty tensor
        return rows
    cos, sin = image_rotary_emb
    return apply_rotary_emb(rows.unsqueeze(0), (cos[positions], sin[positions]), sequence_dim=1).squeeze(0)


def _ragged_attention(adapter: FluxMaskAwareAdapter, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      context: MaskAwareContext) -> torch.Tensor:
    """query: [T_q, heads, d] packed per request; key/value: [B * (P + L), heads, d] -> [T_q, heads, d]."""
    batch = context.batch
    return ops.ragged_attention(query, key, value, batch.cu_seqlens_q, batch.cu_seqlens_k, batch.max_seqlen_q,
                                batch.max_seqlen_k, backend=adapter.attention_backend)


def _joint_rows_with(context: MaskAwareContext, block: int, name: str, computed: torch.Tensor,
                     num_text: int) -> torch.Tensor:
    """[B, P + L, ...]: recorded `name` at unmasked image tokens, `computed: [T_q, ...]` at query tokens."""
    image = recorded_rows(context, block, name, computed, context.layout.num_image_tokens)
    full = torch.cat([image.new_empty((image.shape[0], num_text, *image.shape[2:])), image], dim=1)
    ops.scatter_rows_(full.view(-1, full[0, 0].numel()), context.batch.query_rows,
                      computed.flatten(1))
    return full


__all__ = ["FluxMaskAwareAdapter", "patch_flux"]
