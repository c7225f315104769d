"""Batching modes under load (paper §6.4, Fig. 15): static batching against continuous batching with
pre/post-processing inline (naive) and in helper processes (disagg), on the same arrivals in one run.

    retouch bench batching --model tiny-flux-fill --compare --requests 60 --rps R [--out F.json]

Open-loop Poisson arrivals at `--rps`; each request edits one of `--templates` registered templates
with a synthetic rectangular mask whose token ratio is drawn from Beta(1.9, 8.1) (mean 0.19, the
mean of the paper's public trace). Prints one JSON object: per mode the latency percentiles, the mean
queue time, the loop's interruptions by pre/post work and its batching overhead per step; and the
cost of one request's pre- and post-processing next to a denoising step (where that work runs is the
difference between the modes).
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from retouch.bench.report import MAX_SIDE, device_arg, out_path, positive_float, publish, pyplot, environment, seed_arg
from retouch.editor import EditRequest, MaskAwareEditor
from retouch.engine.api import Engine
from retouch.engine.metrics import now
from retouch.engine.processing import postprocess, preprocess
from retouch.engine.worker import MODES, EngineConfig
from retouch.errors import ArgumentParser
from retouch.masks import FLUX_STRIDE
from retouch.models import load_pipeline
from retouch.progress import bar

MASK_BETA = (1.9, 8.1)  # mean 0.19


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(prog="retouch bench batching", description=__doc__)
    parser.add_argument("--model", default="tiny-flux-fill")
    parser.add_argument("--compare", action="store_true", help="run every mode (default: only --mode)")
    parser.add_argument("--mode", choices=MODES, default="disagg")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--rps", type=positive_float, default=4.0, help="mean arrival rate (Poisson)")
    parser.add_argument("--steps", type=int, default=28, help="denoising steps of every template")
    parser.add_argument("--size", type=int, default=256, help="template side in pixels")
    parser.add_argument("--templates", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--helpers", type=int, default=1, help="pre/post-processing processes (disagg)")
    parser.add_argument("--device", type=device_arg, default="cpu")
    parser.add_argument("--seed", type=seed_arg, default=0)
    parser.add_argument("--out", type=out_path, default=None, help="also write the JSON here, and a PNG beside it")
    args = parser.parse_args(argv)
    if min(args.requests, args.steps, args.templates, args.max_batch, args.helpers) < 1 or args.size < 32:
        parser.error("--requests, --steps, --templates, --max-batch and --helpers must be >= 1, --size >= 32")
    if args.size > MAX_SIDE:
        parser.error(f"--size must be at most {MAX_SIDE}, got {args.size}")
    if args.size % FLUX_STRIDE:
        parser.error(f"--size must be a multiple of {FLUX_STRIDE}")

    editor = MaskAwareEditor(load_pipeline(args.model, device=args.device))
    rng = random.Random(args.seed)
    registering = bar(range(args.templates), f"register templates ({args.steps} steps, {args.size}px)",
                      unit="template")
    template_ids = [editor.register_template(_template_image(rng, args.size), prompt=f"a scene {i}",
                                             steps=args.steps, seed=i) for i in registering]
    arrivals, requests, ratios = _workload(rng, args, template_ids)
    processing = _processing_costs(editor, requests[:5])

    modes = MODES if args.compare else (args.mode,)
    results = {}
    runs = bar(desc=f"batching: {args.requests} requests at {args.rps} rps", total=len(modes), unit="mode")
    for mode in modes:
        runs.set_postfix_str(mode)  # shown while it runs: a mode takes at least requests / rps seconds
        config = EngineConfig(mode=mode, max_batch=args.max_batch, helpers=args.helpers)
        results[mode] = _run(Engine(editor, config, args.model), arrivals, requests)
        runs.update()
    runs.close()

    report = {"bench": "batching", **environment("batching", argv, args.device),
              "model": args.model, "modes": results, "rps": args.rps,
              "requests": args.requests, "steps": args.steps, "size": args.size, "max_batch": args.max_batch,
              "mean_mask_ratio": statistics.fmean(ratios), "processing": processing}
    if "disagg" in results and "static" in results:
        report["disagg_p95_over_static_p95"] = results["disagg"]["p95_s"] / results["static"]["p95_s"]
    return publish(report, args.out, _plot)


def _template_image(rng: random.Random, size: int) -> Image.Image:
    image = Image.new("RGB", (size, size), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for _ in range(4):
        x, y = rng.randrange(size), rng.randrange(size)
        draw.ellipse((x, y, x + size // 3, y + size // 4), fill=tuple(rng.randrange(256) for _ in range(3)))
    return image


def _workload(rng: random.Random, args, template_ids: list[str]):
    """Arrival offsets (s), requests and their mask ratios."""
    grid = args.size // FLUX_STRIDE
    arrivals, requests, ratios, clock = [], [], [], 0.0
    for index in range(args.requests):
        clock += rng.expovariate(args.rps)
        ratio = min(1.0, max(1 / grid ** 2, rng.betavariate(*MASK_BETA)))
        height = max(1, min(grid, round((ratio * grid * grid) ** 0.5 * rng.uniform(0.7, 1.3))))
        width = max(1, min(grid, round(ratio * grid * grid / height)))
        top, left = rng.randrange(grid - height + 1), rng.randrange(grid - width + 1)
        mask = Image.new("L", (args.size, args.size), 0)
        ImageDraw.Draw(mask).rectangle((left * FLUX_STRIDE, top * FLUX_STRIDE, (left + width) * FLUX_STRIDE - 1,
                                        (top + height) * FLUX_STRIDE - 1), fill=255)
        arrivals.append(clock)
        requests.append(EditRequest(rng.choice(template_ids), mask, f"edit {index}", seed=index))
        ratios.append(height * width / grid ** 2)
    return arrivals, requests, ratios


def _processing_costs(editor: MaskAwareEditor, requests: list[EditRequest]) -> dict:
    """Median seconds of one request's pre- and post-processing, and of one batch-1 denoising step."""
    pre, post, step = [], [], []
    with torch.inference_mode():
        for request in requests:
            template = editor.templates[request.template_id]
            request = editor.check_request(request, template)
            started = now()
            ready = preprocess(editor, request, template)
            pre.append(now() - started)
            latents = ready.prepared.latents
            started = now()
            postprocess(editor, template, request.mask, latents)
            post.append(now() - started)
    with Engine(editor, EngineConfig(mode="naive", max_batch=1), editor.model.name) as engine:
        for request in requests:
            engine.submit(request).result()
        step = engine.metrics()["mean_step_s"]
    return {"pre_s": statistics.median(pre), "post_s": statistics.median(post), "step_s_batch1": step,
            "where": "disagg: text encoders and VAE in the helper processes; static/naive: on the loop thread"}


