"""Per-request LoRA: what different adapters in one batch cost a step, and how much of a load the request hides.

    retouch bench lora --model flux-small [--batch 8] [--rank 16] [--load-rank 512] [--steps 10]

1. Step overhead. A batch of `--batch` mask-aware edits (Y-cache, centred masks of `--mask-ratio`; and the
   same batch computing every token) is timed with no LoRA, with one adapter for every request (the
   single-adapter fast path) and with `--batch` distinct adapters (the segmented path), all of rank
   `--rank` on the attention and feed-forward linears diffusers' training scripts target, interleaved
   round-robin. Reports each as a ratio over the batch without LoRA.
2. Loading. One edit of a recorded template (`--steps` steps, naive engine) names an adapter of rank
   `--load-rank` saved in diffusers' file format (hundreds of MiB), read cold (the file dropped from the
   page cache, the engine's LoRA caches cleared; the read lands in host memory the cleared adapter left,
   as in a serving steady state where a read takes an evicted adapter's place): synchronously (applied
   before the first step: `lora_latest_step` 0) and asynchronously (loaded while the edit's first steps run
   without it: `lora_latest_step` 0.3), both from admission ("async") and from submission
   ("async+prefetch", what the engine does); beside them the same edit without LoRA and with the adapter
   already loaded ("warm"). The load costs a user sync - warm. An asynchronous edit applies its adapter
   from step k, so it is paired with the same edit finding the adapter loaded and held back until step k
   ("held@k": the same compute, no load): exposed load = async - held@k, hidden share = 1 - exposed / (sync
   - warm), each difference taken within one of `--load-repeats` interleaved rounds, then the median
   (quartiles beside it: this shared machine's step times vary by ~15% from edit to edit). `read_cpu_s`
   beside `read_s` says how much of the read was CPU work, which on a CPU-only machine competes with the
   forward for the same cores. The engine reads with O_DIRECT where it can (`lora.raw_file`); the same
   rounds also run "sync/buffered" and "async+prefetch/buffered", read through the page cache
   (`buffered_reads`), so that both ways of reading compare on the same edits. The text-encoder part
   of the same adapter (`text_encoder_part`): what its read costs before a request's first step.

Prints one JSON object; writes a PNG beside `--out`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from retouch.adapters import CacheMode, MaskAwareContext
from retouch.bench.report import (DTYPE_CHOICES, device_arg, mask_ratio, out_path, publish, pyplot, side_pixels,
                                  environment)
from retouch.bench.step import TEXT_TOKENS, flux_setup
from retouch.bench.timing import interleaved_medians
from retouch.errors import ArgumentParser
from retouch.lora.files import LoraModule, LoraWeights
from retouch.lora.layers import LoraLayers
from retouch.lora.raw_file import buffered_reads
from retouch.masks import centred_token_rectangle
from retouch.models.inputs import random_flux_inputs
from retouch.models.registry import is_builtin
from retouch.progress import bar

# diffusers' Flux LoRA training script's default targets (examples/dreambooth/train_dreambooth_lora_flux.py).
CLIP_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj")
FLUX_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                "ff_context.net.2", "proj_mlp", "proj_out")


def targeted_linears(denoiser: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {name: module for name, module in denoiser.named_modules()
            if isinstance(module, torch.nn.Linear) and name.endswith(FLUX_TARGETS)
            and ("blocks." in name)}


def random_lora(denoiser: torch.nn.Module, name: str, rank: int, seed: int, dtype: torch.dtype,
                device: torch.device) -> LoraWeights:
    generator = torch.Generator().manual_seed(seed)
    modules = {}
    for path, linear in targeted_linears(denoiser).items():
        A = torch.randn(rank, linear.in_features, generator=generator) / linear.in_features ** 0.5
        B = torch.randn(linear.out_features, rank, generator=generator) * 0.01
        modules[path] = LoraModule(A.to(device, dtype), B.to(device, dtype), 1.0)
    return LoraWeights(name, modules)


def step_overhead(args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    transformer, adapter, one_inputs, cache, grid, num_text = flux_setup(args.model, device, dtype, args.resolution)
    batch = args.batch
    inputs = random_flux_inputs(transformer, batch, grid, num_text, seed=1, device=device, dtype=dtype)
    num_image = grid[0] * grid[1]
    templates = [f"t{b}" for b in range(batch)]
    with torch.inference_mode(), adapter.run(MaskAwareContext.record(templates, [0] * batch, num_text, num_image,
                                                                      cache, device=device)):
        transformer(**inputs)
    masks = [centred_token_rectangle(grid, args.mask_ratio)] * batch
    contexts = {"y-cache": MaskAwareContext.edit(CacheMode.Y_CACHE, masks, templates, [0] * batch, num_text,
                                                 num_image, cache, device=device),
                "full": None}
    layers = LoraLayers(transformer)
    adapter.lora_layers = layers
    adapters = [random_lora(transformer, f"lora{b}", args.rank, b, dtype, device) for b in range(batch)]
    choices = {"none": None, "1 adapter": [((adapters[0], 1.0),)] * batch,
               f"{batch} adapters": [((lora, 1.0),) for lora in adapters]}
    results = []
    with torch.inference_mode():
        for mode, context in bar(list(contexts.items()), "lora: step with 0, 1, N adapters", unit="mode"):
            layouts = adapter.row_layouts(context) if context is not None else []

            def run(entries, context=context, layouts=layouts):
                lora_batch = layers.batch(entries, layouts) if entries else None
                with layers.bind(lora_batch):
                    if context is None:
                        transformer(**inputs)
                    else:
                        with adapter.run(context):
                            transformer(**inputs)
            runs = {name: (lambda entries=entries: run(entries)) for name, entries in choices.items()}
            seconds = interleaved_medians(runs, args.repeats, device)
            base = seconds["none"]
            results.append({"mode": mode, "seconds": seconds,
                            "overhead": {name: round(s / base - 1, 4) for name, s in seconds.items() if name != "none"}})
    return results


def save_diffusers_lora(denoiser: torch.nn.Module, folder: Path, rank: int, name: str = "big", seed: int = 0,
                        component: str = "transformer",
                        text_encoders: dict[str, torch.nn.Module] | None = None) -> Path:
    """A random adapter in diffusers' file format (PEFT keys under `component.`: "transformer" or "unet"),
    as save_lora_weights writes, as `folder/<name>.safetensors`. `text_encoders`: pipeline component name ->
    CLIP encoder, whose attention projections it adapts too (as --train_text_encoder does)."""
    tensors = {}
    generator = torch.Generator().manual_seed(seed)
    parts = [(component, targeted_linears(denoiser))] + [
        (encoder_name, {path: module for path, module in encoder.named_modules()
                        if isinstance(module, torch.nn.Linear) and path.endswith(CLIP_TARGETS)})
        for encoder_name, encoder in (text_encoders or {}).items()]
    for prefix, linears in parts:
        for path, linear in linears.items():
            tensors[f"{prefix}.{path}.lora_A.weight"] = (torch.randn(rank, linear.in_features, generator=generator)
                                                         / linear.in_features ** 0.5).contiguous()
            tensors[f"{prefix}.{path}.lora_B.weight"] = torch.randn(linear.out_features, rank,
                                                                    generator=generator) * 1e-3
    if not any(key.startswith(f"{component}.") for key in tensors):
        raise ValueError(f"{type(denoiser).__name__} has none of the linear layers a LoRA here targets")
    path = folder / f"{name}.safetensors"
    save_file(tensors, str(path))
    return path


def drop_from_page_cache(path: Path) -> None:
    """The next read of `path` comes from the disk (where the kernel honours the advice)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def load_hiding(args, device: torch.device, dtype: torch.dtype) -> dict:
    """The loading part, its adapter file in a folder of its own that goes with it (each run left one
    behind: hundreds of MiB)."""
    with tempfile.TemporaryDirectory(prefix="retouch-bench-lora-") as folder:
        return _load_hiding(args, device, dtype, Path(folder))


