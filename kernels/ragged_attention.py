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

How the kernel is launched:
- `LaunchConfig`: block sizes, warps and pipeline stages. `launch_config` picks one from a table for
  Hopper (bf16/fp16, head_dim 64 and 128) and falls back to `DEFAULT_LAUNCH_CONFIG` elsewhere.
- `RaggedAttentionTuner` (opt-in): on CUDA, times a candidate set once per `TuningKey` and keeps the
  winner; under the interpreter it times nothing and answers the table's config.
- `RaggedPlan` (`plan_ragged_attention`): a batch's validated cu_seqlens with the query block map of
  one config. `ragged_attention` builds one per call (a host sync, a few small kernels);
  `ragged_attention_with_plan` reuses one across calls over the same batch (every layer of a step).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import triton
import triton.language as tl
import triton.testing
from triton.compiler.errors import CompileTimeAssertionFailure
from triton.runtime.errors import OutOfResources, PTXASError
from triton.runtime.interpreter import InterpretedFunction

from retouch.kernels.devices import check_triton_device
from retouch.kernels.reference import sdpa_ragged_ref

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOG2E = 1.4426950408889634


# Triton makes an int argument equal to 1 a constant: without the exemption a single request would
# compile a second kernel (and tuning one more set) for no gain.
@triton.jit(do_not_specialize=["num_requests"])
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
        # Accumulating inside the dot (as Triton's fused-attention tutorial does) lets Hopper's wgmma add
        # into acc in place instead of a separate pass over the [BLOCK_M, BLOCK_D] accumulator.
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    # l_i == 0 only when the request has no keys: acc is 0 there and the defined result is zeros.
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    out_ptrs = out_ptr + offs_m[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_in_bounds[:, None] & dim_in_bounds[None, :])


# triton.jit picks the interpreter when the kernel is defined (TRITON_INTERPRET=1 at import time),
# so ask the kernel object rather than the environment, which may have changed since.
KERNEL_INTERPRETED = isinstance(ragged_attention_kernel, InterpretedFunction)


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchConfig:
    """How the kernel is launched: query rows per program, key rows per inner-loop step, and Triton's
    warps per program and software-pipeline stages."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            block = getattr(self, name)
            if block < 16 or block & (block - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot minimum), got {block}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps must be a power of two, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")

    @property
    def name(self) -> str:
        return f"m{self.block_m}_n{self.block_n}_w{self.num_warps}_s{self.num_stages}"


# Where the table has no entry (other GPUs, other head sizes, fp32, the interpreter): the tutorial's
# 128 x 64 tiles, 8 warps so that a 128-row fp32 accumulator fits in registers up to head_dim 128.
DEFAULT_LAUNCH_CONFIG = LaunchConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)

# Hopper (sm_90), bf16/fp16, by head_dim: measured on an H200 (bench/results/h200/attention.json, stop 44).
# RaggedAttentionTuner timed the whole space (TUNING_CANDIDATES) at 19 layouts from 64 to 4096 queries
# per request; 64 x 64 tiles, 4 warps, 3 stages won 10 of them outright and stayed within 2% of the
# winner at the largest (head_dim 128, 2048-4096 queries: 128 x 64 with 8 warps wins there). The entries
# picked before any GPU run (128 x 64, 3 stages, 4 or 8 warps) were 1.2-1.9x the winner's time at every
# head_dim 64 layout and at head_dim 128 up to 1024 queries.
HOPPER_LAUNCH_CONFIGS = {
    64: LaunchConfig(block_m=64, block_n=64, num_warps=4, num_stages=3),
    128: LaunchConfig(block_m=64, block_n=64, num_warps=4, num_stages=3),
}
_TABLE_DTYPES = (torch.bfloat16, torch.float16)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """CUDA compute capability of `device`; None for any other device."""
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


def launch_config(head_dim: int, dtype: torch.dtype, capability: tuple[int, int] | None) -> LaunchConfig:
    """The table's entry on Hopper for 16-bit inputs at a listed head_dim, else DEFAULT_LAUNCH_CONFIG."""
    if capability is not None and capability[0] == 9 and dtype in _TABLE_DTYPES and head_dim in HOPPER_LAUNCH_CONFIGS:
        return HOPPER_LAUNCH_CONFIGS[head_dim]
    return DEFAULT_LAUNCH_CONFIG


