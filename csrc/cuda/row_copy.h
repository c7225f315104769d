// Launchers for the CUDA row-copy kernels. Plain CUDA types only (no torch headers), so that
// CMakeLists.txt can compile csrc/cuda/*.cu with nvcc on a machine without a CUDA build of torch.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace retouch::cuda {

// out[i, :] = src[row_idx[i], :] for i in [0, num_rows). Rows are row_bytes long; strides are in bytes.
// Indices must be in range: the host-side ragged descriptor validates them once per batch.
cudaError_t launch_gather_rows(const void* src, int64_t src_row_stride_bytes, const void* row_idx,
                               bool idx_is_int64, int64_t num_rows, int64_t row_bytes, void* out,
                               int64_t out_row_stride_bytes, cudaStream_t stream);

// dst[row_idx[i], :] = src[i, :]. Indices must be unique (masked-token lists are), so no atomics.
cudaError_t launch_scatter_rows(void* dst, int64_t dst_row_stride_bytes, const void* row_idx,
                                bool idx_is_int64, int64_t num_rows, int64_t row_bytes, const void* src,
                                int64_t src_row_stride_bytes, cudaStream_t stream);

}  // namespace retouch::cuda
