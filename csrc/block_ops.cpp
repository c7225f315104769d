// Ops of the mask-aware blocks: each replaces a chain of small tensor ops that the blocks issued one by
// one from Python (host overhead per op), with the same math. The composites are built from ATen ops,
// so they serve every device (CompositeExplicitAutograd); rope_pairs and rms_norm_rope have one-pass CPU
// kernels here, and a Triton one on CUDA (kernels/norm_rope.py, registered in retouch/ops.py).
// References: kernels/reference.py (rope_pairs_ref, rms_norm_rope_ref, sdpa_ragged_ref).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "ops.h"

namespace retouch {

namespace {

void check_rope_inputs(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() >= 3, "rope_pairs: x must be [..., S, heads, head_dim], got ", x.sizes());
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes(), "rope_pairs: cos and sin must be [S, head_dim], got ",
              cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(cos.size(0) == x.size(-3) && cos.size(1) == x.size(-1), "rope_pairs: tables ", cos.sizes(),
              " do not match x ", x.sizes(), " (S = dim -3, head_dim = dim -1)");
  TORCH_CHECK(x.size(-1) % 2 == 0, "rope_pairs: head_dim must be even, got ", x.size(-1));
  TORCH_CHECK(x.device() == cos.device() && x.device() == sin.device(), "rope_pairs: x, cos and sin must share a device");
}

// One pass over x: each (2i, 2i+1) pair rotates in fp32, each product rounded as the reference's
// separate tensor ops round it (the build does not contract them into FMAs: -ffp-contract=off).
template <typename scalar_t>
void rope_pairs_loop(const scalar_t* x, const float* cos, const float* sin, scalar_t* out, int64_t outer,
                     int64_t seq, int64_t heads, int64_t dim) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, heads * dim));
  at::parallel_for(0, outer * seq, grain, [&](int64_t begin, int64_t end) {
    for (int64_t token = begin; token < end; ++token) {
      const float* c = cos + (token % seq) * dim;
      const float* s = sin + (token % seq) * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* xi = x + (token * heads + h) * dim;
        scalar_t* oi = out + (token * heads + h) * dim;
        for (int64_t i = 0; i < dim; i += 2) {
          const float x0 = static_cast<float>(xi[i]), x1 = static_cast<float>(xi[i + 1]);
          oi[i] = static_cast<scalar_t>(x0 * c[i] + (-x1) * s[i]);
          oi[i + 1] = static_cast<scalar_t>(x1 * c[i + 1] + x0 * s[i + 1]);
        }
      }
    }
  });
}

// One pass per (token, head) row: RMSNorm in fp32, rounded to x's dtype as torch.rms_norm's output is,
// then (with tables) RoPE on the rounded values, as the two separate ops compute them.
template <typename scalar_t>
void rms_norm_rope_loop(const scalar_t* x, const scalar_t* weight, float eps, const float* cos, const float* sin,
                        scalar_t* out, int64_t rows, int64_t seq, int64_t heads, int64_t dim) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, dim));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> normed(dim);
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* xi = x + row * dim;
      scalar_t* oi = out + row * dim;
      float squares = 0.f;
      for (int64_t i = 0; i < dim; ++i) {
        const float v = static_cast<float>(xi[i]);
        squares += v * v;
      }
      const float rstd = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
      for (int64_t i = 0; i < dim; ++i) {
        float v = static_cast<float>(xi[i]) * rstd;
        if (weight != nullptr) v = v * static_cast<float>(weight[i]);
        normed[i] = static_cast<float>(static_cast<scalar_t>(v));
      }
      if (cos == nullptr) {
        for (int64_t i = 0; i < dim; ++i) oi[i] = static_cast<scalar_t>(normed[i]);
        continue;
      }
      const int64_t position = (row / heads) % seq;
      const float* c = cos + position * dim;
      const float* s = sin + position * dim;
      for (int64_t i = 0; i < dim; i += 2) {
        const float x0 = normed[i], x1 = normed[i + 1];
        oi[i] = static_cast<scalar_t>(x0 * c[i] + (-x1) * s[i]);
        oi[i + 1] = static_cast<scalar_t>(x1 * c[i + 1] + x0 * s[i + 1]);
      }
    }
  });
}

void check_norm_inputs(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                       const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin) {
  TORCH_CHECK(x.dim() >= 1, "rms_norm_rope: x must have a last (normalised) dimension");
  TORCH_CHECK(!weight.has_value() || (weight->dim() == 1 && weight->size(0) == x.size(-1)),
              "rms_norm_rope: weight must be [", x.size(-1), "]");
  TORCH_CHECK(cos.has_value() == sin.has_value(), "rms_norm_rope: give both cos and sin, or neither");
  if (cos.has_value()) check_rope_inputs(x, *cos, *sin);
}

}  // namespace

at::Tensor rms_norm_rope(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps,
                         const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin) {
  check_norm_inputs(x, weight, cos, sin);
  const auto normed = at::rms_norm(x, {x.size(-1)}, weight, eps);
  return cos.has_value() ? rope_pairs(normed, *cos, *sin) : normed;
}