def _check_packed(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {tuple(x.shape)}")


def _check_cu_seqlens(name: str, cu_seqlens: torch.Tensor, total: int | None, tokens_name: str) -> list[int]:
    """Shape/dtype checks, then the contents (copied to the host: one small sync on a GPU).

    `total`: the row count the last entry must equal; None where the tensors are not known yet (a plan)."""
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
    if total is not None and values[-1] != total:
        raise ValueError(f"{name} must end at {tokens_name} = {total}, got {values[-1]}")
    return values


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
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


def _check_one_device(**tensors: torch.Tensor) -> None:
    devices = {x.device for x in tensors.values() if isinstance(x, torch.Tensor)}
    if len(devices) > 1:
        raise ValueError(f"{', '.join(tensors)} must be on one device, got {sorted(map(str, devices))}")


def check_ragged_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_k: torch.Tensor) -> tuple[list[int], list[int]]:
    """Validate the packed layout; returns cu_seqlens_q and cu_seqlens_k as host lists.

    Raises ValueError with a message that names the offending argument.
    """
    _check_qkv(q, k, v)
    _check_one_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], "T_q")
    cu_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], "T_k")
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of requests, "
                         f"got {len(cu_q) - 1} and {len(cu_k) - 1}")
    return cu_q, cu_k


def _check_kernel_inputs(q: torch.Tensor) -> None:
    """What the Triton kernel adds to the layout checks: its dtypes, and a device it can run on."""
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"ragged_attention supports {[str(d) for d in _SUPPORTED_DTYPES]}, got {q.dtype}")
    check_triton_device(ragged_attention_kernel, "ragged_attention", q, hint="; use ragged_attention_sdpa on the CPU")


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


@dataclasses.dataclass(frozen=True, slots=True)
class RaggedPlan:
    """A batch's packed layout, validated, with the query block map of one launch config.

    Built once per batch by `plan_ragged_attention` and reused by every attention call over that batch
    (all layers of a denoising step): `ragged_attention_with_plan` then checks only shapes, dtypes and
    devices, with no host sync and no block-map kernels per call.
    """

    cu_seqlens_q: torch.Tensor  # [B+1] int32
    cu_seqlens_k: torch.Tensor  # [B+1] int32
    total_q: int  # T_q
    total_k: int  # T_k
    config: LaunchConfig
    block_request: torch.Tensor  # [P] int32, see query_block_map
    block_in_request: torch.Tensor  # [P] int32

    @property
    def num_requests(self) -> int:
        return self.cu_seqlens_q.numel() - 1


def plan_from_host(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, cu_q: list[int], cu_k: list[int],
                   max_seqlen_q: int, max_seqlen_k: int, config: LaunchConfig) -> RaggedPlan:
    """The plan of `cu_seqlens_q, cu_seqlens_k` (on the device) from their host copies `cu_q, cu_k`, which
    the caller vouches for: nothing is read back from the device."""
    longest_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    longest_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
    if max_seqlen_q < longest_q:
        raise ValueError(f"max_seqlen_q = {max_seqlen_q} is below the longest query run {longest_q}")
    if max_seqlen_k < longest_k:
        raise ValueError(f"max_seqlen_k = {max_seqlen_k} is below the longest key run {longest_k}")
    block_request, block_in_request = query_block_map(cu_seqlens_q, cu_q[-1], config.block_m, max_seqlen_q)
    return RaggedPlan(cu_seqlens_q, cu_seqlens_k, cu_q[-1], cu_k[-1], config, block_request, block_in_request)


