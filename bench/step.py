"""One denoising step of a Flux denoiser: full compute vs mask-aware (Y-cache, KV-cache), over mask ratios.

    retouch bench step --model flux-small --mask-ratio 0.2 [--device cuda] [--compile] [--out F.json]

The template is recorded once (one step); each ratio's mask (a centred rectangle of tokens: real
masks are contiguous) is then timed in all modes, interleaved round-robin after a warm-up so that
background load falls on every variant alike. Prints one JSON object; quote the speedups (absolute
times only from a GPU). Each row is quoted against one stock baseline (`baseline`; `--baselines
eager,compiled` times both in one run, `retouch.bench.stock`). `--compile` compiles the mask-aware blocks
(`MaskAwareAdapter.compile`) and adds the compiled stock model (an unpatched twin under torch.compile,
what users pick over eager) by default; compilation happens in the warm-up, outside the timed runs.
`--trace` then profiles one call of each variant at the ratio nearest 0.2 (`retouch.bench.trace`: device
busy and idle time, kernels, host ops, top ops; Chrome traces beside `--out`). Progress goes to stderr.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

from retouch.adapters import CacheMode, MaskAwareContext, patch_flux
from retouch.bench import stock
from retouch.bench.report import (DTYPE_CHOICES, device_arg, json_text, mask_ratios, out_path, pyplot, side_pixels,
                                  write_json, environment)
from retouch.bench.timing import interleaved_medians
from retouch.bench.trace import traced
from retouch.cache import InMemoryActivationCache
from retouch.errors import ArgumentParser, InputError
from retouch.masks import centred_token_rectangle
from retouch.models import build_denoiser, get_spec
from retouch.models.inputs import random_flux_inputs
from retouch.progress import bar

MODES = {"y-cache": CacheMode.Y_CACHE, "kv-cache": CacheMode.KV_CACHE}
TEXT_TOKENS = {"tiny-flux-fill": 32, "flux-small": 64, "flux-size": 512}  # max_sequence_length


def flux_setup(model: str, device: torch.device, dtype: torch.dtype, resolution: int | None = None, steps: int = 1):
    """The denoiser with random weights, patched, its inputs for one request, and a template recorded
    (on `device`) at `steps` denoising steps."""
    if model not in TEXT_TOKENS:
        raise InputError(f"bench supports the Flux models {', '.join(TEXT_TOKENS)}, got {model!r}")
    resolution = resolution or get_spec(model).resolution
    grid = (resolution // 16, resolution // 16)
    num_image, num_text = grid[0] * grid[1], TEXT_TOKENS[model]
    print(f"building {model} on {device} ({dtype})", file=sys.stderr)
    transformer = build_denoiser(model, device=device, dtype=dtype).eval()
    adapter = patch_flux(transformer)
    inputs = random_flux_inputs(transformer, 1, grid, num_text, seed=0, device=device, dtype=dtype)
    cache = InMemoryActivationCache(device=device)
    for step in range(steps):
        with torch.inference_mode(), adapter.run(MaskAwareContext.record(["template"], [step], num_text, num_image,
                                                                          cache, device=device)):
            transformer(**inputs)
    return transformer, adapter, inputs, cache, grid, num_text


def run_with(adapter, context, transformer, inputs):
    with adapter.run(context):
        transformer(**inputs)


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(prog="retouch bench step", description=__doc__)
    parser.add_argument("--model", default="flux-small", choices=sorted(TEXT_TOKENS))
    parser.add_argument("--mask-ratio", "--mask-ratios", dest="ratios", type=mask_ratios, default="0.05,0.2,0.5,1.0",
                        help="one ratio or a comma-separated list, each in (0, 1]")
    parser.add_argument("--resolution", type=side_pixels, default=None, help="pixels per side (default: the model's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=DTYPE_CHOICES,
                        help="default: bfloat16 on cuda, float32 on cpu")
    stock.add_options(parser)
    parser.add_argument("--trace", action="store_true",
                        help="profile one call per variant at the ratio nearest 0.2 (traces beside --out)")
    parser.add_argument("--out", type=out_path, default=None, help="also write the JSON here, and a PNG beside it")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    transformer, adapter, inputs, cache, grid, num_text = flux_setup(args.model, device, dtype, args.resolution)
    baselines = stock.denoisers(transformer, stock.chosen(args))
    if stock.compiled(args):
        adapter.compile(cuda_graphs=args.cuda_graphs)
    num_image = grid[0] * grid[1]
    results, runs_at = [], {}
    with torch.inference_mode():
        ratios = bar(args.ratios, "step: full vs y/kv-cache", unit="ratio")
        for ratio in ratios:
            masked = centred_token_rectangle(grid, ratio)
            runs = {baseline: functools.partial(denoiser, **inputs) for baseline, denoiser in baselines.items()}
            for mode, cache_mode in MODES.items():
                context = MaskAwareContext.edit(cache_mode, [masked], ["template"], [0], num_text, num_image, cache,
                                                device=device)
                runs[mode] = functools.partial(run_with, adapter, context, transformer, inputs)
            seconds = interleaved_medians(runs, args.repeats, device)
            measured = round(len(masked) / num_image, 4)
            runs_at[measured] = runs
            rows = [{"mask_ratio": measured, "mode": mode, "baseline": baseline,
                     "masked_tokens": len(masked), "full_s": seconds[baseline], "mask_aware_s": seconds[mode],
                     "speedup": round(seconds[baseline] / seconds[mode], 3)}
                    for mode in MODES for baseline in baselines]
            results += rows
            ratios.set_postfix_str(f"m={measured}: " + ", ".join(
                f"{row['mode']} {row['speedup']}x vs {row['baseline']}" for row in rows), refresh=False)
        if args.trace:
            traced_ratio = min(runs_at, key=lambda ratio: abs(ratio - 0.2))
            traces = {"mask_ratio": traced_ratio, "variants": traced(runs_at[traced_ratio], device, args.out)}
    report = {"bench": "step", **environment("step", argv, device),
              "model": args.model, "compiled": stock.compiled(args), "cuda_graphs": args.cuda_graphs,
              "cudagraph_skips": stock.cudagraph_skips(args),
              "baselines": stock.describe(tuple(baselines)),
              "dtype": str(dtype).removeprefix("torch."), "image_tokens": num_image, "text_tokens": num_text,
              "results": results}
    if args.trace:
        report["traces"] = traces
    if args.out:
        write_report(report, args.out, "speedup", "speedup vs full compute")
    print(json_text(report))
    return report


def write_report(report: dict, out: Path, metric: str, label: str) -> None:
    """The JSON at `out`, and beside it a PNG of `metric` against mask ratio per mode."""
    write_json(report, out)
    plt = pyplot()
    if plt is None:
        return
    figure, axis = plt.subplots(figsize=(5, 3.5))
    for line in dict.fromkeys((row["mode"], row.get("baseline")) for row in report["results"]):
        rows = [row for row in report["results"] if (row["mode"], row.get("baseline")) == line]
        mode, baseline = line
        axis.plot([row["mask_ratio"] for row in rows], [row[metric] for row in rows], marker="o",
                  linestyle="--" if baseline == "compiled" else "-",
                  label=mode + (f" vs {baseline}" if baseline else ""))
    axis.set_xlabel("mask ratio")
    axis.set_ylabel(label)
    axis.set_title(f"{report['bench']}: {report['model']} on {report.get('device_name', 'cpu')}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
