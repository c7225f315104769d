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
from dataclasses import dataclass

import torch
from diffusers.models.attention import JointTransformerBlock
from diffusers.models.attention_processor import JointAttnProcessor2_0
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

from retouch import ops
from retouch.adapters.context import DUAL_KEY, DUAL_VALUE, KEY, OUT, VALUE, CacheMode, MaskAwareContext
# Cache-row helpers shared with Flux (they take any adapter with `needs_all_output_rows`).
from retouch.adapters.base import MaskAwareAdapter
from retouch.adapters.cache_rows import block_output, record_activations, rows_with_recorded

# SD3.5 dual attention (attn2, image tokens only): its image-token keys and values after qk-norm.


@dataclass(frozen=True)
class ImageAttentionLayout:
    """Sequence lengths of the attentions whose queries are the masked image tokens only (derived once
    per context): the context_pre_only block's joint attention and SD3.5's image-only attn2.

    cu_seqlens_q:        [B+1] int32, prefix sums of masked image tokens per request
    cu_seqlens_k_image:  [B+1] int32, prefix sums of L (attn2 keys: the request's image tokens)
    """

    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    cu_seqlens_k_image: torch.Tensor
    max_seqlen_k_image: int

    @classmethod
    def from_context(cls, context: MaskAwareContext) -> ImageAttentionLayout:
        device = context.batch.cu_seqlens_q.device
        counts = torch.tensor((0,) + context.image_counts, dtype=torch.int64)
        image_lens = torch.full((context.batch.batch_size + 1,), context.num_image_tokens, dtype=torch.int64)
        image_lens[0] = 0
        return cls(
            cu_seqlens_q=counts.cumsum(0).to(device, torch.int32),
            max_seqlen_q=max(context.image_counts, default=0),
            cu_seqlens_k_image=image_lens.cumsum(0).to(device, torch.int32),
            max_seqlen_k_image=context.num_image_tokens,
        )


class SD3MaskAwareAdapter(MaskAwareAdapter):
    """Handle of a patched SD3Transformer2DModel; `run(context)` makes one or more forwards mask-aware.

    Blocks are numbered in execution order (`transformer.transformer_blocks`).
    """

    def __init__(self, transformer: SD3Transformer2DModel, attention_backend: str = "auto"):
        self.transformer = transformer
        self._image_attention: ImageAttentionLayout | None = None
        super().__init__(transformer.transformer_blocks, attention_backend)

    @property
    def image_attention(self) -> ImageAttentionLayout | None:
        """The active context's `ImageAttentionLayout`."""
        return self._image_attention

    def enter(self, context: MaskAwareContext) -> None:
        self._image_attention = ImageAttentionLayout.from_context(context)

    def exit(self) -> None:
        self._image_attention = None


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
        outputs = original_forward(block, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs)
        if context is not None and context.recording_requests:  # an unmodified block keeps its output only
            record_activations(context, index, {OUT: outputs[1]})
        return outputs
    if joint_attention_kwargs:
        raise NotImplementedError("mask-aware SD3 takes no joint_attention_kwargs (IP-Adapter), "
                                  f"got {sorted(joint_attention_kwargs)}")
    context.check_shapes(hidden_states, encoder_hidden_states)
    return _joint_block_forward(block, adapter, context, index, hidden_states, encoder_hidden_states, temb)


# ---- the joint block (separate text and image weights, joint attention; optional attn2 on the image) ----

