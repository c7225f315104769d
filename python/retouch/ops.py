"""Every fast op retouch runs, as a torch op in the `retouch` namespace. The only module that imports
`retouch._C`.

- C++/CUDA ops from csrc/ (registered by TORCH_LIBRARY in csrc/torch_bindings.cpp);
- Triton kernels from kernels/, registered here with torch.library.custom_op;
each with a fake (meta) implementation, so torch.compile and CUDA graphs can see and trace them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import threading
from collections.abc import Sequence

import torch
import torch.utils.flop_counter

from retouch.errors import InputError, RetouchError
from retouch.kernels.ragged_attention import (RaggedPlan, device_capability, launch_config, launch_planned,
                                              plan_from_host, plan_from_shapes, plan_ragged_attention,
                                              ragged_attention_with_plan)
from retouch.kernels.host_tables import to_device_async
from retouch.kernels.norm_rope import norm_rope_triton
from retouch.kernels.reference import rms_norm_rope_ref, rope_pairs_ref
from retouch.kernels.ragged_attention import ragged_attention_sdpa as _ragged_attention_sdpa
from retouch.kernels.row_copy import gather_rows_triton, scatter_rows_triton
from retouch.kernels.segmented_lora import segmented_lora_triton

ROW_COPY_BACKENDS = ("native", "triton")
HOST_GATHER_METHODS = ("auto", "kernel", "memcpy")
ATTENTION_BACKENDS = ("auto", "triton", "sdpa", "flash_attn", "cudnn")
FLASH_ATTN_AVAILABLE = importlib.util.find_spec("flash_attn") is not None

try:
    from retouch import _C
except ImportError as exc:  # a source checkout that was never built
    _C = None
    _IMPORT_ERROR = str(exc)
else:
    _IMPORT_ERROR = None


def extension_info() -> dict:
    """Which parts of retouch._C were built: `{"built": bool, "cpu": bool, "cuda": bool, "error": str|None}`."""
    if _C is None:
        return {"built": False, "cpu": False, "cuda": False, "error": _IMPORT_ERROR}
    return {"built": True, "cpu": True, "cuda": bool(_C.built_with_cuda()), "error": None}


def _require_extension() -> None:
    if _C is None:
        raise RetouchError(f"retouch._C is not built ({_IMPORT_ERROR}); run `pip install -e .` or `make`")


def gather_rows(src: torch.Tensor, row_idx: torch.Tensor, backend: str = "native") -> torch.Tensor:
    """Pack rows: `src: [N, H]` (unit stride along H), `row_idx: [T]` int32/int64 -> `[T, H]`."""
    if _row_copy_backend(backend) == "triton":
        return torch.ops.retouch.gather_rows_triton(src, row_idx)
    _require_extension()
    return torch.ops.retouch.gather_rows(src, row_idx)


def scatter_rows_(dst: torch.Tensor, row_idx: torch.Tensor, src: torch.Tensor, backend: str = "native") -> None:
    """Unpack rows in place: `dst[row_idx[i]] = src[i]`; `dst: [N, H]`, `src: [T, H]`, indices unique."""
    if _row_copy_backend(backend) == "triton":
        torch.ops.retouch.scatter_rows_triton_(dst, row_idx, src)
        return
    _require_extension()
    torch.ops.retouch.scatter_rows_(dst, row_idx, src)


if _C is not None:
    HostArena = _C.HostArena
else:

    class HostArena:
        """Stands in for retouch._C.HostArena in a checkout whose extension was never built."""

        def __init__(self, capacity: int, alignment: int = 256, pinned: bool = True):
            _require_extension()


def gather_host_rows_(dst: torch.Tensor, src: torch.Tensor, src_offsets: torch.Tensor, dst_rows: torch.Tensor,
                      method: str = "auto", max_blocks: int = 0) -> None:
    """Copy template rows out of a host arena into a staging buffer, in place (paper §4.2).

    `dst: [N, H]` any dtype, unit stride along H (row_bytes = H * element size); `src: [capacity]` uint8
    host memory (`HostArena.tensor()`); `src_offsets, dst_rows: [n]` int64 CPU tensors. The bytes of
    `dst[dst_rows[i]]` become `src[src_offsets[i] : src_offsets[i] + row_bytes]`; every index is checked
    before anything is written. A CUDA `dst` is filled asynchronously on the current stream, by method
    "kernel" (an SM kernel reads pinned host memory directly; src must be pinned), "memcpy" (one host->
    device copy per run of adjacent rows) or "auto" (memcpy when the mean run is >= 1 MiB or src is
    pageable, else kernel); keep `src` alive and unchanged until the stream has run the copy. A CPU `dst`
    is filled at once by threaded memcpys of the runs of adjacent rows; method is then ignored.

    `max_blocks` > 0 bounds the kernel's grid (its blocks loop over the rows): a gather that overlaps
    compute should take few SMs (`CopyEngine` gives it a quarter); 0 launches as many as the work needs.
    """
    if method not in HOST_GATHER_METHODS:
        raise ValueError(f"host gather method must be one of {HOST_GATHER_METHODS}, got {method!r}")
    if max_blocks < 0:
        raise ValueError(f"max_blocks must be >= 0 (0: no bound), got {max_blocks}")
    _require_extension()
    torch.ops.retouch.gather_host_rows_(dst, src, src_offsets, dst_rows, method, max_blocks)


def allocate_host_arena(capacity: int, alignment: int, pinned: bool, asked_by: str) -> HostArena:
    """A HostArena of `capacity` bytes, or an InputError naming `asked_by` (the option that asked for the
    memory) where the machine has less: TORCH_CHECK's own message holds a C++ trace, and surfaced as an
    internal error after the work that preceded it."""
    if capacity >= 1 << 62:  # past what a size_t the extension takes can hold, and any machine's memory
        raise InputError(f"cannot allocate {capacity / (1 << 30):.3g} GiB of host memory for {asked_by}: ask for less")
    try:
        return HostArena(capacity, alignment, pinned)
    except RuntimeError as exc:
        if "cannot allocate" not in str(exc):
            raise
        raise InputError(f"cannot allocate {capacity / (1 << 30):.3g} GiB of host memory for {asked_by}: ask for "
                         "less") from None


def row_runs(src_offsets: torch.Tensor, dst_rows: torch.Tensor, row_bytes: int) -> int:
    """How many copies the "memcpy" method issues for `src_offsets, dst_rows: [n]`: rows i and i+1 share a
    run when both the source bytes and the destination row follow on (for a staging buffer whose rows are
    back to back, as csrc/host_row_runs.h assumes too)."""
    if len(src_offsets) == 0:
        return 0
    offsets, rows = src_offsets.long(), dst_rows.long()
    extends = (offsets[1:] == offsets[:-1] + row_bytes) & (rows[1:] == rows[:-1] + 1)
    return 1 + int((~extends).sum())


def _row_copy_backend(backend: str) -> str:
    if backend not in ROW_COPY_BACKENDS:
        raise ValueError(f"row-copy backend must be one of {ROW_COPY_BACKENDS}, got {backend!r}")
    return backend


def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     softmax_scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """Each request's queries against that request's keys, packed without padding (flash-attn varlen).

    `q: [T_q, heads, d]`, `k, v: [T_k, heads, d]`, `cu_seqlens_q, cu_seqlens_k: [B+1]` int32 ->
    `[T_q, heads, d]`. backend: "triton" (GPU, or CPU under TRITON_INTERPRET=1), "sdpa" (torch SDPA
    per request; the CPU path), "flash_attn" (flash_attn_varlen_func, if installed), "cudnn" (cuDNN's
    SDPA with ragged offsets, 16-bit CUDA only: `cudnn_varlen`; opt-in until measured), or "auto":
    flash-attn for 16-bit CUDA tensors when installed, else Triton on CUDA, else SDPA.
    """
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return torch.ops.retouch.ragged_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              scale, resolve_attention_backend(backend, q))


def resolve_attention_backend(backend: str, q: torch.Tensor) -> str:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend == "flash_attn" and not FLASH_ATTN_AVAILABLE:
        raise ValueError("attention backend 'flash_attn' requested but flash-attn is not installed")
    if backend == "cudnn" and not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        raise ValueError(f"attention backend 'cudnn' runs on CUDA in fp16/bf16 only, got {q.dtype} on "
                         f"{q.device.type}")
    if backend != "auto":
        return backend
    if q.is_cuda and FLASH_ATTN_AVAILABLE and q.dtype in (torch.float16, torch.bfloat16):
        return "flash_attn"
    return "triton" if q.is_cuda else "sdpa"


@torch.library.custom_op("retouch::ragged_attention", mutates_args=())
def _ragged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                         backend: str) -> torch.Tensor:
    if backend == "triton":
        config = launch_config(q.shape[-1], q.dtype, device_capability(q.device))
        plan = _recent_plans.plan(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, config)
        return ragged_attention_with_plan(q, k, v, plan, softmax_scale)
    if backend == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale=softmax_scale)
    if backend == "cudnn":
        return cudnn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)
    return _ragged_attention_sdpa(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale)


def cudnn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                 softmax_scale: float) -> torch.Tensor:
    """cuDNN's SDPA over packed rows, as torch's nested-tensor SDPA calls it (`aten::_cudnn_attention_forward`
    with cumulative lengths): its ragged offsets are cum_seqlen * heads * d, so rows must be contiguous, and
    the lengths int32."""
    return torch.ops.aten._cudnn_attention_forward(
        q.contiguous(), k.contiguous(), v.contiguous(), None, cu_seqlens_q.to(torch.int32),
        cu_seqlens_k.to(torch.int32), max_seqlen_q, max_seqlen_k, False, 0.0, False, False, scale=softmax_scale)[0]


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """One forward's ragged attention layout, decided before its first block (its planning): every
    block's call reads it and none reads tensor values back, so a planned forward makes no host sync.

    lengths_q, lengths_k:         tokens per request, host ints (the ragged descriptor's own)
    host_lengths_q, host_lengths_k: the same as [B] int64 CPU tensors (what the SDPA path reads: under
                                  torch.compile they are graph inputs, so new lengths are no new graph)
    cu_seqlens_q, cu_seqlens_k:   their prefix sums, [B+1] int32 on the device
    backend:                      resolved ("sdpa", "triton" or "flash_attn")
    triton:                       the Triton kernel's block map (backend "triton")
    padded_rows:                  backend "sdpa" as one call over queries padded to the longest request
                                  (`sdpa_padded`): each packed query's row in that [B * max_q] layout, on the
                                  device; None: one SDPA call per request
    """

    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...]
    host_lengths_q: torch.Tensor
    host_lengths_k: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    backend: str
    triton: RaggedPlan | None = None
    padded_rows: torch.Tensor | None = None

    @property
    def max_seqlen_q(self) -> int:
        return max(self.lengths_q, default=0)

    @property
    def max_seqlen_k(self) -> int:
        return max(self.lengths_k, default=0)


def plan_attention(lengths_q: Sequence[int], lengths_k: Sequence[int], device: torch.device | str,
                   dtype: torch.dtype, head_dim: int, backend: str = "auto",
                   cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                   heads: int | None = None) -> AttentionPlan:
    """The plan of `planned_attention` calls over requests of `lengths_q` queries and `lengths_k` keys
    (host ints; `cu_seqlens_*`: their prefix sums on `device` if already made). Reads nothing back.

    With `heads` given, "auto" on a GPU that `ATTENTION_COSTS` has measured picks the fastest of the
    Triton kernel, SDPA over padded queries and SDPA per request for this layout (`choose_attention`)."""
    lengths_q, lengths_k = tuple(int(n) for n in lengths_q), tuple(int(n) for n in lengths_k)
    if len(lengths_q) != len(lengths_k) or not lengths_q:
        raise ValueError(f"lengths_q and lengths_k must describe the same requests (>= 1), got {len(lengths_q)} "
                         f"and {len(lengths_k)}")
    if min(lengths_q + lengths_k) < 0:
        raise ValueError("sequence lengths must be >= 0")
    device = torch.device(device)
    pad = False
    if backend == "auto" and heads is not None and not FLASH_ATTN_AVAILABLE:
        costs = attention_costs(head_dim, dtype, device_capability(device) if device.type == "cuda" else None)
        if costs is not None:
            backend, pad = choose_attention(lengths_q, lengths_k, heads, head_dim, costs)
    backend = resolve_attention_backend(backend, torch.empty(0, device=device, dtype=dtype))
    cu_q = [0, *itertools.accumulate(lengths_q)]
    cu_k = [0, *itertools.accumulate(lengths_k)]
    if cu_seqlens_q is None:
        cu_seqlens_q = to_device_async(torch.tensor(cu_q, dtype=torch.int32), device)
    if cu_seqlens_k is None:
        cu_seqlens_k = to_device_async(torch.tensor(cu_k, dtype=torch.int32), device)
    triton_plan = None
    if backend == "triton":
        config = launch_config(head_dim, dtype, device_capability(device))
        triton_plan = plan_from_host(cu_seqlens_q, cu_seqlens_k, cu_q, cu_k, max(lengths_q), max(lengths_k), config)
    plan = AttentionPlan(lengths_q, lengths_k, torch.tensor(lengths_q), torch.tensor(lengths_k), cu_seqlens_q,
                         cu_seqlens_k, backend, triton_plan)
    return with_padded_queries(plan) if pad else plan


@dataclasses.dataclass(frozen=True)
class AttentionCost:
    """Milliseconds of one attention call: `fixed_ms + per_request_ms * B + TFLOP / tflops`."""

    fixed_ms: float
    per_request_ms: float
    tflops: float

    def ms(self, requests: int, flop: float) -> float:
        return self.fixed_ms + self.per_request_ms * requests + flop / (self.tflops * 1e9)


# Fits to the 72 layouts per head_dim of `retouch bench attention` on an H200 (bf16, stop 52,
# bench/results/h200/attention.json; `python -m retouch.bench.attention_costs` refits them): the Triton
# kernel (tuned launch configs) over the ragged work, torch SDPA over the work padded to the longest
# request (one call: cuDNN's Hopper kernel), and torch SDPA per request. The times are the device's
# (`ms_steady`, bursts of back-to-back calls), what an engine running ahead of the device pays; one call
# from an idle device is mostly the host's launch latency. SDPA runs at 1.4-1.7x the kernel's rate at
# large sizes; the kernel wins where the fixed costs dominate. Replayed on that sweep, the choice is the
# fastest path at the median point and 0.75x of it at worst; the H100 is the same chip.
ATTENTION_COSTS = {
    (9, 64): {"triton": AttentionCost(0.0484, 0.0, 410), "sdpa_padded": AttentionCost(0.0846, 0.0, 558),
              "sdpa": AttentionCost(0.0825, 0.0411, 473)},
    (9, 128): {"triton": AttentionCost(0.0429, 0.0, 394), "sdpa_padded": AttentionCost(0.0742, 0.0, 653),
               "sdpa": AttentionCost(0.0828, 0.0371, 659)},
}


def attention_costs(head_dim: int, dtype: torch.dtype, capability: tuple[int, int] | None
                    ) -> dict[str, AttentionCost] | None:
    """The measured costs for 16-bit attention at `head_dim` on a GPU of `capability`; None if unmeasured."""
    if capability is None or dtype not in (torch.bfloat16, torch.float16):
        return None
    return ATTENTION_COSTS.get((capability[0], head_dim))


def attention_flop(lengths_q: Sequence[int], lengths_k: Sequence[int], heads: int, head_dim: int,
                   padded: bool = False) -> int:
    """FLOP of ragged attention over requests of `lengths_q` queries and `lengths_k` keys; `padded`: with
    every request's queries padded to the longest (keys of one length, as `with_padded_queries` needs)."""
    flop_per_pair = 4 * heads * head_dim
    if padded:
        return flop_per_pair * len(lengths_q) * max(lengths_q) * lengths_k[0]
    return flop_per_pair * sum(q * k for q, k in zip(lengths_q, lengths_k))


def choose_attention(lengths_q: Sequence[int], lengths_k: Sequence[int], heads: int, head_dim: int,
                     costs: dict[str, AttentionCost]) -> tuple[str, bool]:
    """(backend, padded) predicted fastest for this layout: ("triton", False), ("sdpa", True) for one SDPA
    call over padded queries (keys of one length only: padded keys would need a mask, off SDPA's fast
    kernels), or ("sdpa", False) for one call per request."""
    requests = len(lengths_q)
    ragged = attention_flop(lengths_q, lengths_k, heads, head_dim)
    predicted = {("triton", False): costs["triton"].ms(requests, ragged),
                 ("sdpa", False): costs["sdpa"].ms(requests, ragged)}
    if requests > 1 and len(set(lengths_k)) == 1 and lengths_k[0] > 0:
        padded = attention_flop(lengths_q, lengths_k, heads, head_dim, padded=True)
        predicted[("sdpa", True)] = costs["sdpa_padded"].ms(requests, padded)
    return min(predicted, key=predicted.get)


def with_padded_queries(plan: AttentionPlan) -> AttentionPlan:
    """`plan` run as one SDPA call over queries padded to its longest request (`sdpa_padded`); its keys
    must all be of one length."""
    if len(set(plan.lengths_k)) != 1 or plan.lengths_k[0] == 0:
        raise ValueError(f"padded SDPA needs every request's keys of one nonzero length, got {plan.lengths_k}")
    longest = plan.max_seqlen_q
    rows = [b * longest + j for b, n in enumerate(plan.lengths_q) for j in range(n)]
    padded_rows = to_device_async(torch.tensor(rows, dtype=torch.long), plan.cu_seqlens_q.device)
    return dataclasses.replace(plan, backend="sdpa", triton=None, padded_rows=padded_rows)


def sdpa_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, padded_rows: torch.Tensor, requests: int,
                longest: int, softmax_scale: float) -> torch.Tensor:
    """Ragged attention as one SDPA call: `q: [T_q, heads, d]` scattered to `[B, longest, heads, d]` at
    `padded_rows`, keys `[B * L, heads, d]` as `[B, L, heads, d]`; the padding rows' outputs are dropped."""
    heads, head_dim = q.shape[1:]
    if q.shape[0] == 0:  # no queries: nothing for SDPA's kernels (some refuse empty inputs) to do
        return q.new_empty(q.shape)
    keys = k.shape[0] // requests
    padded = q.new_zeros(requests * longest, heads, head_dim).index_copy_(0, padded_rows, q)
    padded = padded.view(requests, longest, heads, head_dim).transpose(1, 2)
    k_batched = k.reshape(requests, keys, heads, head_dim).transpose(1, 2)
    v_batched = v.reshape(requests, keys, heads, head_dim).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(padded, k_batched, v_batched, scale=softmax_scale)
    return out.transpose(1, 2).reshape(requests * longest, heads, head_dim).index_select(0, padded_rows)


