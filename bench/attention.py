"""Ragged attention benchmark: the Triton kernel against SDPA, FlexAttention and varlen flash attention.

Baselines run in the same process, on the same inputs, timed round-robin with the kernel.

Each request has L tokens; its masked tokens (mask_ratio * L) are the queries and all L tokens are the
keys. Scenarios: every request at one mask ratio, and "mixed" (requests cycle through the ratios, the
case serving sees). Methods:
- ragged_triton: `ragged_attention_with_plan`. The launch config comes from a RaggedAttentionTuner
  (candidates timed once per tuning key on CUDA; the table elsewhere or with --no-tune) and the plan
  is built once per batch, as an engine builds it once per step for all layers.
- ragged_triton_unplanned: `ragged_attention`, which validates cu_seqlens (a host sync) and builds the
  query block map on every call: what the plan saves. Not part of the acceptance checks.
- padded_sdpa: pad every request's queries to the longest, one SDPA call, unpad. Every request has L
  keys, so nothing on the key side is padded and no mask is needed (SDPA keeps its fastest kernels);
  the timing includes the pad and unpad copies an engine would pay.
- per_request_sdpa: `ragged_attention_sdpa`, one SDPA call per request.
- flex_attention: FlexAttention over the packed layout with a document mask (query row and key row
  attend iff they belong to the same request), its block mask built once per batch. torch.compile on
  CUDA, with dynamic shapes by default (a few compiles in all instead of one per point); eager on
  the CPU, where it materialises the scores.
- flash_attn_varlen: `flash_attn_varlen_func` on the packed layout, where flash-attn imports (CUDA, 16-bit).
- torch_varlen: `torch.nn.attention.varlen.varlen_attn` on the packed layout (torch's own flash kernels,
  CUDA, 16-bit): the varlen baseline of a machine without flash-attn (the GPU machines' image has none).
- cudnn_varlen (only when named in --methods): cuDNN's SDPA on the packed layout with ragged offsets
  (`aten::_cudnn_attention_forward` given cumulative lengths, what torch's nested-tensor SDPA calls; CUDA,
  16-bit): cuDNN's Hopper kernel without padding, which torch's own varlen_attn leaves off in 2.11. On an
  H200 with torch 2.11 it took 45-80 ms per call at every point (torch builds a cuDNN graph per call on
  this path): 100x the others, and two thirds of a sweep's time, so the default sweep leaves it out.
Each output is compared with `ragged_attention_ref` (fp32 math) before timing, against flash-attention's
tolerance rule: twice the error of the same math in the input dtype plus twice the output rounding.
Two times per method: `ms_p50`/`ms_p95`, one call from an idle device (its launch latency: what a
forward that waits on the host pays), and `ms_steady`, per call of bursts of back-to-back calls (the
launches queue up, so this is the device's time wherever the device is slower than the host: what an
engine running ahead of the device pays). On an H200 (stop 47) the first was a 0.1-0.3 ms launch floor at
most points and scattered by up to 1.3x between two calls of the same code; the kernels themselves took
0.02-0.5 ms. TFLOP/s counts useful work only (4 * heads * head_dim * sum of n_q * n_k), the same for every
method, over `ms_steady`. Ratios are speedups over `ms_steady`, baseline ms / ragged_triton ms: >= 1 means
ragged attention is at least as fast.

The summary applies the issue's acceptance checks to the data: ragged_triton at least as fast as
padded_sdpa at every point, and within 10% of the best baseline at mask ratio 1.

A GPU benchmark in truth; `--quick` runs tiny sizes on the CPU under the Triton interpreter.

    retouch bench attention [--quick] [--device cuda|cpu] [--methods M ...] [--max-points N] [--out F.json]

Prints one JSON object; with `--out F.json` also writes it to F.json and, when matplotlib is
importable, a plot to F.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import statistics
import sys
import time
import types
import typing
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from retouch.bench.report import (DTYPE_CHOICES, device_arg, device_name, environment, json_text, out_path, pyplot,
                                  write_json)
from retouch.bench.timing import seconds_of
from retouch.errors import ArgumentParser, InputError
from retouch.progress import bar, note

# Heads per head_dim as in the models served: Flux 24 x 128, SDXL's first transformer level 10 x 64.
HEADS_FOR_HEAD_DIM = {64: 10, 128: 24}
# retouch_auto: what the engine runs (`retouch.ops.plan_attention` "auto" with the model's heads: the
# measured choice among the kernel, padded SDPA and SDPA per request on GPUs in ops.ATTENTION_COSTS).
METHODS = ("ragged_triton", "ragged_triton_unplanned", "retouch_auto", "padded_sdpa", "per_request_sdpa",
           "flex_attention", "flash_attn_varlen", "torch_varlen", "cudnn_varlen")
DEFAULT_METHODS = tuple(name for name in METHODS if name != "cudnn_varlen")  # see the module's doc
BASELINES = ("padded_sdpa", "per_request_sdpa", "flex_attention", "flash_attn_varlen", "torch_varlen",
             "cudnn_varlen")
# The acceptance at mask ratio 1: ragged_triton within 10% of the best baseline.
M1_MIN_SPEEDUP_VS_BEST = 0.9


@dataclasses.dataclass(slots=True)
class BenchConfig:
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    dtype: str = "bfloat16"
    # L, tokens per request; Flux at 1024x1024 has 4096 image tokens
    tokens_per_request: list[int] = dataclasses.field(default_factory=lambda: [1024, 2048, 4096])
    batch_sizes: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 4, 8])
    head_dims: list[int] = dataclasses.field(default_factory=lambda: [64, 128])
    mask_ratios: list[float] = dataclasses.field(default_factory=lambda: [0.05, 0.1, 0.2, 0.5, 1.0])
    methods: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_METHODS))
    heads: int | None = None  # None: HEADS_FOR_HEAD_DIM (16 for other head sizes)
    tune: bool = True  # time launch configs per tuning key (CUDA only); --no-tune: the launch-config table
    flex_compile: str = "dynamic"  # FlexAttention's torch.compile on CUDA: "dynamic", or "static" (a compile per point)
    max_points: int | None = None  # stop after this many points (a smoke run of a GPU sweep)
    warmup: int = 3
    iters: int = 20
    bursts: int = 5  # ms_steady: the median of this many bursts
    burst: int = 10  # calls per burst
    seed: int = 0

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype}")
        for name in ("tokens_per_request", "batch_sizes", "head_dims", "mask_ratios", "methods"):
            if not getattr(self, name):
                raise ValueError(f"{name} must not be empty")
        if min(self.tokens_per_request) < 1 or min(self.batch_sizes) < 1 or min(self.head_dims) < 1:
            raise ValueError("tokens_per_request, batch_sizes and head_dims must be >= 1")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError(f"iters must be >= 1 and warmup >= 0, got {self.iters} and {self.warmup}")
        if self.bursts < 1 or self.burst < 1:
            raise ValueError(f"bursts and burst must be >= 1, got {self.bursts} and {self.burst}")
        if not all(0.0 < r <= 1.0 for r in self.mask_ratios):
            raise ValueError(f"mask ratios must lie in (0, 1], got {self.mask_ratios}")
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown or "ragged_triton" not in self.methods:
            raise ValueError(f"methods must include ragged_triton and come from {list(METHODS)}, got {self.methods}")
        if self.flex_compile not in ("dynamic", "static"):
            raise ValueError(f"flex_compile must be dynamic or static, got {self.flex_compile}")
        if self.heads is not None and self.heads < 1:
            raise ValueError(f"heads must be >= 1, got {self.heads}")
        if self.max_points is not None and self.max_points < 1:
            raise ValueError(f"max_points must be >= 1, got {self.max_points}")

    @classmethod
    def quick(cls, device: str) -> BenchConfig:
        """Tiny sizes that the Triton interpreter gets through in seconds."""
        return cls(device=device, tokens_per_request=[64], batch_sizes=[1, 3], head_dims=[64], mask_ratios=[0.2, 1.0],
                   heads=2, warmup=1, iters=2, bursts=1, burst=2)


def _flag_options(hint) -> dict:
    """argparse options for a BenchConfig field of type `hint`."""
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(hint) is list:
        return {"type": typing.get_args(hint)[0], "nargs": "+"}
    if isinstance(hint, types.UnionType):  # `int | None`
        return {"type": next(arg for arg in typing.get_args(hint) if arg is not type(None))}
    return {"type": hint}


CONFIG_HELP = {  # BenchConfig's fields as options (their defaults in parentheses: argparse's are None, "not given")
    "tokens_per_request": "tokens per request, L (1024 2048 4096; Flux at 1024 px has 4096 image tokens)",
    "batch_sizes": "requests per packed batch (1 2 4 8)",
    "head_dims": "head dimensions (64 128)",
    "mask_ratios": "fractions of each request's tokens that query (0.05 0.1 0.2 0.5 1.0)",
    "methods": f"methods to time ({' '.join(METHODS)}; default: all but cudnn_varlen)",
    "heads": "attention heads (by head dimension, as the models have them)",
    "tune": "time launch configs per tuning key, CUDA only (--no-tune: the launch-config table)",
    "flex_compile": "FlexAttention's torch.compile on CUDA: dynamic, or static (a compile per point)",
    "max_points": "stop after this many points (a smoke run of a GPU sweep)",
    "warmup": "untimed calls per point (3)",
    "iters": "timed calls per point, each from an idle device: ms_p50, ms_p95 (20)",
    "bursts": "bursts of back-to-back calls per point: ms_steady is their median per call (5)",
    "burst": "calls per burst (10)",
    "seed": "seeds the random queries, keys and values (0)",
}


def parse_args(argv: list[str] | None) -> tuple[BenchConfig, bool, Path | None]:
    parser = ArgumentParser(prog="retouch bench attention", description=__doc__)
    hints = typing.get_type_hints(BenchConfig)
    shared = {"device": {"type": device_arg}, "dtype": {"choices": DTYPE_CHOICES}}
    for field in dataclasses.fields(BenchConfig):
        parser.add_argument("--" + field.name.replace("_", "-"), default=None, help=CONFIG_HELP.get(field.name),
                            **shared.get(field.name, _flag_options(hints[field.name])))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU interpreter smoke run)")
    parser.add_argument("--out", type=out_path, default=None, help="also write the JSON here, and a PNG beside it")
    args = parser.parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(BenchConfig)
                 if getattr(args, f.name) is not None}
    device = overrides.pop("device", BenchConfig().device)
    try:
        base = BenchConfig.quick(device) if args.quick else BenchConfig(device=device)
        return dataclasses.replace(base, **overrides), args.quick, args.out
    except ValueError as exc:
        parser.error(str(exc))


def scenarios(ratios: list[float], batch: int, tokens: int) -> dict[str, list[int]]:
    """Scenario name -> masked tokens (queries) per request."""
    masked = lambda ratio: max(1, round(ratio * tokens))  # noqa: E731
    named = {f"{ratio:g}": [masked(ratio)] * batch for ratio in ratios}
    named["mixed"] = [masked(ratios[i % len(ratios)]) for i in range(batch)]
    return named


@dataclasses.dataclass(slots=True)
class Layout:
    """One scenario's packed batch, shared by every head size: L keys and query_lens[b] queries per request."""

    tokens: int  # L
    scenario: str
    query_lens: list[int]
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    cu_seqlens_k: torch.Tensor  # [B+1] int32
    block_mask: object | None  # FlexAttention's BlockMask, where flex_attention runs

    @property
    def batch(self) -> int:
        return len(self.query_lens)


