// Ragged row gather/scatter: the data movement of mask-aware inference (packing the masked tokens of a
// ragged batch into [T, H] and writing block outputs back into [B*L, H]).
//
// One thread block per row; threads stride over the row in the widest vector that every address and
// the row length allow (16 bytes for bf16 rows whose hidden size is a multiple of 8), so the copy is
// bandwidth-bound with coalesced 128-bit accesses.
#include "row_copy.h"
#include "row_launch.cuh"

#include <algorithm>

namespace retouch::cuda {
namespace {

template <typename Vec, typename Index>
__global__ void copy_rows_kernel(const char* __restrict__ src, int64_t src_row_stride,
                                 const Index* __restrict__ src_idx,  // nullptr: row i reads row i
                                 char* __restrict__ dst, int64_t dst_row_stride,
                                 const Index* __restrict__ dst_idx,  // nullptr: row i writes row i
                                 int64_t vecs_per_row) {
  const int64_t i = blockIdx.x;
  const int64_t src_row = src_idx ? static_cast<int64_t>(src_idx[i]) : i;
  const int64_t dst_row = dst_idx ? static_cast<int64_t>(dst_idx[i]) : i;
  const Vec* in = reinterpret_cast<const Vec*>(src + src_row * src_row_stride);
  Vec* out = reinterpret_cast<Vec*>(dst + dst_row * dst_row_stride);
  for (int64_t v = threadIdx.x; v < vecs_per_row; v += blockDim.x) out[v] = in[v];
}

template <typename Index>
cudaError_t launch_copy_rows(const char* src, int64_t src_stride, const Index* src_idx, char* dst,
                             int64_t dst_stride, const Index* dst_idx, int64_t num_rows,
                             int64_t row_bytes, cudaStream_t stream) {
  if (num_rows == 0 || row_bytes == 0) return cudaSuccess;
  const RowLaunch shape = row_launch(num_rows, row_bytes,
                                     static_cast<uint64_t>(row_bytes) | static_cast<uint64_t>(src_stride) |
                                         static_cast<uint64_t>(dst_stride) | reinterpret_cast<uintptr_t>(src) |
                                         reinterpret_cast<uintptr_t>(dst));
  with_vector_type(shape.vector_bytes, [&](auto vector) {
    copy_rows_kernel<decltype(vector), Index><<<shape.grid, shape.threads, 0, stream>>>(
        src, src_stride, src_idx, dst, dst_stride, dst_idx, shape.vecs_per_row);
  });
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_gather_rows(const void* src, int64_t src_row_stride_bytes, const void* row_idx,
                               bool idx_is_int64, int64_t num_rows, int64_t row_bytes, void* out,
                               int64_t out_row_stride_bytes, cudaStream_t stream) {
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(out);
  if (idx_is_int64) {
    return launch_copy_rows<int64_t>(s, src_row_stride_bytes, static_cast<const int64_t*>(row_idx), d,
                                     out_row_stride_bytes, nullptr, num_rows, row_bytes, stream);
  }
  return launch_copy_rows<int32_t>(s, src_row_stride_bytes, static_cast<const int32_t*>(row_idx), d,
                                   out_row_stride_bytes, nullptr, num_rows, row_bytes, stream);
}

cudaError_t launch_scatter_rows(void* dst, int64_t dst_row_stride_bytes, const void* row_idx,
                                bool idx_is_int64, int64_t num_rows, int64_t row_bytes, const void* src,
                                int64_t src_row_stride_bytes, cudaStream_t stream) {
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  if (idx_is_int64) {
    return launch_copy_rows<int64_t>(s, src_row_stride_bytes, nullptr, d, dst_row_stride_bytes,
                                     static_cast<const int64_t*>(row_idx), num_rows, row_bytes, stream);
  }
  return launch_copy_rows<int32_t>(s, src_row_stride_bytes, nullptr, d, dst_row_stride_bytes,
                                   static_cast<const int32_t*>(row_idx), num_rows, row_bytes, stream);
}

}  // namespace retouch::cuda
