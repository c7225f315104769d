"""Cache loading overlapped with compute (paper Fig. 4 left, Fig. 9): the latency of one image's
denoising steps with the template's activations in pinned host memory, staged block by block by the
copy engine, against the same edit with the activations already in device memory (the ideal: no
transfer at all) and against naive load-then-compute.

    retouch bench overlap --model flux-size --device cuda --mask-ratio 0.2 [--cost-model F.json] [--out F.json]

Variants, timed interleaved in one run (median seconds per image = `--steps` denoiser forwards):
- ideal:     InMemoryActivationCache on the device
- planned:   host arena + copy engine, block plan from the planner on `--cost-model` (retouch profile)
- pipelined: host arena + copy engine, every block cached (Fig. 9 middle: bubbles where loads are slow)
- pipelined-unbounded, pipelined-memcpy (CUDA): the same with the gather kernel's grid unbounded (one block
             per 1,024 vectors: every SM, as before stop 52), and with copy-engine DMA copies only (no SMs)
- naive:     host arena, every load issued before the first block and waited for (Fig. 4 left)
- full:      full compute, no cache: the stock denoiser eager (an unpatched twin, `retouch.bench.stock`);
             with `--baselines eager,compiled` also `full-compiled`, the same under torch.compile. Each
             row's `speedup_vs` holds its speedup against each.
A GPU benchmark; on the CPU it runs (tests use it at tiny sizes) but copies and compute share cores.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch

from retouch.adapters import CacheMode, MaskAwareContext
from retouch.adapters.reads import staged_context
from retouch.bench import stock
from retouch.bench.report import (DTYPE_CHOICES, cost_model_arg, device_arg, json_text, mask_ratio, out_path,
                                  side_pixels, environment)
from retouch.bench.step import TEXT_TOKENS, flux_setup, write_report
from retouch.bench.timing import interleaved_medians
from retouch.cache import CacheStore, StoreConfig
from retouch.cache.staging import CopyEngine, StagedActivations
from retouch.errors import ArgumentParser, InputError
from retouch.masks import centred_token_rectangle
from retouch.progress import bar

MODES = {"y": CacheMode.Y_CACHE, "kv": CacheMode.KV_CACHE}
FULL = {"eager": "full", "compiled": "full-compiled"}  # the variant name of each stock baseline
RECORDED = {"y": ("out",), "kv": None}


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(prog="retouch bench overlap", description=__doc__)
    parser.add_argument("--model", default="flux-size", choices=sorted(TEXT_TOKENS))
    parser.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--mask-ratio", type=mask_ratio, default=0.2)
    parser.add_argument("--cache-mode", choices=sorted(MODES), default="y")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps of the image")
    parser.add_argument("--resolution", type=side_pixels, default=None, help="pixels per side (default: the model's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lookahead", type=int, default=4, help="cached blocks the copy stream may run ahead")
    parser.add_argument("--cost-model", type=cost_model_arg, default=None,
                        help="retouch profile output for the planner")
    parser.add_argument("--baselines", type=stock.baselines_arg, default=("eager",),
                        help="full compute eager and/or under torch.compile, comma-separated (default: eager)")
    parser.add_argument("--out", type=out_path, default=None, help="also write the JSON here, and a PNG beside it")
    args = parser.parse_args(argv)
    if min(args.steps, args.repeats, args.lookahead) < 1:
        parser.error("--steps, --repeats and --lookahead must be >= 1")

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    mode = MODES[args.cache_mode]
    transformer, adapter, inputs, ideal_cache, grid, num_text = flux_setup(args.model, device, dtype,
                                                                          args.resolution, steps=args.steps)
    num_image = grid[0] * grid[1]
    store = CacheStore(StoreConfig(host_bytes=ideal_cache.nbytes("template") + (64 << 20)))
    store.begin("template", RECORDED[args.cache_mode])
    for step in range(args.steps):
        for block in range(adapter.num_blocks):
            for name in ("out", "k", "v"):
                store.put("template", step, block, name, ideal_cache.get("template", step, block, name))
    store.commit("template")
    print(f"template: {store.nbytes('template') / 2**20:.1f} MiB in pinned host memory "
          f"(pinned={store.arena.pinned})", file=sys.stderr)

    masked = centred_token_rectangle(grid, args.mask_ratio)
    engine = CopyEngine(device, lookahead=args.lookahead)
    # How the gather shares the device with the compute it overlaps: the default (a quarter of the SMs) against
    # every SM, and against DMA copies, in the same run.
    engines = {"pipelined": engine}
    if device.type == "cuda":
        engines["pipelined-unbounded"] = CopyEngine(device, lookahead=args.lookahead, gather_blocks=0)
        engines["pipelined-memcpy"] = CopyEngine(device, lookahead=args.lookahead, method="memcpy")
    plan = _plan(args.cost_model, adapter, args.cache_mode, num_text, num_image, len(masked))

    def build(step, cache, block_plan=None):
        return MaskAwareContext.edit(mode, [masked], ["template"], [step], num_text, num_image, cache,
                                     block_plan=block_plan, device=device)

    def image(context_at):
        with torch.inference_mode():
            for step in range(args.steps):
                context = context_at(step)
                staged = context.cache if isinstance(context.cache, StagedActivations) else contextlib.nullcontext()
                with adapter.run(context), staged:
                    transformer(**inputs)

    with store.acquire("template") as handle:
        handles = {"template": handle}

        def staged(block_plan=None, sync=False, copies=engine):
            return lambda step: staged_context(functools.partial(build, step, block_plan=block_plan), copies,
                                               adapter, handles, dtype, sync=sync)

        runs = {"ideal": functools.partial(image, lambda step: build(step, ideal_cache)),
                **{name: functools.partial(image, staged(copies=copies)) for name, copies in engines.items()},
                "naive": functools.partial(image, staged(sync=True))}
        for baseline, denoiser in stock.denoisers(transformer, args.baselines).items():
            runs[FULL[baseline]] = functools.partial(_full_image, denoiser, inputs, args.steps)
        if plan is not None:
            runs["planned"] = functools.partial(image, staged(plan))
        with bar(desc="overlap: host cache vs ideal", total=len(runs) * (args.repeats + 1), unit="image") as images:
            seconds = interleaved_medians(runs, args.repeats, device, progress=images)

    ideal = seconds["ideal"]
    results = [{"variant": name, "image_s": value, "vs_ideal": round(value / ideal, 4),
                "speedup_vs": {baseline: round(seconds[FULL[baseline]] / value, 3) for baseline in args.baselines}}
               for name, value in seconds.items()]
    for row in results:
        print(f"{row['variant']:>10}: {row['image_s']:.4f} s/image, {row['vs_ideal']:.3f}x ideal", file=sys.stderr)
    report = {"bench": "overlap", **environment("overlap", argv, device),
              "model": args.model,
              "dtype": str(dtype).removeprefix("torch."), "cache_mode": args.cache_mode,
              "baselines": stock.describe(args.baselines),
              "mask_ratio": round(len(masked) / num_image, 4), "steps": args.steps,
              "template_mib": round(store.nbytes("template") / 2**20, 1), "pinned": store.arena.pinned,
              "plan": None if plan is None else "".join("c" if p else "f" for p in plan),
              "copy": {"bytes": engine.stats.bytes, "rows": engine.stats.rows, "blocks": engine.stats.blocks},
              "results": results}
    if args.out:
        for row in results:
            row.setdefault("mask_ratio", report["mask_ratio"])
            row["mode"] = row["variant"]
        write_report(report, args.out, "vs_ideal", "latency / ideal (cache in device memory)")
    print(json_text(report))
    for copies in engines.values():
        copies.close()
    store.close()
    return report


def _full_image(transformer, inputs, steps: int) -> None:
    with torch.inference_mode():
        for _ in range(steps):
            transformer(**inputs)


def _plan(cost_model_path, adapter, cache_mode: str, num_text: int, num_image: int, num_masked: int):
    """The optimal block plan for this edit from a profiled cost model, or None without one."""
    if cost_model_path is None:
        return None
    from retouch.costs import CostModel, RequestTokens
    from retouch.planner import optimal_plan

    model = CostModel.from_json(cost_model_path)
    if len(model.block_kinds) != adapter.num_blocks:
        raise InputError(f"--cost-model {cost_model_path} describes {len(model.block_kinds)} blocks, the model has "
                         f"{adapter.num_blocks}")
    row = {kind: RequestTokens(text=num_text, image=num_image, masked=num_masked) for kind in set(model.block_kinds)}
    return optimal_plan(model.block_costs([row], cache_mode)).use_cache


if __name__ == "__main__":
    main()
