"""Mixed resolutions: one ragged forward over requests of several image sizes against one forward per size.

    retouch bench mixed --model flux-small [--sizes 256,384,512] [--per-size 1] [--mask-ratio 0.2]

Each request has its own template (recorded once, one step) and a centred mask of the given ratio. For
each cache mode the same requests are timed two ways, interleaved round-robin after a warm-up:
`per-size` runs one mask-aware forward per image size (what a worker without mixed batching does: every
size is its own batch), `mixed` runs them all in ONE forward (`forward_packed`: image tokens packed,
positions and attention per request). Reports the throughput ratio (per-size seconds / mixed seconds)
and the largest difference between the two ways' outputs. Prints one JSON object; writes a PNG beside
`--out`.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

from retouch.adapters import CacheMode, MaskAwareContext, patch_flux
from retouch.bench.report import DTYPE_CHOICES, MAX_SIDE, device_arg, mask_ratio, out_path, publish, pyplot, environment
from retouch.bench.step import TEXT_TOKENS
from retouch.bench.timing import interleaved_medians
from retouch.cache import InMemoryActivationCache
from retouch.errors import ArgumentParser
from retouch.masks import centred_token_rectangle
from retouch.models import build_denoiser
from retouch.models.inputs import random_flux_inputs
from retouch.progress import bar

MODES = {"y-cache": CacheMode.Y_CACHE, "kv-cache": CacheMode.KV_CACHE}


def per_size(adapter, transformer, contexts, inputs) -> list[torch.Tensor]:
    outputs = []
    for context, size_inputs in zip(contexts, inputs):
        with adapter.run(context):
            outputs.extend(transformer(**size_inputs)[0])
    return outputs


def mixed(adapter, context, packed_inputs) -> list[torch.Tensor]:
    with adapter.run(context):
        return adapter.forward_packed(**packed_inputs)


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(prog="retouch bench mixed", description=__doc__)
    parser.add_argument("--model", default="flux-small", choices=sorted(TEXT_TOKENS))
    parser.add_argument("--sizes", default="256,384,512", help="image sizes in pixels per side, comma-separated")
    parser.add_argument("--per-size", type=int, default=1, help="requests of each size")
    parser.add_argument("--mask-ratio", type=mask_ratio, default=0.2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--out", type=out_path, default=None, help="also write the JSON here, and a PNG beside it")
    args = parser.parse_args(argv)
    try:
        sizes = [int(size) for size in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes takes integers separated by commas, got {args.sizes!r}")
    if any(not 16 <= size <= MAX_SIDE or size % 16 for size in sizes) or len(set(sizes)) < 2:
        parser.error(f"--sizes needs two or more distinct multiples of 16 in [16, {MAX_SIDE}], got {args.sizes!r}")
    if args.per_size < 1 or args.repeats < 1:
        parser.error("--per-size and --repeats must be >= 1")

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    num_text = TEXT_TOKENS[args.model]
    print(f"building {args.model} on {device} ({dtype})", file=sys.stderr)
    transformer = build_denoiser(args.model, device=device, dtype=dtype).eval()
    adapter = patch_flux(transformer)
    cache = InMemoryActivationCache(device=device)

    # Per size: its requests' inputs (one batch), template ids, masks; recorded once per request.
    grids, size_inputs, ids, masks = [], [], [], []
    with torch.inference_mode():
        for index, size in enumerate(sizes):
            grid = (size // 16, size // 16)
            num_image = grid[0] * grid[1]
            inputs = random_flux_inputs(transformer, args.per_size, grid, num_text, seed=index, device=device,
                                        dtype=dtype)
            templates = [f"t{size}-{r}" for r in range(args.per_size)]
            with adapter.run(MaskAwareContext.record(templates, [0] * args.per_size, num_text, num_image, cache,
                                                     device=device)):
                transformer(**inputs)
            grids.append(grid)
            size_inputs.append(inputs)
            ids.append(templates)
            masks.append([centred_token_rectangle(grid, args.mask_ratio)] * args.per_size)

    lens = [g[0] * g[1] for g in grids for _ in range(args.per_size)]
    packed_inputs = {
        "hidden_states": [row for inputs in size_inputs for row in inputs["hidden_states"]],
        "img_ids": [inputs["img_ids"] for inputs in size_inputs for _ in range(args.per_size)],
        "txt_ids": size_inputs[0]["txt_ids"],
        **{name: torch.cat([inputs[name] for inputs in size_inputs])
           for name in ("encoder_hidden_states", "pooled_projections", "timestep", "guidance")
           if size_inputs[0][name] is not None}}
    results = []
    with torch.inference_mode():
        modes = bar(list(MODES.items()), "mixed: one forward vs one per size", unit="mode")
        for mode, cache_mode in modes:
            contexts = [MaskAwareContext.edit(cache_mode, size_masks, templates, [0] * args.per_size, num_text,
                                              grid[0] * grid[1], cache, device=device)
                        for size_masks, templates, grid in zip(masks, ids, grids)]
            context = MaskAwareContext.edit(cache_mode, [m for size_masks in masks for m in size_masks],
                                            [t for templates in ids for t in templates], [0] * len(lens), num_text,
                                            lens, cache, device=device)
            runs = {"per-size": functools.partial(per_size, adapter, transformer, contexts, size_inputs),
                    "mixed": functools.partial(mixed, adapter, context, packed_inputs)}
            difference = max((a.float() - b.float()).abs().max().item()
                             for a, b in zip(runs["per-size"](), runs["mixed"]()))
            seconds = interleaved_medians(runs, args.repeats, device)
            results.append({"mode": mode, "per_size_s": seconds["per-size"], "mixed_s": seconds["mixed"],
                            "throughput_ratio": round(seconds["per-size"] / seconds["mixed"], 3),
                            "max_abs_difference": difference,
                            "masked_tokens": sum(len(m) for size_masks in masks for m in size_masks)})
            modes.set_postfix_str(f"{mode} {results[-1]['throughput_ratio']}x", refresh=False)

    report = {"bench": "mixed", **environment("mixed", argv, device),
              "model": args.model,
              "dtype": str(dtype).removeprefix("torch."), "sizes": sizes, "per_size": args.per_size,
              "requests": len(lens), "image_tokens": lens, "text_tokens": num_text, "mask_ratio": args.mask_ratio,
              "baseline": "one mask-aware forward per image size", "results": results}
    return publish(report, args.out, plot)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    figure, axis = plt.subplots(figsize=(5, 3.5))
    modes = [row["mode"] for row in report["results"]]
    x = range(len(modes))
    axis.bar([i - 0.2 for i in x], [row["per_size_s"] for row in report["results"]], 0.4, label="one forward per size")
    axis.bar([i + 0.2 for i in x], [row["mixed_s"] for row in report["results"]], 0.4, label="one mixed forward")
    for i, row in enumerate(report["results"]):
        axis.annotate(f"{row['throughput_ratio']}x", (i + 0.2, row["mixed_s"]), ha="center", va="bottom")
    axis.set_xticks(list(x), modes)
    axis.set_ylabel("seconds per step of the batch")
    axis.set_title(f"mixed {report['sizes']} px x{report['per_size']}: {report['model']} on {report['device_name']}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