def document_block_mask(query_lens: list[int], tokens: int, device: torch.device):
    """FlexAttention's view of the packed batch: query row i and key row j attend iff same request."""
    from torch.nn.attention.flex_attention import create_block_mask

    requests = torch.arange(len(query_lens), device=device)
    request_of_query = torch.repeat_interleave(requests, torch.tensor(query_lens, device=device))
    request_of_key = torch.repeat_interleave(requests, tokens)

    # One code object for every batch: torch.compile guards a closure on its code, not its identity,
    # so a new batch's mask does not recompile.
    def same_request(b, h, q_idx, kv_idx):
        return request_of_query[q_idx] == request_of_key[kv_idx]

    return create_block_mask(same_request, None, None, len(request_of_query), len(request_of_key), device=device)


def make_layout(tokens: int, scenario: str, query_lens: list[int], device: torch.device, flex: bool) -> Layout:
    cu_q = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=device)
    cu_k = torch.arange(0, (len(query_lens) + 1) * tokens, tokens, dtype=torch.int32, device=device)
    block_mask = document_block_mask(query_lens, tokens, device) if flex else None
    return Layout(tokens, scenario, query_lens, cu_q, cu_k, block_mask)


@dataclasses.dataclass(slots=True)
class Methods:
    """What the methods need beyond a point's tensors, set up once per run, and which cannot run here."""

    names: list[str]  # the methods that run, in METHODS order
    unavailable: dict[str, str]  # method -> why it cannot run here
    tuner: object | None  # RaggedAttentionTuner, with --tune
    flex: Callable | None  # flex_attention, compiled on CUDA
    flex_compile: str | None  # "dynamic", "static" or "eager"
    flash_attn_varlen: Callable | None
    torch_varlen: Callable | None


