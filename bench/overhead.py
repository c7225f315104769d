"""Host overhead of one denoiser forward: full compute against mask-aware (Y-cache, KV-cache), eager and
compiled, at the model's depth and block structure but a tiny width (`retouch.models.narrow`), where
compute is negligible and the time is the host's.

    retouch bench overhead --model flux-size [--grid 8] [--mask-ratios 0.1,0.2,0.5] [--compile] [--out F.json]

Per variant: host time per forward (median of interleaved repeats; the time the host takes to issue the
forward, planning included: a mask-aware forward builds its context inside the timed call), top-level
ops per forward and per block (torch.profiler: aten and retouch ops called from Python, not their
children), and host syncs of the planned forward (`retouch.host_syncs`, counted around the denoiser
call once its context is built). `--compile` adds the compiled variants: the stock model under
torch.compile (the baseline users pick) and the mask-aware blocks under `MaskAwareAdapter.compile`.
Prints one JSON object; `--out F.json` also writes F.png.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from retouch.bench.report import device_arg, environment, mask_ratios, out_path, publish, pyplot
from retouch.bench.trace import is_top_level_op
from retouch.errors import ArgumentParser
from retouch.host_syncs import counting_host_syncs
from retouch.models import build_denoiser
from retouch.profile import VARIANTS, build_target
from retouch.progress import bar

MASK_AWARE = ("y", "kv")


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(prog="retouch bench overhead", description=__doc__)
    parser.add_argument("--model", default="flux-size", help="a bench spec (flux-size, sd3-size, sdxl-size, sd2-size)")
    parser.add_argument("--grid", type=int, default=8, help="tokens per side (a UNet's latent pixels)")
    parser.add_argument("--text-tokens", type=int, default=16, help="prompt tokens (few: compute stays negligible)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--mask-ratios", type=mask_ratios, default="0.1,0.2,0.5")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", type=device_arg, default="cpu")
    parser.add_argument("--compile", action="store_true", help="also time the torch.compile'd variants")
    parser.add_argument("--out", type=out_path, default=None, help="also write the JSON here, and a PNG beside it")
    args = parser.parse_args(argv)
    if min(args.grid, args.batch, args.repeats, args.text_tokens) < 1:
        parser.error("--grid, --text-tokens, --batch and --repeats must be >= 1")

    device = torch.device(args.device)
    print(f"building a narrow {args.model} ({args.grid}x{args.grid} tokens)", file=sys.stderr)
    target = build_target(args.model, device, torch.float32, narrow=True, text_tokens=args.text_tokens)
    inputs = target.inputs(args.batch, args.grid)
    _, cache = target.record(args.batch, args.grid, device)
    variants = {"full": None}
    for ratio in args.mask_ratios:
        for mode in MASK_AWARE:
            variants[f"{mode}@{ratio:g}"] = (VARIANTS[mode], ratio)
    forwards = {name: Forward(target, inputs, cache, args, variant) for name, variant in variants.items()}
    if args.compile:
        forwards.update(compiled_forwards(args, device, variants))
    with bar(desc="overhead: host time per forward", total=len(forwards) * (args.repeats + 1),
             unit="forward") as timed:
        seconds = interleaved_host_medians({name: forward.run for name, forward in forwards.items()}, args.repeats,
                                           device, progress=timed)
    blocks = target.adapter.num_blocks
    rows = []
    counted = bar(forwards.items(), "overhead: ops and host syncs per forward", total=len(forwards), unit="variant")
    for name, forward in counted:
        ops = count_ops(forward.run)
        syncs = forward.count_syncs()
        rows.append({"variant": name, "compiled": forward.compiled, "host_ms": 1e3 * seconds[name], "ops": ops,
                     "ops_per_block": ops / blocks, "host_syncs": syncs})
        counted.set_postfix_str(f"{name}: {1e3 * seconds[name]:.2f} ms, {ops} ops ({ops / blocks:.1f} per block), "
                                f"{syncs} syncs", refresh=False)
    report = {**environment("overhead", argv, device), "model": args.model, "blocks": blocks, "grid": args.grid,
              "text_tokens": args.text_tokens, "batch": args.batch, "results": rows, "summary": summary(rows)}
    return publish(report, args.out, plot)


class Forward:
    """One variant's forward: the unmodified model (`variant` None) or a mask-aware one, whose context is
    built inside `run` (planning is part of its host time)."""

    def __init__(self, target, inputs: dict, cache, args, variant, denoiser=None, compiled: bool = False):
        self.target, self.inputs, self.cache, self.args, self.variant = target, inputs, cache, args, variant
        self.denoiser = target.denoiser if denoiser is None else denoiser
        self.compiled = compiled

    def context(self):
        mode, ratio = self.variant
        return self.target.edit_context(mode, self.args.batch, self.args.grid, ratio, self.cache)

    def run(self) -> None:
        with torch.inference_mode():
            if self.variant is None:
                self.denoiser(**self.inputs)
                return
            with self.target.adapter.run(self.context()):
                self.denoiser(**self.inputs)

    def count_syncs(self) -> int:
        """Host syncs of the planned forward: counted around the denoiser call, its context built."""
        with torch.inference_mode():
            if self.variant is None:
                with counting_host_syncs() as calls:
                    self.denoiser(**self.inputs)
                return sum(calls.values())
            with self.target.adapter.run(self.context()), counting_host_syncs() as calls:
                self.denoiser(**self.inputs)
        return sum(calls.values())


def compiled_forwards(args, device: torch.device, variants: dict) -> dict[str, Forward]:
    """The compiled variants, warmed up here (compilation is not timed), on models of their own so that
    the eager variants stay eager: the stock model (an unpatched copy, torch.compile'd whole: the
    baseline) and the mask-aware blocks (`MaskAwareAdapter.compile`)."""
    stock = torch.compile(build_denoiser(args.model, device=device, dtype=torch.float32, narrow=True).eval())
    target = build_target(args.model, device, torch.float32, narrow=True, text_tokens=args.text_tokens)
    inputs = target.inputs(args.batch, args.grid)
    _, cache = target.record(args.batch, args.grid, device)
    target.adapter.compile()
    forwards = {}
    compiling = bar(desc="overhead: compile", total=len(variants), unit="variant")
    for name, variant in variants.items():
        forward = Forward(target, inputs, cache, args, variant, denoiser=stock if variant is None else None,
                          compiled=True)
        label = "full compiled (stock)" if variant is None else f"{name} compiled"
        compiling.set_postfix_str(label)  # shown while it compiles: a compile takes seconds
        forward.run()
        forwards[label] = forward
        compiling.update()
    compiling.close()
    return forwards


def interleaved_host_medians(runs: dict[str, Callable[[], None]], repeats: int, device: torch.device,
                             progress=None) -> dict[str, float]:
    """Median host seconds of each run, round-robin after one warm-up each: from the call to its return,
    the device idle at the start (on CUDA the kernels may still run after it: that is device time).
    `progress`: a bar advanced once per call, outside the timed region."""
    def host_seconds(run) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        run()
        return time.perf_counter() - started

    for run in runs.values():
        host_seconds(run)
        if progress is not None:
            progress.update()
    samples = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            samples[name].append(host_seconds(run))
            if progress is not None:
                progress.update()
    return {name: statistics.median(values) for name, values in samples.items()}


def count_ops(run) -> int:
    """Top-level ops of one call (profiled): the aten and retouch ops issued, not the ops they call. In a
    compiled variant, the ops its graphs call (matmuls, attention, retouch ops) count; the kernels
    inductor generated for the fused rest are not ops and do not."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sum(1 for event in prof.events() if is_top_level_op(event))


