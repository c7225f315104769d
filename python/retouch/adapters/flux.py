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
from typing import NamedTuple

import torch
from diffusers.models.transformers.transformer_flux import (
    FluxAttnProcessor,
    FluxSingleTransformerBlock,
    FluxTransformer2DModel,
    FluxTransformerBlock,
)

from retouch import ops
from retouch.adapters.base import MaskAwareAdapter
from retouch.adapters.block_math import (continuous_norm_rows, feed_forward, flat_rows, heads, joint, layer_norm,
                                         linear, modulation, norm_rope, output, pack_queries, per_row, split_queries,
                                         with_rows)
from retouch.adapters.cache_rows import block_output, record_activations, recorded_rows
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

    def block_kinds(self) -> tuple[str, ...]:
        return ("double",) * len(self.double_blocks) + ("single",) * len(self.single_blocks)

    def forward_packed(self, hidden_states: list[torch.Tensor], encoder_hidden_states: torch.Tensor,
                       pooled_projections: torch.Tensor, timestep: torch.Tensor, img_ids: list[torch.Tensor],
                       txt_ids: torch.Tensor, guidance: torch.Tensor | None = None) -> list[torch.Tensor]:
        """FluxTransformer2DModel.forward over requests of different image sizes in one forward, inside
        `run(context)` with a mixed-resolution context: row r's `hidden_states[r]: [L_r, C]` and
        `img_ids[r]: [L_r, 3]`, its row of the batched inputs; -> `[L_r, C_out]` per row. The image tokens
        are packed `[sum L_r, H]` through every block (per-token ops run on the packed rows, attention
        stays within a request, RoPE rows come from each request's own ids); the text is `[R, P, H]`."""
        context = self.active_context
        if context is None or not context.mixed:
            raise RuntimeError("forward_packed runs inside run(context) with a mixed-resolution context")
        model = self.transformer
        hidden = model.x_embedder(torch.cat(hidden_states))
        timestep = timestep.to(hidden.dtype) * 1000
        if guidance is None:
            temb = model.time_text_embed(timestep, pooled_projections)
        else:
            temb = model.time_text_embed(timestep, guidance.to(hidden.dtype) * 1000, pooled_projections)
        text = model.context_embedder(encoder_hidden_states)
        # Position rows are a function of each id alone, so one table over every request's ids gives
        # each request its own rows: [text; request 0's image; request 1's image; ...] (`TokenLayout`).
        rotary = model.pos_embed(torch.cat([txt_ids, *img_ids]))
        for block in self.blocks:
            text, hidden = block(hidden_states=hidden, encoder_hidden_states=text, temb=temb, image_rotary_emb=rotary)
        hidden = continuous_norm_rows(model.norm_out, hidden, temb, context.layout.image_request)
        return list(model.proj_out(hidden).split(list(context.image_lens)))


def patch_flux(transformer: FluxTransformer2DModel, attention_backend: str = "auto") -> FluxMaskAwareAdapter:
    """Patch `transformer`'s blocks in place; returns the adapter whose `run(context)` activates them.

    `attention_backend` is the `retouch.ops.ragged_attention` backend of masked blocks ("auto": flash-attn
    or Triton on CUDA, per-request SDPA on the CPU).
    """
    adapter = FluxMaskAwareAdapter(transformer, attention_backend)
    double = functools.partial(_masked_block_forward, double_block_core)
    single = functools.partial(_masked_block_forward, single_block_core)
    blocks = [(block, double) for block in adapter.double_blocks] + [(block, single) for block in adapter.single_blocks]
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
        if context is not None and context.mixed:
            def unmodified(request_rows, requests, image_rows, num_image):
                positions = adapter.memo(("flux-positions", request_rows), lambda: torch.cat(
                    [torch.arange(context.batch.prefix, device=image_rows.device),
                     context.batch.prefix + image_rows[:num_image]]))
                rope = (image_rotary_emb[0][positions], image_rotary_emb[1][positions])
                return adapter.core(original_forward)(
                    block, hidden_states[image_rows].unflatten(0, (len(requests), num_image)),
                    encoder_hidden_states[requests], temb[requests], rope, joint_attention_kwargs)
            outputs = adapter.by_size(context, unmodified, hidden_states, encoder_hidden_states)
        else:
            outputs = adapter.core(original_forward)(block, hidden_states, encoder_hidden_states, temb,
                                                     image_rotary_emb, joint_attention_kwargs)
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