def setup_methods(config: BenchConfig, device: torch.device) -> Methods:
    from retouch.kernels.ragged_attention import RaggedAttentionTuner

    unavailable, flex, flex_compile, flash = {}, None, None, None
    if "flex_attention" in config.methods:
        try:
            from torch.nn.attention.flex_attention import flex_attention
        except ImportError as error:
            unavailable["flex_attention"] = f"ImportError: {error}"
        else:
            if device.type == "cuda":
                flex_compile = config.flex_compile
                flex = torch.compile(flex_attention, dynamic=flex_compile == "dynamic")
            else:
                # Compiling flex for the CPU takes minutes of C++ builds; eager is the same math.
                flex, flex_compile = flex_attention, "eager"
    if "flash_attn_varlen" in config.methods:
        if device.type != "cuda" or config.dtype == "float32":
            unavailable["flash_attn_varlen"] = "flash-attn runs on CUDA in fp16/bf16 only"
        else:
            try:
                from flash_attn import flash_attn_varlen_func as flash
            except Exception as error:  # ImportError, or a build whose CUDA library does not load
                unavailable["flash_attn_varlen"] = f"{type(error).__name__}: {error}"
    varlen = None
    if "torch_varlen" in config.methods:
        if device.type != "cuda" or config.dtype == "float32":
            unavailable["torch_varlen"] = "torch's varlen_attn runs on CUDA in fp16/bf16 only"
        else:
            try:
                from torch.nn.attention.varlen import varlen_attn as varlen
            except ImportError as error:  # torch before 2.10
                unavailable["torch_varlen"] = f"ImportError: {error}"
    if "cudnn_varlen" in config.methods:
        if device.type != "cuda" or config.dtype == "float32":
            unavailable["cudnn_varlen"] = "cuDNN's attention runs on CUDA in fp16/bf16 only"
        elif not hasattr(torch.ops.aten, "_cudnn_attention_forward"):
            unavailable["cudnn_varlen"] = f"torch {torch.__version__} has no aten::_cudnn_attention_forward"
        elif (reason := probe_cudnn_varlen(config.dtype)) is not None:
            unavailable["cudnn_varlen"] = reason
    names = [name for name in METHODS if name in config.methods and name not in unavailable]
    tuner = RaggedAttentionTuner() if config.tune else None
    return Methods(names, unavailable, tuner, flex, flex_compile, flash, varlen)


