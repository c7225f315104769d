"""Pieces of block math the mask-aware adapters share: heads, AdaLayerNorm modulation per packed row,
output and feed-forward projections, and packing queries of text and masked image tokens.

Submodules are called through `.forward`: nn.Module.__call__ costs a few microseconds of hook checks per
call, which on a masked block of a few dozen ops is host time the GPU waits for. For the same reason the
cores read submodules from `module._modules` (a dict) rather than as attributes (nn.Module.__getattr__,
~0.7 us a lookup, about fifty per block), and `linear` runs an nn.Linear's math without its frame; both
read the live dicts, so a module or weight replaced later (a LoRA layer, a reload) is what they see.
"""

from __future__ import annotations

import functools
import math

import torch
from diffusers.models.activations import GELU
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm

from retouch import ops


def heads(attn: torch.nn.Module, projected: torch.Tensor) -> torch.Tensor:
    """[..., heads * head_dim] -> [..., heads, head_dim], as diffusers' attention processors split heads."""
    return projected.unflatten(-1, (attn.heads, -1))


def linear(lin: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`lin.forward(x)`: an exact nn.Linear by `F.linear` on its current parameters; any other module
    (a LoRA layer, a quantised linear) or one whose forward a hook replaced (accelerate's offload,
    diffusers' layerwise casting) by its own forward."""
    if type(lin) is torch.nn.Linear and "forward" not in lin.__dict__:  # no offload or casting hook on it
        params = lin._parameters
        return torch.nn.functional.linear(x, params["weight"], params["bias"])
    return lin.forward(x)


def layer_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`norm.forward(x)`: an exact nn.LayerNorm by `torch.layer_norm` on its current parameters."""
    if type(norm) is torch.nn.LayerNorm and "forward" not in norm.__dict__:
        params = norm._parameters
        return torch.layer_norm(x, norm.normalized_shape, params.get("weight"), params.get("bias"), norm.eps)
    return norm.forward(x)


def norm_rope(norm: torch.nn.Module | None, x: torch.Tensor,
              tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """An attention q/k norm over head_dim (`norm` None: none) and, given `(cos, sin)` rows, Flux's RoPE
    of its output: `x: [..., S, heads, d]`. RMSNorms (torch's, and diffusers' without bias whose weight
    has x's dtype) run with the rotation as one `retouch::rms_norm_rope`; other norms as they are."""
    eps = _rms_norm_eps(norm, x.dtype)
    if eps is not None:
        return ops.rms_norm_rope(x, norm._parameters.get("weight"), eps, *(tables or (None, None)))
    if norm is not None:
        x = norm.forward(x)
    return x if tables is None else ops.rope_pairs(x, *tables)


def _rms_norm_eps(norm: torch.nn.Module | None, dtype: torch.dtype) -> float | None:
    """The epsilon of an RMSNorm that `torch.rms_norm` computes (up to rounding), else None."""
    if isinstance(norm, torch.nn.RMSNorm) and norm.normalized_shape == (norm.normalized_shape[-1],):
        if norm.eps is not None:
            return norm.eps
        # torch.rms_norm's default: the eps of the dtype it computes in (fp32 for half precision)
        return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    # diffusers' RMSNorm rounds once more in half precision (before its weight), within an ulp of the
    # fused op; with an fp32 weight on half-precision rows it returns fp32, which the fused op does not.
    if isinstance(norm, DiffusersRMSNorm) and norm._parameters.get("bias") is None:
        weight = norm._parameters.get("weight")
        return norm.eps if weight is None or weight.dtype == dtype else None
    return None


def head_dim(attn: torch.nn.Module) -> int:
    """The width of one head of a diffusers attention module (every processor splits to_q's output evenly)."""
    return attn.to_q.out_features // attn.heads


def modulation(norm: torch.nn.Module, temb: torch.Tensor, chunks: int, scales: tuple[int, ...],
               request: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """An AdaLayerNorm's modulation (`norm.linear(norm.silu(temb))`) with 1 added to its scale chunks, so
    each scale s becomes the 1 + s the norms multiply by: per request `[B, 1, chunks * H]` (every token),
    and per packed row `[T, chunks * H]` (`[B, chunks * H]` when `request` is None: a batch of one
    broadcasts)."""
    parts = norm._modules
    values = linear(parts["linear"], torch.nn.functional.silu(temb) if type(parts["silu"]) is torch.nn.SiLU
                    else parts["silu"].forward(temb))
    if torch.compiler.is_compiling():
        offset = _scale_offset.__wrapped__(chunks, scales, values.shape[-1], values.dtype, values.device)
    else:  # built once: three ops fewer per block
        offset = _scale_offset(chunks, scales, values.shape[-1], values.dtype, values.device)
    values = values + offset
    rows = values if request is None else values.index_select(0, request)
    return values.unsqueeze(1), rows


@functools.lru_cache(maxsize=64)
def _scale_offset(chunks: int, scales: tuple[int, ...], width: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """[chunks * H]: 1 in the scale chunks, 0 elsewhere. Never written to (added out of place)."""
    with torch.inference_mode(False):  # an ordinary tensor, whichever mode the first block ran in
        offset = torch.zeros(chunks, width // chunks, dtype=dtype, device=device)
        offset[list(scales)] = 1
        return offset.flatten()


def output(attn: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """attn.to_out: its linear, and its dropout only when training (the identity in inference)."""
    to_out = attn._modules["to_out"]._modules
    rows = linear(to_out["0"], rows)
    return to_out["1"](rows) if attn.training else rows


def feed_forward(ff: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """diffusers' FeedForward: its activation projection and output linear, dropouts only when training."""
    net = ff._modules["net"]._modules
    if ff.training or len(net) != 3:
        return ff(rows)
    activation = net["0"]
    if type(activation) is GELU:  # its projection, then F.gelu (what GELU.forward does off MPS)
        hidden = torch.nn.functional.gelu(linear(activation._modules["proj"], rows), approximate=activation.approximate)
    else:
        hidden = activation.forward(rows)
    return linear(net["2"], hidden)


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
    """`recorded` (an image matrix: `[B, L, ...]`, or packed `[sum L_b, ...]`) with `computed: [T, ...]`
    written over its rows `rows` (of the flattened matrix): in place eagerly; traced, into a new tensor,
    so that a compiled core mutates none of its inputs (a captured CUDA graph may not) and inductor can
    fuse the copy into the op that reads it."""
    flat = recorded.view(-1, math.prod(computed.shape[1:]))
    if torch.compiler.is_compiling():
        return flat.index_copy(0, rows, computed.flatten(1)).view_as(recorded)
    ops.scatter_rows_(flat, rows, computed.flatten(1))
    return recorded


def continuous_norm_rows(norm: torch.nn.Module, rows: torch.Tensor, temb: torch.Tensor,
                         request: torch.Tensor) -> torch.Tensor:
    """diffusers' AdaLayerNormContinuous (a model's `norm_out`) on packed rows `[N, H]` of several requests:
    each row scaled and shifted by its request's (`request: [N]`) conditioning `temb: [B, D]`."""
    scale, shift = linear(norm.linear, norm.silu(temb).to(rows.dtype)).chunk(2, dim=1)
    return norm.norm(rows) * (1 + scale)[request] + shift[request]


def flat_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Keys or values of every request, request after request: `[B, S, heads, d]` flattened, or packed already."""
    return tensor.flatten(0, 1) if tensor.dim() == 4 else tensor


def per_row(per_request: torch.Tensor, request: torch.Tensor | None) -> torch.Tensor:
    """A per-request modulation `[B, 1, X]` for every row of an image or joint matrix: as it is (it
    broadcasts over `[B, L, X]`) when `request` is None, else `[N, X]` for packed rows of those requests."""
    return per_request if request is None else per_request.squeeze(1).index_select(0, request)


def joint(text: torch.Tensor, image: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor] | None,
          text_first: bool = True) -> torch.Tensor:
    """Each request's text and image tokens as one joint sequence: `[B, P + L, ...]` from `text: [B, P, ...]`
    and `image: [B, L, ...]` (`rows` None; text then image, or image then text), or packed
    `[sum (P + L_b), ...]` from `text: [B, P, ...]` and a packed `image: [sum L_b, ...]`, written at `rows`
    (their (text, image) rows there, `TokenLayout.joint_rows`, which fix the order)."""
    if rows is None:
        return torch.cat([text, image] if text_first else [image, text], dim=1)
    text_rows, image_rows = rows
    out = image.new_empty((text_rows.shape[0] + image_rows.shape[0], *image.shape[1:]))
    out.index_copy_(0, text_rows, text.flatten(0, 1))
    out.index_copy_(0, image_rows, image)
    return out
