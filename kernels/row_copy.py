"""Triton ragged row gather/scatter: pack the masked tokens of a batch into `[T, H]` and back.

Same semantics as `retouch.kernels.reference.gather_rows_ref` / `scatter_rows_ref` and the C++/CUDA
ops in csrc/; data movement, so results match bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from retouch.kernels.devices import check_triton_device

DEFAULT_BLOCK_H = 1024  # hidden elements per program: 2 KiB of bf16, whole rows for most models


@triton.jit
def copy_rows_kernel(
    src_ptr,  # [N_src, H] source rows, unit stride along H
    dst_ptr,  # [N_dst, H] destination rows, unit stride along H
    src_idx_ptr,  # [T] row of src that program row i reads (ignored unless GATHER)
    dst_idx_ptr,  # [T] row of dst that program row i writes (ignored unless SCATTER)
    hidden,  # H, elements per row
    src_row_stride,  # elements between consecutive src rows
    dst_row_stride,  # elements between consecutive dst rows
    GATHER: tl.constexpr,  # read src row src_idx[i] (else row i)
    SCATTER: tl.constexpr,  # write dst row dst_idx[i] (else row i)
    BLOCK_H: tl.constexpr,  # hidden elements per program
):
    i = tl.program_id(0)
    if GATHER:
        src_row = tl.load(src_idx_ptr + i).to(tl.int64)
    else:
        src_row = i.to(tl.int64)
    if SCATTER:
        dst_row = tl.load(dst_idx_ptr + i).to(tl.int64)
    else:
        dst_row = i.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_bounds = cols < hidden
    values = tl.load(src_ptr + src_row * src_row_stride + cols, mask=in_bounds)
    tl.store(dst_ptr + dst_row * dst_row_stride + cols, values, mask=in_bounds)


def _check_rows(name: str, rows: torch.Tensor) -> None:
    if rows.dim() != 2 or (rows.shape[1] > 1 and rows.stride(1) != 1):
        raise ValueError(f"{name} must be 2-D [rows, hidden] with unit stride along hidden, got shape "
                         f"{tuple(rows.shape)} strides {rows.stride()}")


def _check_index(row_idx: torch.Tensor, num_rows: int, device: torch.device) -> None:
    if row_idx.dim() != 1 or row_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"row_idx must be 1-D int32/int64, got {tuple(row_idx.shape)} {row_idx.dtype}")
    if row_idx.device != device:
        raise ValueError(f"row_idx is on {row_idx.device} but rows are on {device}")
    # Only on the CPU (interpreter): on a GPU this would sync; the ragged descriptor validated them.
    on_host = row_idx.device.type == "cpu" and row_idx.numel()
    if on_host and not (0 <= int(row_idx.min()) and int(row_idx.max()) < num_rows):
        raise ValueError(f"row_idx out of range for {num_rows} rows")


def gather_rows_triton(src: torch.Tensor, row_idx: torch.Tensor, block_h: int = DEFAULT_BLOCK_H) -> torch.Tensor:
    """`src: [N, H]`, `row_idx: [T]` -> `[T, H]` with `out[i] = src[row_idx[i]]`."""
    _check_rows("src", src)
    _check_index(row_idx, src.shape[0], src.device)
    check_triton_device(copy_rows_kernel, "gather_rows_triton", src)
    out = src.new_empty((row_idx.shape[0], src.shape[1]))
    if out.numel():
        grid = (row_idx.shape[0], triton.cdiv(src.shape[1], block_h))
        copy_rows_kernel[grid](src, out, row_idx.contiguous(), row_idx, src.shape[1], src.stride(0), out.stride(0),
                               GATHER=True, SCATTER=False, BLOCK_H=block_h)
    return out


def scatter_rows_triton(dst: torch.Tensor, row_idx: torch.Tensor, src: torch.Tensor,
                        block_h: int = DEFAULT_BLOCK_H) -> None:
    """In place: `dst[row_idx[i]] = src[i]`; `dst: [N, H]`, `src: [T, H]`, indices unique."""
    _check_rows("dst", dst)
    _check_rows("src", src)
    _check_index(row_idx, dst.shape[0], dst.device)
    if src.shape != (row_idx.shape[0], dst.shape[1]) or src.dtype != dst.dtype or src.device != dst.device:
        raise ValueError(f"src must be [{row_idx.shape[0]}, {dst.shape[1]}] {dst.dtype} on {dst.device}, "
                         f"got {tuple(src.shape)} {src.dtype} on {src.device}")
    check_triton_device(copy_rows_kernel, "scatter_rows_triton", dst)
    if src.numel():
        grid = (row_idx.shape[0], triton.cdiv(dst.shape[1], block_h))
        copy_rows_kernel[grid](src, dst, row_idx, row_idx.contiguous(), dst.shape[1], src.stride(0), dst.stride(0),
                               GATHER=False, SCATTER=True, BLOCK_H=block_h)