def padded_sdpa_fn(q, k, v, query_lens: list[int]) -> Callable[[], torch.Tensor]:
    """Pad queries to the longest request, one SDPA call, unpad (`retouch.ops.sdpa_padded`, which the engine
    also runs where it measures faster). `q: [T_q, H, D]`, `k, v: [B*L, H, D]`."""
    from retouch import ops

    batch = len(query_lens)
    plan = ops.with_padded_queries(ops.plan_attention(query_lens, [k.shape[0] // batch] * batch, q.device, q.dtype,
                                                      q.shape[-1], backend="sdpa"))
    return lambda: ops.planned_attention(q, k, v, plan)


def flex_attention_fn(flex: Callable, q, k, v, block_mask) -> Callable[[], torch.Tensor]:
    """FlexAttention on `[1, H, T, D]` views of the packed `[T, H, D]` tensors; the output as `[T_q, H, D]`."""
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    return lambda: flex(q4, k4, v4, block_mask=block_mask)[0].transpose(0, 1)


def method_runs(methods: Methods, layout: Layout, q, k, v, launch) -> dict[str, Callable[[], torch.Tensor]]:
    """The runs of every method at one point, each returning `[T_q, H, D]`."""
    from retouch import ops
    from retouch.kernels.ragged_attention import (
        plan_ragged_attention,
        ragged_attention,
        ragged_attention_sdpa,
        ragged_attention_with_plan,
    )

    cu_q, cu_k, tokens = layout.cu_seqlens_q, layout.cu_seqlens_k, layout.tokens
    max_q = max(layout.query_lens)
    plan = plan_ragged_attention(cu_q, cu_k, max_q, tokens, launch)
    auto = ops.plan_attention(layout.query_lens, [tokens] * layout.batch, q.device, q.dtype, q.shape[2],
                              cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, heads=q.shape[1])
    runs = {
        "ragged_triton": lambda: ragged_attention_with_plan(q, k, v, plan),
        "retouch_auto": lambda: ops.planned_attention(q, k, v, auto),
        "ragged_triton_unplanned": lambda: ragged_attention(q, k, v, cu_q, cu_k, max_q, tokens, config=launch),
        "padded_sdpa": padded_sdpa_fn(q, k, v, layout.query_lens),
        "per_request_sdpa": lambda: ragged_attention_sdpa(q, k, v, cu_q, cu_k),
    }
    if methods.flex is not None:
        runs["flex_attention"] = flex_attention_fn(methods.flex, q, k, v, layout.block_mask)
    if methods.flash_attn_varlen is not None:
        runs["flash_attn_varlen"] = lambda: methods.flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, tokens)
    if methods.torch_varlen is not None:
        runs["torch_varlen"] = lambda: methods.torch_varlen(q, k, v, cu_q, cu_k, max_q, tokens)
    if "cudnn_varlen" in methods.names:
        runs["cudnn_varlen"] = cudnn_varlen_fn(q, k, v, cu_q, cu_k, max_q, tokens)
    return {name: runs[name] for name in methods.names}


