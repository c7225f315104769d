"""Ragged (varlen) attention for mask-aware editing: each request's masked tokens attend to all of
that request's tokens.

Layout follows flash-attn's varlen convention. The batch is packed without padding:

    q: [T_q, heads, head_dim]   queries of all requests, request b at rows cu_seqlens_q[b]:cu_seqlens_q[b+1]
    k, v: [T_k, heads, head_dim] keys/values, request b at rows cu_seqlens_k[b]:cu_seqlens_k[b+1]
    cu_seqlens_q, cu_seqlens_k: [B+1] int32 prefix sums starting at 0

Non-causal; softmax in fp32; output in q's dtype. A request with no queries has nothing to compute; a
request with queries but no keys gets zeros (an empty softmax has no defined value, and zeros are
what the online softmax yields when its normaliser is 0).

Three implementations with the same semantics:
- `ragged_attention`: the Triton kernel (GPU, or CPU under TRITON_INTERPRET=1).
- `ragged_attention_ref`: the oracle, explicit softmax per request in fp32 (or fp64 for fp64 input).
- `ragged_attention_sdpa`: the practical CPU path, torch SDPA per request in the input dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# Block defaults for Hopper-class GPUs, within the configurations of Triton's fused-attention
# tutorial; not tuned yet (GPU tuning happens in the GPU issue). The wrapper's arguments override them.
DEFAULT_BLOCK_M = 128  # query rows per program
DEFAULT_BLOCK_N = 64  # key rows per inner-loop step
DEFAULT_NUM_WARPS = 8
DEFAULT_NUM_STAGES = 2

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOG2E = 1.4426950408889634


@triton.jit
def ragged_attention_kernel(
    q_ptr,  # [T_q, heads, head_dim] packed queries
    k_ptr,  # [T_k, heads, head_dim] packed keys
    v_ptr,  # [T_k, heads, head_dim] packed values
    out_ptr,  # [T_q, heads, head_dim] output, dtype of q
    cu_seqlens_q_ptr,  # [B+1] int32, query row range of each request
    cu_seqlens_k_ptr,  # [B+1] int32, key row range of each request
    block_request_ptr,  # [num_programs] int32, request of each query block; >= num_requests: spare program
    block_in_request_ptr,  # [num_programs] int32, index of the query block within its request
    num_requests,  # B
    head_dim,  # true head size; BLOCK_D is it rounded up to a power of two
    qk_scale,  # softmax_scale * log2(e): the softmax runs on exp2
    stride_qt, stride_qh,  # q strides (elements) along tokens and heads; head_dim is unit stride
    stride_kt, stride_kh,  # k strides
    stride_vt, stride_vh,  # v strides
    stride_ot, stride_oh,  # out strides
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # key rows per inner-loop step
    BLOCK_D: tl.constexpr,  # next power of two >= head_dim (>= 16 for tl.dot)
    DOT_PRECISION: tl.constexpr,  # "ieee": fp32 inputs keep 24 mantissa bits, not TF32's 11; ignored for 16-bit
    UPCAST_OPERANDS: tl.constexpr,  # compute dots in fp32 on 16-bit-rounded values (interpreter has no bf16 dot)
):
    block_id = tl.program_id(0)
    head = tl.program_id(1)

    # The grid is sized from T_q and B without reading cu_seqlens (no host sync), so a few programs
    # may have no block; the map marks them with request index B.
    request = tl.load(block_request_ptr + block_id)
    if request >= num_requests:
        return
    block_in_request = tl.load(block_in_request_ptr + block_id)
    q_end = tl.load(cu_seqlens_q_ptr + request + 1)
    k_start = tl.load(cu_seqlens_k_ptr + request)
    k_end = tl.load(cu_seqlens_k_ptr + request + 1)

    # Token offsets in int64: T * heads * head_dim overflows int32 for large packed batches.
    offs_m = (tl.load(cu_seqlens_q_ptr + request) + block_in_request * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_in_bounds = offs_m < q_end
    dim_in_bounds = offs_d < head_dim

    q_ptrs = q_ptr + offs_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_in_bounds[:, None] & dim_in_bounds[None, :], other=0.0)
    if UPCAST_OPERANDS:
        q = q.to(tl.float32)

    # Online softmax state (flash-attention 2): running max, running sum, unnormalised output.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    for start_n in range(k_start, k_end, BLOCK_N):
        key_rows = (start_n + offs_n).to(tl.int64)
        key_in_bounds = key_rows < k_end
        kv_mask = key_in_bounds[:, None] & dim_in_bounds[None, :]
        k = tl.load(k_ptr + key_rows[:, None] * stride_kt + head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + key_rows[:, None] * stride_vt + head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST_OPERANDS:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        # Every step holds at least one key in bounds, so each row's max stays finite.
        scores = tl.where(key_in_bounds[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.math.exp2(scores - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # P is rounded to the input dtype for the second matmul, as flash-attention does.
        p = p.to(v_ptr.dtype.element_ty)
        if UPCAST_OPERANDS:
            p = p.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    # l_i == 0 only when the request has no keys: acc is 0 there and the defined result is zeros.
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    out_ptrs = out_ptr + offs_m[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_in_bounds[:, None] & dim_in_bounds[None, :])


# triton.jit picks the interpreter when the kernel is defined (TRITON_INTERPRET=1 at import time),
# so ask the kernel object rather than the environment, which may have changed since.
KERNEL_INTERPRETED = isinstance(ragged_attention_kernel, InterpretedFunction)


def _check_packed(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {tuple(x.shape)}")


def _check_cu_seqlens(name: str, cu_seqlens: torch.Tensor, total: int, tokens_name: str) -> list[int]:
    """Shape/dtype checks, then the contents (copied to the host: one small sync on a GPU)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"{name} must be int32 (flash-attn varlen convention), got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be [B+1] with B >= 1, got shape {tuple(cu_seqlens.shape)}")
    values = cu_seqlens.tolist()
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    if any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {values}")
    if values[-1] != total:
        raise ValueError(f"{name} must end at {tokens_name} = {total}, got {values[-1]}")
    return values


