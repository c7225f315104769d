// Declarations of every native op. Each is registered once, with its schema, in torch_bindings.cpp.
#pragma once

#include <optional>
#include <string_view>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace retouch {

// out[i] = src[row_idx[i]]. src: [N, H] with unit stride along H; row_idx: [T] int32/int64.
at::Tensor gather_rows_cpu(const at::Tensor& src, const at::Tensor& row_idx);
// dst[row_idx[i]] = src[i]. dst: [N, H]; src: [T, H]; indices unique.
void scatter_rows_cpu(at::Tensor& dst, const at::Tensor& row_idx, const at::Tensor& src);
// dst[dst_rows[i]] (as bytes) = src[src_offsets[i] : + row_bytes]. dst: [N, H] (row_bytes = H * element
// size); src: uint8 [capacity] host memory (a HostArena); src_offsets, dst_rows: [n] int64 on the CPU.
// method: "auto" | "kernel" | "memcpy" (how a CUDA dst is filled; a CPU dst has one way); max_blocks > 0
// bounds the kernel's grid (0: as many blocks as the work needs).
void gather_host_rows_cpu(at::Tensor& dst, const at::Tensor& src, const at::Tensor& src_offsets,
                          const at::Tensor& dst_rows, std::string_view method, int64_t max_blocks);

// Composite ops of the mask-aware blocks (block_ops.cpp), any device.
// diffusers' Flux RoPE on pairs: x: [..., S, heads, d]; cos, sin: [S, d] (fp32) -> x's shape and dtype.
at::Tensor rope_pairs(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor rope_pairs_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// torch.rms_norm over the last dimension, then (given tables) rope_pairs: the q/k norms of attention.
at::Tensor rms_norm_rope(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps,
                         const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin);
at::Tensor rms_norm_rope_cpu(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps,
                             const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin);
// Each request's queries against its keys by SDPA. q: [T_q, heads, d]; k, v: [T_k, heads, d]; lengths:
// [B] int64 CPU tensors (a planned forward's), so nothing is read back from the device.
at::Tensor sdpa_ragged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lengths_q,
                       const at::Tensor& lengths_k, double scale);

#ifdef RETOUCH_WITH_CUDA
at::Tensor gather_rows_cuda(const at::Tensor& src, const at::Tensor& row_idx);
void scatter_rows_cuda(at::Tensor& dst, const at::Tensor& row_idx, const at::Tensor& src);
void gather_host_rows_cuda(at::Tensor& dst, const at::Tensor& src, const at::Tensor& src_offsets,
                           const at::Tensor& dst_rows, std::string_view method, int64_t max_blocks);
#endif

}  // namespace retouch
