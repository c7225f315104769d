"""End-to-end latency against request rate (paper Fig. 12): retouch's engine against the unmodified
diffusers pipeline with static batching, on the same Poisson arrivals and the same requests.

    retouch bench serving --model tiny-flux-fill --device cpu --size 64 --steps 2 --rps 1 2 --requests 6

On a GPU (one H100; ~7 minutes, most of it the sweep; estimated, not measured):

    retouch bench serving --model flux-size --device cuda --size 1024 --steps 8 --max-batch 8 \
        --rps 0.5 1 2 4 --requests 16 --out bench/results/h100/serving.json

Systems, each fed every RPS point's arrivals open loop (a request is sent at its arrival time whether
or not earlier ones are done; latency = sent to image ready, pre- and post-processing included):
    retouch:    `Engine` in disagg mode per device: continuous batching at step granularity, mask-aware
                steps reading the templates' activations from the pinned host cache (the planner on with
                `--cost-model`), pre/post-processing in a helper process. With `--workers N` a request
                goes to the engine with the fewest masked tokens outstanding (token-level balance).
    diffusers:  per device a loop that takes up to `--max-batch` waiting requests and runs the stock
                pipeline on them as one static batch (`edit_many(..., full_compute=True)`); with
                `--workers N` requests are dealt round-robin over the loops (request-level balance).
                One such system per `--baselines` entry (`retouch.bench.stock`): `diffusers` with the
                stock denoiser eager, `diffusers-compiled` with it under torch.compile.
`--workers N` puts worker i on cuda:i; on one device there is one engine and one loop.

Mask ratios follow the paper's distributions (`--mask-dist public|production`, as `retouch simulate`).
Each RPS point has `--requests` requests (that caps its duration: about requests / rps seconds per system,
longer where a system saturates) and its own arrivals and masks; every system sees the same ones, and all
are warmed up first. Prints one JSON object: per RPS point and system the mean, p50 and p95 latency,
ok and failed counts and the mean batch size (requests per denoising step); `--out F.json` also
writes F.png (mean and p95 latency against RPS).

GPU time, flux-size at 1024 px, 8 steps, 16 requests per point: a step of the stock transformer is
~1.2e14 FLOP per image (~0.25 s on an H100), so the static baseline saturates near 0.45 images/s and
takes ~35-40 s per point from 1 rps up; retouch (mask ratio ~0.19) drains faster than requests arrive
up to ~2 rps. The four points take ~75, ~55, ~50 and ~45 s for both systems together, after ~40 s of
warm-up, building the model (here and in the engine's helper process) and pinning the host cache.
GPU memory: the helper process builds the model as the parent did and frees its denoiser (it never
runs it), so the device carries the transformer once, next to the baseline's batch-8 VAE decode at
1024 px (~15-20 GB).
"""

from __future__ import annotations

import itertools
import statistics
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch

from retouch.bench import stock, workload
from retouch.bench.report import environment, positive_float, publish, pyplot
from retouch.editor import EditRequest, MaskAwareEditor
from retouch.engine.api import Engine
from retouch.engine.metrics import now
from retouch.engine.simulate import MASK_BETA
from retouch.engine.worker import EngineConfig
from retouch.errors import ArgumentParser
from retouch.progress import bar