def check_ragged_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_k: torch.Tensor) -> tuple[list[int], list[int]]:
    """Validate the packed layout; returns cu_seqlens_q and cu_seqlens_k as host lists.

    Raises ValueError with a message that names the offending argument.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_packed(name, x)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[1:] != k.shape[1:]:
        raise ValueError(f"q and k must agree on [heads, head_dim], got {tuple(q.shape[1:])} and {tuple(k.shape[1:])}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.is_floating_point():
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}")
    devices = {x.device for x in (q, k, v, cu_seqlens_q, cu_seqlens_k) if isinstance(x, torch.Tensor)}
    if len(devices) > 1:
        raise ValueError(f"q, k, v, cu_seqlens_q, cu_seqlens_k must be on one device, got {sorted(map(str, devices))}")
    cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], "T_q")
    cu_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], "T_k")
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of requests, "
                         f"got {len(cu_q) - 1} and {len(cu_k) - 1}")
    return cu_q, cu_k


def _default_scale(head_dim: int, softmax_scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def query_block_map(cu_seqlens_q: torch.Tensor, total_q: int, block_m: int,
                    max_seqlen_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Map each program to (request, query block within the request); blocks never straddle requests.

    `cu_seqlens_q: [B+1]` -> `block_request, block_in_request: [P]` int32 on the same device. P is an
    upper bound computed without reading cu_seqlens (each request wastes at most one partial block),
    so building the map needs no device-to-host sync; spare programs get request index B.
    """
    num_requests = cu_seqlens_q.numel() - 1
    num_programs = min(triton.cdiv(total_q, block_m) + num_requests, num_requests * triton.cdiv(max_seqlen_q, block_m))
    seqlens_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    blocks_per_request = (seqlens_q + block_m - 1) // block_m
    block_ends = torch.cumsum(blocks_per_request, 0)  # inclusive prefix sum of blocks
    program = torch.arange(num_programs, device=cu_seqlens_q.device)
    block_request = torch.searchsorted(block_ends, program, right=True)
    first_block = (block_ends - blocks_per_request)[block_request.clamp(max=num_requests - 1)]
    return block_request.to(torch.int32), (program - first_block).to(torch.int32)