def _load_hiding(args, device: torch.device, dtype: torch.dtype, folder: Path) -> dict:
    from PIL import Image

    from retouch.editor import EditRequest
    from retouch.engine.api import Engine
    from retouch.engine.worker import EngineConfig

    engine = Engine.load(args.engine_model, EngineConfig(mode="naive", max_batch=1, lora_dir=str(folder)),
                         device=str(device), dtype=dtype)
    path = save_diffusers_lora(engine.editor.denoiser, folder, args.load_rank)
    size = args.engine_resolution
    image = Image.new("RGB", (size, size), (120, 140, 90))
    mask = Image.new("L", (size, size), 0)
    side = int(size * args.mask_ratio ** 0.5)
    mask.paste(255, ((size - side) // 2, (size - side) // 2, (size + side) // 2, (size + side) // 2))
    rounds: list[dict[str, float]] = []  # one edit of each variant per round: paired within the round
    read = {"sync": {"wall": [], "cpu": []}, "sync/buffered": {"wall": [], "cpu": []}}
    applied: dict[str, list[int]] = {"async": [], "async+prefetch": [], "async+prefetch/buffered": []}
    with engine:
        template_id = engine.register_template(image, prompt="a field", steps=args.steps, seed=1)
        request = EditRequest(template_id, mask, "a red barn", seed=2)
        # (name, latest step, read cold, load from submission, the async variant whose step it holds back to):
        # "warm" finds the adapter sync just loaded, so it applies from step 0. Without prefetch the load starts
        # when the request joins the batch (after its pre-processing), as a server that loads a request's LoRA
        # before running it does. "/buffered": the file read through the page cache, not with O_DIRECT.
        variants = [("none", None, False, False, None), ("sync", 0.0, True, False, None),
                    ("sync/buffered", 0.0, True, False, None),
                    ("warm", 0.3, False, False, None), ("async", 0.3, True, False, None),
                    ("held@async", 0.3, False, False, "async"), ("async+prefetch", 0.3, True, True, None),
                    ("held@async+prefetch", 0.3, False, False, "async+prefetch"),
                    ("async+prefetch/buffered", 0.3, True, True, None),
                    ("held@async+prefetch/buffered", 0.3, False, False, "async+prefetch/buffered")]
        loras = engine.worker.loras
        loras.memory.prefault(pinned=device.type == "cuda")  # reads land in recycled memory from the first round
        prefetch, ready = loras.prefetch, loras.ready
        progress = bar(range((args.load_repeats + 1) * len(variants)), "lora: sync vs async load", unit="edit")
        steps = iter(progress)
        for repeat in range(args.load_repeats + 1):  # the first round warms up
            latency, steps_applied = {}, {}
            for name, latest, cold, prefetches, holds_for in variants:
                next(steps, None)
                loras.prefetch = prefetch if prefetches else (lambda choice: None)
                loras.ready = ready if holds_for is None else _held_back(ready, steps_applied[holds_for])
                if cold:
                    loras.clear()
                    drop_from_page_cache(path)
                before = loras.metrics()
                engine.worker.config = dataclasses.replace(engine.worker.config, lora_latest_step=latest or 0.0)
                with buffered_reads() if name.endswith("/buffered") else contextlib.nullcontext():
                    started = time.perf_counter()
                    result = engine.submit(request, lora=[] if latest is None else "big").result()
                    latency[name] = time.perf_counter() - started
                steps_applied[name] = result.metrics.lora_applied_step
                if holds_for is not None and steps_applied[name] != steps_applied[holds_for]:
                    raise RuntimeError(f"{name} applied its adapter at step {steps_applied[name]}, not "
                                       f"{steps_applied[holds_for]}")
                after = loras.metrics()
                if repeat and name in read:
                    read[name]["wall"].append(after["load_seconds"] - before["load_seconds"])
                    read[name]["cpu"].append(after["load_cpu_seconds"] - before["load_cpu_seconds"])
                if repeat and name in applied:
                    applied[name].append(steps_applied[name])
            if repeat:
                rounds.append(latency)
        progress.close()
        loras.prefetch, loras.ready = prefetch, ready
        fallbacks = loras.metrics()["read_fallbacks"]  # reads that found no recycled memory (expected: none)
        text_encoder_part = _text_encoder_part_read(args, engine.editor.pipe, engine.editor.denoiser, folder)
    medians = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
    load_cost = statistics.median(r["sync"] - r["warm"] for r in rounds)
    report = {"adapter_mib": round(path.stat().st_size / 2**20, 1), "rank": args.load_rank, "steps": args.steps,
              "repeats": args.load_repeats, "e2e_s": medians, "read_s": statistics.median(read["sync"]["wall"]),
              "read_cpu_s": statistics.median(read["sync"]["cpu"]), "load_cost_s": load_cost,
              "load_cost_quartiles_s": _quartiles([r["sync"] - r["warm"] for r in rounds]),
              "lora_compute_per_step_s": (medians["warm"] - medians["none"]) / args.steps,
              "read_fallbacks": fallbacks,
              "text_encoder_part": {**text_encoder_part,
                                    "share_of_load_cost": round(text_encoder_part["read_s"] / load_cost, 3)
                                    if load_cost > 0 else None}}
    for name, steps_applied in applied.items():
        exposed = [r[name] - r[f"held@{name}"] for r in rounds]
        report[name] = {"applied_step": statistics.median(steps_applied),
                        "exposed_load_s": statistics.median(exposed), "exposed_quartiles_s": _quartiles(exposed),
                        "hidden_share": round(1 - statistics.median(exposed) / load_cost, 3) if load_cost > 0
                        else None}
    # The same adapter read through the page cache, in the same rounds: its own load cost, what the async edit
    # still pays of it, and how each compares with the direct read's.
    buffered_cost = statistics.median(r["sync/buffered"] - r["warm"] for r in rounds)
    report["buffered_reads"] = {
        "read_s": statistics.median(read["sync/buffered"]["wall"]),
        "read_cpu_s": statistics.median(read["sync/buffered"]["cpu"]), "load_cost_s": buffered_cost,
        "load_cost_quartiles_s": _quartiles([r["sync/buffered"] - r["warm"] for r in rounds]),
        "hidden_share": round(1 - report["async+prefetch/buffered"]["exposed_load_s"] / buffered_cost, 3)
        if buffered_cost > 0 else None,
        "exposed_over_direct": _paired_ratio([r["async+prefetch/buffered"] - r["held@async+prefetch/buffered"]
                                              for r in rounds],
                                             [r["async+prefetch"] - r["held@async+prefetch"] for r in rounds])}
    report["async+prefetch/buffered"]["hidden_share"] = report["buffered_reads"]["hidden_share"]
    report["hidden_share"] = report["async+prefetch"]["hidden_share"]  # the engine's default: load from submission
    return report


def _paired_ratio(numerators: list[float], denominators: list[float]) -> float | None:
    """Median of the first over median of the second (None where the second is not positive)."""
    bottom = statistics.median(denominators)
    return round(statistics.median(numerators) / bottom, 3) if bottom > 0 else None


def _text_encoder_part_read(args, pipe, denoiser: torch.nn.Module, folder: Path) -> dict:
    """What a request pays before its first step for an adapter that adapts the text encoders too: the same
    file with them, its text-encoder part read cold where prompts are encoded (`read_text_encoder_lora`:
    that part's bytes only), against the whole load the step loop hides (`load_cost_s`)."""
    from retouch.lora.files import read_text_encoder_lora, text_encoder_components

    encoders = {name: getattr(pipe, name) for name in text_encoder_components(pipe)}
    path = save_diffusers_lora(denoiser, folder, args.load_rank, "big-te", text_encoders=encoders)
    seconds, parts = [], {}
    for _ in range(args.load_repeats):
        drop_from_page_cache(path)
        started = time.perf_counter()
        parts = read_text_encoder_lora(path, "big-te", pipe)
        seconds.append(time.perf_counter() - started)
    return {"file_mib": round(path.stat().st_size / 2**20, 1),
            "part_mib": round(sum(w.nbytes for w in parts.values()) / 2**20, 3),
            "read_s": statistics.median(seconds), "read_quartiles_s": _quartiles(seconds)}


def _held_back(ready, steps: int):
    """`LoraManager.ready` that says not yet for a request's first `steps` questions: the loop asks once per
    step of a lone request until it is ready, so an adapter already loaded applies from step `steps`."""
    asked = itertools.count()
    return lambda futures: ready(futures) if next(asked) >= steps else False


def _quartiles(values: list[float]) -> list[float]:
    return [round(q, 4) for q in statistics.quantiles(values, n=4)] if len(values) > 1 else values


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(prog="retouch bench lora", description=__doc__)
    parser.add_argument("--model", default="flux-small", choices=sorted(TEXT_TOKENS))
    parser.add_argument("--engine-model", default=None, help="pipeline of the loading part (default: flux-demo for "
                        "flux-small: its transformer with a VAE that leaves the denoiser its share)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16, help="rank of the step part's adapters")
    parser.add_argument("--load-rank", type=int, default=512,
                        help="rank of the loading part's adapter (its file: hundreds of MiB at 512)")
    parser.add_argument("--mask-ratio", type=mask_ratio, default=0.2)
    parser.add_argument("--resolution", type=side_pixels, default=256, help="pixels per side of the step part")
    parser.add_argument("--engine-resolution", type=side_pixels, default=256,
                        help="pixels per side of the loading part")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--load-repeats", type=int, default=12,
                        help="rounds of the loading part (after a warm-up)")
    parser.add_argument("--skip-load", action="store_true", help="only the step overhead")
    parser.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--out", type=out_path, default=None, help="also write the JSON here, and a PNG beside it")
    args = parser.parse_args(argv)
    if min(args.batch, args.rank, args.load_rank, args.repeats, args.load_repeats, args.steps) < 1:
        parser.error("--batch, --rank, --load-rank, --repeats, --load-repeats and --steps must be >= 1")
    args.engine_model = args.engine_model or ("flux-demo" if args.model == "flux-small" else args.model)
    if not (is_builtin(args.engine_model) or Path(args.engine_model).is_dir()):
        parser.error(f"--engine-model {args.engine_model!r} is neither a built-in model nor a pipeline folder")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))

    report = {"bench": "lora", **environment("lora", argv, device),
              "model": args.model,
              "dtype": str(dtype).removeprefix("torch."), "batch": args.batch, "rank": args.rank,
              "mask_ratio": args.mask_ratio, "resolution": args.resolution,
              "baseline": "the same batch without LoRA; the same edit without LoRA",
              "steps": step_overhead(args, device, dtype)}
    if not args.skip_load:
        report["loading"] = {"model": args.engine_model, "resolution": args.engine_resolution,
                             **load_hiding(args, device, dtype)}
    return publish(report, args.out, plot)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    panels = 2 if "loading" in report else 1
    figure, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.5), squeeze=False)
    axis = axes[0][0]
    names = list(report["steps"][0]["seconds"])
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [m + (i - (len(names) - 1) / 2) * width for m in range(len(report["steps"]))]
        values = [row["seconds"][name] for row in report["steps"]]
        axis.bar(xs, values, width, label=name)
        for x, row in zip(xs, report["steps"]):
            if name in row["overhead"]:
                axis.annotate(f"+{row['overhead'][name] * 100:.1f}%", (x, row["seconds"][name]), ha="center",
                              va="bottom", fontsize=8)
    axis.set_xticks(range(len(report["steps"])), [row["mode"] for row in report["steps"]])
    axis.set_ylabel("seconds per step")
    axis.set_title(f"batch of {report['batch']}, rank {report['rank']}: {report['model']}")
    axis.legend()
    if panels == 2:
        loading = report["loading"]
        axis = axes[0][1]
        # The differences the share is made of, with their quartiles over the rounds: the latencies themselves
        # differ by less than their noise.
        bars = [("load\n(sync - warm)", loading["load_cost_s"], loading["load_cost_quartiles_s"], "tab:red")]
        bars += [(f"exposed\n({name} - held)", loading[name]["exposed_load_s"], loading[name]["exposed_quartiles_s"],
                  colour) for name, colour in (("async", "tab:green"), ("async+prefetch", "tab:olive"))]
        buffered = loading["buffered_reads"]  # the same, the file read through the page cache
        bars += [("load\nbuffered", buffered["load_cost_s"], buffered["load_cost_quartiles_s"], "tab:pink"),
                 ("exposed\nbuffered", loading["async+prefetch/buffered"]["exposed_load_s"],
                  loading["async+prefetch/buffered"]["exposed_quartiles_s"], "tab:gray")]
        for x, (_, value, quartiles, colour) in enumerate(bars):
            low, high = quartiles[0], quartiles[-1]
            axis.bar(x, value, color=colour, yerr=[[value - low], [high - value]], capsize=4)
        axis.set_xticks(range(len(bars)), [bar[0] for bar in bars])
        axis.axhline(0, color="black", linewidth=0.5)
        axis.set_ylabel("seconds (median, quartiles)")
        axis.set_title(f"{loading['adapter_mib']:.0f} MiB adapter: {loading['hidden_share'] * 100:.0f}% of its load "
                       "hidden" if loading["hidden_share"] is not None else "load")
        axis.tick_params(axis="x", labelsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