def planned_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
                      softmax_scale: float | None = None) -> torch.Tensor:
    """`ragged_attention` over a planned layout: `q: [T_q, heads, d]`, `k, v: [T_k, heads, d]` packed as
    `plan` says -> `[T_q, heads, d]`. No host sync: the plan holds every length it needs.

    Traced by torch.compile, only the plan's tensors are read (graph inputs: a new layout is new data,
    not a new graph) and the lengths' maxima are bounded by the token totals (`plan_from_shapes`); a
    padded plan runs one SDPA call per request there (its padded shape would be a new graph per batch)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if torch.compiler.is_compiling():
        if plan.backend == "sdpa":
            return torch.ops.retouch.sdpa_ragged(q, k, v, plan.host_lengths_q, plan.host_lengths_k, scale)
        return torch.ops.retouch.ragged_attention_bounded(q, k, v, plan.cu_seqlens_q, plan.cu_seqlens_k, scale,
                                                          plan.backend)
    if plan.backend == "triton":
        return ragged_attention_with_plan(q, k, v, plan.triton, scale)
    if plan.padded_rows is not None:
        return sdpa_padded(q, k, v, plan.padded_rows, len(plan.lengths_q), plan.max_seqlen_q, scale)
    if plan.backend == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(q, k, v, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q,
                                      plan.max_seqlen_k, softmax_scale=scale)
    if plan.backend == "cudnn":
        return cudnn_varlen(q, k, v, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k,
                            scale)
    return torch.ops.retouch.sdpa_ragged(q, k, v, plan.host_lengths_q, plan.host_lengths_k, scale)


@torch.library.custom_op("retouch::ragged_attention_bounded", mutates_args=())
def _ragged_attention_bounded_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                 cu_seqlens_k: torch.Tensor, softmax_scale: float, backend: str) -> torch.Tensor:
    """The GPU backends over a layout on the device, each request's length bounded by the totals."""
    if backend == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0],
                                      softmax_scale=softmax_scale)
    if backend == "cudnn":
        return cudnn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], softmax_scale)
    config = launch_config(q.shape[-1], q.dtype, device_capability(q.device))
    plan = plan_from_shapes(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], config)
    return launch_planned(q, k, v, plan, softmax_scale)


