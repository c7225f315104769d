"""Pure-PyTorch references of the data-movement ops. They define the semantics that the C++, CUDA and
Triton implementations must match exactly (data movement has no rounding, so tests compare bit for bit).
"""

import torch


def gather_rows_ref(src: torch.Tensor, row_idx: torch.Tensor) -> torch.Tensor:
    """Pack rows: `src: [N, H]`, `row_idx: [T]` -> `[T, H]` with `out[i] = src[row_idx[i]]`."""
    return src.index_select(0, row_idx.long())


def scatter_rows_ref(dst: torch.Tensor, row_idx: torch.Tensor, src: torch.Tensor) -> None:
    """Unpack rows in place: `dst: [N, H]`, `src: [T, H]`, `dst[row_idx[i]] = src[i]`; indices unique."""
    dst.index_copy_(0, row_idx.long(), src)


def gather_host_rows_ref(dst: torch.Tensor, src: torch.Tensor, src_offsets: torch.Tensor,
                         dst_rows: torch.Tensor) -> None:
    """Copy rows out of a host arena in place: `dst: [N, H]` (any dtype, unit stride along H),
    `src: [capacity]` uint8, `src_offsets, dst_rows: [n]` int64; the bytes of `dst[dst_rows[i]]` become
    `src[src_offsets[i] : src_offsets[i] + H * dst.element_size()]`."""
    row_bytes = dst.shape[1] * dst.element_size()
    byte_idx = src_offsets.long()[:, None] + torch.arange(row_bytes)
    rows = src[byte_idx].to(dst.device)  # [n, row_bytes] uint8
    dst.view(torch.uint8).index_copy_(0, dst_rows.long().to(dst.device), rows)
