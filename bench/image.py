"""Latency of one whole edit, the unmodified diffusers pipeline against mask-aware inference, over mask
ratios (paper Fig. 15 right, §6.2): text encoders, every denoising step and the VAE, end to end.

    retouch bench image --model flux-size --device cuda --cost-model cost.json [--steps 8] [--strengths 1,0.5]
        [--out F.json]

The template is registered once in KV-cache mode (which records every block's output, keys and
values, so the same recording serves both modes; Y-cache mode when only y is measured) into a
`CacheStore` in pinned host memory; each
mask-aware edit loads its rows over PCIe with the copy engine, overlapped with compute, and with
`--cost-model` (from `retouch profile`) the planner chooses per block cache or full compute. The
masks are centred rectangles of tokens covering each ratio. Per mode, the full pipeline and every
ratio's edit are timed interleaved. `--strengths` runs them at each denoising strength (`retouch.strength`:
the last steps x S of the schedule, from the template noised with the edit's noise; the full pipeline at S
is diffusers' own), all interleaved. Prints one JSON object
`{"model", "device", "results": [{"strength", "steps_run", "mask_ratio", "mode", "baseline", "full_s",
"mask_aware_s", "speedup"}], ...}`;
`--out F.json` also writes F.png. Each row is quoted against one stock baseline (`baseline`), and
`--baselines eager,compiled` times both in the same run (`retouch.bench.stock`: the pipeline with an
unpatched twin of its denoiser, eager and under torch.compile). `--compile` compiles the mask-aware blocks
(`MaskAwareEditor(compile=True)`) and adds the compiled baseline by default; compilation happens in the
warm-up runs, outside the timed ones. Compiled (`--compile`, `--cuda-graphs`), each edit is also timed with
its blocks eager (`adapter.eager()`) in the same run: rows add `eager_blocks_s` and `speedup_eager_blocks`,
so that what compiling the blocks changed stands apart from everything else that changed between runs.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import numpy as np
import torch

from retouch.bench import stock, workload
from retouch.bench.report import (DTYPE_CHOICES, cost_model_arg, device_arg, environment, mask_ratios, out_path,
                                  positive_float, publish, pyplot, side_pixels)
from retouch.bench.timing import interleaved_medians
from retouch.cache import CacheStore, StoreConfig
from retouch.cache.layout import STORAGE_DTYPES
from retouch.config import CACHE_DTYPES
from retouch.editor import PLANNERS, EditRequest, MaskAwareEditor
from retouch.errors import ArgumentParser, InputError
from retouch.masks import FLUX_STRIDE, UNET_LATENT_STRIDE, centred_token_rectangle, pixel_mask_of_tokens
from retouch.models import get_spec
from retouch.models.loading import load_for_bench
from retouch.progress import bar, pipeline_bar
from retouch.strength import check_strength, steps_run

MODES = {"y": "y-cache", "kv": "kv-cache"}
TRANSFORMER_FAMILIES = ("flux-fill", "flux-inpaint", "sd3")


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(prog="retouch bench image", description=__doc__)
    parser.add_argument("--model", default="flux-size")
    parser.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--mask-ratios", type=mask_ratios, default="0.05,0.1,0.2,0.3,0.5,0.7,0.9")
    parser.add_argument("--modes", default="y,kv", help="cache modes, comma-separated (y, kv)")
    parser.add_argument("--steps", type=int, default=8,
                        help="denoising steps (the cache holds every step: flux-size needs ~5 GB of host memory each)")
    parser.add_argument("--strengths", type=strengths_arg, default="1",
                        help="denoising strengths of the edits, full and mask-aware, comma-separated, each in (0, 1]")
    parser.add_argument("--resolution", type=side_pixels, default=None, help="pixels per side (default: the model's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cost-model", type=cost_model_arg, default=None,
                        help="retouch profile output: the planner on")
    parser.add_argument("--planner", choices=PLANNERS, default="optimal")
    parser.add_argument("--host-gib", type=positive_float, default=None,
                        help="pinned host cache (default: the template's size)")
    parser.add_argument("--cache-dtype", choices=CACHE_DTYPES, default="auto",
                        help="how the cache stores activations (float8_e4m3fn: half of bf16, so a 28-step KV-cache "
                             "template of flux-size at 1024 px, ~124 GiB in bf16, fits a 128 GiB machine)")
    stock.add_options(parser)
    parser.add_argument("--out", type=out_path, default=None, help="also write the JSON here, and a PNG beside it")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be >= 1")
    if unknown := set(modes) - set(MODES):
        parser.error(f"--modes takes {', '.join(MODES)}, got {', '.join(sorted(unknown))}")
    for strength in args.strengths:
        try:
            check_strength(strength, args.steps, "--strengths: strength")
        except InputError as exc:
            parser.error(str(exc))

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    spec = get_spec(args.model)
    resolution = args.resolution or spec.resolution
    print(f"building {args.model} on {device} ({dtype})", file=sys.stderr)
    model = load_for_bench(args.model, device, dtype)
    cost_model = workload.load_cost_model(args.cost_model, model.name)
    # A KV-cache recording serves both modes; Y-cache alone records a third of it (outputs only), which is
    # what fits a flux-size template of 28 steps at 1024 px in a GPU machine's host memory.
    recorded_mode = "kv" if "kv" in modes else "y"
    store = CacheStore(StoreConfig(host_bytes=_host_bytes(args, model, resolution, recorded_mode),
                                   dtype=args.cache_dtype))
    editor = MaskAwareEditor(model, cache=store, cache_mode=recorded_mode, cost_model=cost_model,
                             planner=args.planner, compile=args.compile, cuda_graphs=args.cuda_graphs)
    baselines = stock.denoisers(editor.denoiser, stock.chosen(args))
    with pipeline_bar(model.pipe, f"image: register template ({resolution}px)"):
        template_id = editor.register_template(workload.template_image(np.random.default_rng(0), resolution),
                                               prompt="a living room", steps=args.steps)
    print(f"template: {store.nbytes(template_id) / 2**30:.2f} GiB in host memory (pinned={store.arena.pinned})",
          file=sys.stderr)

    stride = workload.token_stride(editor)
    grid = (resolution // stride, resolution // stride)
    requests = {}  # (strength, measured mask ratio) -> the edit
    for strength in args.strengths:
        for ratio in args.mask_ratios:
            tokens = centred_token_rectangle(grid, ratio)
            requests[strength, round(len(tokens) / (grid[0] * grid[1]), 4)] = EditRequest(
                template_id, pixel_mask_of_tokens(tokens, grid, stride), "a red sofa", seed=1, strength=strength)

    results = []
    # Every edit this loop runs: per mode the planner's one per ratio, then each timed run's warm-up and repeats.
    planned = len(requests) if cost_model is not None else 0
    full_runs = len(args.strengths) * len(baselines)
    compiled = args.compile or args.cuda_graphs
    edit_runs = len(requests) * (2 if compiled else 1)
    edits = bar(desc="image: diffusers vs mask-aware", total=len(modes) * (planned + (full_runs + edit_runs) *
                                                                           (args.repeats + 1)), unit="edit")
    for mode in modes:
        editor.switch_cache_mode(mode)
        runs = {}
        for strength in args.strengths:  # the full pipeline once per strength: its cost does not depend on the mask
            first = next(request for (of, _), request in requests.items() if of == strength)
            for baseline, denoiser in baselines.items():
                runs[baseline, strength] = functools.partial(stock.full_edits, editor, [first], denoiser)
        plans = {}
        for key, request in requests.items():
            runs[key] = functools.partial(editor.edit_many, [request])
            if compiled:
                runs[key, "eager blocks"] = functools.partial(_with_eager_blocks, editor, request)
            if cost_model is not None:
                editor.edit_many([request])  # the planner's choice for this mask, kept as last_plan
                edits.update()
                plans[key] = "".join("c" if cached else "f" for cached in editor.last_plan.use_cache)
        seconds = interleaved_medians(runs, args.repeats, device, progress=edits)
        rows = []
        for key in requests:
            strength, ratio = key
            for baseline in baselines:
                full_s = seconds[baseline, strength]
                row = {"strength": strength, "steps_run": steps_run(model.family, args.steps, strength),
                       "mask_ratio": ratio, "mode": MODES[mode], "baseline": baseline, "full_s": full_s,
                       "mask_aware_s": seconds[key], "speedup": round(full_s / seconds[key], 3)}
                if key in plans:
                    row["plan"] = plans[key]
                if compiled:
                    row["eager_blocks_s"] = seconds[key, "eager blocks"]
                    row["speedup_eager_blocks"] = round(full_s / seconds[key, "eager blocks"], 3)
                rows.append(row)
        results += rows
        speedups = [row["speedup"] for row in rows]
        edits.set_postfix_str(f"{MODES[mode]} {min(speedups)}x..{max(speedups)}x", refresh=False)
    edits.close()

    report = {"bench": "image", "model": args.model, **environment("image", argv, device),
              "dtype": str(dtype).removeprefix("torch."), "resolution": resolution, "steps": args.steps,
              "compiled": stock.compiled(args), "cuda_graphs": args.cuda_graphs,
              "cudagraph_skips": stock.cudagraph_skips(args),
              "baselines": stock.describe(tuple(baselines)),
              "cache": {"tier": "pinned host memory" if store.arena.pinned else "host memory",
                        "recorded": MODES[recorded_mode], "dtype": args.cache_dtype,
                        "template_gib": round(store.nbytes(template_id) / 2**30, 3),
                        "template_bytes": store.nbytes(template_id)},
              "planner": args.planner if cost_model is not None else "off (every block cached)",
              "cost_model": str(args.cost_model) if args.cost_model else None, "results": results}
    store.close()
    return publish(report, args.out, _plot)


def _with_eager_blocks(editor: MaskAwareEditor, request: EditRequest) -> None:
    with editor.adapter.eager():
        editor.edit_many([request])


def _host_bytes(args, model, resolution: int, recorded_mode: str) -> int:
    """The pinned budget: --host-gib, else one template recorded in `recorded_mode` (KV-cache: outputs, keys
    and values of every block at every step; Y-cache: outputs), from the denoiser's shapes, plus a margin."""
    if args.host_gib is not None:
        return int(args.host_gib * 2**30)
    denoiser = model.pipe.unet if model.family not in TRANSFORMER_FAMILIES else model.pipe.transformer
    parameters = next(denoiser.parameters())
    if model.family in TRANSFORMER_FAMILIES:
        tokens = (resolution // FLUX_STRIDE) ** 2 + int(model.call_defaults.get("max_sequence_length", 512)) + 77
        width = denoiser.config.num_attention_heads * denoiser.config.attention_head_dim
        rows = tokens * (len(list(denoiser.transformer_blocks)) + len(getattr(denoiser, "single_transformer_blocks", [])))
        per_step = (3 if recorded_mode == "kv" else 1) * rows * width
    else:
        # Every attention block's output, keys and values at the widest level bounds a UNet's recording;
        # x2 for classifier-free guidance.
        latent = (resolution // UNET_LATENT_STRIDE) ** 2
        per_step = 2 * (3 if recorded_mode == "kv" else 1) * latent * sum(denoiser.config.block_out_channels) * 4
    stored = parameters.element_size() if args.cache_dtype == "auto" else STORAGE_DTYPES[args.cache_dtype].itemsize
    return int(per_step * args.steps * stored * 1.1) + (256 << 20)


def strengths_arg(text: str) -> list[float]:
    """argparse `type` of `--strengths`: comma-separated numbers (each checked against the steps in main)."""
    try:
        return [float(value) for value in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError("must be comma-separated numbers") from None


def _plot(report: dict, out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    results = report["results"]
    if len({(row["mask_ratio"], row["strength"]) for row in results}) == 1:
        _plot_one_point(report, figure, left, right)
        figure.savefig(out, dpi=120)
        plt.close(figure)
        return
    several = len({row["strength"] for row in results}) > 1
    baselines = list(dict.fromkeys(row["baseline"] for row in results))
    for mode, strength, baseline in dict.fromkeys((row["mode"], row["strength"], row["baseline"]) for row in results):
        rows = [row for row in results if (row["mode"], row["strength"], row["baseline"]) == (mode, strength, baseline)]
        ratios = [row["mask_ratio"] for row in rows]
        label = mode + (f", strength {strength:g}" if several else "")
        if baseline == baselines[0]:  # the mask-aware latency does not depend on the baseline
            left.plot(ratios, [row["mask_aware_s"] for row in rows], marker="o", label=label)
        right.plot(ratios, [row["speedup"] for row in rows], marker="o", linestyle="-" if baseline == "eager" else "--",
                   label=f"{label} vs {baseline}")
    for (strength, baseline), colour in zip(dict.fromkeys((row["strength"], row["baseline"]) for row in results),
                                            ("grey", "black", "silver", "dimgrey")):
        full_s = next(row["full_s"] for row in results if (row["strength"], row["baseline"]) == (strength, baseline))
        left.axhline(full_s, color=colour, linestyle="--" if strength == 1 else ":",
                     label=f"diffusers {baseline}" + (f", strength {strength:g}" if several else ""))
    left.set_ylabel("seconds per image")
    right.set_ylabel("speedup vs diffusers")
    for axis in (left, right):
        axis.set_xlabel("mask ratio")
        axis.legend(fontsize=7)
    compiled = ", mask-aware compiled" if report["compiled"] else ""
    figure.suptitle(f"{report['model']}, {report['steps']} steps, {report['resolution']}px{compiled}, "
                    f"{report['device_name']}")
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)


def _plot_one_point(report: dict, figure, left, right) -> None:
    """One mask ratio (the headline): bars, seconds per image of each stock baseline and each cache mode, and
    each mode's speedup over each baseline."""
    results = report["results"]
    full = dict.fromkeys((f"diffusers {row['baseline']}", row["full_s"]) for row in results)
    mine = dict.fromkeys((row["mode"], row["mask_aware_s"]) for row in results)
    names, seconds = zip(*[*full, *mine])
    left.bar(names, seconds, color=["grey"] * len(full) + ["tab:blue"] * len(mine))
    for index, value in enumerate(seconds):
        left.annotate(f"{value:.2f} s", (index, value), ha="center", va="bottom", fontsize=8)
    left.set_ylabel("seconds per image")
    labels = [f"{row['mode']}\nvs {row['baseline']}" for row in results]
    right.bar(labels, [row["speedup"] for row in results], color="tab:blue")
    for index, row in enumerate(results):
        right.annotate(f"{row['speedup']:.2f}x", (index, row["speedup"]), ha="center", va="bottom", fontsize=8)
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set_ylabel("speedup vs diffusers")
    for axis in (left, right):
        axis.tick_params(axis="x", labelsize=8)
    row = results[0]
    compiled = ", mask-aware compiled" if report["compiled"] else ""
    figure.suptitle(f"{report['model']}, {report['steps']} steps, {report['resolution']}px, mask ratio "
                    f"{row['mask_ratio']:g}{compiled}, {report['device_name']}")
    figure.tight_layout()


if __name__ == "__main__":
    main(sys.argv[1:])
