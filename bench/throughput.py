"""Throughput against batch size (paper Fig. 14): mask-aware batches against the unmodified diffusers
pipeline batching the same requests statically.

    retouch bench throughput --model tiny-flux-fill --device cpu --size 64 --steps 2 --batch-sizes 1 2

On a GPU (one H100; ~3 minutes of timing after the model's load, ~8 with the first flux-size export):

    retouch bench throughput --model flux-size --device cuda --size 1024 --steps 8 --batch-sizes 1 2 4 8 \
        --repeats 2 [--mask-ratio 0.2] [--cost-model cost.json] --out bench/results/h100/throughput.json

For each batch size B the first B of one list of requests (different masks, each editing one of
`--templates` registered templates; mask ratios from the paper's public distribution unless
`--mask-ratio` fixes them) run as one call of
    retouch:    `MaskAwareEditor.edit_many`: one ragged batch computing only masked tokens, the rest read
                from the templates' activations in the pinned host cache (`CacheStore`, staged to the
                device block by block); with `--cost-model` the planner picks cache or compute per block
    diffusers:  `edit_many(..., full_compute=True)`: the stock pipeline on the static batch, its denoiser
                per `--baselines` eager and/or under torch.compile (`retouch.bench.stock`), one row each
Both include the pipeline's pre- and post-processing (text and VAE encoding, VAE decoding, paste-back):
images/s is end to end. Timed interleaved after one warm-up each; median of `--repeats` runs.
Prints one JSON object; `--out F.json` also writes F.png (images/s against batch size).
"""

from __future__ import annotations

import functools
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

from retouch.bench import stock, workload
from retouch.bench.report import environment, mask_ratio, publish, pyplot
from retouch.bench.timing import interleaved_medians
from retouch.engine.simulate import MASK_BETA
from retouch.errors import ArgumentParser
from retouch.progress import bar

def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(prog="retouch bench throughput", description=__doc__)
    workload.add_editor_options(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--mask-dist", choices=tuple(MASK_BETA), default="public")
    parser.add_argument("--mask-ratio", type=mask_ratio, default=None, help="every request's ratio (default: drawn)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    workload.check_editor_options(parser, args)
    if min(args.batch_sizes) < 1 or args.repeats < 1:
        parser.error("--batch-sizes and --repeats must be >= 1")

    device = torch.device(args.device)
    editor = workload.load_editor(args, device)
    template_ids = workload.register_templates(editor, args)
    rng = np.random.default_rng([args.seed, 1])
    ratios = workload.mask_ratios(rng, max(args.batch_sizes), args.mask_dist, args.mask_ratio)
    edits = workload.synthetic_edits(rng, template_ids, ratios, args.size, workload.token_stride(editor))

    baselines = stock.denoisers(editor.denoiser, stock.chosen(args))
    results = []
    batches = bar(desc="throughput: retouch vs diffusers", unit="batch",
                  total=len(args.batch_sizes) * (1 + len(baselines)) * (args.repeats + 1))
    for batch_size in args.batch_sizes:
        requests = [edit.request for edit in edits[:batch_size]]
        runs = {"retouch": functools.partial(editor.edit_many, requests)}
        for baseline, denoiser in baselines.items():
            runs[baseline] = functools.partial(stock.full_edits, editor, requests, denoiser)
        seconds = interleaved_medians(runs, args.repeats, device, progress=batches)
        cached_blocks = editor.last_plan.num_cached if editor.last_plan is not None else None
        for baseline in baselines:
            row = {"batch_size": batch_size, "baseline": baseline,
                   "mean_mask_ratio": statistics.fmean(edit.mask_ratio for edit in edits[:batch_size]),
                   "retouch_s": seconds["retouch"], "diffusers_s": seconds[baseline],
                   "retouch_images_per_s": batch_size / seconds["retouch"],
                   "diffusers_images_per_s": batch_size / seconds[baseline],
                   "speedup": seconds[baseline] / seconds["retouch"]}
            if cached_blocks is not None:
                row["cached_blocks"] = cached_blocks  # the planner's choice for this batch
            results.append(row)
        batches.set_postfix_str(f"batch {batch_size}: " + ", ".join(
            f"{row['speedup']:.2f}x vs {row['baseline']}" for row in results[-len(baselines):]), refresh=False)
    batches.close()
    largest = max(args.batch_sizes)

    report = {"bench": "throughput", **environment("throughput", argv, device), "model": args.model,
              "dtype": args.dtype, "size": args.size, "steps": args.steps, "templates": args.templates,
              "cache_mode": args.cache_mode, "mask_dist": None if args.mask_ratio is not None else args.mask_dist,
              "mask_ratio": args.mask_ratio, "repeats": args.repeats,
              "planner": args.planner if args.cost_model else None,
              "cost_model": str(args.cost_model) if args.cost_model else None,
              "compiled": stock.compiled(args), "cuda_graphs": args.cuda_graphs,
              "cudagraph_skips": stock.cudagraph_skips(args),
              "baselines": stock.describe(tuple(baselines)),
              "blocks": editor.adapter.num_blocks, "cache": editor.cache.metrics(), "recomputes": editor.recomputes,
              "results": results,
              "speedup_at_max_batch": {row["baseline"]: row["speedup"] for row in results
                                       if row["batch_size"] == largest}}
    return publish(report, args.out, _plot)


def _plot(report: dict, out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    results = report["results"]
    baselines = list(report["baselines"])
    figure, axis = plt.subplots(figsize=(5.5, 4))
    ours = [row for row in results if row["baseline"] == baselines[0]]
    batch_sizes = [row["batch_size"] for row in ours]
    axis.plot(batch_sizes, [row["retouch_images_per_s"] for row in ours], marker="o",
              label="retouch" + (" (compiled)" if report["compiled"] else ""))
    for baseline in baselines:
        rows = [row for row in results if row["baseline"] == baseline]
        axis.plot(batch_sizes, [row["diffusers_images_per_s"] for row in rows], marker="o",
                  label=f"diffusers {baseline}")
    for row in ours:
        speedups = " / ".join(f"{other['speedup']:.2f}x" for other in results
                              if other["batch_size"] == row["batch_size"])
        axis.annotate(speedups, (row["batch_size"], row["retouch_images_per_s"]),
                      textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    axis.set_xscale("log", base=2)
    axis.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    axis.set_xlabel("batch size")
    axis.set_ylabel("images / s")
    masks = f"m = {report['mask_ratio']}" if report["mask_ratio"] is not None else f"{report['mask_dist']} masks"
    versus = " / ".join(baselines)
    axis.set_title(f"{report['model']} {report['size']}px, {report['steps']} steps, {masks}, speedup vs {versus}\n"
                   f"{report['device_name']}", fontsize=9)
    axis.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main(sys.argv[1:])