# Run in a process of its own before the sweep: a fault inside cuDNN would leave the sweep's CUDA context
# unusable for every method after it.
CUDNN_PROBE = """
import sys
import torch
from retouch.bench.attention import cudnn_varlen_fn
from retouch.kernels.ragged_attention import ragged_attention_ref

dtype = getattr(torch, sys.argv[1])
cu_q = torch.tensor([0, 3, 8, 17], dtype=torch.int32, device="cuda")
cu_k = torch.tensor([0, 12, 24, 36], dtype=torch.int32, device="cuda")
for head_dim in (64, 128):
    q, k, v = (torch.randn(rows, 4, head_dim, device="cuda", dtype=dtype) for rows in (17, 36, 36))
    out = cudnn_varlen_fn(q, k, v, cu_q, cu_k, 9, 12)()
    error = (out.float() - ragged_attention_ref(q.float(), k.float(), v.float(), cu_q, cu_k)).abs().max().item()
    if not error < 0.05:
        sys.exit(f"head_dim {head_dim}: {error:.3g} off the reference")
"""


def probe_cudnn_varlen(dtype: str, timeout_s: float = 300.0) -> str | None:
    """Why cuDNN's varlen attention cannot be timed here (it failed, or missed the reference, on a small ragged
    batch in a process of its own); None where it ran and matched."""
    import subprocess

    try:
        done = subprocess.run([sys.executable, "-c", CUDNN_PROBE, dtype], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"probe: no answer in {timeout_s:.0f} s"
    if done.returncode == 0:
        return None
    said = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
    return f"probe: {said[-1][:300]}"


def cudnn_varlen_fn(q, k, v, cu_q, cu_k, max_q: int, max_k: int) -> Callable[[], torch.Tensor]:
    """cuDNN's SDPA over the packed `[T, H, D]` rows (`retouch.ops.cudnn_varlen`, the "cudnn" backend)."""
    from retouch import ops

    scale = q.shape[-1] ** -0.5
    return lambda: ops.cudnn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale)


def check_against_reference(runs: dict[str, Callable[[], torch.Tensor]], q, k, v, cu_q,
                            cu_k) -> tuple[dict[str, float], float, dict[str, str]]:
    """Run each method once (compiling it) against the fp32 oracle.

    Returns (max abs diff per method, the tolerance, error per method that raised: out of memory, a
    compile failure). The tolerance is flash-attention's: twice the error of the same math in the input
    dtype plus twice the rounding of the exact answer to it (fp32: torch.testing's atol 1e-5).
    """
    from retouch.kernels.ragged_attention import ragged_attention_ref

    oracle = ragged_attention_ref(q.float(), k.float(), v.float(), cu_q, cu_k)
    if q.dtype == torch.float32:
        tolerance = 1e-5
    else:
        plain = ragged_attention_ref(q, k, v, cu_q, cu_k, upcast=False)
        rounding = (oracle.to(q.dtype).float() - oracle).abs().max().item()
        tolerance = 2 * (plain.float() - oracle).abs().max().item() + 2 * rounding
        del plain
    diffs, errors = {}, {}
    for name, run in runs.items():
        try:
            out = run()
        except Exception as error:  # one method failing at one point must not lose the sweep
            errors[name] = f"{type(error).__name__}: {error}"[:2000]
            note(f"attention: {name} failed: {errors[name][:300]}")
            continue
        diffs[name] = (out.float() - oracle).abs().max().item()
    return diffs, tolerance, errors


