// When consecutive rows of a host->device gather can travel as one copy. Plain C++ (no torch, no CUDA)
// so that the op's argument check (csrc/host_gather_checks.h) and the memcpy launcher
// (csrc/cuda/host_gather.cu) apply the same rule.
#pragma once

#include <cstdint>

namespace retouch {

// Row i+1 extends the run that row i ends when both its source bytes and its destination row follow on
// directly. Destination rows are adjacent in memory only when the staging buffer's row stride equals
// the row length; otherwise every row is a run of its own.
inline bool extends_run(int64_t prev_offset, int64_t prev_row, int64_t offset, int64_t row, int64_t row_bytes,
                        bool dst_rows_adjacent) {
  return dst_rows_adjacent && offset == prev_offset + row_bytes && row == prev_row + 1;
}

inline int64_t count_row_runs(const int64_t* src_offsets, const int64_t* dst_rows, int64_t num_rows,
                              int64_t row_bytes, bool dst_rows_adjacent) {
  int64_t runs = num_rows > 0 ? 1 : 0;
  for (int64_t i = 1; i < num_rows; ++i) {
    runs += !extends_run(src_offsets[i - 1], dst_rows[i - 1], src_offsets[i], dst_rows[i], row_bytes,
                         dst_rows_adjacent);
  }
  return runs;
}

}  // namespace retouch
