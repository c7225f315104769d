// Argument checks shared by the CPU and CUDA row-copy ops: validate once at the boundary, then the
// kernels trust shapes, strides and dtypes.
#pragma once

#include <c10/util/Exception.h>
#include <ATen/core/Tensor.h>

namespace retouch {

inline void check_row_matrix(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D [rows, hidden], got ", t.dim(), "-D");
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, name, " must have unit stride along hidden, got stride ",
              t.stride(1));
}

inline void check_row_index(const at::Tensor& row_idx, const at::Tensor& rows) {
  TORCH_CHECK(row_idx.dim() == 1, "row_idx must be 1-D, got ", row_idx.dim(), "-D");
  TORCH_CHECK(row_idx.scalar_type() == at::kInt || row_idx.scalar_type() == at::kLong,
              "row_idx must be int32 or int64, got ", row_idx.scalar_type());
  TORCH_CHECK(row_idx.is_contiguous(), "row_idx must be contiguous");
  TORCH_CHECK(row_idx.device() == rows.device(), "row_idx is on ", row_idx.device(), " but rows are on ",
              rows.device());
}

inline void check_scatter_args(const at::Tensor& dst, const at::Tensor& row_idx, const at::Tensor& src) {
  check_row_matrix(dst, "dst");
  check_row_matrix(src, "src");
  check_row_index(row_idx, dst);
  TORCH_CHECK(src.device() == dst.device(), "src is on ", src.device(), " but dst is on ", dst.device());
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), "src dtype ", src.scalar_type(), " != dst dtype ",
              dst.scalar_type());
  TORCH_CHECK(src.size(1) == dst.size(1), "src hidden ", src.size(1), " != dst hidden ", dst.size(1));
  TORCH_CHECK(src.size(0) == row_idx.size(0), "src has ", src.size(0), " rows but row_idx has ",
              row_idx.size(0), " entries");
}

}  // namespace retouch