def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     softmax_scale: float | None = None, *, block_m: int = DEFAULT_BLOCK_M,
                     block_n: int = DEFAULT_BLOCK_N, num_warps: int = DEFAULT_NUM_WARPS,
                     num_stages: int = DEFAULT_NUM_STAGES) -> torch.Tensor:
    """Ragged attention with the Triton kernel.

    `q: [T_q, heads, head_dim]`, `k, v: [T_k, heads, head_dim]`, `cu_seqlens_q, cu_seqlens_k: [B+1]`
    int32 -> `[T_q, heads, head_dim]` in q's dtype. `max_seqlen_q` bounds the grid and must be at
    least the longest query run; `max_seqlen_k` is checked and kept for flash-attn API parity.
    fp32 / bf16 / fp16; head_dim of any size (padded to a power of two inside the kernel).

    The contents of cu_seqlens are validated on the host (one small sync on a GPU).
    """
    cu_q, cu_k = check_ragged_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"ragged_attention supports {[str(d) for d in _SUPPORTED_DTYPES]}, got {q.dtype}")
    longest_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    longest_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
    if max_seqlen_q < longest_q:
        raise ValueError(f"max_seqlen_q = {max_seqlen_q} is below the longest query run {longest_q}")
    if max_seqlen_k < longest_k:
        raise ValueError(f"max_seqlen_k = {max_seqlen_k} is below the longest key run {longest_k}")
    for name, block in (("block_m", block_m), ("block_n", block_n)):
        if block < 16 or block & (block - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot minimum), got {block}")
    if q.device.type != "cuda" and not KERNEL_INTERPRETED:
        raise ValueError(f"the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 for CPU), got {q.device}; "
                         "use ragged_attention_sdpa on the CPU")

    total_q, heads, head_dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if total_q == 0 or heads == 0:
        return out
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    block_request, block_in_request = query_block_map(cu_seqlens_q, total_q, block_m, max_seqlen_q)
    grid = (block_request.numel(), heads)
    ragged_attention_kernel[grid](
        q, k, v, out, cu_seqlens_q, cu_seqlens_k, block_request, block_in_request,
        len(cu_q) - 1, head_dim, _default_scale(head_dim, softmax_scale) * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION="ieee",
        # Under the interpreter bf16 is stored as uint16 and tl.dot multiplies the bit patterns
        # (triton-lang/triton#11584, unsupported upstream); fp32 dots on bf16 values are exact products.
        UPCAST_OPERANDS=KERNEL_INTERPRETED and q.dtype == torch.bfloat16,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def ragged_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, softmax_scale: float | None = None, *,
                         upcast: bool = True) -> torch.Tensor:
    """The oracle: explicit softmax per request. Same shapes and semantics as `ragged_attention`.

    With `upcast` (default) the math runs in fp32 (fp64 stays fp64); with `upcast=False` it runs in
    the input dtype, which is the "plain PyTorch in low precision" baseline of the test tolerances.
    """
    cu_q, cu_k = check_ragged_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    compute_dtype = torch.promote_types(q.dtype, torch.float32) if upcast else q.dtype
    scale = _default_scale(q.shape[-1], softmax_scale)
    out = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    for b in range(len(cu_q) - 1):
        (q0, q1), (k0, k1) = (cu_q[b], cu_q[b + 1]), (cu_k[b], cu_k[b + 1])
        if q1 == q0 or k1 == k0:
            continue  # nothing to compute, or no keys: zeros by definition
        qb, kb, vb = (x.to(compute_dtype).transpose(0, 1) for x in (q[q0:q1], k[k0:k1], v[k0:k1]))  # [H, n, D]
        scores = (qb @ kb.transpose(1, 2)) * scale
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = (probs @ vb).transpose(0, 1)
    return out.to(q.dtype)


def ragged_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, softmax_scale: float | None = None) -> torch.Tensor:
    """Practical path without Triton: torch SDPA per request, in the input dtype.

    Same shapes and semantics as `ragged_attention`; one SDPA call per request with queries.
    """
    cu_q, cu_k = check_ragged_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    scale = _default_scale(q.shape[-1], softmax_scale)
    out = torch.zeros_like(q)
    for b in range(len(cu_q) - 1):
        (q0, q1), (k0, k1) = (cu_q[b], cu_q[b + 1]), (cu_k[b], cu_k[b + 1])
        if q1 == q0 or k1 == k0:
            continue
        # [1, H, n, D]: SDPA's fused CPU (flash) kernel takes only 4-D inputs; 3-D ones fall back to
        # the unfused math path, measured 2x slower on flux-small.
        qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q[q0:q1], k[k0:k1], v[k0:k1]))
        out[q0:q1] = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, scale=scale)[0].transpose(0, 1)
    return out