def _run(engine: Engine, arrivals: list[float], requests: list[EditRequest]) -> dict:
    with engine:
        start = time.perf_counter()
        futures = []
        for offset, request in zip(arrivals, requests):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                time.sleep(delay)  # open-loop arrivals
            futures.append(engine.submit(request))
        outcomes = []
        for future in futures:
            try:
                outcomes.append(future.result())
            except Exception as exc:  # a benchmark counts failures; it does not stop at one
                outcomes.append(exc)
        worker = engine.metrics()
    done = [o.metrics for o in outcomes if not isinstance(o, Exception)]
    e2e = sorted(m.e2e_s for m in done)
    return {"p50_s": _percentile(e2e, 50), "p95_s": _percentile(e2e, 95), "mean_s": statistics.fmean(e2e),
            "mean_queue_s": statistics.fmean(m.queue_s for m in done),
            "mean_inference_s": statistics.fmean(m.inference_s for m in done),
            "interruptions": worker["interruptions"], "ok": len(done), "failed": len(outcomes) - len(done),
            "mean_batch_size": worker["mean_batch_size"], "mean_step_s": worker["mean_step_s"],
            "overhead_per_step_s": worker["mean_overhead_s"], "overhead_fraction": worker["overhead_fraction"],
            "e2e_s": e2e}


def _percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def _plot(report: dict, out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    figure, axis = plt.subplots(figsize=(6, 4))
    for mode, result in report["modes"].items():
        latencies = result["e2e_s"]
        axis.plot(latencies, [(i + 1) / len(latencies) for i in range(len(latencies))], label=mode)
    axis.set_xlabel("end-to-end latency (s)")
    axis.set_ylabel("fraction of requests")
    axis.set_title(f"{report['model']}, {report['requests']} requests at {report['rps']} rps")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)