def _joint_block_forward(block: JointTransformerBlock, adapter: SD3MaskAwareAdapter, context: MaskAwareContext,
                         index: int, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                         temb: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """hidden_states: [B, L, H] image tokens, encoder_hidden_states: [B, P, H] text -> (text or None, image)."""
    layout, attn = context.layout, block.attn
    batch, num_image, hidden = hidden_states.shape
    image_shape = (batch, num_image)

    # Text stream: every token, the block's own ops on [B, P, H].
    if block.context_pre_only:
        norm_text = block.norm1_context(encoder_hidden_states, temb)
    else:
        norm_text, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(encoder_hidden_states,
                                                                                          emb=temb)
    text_k = _qk_norm(attn.norm_added_k, _heads(attn, attn.add_k_proj(norm_text)))
    text_v = _heads(attn, attn.add_v_proj(norm_text))

    # Image stream: the masked tokens, packed across the batch; modulation per request ([B, 6H] or [B, 9H]).
    modulation = block.norm1.linear(block.norm1.silu(temb)).chunk(9 if block.use_dual_attention else 6, dim=1)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = modulation[:6]
    request = layout.image_query_request
    image_rows = ops.gather_rows(hidden_states.reshape(-1, hidden), layout.image_query_rows)  # [T_img, H]
    keys2 = None
    if context.mode is CacheMode.Y_CACHE:
        # K and V from every image token: unmasked rows of the input are recorded outputs (Fig. 5).
        normed = block.norm1.norm(hidden_states)
        norm_image = normed * (1 + scale_msa[:, None]) + shift_msa[:, None]
        image_k = _qk_norm(attn.norm_k, _heads(attn, attn.to_k(norm_image)))
        image_v = _heads(attn, attn.to_v(norm_image))
        norm_rows = ops.gather_rows(norm_image.reshape(-1, hidden), layout.image_query_rows)
        if block.use_dual_attention:
            shift_msa2, scale_msa2 = modulation[6:8]
            norm_image2 = normed * (1 + scale_msa2[:, None]) + shift_msa2[:, None]
            keys2 = (_qk_norm(block.attn2.norm_k, _heads(block.attn2, block.attn2.to_k(norm_image2))),
                     _heads(block.attn2, block.attn2.to_v(norm_image2)))
            norm_rows2 = ops.gather_rows(norm_image2.reshape(-1, hidden), layout.image_query_rows)
    else:
        normed_rows = block.norm1.norm(image_rows)
        norm_rows = normed_rows * (1 + scale_msa[request]) + shift_msa[request]
        k_rows = _qk_norm(attn.norm_k, _heads(attn, attn.to_k(norm_rows)))
        v_rows = _heads(attn, attn.to_v(norm_rows))
        # Unmasked keys/values from the cache (Fig. 7), computed ones written over the masked rows.
        image_k = rows_with_recorded(context, index, KEY, k_rows, layout.image_query_rows, image_shape)
        image_v = rows_with_recorded(context, index, VALUE, v_rows, layout.image_query_rows, image_shape)
        if block.use_dual_attention:
            shift_msa2, scale_msa2 = modulation[6:8]
            norm_rows2 = normed_rows * (1 + scale_msa2[request]) + shift_msa2[request]
            k2_rows = _qk_norm(block.attn2.norm_k, _heads(block.attn2, block.attn2.to_k(norm_rows2)))
            v2_rows = _heads(block.attn2, block.attn2.to_v(norm_rows2))
            keys2 = (rows_with_recorded(context, index, DUAL_KEY, k2_rows, layout.image_query_rows, image_shape),
                     rows_with_recorded(context, index, DUAL_VALUE, v2_rows, layout.image_query_rows, image_shape))
    image_q = _qk_norm(attn.norm_q, _heads(attn, attn.to_q(norm_rows)))

    # Joint attention: per request, queries against [all image; text] keys (JointAttnProcessor2_0's order).
    key = torch.cat([image_k, text_k], dim=1).flatten(0, 1)
    value = torch.cat([image_v, text_v], dim=1).flatten(0, 1)
    if block.context_pre_only:
        # The text output of this block is discarded, so only masked image tokens are queries.
        image_attn = _image_query_attention(adapter, context, image_q, key, value, joint=True)
        text_attn = None
    else:
        text_q = _qk_norm(attn.norm_added_q, _heads(attn, attn.add_q_proj(norm_text)))
        num_text = layout.num_text_tokens
        query = image_q.new_empty((layout.query_positions.numel(), *image_q.shape[1:]))
        query.index_copy_(0, layout.text_query_slots, text_q.reshape(-1, *text_q.shape[2:]))
        query.index_copy_(0, layout.image_query_slots, image_q)
        batch_tokens = context.batch
        attn_out = ops.ragged_attention(query, key, value, batch_tokens.cu_seqlens_q, batch_tokens.cu_seqlens_k,
                                        batch_tokens.max_seqlen_q, batch_tokens.max_seqlen_k,
                                        backend=adapter.attention_backend).flatten(1).to(query.dtype)
        text_attn = attn.to_add_out(attn_out.index_select(0, layout.text_query_slots).reshape(batch, num_text, -1))
        image_attn = attn_out.index_select(0, layout.image_query_slots)
    image_attn = attn.to_out[1](attn.to_out[0](image_attn))

    # Image residuals and feed-forward, modulated per request (same op order as JointTransformerBlock).
    image_rows = image_rows + gate_msa[request] * image_attn
    if block.use_dual_attention:
        attn2, gate_msa2 = block.attn2, modulation[8]
        query2 = _qk_norm(attn2.norm_q, _heads(attn2, attn2.to_q(norm_rows2)))
        image_attn2 = _image_query_attention(adapter, context, query2, keys2[0].flatten(0, 1),
                                             keys2[1].flatten(0, 1), joint=False)
        image_rows = image_rows + gate_msa2[request] * attn2.to_out[1](attn2.to_out[0](image_attn2))
    norm_rows = block.norm2(image_rows) * (1 + scale_mlp[request]) + shift_mlp[request]
    image_rows = image_rows + gate_mlp[request] * block.ff(norm_rows)

    if block.context_pre_only:
        encoder_hidden_states = None
    else:
        encoder_hidden_states = encoder_hidden_states + c_gate_msa.unsqueeze(1) * text_attn
        norm_text = block.norm2_context(encoder_hidden_states) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
        encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * block.ff_context(norm_text)

    image_out = block_output(adapter, context, index, hidden_states, image_rows, layout.image_query_rows)
    if context.recording_requests:
        recorded = {OUT: image_out, KEY: image_k, VALUE: image_v}
        if keys2 is not None:
            recorded.update({DUAL_KEY: keys2[0], DUAL_VALUE: keys2[1]})
        record_activations(context, index, recorded)
    return encoder_hidden_states, image_out


# ---- shared pieces ----

def _heads(attn, projected: torch.Tensor) -> torch.Tensor:
    """[..., heads * head_dim] -> [..., heads, head_dim], as JointAttnProcessor2_0 splits heads."""
    return projected.unflatten(-1, (attn.heads, -1))


def _qk_norm(norm: torch.nn.Module | None, heads: torch.Tensor) -> torch.Tensor:
    """An optional qk norm (RMSNorm or LayerNorm over head_dim, so per token and head)."""
    return heads if norm is None else norm(heads)


def _image_query_attention(adapter: SD3MaskAwareAdapter, context: MaskAwareContext, query: torch.Tensor,
                           key: torch.Tensor, value: torch.Tensor, joint: bool) -> torch.Tensor:
    """Masked image queries `query: [T_img, heads, d]` against each request's keys: [image; text] tokens
    (`joint`, key/value: [B * (L + P), heads, d]) or its image tokens (key/value: [B * L, heads, d])
    -> [T_img, heads * d]."""
    lens = adapter.image_attention
    if joint:
        cu_seqlens_k, max_seqlen_k = context.batch.cu_seqlens_k, context.batch.max_seqlen_k
    else:
        cu_seqlens_k, max_seqlen_k = lens.cu_seqlens_k_image, lens.max_seqlen_k_image
    out = ops.ragged_attention(query, key, value, lens.cu_seqlens_q, cu_seqlens_k, lens.max_seqlen_q, max_seqlen_k,
                               backend=adapter.attention_backend)
    return out.flatten(1).to(query.dtype)


__all__ = ["ImageAttentionLayout", "SD3MaskAwareAdapter", "patch_sd3"]