def time_methods(runs: dict[str, Callable[[], object]], device: torch.device, warmup: int,
                 iters: int) -> dict[str, list[float]]:
    """ms per call of each run after `warmup` calls each; timed round-robin, so background load falls
    on all alike. CUDA events around each call, with the device idle before it."""
    for run in runs.values():
        for _ in range(warmup):
            run()
    samples = {name: [] for name in runs}
    for _ in range(iters):
        for name, run in runs.items():
            samples[name].append(1e3 * seconds_of(run, device))
    return samples


def steady_ms(runs: dict[str, Callable[[], object]], device: torch.device, bursts: int, burst: int) -> dict[str, float]:
    """ms per call of each run in steady state: the median over `bursts` bursts (round-robin) of `burst`
    back-to-back calls, timed as one."""
    samples = {name: [] for name in runs}
    for _ in range(bursts):
        for name, run in runs.items():
            samples[name].append(1e3 * seconds_of(functools.partial(_repeat, run, burst), device) / burst)
    return {name: statistics.median(values) for name, values in samples.items()}


def _repeat(run: Callable[[], object], times: int) -> None:
    for _ in range(times):
        run()


def percentile(sorted_values: list[float], fraction: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, round(fraction * (len(sorted_values) - 1)))]


def bench_point(config: BenchConfig, methods: Methods, layout: Layout, head_dim: int) -> dict:
    from retouch.kernels.ragged_attention import device_capability, launch_config

    started = time.perf_counter()
    device, dtype, tokens = torch.device(config.device), getattr(torch, config.dtype), layout.tokens
    heads = config.heads if config.heads is not None else HEADS_FOR_HEAD_DIM.get(head_dim, 16)
    generator = torch.Generator(device).manual_seed(config.seed)
    q, k, v = (torch.randn(rows, heads, head_dim, generator=generator, device=device, dtype=dtype)
               for rows in (sum(layout.query_lens), layout.batch * tokens, layout.batch * tokens))
    cu_q, cu_k, max_q = layout.cu_seqlens_q, layout.cu_seqlens_k, max(layout.query_lens)
    if methods.tuner is not None:
        tuned = methods.tuner.result_for(q, k, v, cu_q, cu_k, max_q, tokens)
        launch, source = tuned.config, tuned.source
    else:
        launch, source = launch_config(head_dim, dtype, device_capability(device)), "table"

    runs = method_runs(methods, layout, q, k, v, launch)
    diffs, tolerance, errors = check_against_reference(runs, q, k, v, cu_q, cu_k)
    runs = {name: run for name, run in runs.items() if name not in errors}
    samples = time_methods(runs, device, config.warmup, config.iters)
    steady = steady_ms(runs, device, config.bursts, config.burst)

    tflop = 4 * heads * head_dim * sum(n_q * tokens for n_q in layout.query_lens) / 1e12
    p50 = {name: statistics.median(times) for name, times in samples.items()}
    p95 = {name: percentile(sorted(times), 0.95) for name, times in samples.items()}
    ragged = steady.get("ragged_triton")
    baselines = {name: ms for name, ms in steady.items() if name in BASELINES}
    best = min(baselines, key=baselines.get) if baselines else None
    return {
        "tokens_per_request": tokens, "head_dim": head_dim, "heads": heads, "batch": layout.batch,
        "mask_ratio": layout.scenario, "query_lens": layout.query_lens, "tflop": tflop,
        "launch_config": launch.name, "launch_config_source": source,
        "ms_p50": p50, "ms_p95": p95, "ms_steady": steady,
        "tflops": {name: tflop / (ms / 1e3) for name, ms in steady.items()},
        "speedup_vs_padded_sdpa": steady["padded_sdpa"] / ragged if ragged and "padded_sdpa" in steady else None,
        "best_baseline": best,
        "speedup_vs_best_baseline": baselines[best] / ragged if ragged and best else None,
        "auto_speedup_vs_padded_sdpa": (steady["padded_sdpa"] / steady["retouch_auto"]
                                        if "retouch_auto" in steady and "padded_sdpa" in steady else None),
        "auto_speedup_vs_best_baseline": baselines[best] / steady["retouch_auto"] if "retouch_auto" in steady
        and best else None,
        # The same ratio from one call each from an idle device: the launch latency's share.
        "latency_speedup_vs_padded_sdpa": p50["padded_sdpa"] / p50["ragged_triton"]
        if "ragged_triton" in p50 and "padded_sdpa" in p50 else None,
        "max_abs_diff_vs_reference": diffs, "tolerance": tolerance,
        "matches_reference": {name: diff <= tolerance for name, diff in diffs.items()},
        "errors": errors,
        "wall_s": time.perf_counter() - started,
    }


