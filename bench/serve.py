"""Load on a running retouch server over HTTP: edits against one template, with a cap on requests in flight.

    retouch bench serve --url http://127.0.0.1:8000 --requests 100 --concurrency 8 [--rps R] [--out F.json]
    retouch bench serve ... --one-off 0.5 --registrations 4 --stock-model tiny-flux-fill

The workload mix (what a request costs, issue 15): `--one-off F` sends a fraction F of the edits as
one-off images (POST /v1/edits with `image`, a new image each time, as OpenAI clients do) among the
edits of the registered template, and reports latency per class (`classes`). `--registrations N`
runs the same load a second time while N more templates register one after another, and compares
the p95 of template edits with and without them (`registrations`). `--stock-model M` (with
`--concurrency 1`) runs the stock diffusers pipeline (model M, in this process) on each of the first
`--stock-samples` requests of each class right after the server answered it, and reports each
class's median latency over the stock median for the same requests (`stock`). `--templates N` registers
N templates and spreads the template edits uniformly (seeded) over them: with more templates than the
workers' host caches hold, `server` says from the server's /metrics what the edits cost it in recordings
made again (and one-off first edits), host hits and disk reads, read once they settle (`retouch serve
--template-affinity` decides how many).

Registers a generated template (POST /v1/templates, polled until ready) unless `--template-id` names one,
then sends `--requests` edits (POST /v1/edits, PNG answers), never more than `--concurrency` at once.
Without `--rps` the load is closed-loop: a request leaves as soon as a slot frees. With `--rps` arrivals
are Poisson (seeded) and a request that arrives while every slot is taken waits for one; that wait is
reported as client wait (`mean_client_wait_s`, and the `*_from_arrival_s` percentiles include it).
Each edit has a rectangular mask whose area ratio is drawn from Beta(1.9, 8.1) (`--mask-dist public`,
mean 0.19, the paper's public trace) or Beta(1.1, 8.9) (`production`, mean 0.11), and seed = its index.

Prints one JSON object. Every request ends as exactly one of: ok (HTTP 200 with a PNG body), an error
(any other HTTP answer, counted by status code; a 429 is counted, never retried), or lost (no HTTP
answer: connection refused or reset, the server closed without answering, or `--timeout` passed).
Latency is from sending a request to the end of its answer's body; `p50_s`, `p95_s`, `mean_s`, `max_s`
and `latencies_s` are over the ok requests only (null when none is ok); `throughput_rps` is ok answers
per second of the whole run (`wall_s`, from the first edit sent to the last answer).
"""

from __future__ import annotations

import asyncio
import io
import json
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

from retouch.bench.report import MAX_SIDE, out_path, positive_float, publish, pyplot, environment, seed_arg
from retouch.errors import ArgumentParser, RetouchError
from retouch.images import png_bytes
from retouch.progress import bar

# Mask area ratio ~ Beta(a, b). "public" equals bench/batching.py's MASK_BETA (not imported: that module
# loads torch and the engine, which a load generator does not need).
MASK_BETA = {"public": (1.9, 8.1), "production": (1.1, 8.9)}  # means 0.19 and 0.11
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True, slots=True)
class EditSpec:
    """One request of the load: an edit of the template (`image` None) or of a one-off image."""

    index: int
    kind: str  # "template" or "one_off"
    mask: bytes  # PNG
    image: bytes | None = None  # PNG of a one-off image
    box: tuple[int, int, int, int] = (0, 0, 0, 0)
    template: int = 0  # which of the `--templates` a template edit edits