BASELINE_SYSTEMS = {"eager": "diffusers", "compiled": "diffusers-compiled"}


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(prog="retouch bench serving", description=__doc__)
    workload.add_editor_options(parser)
    parser.add_argument("--rps", type=positive_float, nargs="+", default=[0.5, 1.0, 2.0, 4.0], help="request rates")
    parser.add_argument("--requests", type=int, default=16, help="requests per RPS point")
    parser.add_argument("--mask-dist", choices=tuple(MASK_BETA), default="public")
    parser.add_argument("--max-batch", type=int, default=8, help="requests per batch, every system")
    parser.add_argument("--workers", type=int, default=1, help="devices (cuda:0..N-1), one engine / loop each")
    parser.add_argument("--helpers", type=int, default=1, help="pre/post-processing processes per engine")
    args = parser.parse_args(argv)
    workload.check_editor_options(parser, args)
    if min(args.rps) <= 0 or args.requests < 1 or args.max_batch < 1 or args.workers < 1 or args.helpers < 1:
        parser.error("--rps must be > 0; --requests, --max-batch, --workers and --helpers >= 1")
    try:
        devices = workload.devices_for(args.device, args.workers)
    except ValueError as exc:
        parser.error(str(exc))

    editors = [workload.load_editor(args, device) for device in devices]
    template_ids = [workload.register_templates(editor, args) for editor in editors]
    assert all(ids == template_ids[0] for ids in template_ids), "template ids are digests of the same inputs"
    template_ids = template_ids[0]
    stride = workload.token_stride(editors[0])
    points = [_point_workload(args, index, rps, template_ids, stride) for index, rps in enumerate(args.rps)]
    warm_up = workload.synthetic_edits(np.random.default_rng([args.seed, 3]),
                                       template_ids, np.full(args.max_batch * args.workers, 0.2), args.size, stride,
                                       first_seed=10**6)

    results = []
    engine_config = EngineConfig(mode="disagg", max_batch=args.max_batch, helpers=args.helpers)
    baselines = stock.chosen(args)
    stocks = [stock.denoisers(editor.denoiser, baselines) for editor in editors]
    with ExitStack() as running:
        systems = {"retouch": running.enter_context(MaskAwareServing(editors, engine_config, args.model))}
        for baseline in baselines:
            systems[BASELINE_SYSTEMS[baseline]] = running.enter_context(
                StaticBatching(editors, args.max_batch, [denoisers[baseline] for denoisers in stocks]))
        for name, system in systems.items():
            print(f"warming up {name}", file=sys.stderr)
            _warm_up(system, warm_up)
        runs = bar(desc="serving: retouch vs diffusers", total=len(points) * len(systems), unit="run")
        for rps, arrivals, edits in points:
            row = {"rps": rps, "requests": len(edits), "arrival_span_s": arrivals[-1],
                   "mean_mask_ratio": statistics.fmean(edit.mask_ratio for edit in edits)}
            for name, system in systems.items():
                runs.set_postfix_str(f"{rps:g} rps {name}")  # shown while it runs: a run lasts requests / rps
                row[name] = _drive(system, arrivals, edits)
                runs.update()
            for metric in ("mean", "p95"):  # per baseline: its latency over retouch's
                row[f"{metric}_speedup"] = {baseline: _ratio(row[BASELINE_SYSTEMS[baseline]][f"{metric}_s"],
                                                             row["retouch"][f"{metric}_s"]) for baseline in baselines}
            results.append(row)
        runs.close()

    report = {"bench": "serving", **environment("serving", argv, devices[0]), "model": args.model,
              "dtype": args.dtype, "size": args.size, "steps": args.steps, "templates": args.templates,
              "cache_mode": args.cache_mode, "mask_dist": args.mask_dist, "max_batch": args.max_batch,
              "workers": args.workers, "helpers": args.helpers, "requests_per_point": args.requests,
              "planner": args.planner if args.cost_model else None,
              "cost_model": str(args.cost_model) if args.cost_model else None,
              "compiled": stock.compiled(args), "cuda_graphs": args.cuda_graphs,
              "cudagraph_skips": stock.cudagraph_skips(args),
              "baselines": stock.describe(baselines),
              "systems": {"retouch": MaskAwareServing.__doc__.splitlines()[0],
                          **{BASELINE_SYSTEMS[baseline]: f"{StaticBatching.__doc__.splitlines()[0]} ({baseline})"
                             for baseline in baselines}},
              "cache": [editor.cache.metrics() for editor in editors],
              "recomputes": sum(editor.recomputes for editor in editors), "results": results}
    return publish(report, args.out, _plot)


