"""Triton RMSNorm + Flux RoPE in one pass: the q/k norms of attention and the rotation of the normalised
rows, the CUDA kernel of `retouch::rms_norm_rope` and `retouch::rope_pairs` (registered in retouch.ops).

Same math as `retouch.kernels.reference.rms_norm_rope_ref`: the norm in fp32, rounded to x's dtype as
torch.rms_norm's output is, then each (2i, 2i+1) pair rotated in fp32. Each program takes BLOCK_ROWS
rows of `head_dim` elements; even and odd elements load as two vectors, so a pair never crosses lanes.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from retouch.kernels.devices import check_triton_device


@triton.jit
def norm_rope_kernel(
    x_ptr,  # [rows, D] contiguous: rows = tokens x heads (x heads per position)
    out_ptr,  # [rows, D] contiguous, x's dtype
    weight_ptr,  # [D] norm weight (ignored unless HAS_WEIGHT)
    cos_ptr,  # [S, D] fp32 (ignored unless ROPE)
    sin_ptr,  # [S, D] fp32
    rows,  # rows of x
    heads,  # rows per position
    seq,  # positions per table
    eps,  # RMSNorm epsilon
    HALF_D: tl.constexpr,  # head_dim // 2
    BLOCK_PAIRS: tl.constexpr,  # next power of two >= HALF_D
    BLOCK_ROWS: tl.constexpr,
    NORM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    ROPE: tl.constexpr,
):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]  # [R, 1]
    pair = tl.arange(0, BLOCK_PAIRS)[None, :]  # [1, P]
    live = (row < rows) & (pair < HALF_D)
    even = row.to(tl.int64) * (2 * HALF_D) + 2 * pair
    x0 = tl.load(x_ptr + even, mask=live, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + even + 1, mask=live, other=0.0).to(tl.float32)
    if NORM:
        squares = tl.sum(x0 * x0 + x1 * x1, axis=1)[:, None]
        # Correctly rounded, as torch's CPU ops are (tl.sqrt and / are approximate on GPUs).
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(squares, 2.0 * HALF_D) + eps))
        x0 = x0 * rstd
        x1 = x1 * rstd
        if HAS_WEIGHT:
            x0 = x0 * tl.load(weight_ptr + 2 * pair, mask=pair < HALF_D, other=0.0).to(tl.float32)
            x1 = x1 * tl.load(weight_ptr + 2 * pair + 1, mask=pair < HALF_D, other=0.0).to(tl.float32)
        # Rounded to x's dtype, as the norm's output is before RoPE reads it.
        x0 = x0.to(out_ptr.dtype.element_ty).to(tl.float32)
        x1 = x1.to(out_ptr.dtype.element_ty).to(tl.float32)
    if ROPE:
        table = ((row // heads) % seq).to(tl.int64) * (2 * HALF_D) + 2 * pair
        c0 = tl.load(cos_ptr + table, mask=live, other=0.0)
        c1 = tl.load(cos_ptr + table + 1, mask=live, other=0.0)
        s0 = tl.load(sin_ptr + table, mask=live, other=0.0)
        s1 = tl.load(sin_ptr + table + 1, mask=live, other=0.0)
        y0 = x0 * c0 + (-x1) * s0
        y1 = x1 * c1 + x0 * s1
    else:
        y0 = x0
        y1 = x1
    tl.store(out_ptr + even, y0.to(out_ptr.dtype.element_ty), mask=live)
    tl.store(out_ptr + even + 1, y1.to(out_ptr.dtype.element_ty), mask=live)


def norm_rope_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float | None, cos: torch.Tensor | None,
                     sin: torch.Tensor | None, block_rows: int = 16) -> torch.Tensor:
    """`rms_norm_rope_ref(x, weight, eps, cos, sin)`; eps None: RoPE only (`rope_pairs_ref`).
    `x: [..., S, heads, d]` with tables, `[..., d]` without; tables fp32 `[S, d]`; d even."""
    dim = x.shape[-1]
    if dim % 2:
        raise ValueError(f"head_dim must be even, got {dim}")
    if (cos is None) != (sin is None) or (cos is None and eps is None):
        raise ValueError("give cos and sin together; with neither, eps (the norm) is required")
    if cos is not None:
        if x.dim() < 3 or tuple(cos.shape) != (x.shape[-3], dim) or cos.shape != sin.shape:
            raise ValueError(f"tables {tuple(cos.shape)} do not match x {tuple(x.shape)} (S = dim -3, d = dim -1)")
        if cos.dtype != torch.float32 or sin.dtype != torch.float32:
            raise ValueError("cos and sin must be fp32")
    if weight is not None and tuple(weight.shape) != (dim,):
        raise ValueError(f"weight must be [{dim}], got {tuple(weight.shape)}")
    check_triton_device(norm_rope_kernel, "norm_rope_triton", x, *(t for t in (weight, cos, sin) if t is not None))
    x = x.contiguous()
    out = torch.empty_like(x)
    rows = x.numel() // dim if dim else 0
    if rows == 0:
        return out
    heads = x.shape[-2] if cos is not None else 1
    seq = x.shape[-3] if cos is not None else 1
    grid = (triton.cdiv(rows, block_rows),)
    # enable_fp_fusion=False: no FMA contraction, so each product rounds as the reference's separate
    # tensor ops round it (the CPU kernel is built with -ffp-contract=off for the same reason).
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        norm_rope_kernel[grid](
            x, out, x if weight is None else weight.contiguous(), x if cos is None else cos.contiguous(),
            x if sin is None else sin.contiguous(), rows, heads, seq, 0.0 if eps is None else float(eps),
            HALF_D=dim // 2, BLOCK_PAIRS=triton.next_power_of_2(dim // 2), BLOCK_ROWS=block_rows,
            NORM=eps is not None, HAS_WEIGHT=weight is not None, ROPE=cos is not None, enable_fp_fusion=False)
    return out