@_ragged_attention_bounded_op.register_fake
def _ragged_attention_bounded_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, backend):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


LoraGroup = tuple[torch.Tensor, torch.Tensor, float]  # (A [r, in], B [out, r], scale) of one adapter


def segmented_lora_(x: torch.Tensor, y: torch.Tensor, groups: Sequence[LoraGroup],
                    segments: Sequence[tuple[int, int, int]], backend: str = "auto",
                    stacked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """In place on `y: [T, out]`, for each segment (start, stop, g) of the rows of `x: [T, in]`:
    `y[start:stop] += scale_g * (x[start:stop] A_g^T) B_g^T` (Punica's SGMV). backend "triton" (CUDA, or
    the CPU under TRITON_INTERPRET=1): the segmented kernels (`retouch.kernels.segmented_lora`), over
    `stacked` = (A [G, R, in], B [G, out, R], scales [G]) when the caller keeps them (else stacked here);
    "torch": two matmuls per segment (the CPU's path, and every device's when one segment covers a call:
    the single-adapter fast path). "auto": Triton on CUDA with several segments, else torch."""
    if backend == "auto":
        backend = "triton" if x.is_cuda and len(segments) > 1 else "torch"
    if backend == "torch":
        for start, stop, group in segments:
            A, B, scale = groups[group]
            y[start:stop].addmm_(x[start:stop] @ A.T, B.T, alpha=scale)
        return
    if backend != "triton":
        raise ValueError(f"segmented_lora backend must be auto, triton or torch, got {backend!r}")
    A, B, scales = stacked if stacked is not None else stack_lora_groups(groups)
    segmented_lora_triton(x, y, A, B, scales, [g[0].shape[0] for g in groups], segments)


def stack_lora_groups(groups: Sequence[LoraGroup]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The segmented kernels' operands: A `[G, R, in]` and B `[G, out, R]` zero-padded to the largest rank
    R, and the scales `[G]` (fp32)."""
    max_rank = max(A.shape[0] for A, _, _ in groups)
    first_A, first_B, _ = groups[0]
    A = first_A.new_zeros((len(groups), max_rank, first_A.shape[1]))
    B = first_B.new_zeros((len(groups), first_B.shape[0], max_rank))
    for g, (a, b, _) in enumerate(groups):
        A[g, :a.shape[0]] = a
        B[g, :, :b.shape[1]] = b
    scales = to_device_async(torch.tensor([scale for _, _, scale in groups], dtype=torch.float32), first_A.device)
    return A, B, scales


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' Flux RoPE in one op: `x: [..., S, heads, d]`, `cos, sin: [S, d]` (the per-token rows of
    the position tables) -> x's shape and dtype. Traced as its reference under torch.compile, whose
    fusion does better than an opaque op."""
    if torch.compiler.is_compiling() or _C is None:
        return rope_pairs_ref(x, cos, sin)
    return torch.ops.retouch.rope_pairs(x, cos, sin)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor | None = None,
                  sin: torch.Tensor | None = None) -> torch.Tensor:
    """An attention q/k norm (`torch.rms_norm` over the last dimension) and, given tables, `rope_pairs` of
    its output, in one op: one pass over the rows instead of the norm's seven ops and the rotation's own.
    Traced as its reference under torch.compile, as `rope_pairs` is."""
    if torch.compiler.is_compiling() or _C is None:
        return rms_norm_rope_ref(x, weight, eps, cos, sin)
    return torch.ops.retouch.rms_norm_rope(x, weight, eps, cos, sin)


class RecentPlans:
    """The Triton kernel's plans of the last few batches. Every masked block of a forward passes the
    same cu_seqlens tensors, so validating them (a host sync on a GPU) and building the query block
    map happen once per forward instead of once per block, where a sync would stall the launches
    queued ahead of the GPU."""

    def __init__(self, size: int = 4):
        self.size = size
        self._plans: list[tuple[tuple, RaggedPlan]] = []  # most recent last
        self._lock = threading.Lock()
        self.built = 0

    def plan(self, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
             config) -> RaggedPlan:
        # Identity and version: the same tensor objects, not modified in place since.
        key = (id(cu_seqlens_q), id(cu_seqlens_k), cu_seqlens_q._version, cu_seqlens_k._version, max_seqlen_q,
               max_seqlen_k, config)
        with self._lock:
            for index, (known, plan) in enumerate(self._plans):
                if known == key and plan.cu_seqlens_q is cu_seqlens_q and plan.cu_seqlens_k is cu_seqlens_k:
                    self._plans.append(self._plans.pop(index))
                    return plan
        plan = plan_ragged_attention(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, config)
        with self._lock:
            self._plans = (self._plans + [(key, plan)])[-self.size:]
            self.built += 1
        return plan


_recent_plans = RecentPlans()


@_ragged_attention_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, backend):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.utils.flop_counter.register_flop_formula(torch.ops.retouch.ragged_attention, get_raw=True)
def ragged_attention_flops(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, out_val=None, **kwargs) -> int:
    """QK^T and PV of every request: 2 matmuls x 2 FLOPs x heads x head_dim x sum_b(n_q,b * n_k,b).

    Registered so that torch.utils.flop_counter sees through the opaque custom op (Table 1 checks)."""
    lengths_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    lengths_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    return 4 * q.shape[1] * q.shape[2] * int((lengths_q * lengths_k).sum())