def plan_from_shapes(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int,
                     config: LaunchConfig) -> RaggedPlan:
    """The plan of a layout known only on the device, bounded by its totals: no request is longer than
    `total_q`, so the block map needs nothing read back (what a compiled or captured block builds; its
    spare programs return at once)."""
    block_request, block_in_request = query_block_map(cu_seqlens_q, total_q, config.block_m, max(total_q, 1))
    return RaggedPlan(cu_seqlens_q, cu_seqlens_k, total_q, total_k, config, block_request, block_in_request)


def launch_planned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RaggedPlan,
                   softmax_scale: float | None) -> torch.Tensor:
    """The kernel over a plan, with no checks at all (inside a traced op, whose fake has checked shapes)."""
    return _launch(q, k, v, plan, softmax_scale)


def plan_ragged_attention(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                          max_seqlen_k: int, config: LaunchConfig) -> RaggedPlan:
    """Validate `cu_seqlens_q, cu_seqlens_k: [B+1]` int32 (one host sync on a GPU) and build the query
    block map of `config` (from `launch_config` or a RaggedAttentionTuner)."""
    _check_one_device(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, "T_q")
    cu_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, None, "T_k")
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of requests, "
                         f"got {len(cu_q) - 1} and {len(cu_k) - 1}")
    return plan_from_host(cu_seqlens_q, cu_seqlens_k, cu_q, cu_k, max_seqlen_q, max_seqlen_k, config)


def _kernel_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, plan: RaggedPlan,
                   softmax_scale: float | None) -> tuple[tuple[int, int], tuple, dict]:
    """(grid, arguments, meta-parameters) of one kernel launch."""
    head_dim = q.shape[2]
    config = plan.config
    grid = (plan.block_request.numel(), q.shape[1])
    args = (q, k, v, out, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.block_request, plan.block_in_request,
            plan.num_requests, head_dim, _default_scale(head_dim, softmax_scale) * _LOG2E,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1))
    meta = dict(
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION="ieee",
        # Under the interpreter bf16 is stored as uint16 and tl.dot multiplies the bit patterns
        # (triton-lang/triton#11584, unsupported upstream); fp32 dots on bf16 values are exact products.
        UPCAST_OPERANDS=KERNEL_INTERPRETED and q.dtype == torch.bfloat16,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return grid, args, meta


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RaggedPlan, softmax_scale: float | None,
            out: torch.Tensor | None = None, warmup: bool = False) -> torch.Tensor:
    """Run (or with `warmup` only compile) the kernel on validated inputs; returns `out`."""
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.shape[0] == 0 or q.shape[1] == 0:
        return out
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    grid, args, meta = _kernel_launch(q, k, v, out, plan, softmax_scale)
    if warmup:
        ragged_attention_kernel.warmup(*args, grid=grid, **meta)
    else:
        ragged_attention_kernel[grid](*args, **meta)
    return out


def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     softmax_scale: float | None = None, *, config: LaunchConfig | None = None) -> torch.Tensor:
    """Ragged attention with the Triton kernel.

    `q: [T_q, heads, head_dim]`, `k, v: [T_k, heads, head_dim]`, `cu_seqlens_q, cu_seqlens_k: [B+1]`
    int32 -> `[T_q, heads, head_dim]` in q's dtype. `max_seqlen_q` bounds the grid and must be at
    least the longest query run; `max_seqlen_k` is checked and kept for flash-attn API parity.
    fp32 / bf16 / fp16; head_dim of any size (padded to a power of two inside the kernel).
    `config`: the launch; None takes `launch_config` for this head_dim, dtype and GPU.

    The contents of cu_seqlens are validated on the host (one small sync on a GPU) and the query block
    map is built on every call; `ragged_attention_with_plan` does both once per batch.
    """
    cu_q, cu_k = check_ragged_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    _check_kernel_inputs(q)
    if config is None:
        config = launch_config(q.shape[-1], q.dtype, device_capability(q.device))
    plan = plan_from_host(cu_seqlens_q, cu_seqlens_k, cu_q, cu_k, max_seqlen_q, max_seqlen_k, config)
    return _launch(q, k, v, plan, softmax_scale)


