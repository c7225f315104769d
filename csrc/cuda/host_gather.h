// Launchers of the host->device row gather (paper §4.2: per transformer block, the cached rows a batch
// needs are copied from the pinned HostArena into a device staging buffer on a copy stream). Plain CUDA
// types only (no torch headers), so that CMakeLists.txt compiles csrc/cuda/*.cu with nvcc alone.
//
// Both launchers compute dst[dst_rows[i], :] (as bytes) = src[src_offsets[i] : src_offsets[i] + row_bytes]
// asynchronously on `stream`. The caller has validated every index (csrc/host_gather_checks.h); with
// repeated dst rows, which source row lands is unspecified.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace retouch::cuda {

// Zero-copy: an SM kernel reads src straight out of pinned host memory over PCIe/NVLink-C2C. src_host is
// a host pointer into memory that is pinned and mapped (cudaHostAlloc, or cudaHostRegister'd); the
// index arrays are DEVICE pointers. offset_bits is the OR of all source offsets, so the kernel can use
// 16-byte loads whenever every row starts 16-byte aligned. max_blocks > 0 bounds the grid (the kernel
// loops): a gather overlapping compute should leave most SMs to it; 0 launches as many as the work needs.
cudaError_t launch_gather_host_rows_kernel(void* dst, int64_t dst_row_stride_bytes, const void* src_host,
                                           const int64_t* src_offsets, const int64_t* dst_rows, int64_t num_rows,
                                           int64_t row_bytes, uint64_t offset_bits, int64_t max_blocks,
                                           cudaStream_t stream);

// Copy engines: consecutive rows that are consecutive on both sides (see csrc/host_row_runs.h) are
// coalesced on the host into runs, and each run is one host->device copy. The index arrays are HOST
// pointers. src may be pageable, but then the driver stages the copy and it is not asynchronous.
cudaError_t launch_gather_host_rows_memcpy(void* dst, int64_t dst_row_stride_bytes, bool dst_rows_adjacent,
                                           const void* src_host, const int64_t* src_offsets, const int64_t* dst_rows,
                                           int64_t num_rows, int64_t row_bytes, cudaStream_t stream);

}  // namespace retouch::cuda
