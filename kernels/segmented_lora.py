"""Segmented LoRA (after Punica's SGMV): one launch adds each row segment's own adapter to a base
linear's output, for a continuous batch whose rows use different LoRAs (or none).

    y[s:e] += scale_a * ((x[s:e] @ A_a^T) @ B_a^T)      for every segment (s, e, a)

`x: [T, in]` the linear's input rows, `y: [T, out]` its base output (updated in place), `A: [G, R, in]`
and `B: [G, out, R]` the G adapters' down and up projections padded to the largest rank R (adapter a
uses its first `ranks[a]` rows of A and columns of B), `scales: [G]`. Segments are row ranges; several
may use one adapter and rows in no segment (requests without a LoRA) cost nothing. Two kernels, as
Punica: shrink (`v = x A^T`, rounded to x's dtype as PEFT's `lora_A(x)` is) and expand (`y += s v B^T`),
both accumulating in fp32. `segmented_lora_ref` below is the same computation in PyTorch (the CPU
fallback and the test oracle).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from retouch.kernels.devices import check_triton_device
from retouch.kernels.host_tables import to_device_async

BLOCK_M = 32  # rows per program
BLOCK_R = 16  # rank columns per program (shrink) / per inner step (expand)
BLOCK_K = 64  # input features per inner step (shrink)
BLOCK_N = 64  # output features per program (expand)


@triton.jit
def _block_rows(block_segment_ptr, block_start_ptr, segment_end_ptr, segment_adapter_ptr, ranks_ptr,
                BLOCK_M: tl.constexpr):
    """This program's row block: its adapter, that adapter's rank, its rows and which of them are in the segment."""
    block = tl.program_id(0)
    segment = tl.load(block_segment_ptr + block)
    adapter = tl.load(segment_adapter_ptr + segment).to(tl.int64)
    rows = tl.load(block_start_ptr + block).to(tl.int64) + tl.arange(0, BLOCK_M)
    return adapter, tl.load(ranks_ptr + adapter), rows, rows < tl.load(segment_end_ptr + segment)


@triton.jit
def lora_shrink_kernel(
    x_ptr,  # [T, in] input rows, unit stride along in
    a_ptr,  # [G, R, in] down projections, unit stride along in
    v_ptr,  # [T, R] out: x A^T of each row's adapter (rows in no segment are not written)
    block_segment_ptr,  # [num_blocks] the segment of each row block
    block_start_ptr,  # [num_blocks] its first row
    segment_end_ptr,  # [S] one past each segment's last row
    segment_adapter_ptr,  # [S] each segment's adapter
    ranks_ptr,  # [G] each adapter's rank (<= R)
    in_features,
    x_stride, a_stride_g, a_stride_r, v_stride,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    adapter, rank, rows, row_ok = _block_rows(block_segment_ptr, block_start_ptr, segment_end_ptr,
                                              segment_adapter_ptr, ranks_ptr, BLOCK_M)
    first_rank = tl.program_id(1) * BLOCK_R
    if first_rank < rank:
        ranks = first_rank + tl.arange(0, BLOCK_R)
        rank_ok = ranks < rank
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, in_features, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < in_features
            x = tl.load(x_ptr + rows[:, None] * x_stride + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(a_ptr + adapter * a_stride_g + ranks[None, :] * a_stride_r + ks[:, None],
                        mask=k_ok[:, None] & rank_ok[None, :], other=0.0)
            if UPCAST:
                x, a = x.to(tl.float32), a.to(tl.float32)
            acc = tl.dot(x, a, acc, input_precision="ieee")
        tl.store(v_ptr + rows[:, None] * v_stride + ranks[None, :], acc.to(v_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & rank_ok[None, :])


@triton.jit
def lora_expand_kernel(
    v_ptr,  # [T, R] shrunk rows
    b_ptr,  # [G, out, R] up projections, unit stride along R
    y_ptr,  # [T, out] base output, updated in place
    scales_ptr,  # [G] fp32
    block_segment_ptr, block_start_ptr, segment_end_ptr, segment_adapter_ptr, ranks_ptr,
    out_features,
    v_stride, b_stride_g, b_stride_o, y_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST: tl.constexpr,
):
    adapter, rank, rows, row_ok = _block_rows(block_segment_ptr, block_start_ptr, segment_end_ptr,
                                              segment_adapter_ptr, ranks_ptr, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < out_features
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        ranks = r0 + tl.arange(0, BLOCK_R)
        rank_ok = ranks < rank
        v = tl.load(v_ptr + rows[:, None] * v_stride + ranks[None, :], mask=row_ok[:, None] & rank_ok[None, :],
                    other=0.0)
        b = tl.load(b_ptr + adapter * b_stride_g + cols[None, :] * b_stride_o + ranks[:, None],
                    mask=rank_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            v, b = v.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(v, b, acc, input_precision="ieee")
    scale = tl.load(scales_ptr + adapter)
    mask = row_ok[:, None] & col_ok[None, :]
    y_at = y_ptr + rows[:, None] * y_stride + cols[None, :]
    y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_at, (y + scale * acc).to(y_ptr.dtype.element_ty), mask=mask)


def check_segments(x: torch.Tensor, y: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scales: torch.Tensor,
                   ranks: Sequence[int], segments: Sequence[tuple[int, int, int]]) -> None:
    """Shapes, dtypes and segment bounds (host values: no device sync)."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y must be [T, in] and [T, out], got {tuple(x.shape)} and {tuple(y.shape)}")
    groups, max_rank, in_features = A.shape
    if B.shape != (groups, y.shape[1], max_rank) or in_features != x.shape[1]:
        raise ValueError(f"A must be [G, R, in={x.shape[1]}] and B [G, out={y.shape[1]}, R], got "
                         f"{tuple(A.shape)} and {tuple(B.shape)}")
    if scales.shape != (groups,) or len(ranks) != groups or any(not 0 < r <= max_rank for r in ranks):
        raise ValueError(f"scales [G] and ranks (each in 1..{max_rank}) for {groups} adapters, got "
                         f"{tuple(scales.shape)} and {list(ranks)}")
    if x.dtype != A.dtype or A.dtype != B.dtype:
        raise ValueError(f"x, A and B must share a dtype, got {x.dtype}, {A.dtype}, {B.dtype}")
    end = 0
    for start, stop, adapter in sorted(segments):
        if start < end or not start <= stop <= x.shape[0] or not 0 <= adapter < groups:
            raise ValueError(f"segments must be disjoint row ranges of {x.shape[0]} rows with adapters in "
                             f"0..{groups - 1}, got {list(segments)}")
        end = stop


