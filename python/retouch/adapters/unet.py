"""Mask-aware UNets (SDXL, SD2): only the masked tokens of each level run through its transformer blocks.

`patch_unet(unet)` overrides `forward` on each BasicTransformerBlock instance inside the Transformer2DModels
of a loaded UNet2DConditionModel (no weight copies; state_dict keys unchanged). Convolutions, resnets, the
Transformer2DModels' norm/proj_in/proj_out and everything else run in full on every token (paper §3: the
convolutions of a UNet run in full). With no context active the blocks call the class forward, so the
unmodified UNet behaves exactly as before; inside `with adapter.run(context):` each block computes per a
`UNetMaskAwareContext`:

- RECORD: every token is computed; the block's output ("out": [L, C]) and its self-attention keys and
  values ("k", "v": [L, heads, d]) are kept per request, template and step.
- Y_CACHE (paper Fig. 5): self-attention K and V from every token of the block input (unmasked rows are
  whatever the running hidden state holds: proj_in's full output for a first block, the previous block's
  recorded output after it); Q, attention output, cross-attention, feed-forward and the residuals run on
  the masked tokens only. Unmasked output rows are the recorded output.
- KV_CACHE (paper Fig. 7): every op of the block runs on the masked tokens only; unmasked self-attention
  keys and values come from the recording. Unmasked output rows are filled from the recorded output where
  something reads them: proj_out (after a Transformer2DModel's last block) and blocks that run in full.
- Blocks whose `block_plan` entry is False run the class forward (all tokens, no cache traffic).

Cross-attention keys are always all text tokens of the request, computed (the text is never cached).
Each level (spatial resolution) has its own masked set: a token of level l covers 8 * 2**l pixels a side
(`retouch.masks.token_mask`), flattened row-major as Transformer2DModel flattens [B, C, H, W] ->
[B, H*W, C]. A block's level is that of its stage: down block l, the mid block at the last level, up
block l at level num_levels - 1 - l (UNet2DConditionModel halves the resolution after every down block
but the last and doubles it after every up block but the last).

Classifier-free guidance: a context built with `guidance_copies=2` serves the doubled batch
[uncond; cond] of the pipelines; request b's mask and template apply to rows b and B + b, whose
activations are recorded under separate names ("uncond.out", ... and "out", ...).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.attention_processor import AttnProcessor2_0
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel

from retouch import ops
from retouch.adapters.base import MaskAwareAdapter
from retouch.adapters.block_math import feed_forward, head_dim, heads, layer_norm, linear, output, with_rows
from retouch.adapters.context import KEY, OUT, VALUE, CacheMode, set_recording
from retouch.cache import UNCOND_PREFIX, ActivationCache  # UNCOND_PREFIX: the unconditional half of a guidance batch
from retouch.masks import UNET_LATENT_STRIDE, masked_token_indices, token_mask
from retouch.ragged import RaggedBatch


def level_grid(image_size: tuple[int, int], level: int) -> tuple[int, int]:
    """Token grid (h, w) of UNet level `level` for an image of `image_size` (H, W) pixels: stride-2
    convolutions with padding 1 halve a side rounding up, as `token_mask`'s ceil mode does."""
    stride = UNET_LATENT_STRIDE * 2 ** level
    return -(-image_size[0] // stride), -(-image_size[1] // stride)


@dataclass(frozen=True)
class UNetMaskAwareContext:
    """One mask-aware UNet forward over a batch of B requests (B * guidance_copies rows).

    levels:          per UNet level l, a `RaggedBatch` (no prefix, L_l tokens per row) of its masked tokens,
                     one entry per row of the UNet batch (requests repeated per guidance copy)
    template_ids:    [B] the recorded template each request reads (Y/KV) or writes (RECORD)
    steps:           [B] the denoising step of each request
    cache:           where recorded activations are read and written
    block_plan:      per transformer block in execution order (down, mid, up): True = use the cache,
                     False = the unmodified block (recording rows keep its output only). None = every
                     block uses the cache.
    guidance_copies: 1, or 2 for a classifier-free-guidance batch [uncond; cond]
    records:         [B] whether request b records (every token computed, written to `record_to`)
                     beside the edits of a Y/KV forward; all True in RECORD mode
    record_to:       where recording requests write (RECORD mode: `cache`)
    """

    mode: CacheMode
    levels: tuple[RaggedBatch, ...]
    template_ids: tuple[str, ...]
    steps: tuple[int, ...]
    cache: ActivationCache
    block_plan: tuple[bool, ...] | None = None
    guidance_copies: int = 1
    records: tuple[bool, ...] | None = None
    record_to: ActivationCache | None = None
    level_tokens: tuple[int, ...] = field(init=False)  # L_l per level
    _query_counts: tuple[tuple[int, ...], ...] = field(init=False, repr=False)

    def __post_init__(self):
        num_requests = len(self.template_ids)
        if len(self.steps) != num_requests:
            raise ValueError(f"{num_requests} template ids but {len(self.steps)} steps")
        if self.guidance_copies not in (1, 2):
            raise ValueError(f"guidance_copies must be 1 or 2, got {self.guidance_copies}")
        object.__setattr__(self, "levels", tuple(self.levels))
        level_tokens = []
        for level, batch in enumerate(self.levels):
            if batch.prefix != 0 or len(set(batch.seq_lens)) != 1:
                raise ValueError(f"level {level}: its RaggedBatch must have no prefix and one token count")
            if batch.batch_size != num_requests * self.guidance_copies:
                raise ValueError(f"level {level} has {batch.batch_size} rows for {num_requests} requests x "
                                 f"{self.guidance_copies} guidance copies")
            level_tokens.append(batch.seq_lens[0])
        object.__setattr__(self, "level_tokens", tuple(level_tokens))
        object.__setattr__(self, "template_ids", tuple(self.template_ids))
        object.__setattr__(self, "steps", tuple(int(s) for s in self.steps))
        if self.block_plan is not None:
            object.__setattr__(self, "block_plan", tuple(bool(p) for p in self.block_plan))
        object.__setattr__(self, "_query_counts", tuple(tuple(b.query_counts()) for b in self.levels))
        if self.mode is CacheMode.RECORD and any(c != n for n, counts in zip(level_tokens, self._query_counts)
                                                 for c in counts):
            raise ValueError("a RECORD context computes every token; build it with `UNetMaskAwareContext.record`")
        # A request is all masked when each of its rows computes every token of the finest level.
        finest = self._query_counts[0] if self.levels else ()
        set_recording(self, [all(finest[copy * num_requests + b] == level_tokens[0]
                                 for copy in range(self.guidance_copies)) if finest else True
                             for b in range(num_requests)])

    @classmethod
    def record(cls, template_ids: Sequence[str], steps: Sequence[int], image_size: tuple[int, int], num_levels: int,
               cache: ActivationCache, guidance_copies: int = 1, device: torch.device | str = "cpu",
               block_plan: Sequence[bool] | None = None) -> UNetMaskAwareContext:
        """Full compute of every token of an `image_size` (H, W pixels) edit, keeping every block's activations;
        blocks whose `block_plan` entry is False run unmodified and keep their output only."""
        masks = [torch.ones(image_size, dtype=torch.bool)] * len(template_ids)
        levels = _levels_from_pixel_masks(masks, num_levels, 0, guidance_copies, device)
        return cls(CacheMode.RECORD, levels, tuple(template_ids), tuple(steps), cache,
                   None if block_plan is None else tuple(block_plan), guidance_copies)

    @classmethod
    def edit(cls, mode: CacheMode, pixel_masks: Sequence, template_ids: Sequence[str], steps: Sequence[int],
             num_levels: int, cache: ActivationCache, dilation: int = 0, block_plan: Sequence[bool] | None = None,
             guidance_copies: int = 1, device: torch.device | str = "cpu", records: Sequence[bool] | None = None,
             record_to: ActivationCache | None = None) -> UNetMaskAwareContext:
        """An edit of recorded templates: request b recomputes the tokens its pixel mask `[H, W]` touches
        (True/white = repaint; all masks of a batch have one size) at each of `num_levels` UNet levels,
        widened by `dilation` tokens of that level. Requests marked in `records` (an all-white mask)
        record into `record_to` meanwhile."""
        if mode is CacheMode.RECORD:
            raise ValueError("use UNetMaskAwareContext.record for recording")
        levels = _levels_from_pixel_masks(pixel_masks, num_levels, dilation, guidance_copies, device)
        return cls(mode, levels, tuple(template_ids), tuple(steps), cache,
                   None if block_plan is None else tuple(block_plan), guidance_copies,
                   None if records is None else tuple(records), record_to)

    @property
    def num_rows(self) -> int:
        """Rows of the UNet batch: requests x guidance copies."""
        return len(self.template_ids) * self.guidance_copies

    def uses_cache(self, block: int) -> bool:
        """Whether `block` runs mask-aware (reads the cache) rather than in full."""
        return self.block_plan is None or self.block_plan[block]

    def row_reuses_tokens(self, level: int, row: int) -> bool:
        """Whether any token of batch row `row` at UNet level `level` is unmasked."""
        return self._query_counts[level][row] < self.level_tokens[level]

    @property
    def recording_rows(self) -> tuple[int, ...]:
        """The rows of the UNet batch whose activations this forward records."""
        return tuple(row for row in range(self.num_rows) if self.records[row % len(self.template_ids)])

    def cache_key(self, row: int, name: str) -> tuple[str, int, str]:
        """(template_id, step, name) of batch row `row`'s activation `name`."""
        request, copy = row % len(self.template_ids), row // len(self.template_ids)
        prefix = UNCOND_PREFIX if copy < self.guidance_copies - 1 else ""
        return self.template_ids[request], self.steps[request], prefix + name


def _levels_from_pixel_masks(pixel_masks: Sequence, num_levels: int, dilation: int, guidance_copies: int,
                             device) -> tuple[RaggedBatch, ...]:
    token_masks = [[token_mask(mask, UNET_LATENT_STRIDE * 2 ** level, dilation) for mask in pixel_masks]
                   for level in range(num_levels)]
    levels = []
    for level, masks in enumerate(token_masks):
        if len({tuple(m.shape) for m in masks}) > 1:
            raise ValueError(f"pixel masks of one batch must have one size, got level-{level} grids "
                             f"{sorted({tuple(m.shape) for m in masks})}")
        num_tokens = masks[0].numel() if masks else 0
        masked_idx = [masked_token_indices(m) for m in masks] * guidance_copies
        levels.append(RaggedBatch.from_masked_indices(masked_idx, num_tokens, device=device))
    return tuple(levels)


class UNetMaskAwareAdapter(MaskAwareAdapter):
    """Handle of a patched UNet2DConditionModel; `run(context)` makes one or more forwards mask-aware.

    Transformer blocks are numbered in execution order (down blocks, mid block, up blocks; in each, its
    Transformer2DModels in order, then their blocks): that number is the `block` of cache keys and the index
    into a context's `block_plan`. One context at a time, as the model serves one forward at a time.
    """

    def __init__(self, unet: UNet2DConditionModel, attention_backend: str = "auto"):
        self.unet = unet
        blocks: list[BasicTransformerBlock] = []
        self.block_levels: list[int] = []  # the UNet level each block runs at
        self.last_in_transformer: list[bool] = []  # whose output proj_out reads
        last = self.num_levels - 1
        stages = [(stage, level) for level, stage in enumerate(unet.down_blocks)]
        stages += [(unet.mid_block, last)] if unet.mid_block is not None else []
        stages += [(stage, last - index) for index, stage in enumerate(unet.up_blocks)]
        for stage, level in stages:
            for transformer in getattr(stage, "attentions", None) or []:
                layers = list(transformer.transformer_blocks)
                blocks += layers
                self.block_levels += [level] * len(layers)
                self.last_in_transformer += [i == len(layers) - 1 for i in range(len(layers))]
        super().__init__(blocks, attention_backend)

    def block_kinds(self) -> tuple[str, ...]:
        return tuple(f"level{level}" for level in self.block_levels)

    @property
    def num_levels(self) -> int:
        """Resolutions of the UNet: one per entry of block_out_channels."""
        return len(self.unet.config.block_out_channels)

    def check_context(self, context: UNetMaskAwareContext) -> None:
        if len(context.levels) != self.num_levels:
            raise ValueError(f"context has {len(context.levels)} levels for a UNet of {self.num_levels}")

    def row_layouts(self, context: UNetMaskAwareContext) -> list[tuple[int, ...]]:
        """Rows per batch row of the masked tokens of each level (the packed matrices a level's blocks see)."""
        return [tuple(level.query_counts()) for level in context.levels]

    def needs_all_output_rows(self, context: UNetMaskAwareContext, block: int) -> bool:
        """Whether a KV-cache block must fill its unmasked output rows: proj_out reads them (last block of
        its Transformer2DModel), or the next block computes every token."""
        return self.last_in_transformer[block] or not context.uses_cache(block + 1)


def patch_unet(unet: UNet2DConditionModel, attention_backend: str = "auto") -> UNetMaskAwareAdapter:
    """Patch `unet`'s transformer blocks in place; returns the adapter whose `run(context)` activates them.

    `attention_backend` is the `retouch.ops.ragged_attention` backend of masked blocks ("auto": flash-attn
    or Triton on CUDA, per-request SDPA on the CPU).
    """
    adapter = UNetMaskAwareAdapter(unet, attention_backend)
    for index, block in enumerate(adapter.blocks):
        if "forward" in block.__dict__:
            raise RuntimeError(f"transformer block {index} of the UNet is already patched")
        _check_supported(index, block)
    for index, block in enumerate(adapter.blocks):
        # A plain callable, not an nn.Module: the instance attribute must not register as a submodule.
        block.forward = functools.partial(_dispatch, adapter, block, index, type(block).forward)
    return adapter


def _check_supported(index: int, block: BasicTransformerBlock) -> None:
    """The masked path re-implements the UNet configuration of BasicTransformerBlock and AttnProcessor2_0."""
    problems = []
    if block.norm_type != "layer_norm" or block.pos_embed is not None or block.only_cross_attention:
        problems.append(f"norm_type={block.norm_type!r}, pos_embed, only_cross_attention")
    if block.attn2 is None or getattr(block, "fuser", None) is not None or block._chunk_size is not None:
        problems.append("no cross-attention, GLIGEN or chunked feed-forward")
    for attn in (block.attn1, block.attn2):
        if attn is None:
            continue
        if type(attn.processor) is not AttnProcessor2_0 or getattr(attn, "fused_projections", False):
            problems.append(f"processor {type(attn.processor).__name__}")
        if (attn.spatial_norm is not None or attn.group_norm is not None or attn.norm_q is not None
                or attn.norm_k is not None or attn.norm_cross or attn.residual_connection
                or attn.rescale_output_factor != 1.0):
            problems.append("attention norms, residual connection or output rescaling")
    if problems:
        raise NotImplementedError(f"transformer block {index}: mask-aware UNets support the SDXL/SD2 "
                                  f"BasicTransformerBlock with AttnProcessor2_0; got {'; '.join(problems)}")


def _dispatch(adapter: UNetMaskAwareAdapter, block: BasicTransformerBlock, index: int, original_forward: Callable,
              hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
              encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: torch.Tensor | None = None,
              timestep: torch.Tensor | None = None, cross_attention_kwargs: dict | None = None,
              class_labels: torch.Tensor | None = None, added_cond_kwargs: dict | None = None) -> torch.Tensor:
    context = adapter.active_context
    if context is None or not context.uses_cache(index):
        output = adapter.core(original_forward)(block, hidden_states, attention_mask, encoder_hidden_states,
                                                encoder_attention_mask, timestep, cross_attention_kwargs,
                                                class_labels, added_cond_kwargs)
        if context is not None and context.recording_rows:  # an unmodified block keeps its output only
            _record_rows(context, index, {OUT: output})
        return output
    if attention_mask is not None or encoder_attention_mask is not None or cross_attention_kwargs:
        raise NotImplementedError("mask-aware UNet blocks take no attention masks or cross_attention_kwargs")
    if encoder_hidden_states is None:
        raise ValueError("mask-aware UNet blocks need encoder_hidden_states (the text) for cross-attention")
    rows, num_tokens, _ = hidden_states.shape
    level = adapter.block_levels[index]
    if num_tokens != context.level_tokens[level]:
        raise ValueError(f"block {index} (level {level}) sees {num_tokens} tokens; the context's levels have "
                         f"{context.level_tokens} (masks of another image size?)")
    if rows != context.num_rows:
        raise ValueError(f"context is for {len(context.template_ids)} requests x {context.guidance_copies} "
                         f"guidance copies, the UNet batch has {rows} rows")
    if context.mode is CacheMode.RECORD:
        return _record_forward(block, context, index, hidden_states, encoder_hidden_states)
    return _masked_forward(block, adapter, context, index, level, hidden_states, encoder_hidden_states)


def _record_rows(context: UNetMaskAwareContext, index: int, activations: dict[str, torch.Tensor]) -> None:
    """Keep each recording row's [L, ...] activations under its template, step and guidance copy."""
    for name, tensor in activations.items():
        for row in context.recording_rows:
            template_id, step, cache_name = context.cache_key(row, name)
            context.record_to.put(template_id, step, index, cache_name, tensor[row])


def _record_forward(block: BasicTransformerBlock, context: UNetMaskAwareContext, index: int,
                    hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
    """The class forward's ops on [B, L, C] (AttnProcessor2_0's SDPA), keeping out, K and V."""
    attn = block.attn1
    batch, num_tokens, _ = hidden_states.shape
    norm_hidden = block.norm1(hidden_states)
    query, key, value = (heads(attn, proj(norm_hidden)) for proj in (attn.to_q, attn.to_k, attn.to_v))
    attn_out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
    attn_out = attn_out.transpose(1, 2).reshape(batch, num_tokens, -1).to(query.dtype)
    hidden_states = attn.to_out[1](attn.to_out[0](attn_out)) + hidden_states
    hidden_states = block.attn2(block.norm2(hidden_states), encoder_hidden_states=encoder_hidden_states) + hidden_states
    hidden_states = block.ff(block.norm3(hidden_states)) + hidden_states
    _record_rows(context, index, {OUT: hidden_states, KEY: key, VALUE: value})
    return hidden_states


def _level_plan(adapter: UNetMaskAwareAdapter, context: UNetMaskAwareContext, level: int, num_text: int,
                dtype: torch.dtype, heads: int, width: int) -> tuple[ops.AttentionPlan, ops.AttentionPlan]:
    """A level's self- and cross-attention plans, made once per active context: each row's masked tokens
    against its L tokens, and against its `num_text` text tokens."""
    def plan() -> tuple[ops.AttentionPlan, ops.AttentionPlan]:
        ragged = adapter.computed_batch(context.levels[level])
        counts, device = ragged.query_counts(), ragged.cu_seqlens_q.device
        planned = functools.partial(ops.plan_attention, device=device, dtype=dtype, head_dim=width,
                                    backend=adapter.attention_backend, cu_seqlens_q=ragged.cu_seqlens_q, heads=heads)
        return (planned(counts, ragged.seq_lens, cu_seqlens_k=ragged.cu_seqlens_k),
                planned(counts, [num_text] * ragged.batch_size))
    return adapter.memo(("unet", level, num_text, dtype, heads, width), plan)


def _masked_forward(block: BasicTransformerBlock, adapter: UNetMaskAwareAdapter, context: UNetMaskAwareContext,
                    index: int, level: int, hidden_states: torch.Tensor,
                    encoder_hidden_states: torch.Tensor) -> torch.Tensor:
    """hidden_states: [R, L, C] (R rows of the UNet batch), encoder_hidden_states: [R, S, D] -> [R, L, C].
    Eager around a tensors-only core: recorded keys and values are read before it, the block's output
    filled and its activations recorded after it."""
    attn = block.attn1
    query_rows = adapter.computed_batch(context.levels[level]).query_rows
    plans = _level_plan(adapter, context, level, encoder_hidden_states.shape[1], hidden_states.dtype, attn.heads,
                        head_dim(attn))
    recorded = None
    if context.mode is CacheMode.KV_CACHE:
        like = adapter.key_rows_like(hidden_states, attn.heads, head_dim(attn))
        recorded = (_recorded(context, index, level, KEY, like), _recorded(context, index, level, VALUE, like))
    rows, key, value = adapter.core(transformer_block_core)(block, hidden_states, encoder_hidden_states, query_rows,
                                                            recorded, plans)
    if context.mode is CacheMode.KV_CACHE and not adapter.needs_all_output_rows(context, index):
        # Nothing reads the unmasked rows before the next cached block of this Transformer2DModel.
        out = with_rows(adapter.output_over_stale_rows(hidden_states, bool(context.recording_rows)), query_rows, rows)
    else:
        out = with_rows(_recorded(context, index, level, OUT, rows), query_rows, rows)
    if context.recording_rows:  # their rows computed every token: out, key and value are whole
        _record_rows(context, index, {OUT: out, KEY: key, VALUE: value})
    return out


def transformer_block_core(block: BasicTransformerBlock, hidden_states: torch.Tensor,
                           encoder_hidden_states: torch.Tensor, query_rows: torch.Tensor,
                           recorded: tuple[torch.Tensor, torch.Tensor] | None,
                           plans: tuple[ops.AttentionPlan, ops.AttentionPlan]):
    """BasicTransformerBlock's math on the masked tokens (`query_rows` of the [R * L, C] matrix) ->
    (their output rows [T, C], self-attention keys and values [R, L, heads, d]). Y-cache without
    `recorded` (K and V from every token of the input, Fig. 5); KV-cache with the recorded keys and
    values (Fig. 7), whose masked rows are overwritten by computed ones."""
    parts = block._modules  # submodules without nn.Module.__getattr__ (block_math)
    attn = parts["attn1"]
    mods = attn._modules
    hidden = hidden_states.shape[-1]
    rows = ops.gather_rows(hidden_states.reshape(-1, hidden), query_rows)  # [T, C]
    if recorded is None:
        norm_hidden = layer_norm(parts["norm1"], hidden_states)
        key = heads(attn, linear(mods["to_k"], norm_hidden))
        value = heads(attn, linear(mods["to_v"], norm_hidden))
        norm_rows = ops.gather_rows(norm_hidden.reshape(-1, hidden), query_rows)
    else:
        norm_rows = layer_norm(parts["norm1"], rows)
        key = with_rows(recorded[0], query_rows, heads(attn, linear(mods["to_k"], norm_rows)))
        value = with_rows(recorded[1], query_rows, heads(attn, linear(mods["to_v"], norm_rows)))
    query = heads(attn, linear(mods["to_q"], norm_rows))
    attn_out = ops.planned_attention(query, key.flatten(0, 1), value.flatten(0, 1), plans[0])
    rows = output(attn, attn_out.flatten(1)) + rows

    # Cross-attention: each row's masked queries against all of its text tokens.
    cross = parts["attn2"]
    cross_mods = cross._modules
    query = heads(cross, linear(cross_mods["to_q"], layer_norm(parts["norm2"], rows)))
    text_k = heads(cross, linear(cross_mods["to_k"], encoder_hidden_states)).flatten(0, 1)
    text_v = heads(cross, linear(cross_mods["to_v"], encoder_hidden_states)).flatten(0, 1)
    rows = output(cross, ops.planned_attention(query, text_k, text_v, plans[1]).flatten(1)) + rows
    rows = feed_forward(parts["ff"], layer_norm(parts["norm3"], rows)) + rows
    return rows, key, value


def _recorded(context: UNetMaskAwareContext, index: int, level: int, name: str, like: torch.Tensor) -> torch.Tensor:
    """[R, L, ...] recorded `name` of each row's template, step and guidance copy. Rows with every token
    masked read nothing (all their rows are overwritten)."""
    keys = [context.cache_key(row, name) if context.row_reuses_tokens(level, row) else None
            for row in range(context.num_rows)]
    return context.cache.read_rows(index, name, keys, like, context.level_tokens[level])


__all__ = ["UNetMaskAwareAdapter", "UNetMaskAwareContext", "level_grid", "patch_unet"]
