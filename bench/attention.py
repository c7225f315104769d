"""Ragged attention benchmark: the Triton kernel against padded SDPA and per-request SDPA.

Each request has L tokens; its masked tokens (mask_ratio * L) are the queries and all L tokens are the
keys. Scenarios: every request at one mask ratio, and "mixed" (requests cycle through the ratios, the
case serving sees). Baselines, measured in the same run:
- padded_sdpa: pad every request's queries to the longest, one SDPA call with a boolean key mask;
  the timing includes the pad and unpad copies an engine would pay.
- per_request_sdpa: `ragged_attention_sdpa`, one SDPA call per request.
TFLOP/s counts useful work only (4 * heads * head_dim * sum of n_q * n_k), the same for every method.

A GPU benchmark in truth; `--quick` runs tiny sizes on the CPU under the Triton interpreter.

    retouch bench attention [--quick] [--device cuda|cpu] [--out results.json]

Prints one JSON object; with `--out F.json` also writes it to F.json and, when matplotlib is
importable, a plot to F.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from retouch.bench.report import pyplot, write_json
from retouch.bench.timing import seconds_of

# Heads per head_dim as in the models served: Flux 24 x 128, SDXL's first transformer level 10 x 64.
HEADS_FOR_HEAD_DIM = {64: 10, 128: 24}


@dataclasses.dataclass(slots=True)
class BenchConfig:
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    dtype: str = "bfloat16"
    tokens_per_request: int = 4096  # L: Flux at 1024x1024 has 4096 image tokens
    batch_sizes: list[int] = dataclasses.field(default_factory=lambda: [1, 4, 8])
    head_dims: list[int] = dataclasses.field(default_factory=lambda: [64, 128])
    mask_ratios: list[float] = dataclasses.field(default_factory=lambda: [0.05, 0.2, 0.5, 1.0])
    heads: int = 0  # 0: HEADS_FOR_HEAD_DIM
    warmup: int = 5
    iters: int = 20
    seed: int = 0

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype}")
        if self.tokens_per_request < 1 or min(self.batch_sizes) < 1 or self.iters < 1 or self.warmup < 0:
            raise ValueError("tokens_per_request, batch_sizes and iters must be >= 1, warmup >= 0")
        if not all(0.0 < r <= 1.0 for r in self.mask_ratios):
            raise ValueError(f"mask ratios must lie in (0, 1], got {self.mask_ratios}")

    @classmethod
    def quick(cls, device: str) -> BenchConfig:
        """Tiny sizes that the Triton interpreter gets through in seconds."""
        return cls(device=device, tokens_per_request=64, batch_sizes=[2, 3], head_dims=[64], heads=2,
                   warmup=1, iters=3)


def parse_args(argv: list[str] | None) -> tuple[BenchConfig, bool, Path | None]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = BenchConfig()
    for field in dataclasses.fields(BenchConfig):
        flag = "--" + field.name.replace("_", "-")
        value = getattr(defaults, field.name)
        if isinstance(value, list):
            parser.add_argument(flag, type=type(value[0]), nargs="+", default=None)
        else:
            parser.add_argument(flag, type=type(value), default=None)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU interpreter smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here, and a PNG beside it")
    args = parser.parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(BenchConfig)
                 if getattr(args, f.name) is not None}
    device = overrides.pop("device", defaults.device)
    base = BenchConfig.quick(device) if args.quick else BenchConfig(device=device)
    return dataclasses.replace(base, **overrides), args.quick, args.out


def measure_ms(fn, device: torch.device, warmup: int, iters: int) -> list[float]:
    """Wall time of `fn()` per call in ms, synchronised; CUDA events on a GPU."""
    for _ in range(warmup):
        fn()
    return [1e3 * seconds_of(fn, device) for _ in range(iters)]


def scenarios(ratios: list[float], batch: int, tokens: int) -> dict[str, list[int]]:
    """Scenario name -> masked tokens (queries) per request."""
    masked = lambda ratio: max(1, round(ratio * tokens))  # noqa: E731
    named = {f"{ratio:g}": [masked(ratio)] * batch for ratio in ratios}
    named["mixed"] = [masked(ratios[i % len(ratios)]) for i in range(batch)]
    return named


def padded_sdpa_fn(q, k, v, query_lens: list[int], tokens: int):
    """Pad queries to the longest request, one masked SDPA call, unpad. k, v: [B*L, H, D]."""
    batch, heads, head_dim = len(query_lens), q.shape[1], q.shape[2]
    max_q = max(query_lens)
    # Row of each packed query in the padded [B * max_q] layout.
    pad_rows = torch.cat([b * max_q + torch.arange(n, device=q.device) for b, n in enumerate(query_lens)])
    key_valid = torch.ones(batch, 1, 1, tokens, dtype=torch.bool, device=q.device)
    k_batched = k.view(batch, tokens, heads, head_dim).transpose(1, 2)
    v_batched = v.view(batch, tokens, heads, head_dim).transpose(1, 2)

    def run():
        q_pad = q.new_zeros(batch * max_q, heads, head_dim).index_copy_(0, pad_rows, q)
        q_pad = q_pad.view(batch, max_q, heads, head_dim).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q_pad, k_batched, v_batched, attn_mask=key_valid)
        return out.transpose(1, 2).reshape(batch * max_q, heads, head_dim).index_select(0, pad_rows)

    return run


def bench_one(config: BenchConfig, head_dim: int, batch: int, scenario: str, query_lens: list[int]) -> dict:
    from retouch.kernels.ragged_attention import ragged_attention, ragged_attention_sdpa

    device, dtype, tokens = torch.device(config.device), getattr(torch, config.dtype), config.tokens_per_request
    heads = config.heads or HEADS_FOR_HEAD_DIM.get(head_dim, 16)
    generator = torch.Generator().manual_seed(config.seed)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=generator).to(device, dtype)
    k = torch.randn(batch * tokens, heads, head_dim, generator=generator).to(device, dtype)
    v = torch.randn(batch * tokens, heads, head_dim, generator=generator).to(device, dtype)
    cu_q = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.arange(0, (batch + 1) * tokens, tokens, dtype=torch.int32, device=device)

    methods = {
        "ragged_triton": lambda: ragged_attention(q, k, v, cu_q, cu_k, max(query_lens), tokens),
        "padded_sdpa": padded_sdpa_fn(q, k, v, query_lens, tokens),
        "per_request_sdpa": lambda: ragged_attention_sdpa(q, k, v, cu_q, cu_k),
    }
    # Same answer from all three, or the timings mean nothing.
    reference = methods["per_request_sdpa"]().float()
    max_abs_diff = {name: (fn().float() - reference).abs().max().item() for name, fn in methods.items()
                    if name != "per_request_sdpa"}

    tflop = 4 * heads * head_dim * sum(n_q * tokens for n_q in query_lens) / 1e12
    p50 = {}
    p95 = {}
    for name, fn in methods.items():
        times = sorted(measure_ms(fn, device, config.warmup, config.iters))
        p50[name] = statistics.median(times)
        p95[name] = times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]
    return {
        "head_dim": head_dim, "heads": heads, "batch": batch, "mask_ratio": scenario, "query_lens": query_lens,
        "tflop": tflop,
        "ms_p50": p50, "ms_p95": p95,
        "tflops": {name: tflop / (ms / 1e3) for name, ms in p50.items()},
        "speedup_vs_padded_sdpa": p50["padded_sdpa"] / p50["ragged_triton"],
        "speedup_vs_per_request_sdpa": p50["per_request_sdpa"] / p50["ragged_triton"],
        "max_abs_diff_vs_per_request_sdpa": max_abs_diff,
    }


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores)"


def write_plot(report: dict, path: Path) -> str | None:
    """TFLOP/s per scenario, one panel per (head_dim, batch). Returns the path, or None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    rows = report["results"]
    panels = sorted({(r["head_dim"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (head_dim, batch) in zip(axes[0], panels):
        selected = [r for r in rows if r["head_dim"] == head_dim and r["batch"] == batch]
        labels = [r["mask_ratio"] for r in selected]
        for name in ("ragged_triton", "padded_sdpa", "per_request_sdpa"):
            ax.plot(labels, [r["tflops"][name] for r in selected], marker="o", label=name)
        ax.set_title(f"head_dim {head_dim}, batch {batch}")
        ax.set_xlabel("mask ratio")
        ax.set_ylabel("TFLOP/s (useful)")
    axes[0][0].legend()
    fig.suptitle(f"ragged attention, {report['device']}, {report['config']['dtype']}, "
                 f"L={report['config']['tokens_per_request']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def main(argv: list[str] | None = None) -> dict:
    config, quick, out = parse_args(argv)
    device = torch.device(config.device)
    if device.type != "cuda":
        # The kernel module picks the interpreter when it is imported, so decide before importing it.
        os.environ["TRITON_INTERPRET"] = "1"
    from retouch.kernels.ragged_attention import KERNEL_INTERPRETED

    results = []
    for head_dim in config.head_dims:
        for batch in config.batch_sizes:
            for scenario, query_lens in scenarios(config.mask_ratios, batch, config.tokens_per_request).items():
                results.append(bench_one(config, head_dim, batch, scenario, query_lens))
    report = {
        "benchmark": "ragged_attention",
        "device": device_name(device),
        "triton_interpreted": KERNEL_INTERPRETED,
        "quick": quick,
        "torch": torch.__version__,
        "config": dataclasses.asdict(config),
        "results": results,
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        report["plot"] = write_plot(report, out.with_suffix(".png"))
        write_json(report, out)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