def point_label(row: dict) -> str:
    return f"L={row['tokens_per_request']} d={row['head_dim']} B={row['batch']} m={row['mask_ratio']}"


def summarize(results: list[dict]) -> dict:
    """The issue's acceptance checks computed from the points. A point where a needed method did not
    run counts as a failure."""
    vs_padded = [row for row in results if row["speedup_vs_padded_sdpa"] is not None]
    worst = min(vs_padded, key=lambda row: row["speedup_vs_padded_sdpa"], default=None)
    m1 = [row for row in results if row["mask_ratio"] == "1"]
    m1_measured = [row for row in m1 if row["speedup_vs_best_baseline"] is not None]
    m1_worst = min(m1_measured, key=lambda row: row["speedup_vs_best_baseline"], default=None)
    summary = {
        "criteria": "speedup = baseline ms / ragged_triton ms (ms_steady); pass: >= 1 vs padded_sdpa at every point, "
                    f">= {M1_MIN_SPEEDUP_VS_BEST} vs the best baseline at every mask-ratio-1 point",
        "points": len(results),
        "all_points_at_least_padded_sdpa": bool(results) and len(vs_padded) == len(results)
        and all(row["speedup_vs_padded_sdpa"] >= 1.0 for row in vs_padded),
        "worst_ratio_vs_padded": worst and worst["speedup_vs_padded_sdpa"],
        "worst_point_vs_padded": worst and point_label(worst),
        "m1_ratio_vs_best_baseline_min": m1_worst and m1_worst["speedup_vs_best_baseline"],
        "m1_point_vs_best_baseline": m1_worst and f"{point_label(m1_worst)} vs {m1_worst['best_baseline']}",
        "m1_within_10pct_of_best_baseline": bool(m1) and len(m1_measured) == len(m1)
        and m1_worst["speedup_vs_best_baseline"] >= M1_MIN_SPEEDUP_VS_BEST,
        "all_outputs_match_reference": all(all(row["matches_reference"].values()) for row in results),
        "errors": sum(len(row["errors"]) for row in results),
    }
    # The same two ratios for what the engine runs (the measured choice), where it was timed.
    auto = [row for row in results if row.get("auto_speedup_vs_padded_sdpa") is not None]
    auto_m1 = [row for row in m1 if row.get("auto_speedup_vs_best_baseline") is not None]
    summary["auto_worst_ratio_vs_padded"] = min((row["auto_speedup_vs_padded_sdpa"] for row in auto), default=None)
    summary["auto_m1_ratio_vs_best_baseline_min"] = min((row["auto_speedup_vs_best_baseline"] for row in auto_m1),
                                                        default=None)
    summary["acceptance_passed"] = (summary["all_points_at_least_padded_sdpa"]
                                    and summary["m1_within_10pct_of_best_baseline"]
                                    and summary["all_outputs_match_reference"] and summary["errors"] == 0)
    return summary


def sweep_points(config: BenchConfig) -> list[tuple[tuple[int, str, tuple[int, ...]], int]]:
    """((L, scenario, query_lens), head_dim) in run order, at most max_points; head sizes innermost so
    that both share one layout (and one FlexAttention block mask)."""
    points = [((tokens, scenario, tuple(query_lens)), head_dim)
              for tokens in config.tokens_per_request
              for batch in config.batch_sizes
              for scenario, query_lens in scenarios(config.mask_ratios, batch, tokens).items()
              for head_dim in config.head_dims]
    return points[:config.max_points]