def ragged_attention_with_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RaggedPlan,
                               softmax_scale: float | None = None) -> torch.Tensor:
    """`ragged_attention` over a batch planned by `plan_ragged_attention`: same shapes and semantics,
    with the launch config of the plan. Checks shapes, dtypes and devices only (no host sync)."""
    _check_qkv(q, k, v)
    if q.shape[0] != plan.total_q or k.shape[0] != plan.total_k:
        raise ValueError(f"q and k must have the plan's T_q = {plan.total_q} and T_k = {plan.total_k} rows, "
                         f"got {q.shape[0]} and {k.shape[0]}")
    _check_one_device(q=q, k=k, v=v, plan=plan.cu_seqlens_q)
    _check_kernel_inputs(q)
    return _launch(q, k, v, plan, softmax_scale)


# The tuner's search space: the tutorial's (see HOPPER_LAUNCH_CONFIGS), BLOCK_N 128 included, stages 2-4.
TUNING_CANDIDATES = tuple(LaunchConfig(block_m=m, block_n=n, num_warps=w, num_stages=s)
                          for m in (64, 128) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4))
# triton.testing.do_bench budget per candidate (ms of warm-up, ms of timed runs): under a second per
# key for the 36 candidates, which differ by tens of percent, well above do_bench's noise at this budget.
_TUNING_WARMUP_MS = 3
_TUNING_REP_MS = 10


@dataclasses.dataclass(frozen=True, slots=True)
class TuningKey:
    """What the fastest config depends on, coarsely: the operand shapes and dtype, the GPU, the query
    rows of the longest request, and whether the grid fills the GPU more than once (a grid that does
    not favours smaller query blocks: more programs to spread over the SMs)."""

    head_dim: int
    dtype: str
    capability: tuple[int, int] | None  # None off CUDA
    max_seqlen_q_bucket: int  # max_seqlen_q rounded up to a power of two, at least 64
    grid_waves_bucket: int  # 1: 128-row programs x heads fit the SMs in one wave (or off CUDA), 2: more


def tuning_key(q: torch.Tensor, max_seqlen_q: int) -> TuningKey:
    """The key of `q: [T_q, heads, head_dim]` with `max_seqlen_q`; reads no device memory."""
    capability = device_capability(q.device)
    waves = 1
    if capability is not None:
        processors = torch.cuda.get_device_properties(q.device).multi_processor_count
        programs = triton.cdiv(q.shape[0], 128) * q.shape[1]
        waves = 1 if programs <= processors else 2
    return TuningKey(head_dim=q.shape[2], dtype=str(q.dtype).removeprefix("torch."), capability=capability,
                     max_seqlen_q_bucket=max(64, triton.next_power_of_2(max(1, max_seqlen_q))),
                     grid_waves_bucket=waves)


@dataclasses.dataclass(slots=True)
class TuningResult:
    """The config chosen for one key, and the evidence."""

    key: TuningKey
    config: LaunchConfig
    source: str  # "tuned": the fastest candidate; "table": launch_config's entry (nothing timed, or none ran)
    timings_ms: dict[str, float]  # candidate name -> median ms
    skipped: dict[str, str]  # candidate name -> why it could not run (shared memory, ptxas)
    precompile_error: str | None = None  # why the concurrent compile was not used, if it was not

    def to_json(self) -> dict:
        return {"key": dataclasses.asdict(self.key), "config": dataclasses.asdict(self.config),
                "config_name": self.config.name, "source": self.source, "timings_ms": self.timings_ms,
                "skipped": self.skipped, "precompile_error": self.precompile_error}


# What a launch config can fail with that says "not this config" rather than "a bug" (the exceptions
# triton.runtime.autotuner skips).
_CANDIDATE_FAILURES = (OutOfResources, PTXASError, CompileTimeAssertionFailure)


def _median_ms(run: Callable[[], object]) -> float:
    return triton.testing.do_bench(run, warmup=_TUNING_WARMUP_MS, rep=_TUNING_REP_MS, return_mode="median")


