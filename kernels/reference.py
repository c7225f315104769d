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
