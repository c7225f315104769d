"""One block of a denoiser, full compute against mask-aware (Y-cache, KV-cache), over mask ratios
(paper Fig. 15 left: one Flux block).

    retouch bench block --model flux-size --device cuda [--batch 1] [--mask-ratios 0.05,0.1,...] [--out F.json]

Each kind of block of the model (Flux: double and single; a UNet: one per level) is timed on its own,
with the inputs it receives inside the denoiser at the model's own resolution, and with the template's
activations already on the device: the compute of a cached block, without its load (the load is what
`retouch bench overlap` and `retouch bench copy` measure). Variants are timed interleaved per ratio.
Full compute is the stock block eager and, with `--baselines eager,compiled`, the stock block under
torch.compile (an unpatched twin's block, `retouch.bench.stock`), one row per baseline; `--compile` compiles
the mask-aware cores (`MaskAwareAdapter.compile`) and adds the compiled baseline. Prints one JSON object;
`--out F.json` also writes F.png (speedup against mask ratio per block kind).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

from retouch.bench import stock
from retouch.bench.report import (DTYPE_CHOICES, device_arg, environment, mask_ratios, out_path, publish, pyplot,
                                  side_pixels)
from retouch.bench.timing import interleaved_medians
from retouch.errors import ArgumentParser
from retouch.models import get_spec, unpatched_twin
from retouch.profile import VARIANTS, build_target
from retouch.progress import bar

PATCH_PIXELS = {"flux-fill": 16, "flux-inpaint": 16, "sd3": 16}  # pixels per token side; UNets: 8 (latent)
MODES = {"y": "y-cache", "kv": "kv-cache"}


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(prog="retouch bench block", description=__doc__)
    parser.add_argument("--model", default="flux-size")
    parser.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--resolution", type=side_pixels, default=None, help="pixels per side (default: the model's)")
    parser.add_argument("--batch", type=int, default=1, help="requests per forward")
    parser.add_argument("--mask-ratios", type=mask_ratios, default="0.05,0.1,0.2,0.3,0.5,0.7,0.9,1.0")
    parser.add_argument("--repeats", type=int, default=10)
    stock.add_options(parser)
    parser.add_argument("--out", type=out_path, default=None, help="also write the JSON here, and a PNG beside it")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.repeats < 1:
        parser.error("--batch and --repeats must be >= 1")

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    spec = get_spec(args.model)
    resolution = args.resolution or spec.resolution
    side = resolution // PATCH_PIXELS.get(spec.family, 8)
    print(f"building {args.model} on {device} ({dtype}), {side}x{side} token grid", file=sys.stderr)
    target = build_target(args.model, device, dtype)
    captured, cache = target.record(args.batch, side, device, representative_only=True)
    baselines = stock_blocks(target, stock.chosen(args))
    if stock.compiled(args):
        target.adapter.compile(cuda_graphs=args.cuda_graphs)

    results = []
    points = bar([(kind, index, ratio) for kind, index in target.representative.items() for ratio in args.mask_ratios],
                 "block: full vs y/kv-cache", unit="point")
    for kind, index, ratio in points:
        block_args, block_kwargs = captured[index]
        runs = {baseline: functools.partial(run_block, blocks[index], block_args, block_kwargs)
                for baseline, blocks in baselines.items()}
        for variant, name in MODES.items():
            context = target.edit_context(VARIANTS[variant], args.batch, side, ratio, cache)
            runs[name] = target.block_run(index, block_args, block_kwargs, context)
        seconds = interleaved_medians(runs, args.repeats, device)
        tokens = target.tokens(kind, side, ratio)
        rows = [{"kind": kind, "block": index, "mask_ratio": round(tokens.masked / tokens.image, 4),
                 "mode": name, "baseline": baseline, "masked_tokens": tokens.masked, "image_tokens": tokens.image,
                 "full_s": seconds[baseline], "mask_aware_s": seconds[name],
                 "speedup": round(seconds[baseline] / seconds[name], 3)}
                for name in MODES.values() for baseline in baselines]
        results += rows
        points.set_postfix_str(f"{kind} m={rows[0]['mask_ratio']}: " + ", ".join(
            f"{row['mode']} {row['speedup']}x vs {row['baseline']}" for row in rows), refresh=False)

    report = {"bench": "block", **environment("block", argv, device), "model": args.model,
              "dtype": str(dtype).removeprefix("torch."), "resolution": resolution, "batch": args.batch,
              "compiled": stock.compiled(args), "cuda_graphs": args.cuda_graphs,
              "cudagraph_skips": stock.cudagraph_skips(args),
              "baselines": stock.describe(tuple(baselines), "the unmodified diffusers block"),
              "block_kinds": sorted(target.representative), "results": results}
    return publish(report, args.out, _plot)


def stock_blocks(target, baselines: tuple[str, ...]) -> dict[str, dict[int, torch.nn.Module]]:
    """Per baseline, the representative blocks of the stock model (eager, or each under torch.compile): the
    blocks of an unpatched twin of the target's denoiser (the patched ones carry the adapter's dispatch)."""
    twin = unpatched_twin(target.denoiser)
    names = {id(module): name for name, module in target.denoiser.named_modules()}
    eager = {index: twin.get_submodule(names[id(target.adapter.blocks[index])])
             for index in target.representative.values()}
    return {baseline: eager if baseline == "eager" else {index: torch.compile(block) for index, block in eager.items()}
            for baseline in baselines}


def run_block(block: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    with torch.inference_mode():
        block(*args, **kwargs)


def _plot(report: dict, out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    kinds = report["block_kinds"]
    figure, axes = plt.subplots(1, len(kinds), figsize=(4.5 * len(kinds), 3.6), squeeze=False)
    for axis, kind in zip(axes[0], kinds):
        for mode in MODES.values():
            for baseline in report["baselines"]:
                rows = [row for row in report["results"]
                        if (row["kind"], row["mode"], row["baseline"]) == (kind, mode, baseline)]
                axis.plot([row["mask_ratio"] for row in rows], [row["speedup"] for row in rows], marker="o",
                          linestyle="-" if baseline == "eager" else "--", label=f"{mode} vs {baseline}")
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_title(f"{kind} block")
        axis.set_xlabel("mask ratio")
        axis.set_ylabel("speedup vs the stock block")
        axis.legend()
    figure.suptitle(f"{report['model']} block, batch {report['batch']}, {report['device_name']}")
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main(sys.argv[1:])
