// Declarations of every native op. Each is registered once, with its schema, in torch_bindings.cpp.
#pragma once

#include <ATen/core/Tensor.h>

namespace retouch {

// out[i] = src[row_idx[i]]. src: [N, H] with unit stride along H; row_idx: [T] int32/int64.
at::Tensor gather_rows_cpu(const at::Tensor& src, const at::Tensor& row_idx);
// dst[row_idx[i]] = src[i]. dst: [N, H]; src: [T, H]; indices unique.
void scatter_rows_cpu(at::Tensor& dst, const at::Tensor& row_idx, const at::Tensor& src);

#ifdef RETOUCH_WITH_CUDA
at::Tensor gather_rows_cuda(const at::Tensor& src, const at::Tensor& row_idx);
void scatter_rows_cuda(at::Tensor& dst, const at::Tensor& row_idx, const at::Tensor& src);
#endif

}  // namespace retouch
