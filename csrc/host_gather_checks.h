// Argument checks of gather_host_rows_, shared by the CPU and CUDA implementations. Every index is
// checked on the host before any copy is issued, so a bad one never leaves dst half-written; the same
// pass collects what the launchers need (run count, offset alignment), so the indices are read once.
#pragma once

#include <cstdint>
#include <string_view>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "host_row_runs.h"
#include "row_copy_checks.h"

namespace retouch {

enum class HostGatherMethod { kAuto, kKernel, kMemcpy };

inline HostGatherMethod parse_host_gather_method(std::string_view method) {
  if (method == "auto") return HostGatherMethod::kAuto;
  if (method == "kernel") return HostGatherMethod::kKernel;
  TORCH_CHECK_VALUE(method == "memcpy", "gather_host_rows_: method must be 'auto', 'kernel' or 'memcpy', got '",
                    method, "'");
  return HostGatherMethod::kMemcpy;
}

inline void check_max_blocks(int64_t max_blocks) {
  TORCH_CHECK_VALUE(max_blocks >= 0, "gather_host_rows_: max_blocks must be >= 0 (0: no bound), got ", max_blocks);
}

// A validated gather: everything the CPU loop and the CUDA launchers need besides the pointers.
struct HostGather {
  int64_t num_rows;
  int64_t row_bytes;
  int64_t dst_row_stride_bytes;
  bool dst_rows_adjacent;  // the staging rows are back to back, so consecutive rows can share a copy
  int64_t num_runs;        // copies the memcpy method issues
  uint64_t offset_bits;    // OR of all source offsets: bounds the vector width the kernel may use
};

inline void check_host_index(const at::Tensor& index, const char* name) {
  TORCH_CHECK(index.dim() == 1, name, " must be 1-D, got ", index.dim(), "-D");
  TORCH_CHECK(index.scalar_type() == at::kLong, name, " must be int64, got ", index.scalar_type());
  TORCH_CHECK(index.device().is_cpu(), name, " must be a CPU tensor (it is read on the host), got ",
              index.device());
  TORCH_CHECK(index.is_contiguous(), name, " must be contiguous");
}

inline HostGather check_host_gather_args(const at::Tensor& dst, const at::Tensor& src, const at::Tensor& src_offsets,
                                         const at::Tensor& dst_rows) {
  check_row_matrix(dst, "dst");
  TORCH_CHECK(src.dim() == 1 && src.scalar_type() == at::kByte,
              "src must be a 1-D uint8 tensor (a HostArena's tensor()), got ", src.dim(), "-D ", src.scalar_type());
  TORCH_CHECK(src.device().is_cpu(), "src must be in host memory, got ", src.device());
  TORCH_CHECK(src.is_contiguous(), "src must be contiguous");
  check_host_index(src_offsets, "src_offsets");
  check_host_index(dst_rows, "dst_rows");
  TORCH_CHECK(src_offsets.numel() == dst_rows.numel(), "src_offsets has ", src_offsets.numel(),
              " entries but dst_rows has ", dst_rows.numel());

  const int64_t elem = dst.element_size();
  HostGather gather{};
  gather.num_rows = src_offsets.numel();
  gather.row_bytes = dst.size(1) * elem;
  gather.dst_row_stride_bytes = dst.stride(0) * elem;
  gather.dst_rows_adjacent = dst.size(0) <= 1 || gather.dst_row_stride_bytes == gather.row_bytes;
  const int64_t* offsets = src_offsets.const_data_ptr<int64_t>();
  const int64_t* rows = dst_rows.const_data_ptr<int64_t>();
  const int64_t last_offset = src.numel() - gather.row_bytes;  // the last offset whose row fits in src
  for (int64_t i = 0; i < gather.num_rows; ++i) {
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] <= last_offset, "src_offsets[", i, "] = ", offsets[i],
                ": a row of ", gather.row_bytes, " bytes there is out of range for src of ", src.numel(), " bytes");
    TORCH_CHECK(rows[i] >= 0 && rows[i] < dst.size(0), "dst_rows[", i, "] = ", rows[i], " is out of range for ",
                dst.size(0), " rows");
    gather.offset_bits |= static_cast<uint64_t>(offsets[i]);
  }
  gather.num_runs = count_row_runs(offsets, rows, gather.num_rows, gather.row_bytes, gather.dst_rows_adjacent);
  return gather;
}

}  // namespace retouch