at::Tensor rms_norm_rope_cpu(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps,
                             const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin) {
  check_norm_inputs(x, weight, cos, sin);
  const bool fp32_tables = !cos.has_value() || (cos->scalar_type() == at::kFloat && sin->scalar_type() == at::kFloat);
  if (!fp32_tables || (weight.has_value() && weight->scalar_type() != x.scalar_type()) ||
      x.scalar_type() == at::kDouble) {
    return rms_norm_rope(x, weight, eps, cos, sin);  // mixed dtypes, fp64: the composite's arithmetic
  }
  const auto xc = x.contiguous();
  const auto wc = weight.has_value() ? weight->contiguous() : at::Tensor();
  const auto cc = cos.has_value() ? cos->contiguous() : at::Tensor();
  const auto sc = sin.has_value() ? sin->contiguous() : at::Tensor();
  auto out = at::empty_like(xc, at::MemoryFormat::Contiguous);
  const int64_t dim = x.size(-1);
  const int64_t rows = dim == 0 ? 0 : x.numel() / dim;
  const int64_t heads = cos.has_value() ? x.size(-2) : 1, seq = cos.has_value() ? x.size(-3) : 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_rope_cpu", [&] {
    rms_norm_rope_loop<scalar_t>(xc.const_data_ptr<scalar_t>(), wc.defined() ? wc.const_data_ptr<scalar_t>() : nullptr,
                                 static_cast<float>(eps), cc.defined() ? cc.const_data_ptr<float>() : nullptr,
                                 sc.defined() ? sc.const_data_ptr<float>() : nullptr, out.mutable_data_ptr<scalar_t>(),
                                 rows, seq, heads, dim);
  });
  return out;
}

at::Tensor rope_pairs(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rope_inputs(x, cos, sin);
  // diffusers' apply_rotary_emb (use_real, unbind_dim -1): pairs (2i, 2i+1) rotate as complex numbers.
  const auto pairs = x.unflatten(-1, {-1, 2});
  const auto rotated = at::stack({pairs.select(-1, 1).neg(), pairs.select(-1, 0)}, -1).flatten(-2);
  const auto c = cos.unsqueeze(-2);
  const auto s = sin.unsqueeze(-2);
  return (x.to(at::kFloat) * c + rotated.to(at::kFloat) * s).to(x.scalar_type());
}

at::Tensor rope_pairs_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rope_inputs(x, cos, sin);
  if (cos.scalar_type() != at::kFloat || sin.scalar_type() != at::kFloat) {
    return rope_pairs(x, cos, sin);  // the tables Flux builds are fp32; others take the composite
  }
  const auto xc = x.contiguous();
  const auto cc = cos.contiguous(), sc = sin.contiguous();
  auto out = at::empty_like(xc, at::MemoryFormat::Contiguous);
  const int64_t dim = x.size(-1), heads = x.size(-2), seq = x.size(-3);
  const int64_t outer = seq * heads * dim == 0 ? 0 : x.numel() / (seq * heads * dim);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_pairs_cpu", [&] {
    rope_pairs_loop<scalar_t>(xc.const_data_ptr<scalar_t>(), cc.const_data_ptr<float>(), sc.const_data_ptr<float>(),
                              out.mutable_data_ptr<scalar_t>(), outer, seq, heads, dim);
  });
  return out;
}

at::Tensor sdpa_ragged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lengths_q_t,
                       const at::Tensor& lengths_k_t, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(),
              "sdpa_ragged: q must be [T_q, heads, d] and k, v [T_k, heads, d]");
  for (const auto* lengths : {&lengths_q_t, &lengths_k_t}) {
    // Host memory: reading it is no device sync, and under torch.compile the lengths stay graph inputs
    // (a new batch composition is new data, not a new graph).
    TORCH_CHECK(lengths->device().is_cpu() && lengths->scalar_type() == at::kLong && lengths->dim() == 1,
                "sdpa_ragged: lengths must be 1-D int64 CPU tensors");
  }
  const auto lq = lengths_q_t.contiguous(), lk = lengths_k_t.contiguous();
  const at::IntArrayRef lengths_q(lq.data_ptr<int64_t>(), lq.numel());
  const at::IntArrayRef lengths_k(lk.data_ptr<int64_t>(), lk.numel());
  TORCH_CHECK(lengths_q.size() == lengths_k.size() && !lengths_q.empty(),
              "sdpa_ragged: lengths_q and lengths_k must describe the same requests");
  int64_t total_q = 0, total_k = 0;
  for (size_t b = 0; b < lengths_q.size(); ++b) {
    TORCH_CHECK(lengths_q[b] >= 0 && lengths_k[b] >= 0, "sdpa_ragged: lengths must be >= 0");
    total_q += lengths_q[b];
    total_k += lengths_k[b];
  }
  TORCH_CHECK(total_q == q.size(0) && total_k == k.size(0), "sdpa_ragged: lengths sum to ", total_q, " queries and ",
              total_k, " keys, the tensors have ", q.size(0), " and ", k.size(0));
  std::vector<at::Tensor> outputs;
  outputs.reserve(lengths_q.size());
  int64_t q0 = 0, k0 = 0;
  for (size_t b = 0; b < lengths_q.size(); ++b) {
    const int64_t nq = lengths_q[b], nk = lengths_k[b];
    const auto qb = q.narrow(0, q0, nq);
    if (nk == 0) {
      outputs.push_back(at::zeros_like(qb));  // an empty softmax is defined as zeros
    } else if (nq > 0) {
      // [1, heads, n, d]: the fused CPU (flash) kernel takes 4-D inputs only.
      const auto kb = k.narrow(0, k0, nk), vb = v.narrow(0, k0, nk);
      const auto out = at::scaled_dot_product_attention(qb.transpose(0, 1).unsqueeze(0), kb.transpose(0, 1).unsqueeze(0),
                                                        vb.transpose(0, 1).unsqueeze(0), std::nullopt, 0.0, false, scale);
      outputs.push_back(out.squeeze(0).transpose(0, 1));
    } else {
      outputs.push_back(qb);
    }
    q0 += nq;
    k0 += nk;
  }
  return outputs.size() == 1 ? outputs[0].contiguous() : at::cat(outputs);
}

}  // namespace retouch