def _precompile(warmups: list[Callable[[], object]]) -> str | None:
    """Compile the candidates concurrently with Triton's AsyncCompileMode (ptxas at least runs outside
    the GIL), so tuning a head size does not wait for 36 compiles in a row. Best effort, through a
    private Triton module: returns why it failed, and the timing loop then compiles each in turn."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as executor, \
                AsyncCompileMode(executor, ignore_errors=True):
            for warmup in warmups:
                warmup()
    except Exception as error:  # any failure here only costs compile time
        return f"{type(error).__name__}: {error}"
    return None


class RaggedAttentionTuner:
    """Picks the fastest LaunchConfig per TuningKey by timing candidates on the caller's inputs, once
    per key, and keeps the winners (`results`) for the life of the tuner.

    Under the Triton interpreter or off CUDA it times nothing: the answer is `launch_config`'s.
    """

    def __init__(self, candidates: Sequence[LaunchConfig] = TUNING_CANDIDATES,
                 measure_ms: Callable[[Callable[[], object]], float] = _median_ms):
        if not candidates:
            raise ValueError("the tuner needs at least one candidate config")
        self.candidates = tuple(candidates)
        self.measure_ms = measure_ms
        self.results: dict[TuningKey, TuningResult] = {}

    def config_for(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                   softmax_scale: float | None = None) -> LaunchConfig:
        """The config for these inputs (shapes as in `ragged_attention`); see `result_for`."""
        return self.result_for(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale).config

    def result_for(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                   softmax_scale: float | None = None) -> TuningResult:
        """The cached result for these inputs' key; on a miss, on CUDA, every candidate is compiled and
        timed on these inputs (their output is discarded)."""
        key = tuning_key(q, max_seqlen_q)
        if key not in self.results:
            table = launch_config(q.shape[-1], q.dtype, key.capability)
            if q.device.type != "cuda" or KERNEL_INTERPRETED:
                # Interpreter timings say nothing about a GPU, and tests stay fast.
                self.results[key] = TuningResult(key, table, "table", {}, {})
            else:
                self.results[key] = self._tune(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               softmax_scale, key, table)
        return self.results[key]

    def _tune(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
              key: TuningKey, table: LaunchConfig) -> TuningResult:
        cu_q, cu_k = check_ragged_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
        _check_kernel_inputs(q)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        # The query block map depends on BLOCK_M: one plan per candidate.
        plans = {config: plan_from_host(cu_seqlens_q, cu_seqlens_k, cu_q, cu_k, max_seqlen_q, max_seqlen_k, config)
                 for config in self.candidates}
        precompile_error = _precompile([lambda plan=plan: _launch(q, k, v, plan, softmax_scale, out, warmup=True)
                                        for plan in plans.values()])
        runs = {config: (lambda plan=plan: _launch(q, k, v, plan, softmax_scale, out))
                for config, plan in plans.items()}
        result = self.pick(key, runs, fallback=table)
        result.precompile_error = precompile_error
        return result

    def pick(self, key: TuningKey, runs: dict[LaunchConfig, Callable[[], object]],
             fallback: LaunchConfig) -> TuningResult:
        """Time each candidate's run (its first call compiles and loads it); the fastest wins. A
        candidate that cannot run is skipped, with what Triton's own autotuner skips: over the GPU's
        shared memory (OutOfResources), rejected by ptxas, or failing a compile-time assertion. If
        none runs, `fallback` is the answer."""
        timings, skipped = {}, {}
        for config, run in runs.items():
            try:
                run()
            except _CANDIDATE_FAILURES as error:
                skipped[config.name] = f"{type(error).__name__}: {error}"
                continue
            timings[config.name] = self.measure_ms(run)
        ran = [config for config in runs if config.name in timings]
        if not ran:
            return TuningResult(key, fallback, "table", timings, skipped)
        return TuningResult(key, min(ran, key=lambda config: timings[config.name]), "tuned", timings, skipped)


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
    lengths_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
    lengths_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
    return sdpa_ragged_ref(q, k, v, lengths_q, lengths_k, _default_scale(q.shape[-1], softmax_scale))