@dataclass(slots=True)
class Outcome:
    """What became of one edit request. Exactly one of `status` and `lost_reason` is set."""

    index: int
    kind: str
    scheduled_s: float  # arrival time the schedule gave it, from the start of the run
    sent_s: float  # when it left (after waiting for a free slot), from the start of the run
    latency_s: float  # sent -> answer body read, or -> failure when lost
    status: int | None = None
    png: bool = False  # a 200 answer whose body is a PNG
    lost_reason: str | None = None  # exception class name
    message: str | None = None  # the server's error message, or the exception text

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.png


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(prog="retouch bench serve", description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--requests", type=int, default=100, help="edits to send")
    parser.add_argument("--concurrency", type=int, default=8, help="most edits in flight at once")
    parser.add_argument("--rps", type=positive_float, default=None,
                        help="mean arrival rate (Poisson, seeded); default: closed loop at --concurrency")
    parser.add_argument("--template-id", default=None, help="edit this registered template (default: register one)")
    parser.add_argument("--templates", type=int, default=1,
                        help="register this many templates and spread the edits over them")
    parser.add_argument("--size", type=int, default=64, help="side in pixels of the generated template")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps of the generated template")
    parser.add_argument("--mask-dist", choices=tuple(MASK_BETA), default="public",
                        help="mask area ratio: public Beta(1.9, 8.1), production Beta(1.1, 8.9)")
    parser.add_argument("--prompt", default="a red balloon", help="edit prompt (the request index is appended)")
    parser.add_argument("--seed", type=seed_arg, default=0, help="seeds the masks, the arrivals and the template")
    parser.add_argument("--timeout", type=positive_float, default=300.0,
                        help="seconds one request may take before it counts as lost; also the most to wait "
                             "for the template to become ready")
    parser.add_argument("--one-off", type=float, default=0.0,
                        help="fraction of the edits sent as one-off images (a new image each) instead of edits "
                             "of the registered template")
    parser.add_argument("--registrations", type=int, default=0,
                        help="run the load again while this many templates register, one after another, and "
                             "compare the p95 of template edits")
    parser.add_argument("--stock-model", default=None,
                        help="time the stock pipeline of this model (in-process) on a sample of the requests")
    parser.add_argument("--stock-samples", type=int, default=6, help="requests per class the stock pipeline runs")
    parser.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    parser.add_argument("--out", type=out_path, default=None, help="also write the JSON here, and a PNG beside it")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.steps < 1 or not 1 <= args.size <= MAX_SIDE:
        parser.error(f"--requests, --concurrency and --steps must be >= 1, --size in [1, {MAX_SIDE}]")
    if not 0 <= args.one_off <= 1 or args.registrations < 0 or args.stock_samples < 1:
        parser.error("--one-off must lie in [0, 1], --registrations >= 0 and --stock-samples >= 1")
    if args.stock_model is not None and args.concurrency != 1:
        parser.error("--stock-model times the stock pipeline between requests: use --concurrency 1")
    if args.templates < 1 or (args.templates > 1 and (args.template_id is not None or args.stock_model is not None)):
        parser.error("--templates must be >= 1, and 1 with --template-id or --stock-model")
    try:
        import httpx  # noqa: F401
    except ImportError:
        sys.exit("retouch bench serve needs httpx: pip install 'httpx>=0.28'")

    template, template_ids, outcomes, wall_s, mask_ratios, with_registrations, stock, server = asyncio.run(
        _drive(args))
    # the client's machine: the server's device is the server's to report (/metrics)
    client = {key: value for key, value in environment("serve", argv, "cpu").items()
              if key in ("command", "versions", "retouch_commit")}
    report = {**summarize(outcomes, wall_s), "bench": "serve", **client, "url": args.url,
              "template": template, "template_ids": template_ids, "server": server,
              "mean_mask_ratio": statistics.fmean(mask_ratios),
              "classes": by_class(outcomes),
              "settings": {"requests": args.requests, "concurrency": args.concurrency, "rps": args.rps,
                           "mask_dist": args.mask_dist, "mask_beta": MASK_BETA[args.mask_dist],
                           "size": args.size, "steps": args.steps, "seed": args.seed, "timeout_s": args.timeout,
                           "template_id": args.template_id, "templates": args.templates, "one_off": args.one_off,
                           "registrations": args.registrations, "stock_model": args.stock_model}}
    if with_registrations is not None:
        report["registrations"] = compare_registrations(outcomes, *with_registrations)
    if stock is not None:
        report["stock"] = stock.report()
    return publish(report, args.out, lambda report, path: _plot(report, outcomes, path))


def arrival_offsets(requests: int, rps: float | None, seed: int) -> list[float]:
    """Seconds from the start at which each request arrives: Poisson at `rps`, or all at 0 without one."""
    if rps is None:
        return [0.0] * requests
    rng = random.Random(seed)
    offsets, clock = [], 0.0
    for _ in range(requests):
        clock += rng.expovariate(rps)
        offsets.append(clock)
    return offsets


def mask_boxes(requests: int, width: int, height: int, beta: tuple[float, float],
               seed: int) -> list[tuple[int, int, int, int]]:
    """One rectangle (left, top, right, bottom; right and bottom exclusive) per request, of at least one
    pixel, whose area ratio is drawn from Beta(*beta) and whose position is uniform over the image."""
    rng = random.Random(seed)
    area = width * height
    boxes = []
    for _ in range(requests):
        ratio = rng.betavariate(*beta)
        # An aspect jitter so that masks are not all squares; clipping to the image keeps it a rectangle.
        box_height = max(1, min(height, round((ratio * area) ** 0.5 * rng.uniform(0.7, 1.3))))
        box_width = max(1, min(width, round(ratio * area / box_height)))
        left, top = rng.randrange(width - box_width + 1), rng.randrange(height - box_height + 1)
        boxes.append((left, top, left + box_width, top + box_height))
    return boxes


def mask_ratio(box: tuple[int, int, int, int], width: int, height: int) -> float:
    """Fraction of the image's pixels inside `box`."""
    left, top, right, bottom = box
    return (right - left) * (bottom - top) / (width * height)


def mask_png(box: tuple[int, int, int, int], width: int, height: int) -> bytes:
    """The mask the API takes: a PNG in mode "L", 255 (white) inside `box` = repaint, 0 elsewhere."""
    mask = Image.new("L", (width, height), 0)
    left, top, right, bottom = box
    ImageDraw.Draw(mask).rectangle((left, top, right - 1, bottom - 1), fill=255)
    return png_bytes(mask)


def template_png(size: int, seed: int) -> bytes:
    """A deterministic template image: a smooth gradient with a few shapes on it, `size` x `size` RGB."""
    rng = random.Random(seed)
    ramp = [round(255 * i / max(1, size - 1)) for i in range(size)]
    red = Image.new("L", (size, size))
    red.putdata([ramp[x] for _ in range(size) for x in range(size)])
    green = red.transpose(Image.Transpose.ROTATE_90)
    blue = Image.new("L", (size, size), rng.randrange(256))
    image = Image.merge("RGB", (red, green, blue))
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        x, y = rng.randrange(size), rng.randrange(size)
        colour = tuple(rng.randrange(256) for _ in range(3))
        draw.ellipse((x, y, x + size // 3, y + size // 4), fill=colour)
        draw.rectangle((y, x, y + size // 5, x + size // 6), fill=colour[::-1])
    return png_bytes(image)


def summarize(outcomes: list[Outcome], wall_s: float) -> dict:
    """The report's counts and latencies. ok + sum(errors) + lost == sent."""
    ok = [o for o in outcomes if o.ok]
    answered = [o for o in outcomes if o.lost_reason is None and not o.ok]
    lost = [o for o in outcomes if o.lost_reason is not None]
    latencies = sorted(o.latency_s for o in ok)
    from_arrival = sorted(o.sent_s - o.scheduled_s + o.latency_s for o in ok)
    # A 200 whose body is not a PNG is a broken answer: it stays under its status, "200".
    errors = Counter(str(o.status) for o in answered)
    messages = {}
    for o in answered:
        messages.setdefault(str(o.status), o.message)
    return {"sent": len(outcomes), "ok": len(ok), "errors": dict(sorted(errors.items())), "lost": len(lost),
            "p50_s": _percentile(latencies, 50), "p95_s": _percentile(latencies, 95),
            "p99_s": _percentile(latencies, 99), "mean_s": statistics.fmean(latencies) if latencies else None,
            "max_s": latencies[-1] if latencies else None, "wall_s": wall_s,
            "throughput_rps": len(ok) / wall_s if wall_s > 0 else None,
            "p50_from_arrival_s": _percentile(from_arrival, 50), "p95_from_arrival_s": _percentile(from_arrival, 95),
            "mean_client_wait_s": statistics.fmean(o.sent_s - o.scheduled_s for o in outcomes),
            "lost_reasons": dict(sorted(Counter(o.lost_reason for o in lost).items())),
            "error_messages": dict(sorted(messages.items())), "latencies_s": latencies}


def by_class(outcomes: list[Outcome]) -> dict:
    """Per request class present, its count, ok count and latency percentiles over its ok requests."""
    classes = {}
    for kind in ("template", "one_off"):
        chosen = [o for o in outcomes if o.kind == kind]
        if chosen:
            latencies = sorted(o.latency_s for o in chosen if o.ok)
            classes[kind] = {"sent": len(chosen), "ok": len(latencies), "p50_s": _percentile(latencies, 50),
                             "p95_s": _percentile(latencies, 95),
                             "mean_s": statistics.fmean(latencies) if latencies else None}
    return classes


def compare_registrations(alone: list[Outcome], beside: list[Outcome], registered: int) -> dict:
    """p95 of the template edits without and with templates registering meanwhile."""
    p95 = [_percentile(sorted(o.latency_s for o in run if o.ok and o.kind == "template"), 95)
           for run in (alone, beside)]
    return {"registered": registered, "template_p95_without_s": p95[0], "template_p95_with_s": p95[1],
            "ratio": p95[1] / p95[0] if None not in p95 and p95[0] > 0 else None,
            "ok_with": sum(o.ok for o in beside), "sent_with": len(beside)}


class StockTimer:
    """The stock pipeline (`--stock-model`, in this process) on the same requests, each run right after
    the server answered it (interleaved, so both see the same machine): up to `--stock-samples` per
    class. Needs `--concurrency 1`: nothing else is in flight while it runs."""

    def __init__(self, args, template: dict):
        from retouch.models import load_pipeline

        self.args = args
        self.model = load_pipeline(args.stock_model)
        self.template_image = (Image.open(io.BytesIO(template_png(args.size, args.seed))).convert("RGB")
                               if args.template_id is None else None)
        self.timed: dict[str, list[tuple[float, float]]] = {"template": [], "one_off": []}  # (served, stock)

    def after(self, spec: EditSpec, outcome: Outcome) -> None:
        from retouch.baseline import run_baseline_edit

        timed = self.timed[spec.kind]
        if not outcome.ok or len(timed) >= self.args.stock_samples:
            return
        image = self.template_image if spec.image is None else Image.open(io.BytesIO(spec.image)).convert("RGB")
        if image is None:  # an existing template (--template-id): its image is not known here
            return
        started = time.perf_counter()
        run_baseline_edit(self.model.pipe, image, Image.open(io.BytesIO(spec.mask)), f"{self.args.prompt} {spec.index}",
                          steps=self.args.steps, seed=spec.index, call_defaults=self.model.call_defaults)
        timed.append((outcome.latency_s, time.perf_counter() - started))

    def report(self) -> dict:
        """Per class: medians of the served and the stock latencies of the same requests, and their ratio."""
        report = {}
        for kind, timed in self.timed.items():
            if timed:
                served, stock = (statistics.median(column) for column in zip(*timed))
                report[kind] = {"requests": len(timed), "served_p50_s": served, "stock_p50_s": stock,
                                "ratio_p50": served / stock}
                print(f"serve: {kind}: served {served:.3f} s, stock pipeline {stock:.3f} s (median of {len(timed)})",
                      file=sys.stderr)
        return report


def edit_specs(args, template: dict, phase: int = 0) -> list[EditSpec]:
    """The load's requests, seeded: rectangular masks, and a new image for each one-off edit (phase >
    0 draws other images, so that a second run's one-offs are first edits too)."""
    width, height = template.get("width") or args.size, template.get("height") or args.size
    boxes = mask_boxes(args.requests, width, height, MASK_BETA[args.mask_dist], args.seed)
    rng, which = random.Random(args.seed + 7), random.Random(args.seed + 11)
    specs = []
    for index, box in enumerate(boxes):
        one_off = rng.random() < args.one_off
        image = template_png(args.size, args.seed + 1 + index + phase * args.requests) if one_off else None
        specs.append(EditSpec(index, "one_off" if one_off else "template", mask_png(box, width, height), image, box,
                              which.randrange(args.templates)))
    return specs


async def _drive(args) -> tuple[dict, list[str], list[Outcome], float, list[float], tuple | None, StockTimer | None,
                                dict | None]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout)) as client:
        await _check_health(client, args.url)
        template = await _ready_template(client, args)
        template_ids = [template["id"]]
        for index in range(1, args.templates):  # the same size: every mask fits every template
            image = template_png(args.size, args.seed + 20_000 + index)
            template_ids.append((await _ready_template(client, args, image, args.seed + index))["id"])
        width, height = template.get("width") or args.size, template.get("height") or args.size
        # Encoded up front so that the client's own work does not sit inside the measured latencies.
        specs = edit_specs(args, template)
        ratios = [mask_ratio(spec.box, width, height) for spec in specs]
        offsets = arrival_offsets(args.requests, args.rps, args.seed)
        one_offs = sum(spec.kind == "one_off" for spec in specs)
        print(f"serve: {args.requests} edits ({one_offs} of one-off images) of template {template['id']} "
              f"({width}x{height}), concurrency {args.concurrency}, "
              + (f"{args.rps} rps" if args.rps else "closed loop"), file=sys.stderr)
        stock = StockTimer(args, template) if args.stock_model is not None else None
        before = await _settled_counters(client)
        outcomes, wall_s = await _send_all(client, args, template_ids, specs, offsets,
                                           None if stock is None else stock.after, desc="serve: edits")
        after = await _settled_counters(client)
        server = None if None in (before, after) else {name: after[name] - before[name] for name in after}
        with_registrations = None
        if args.registrations:
            print(f"serve: the same load again while {args.registrations} templates register", file=sys.stderr)
            registering = asyncio.create_task(_register_in_turn(client, args))
            beside, _ = await _send_all(client, args, template_ids, edit_specs(args, template, phase=1), offsets,
                                        desc="serve: edits while registering")
            with_registrations = (beside, await registering)
    return template, template_ids, outcomes, wall_s, ratios, with_registrations, stock, server


# What the edits cost the server, summed over its workers (`retouch_worker_*` on the head's /metrics):
# recordings (templates recorded again after their eviction, and one-off images' first edits), host hits,
# disk reads; and how many routing choices template affinity narrowed to workers holding the template.
SERVER_COUNTERS = {"recordings": ("retouch_worker_cache_registrations_total", {}),
                   "host_hits": ("retouch_worker_cache_hits_total", {}),
                   "disk_hits": ("retouch_worker_cache_disk_hits_total", {}),
                   "template_affinity": ("retouch_router_events_total", {"event": "template_affinity"})}


async def _settled_counters(client, tries: int = 10) -> dict[str, float] | None:
    """SERVER_COUNTERS once two reads a second apart agree: the head shows its workers' counters as of
    their last heartbeat (0.5 s by default), so a read right after the templates became ready would count
    their last recordings among the edits'."""
    last = await _server_counters(client)
    for _ in range(tries):
        if last is None:
            return None
        await asyncio.sleep(1.0)  # two heartbeats
        now = await _server_counters(client)
        if now == last:
            return now
        last = now
    return last


async def _server_counters(client) -> dict[str, float] | None:
    """SERVER_COUNTERS now, from /metrics; None where it does not answer them (another server, a stub)."""
    response = await client.get("/metrics")
    if response.status_code != 200:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    samples = [sample for family in text_string_to_metric_families(response.text) for sample in family.samples]
    totals = {}
    for name, (series, labels) in SERVER_COUNTERS.items():
        values = [sample.value for sample in samples
                  if sample.name == series and labels.items() <= sample.labels.items()]
        if not values:
            return None
        totals[name] = sum(values)
    return totals


async def _register_in_turn(client, args) -> int:
    """Register `--registrations` new templates, each once the last is ready; how many became ready."""
    ready = 0
    for index in range(args.registrations):
        response = await client.post("/v1/templates", data={"prompt": f"a room {index}", "steps": str(args.steps)},
                                     files={"image": ("t.png", template_png(args.size, 10_000 + index), "image/png")})
        if response.status_code not in (200, 202):
            continue
        template_id = response.json()["id"]
        deadline = time.monotonic() + args.timeout
        while True:  # a long poll waits 60 s at most
            polled = await client.get(f"/v1/templates/{template_id}",
                                      params={"wait": max(0.0, min(60.0, deadline - time.monotonic()))})
            if polled.status_code != 200 or polled.json()["status"] != "recording" or time.monotonic() >= deadline:
                break
        ready += polled.status_code == 200 and polled.json()["status"] == "ready"
    return ready


async def _check_health(client, url: str) -> None:
    import httpx

    try:
        response = await client.get("/healthz")
    except httpx.RequestError as exc:
        raise RetouchError(f"no retouch server answers at {url} ({type(exc).__name__}: {exc})") from None
    if response.status_code != 200:
        raise RetouchError(f"{url}/healthz answered {response.status_code}: {_error_message(response)}")


async def _ready_template(client, args, image: bytes | None = None, seed: int | None = None) -> dict:
    """The template's JSON once its status is "ready": `--template-id`, or one registered now (`image`, `seed`:
    another than the first)."""
    if args.template_id is None or image is not None:
        image = template_png(args.size, args.seed) if image is None else image
        seed = args.seed if seed is None else seed
        response = await client.post("/v1/templates", files={"image": ("template.png", image, "image/png")},
                                     data={"prompt": "a scene", "steps": str(args.steps), "seed": str(seed)})
        if response.status_code not in (200, 201, 202):
            raise RetouchError(f"registering a template failed with {response.status_code}: "
                               f"{_error_message(response)}")
        template = response.json()
        print(f"serve: registering template {template['id']} ({args.size}px, {args.steps} steps)", file=sys.stderr)
    else:
        template = await _get_template(client, args.template_id)
    deadline = time.monotonic() + args.timeout
    pause = 0.02
    while template["status"] != "ready":
        if template["status"] == "failed":
            raise RetouchError(f"template {template['id']} failed: {json.dumps(template)}")
        if time.monotonic() > deadline:
            raise RetouchError(f"template {template['id']} not ready after {args.timeout} s "
                               f"(status {template['status']!r})")
        await asyncio.sleep(pause)  # polling a recording in progress
        pause = min(1.0, pause * 2)
        template = await _get_template(client, template["id"])
    return template


async def _get_template(client, template_id: str) -> dict:
    response = await client.get(f"/v1/templates/{template_id}")
    if response.status_code != 200:
        raise RetouchError(f"GET /v1/templates/{template_id} answered {response.status_code}: "
                           f"{_error_message(response)}")
    return response.json()


async def _send_all(client, args, template_ids: list[str], specs: list[EditSpec], offsets: list[float],
                    after=None, desc: str = "serve: edits") -> tuple[list[Outcome], float]:
    """`after(spec, outcome)`, when given, runs once each answer is in and before its slot frees."""
    slots = asyncio.Semaphore(args.concurrency)
    progress = _Progress(len(specs), desc)
    start = time.perf_counter()

    async def send(index: int) -> Outcome:
        try:
            sent = time.perf_counter() - start
            spec = specs[index]
            outcome = await _edit(client, args, template_ids[spec.template], spec, offsets[index], sent)
            if after is not None:
                after(specs[index], outcome)
        finally:
            slots.release()
        progress.record(outcome)
        return outcome

    tasks = []
    for index, offset in enumerate(offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)  # open-loop arrivals
        await slots.acquire()  # the cap on requests in flight; released when the answer is read
        tasks.append(asyncio.create_task(send(index)))
    try:
        outcomes = await asyncio.gather(*tasks)
    finally:
        progress.close()
    return list(outcomes), time.perf_counter() - start


async def _edit(client, args, template_id: str, spec: EditSpec, scheduled: float, sent: float) -> Outcome:
    import httpx

    form = {"prompt": f"{args.prompt} {spec.index}", "seed": str(spec.index), "response_format": "png"}
    files = {"mask": ("mask.png", spec.mask, "image/png")}
    if spec.image is None:
        form["template_id"] = template_id
    else:
        form["steps"] = str(args.steps)
        files["image"] = ("image.png", spec.image, "image/png")
    began = time.perf_counter()
    try:
        # wait_for bounds the whole request; httpx's own timeout bounds each read and write.
        response = await asyncio.wait_for(client.post("/v1/edits", data=form, files=files), args.timeout)
    except (httpx.RequestError, TimeoutError) as exc:
        return Outcome(spec.index, spec.kind, scheduled, sent, time.perf_counter() - began,
                       lost_reason=type(exc).__name__, message=str(exc) or None)
    latency = time.perf_counter() - began
    png = response.content.startswith(PNG_SIGNATURE)
    message = None if response.status_code == 200 and png else _error_message(response)
    return Outcome(spec.index, spec.kind, scheduled, sent, latency, status=response.status_code, png=png,
                   message=message)


def _error_message(response) -> str:
    """The API's `{"error": {"message": ...}}`, else the start of the body; with Retry-After when given."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        kind = response.headers.get("content-type", "unknown type")
        message = response.text[:200] if kind.startswith(("text", "application/json")) \
            else f"{len(response.content)} bytes of {kind}"
    retry_after = response.headers.get("retry-after")
    return f"{message} (Retry-After: {retry_after})" if retry_after is not None else message


class _Progress:
    """A bar on stderr over the answered requests, with how many were ok, errors and lost so far."""

    def __init__(self, total: int, desc: str):
        self.bar = bar(desc=desc, total=total, unit="edit")
        self.counts = Counter()

    def record(self, outcome: Outcome) -> None:
        self.counts["ok" if outcome.ok else "lost" if outcome.lost_reason else "errors"] += 1
        self.bar.set_postfix_str(f"ok {self.counts['ok']}, errors {self.counts['errors']}, "
                                 f"lost {self.counts['lost']}", refresh=False)
        self.bar.update()

    def close(self) -> None:
        self.bar.close()


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def _plot(report: dict, outcomes: list[Outcome], out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    figure, (timeline, cdf) = plt.subplots(1, 2, figsize=(11, 4))
    for label, chosen, marker in (("ok, template", [o for o in outcomes if o.ok and o.kind == "template"], "."),
                                  ("ok, one-off", [o for o in outcomes if o.ok and o.kind == "one_off"], "+"),
                                  ("error", [o for o in outcomes if not o.ok and o.lost_reason is None], "x"),
                                  ("lost", [o for o in outcomes if o.lost_reason is not None], "v")):
        if chosen:
            timeline.scatter([o.sent_s for o in chosen], [o.latency_s for o in chosen], marker=marker, s=12,
                             label=f"{label} ({len(chosen)})")
    timeline.set_xlabel("sent at (s from start)")
    timeline.set_ylabel("latency (s)")
    timeline.legend()
    latencies = report["latencies_s"]
    if latencies:
        cdf.plot(latencies, [(i + 1) / len(latencies) for i in range(len(latencies))])
    cdf.set_xlabel("latency of ok requests (s)")
    cdf.set_ylabel("fraction of ok requests")
    settings = report["settings"]
    rate = f"{settings['rps']} rps" if settings["rps"] else "closed loop"
    server = report.get("server")
    cost = (f"\n{settings['templates']} templates; the server: {server['recordings']:g} recordings, "
            f"{server['host_hits']:g} host hits, {server['disk_hits']:g} disk reads" if server else "")
    figure.suptitle(f"{report['sent']} edits, concurrency {settings['concurrency']}, {rate}: "
                    f"ok {report['ok']}, errors {sum(report['errors'].values())}, lost {report['lost']}{cost}")
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)