def summary(rows: list[dict]) -> dict:
    """The issue's targets, from the data: ops per masked block against a full block, host time of the
    mask-aware forward at m = 0.2 against full compute (eager against eager, compiled against the
    compiled stock model), and host syncs."""
    by_name = {row["variant"]: row for row in rows}
    full = by_name["full"]
    out = {"full_ops_per_block": full["ops_per_block"]}
    compiled_full = by_name.get("full compiled (stock)")
    for mode in MASK_AWARE:
        row = by_name.get(f"{mode}@0.2")
        if row is None:
            continue
        out[f"{mode}_ops_per_block_over_full"] = row["ops_per_block"] / full["ops_per_block"]
        out[f"{mode}_host_over_full"] = row["host_ms"] / full["host_ms"]
        out[f"{mode}_host_syncs"] = row["host_syncs"]
        compiled = by_name.get(f"{mode}@0.2 compiled")
        if compiled is not None and compiled_full is not None:
            out[f"{mode}_compiled_host_over_compiled_full"] = compiled["host_ms"] / compiled_full["host_ms"]
            out[f"{mode}_compiled_host_over_eager"] = compiled["host_ms"] / row["host_ms"]
    out["max_host_syncs"] = max(row["host_syncs"] for row in rows if row["variant"] != "full"
                                and not row["variant"].startswith("full compiled"))
    return out


def plot(report: dict, out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = report["results"]
    names = [row["variant"] for row in rows]
    colours = ["tab:orange" if row["compiled"] else "tab:blue" for row in rows]
    figure, (times, ops) = plt.subplots(1, 2, figsize=(12, 0.9 + 0.3 * len(rows)))
    times.barh(names, [row["host_ms"] for row in rows], color=colours)
    times.set_xlabel("host ms per forward (orange: compiled)")
    times.invert_yaxis()
    ops.barh(names, [row["ops_per_block"] for row in rows], color=colours)
    ops.axvline(report["summary"]["full_ops_per_block"], color="k", linestyle="--", linewidth=1)
    ops.set_xlabel("top-level ops per block (dashed: full, eager)")
    ops.invert_yaxis()
    figure.suptitle(f"{report['model']} depth ({report['blocks']} blocks) at a tiny width, {report['grid']}x"
                    f"{report['grid']} tokens, batch {report['batch']}, {report['device_name']}")
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
