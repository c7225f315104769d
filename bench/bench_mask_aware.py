"""Denoiser latency of one forward: full compute vs mask-aware (Y-cache, KV-cache), over mask ratios.

    python bench/bench_mask_aware.py --model flux-small --ratios 0.05,0.2,0.5,1.0 [--device cuda] [--out F.json]

The template is recorded once (one step), then each ratio's mask (a centred rectangle of tokens, as
real masks are contiguous) is timed in all three modes in the same run, interleaved. Prints one JSON object; the
speedups are the figures to quote, absolute times only from a GPU. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from retouch.adapters import CacheMode, MaskAwareContext, patch_flux
from retouch.cache import InMemoryActivationCache
from retouch.models import build_denoiser, get_spec
from retouch.models.inputs import random_flux_inputs

TEXT_TOKENS = {"tiny-flux-fill": 32, "flux-small": 64, "flux-size": 512}  # max_sequence_length


def centred_rectangle(grid: tuple[int, int], ratio: float) -> torch.Tensor:
    """Row-major indices of a centred rectangle of tokens covering about `ratio` of the grid."""
    rows, cols = grid
    side = max(1, round(math.sqrt(ratio * rows * cols)))
    height, width = min(rows, side), min(cols, max(1, round(ratio * rows * cols / min(rows, side))))
    top, left = (rows - height) // 2, (cols - width) // 2
    r, c = torch.meshgrid(torch.arange(top, top + height), torch.arange(left, left + width), indexing="ij")
    return (r * cols + c).flatten()


def interleaved_medians(runs: dict, repeats: int, device: torch.device) -> dict[str, float]:
    """Median seconds of each run, timed round-robin after one warm-up each, so that load from other
    processes falls on every variant alike and the ratios stay fair."""
    def once(run) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    for run in runs.values():
        once(run)
    samples = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            samples[name].append(once(run))
    return {name: statistics.median(values) for name, values in samples.items()}


def run_with(adapter, context, transformer, inputs):
    with adapter.run(context):
        transformer(**inputs)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="flux-small", choices=sorted(TEXT_TOKENS))
    parser.add_argument("--ratios", default="0.05,0.2,0.5,1.0")
    parser.add_argument("--resolution", type=int, default=None, help="pixels per side (default: the model's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    resolution = args.resolution or get_spec(args.model).resolution
    grid = (resolution // 16, resolution // 16)
    num_image, num_text = grid[0] * grid[1], TEXT_TOKENS[args.model]
    print(f"building {args.model} on {device} ({dtype})", file=sys.stderr)
    transformer = build_denoiser(args.model, device=device, dtype=dtype).eval()
    adapter = patch_flux(transformer)
    inputs = random_flux_inputs(transformer, 1, grid, num_text, seed=0, device=device, dtype=dtype)
    cache = InMemoryActivationCache(device=device)

    with torch.inference_mode():
        print("recording the template", file=sys.stderr)
        with adapter.run(MaskAwareContext.record(["template"], [0], num_text, num_image, cache, device=device)):
            transformer(**inputs)
        results = []
        for ratio in [float(r) for r in args.ratios.split(",")]:
            masked = centred_rectangle(grid, ratio)
            runs = {"full": lambda: transformer(**inputs)}
            for name, mode in (("y_cache", CacheMode.Y_CACHE), ("kv_cache", CacheMode.KV_CACHE)):
                context = MaskAwareContext.edit(mode, [masked], ["template"], [0], num_text, num_image, cache,
                                                device=device)
                runs[name] = functools.partial(run_with, adapter, context, transformer, inputs)
            seconds = interleaved_medians(runs, args.repeats, device)
            row = {"mask_ratio": round(len(masked) / num_image, 4), "masked_tokens": len(masked),
                   "full_s": seconds["full"]}
            for name in ("y_cache", "kv_cache"):
                row[f"{name}_s"] = seconds[name]
                row[f"{name}_speedup"] = round(seconds["full"] / seconds[name], 3)
            print(f"m={row['mask_ratio']}: y {row['y_cache_speedup']}x, kv {row['kv_cache_speedup']}x",
                  file=sys.stderr)
            results.append(row)

    command = "python bench/bench_mask_aware.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = {"bench": "mask_aware_denoiser", "command": command, "model": args.model, "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": str(dtype).removeprefix("torch."), "image_tokens": num_image, "text_tokens": num_text,
              "threads": torch.get_num_threads(), "torch": torch.__version__, "results": results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        report["plot"] = write_plot(report, args.out.with_suffix(".png"))
    print(json.dumps(report))
    return report


def write_plot(report: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return None
    ratios = [row["mask_ratio"] for row in report["results"]]
    figure, axis = plt.subplots(figsize=(5, 3.5))
    for name in ("y_cache", "kv_cache"):
        axis.plot(ratios, [row[f"{name}_speedup"] for row in report["results"]], marker="o", label=name)
    axis.axhline(1.0, color="gray", linewidth=0.8)
    axis.set_xlabel("mask ratio")
    axis.set_ylabel("speedup vs full compute")
    axis.set_title(f"{report['model']} on {report['device_name']}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return str(path)


if __name__ == "__main__":
    main()
