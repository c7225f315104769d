// Torch-facing wrapper of the host->device row gather (compiled only when torch has CUDA): checks the
// arguments on the host, picks the method, and hands raw pointers to csrc/cuda/host_gather.cu. All work
// is issued on the current CUDA stream and returns without waiting for it.
#include <cstring>

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/host_gather.h"
#include "host_gather_checks.h"
#include "ops.h"

namespace retouch {
namespace {

// "auto" takes the copy engines when the mean run is at least this long. Measured on an H200 (PCIe 5,
// bench/results/h200/gather.json, stop 47, 2-190 MB from pinned memory): with Flux's 6 KiB rows the SM
// kernel moved 45-48 GB/s at every mean run, per-run cudaMemcpyAsync 33 GB/s at ~270 KiB, 42 GB/s at
// ~670 KiB and 48 GB/s at ~1.6 MiB (one contiguous copy: 54-55 GB/s). The crossover lies between the last
// two, so copies are taken from 1 MiB (stop 44's 640 KiB, fitted on the smoke sizes, sent the ~670 KiB runs
// of a Flux edit at m = 0.2 to copies 10% slower than the kernel).
constexpr int64_t kMemcpyMinMeanRunBytes = 1024 * 1024;

bool copy_with_memcpy(HostGatherMethod method, const HostGather& gather, bool src_pinned) {
  switch (method) {
    case HostGatherMethod::kMemcpy: return true;
    case HostGatherMethod::kKernel: return false;
    case HostGatherMethod::kAuto: break;
  }
  // The kernel can only read pinned memory; pageable memory has to go through the driver's staging.
  return !src_pinned || gather.num_rows * gather.row_bytes >= kMemcpyMinMeanRunBytes * gather.num_runs;
}

// The kernel needs the indices in device memory. Both arrays go over in one async copy from a pinned
// block of torch's caching host allocator, which holds the block until that copy has completed. The
// alternative, requiring pinned index tensors and reading them through their mapped device pointers,
// would make the caller keep them unchanged until the kernel has run; this way the host may plan the
// next block's indices as soon as the call returns, and pays one small copy.
at::Tensor device_indices(const at::Tensor& src_offsets, const at::Tensor& dst_rows, const HostGather& gather,
                          const at::Device& device) {
  const int64_t n = gather.num_rows;
  at::Tensor host = at::empty({2, n}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::memcpy(host.data_ptr<int64_t>(), src_offsets.const_data_ptr<int64_t>(), n * sizeof(int64_t));
  std::memcpy(host.data_ptr<int64_t>() + n, dst_rows.const_data_ptr<int64_t>(), n * sizeof(int64_t));
  at::Tensor indices = at::empty({2, n}, at::TensorOptions().dtype(at::kLong).device(device));
  indices.copy_(host, /*non_blocking=*/true);
  return indices;
}

}  // namespace

void gather_host_rows_cuda(at::Tensor& dst, const at::Tensor& src, const at::Tensor& src_offsets,
                           const at::Tensor& dst_rows, std::string_view method, int64_t max_blocks) {
  const HostGatherMethod requested = parse_host_gather_method(method);
  check_max_blocks(max_blocks);
  TORCH_CHECK(dst.is_cuda(), "dst must be a CUDA tensor here, got ", dst.device());
  const HostGather gather = check_host_gather_args(dst, src, src_offsets, dst_rows);
  const bool src_pinned = src.is_pinned();
  const bool with_memcpy = copy_with_memcpy(requested, gather, src_pinned);
  TORCH_CHECK(with_memcpy || src_pinned,
              "gather_host_rows_(method='kernel') reads src from the GPU, so src must be pinned host memory "
              "(a HostArena whose .pinned is True)");
  if (gather.num_rows == 0 || gather.row_bytes == 0) return;

  const c10::cuda::CUDAGuard device_guard(dst.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (with_memcpy) {
    C10_CUDA_CHECK(cuda::launch_gather_host_rows_memcpy(
        dst.data_ptr(), gather.dst_row_stride_bytes, gather.dst_rows_adjacent, src.const_data_ptr(),
        src_offsets.const_data_ptr<int64_t>(), dst_rows.const_data_ptr<int64_t>(), gather.num_rows,
        gather.row_bytes, stream));
    return;
  }
  const at::Tensor indices = device_indices(src_offsets, dst_rows, gather, dst.device());
  C10_CUDA_CHECK(cuda::launch_gather_host_rows_kernel(
      dst.data_ptr(), gather.dst_row_stride_bytes, src.const_data_ptr(), indices[0].const_data_ptr<int64_t>(),
      indices[1].const_data_ptr<int64_t>(), gather.num_rows, gather.row_bytes, gather.offset_bits, max_blocks,
      stream));
}

}  // namespace retouch