def segmented_lora_ref(x: torch.Tensor, y: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scales: torch.Tensor,
                       ranks: Sequence[int], segments: Sequence[tuple[int, int, int]]) -> None:
    """The reference, in place on y: per segment, `v = round(x A^T)` then `y += s v B^T`, fp32 sums."""
    check_segments(x, y, A, B, scales, ranks, segments)
    for start, stop, adapter in segments:
        rank = ranks[adapter]
        v = (x[start:stop].float() @ A[adapter, :rank].float().T).to(x.dtype)
        delta = v.float() @ B[adapter, :, :rank].float().T
        y[start:stop] = (y[start:stop].float() + scales[adapter].float() * delta).to(y.dtype)


def segmented_lora_triton(x: torch.Tensor, y: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scales: torch.Tensor,
                          ranks: Sequence[int], segments: Sequence[tuple[int, int, int]]) -> None:
    """The Triton kernels, in place on y; `segments` and `ranks` are host values (the batch knows them),
    so building the launch tables syncs nothing."""
    check_segments(x, y, A, B, scales, ranks, segments)
    check_triton_device(lora_shrink_kernel, "segmented_lora_triton", x, y, A, B)
    if x.stride(1) != 1 or y.stride(1) != 1 or A.stride(2) != 1 or B.stride(2) != 1:
        raise ValueError("x, y, A and B must have unit stride along their last dimension")
    segments = [(start, stop, adapter) for start, stop, adapter in segments if stop > start]
    if not segments:
        return
    blocks = [(s, start) for s, (first, stop, _) in enumerate(segments) for start in range(first, stop, BLOCK_M)]
    device = x.device

    def table(values) -> torch.Tensor:
        return to_device_async(torch.tensor(values, dtype=torch.int32), device)

    block_segment, block_start = table([b[0] for b in blocks]), table([b[1] for b in blocks])
    segment_end, segment_adapter = table([s[1] for s in segments]), table([s[2] for s in segments])
    rank_table = table(list(ranks))
    max_rank = A.shape[1]
    # Under the interpreter bf16 is stored as uint16 and tl.dot multiplies the bit patterns
    # (triton-lang/triton#11584; as retouch.kernels.ragged_attention): fp32 dots of bf16 values are exact.
    upcast = isinstance(lora_shrink_kernel, InterpretedFunction) and x.dtype == torch.bfloat16
    v = x.new_empty((x.shape[0], max_rank))
    lora_shrink_kernel[(len(blocks), triton.cdiv(max_rank, BLOCK_R))](
        x, A, v, block_segment, block_start, segment_end, segment_adapter, rank_table, x.shape[1],
        x.stride(0), A.stride(0), A.stride(1), v.stride(0), BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
        UPCAST=upcast)
    lora_expand_kernel[(len(blocks), triton.cdiv(y.shape[1], BLOCK_N))](
        v, B, y, scales.to(device, torch.float32), block_segment, block_start, segment_end, segment_adapter,
        rank_table, y.shape[1], v.stride(0), B.stride(0), B.stride(1), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, UPCAST=upcast)