class MaskAwareServing:
    """retouch: an Engine per device in disagg mode (continuous batching, mask-aware steps)."""

    def __init__(self, editors: list[MaskAwareEditor], config: EngineConfig, model_name: str):
        self.engines = [Engine(editor, config, model_name) for editor in editors]
        self._outstanding: list[list[tuple[Future, int]]] = [[] for _ in self.engines]  # (future, masked tokens)
        self._stack = ExitStack()

    def __enter__(self) -> MaskAwareServing:
        for engine in self.engines:
            self._stack.enter_context(engine)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def submit(self, edit: workload.SyntheticEdit) -> Future[float]:
        """The engine with the fewest masked tokens not yet answered takes the edit; the future holds
        the perf_counter time its image was ready."""
        for index, pending in enumerate(self._outstanding):
            self._outstanding[index] = [(future, tokens) for future, tokens in pending if not future.done()]
        loads = [sum(tokens for _, tokens in pending) for pending in self._outstanding]
        index = loads.index(min(loads))
        finished: Future[float] = Future()
        try:
            future = self.engines[index].submit(edit.request)
        except Exception as exc:  # refused at the door: a failed request, not a stopped benchmark
            finished.set_exception(exc)
            return finished
        self._outstanding[index].append((future, edit.masked_tokens))

        def done(future: Future) -> None:
            if future.exception() is not None:
                finished.set_exception(future.exception())
            else:
                finished.set_result(future.result().metrics.completed)

        future.add_done_callback(done)
        return finished

    def steps(self) -> list[int]:
        """Per engine, the denoising steps run so far."""
        return [engine.worker.metrics.steps for engine in self.engines]

    def batch_sizes_since(self, marks: list[int]) -> list[int]:
        """The requests in each denoising step run after `marks` (`steps()`), over every engine."""
        return [size for engine, mark in zip(self.engines, marks)
                for size in engine.worker.metrics.batch_sizes_since(mark)]


class StaticBatching:
    """diffusers: the stock pipeline on static batches of up to max_batch waiting requests per device."""

    def __init__(self, editors: list[MaskAwareEditor], max_batch: int, denoisers: list[torch.nn.Module]):
        self.loops = [_StaticLoop(editor, max_batch, denoiser) for editor, denoiser in zip(editors, denoisers)]
        self._turn = itertools.cycle(range(len(self.loops)))  # request-level balance: round-robin

    def __enter__(self) -> StaticBatching:
        for loop in self.loops:
            loop.start()
        return self

    def __exit__(self, *exc) -> None:
        for loop in self.loops:
            loop.close()

    def submit(self, edit: workload.SyntheticEdit) -> Future[float]:
        return self.loops[next(self._turn)].submit(edit.request)

    def steps(self) -> list[int]:
        """Per loop, the batches run so far (a batch runs every step together)."""
        return [len(loop.batch_sizes) for loop in self.loops]

    def batch_sizes_since(self, marks: list[int]) -> list[int]:
        """The size of each batch run after `marks` (`steps()`), over every loop."""
        return [size for loop, mark in zip(self.loops, marks) for size in loop.batch_sizes[mark:]]


