"""Decoding float8 cache rows in one pass: `float32(stored) * scale`, rounded to the compute dtype.

What `retouch.cache.layout.decode` does in three (fp8 -> fp32, multiply, -> bf16: 19 bytes of traffic an
element and three launches), for the rows the copy engine stages every block of every KV-cache step
(`retouch.cache.staging`). Token row t uses scale row `t // tokens_per_row`, or `row_of_token[t]` (a
packed, mixed-resolution batch). Same arithmetic as the reference: compiled, the results match bit for bit
(the conversions are exact or round to nearest even, the product is one fp32 multiply); Triton's
interpreter rounds fp32 -> bf16 otherwise, within one bf16 unit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from retouch.kernels.devices import check_triton_device

BLOCK = 1024  # row elements per program


@triton.jit
def decode_fp8_kernel(
    stored_ptr,  # [T, E] float8 rows, contiguous
    scale_ptr,  # [R, E] float32 per-channel scales, contiguous
    row_of_token_ptr,  # [T] scale row of each token row (read when INDEXED)
    out_ptr,  # [T, E] in the compute dtype, contiguous
    row_elems,  # E
    tokens_per_row,  # tokens sharing a scale row (when not INDEXED)
    INDEXED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    if INDEXED:
        scale_row = tl.load(row_of_token_ptr + token).to(tl.int64)
    else:
        scale_row = token // tokens_per_row
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = cols < row_elems
    values = tl.load(stored_ptr + token * row_elems + cols, mask=in_bounds).to(tl.float32)
    scales = tl.load(scale_ptr + scale_row * row_elems + cols, mask=in_bounds)
    tl.store(out_ptr + token * row_elems + cols, (values * scales).to(out_ptr.dtype.element_ty), mask=in_bounds)


def decode_fp8_rows(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, tokens_per_row: int | None = None,
                    row_of_token: torch.Tensor | None = None) -> torch.Tensor:
    """`stored: [T, E]` float8_e4m3fn, `scale: [R, E]` float32 -> `[T, E]` in `dtype`; token row t scaled by
    scale row `t // tokens_per_row`, or by `row_of_token[t]` ([T] int64), exactly one of the two given."""
    if (tokens_per_row is None) == (row_of_token is None):
        raise ValueError("give exactly one of tokens_per_row and row_of_token")
    if stored.dim() != 2 or stored.dtype != torch.float8_e4m3fn or not stored.is_contiguous():
        raise ValueError(f"stored must be contiguous [T, E] float8_e4m3fn, got {tuple(stored.shape)} {stored.dtype}")
    if scale.dim() != 2 or scale.dtype != torch.float32 or scale.shape[1] != stored.shape[1]:
        raise ValueError(f"scale must be [R, {stored.shape[1]}] float32, got {tuple(scale.shape)} {scale.dtype}")
    if row_of_token is not None and (row_of_token.shape != (stored.shape[0],) or row_of_token.dtype != torch.long):
        raise ValueError(f"row_of_token must be [{stored.shape[0]}] int64, got {tuple(row_of_token.shape)} "
                         f"{row_of_token.dtype}")
    if tokens_per_row is not None and (tokens_per_row < 1 or stored.shape[0] > tokens_per_row * scale.shape[0]):
        raise ValueError(f"{stored.shape[0]} token rows need {tokens_per_row} x {scale.shape[0]} scale rows or more")
    check_triton_device(decode_fp8_kernel, "decode_fp8_rows", stored, scale)
    out = torch.empty(stored.shape, dtype=dtype, device=stored.device)
    if out.numel():
        indexed = row_of_token is not None
        grid = (stored.shape[0], triton.cdiv(stored.shape[1], BLOCK))
        decode_fp8_kernel[grid](stored, scale.contiguous(), row_of_token if indexed else stored, out, stored.shape[1],
                                tokens_per_row or 1, INDEXED=indexed, BLOCK=BLOCK)
    return out
