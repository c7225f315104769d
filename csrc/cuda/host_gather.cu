// Host->device row gather out of the pinned HostArena: an SM kernel that reads mapped host memory
// (many small runs: one launch, no per-copy overhead; its grid can be bounded to leave SMs to compute)
// and a copy-engine path that issues one host->device copy per run of adjacent rows (few long runs: DMA
// at full link bandwidth, no SMs taken from the compute stream). The torch wrapper
// (csrc/host_gather_cuda.cpp) picks one.
#include "host_gather.h"

#include <algorithm>
#include <vector>

#include "../host_row_runs.h"
#include "row_launch.cuh"

namespace retouch::cuda {
namespace {

constexpr int kGatherThreads = 256;
constexpr int kGatherUnroll = 4;

// The rows' vectors as one index space, g = row * vecs_per_row + v: each thread loads kGatherUnroll vectors
// before it stores any, so a thread block keeps kGatherThreads * kGatherUnroll vectors in flight over the
// host link (16 KiB with 16-byte vectors), whatever the row size, and a grid of a few dozen blocks loops
// over all of it. A grid of one block per row (stop 47's kernel) filled every SM with blocks waiting on
// PCIe: the compute kernels it overlapped could not start until it drained (the H200 headline's step took
// about compute + copy time, stop 52).
template <typename Vec>
__global__ void gather_host_rows_kernel(char* __restrict__ dst, int64_t dst_row_stride,
                                        const char* __restrict__ src,  // device alias of pinned host memory
                                        const int64_t* __restrict__ src_offsets,  // device memory
                                        const int64_t* __restrict__ dst_rows,     // device memory
                                        int64_t vecs_per_row, int64_t total_vecs) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kGatherThreads * kGatherUnroll;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kGatherThreads * kGatherUnroll + threadIdx.x;
       base < total_vecs; base += step) {
    Vec values[kGatherUnroll];
    Vec* outs[kGatherUnroll];
#pragma unroll
    for (int u = 0; u < kGatherUnroll; ++u) {
      const int64_t g = base + static_cast<int64_t>(u) * kGatherThreads;
      outs[u] = nullptr;
      if (g < total_vecs) {
        const int64_t row = g / vecs_per_row;
        const int64_t v = g - row * vecs_per_row;
        values[u] = reinterpret_cast<const Vec*>(src + src_offsets[row])[v];
        outs[u] = reinterpret_cast<Vec*>(dst + dst_rows[row] * dst_row_stride) + v;
      }
    }
#pragma unroll
    for (int u = 0; u < kGatherUnroll; ++u) {
      if (outs[u] != nullptr) *outs[u] = values[u];
    }
  }
}

bool is_legacy_stream(cudaStream_t stream) { return stream == nullptr || stream == cudaStreamLegacy; }

struct Runs {
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
};

Runs coalesce_runs(char* dst, int64_t dst_row_stride, bool dst_rows_adjacent, const char* src,
                   const int64_t* src_offsets, const int64_t* dst_rows, int64_t num_rows, int64_t row_bytes) {
  Runs runs;
  for (int64_t i = 0; i < num_rows; ++i) {
    if (i > 0 && extends_run(src_offsets[i - 1], dst_rows[i - 1], src_offsets[i], dst_rows[i], row_bytes,
                             dst_rows_adjacent)) {
      runs.sizes.back() += static_cast<size_t>(row_bytes);
      continue;
    }
    runs.dsts.push_back(dst + dst_rows[i] * dst_row_stride);
    runs.srcs.push_back(src + src_offsets[i]);
    runs.sizes.push_back(static_cast<size_t>(row_bytes));
  }
  return runs;
}

// cudaMemcpyBatchAsync (CUDA 12.8+; this is the CUDA 13 signature, 12.8/12.9 had an extra failIdx)
// issues every run in one driver call instead of one per run. It refuses the legacy default stream.
// Returns false when it did not apply or failed; then the caller issues the runs one by one.
bool memcpy_batch(Runs& runs, cudaStream_t stream) {
#if CUDART_VERSION >= 13000
  if (runs.sizes.size() < 2 || is_legacy_stream(stream)) return false;
  cudaMemcpyAttributes attrs{};
  attrs.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t attrs_idx = 0;
  if (cudaMemcpyBatchAsync(runs.dsts.data(), runs.srcs.data(), runs.sizes.data(), runs.sizes.size(), &attrs,
                           &attrs_idx, 1, stream) == cudaSuccess) {
    return true;
  }
  (void)cudaGetLastError();  // e.g. a driver older than the runtime: not an error of this op
#else
  (void)runs;
  (void)stream;
#endif
  return false;
}

}  // namespace

cudaError_t launch_gather_host_rows_kernel(void* dst, int64_t dst_row_stride_bytes, const void* src_host,
                                           const int64_t* src_offsets, const int64_t* dst_rows, int64_t num_rows,
                                           int64_t row_bytes, uint64_t offset_bits, int64_t max_blocks,
                                           cudaStream_t stream) {
  if (num_rows == 0 || row_bytes == 0) return cudaSuccess;
  void* src_device = nullptr;
  // With unified addressing this is src_host itself; asking keeps non-UVA mappings correct too.
  cudaError_t status = cudaHostGetDevicePointer(&src_device, const_cast<void*>(src_host), 0);
  if (status != cudaSuccess) return status;
  const uint64_t all_bits = static_cast<uint64_t>(row_bytes) | static_cast<uint64_t>(dst_row_stride_bytes) |
                            offset_bits | reinterpret_cast<uintptr_t>(src_device) |
                            reinterpret_cast<uintptr_t>(dst);
  const int vector_bytes = widest_vector_bytes(all_bits);
  const int64_t vecs_per_row = row_bytes / vector_bytes;
  const int64_t total_vecs = num_rows * vecs_per_row;
  const int64_t per_block = static_cast<int64_t>(kGatherThreads) * kGatherUnroll;
  int64_t blocks = (total_vecs + per_block - 1) / per_block;
  if (max_blocks > 0) blocks = std::min(blocks, max_blocks);
  blocks = std::min<int64_t>(blocks, 0x7fffffff);
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src_device);
  with_vector_type(vector_bytes, [&](auto vector) {
    gather_host_rows_kernel<decltype(vector)><<<static_cast<unsigned int>(blocks), kGatherThreads, 0, stream>>>(
        d, dst_row_stride_bytes, s, src_offsets, dst_rows, vecs_per_row, total_vecs);
  });
  return cudaGetLastError();
}

cudaError_t launch_gather_host_rows_memcpy(void* dst, int64_t dst_row_stride_bytes, bool dst_rows_adjacent,
                                           const void* src_host, const int64_t* src_offsets, const int64_t* dst_rows,
                                           int64_t num_rows, int64_t row_bytes, cudaStream_t stream) {
  if (num_rows == 0 || row_bytes == 0) return cudaSuccess;
  Runs runs = coalesce_runs(static_cast<char*>(dst), dst_row_stride_bytes, dst_rows_adjacent,
                            static_cast<const char*>(src_host), src_offsets, dst_rows, num_rows, row_bytes);
  if (memcpy_batch(runs, stream)) return cudaSuccess;
  // One copy per run. Re-issuing runs that a failed batch may have started is harmless: every run
  // rewrites the same bytes.
  for (size_t r = 0; r < runs.sizes.size(); ++r) {
    const cudaError_t status =
        cudaMemcpyAsync(runs.dsts[r], runs.srcs[r], runs.sizes[r], cudaMemcpyHostToDevice, stream);
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

}  // namespace retouch::cuda
