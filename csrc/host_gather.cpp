// gather_host_rows_ with a CPU destination: the "threaded gather" that copies template rows out of a
// HostArena on machines without a GPU.
//
// Rows that follow on in both the arena and the staging buffer (the unmasked tokens of a request come
// in long runs) are copied as one memcpy of up to 256 KiB, and those copies are spread over threads in
// tasks of >= 32 KiB as in row_copy.cpp. Measured on the 2-core dev machine (L=4096, 8 requests, m=0.2),
// one memcpy per row reached 3.5 GB/s for 1280-byte SDXL rows and 5.6 GB/s for 6 KiB Flux rows, runs
// 8.3 and 9.9 GB/s: probably because template and staging rows sit at the same offset within their pages,
// and short copies between 4 KiB-aliased addresses stall where glibc's long-copy path does not.
#include <algorithm>
#include <cstring>
#include <vector>

#include <ATen/Parallel.h>

#include "host_gather_checks.h"
#include "ops.h"

namespace retouch {
namespace {

constexpr int64_t kBytesPerTask = 32 * 1024;
constexpr int64_t kMaxCopyBytes = 256 * 1024;  // long runs are cut so that threads share them

struct Copy {
  const char* src;
  char* dst;
  int64_t bytes;
};

std::vector<Copy> coalesce_copies(const HostGather& gather, const char* src, const int64_t* offsets, char* dst,
                                  const int64_t* rows) {
  std::vector<Copy> copies;
  copies.reserve(static_cast<size_t>(gather.num_runs));
  for (int64_t i = 0; i < gather.num_rows; ++i) {
    if (i > 0 && copies.back().bytes + gather.row_bytes <= kMaxCopyBytes &&
        extends_run(offsets[i - 1], rows[i - 1], offsets[i], rows[i], gather.row_bytes, gather.dst_rows_adjacent)) {
      copies.back().bytes += gather.row_bytes;
      continue;
    }
    copies.push_back({src + offsets[i], dst + rows[i] * gather.dst_row_stride_bytes, gather.row_bytes});
  }
  return copies;
}

}  // namespace

void gather_host_rows_cpu(at::Tensor& dst, const at::Tensor& src, const at::Tensor& src_offsets,
                          const at::Tensor& dst_rows, std::string_view method, int64_t max_blocks) {
  parse_host_gather_method(method);  // validated for symmetry with CUDA; a CPU destination has one way
  check_max_blocks(max_blocks);
  TORCH_CHECK(dst.device().is_cpu(), "dst must be a CPU tensor here, got ", dst.device());
  const HostGather gather = check_host_gather_args(dst, src, src_offsets, dst_rows);
  if (gather.num_rows == 0 || gather.row_bytes == 0) return;
  const std::vector<Copy> copies = coalesce_copies(
      gather, static_cast<const char*>(src.const_data_ptr()), src_offsets.const_data_ptr<int64_t>(),
      static_cast<char*>(dst.data_ptr()), dst_rows.const_data_ptr<int64_t>());
  const int64_t num_copies = static_cast<int64_t>(copies.size());
  const int64_t mean_bytes = gather.num_rows * gather.row_bytes / num_copies;
  const int64_t grain = std::max<int64_t>(1, kBytesPerTask / std::max<int64_t>(1, mean_bytes));
  at::parallel_for(0, num_copies, grain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) std::memcpy(copies[c].dst, copies[c].src, copies[c].bytes);
  });
}

}  // namespace retouch
