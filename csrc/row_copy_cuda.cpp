// Torch-facing wrappers of the CUDA row-copy kernels (compiled only when torch has CUDA). They check
// arguments, pick the current stream and device, and hand raw pointers to csrc/cuda/row_copy.cu.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/row_copy.h"
#include "ops.h"
#include "row_copy_checks.h"

namespace retouch {

at::Tensor gather_rows_cuda(const at::Tensor& src, const at::Tensor& row_idx) {
  check_row_matrix(src, "src");
  check_row_index(row_idx, src);
  const c10::cuda::CUDAGuard device_guard(src.device());
  at::Tensor out = at::empty({row_idx.size(0), src.size(1)}, src.options());
  const int64_t elem = src.element_size();
  const int64_t row_bytes = src.size(1) * elem;
  C10_CUDA_CHECK(cuda::launch_gather_rows(src.data_ptr(), src.stride(0) * elem, row_idx.data_ptr(),
                                          row_idx.scalar_type() == at::kLong, row_idx.size(0), row_bytes,
                                          out.data_ptr(), row_bytes, at::cuda::getCurrentCUDAStream()));
  return out;
}

void scatter_rows_cuda(at::Tensor& dst, const at::Tensor& row_idx, const at::Tensor& src) {
  check_scatter_args(dst, row_idx, src);
  const c10::cuda::CUDAGuard device_guard(dst.device());
  const int64_t elem = dst.element_size();
  C10_CUDA_CHECK(cuda::launch_scatter_rows(dst.data_ptr(), dst.stride(0) * elem, row_idx.data_ptr(),
                                           row_idx.scalar_type() == at::kLong, row_idx.size(0),
                                           dst.size(1) * elem, src.data_ptr(), src.stride(0) * elem,
                                           at::cuda::getCurrentCUDAStream()));
}

}  // namespace retouch