if _C is not None:

    @torch.utils.flop_counter.register_flop_formula(torch.ops.retouch.sdpa_ragged, get_raw=True)
    def sdpa_ragged_flops(q, k, v, lengths_q, lengths_k, *args, out_val=None, **kwargs) -> int:
        """As `ragged_attention_flops`, from the host lengths."""
        return 4 * q.shape[1] * q.shape[2] * int((lengths_q * lengths_k).sum())


@torch.library.custom_op("retouch::gather_rows_triton", mutates_args=())
def _gather_rows_triton_op(src: torch.Tensor, row_idx: torch.Tensor) -> torch.Tensor:
    return gather_rows_triton(src, row_idx)


@_gather_rows_triton_op.register_fake
def _(src, row_idx):
    return src.new_empty((row_idx.shape[0], src.shape[1]))


@torch.library.custom_op("retouch::scatter_rows_triton_", mutates_args=("dst",))
def _scatter_rows_triton_op(dst: torch.Tensor, row_idx: torch.Tensor, src: torch.Tensor) -> None:
    scatter_rows_triton(dst, row_idx, src)


@_scatter_rows_triton_op.register_fake
def _(dst, row_idx, src):
    return None


if _C is not None:

    @torch.library.register_fake("retouch::gather_rows")
    def _gather_rows_fake(src: torch.Tensor, row_idx: torch.Tensor) -> torch.Tensor:
        return src.new_empty((row_idx.shape[0], src.shape[1]))

    @torch.library.register_fake("retouch::scatter_rows_")
    def _scatter_rows_fake(dst: torch.Tensor, row_idx: torch.Tensor, src: torch.Tensor) -> None:
        return None

    @torch.library.register_fake("retouch::rope_pairs")
    def _rope_pairs_fake(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("retouch::rms_norm_rope")
    def _rms_norm_rope_fake(x, weight, eps, cos, sin) -> torch.Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    # On CUDA both run the Triton kernel (kernels/norm_rope.py); the CPU has C++ kernels, other devices
    # the composites.
    @torch.library.register_kernel("retouch::rope_pairs", "cuda")
    def _rope_pairs_cuda(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if cos.device != x.device or sin.device != x.device:
            raise RuntimeError(f"rope_pairs: x, cos and sin must share a device, got {x.device}, {cos.device}")
        if cos.dtype != torch.float32 or sin.dtype != torch.float32 or x.dtype == torch.float64:
            return rope_pairs_ref(x, cos, sin)  # the kernel takes the fp32 tables Flux builds
        return norm_rope_triton(x, None, None, cos, sin)

    @torch.library.register_kernel("retouch::rms_norm_rope", "cuda")
    def _rms_norm_rope_cuda(x, weight, eps, cos, sin) -> torch.Tensor:
        tensors = [t for t in (weight, cos, sin) if t is not None]
        if any(t.device != x.device for t in tensors):
            raise RuntimeError(f"rms_norm_rope: every tensor must be on {x.device}")
        if ((cos is not None and (cos.dtype != torch.float32 or sin.dtype != torch.float32))
                or (weight is not None and weight.dtype != x.dtype) or x.dtype == torch.float64):
            return rms_norm_rope_ref(x, weight, eps, cos, sin)  # the composite's promotion rules, as on the CPU
        return norm_rope_triton(x, weight, eps, cos, sin)

    @torch.library.register_fake("retouch::sdpa_ragged")
    def _sdpa_ragged_fake(q, k, v, lengths_q, lengths_k, scale) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("retouch::gather_host_rows_")
    def _gather_host_rows_fake(dst: torch.Tensor, src: torch.Tensor, src_offsets: torch.Tensor,
                               dst_rows: torch.Tensor, method: str, max_blocks: int = 0) -> None:
        return None
