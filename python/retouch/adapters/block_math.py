"""Pieces of block math the mask-aware adapters share: heads, AdaLayerNorm modulation per packed row,
output and feed-forward projections, and packing queries of text and masked image tokens.

Submodules are called through `.forward`: nn.Module.__call__ costs a few microseconds of hook checks per
call, which on a masked block of a few dozen ops is host time the GPU waits for.
"""

from __future__ import annotations

import torch

from retouch import ops


def heads(attn: torch.nn.Module, projected: torch.Tensor) -> torch.Tensor:
    """[..., heads * head_dim] -> [..., heads, head_dim], as diffusers' attention processors split heads."""
    return projected.unflatten(-1, (attn.heads, -1))


def head_dim(attn: torch.nn.Module) -> int:
    """The width of one head of a diffusers attention module (every processor splits to_q's output evenly)."""
    return attn.to_q.out_features // attn.heads


def modulation(norm: torch.nn.Module, temb: torch.Tensor, chunks: int, scales: tuple[int, ...],
               request: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """An AdaLayerNorm's modulation (`norm.linear(norm.silu(temb))`) with 1 added to its scale chunks, so
    each scale s becomes the 1 + s the norms multiply by: per request `[B, 1, chunks * H]` (every token),
    and per packed row `[T, chunks * H]` (`[B, chunks * H]` when `request` is None: a batch of one
    broadcasts)."""
    values = norm.linear.forward(norm.silu.forward(temb))
    offset = values.new_zeros(chunks, values.shape[-1] // chunks)
    offset[list(scales)] = 1
    values = values + offset.flatten()
    rows = values if request is None else values.index_select(0, request)
    return values.unsqueeze(1), rows


def output(attn: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """attn.to_out: its linear, and its dropout only when training (the identity in inference)."""
    rows = attn.to_out[0].forward(rows)
    return attn.to_out[1](rows) if attn.training else rows


def feed_forward(ff: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """diffusers' FeedForward: its activation projection and output linear, dropouts only when training."""
    if ff.training or len(ff.net) != 3:
        return ff(rows)
    return ff.net[2].forward(ff.net[0].forward(rows))


def pack_queries(text: torch.Tensor, image_rows: torch.Tensor, text_slots: torch.Tensor,
                 image_slots: torch.Tensor, batched: bool) -> torch.Tensor:
    """`[T_q, ...]` in query order (per request: its text, then its masked image tokens) from text
    `[B, P, ...]` and the masked image rows `[T_img, ...]`; `batched` False: a batch of one (a concat)."""
    if not batched:
        return torch.cat([text[0], image_rows])
    packed = image_rows.new_empty((text_slots.shape[0] + image_slots.shape[0], *image_rows.shape[1:]))
    packed.index_copy_(0, text_slots, text.flatten(0, 1))
    packed.index_copy_(0, image_slots, image_rows)
    return packed


def split_queries(packed: torch.Tensor, text_slots: torch.Tensor, image_slots: torch.Tensor, batch: int,
                  num_text: int, batched: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack_queries`: (text `[B, P, ...]`, masked image rows `[T_img, ...]`)."""
    if not batched:
        text, image = packed.split([num_text, packed.shape[0] - num_text])
        return text[None], image
    text = packed.index_select(0, text_slots).unflatten(0, (batch, num_text))
    return text, packed.index_select(0, image_slots)


def with_rows(recorded: torch.Tensor, rows: torch.Tensor, computed: torch.Tensor) -> torch.Tensor:
    """`recorded: [B, L, ...]` with `computed: [T, ...]` written over its rows `rows` (of the flattened
    [B * L, ...]): in place eagerly; traced, into a new tensor, so that a compiled core mutates none of its
    inputs (a captured CUDA graph may not) and inductor can fuse the copy into the op that reads it."""
    flat = recorded.view(-1, recorded[0, 0].numel())
    if torch.compiler.is_compiling():
        return flat.index_copy(0, rows, computed.flatten(1)).view_as(recorded)
    ops.scatter_rows_(flat, rows, computed.flatten(1))
    return recorded
