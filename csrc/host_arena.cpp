// HostArena: one buffer, a free list of address-ordered ranges, reference-counted allocations.
//
// Fit policy: best fit (the smallest free range that holds the request, lowest address on ties).
// Template activations come in a few sizes (one per model and resolution) and live long, so the arena
// fills up with same-sized ranges; best fit keeps the large ranges whole for the largest templates,
// where first fit would nibble them down and strand capacity. The scan is O(free ranges), which is
// cheap because allocations happen per template, never per token or per block.
#include "host_arena.h"

#include <algorithm>
#include <cstdlib>
#include <iterator>

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#ifdef RETOUCH_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace retouch {
namespace {

constexpr int64_t kPageBytes = 4096;
constexpr int64_t kMaxAlignment = int64_t{1} << 30;
constexpr int64_t kMaxCapacity = int64_t{1} << 60;  // so that capacity + alignment cannot overflow

int64_t align_up(int64_t n, int64_t alignment) { return (n + alignment - 1) & ~(alignment - 1); }

}  // namespace

// The memory itself, shared by the arena and by every tensor() handed out.
struct HostArena::Buffer {
  void* raw = nullptr;   // what was allocated, for the matching free
  char* base = nullptr;  // raw rounded up to the arena's alignment
  bool pinned = false;

  Buffer(int64_t capacity, int64_t alignment, bool want_pinned) {
    // The base is page-aligned at least (O_DIRECT reads of the disk tier land in it). posix_memalign is
    // asked for that alignment itself; cudaHostAlloc promises none, and returned a base only 512-byte
    // aligned on an H200 (stop 44), so pinned memory is over-allocated and its base rounded up.
    const int64_t base_alignment = std::max(alignment, kPageBytes);
#ifdef RETOUCH_WITH_CUDA
    int devices = 0;
    if (want_pinned) {
      const size_t bytes = static_cast<size_t>(capacity + base_alignment);
      // Mapped, so that the gather kernel can read the rows in place; portable, for every device.
      if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0 &&
          cudaHostAlloc(&raw, bytes, cudaHostAllocPortable | cudaHostAllocMapped) == cudaSuccess) {
        pinned = true;
      } else {
        raw = nullptr;
        (void)cudaGetLastError();  // a failed probe must not surface as the next kernel's error
      }
    }
#else
    (void)want_pinned;
#endif
    if (raw == nullptr) {
      TORCH_CHECK(posix_memalign(&raw, static_cast<size_t>(base_alignment), static_cast<size_t>(capacity)) == 0,
                  "HostArena: cannot allocate ", capacity, " bytes of host memory");
    }
    const uintptr_t mask = static_cast<uintptr_t>(base_alignment) - 1;
    base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(raw) + mask) & ~mask);
  }

  ~Buffer() {
#ifdef RETOUCH_WITH_CUDA
    if (pinned) {
      (void)cudaFreeHost(raw);  // at interpreter exit the runtime may be gone already; nothing to do then
      return;
    }
#endif
    std::free(raw);
  }

  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

HostArena::HostArena(int64_t capacity, int64_t alignment, bool pinned) : alignment_(alignment) {
  TORCH_CHECK_VALUE(alignment >= 16 && alignment <= kMaxAlignment && (alignment & (alignment - 1)) == 0,
                    "HostArena: alignment must be a power of two in [16, 2^30], got ", alignment);
  TORCH_CHECK_VALUE(capacity >= 1 && capacity <= kMaxCapacity, "HostArena: capacity must be in [1, 2^60] bytes, got ",
                    capacity);
  capacity_ = align_up(capacity, alignment);
  buffer_ = std::make_shared<Buffer>(capacity_, alignment_, pinned);
  free_.emplace(0, capacity_);
}

bool HostArena::pinned() const { return buffer_->pinned; }

int64_t HostArena::used() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return used_;
}

int64_t HostArena::largest_free() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t largest = 0;
  for (const auto& [offset, size] : free_) largest = std::max(largest, size);
  return largest;
}

int64_t HostArena::num_allocations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(live_.size());
}

int64_t HostArena::allocate(int64_t nbytes) {
  TORCH_CHECK_VALUE(nbytes >= 1, "HostArena.allocate: nbytes must be >= 1, got ", nbytes);
  if (nbytes > capacity_) return -1;
  const int64_t size = align_up(nbytes, alignment_);
  std::lock_guard<std::mutex> lock(mutex_);
  auto best = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second >= size && (best == free_.end() || it->second < best->second)) {
      best = it;
      if (it->second == size) break;
    }
  }
  if (best == free_.end()) return -1;
  const int64_t offset = best->first;
  const int64_t rest = best->second - size;
  free_.erase(best);
  if (rest > 0) free_.emplace(offset + size, rest);
  live_.emplace(offset, Allocation{size, 1});
  used_ += size;
  return offset;
}

HostArena::Allocation& HostArena::live_allocation(int64_t offset, const char* what) {
  auto it = live_.find(offset);
  TORCH_CHECK(it != live_.end(), "HostArena.", what, ": offset ", offset,
              " is not a live allocation (never allocated, or already freed)");
  return it->second;
}

void HostArena::retain(int64_t offset) {
  std::lock_guard<std::mutex> lock(mutex_);
  live_allocation(offset, "retain").refcount += 1;
}

bool HostArena::release(int64_t offset) {
  std::lock_guard<std::mutex> lock(mutex_);
  Allocation& allocation = live_allocation(offset, "release");
  if (--allocation.refcount > 0) return false;
  int64_t start = offset;
  int64_t size = allocation.size;
  used_ -= size;
  live_.erase(offset);
  // Coalesce with the free range that ends where this one starts and with the one that starts where it
  // ends, so that freeing every allocation always restores one capacity-sized range.
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && next->first == offset + size) {
    size += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      start = prev->first;
      size += prev->second;
      free_.erase(prev);
    }
  }
  free_.emplace(start, size);
  return true;
}

int64_t HostArena::refcount(int64_t offset) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(offset);
  return it == live_.end() ? 0 : it->second.refcount;
}

int64_t HostArena::size(int64_t offset) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(offset);
  TORCH_CHECK(it != live_.end(), "HostArena.size: offset ", offset, " is not a live allocation");
  return it->second.size;
}

at::Tensor HostArena::tensor() const {
  std::shared_ptr<Buffer> owner = buffer_;
  return at::from_blob(
      owner->base, {capacity_}, [owner](void*) mutable { owner.reset(); },
      at::TensorOptions().dtype(at::kByte).device(at::kCPU));
}

}  // namespace retouch