# ---- what every masked block of one forward shares ----

class FluxRows(NamedTuple):
    """One forward's index and position tensors, derived at its first masked block and shared by all.
    Tensors only: a compiled block core takes them as inputs, so a new mask is new data, not a new
    graph. Position tables are (cos, sin) rows: of the packed queries [T_q, d], of the masked image
    tokens [T_img, d], of the text [P, d], of every image token [L, d] and of every token [P + L, d];
    in a mixed-resolution batch (image rows packed, `TokenLayout`) of every image row [sum L_b, d] and of
    every row of the packed joint matrix [sum (P + L_b), d]."""

    query_rows: torch.Tensor  # [T_q] rows of the query tokens in the [B * (P + L), H] joint matrix
    image_query_rows: torch.Tensor  # [T_img] rows of the masked image tokens in the [B * L, H] image matrix
    text_query_slots: torch.Tensor  # [B * P] where each text token sits among the T_q queries
    image_query_slots: torch.Tensor  # [T_img] where each masked image token does
    request_queries: torch.Tensor | None  # [T_q] each query's request; None: a batch of one, eager
    request_image_queries: torch.Tensor | None  # [T_img]
    rope_queries: RotaryEmbedding
    rope_image_queries: RotaryEmbedding
    rope_text: RotaryEmbedding
    rope_image: RotaryEmbedding
    rope_all: RotaryEmbedding
    # A mixed-resolution batch only (None otherwise): each image row's request [sum L_b], each joint
    # row's request [sum (P + L_b)], and the (text, image) rows of the packed joint matrix.
    request_image: torch.Tensor | None = None
    request_joint: torch.Tensor | None = None
    joint_rows: tuple[torch.Tensor, torch.Tensor] | None = None


def _forward_rows(adapter: FluxMaskAwareAdapter, context: MaskAwareContext, image_rotary_emb: RotaryEmbedding,
                  dtype: torch.dtype, heads: int, head_dim: int) -> tuple[FluxRows, ops.AttentionPlan]:
    """The forward's rows and its attention plan (`retouch.ops.plan_attention`: no host sync after it),
    once per forward: the transformer computes its position tables once per forward, so they name it."""
    def plan() -> tuple[FluxRows, ops.AttentionPlan]:
        layout, batch = adapter.computed_layout(context), adapter.computed_batch(context.batch)
        cos, sin = image_rotary_emb
        attention = ops.plan_attention(batch.query_counts(), batch.seq_lens, batch.cu_seqlens_q.device, dtype,
                                       head_dim, adapter.attention_backend, batch.cu_seqlens_q, batch.cu_seqlens_k,
                                       heads=heads if adapter.measured_attention else None)
        gathered = adapter.compiling or batch.batch_size > 1  # a compiled core takes one path
        num_text = layout.num_text_tokens
        packed = {}
        rope_all = (cos, sin)
        if layout.packed:
            text_rows, image_rows = layout.joint_rows()
            positions = torch.empty(text_rows.shape[0] + image_rows.shape[0], dtype=torch.long, device=cos.device)
            positions[text_rows] = torch.arange(num_text, device=cos.device).repeat(len(layout.image_lens))
            positions[image_rows] = torch.arange(num_text, cos.shape[0], device=cos.device)
            rope_all = (cos[positions], sin[positions])
            request_image = layout.image_request
            request_joint = torch.empty_like(positions)
            request_joint[text_rows] = torch.arange(len(layout.image_lens), device=cos.device).repeat_interleave(num_text)
            request_joint[image_rows] = request_image
            packed = {"request_image": request_image, "request_joint": request_joint,
                      "joint_rows": (text_rows, image_rows)}
        rows = FluxRows(batch.query_rows, layout.image_query_rows, layout.text_query_slots, layout.image_query_slots,
                        layout.query_request if gathered else None, layout.image_query_request if gathered else None,
                        (cos[layout.query_positions], sin[layout.query_positions]),
                        (cos[layout.image_query_positions], sin[layout.image_query_positions]),
                        (cos[:num_text], sin[:num_text]), (cos[num_text:], sin[num_text:]), rope_all, **packed)
        return rows, attention
    return adapter.memo(("flux", id(image_rotary_emb[0])), plan)