def write_plot(report: dict, path: Path) -> str | None:
    """TFLOP/s per scenario and method: a row per (head_dim, L), a column per batch size. Returns the
    path, or None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    rows = report["results"]
    panel_rows = sorted({(r["head_dim"], r["tokens_per_request"]) for r in rows})
    panel_cols = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(len(panel_rows), len(panel_cols), figsize=(3.6 * len(panel_cols), 2.8 * len(panel_rows)),
                             squeeze=False)
    for (i, (head_dim, tokens)), (j, batch) in itertools.product(enumerate(panel_rows), enumerate(panel_cols)):
        ax = axes[i][j]
        selected = [r for r in rows
                    if (r["head_dim"], r["tokens_per_request"], r["batch"]) == (head_dim, tokens, batch)]
        for name in report["methods"]:
            points = [(r["mask_ratio"], r["tflops"][name]) for r in selected if name in r["tflops"]]
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=name)
        ax.set_title(f"d={head_dim}, L={tokens}, B={batch}", fontsize=9)
        ax.tick_params(labelsize=7)
        if j == 0:
            ax.set_ylabel("TFLOP/s (useful)", fontsize=8)
        if i == len(panel_rows) - 1:
            ax.set_xlabel("mask ratio", fontsize=8)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"ragged attention, {report['device']}, {report['config']['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def main(argv: list[str] | None = None) -> dict:
    started = time.perf_counter()
    config, quick, out = parse_args(argv)
    device = torch.device(config.device)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:  # `retouch bench` loaded it already: its kernels would not be interpreted
            raise InputError("on a CPU the Triton kernel runs in Triton's interpreter, chosen when Triton loads: "
                             "run it as TRITON_INTERPRET=1 retouch bench attention ...")
        # The kernel module picks the interpreter when it is imported, so decide before importing it.
        os.environ["TRITON_INTERPRET"] = "1"
    from torch._dynamo import config as dynamo_config

    from retouch.kernels.ragged_attention import KERNEL_INTERPRETED

    methods = setup_methods(config, device)
    graphs_before = _compiled_graphs()
    # A compile past dynamo's recompile limit would fall back to eager flex (materialised scores,
    # other timings) without a word; make it an error that the point records instead. Not for eager
    # flex: it compiles a tracing wrapper per shape itself, and its fallback is the same math.
    limits = {}
    if methods.flex_compile in ("dynamic", "static"):
        limits["fail_on_recompile_limit_hit"] = True
    if methods.flex_compile == "static":
        limits["recompile_limit"] = limits["accumulated_recompile_limit"] = 100_000
    results = []
    points = sweep_points(config)
    swept = bar(desc="attention: ragged vs baselines", total=len(points), unit="point")
    with dynamo_config.patch(**limits), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        for (tokens, scenario, query_lens), group in itertools.groupby(points, key=lambda p: p[0]):
            layout = make_layout(tokens, scenario, list(query_lens), device, methods.flex is not None)
            for _, head_dim in group:
                results.append(bench_point(config, methods, layout, head_dim))
                swept.set_postfix_str(point_label(results[-1]), refresh=False)
                swept.update()
    swept.close()
    report = {
        "benchmark": "ragged_attention",
        "environment": environment("attention", argv, device),
        "device": device_name(device),
        "triton_interpreted": KERNEL_INTERPRETED,
        "quick": quick,
        "config": dataclasses.asdict(config),
        "methods": methods.names,
        "baselines": [name for name in methods.names if name in BASELINES],
        "unavailable": methods.unavailable,
        "flex_compile": methods.flex_compile,
        # torch.compile graphs made during the sweep; on CUDA, FlexAttention's (eager flex traces its own).
        "dynamo_graphs_compiled": _compiled_graphs() - graphs_before,
        "tuning": [result.to_json() for result in methods.tuner.results.values()] if methods.tuner else [],
        "summary": summarize(results),
        "results": results,
    }
    report["wall_s"] = time.perf_counter() - started
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        report["plot"] = write_plot(report, out.with_suffix(".png"))
        write_json(report, out)
    print(json_text(report))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
