// The pinned host arena that holds template activations (paper §4.2): one allocation per arena,
// sub-allocated with alignment and reference counts, so that per-block copies to the device read from
// page-locked memory and the OS never pins and unpins per request. Modelled on LMCache's
// PinMemoryAllocator. Bound to Python in torch_bindings.cpp; use it as retouch.ops.HostArena.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>

#include <ATen/core/Tensor.h>
#include <c10/macros/Export.h>

namespace retouch {

// Hidden like pybind11's namespace, which binds it (GCC warns otherwise); nothing outside retouch._C uses it.
// Copies that read the buffer asynchronously (gather_host_rows_ on a CUDA stream) must complete before
// the last owner of the buffer, this arena or a tensor() of it, is gone.
class C10_HIDDEN HostArena {
 public:
  // capacity is rounded up to alignment (a power of two >= 16). pinned=true asks for cudaHostAlloc'd
  // (portable, mapped) memory and gets page-aligned pageable memory where that is impossible: a build
  // without CUDA, no device, or a failed cudaHostAlloc. pinned() says which one it got.
  HostArena(int64_t capacity, int64_t alignment, bool pinned);

  int64_t capacity() const { return capacity_; }
  int64_t alignment() const { return alignment_; }
  bool pinned() const;
  // Bytes held by live allocations, each counted at its aligned size.
  int64_t used() const;
  int64_t largest_free() const;
  int64_t num_allocations() const;

  // Offset of a new allocation of nbytes (rounded up to alignment) with refcount 1, or -1 when no free
  // range fits: running out of space is an expected outcome for a cache (evict, then retry), not an error.
  int64_t allocate(int64_t nbytes);
  void retain(int64_t offset);
  // Drops one reference; frees the range (coalescing with free neighbours) at zero. True when freed.
  bool release(int64_t offset);
  // 0 when offset is not a live allocation.
  int64_t refcount(int64_t offset) const;
  int64_t size(int64_t offset) const;

  // uint8 [capacity] CPU tensor over the whole buffer. It shares ownership of the buffer, so the memory
  // outlives this HostArena for as long as any such tensor (or view of one) is alive.
  at::Tensor tensor() const;

 private:
  struct Buffer;
  struct Allocation {
    int64_t size;
    int64_t refcount;
  };

  Allocation& live_allocation(int64_t offset, const char* what);  // mutex_ held

  std::shared_ptr<Buffer> buffer_;
  int64_t capacity_;
  int64_t alignment_;
  mutable std::mutex mutex_;  // guards everything below
  std::map<int64_t, int64_t> free_;  // offset -> size, address-ordered so neighbours coalesce in O(log n)
  std::unordered_map<int64_t, Allocation> live_;
  int64_t used_ = 0;
};

}  // namespace retouch