def _masked_block_forward(core: Callable, block: torch.nn.Module, adapter: FluxMaskAwareAdapter,
                          context: MaskAwareContext, index: int, hidden_states: torch.Tensor,
                          encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                          image_rotary_emb: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden_states: [B, L, H] image tokens (packed [sum L_b, H] in a mixed-resolution batch),
    encoder_hidden_states: [B, P, H] text -> (text, image) outputs
    of a double- or single-stream block, whose tensors-only `core` (`double_block_core`,
    `single_block_core`) runs inside this eager wrapper: the recorded keys and values are read before
    it, the block's output filled and its activations recorded after it."""
    attn = block._modules["attn"]
    rows, attention = _forward_rows(adapter, context, image_rotary_emb, hidden_states.dtype, attn.heads,
                                    attn.head_dim)
    recorded_k = recorded_v = None
    if context.mode is not CacheMode.Y_CACHE:
        like = adapter.key_rows_like(hidden_states, attn.heads, attn.head_dim)
        recorded_k = recorded_rows(context, index, KEY, like)
        recorded_v = recorded_rows(context, index, VALUE, like)
    text_out, image_rows, image_k, image_v = adapter.core(core)(
        block, hidden_states, encoder_hidden_states, temb, rows, recorded_k, recorded_v, attention)
    image_out = block_output(adapter, context, index, hidden_states, image_rows, rows.image_query_rows)
    if context.recording_requests:
        record_activations(context, index, {OUT: image_out, KEY: image_k, VALUE: image_v})
    return text_out, image_out


# ---- the double-stream block (separate text and image weights, joint attention) ----

def double_block_core(block: FluxTransformerBlock, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                      temb: torch.Tensor, rows: FluxRows, recorded_k: torch.Tensor | None,
                      recorded_v: torch.Tensor | None, attention: ops.AttentionPlan):
    """FluxTransformerBlock's math on the masked image tokens and the text: -> (text output [B, P, H],
    masked image rows [T_img, H], image keys and values shaped as the image matrix ([B, L, heads, d], or
    packed [sum L_b, heads, d])). Y-cache without recorded
    keys (K and V from every token: unmasked rows of the input are recorded outputs, Fig. 5); KV-cache
    with them (Fig. 7): computed rows are written over the masked rows of `recorded_k/v`."""
    parts = block._modules
    attn = parts["attn"]
    mods = attn._modules
    hidden = hidden_states.shape[-1]

    # Text stream: every token, [B, P, H], modulated per request as the image rows are.
    text_modulation, _ = modulation(parts["norm1_context"], temb, 6, (1, 4), None)
    c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = text_modulation.chunk(6, dim=-1)
    norm_text = torch.addcmul(c_shift_msa, layer_norm(parts["norm1_context"]._modules["norm"], encoder_hidden_states),
                              c_scale_msa)
    # q/k norms and RoPE in one op per stream (`norm_rope`): the text rows with the text's tables, the
    # image rows with theirs, then packed.
    text_q = norm_rope(mods.get("norm_added_q"), heads(attn, linear(mods["add_q_proj"], norm_text)), rows.rope_text)
    text_k = norm_rope(mods.get("norm_added_k"), heads(attn, linear(mods["add_k_proj"], norm_text)), rows.rope_text)
    text_v = heads(attn, linear(mods["add_v_proj"], norm_text))

    # Image stream: the masked tokens, packed across the batch, modulated per request
    # (AdaLayerNormZero: shift, scale, gate for attention, then for the feed-forward).
    per_request, modulation_rows = modulation(parts["norm1"], temb, 6, (1, 4), rows.request_image_queries)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = modulation_rows.chunk(6, dim=-1)
    image_rows = ops.gather_rows(hidden_states.reshape(-1, hidden), rows.image_query_rows)  # [T_img, H]
    if recorded_k is None:
        all_shift, all_scale = per_row(per_request[..., :2 * hidden], rows.request_image).chunk(2, dim=-1)
        norm_image = torch.addcmul(all_shift, layer_norm(parts["norm1"]._modules["norm"], hidden_states), all_scale)
        image_k = norm_rope(mods.get("norm_k"), heads(attn, linear(mods["to_k"], norm_image)), rows.rope_image)
        image_v = heads(attn, linear(mods["to_v"], norm_image))
        norm_rows = ops.gather_rows(norm_image.reshape(-1, hidden), rows.image_query_rows)
    else:
        norm_rows = torch.addcmul(shift_msa, layer_norm(parts["norm1"]._modules["norm"], image_rows), scale_msa)
        k_rows = norm_rope(mods.get("norm_k"), heads(attn, linear(mods["to_k"], norm_rows)), rows.rope_image_queries)
        v_rows = heads(attn, linear(mods["to_v"], norm_rows))
        image_k = with_rows(recorded_k, rows.image_query_rows, k_rows)
        image_v = with_rows(recorded_v, rows.image_query_rows, v_rows)
    key = joint(text_k, image_k, rows.joint_rows)
    value = joint(text_v, image_v, rows.joint_rows)
    image_q = norm_rope(mods.get("norm_q"), heads(attn, linear(mods["to_q"], norm_rows)), rows.rope_image_queries)

    # Joint attention: per request, [text; masked image] queries against [text; all image] keys.
    batched = rows.request_queries is not None
    query = pack_queries(text_q, image_q, rows.text_query_slots, rows.image_query_slots, batched)
    attn_out = _attend(query, key, value, attention)
    text_out, image_out_rows = split_queries(attn_out, rows.text_query_slots, rows.image_query_slots, text_q.shape[0],
                                             text_q.shape[1], batched)
    text_attn = linear(mods["to_add_out"], text_out)
    image_attn = output(attn, image_out_rows)

    # Image residuals and feed-forward, modulated per request (FluxTransformerBlock's math).
    image_rows = torch.addcmul(image_rows, gate_msa, image_attn)
    norm_rows = torch.addcmul(shift_mlp, layer_norm(parts["norm2"], image_rows), scale_mlp)
    image_rows = torch.addcmul(image_rows, gate_mlp, feed_forward(parts["ff"], norm_rows))

    encoder_hidden_states = torch.addcmul(encoder_hidden_states, c_gate_msa, text_attn)
    norm_text = torch.addcmul(c_shift_mlp, layer_norm(parts["norm2_context"], encoder_hidden_states), c_scale_mlp)
    encoder_hidden_states = torch.addcmul(encoder_hidden_states, c_gate_mlp,
                                          feed_forward(parts["ff_context"], norm_text))
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, image_rows, image_k, image_v


# ---- the single-stream block (shared weights for text and image, joint attention) ----

def single_block_core(block: FluxSingleTransformerBlock, hidden_states: torch.Tensor,
                      encoder_hidden_states: torch.Tensor, temb: torch.Tensor, rows: FluxRows,
                      recorded_k: torch.Tensor | None, recorded_v: torch.Tensor | None,
                      attention: ops.AttentionPlan):
    """FluxSingleTransformerBlock's math on the query tokens -> (text output [B, P, H], masked image
    rows [T_img, H], image keys and values shaped as the image matrix); Y-cache or KV-cache as in
    `double_block_core`."""
    parts = block._modules
    attn = parts["attn"]
    mods = attn._modules
    batch, num_text, hidden = encoder_hidden_states.shape
    joint_rows = joint(encoder_hidden_states, hidden_states, rows.joint_rows)  # [B, P + L, H] or packed

    per_request, modulation_rows = modulation(parts["norm"], temb, 3, (1,), rows.request_queries)
    shift, scale, gate = modulation_rows.chunk(3, dim=-1)
    query_rows = ops.gather_rows(joint_rows.reshape(-1, hidden), rows.query_rows)  # [T_q, H]
    if recorded_k is None:
        all_shift, all_scale = per_row(per_request[..., :2 * hidden], rows.request_joint).chunk(2, dim=-1)
        norm_joint = torch.addcmul(all_shift, layer_norm(parts["norm"]._modules["norm"], joint_rows), all_scale)
        key = norm_rope(mods.get("norm_k"), heads(attn, linear(mods["to_k"], norm_joint)), rows.rope_all)
        value = heads(attn, linear(mods["to_v"], norm_joint))
        norm_rows = ops.gather_rows(norm_joint.reshape(-1, hidden), rows.query_rows)
    else:
        norm_rows = torch.addcmul(shift, layer_norm(parts["norm"]._modules["norm"], query_rows), scale)
        k_rows = norm_rope(mods.get("norm_k"), heads(attn, linear(mods["to_k"], norm_rows)), rows.rope_queries)
        v_rows = heads(attn, linear(mods["to_v"], norm_rows))
        # Every text row is a query row, so only image rows come from the cache.
        key = _joint_with_rows(recorded_k, num_text, rows, k_rows)
        value = _joint_with_rows(recorded_v, num_text, rows, v_rows)
    query = norm_rope(mods.get("norm_q"), heads(attn, linear(mods["to_q"], norm_rows)), rows.rope_queries)
    mlp_rows = parts["act_mlp"].forward(linear(parts["proj_mlp"], norm_rows))
    attn_rows = _attend(query, key, value, attention)

    query_rows = torch.addcmul(query_rows, gate, linear(parts["proj_out"], torch.cat([attn_rows, mlp_rows], dim=1)))
    if query_rows.dtype == torch.float16:
        query_rows = query_rows.clip(-65504, 65504)
    text_rows, image_rows = split_queries(query_rows, rows.text_query_slots, rows.image_query_slots, batch, num_text,
                                          rows.request_queries is not None)
    if rows.joint_rows is not None:
        return text_rows, image_rows, key.index_select(0, rows.joint_rows[1]), value.index_select(0, rows.joint_rows[1])
    return text_rows, image_rows, key[:, num_text:], value[:, num_text:]


# ---- shared pieces ----

def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attention: ops.AttentionPlan) -> torch.Tensor:
    """query: [T_q, heads, d] packed per request; key/value: [B, P + L, heads, d] (or packed
    [sum (P + L_b), heads, d]) -> [T_q, heads * d]."""
    return ops.planned_attention(query, flat_rows(key), flat_rows(value), attention).flatten(1)


def _joint_with_rows(recorded: torch.Tensor, num_text: int, rows: FluxRows, computed: torch.Tensor) -> torch.Tensor:
    """The joint matrix ([B, P + L, ...], or packed): recorded image rows, `computed: [T_q, ...]` at the
    query tokens (every text token)."""
    if rows.joint_rows is None:
        full = torch.cat([recorded.new_empty((recorded.shape[0], num_text, *recorded.shape[2:])), recorded], dim=1)
    else:
        full = recorded.new_empty((rows.joint_rows[0].shape[0] + recorded.shape[0], *recorded.shape[1:]))
        full.index_copy_(0, rows.joint_rows[1], recorded)
    return with_rows(full, rows.query_rows, computed)


__all__ = ["FluxMaskAwareAdapter", "patch_flux"]
