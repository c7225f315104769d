// The launch shape of the row-copy kernels (row_copy.cu; host_gather.cu takes its vector width): one thread
// block per row, threads striding over the row in the widest vector type (16, 8, 4, 2 or 1 bytes) that every
// address, stride and length allows, so copies are bandwidth-bound with coalesced wide accesses.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_runtime.h>

namespace retouch::cuda {

constexpr int kMaxRowThreads = 256;

// all_bits: every address, stride and length the kernel touches, OR-ed together.
inline int widest_vector_bytes(uint64_t all_bits) {
  for (int width : {16, 8, 4, 2}) {
    if (all_bits % width == 0) return width;
  }
  return 1;
}

struct RowLaunch {
  int vector_bytes;
  int64_t vecs_per_row;
  dim3 grid;
  int threads;
};

inline RowLaunch row_launch(int64_t num_rows, int64_t row_bytes, uint64_t all_bits) {
  const int width = widest_vector_bytes(all_bits);
  const int64_t vecs = row_bytes / width;
  const int threads = static_cast<int>(std::min<int64_t>(kMaxRowThreads, ((vecs + 31) / 32) * 32));
  return {width, vecs, dim3(static_cast<unsigned int>(num_rows)), threads};
}

// Calls launch(Vec{}) with the vector type of `vector_bytes`; the generic lambda launches its kernel<Vec>.
template <typename Launch>
void with_vector_type(int vector_bytes, Launch&& launch) {
  switch (vector_bytes) {
    case 16: launch(uint4{}); break;
    case 8: launch(uint2{}); break;
    case 4: launch(uint32_t{}); break;
    case 2: launch(uint16_t{}); break;
    default: launch(uint8_t{}); break;
  }
}

}  // namespace retouch::cuda
