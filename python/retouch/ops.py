"""Typed entry points of the native ops. The only module that imports `retouch._C`.

The ops are registered with torch (TORCH_LIBRARY in csrc/torch_bindings.cpp) under the `retouch`
namespace, so torch.compile and CUDA graphs see them; the fake (meta) implementations below let
torch.compile trace them without running them.
"""

from __future__ import annotations

import torch

from retouch.errors import RetouchError

try:
    from retouch import _C
except ImportError as exc:  # a source checkout that was never built
    _C = None
    _IMPORT_ERROR = str(exc)
else:
    _IMPORT_ERROR = None


def extension_info() -> dict:
    """Which parts of retouch._C were built: `{"built": bool, "cpu": bool, "cuda": bool, "error": str|None}`."""
    if _C is None:
        return {"built": False, "cpu": False, "cuda": False, "error": _IMPORT_ERROR}
    return {"built": True, "cpu": True, "cuda": bool(_C.built_with_cuda()), "error": None}


def _require_extension() -> None:
    if _C is None:
        raise RetouchError(f"retouch._C is not built ({_IMPORT_ERROR}); run `pip install -e .` or `make`")


def gather_rows(src: torch.Tensor, row_idx: torch.Tensor) -> torch.Tensor:
    """Pack rows: `src: [N, H]` (unit stride along H), `row_idx: [T]` int32/int64 -> `[T, H]`."""
    _require_extension()
    return torch.ops.retouch.gather_rows(src, row_idx)


def scatter_rows_(dst: torch.Tensor, row_idx: torch.Tensor, src: torch.Tensor) -> None:
    """Unpack rows in place: `dst[row_idx[i]] = src[i]`; `dst: [N, H]`, `src: [T, H]`, indices unique."""
    _require_extension()
    torch.ops.retouch.scatter_rows_(dst, row_idx, src)


if _C is not None:

    @torch.library.register_fake("retouch::gather_rows")
    def _gather_rows_fake(src: torch.Tensor, row_idx: torch.Tensor) -> torch.Tensor:
        return src.new_empty((row_idx.shape[0], src.shape[1]))

    @torch.library.register_fake("retouch::scatter_rows_")
    def _scatter_rows_fake(dst: torch.Tensor, row_idx: torch.Tensor, src: torch.Tensor) -> None:
        return None
