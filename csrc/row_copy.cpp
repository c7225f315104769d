// CPU ragged row gather/scatter: the reference-speed path on machines without a GPU, and the op the
// engine uses when it runs on CPU. Rows are copied with memcpy, in parallel chunks of >= 32 KiB.
#include <cstring>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "ops.h"
#include "row_copy_checks.h"

namespace retouch {
namespace {

constexpr int64_t kBytesPerTask = 32 * 1024;

template <typename Index>
void check_bounds(const Index* idx, int64_t count, int64_t num_rows) {
  // Checked before any write, so a bad index never leaves dst half-scattered.
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(idx[i] >= 0 && idx[i] < num_rows, "row_idx[", i, "] = ", static_cast<int64_t>(idx[i]),
                " is out of range for ", num_rows, " rows");
  }
}

template <typename Index>
void copy_rows(const char* src, int64_t src_stride, const Index* src_idx, char* dst, int64_t dst_stride,
               const Index* dst_idx, int64_t num_rows, int64_t row_bytes) {
  const int64_t grain = std::max<int64_t>(1, kBytesPerTask / std::max<int64_t>(1, row_bytes));
  at::parallel_for(0, num_rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = src_idx ? static_cast<int64_t>(src_idx[i]) : i;
      const int64_t d = dst_idx ? static_cast<int64_t>(dst_idx[i]) : i;
      std::memcpy(dst + d * dst_stride, src + s * src_stride, row_bytes);
    }
  });
}

}  // namespace

at::Tensor gather_rows_cpu(const at::Tensor& src, const at::Tensor& row_idx) {
  check_row_matrix(src, "src");
  check_row_index(row_idx, src);
  at::Tensor out = at::empty({row_idx.size(0), src.size(1)}, src.options());
  const int64_t elem = src.element_size();
  const int64_t row_bytes = src.size(1) * elem;
  const char* s = static_cast<const char*>(src.data_ptr());
  char* d = static_cast<char*>(out.data_ptr());
  AT_DISPATCH_INDEX_TYPES(row_idx.scalar_type(), "gather_rows_cpu", [&] {
    const index_t* idx = row_idx.data_ptr<index_t>();
    check_bounds(idx, row_idx.size(0), src.size(0));
    copy_rows<index_t>(s, src.stride(0) * elem, idx, d, row_bytes, nullptr, row_idx.size(0), row_bytes);
  });
  return out;
}

void scatter_rows_cpu(at::Tensor& dst, const at::Tensor& row_idx, const at::Tensor& src) {
  check_scatter_args(dst, row_idx, src);
  const int64_t elem = dst.element_size();
  const int64_t row_bytes = dst.size(1) * elem;
  const char* s = static_cast<const char*>(src.data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  AT_DISPATCH_INDEX_TYPES(row_idx.scalar_type(), "scatter_rows_cpu", [&] {
    const index_t* idx = row_idx.data_ptr<index_t>();
    check_bounds(idx, row_idx.size(0), dst.size(0));
    copy_rows<index_t>(s, src.stride(0) * elem, nullptr, d, dst.stride(0) * elem, idx, row_idx.size(0),
                       row_bytes);
  });
}

}  // namespace retouch