class _StaticLoop:
    """Takes whatever is waiting (up to max_batch) when the previous batch is done, and runs it to the end
    with `denoiser` (a stock baseline) as the pipeline's."""

    def __init__(self, editor: MaskAwareEditor, max_batch: int, denoiser: torch.nn.Module):
        self.editor = editor
        self.denoiser = denoiser
        self.max_batch = max_batch
        self.batch_sizes: list[int] = []
        self._waiting: deque[tuple[EditRequest, Future]] = deque()
        self._changed = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="retouch-static-batching", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Finish what was submitted, then stop."""
        with self._changed:
            self._stopping = True
            self._changed.notify()
        self._thread.join()

    def submit(self, request: EditRequest) -> Future[float]:
        future: Future[float] = Future()
        with self._changed:
            self._waiting.append((request, future))
            self._changed.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._waiting or self._stopping)
                if not self._waiting:
                    return
                batch = [self._waiting.popleft() for _ in range(min(self.max_batch, len(self._waiting)))]
            self.batch_sizes.append(len(batch))
            try:
                # The engine is idle meanwhile (systems run in turn), so swapping the pipeline's denoiser is safe.
                stock.full_edits(self.editor, [request for request, _ in batch], self.denoiser)
            except Exception as exc:  # the batch's requests fail; the loop goes on
                for _, future in batch:
                    future.set_exception(exc)
                continue
            ready = now()
            for _, future in batch:
                future.set_result(ready)


def _point_workload(args, index: int, rps: float, template_ids: list[str], stride: int):
    """One RPS point's arrival offsets and edits: its own random stream, the same for both systems."""
    rng = np.random.default_rng([args.seed, 2, index])
    ratios = workload.mask_ratios(rng, args.requests, args.mask_dist)
    edits = workload.synthetic_edits(rng, template_ids, ratios, args.size, stride, first_seed=args.requests * index)
    return rps, workload.poisson_arrivals(rng, args.requests, rps), edits


def _warm_up(system, edits: list[workload.SyntheticEdit]) -> None:
    """Every edit at once (first kernels, allocator, autotuning); a failure here stops the benchmark."""
    for future in [system.submit(edit) for edit in edits]:
        future.result()


def _drive(system, arrivals: list[float], edits: list[workload.SyntheticEdit]) -> dict:
    """Send each edit at its arrival offset, wait for all; latency and batch statistics of the point."""
    marks = system.steps()
    start = now()
    sent, futures = [], []
    for offset, edit in zip(arrivals, edits):
        delay = start + offset - now()
        if delay > 0:
            time.sleep(delay)  # open-loop arrivals
        sent.append(now())
        futures.append(system.submit(edit))
    latencies, errors = [], {}
    for sent_at, future in zip(sent, futures):
        try:
            latencies.append(future.result() - sent_at)
        except Exception as exc:  # a benchmark counts failures; it does not stop at one
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
    batch_sizes = system.batch_sizes_since(marks)
    summary = {"ok": len(latencies), "failed": len(futures) - len(latencies), "errors": errors,
               "mean_s": None, "p50_s": None, "p95_s": None, "max_s": None,
               "mean_batch_size": statistics.fmean(batch_sizes) if batch_sizes else 0.0,
               "batches": len(batch_sizes), "e2e_s": latencies}
    if latencies:
        p50, p95 = np.percentile(latencies, [50, 95]).tolist()
        summary.update(mean_s=statistics.fmean(latencies), p50_s=p50, p95_s=p95, max_s=max(latencies))
    return summary


def _ratio(baseline: float | None, ours: float | None) -> float | None:
    return None if baseline is None or not ours else baseline / ours


def _plot(report: dict, out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = report["results"]
    figure, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for axis, (metric, label) in zip(axes, (("mean_s", "mean latency (s)"), ("p95_s", "p95 latency (s)"))):
        for system in report["systems"]:
            points = [(row["rps"], row[system][metric]) for row in rows if row[system][metric] is not None]
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=system)
        axis.set_xscale("log", base=2)
        axis.set_xticks([row["rps"] for row in rows], [f"{row['rps']:g}" for row in rows])
        axis.minorticks_off()
        axis.set_ylim(bottom=0)
        axis.set_xlabel("requests / s (Poisson)")
        axis.set_ylabel(label)
        axis.legend()
    figure.suptitle(f"{report['model']} {report['size']}px, {report['steps']} steps, {report['mask_dist']} masks, "
                    f"max batch {report['max_batch']}, {report['workers']} x {report['device_name']}", fontsize=9)
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main(sys.argv[1:])
