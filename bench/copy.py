"""Host gather benchmark: template rows out of a HostArena into a staging buffer (paper §4.2).

    retouch bench copy [--device cpu|cuda] [--quick] [--out F.json]     (or python -m retouch.bench.copy)

Per transformer block a mask-aware batch needs, for each request, the cached rows of its template's
unmasked tokens: all L tokens of a sqrt(L) x sqrt(L) grid minus a centred rectangle covering the mask
ratio. Templates live back to back in a HostArena (pinned on a GPU machine); the rows go to a staging
buffer [B*L, H] at the request's token positions. Rows as the served models have them: Flux blocks
(H=3072 bf16, 6 KiB rows) and SDXL's first transformer level (H=640 fp16, 1.25 KiB rows).

- cpu: `ops.gather_host_rows_` (threaded memcpy per row) against torch `index_select` + `index_copy_`
  of the same rows (the arena viewed as [rows, H]), timed interleaved in the same run.
- cuda: the "kernel", "memcpy" and "auto" methods, and "kernel_lean" (the kernel on the bounded grid the
  copy engine gives it beside compute: a quarter of the SMs), against one contiguous pinned->device copy
  of the same number of bytes (what the link can do at best), with CUDA events; "runs" is how many copies
  "memcpy" issues per block. Then `overlap_<method>` (kernel, kernel_lean, memcpy): gathers on a side
  stream beside matmuls as long, their wall time over the longer of the two alone (1: hidden behind the
  compute; ~2: serialised with it), what the copy engine's staging pays.
GB/s count the bytes of the rows copied. Prints one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path

import torch

from retouch import ops
from retouch.bench.report import device_arg, json_text, out_path, pyplot, write_json, environment
from retouch.bench.timing import interleaved_medians, seconds_of
from retouch.cache.staging import gather_blocks_beside_compute
from retouch.errors import ArgumentParser
from retouch.masks import centred_token_rectangle
from retouch.progress import bar

# name -> (hidden size, dtype) of a token row.
ROW_SHAPES = {"flux": (3072, "bfloat16"), "sdxl": (640, "float16")}


@dataclasses.dataclass(slots=True)
class CopyBenchConfig:
    device: str = "cpu"
    tokens_per_request: int = 4096  # L: Flux at 1024x1024 has a 64 x 64 grid of image tokens
    batch_sizes: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 4, 8])
    mask_ratios: list[float] = dataclasses.field(default_factory=lambda: [0.05, 0.2, 0.5])
    rows: list[str] = dataclasses.field(default_factory=lambda: list(ROW_SHAPES))
    repeats: int = 11

    def __post_init__(self):
        if self.tokens_per_request < 1:
            raise ValueError(f"tokens_per_request must be >= 1, got {self.tokens_per_request}")
        side = round(self.tokens_per_request ** 0.5)
        if side * side != self.tokens_per_request:
            raise ValueError(f"tokens_per_request must be a square grid, got {self.tokens_per_request}")
        if min(self.batch_sizes) < 1 or self.repeats < 1:
            raise ValueError("batch sizes and repeats must be >= 1")
        if not all(0.0 < r < 1.0 for r in self.mask_ratios):
            raise ValueError(f"mask ratios must lie in (0, 1), got {self.mask_ratios}")
        if unknown := set(self.rows) - set(ROW_SHAPES):
            raise ValueError(f"rows must be among {sorted(ROW_SHAPES)}, got {sorted(unknown)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")

    @classmethod
    def quick(cls, device: str) -> CopyBenchConfig:
        return cls(device=device, tokens_per_request=1024, batch_sizes=[1, 4], mask_ratios=[0.2], repeats=3)


def parse_args(argv: list[str] | None) -> tuple[CopyBenchConfig, bool, Path | None]:
    parser = ArgumentParser(prog="retouch bench copy", description=__doc__)
    defaults = CopyBenchConfig()
    for field in dataclasses.fields(CopyBenchConfig):
        value = getattr(defaults, field.name)
        many = isinstance(value, list)
        kind = device_arg if field.name == "device" else type(value[0]) if many else type(value)
        parser.add_argument("--" + field.name.replace("_", "-"), type=kind, nargs="+" if many else None, default=None,
                            help=f"default: {value}")
    parser.add_argument("--quick", action="store_true", help="L=1024, two batch sizes, one mask ratio (seconds)")
    parser.add_argument("--out", type=out_path, default=None, help="also write the JSON here, and a PNG beside it")
    args = parser.parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(CopyBenchConfig)
                 if getattr(args, f.name) is not None}
    device = overrides.pop("device", "cpu")
    try:
        base = CopyBenchConfig.quick(device) if args.quick else CopyBenchConfig(device=device)
        return dataclasses.replace(base, **overrides), args.quick, args.out
    except ValueError as exc:
        parser.error(str(exc))


def unmasked_rows(tokens: int, ratio: float) -> torch.Tensor:
    """Token indices [n] of a request that the template supplies: all but a centred masked rectangle."""
    side = round(tokens ** 0.5)
    keep = torch.ones(tokens, dtype=torch.bool)
    keep[centred_token_rectangle((side, side), ratio)] = False
    return keep.nonzero().flatten()


def bench_row_shape(config: CopyBenchConfig, shape: str) -> list[dict]:
    hidden, dtype = ROW_SHAPES[shape][0], getattr(torch, ROW_SHAPES[shape][1])
    row_bytes, tokens, cuda = hidden * dtype.itemsize, config.tokens_per_request, config.device == "cuda"
    template_bytes = tokens * row_bytes
    max_batch = max(config.batch_sizes)
    arena = ops.HostArena(max_batch * template_bytes, pinned=cuda)
    bases = [arena.allocate(template_bytes) for _ in range(max_batch)]
    memory = arena.tensor()
    memory.fill_(1)  # touch every page before timing
    staging = torch.empty(max_batch * tokens, hidden, dtype=dtype, device=config.device)
    # The baseline indexes the arena as rows; it can because each template starts on a row boundary.
    assert all(base % row_bytes == 0 for base in bases)
    arena_rows = memory[: arena.capacity // row_bytes * row_bytes].view(dtype).view(-1, hidden)

    results = []
    points = bar([(batch, ratio) for batch in config.batch_sizes for ratio in config.mask_ratios],
                 f"copy: {shape} ({row_bytes} B rows, {arena.capacity >> 20} MiB arena, pinned={arena.pinned})",
                 unit="point")
    for batch, ratio in points:
        kept = unmasked_rows(tokens, ratio)
        src_offsets = torch.cat([base + kept * row_bytes for base in bases[:batch]])
        dst_rows = torch.cat([b * tokens + kept for b in range(batch)])
        nbytes = len(src_offsets) * row_bytes
        row = {"rows": shape, "row_bytes": row_bytes, "batch": batch,
               "mask_ratio": round(1 - len(kept) / tokens, 4), "bytes": nbytes,
               "runs": ops.row_runs(src_offsets, dst_rows, row_bytes)}
        if cuda:
            row.update(time_cuda(staging, memory, src_offsets, dst_rows, nbytes, config.repeats))
        else:
            row.update(time_cpu(staging, memory, arena_rows, src_offsets, dst_rows, row_bytes, config.repeats))
        results.append(row)
        points.set_postfix_str(f"B={batch} m={row['mask_ratio']}: {row['runs']} runs, " + ", ".join(
            f"{k} {v:.2f}" for k, v in row.items() if k.endswith(("gbps", "ratio")) and k != "mask_ratio"),
            refresh=False)
    return results


def time_cpu(staging, memory, arena_rows, src_offsets, dst_rows, row_bytes, repeats) -> dict:
    src_row_idx = src_offsets // row_bytes
    runs = {
        "gather": lambda: ops.gather_host_rows_(staging, memory, src_offsets, dst_rows),
        "baseline": lambda: staging.index_copy_(0, dst_rows, arena_rows.index_select(0, src_row_idx)),
    }
    seconds = interleaved_medians(runs, repeats, torch.device("cpu"))
    nbytes = len(src_offsets) * row_bytes
    gbps = {name: nbytes / s / 1e9 for name, s in seconds.items()}
    return {"gather_gbps": round(gbps["gather"], 3), "baseline_gbps": round(gbps["baseline"], 3),
            "ratio": round(gbps["gather"] / gbps["baseline"], 3)}


def time_cuda(staging, memory, src_offsets, dst_rows, nbytes, repeats) -> dict:
    contiguous_dst, contiguous_src = staging.view(-1).view(torch.uint8)[:nbytes], memory[:nbytes]
    gathers = {method: (lambda method=method: ops.gather_host_rows_(staging, memory, src_offsets, dst_rows, method))
               for method in ops.HOST_GATHER_METHODS}
    lean_blocks = gather_blocks_beside_compute(staging.device)
    gathers["kernel_lean"] = lambda: ops.gather_host_rows_(staging, memory, src_offsets, dst_rows, "kernel",
                                                           max_blocks=lean_blocks)
    runs = {**gathers, "baseline": lambda: contiguous_dst.copy_(contiguous_src, non_blocking=True)}
    seconds = interleaved_medians(runs, repeats, torch.device("cuda"))
    gbps = {name: nbytes / s / 1e9 for name, s in seconds.items()}
    beside = time_beside_compute({name: gathers[name] for name in ("kernel", "kernel_lean", "memcpy")},
                                 seconds["kernel"], repeats)
    return {**{f"{name}_gbps": round(value, 3) for name, value in gbps.items()},
            **{f"{method}_ratio": round(gbps[method] / gbps["baseline"], 3) for method in gathers},
            "kernel_lean_blocks": lean_blocks, **beside}


COPIES_BESIDE_COMPUTE = 4


def time_beside_compute(gathers: dict, gather_seconds: float, repeats: int) -> dict:
    """overlap_<method>: the wall time of `COPIES_BESIDE_COMPUTE` gathers on a side stream beside matmuls as
    long on the compute stream (a Flux block's MLP projection, bf16), over the longer of the two alone: 1 is
    a copy hidden behind compute, about 2 a copy that holds the compute back (what the copy engine's staging
    must avoid: a gather kernel that fills every SM serialises them, stop 52)."""
    device = torch.device("cuda")
    x = torch.randn(4608, 3072, device=device, dtype=torch.bfloat16)
    w = torch.randn(3072, 12288, device=device, dtype=torch.bfloat16)
    seconds_of(lambda: x @ w, device)
    matmul_seconds = statistics.median(seconds_of(lambda: x @ w, device) for _ in range(5))
    matmuls = max(1, round(COPIES_BESIDE_COMPUTE * gather_seconds / matmul_seconds))
    side = torch.cuda.Stream(device)

    def compute() -> None:
        for _ in range(matmuls):
            x @ w

    def copies(gather, with_compute: bool):
        def run() -> None:
            current = torch.cuda.current_stream(device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for _ in range(COPIES_BESIDE_COMPUTE):
                    gather()
            if with_compute:
                compute()
            current.wait_stream(side)
        return run

    runs = {"compute": compute, **{f"copies {name}": copies(gather, False) for name, gather in gathers.items()},
            **{f"both {name}": copies(gather, True) for name, gather in gathers.items()}}
    seconds = interleaved_medians(runs, repeats, device)
    return {f"overlap_{name}": round(seconds[f"both {name}"] / max(seconds["compute"], seconds[f"copies {name}"]), 3)
            for name in gathers}


def main(argv: list[str] | None = None) -> dict:
    config, quick, out = parse_args(argv)
    results = [row for shape in config.rows for row in bench_row_shape(config, shape)]
    report = {"bench": "copy", **environment("copy", argv, config.device),
              "quick": quick,
              "config": dataclasses.asdict(config), "results": results}
    if out is not None:
        write_json(report, out)
        write_plot(report, out.with_suffix(".png"))
    print(json_text(report))
    return report


def write_plot(report: dict, path: Path) -> None:
    """GB/s against batch size, one panel per row size: a line per method and mask ratio; on a GPU a second
    row of panels, the overlap with compute of each method (1 = hidden)."""
    plt = pyplot()
    if plt is None:
        return
    rows = report["results"]
    shapes = list(dict.fromkeys(row["rows"] for row in rows))
    panels = [("_gbps", "GB/s")] + ([("overlap_", "wall time / longer alone")] if "overlap_kernel" in rows[0] else [])
    figure, axes = plt.subplots(len(panels), len(shapes), figsize=(5 * len(shapes), 3.8 * len(panels)),
                                squeeze=False)
    styles = ("-", "--", ":", "-.", (0, (1, 3)))
    for (key, unit), panel_axes in zip(panels, axes):
        metrics = [name for name in rows[0] if (name.endswith(key) if key == "_gbps" else name.startswith(key))]
        for axis, shape in zip(panel_axes, shapes):
            for colour, ratio in enumerate(dict.fromkeys(row["mask_ratio"] for row in rows)):
                selected = [row for row in rows if row["rows"] == shape and row["mask_ratio"] == ratio]
                for style, metric in zip(styles, metrics):
                    label = metric.removesuffix("_gbps").removeprefix("overlap_")
                    axis.plot([row["batch"] for row in selected], [row[metric] for row in selected], linestyle=style,
                              marker="o", color=f"C{colour}", label=f"{label} m={ratio:.2f}")
            beside = ", beside compute" if key != "_gbps" else ""
            axis.set_title(f"{shape} ({selected[0]['row_bytes']} B rows){beside}")
            axis.set_xlabel("requests per batch")
            axis.set_ylabel(unit)
            axis.legend(fontsize="small")
    figure.suptitle(f"host gather on {report['device_name']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main(sys.argv[1:])
