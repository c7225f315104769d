"""`retouch simulate`: routing policies on a simulated cluster, compared on the same requests.

    retouch simulate --workers 64 --rps 32 --requests 4000 [--policies a,b] [--mask-dist production]
                     [--cost-model cost.json] [--out sim.json]

A discrete-event simulation of W workers, each batching continuously at denoising-step granularity (the
engine loop, §4.3): at every step boundary a worker drops the requests whose steps are done and admits
queued ones up to max_batch; an idle worker starts at once. A step takes the `StepCost` latency of the
worker's batch at that moment: the planner's optimal pipeline latency (Y-cache) from the cost model --
the router's own estimator, so the router's model is taken to be exact. Pre/post-processing and the
network are not modelled. Steps between two changes of a batch take equal time, so a worker is one
event per change of its batch, not one per step; a request routed to a busy worker with slack joins at
its next step boundary.

Requests arrive as a Poisson process at --rps; each is routed at its arrival by the real policy objects
through the same `ClusterLoad` calls the router makes (assign, admit, advance, finish). A worker reports
its requests' progress (advance) whenever its batch changes, as a heartbeat would. Mask ratios:
    public      Beta(1.9, 8.1): mean 0.19, the public trace (§2.2, Fig. 3 right)
    production  Beta(1.1, 8.9): mean 0.11, the paper's production trace (Fig. 3 left); the paper gives
                only the mean, so the spread is the public fit's (alpha + beta = 10)
masked tokens = round(ratio * image tokens), at least 1. Every policy sees the same arrivals and masks
(a paired comparison). Prints one JSON object; latencies are arrival to last step, in seconds.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from retouch.costs import CostModel
from retouch.engine.policies import POLICIES, ClusterLoad, Policy, RequestLoad, make_policy
from retouch.engine.reference_costs import h800_flux
from retouch.engine.step_cost import StepCost

MASK_BETA = {"public": (1.9, 8.1), "production": (1.1, 8.9)}


@dataclass(frozen=True)
class Workload:
    """N requests: arrival times [N] (s, ascending) and their loads."""

    arrivals: np.ndarray
    loads: tuple[RequestLoad, ...]


def make_workload(requests: int, rps: float, mask_dist: str, image_tokens: int, text_tokens: int, steps: int,
                  seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rps, requests))
    ratios = rng.beta(*MASK_BETA[mask_dist], requests)
    masked = np.clip(np.rint(ratios * image_tokens), 1, image_tokens).astype(int)
    return Workload(arrivals, tuple(RequestLoad(image_tokens, int(m), steps, text_tokens) for m in masked))


@dataclass(eq=False)
class _Worker:
    slot: int
    batch: list[int] = field(default_factory=list)  # request indices, running
    queue: deque = field(default_factory=deque)  # request indices, routed here, not yet admitted
    features: np.ndarray | None = None  # summed cost features of the batch
    step_s: float = 0.0  # latency of each step of the current batch
    phase_start: float = 0.0  # when the current batch started its first step
    event_steps: int = 0  # steps after phase_start at which the pending event fires
    version: int = 0  # invalidates superseded events


class SimulatedCluster:
    """The simulated workers and their event queue, routing through `policy` and a ClusterLoad."""

    def __init__(self, policy: Policy, cost: StepCost, workload: Workload, workers: int, max_batch: int):
        self.policy, self.cost, self.workload, self.max_batch = policy, cost, workload, max_batch
        self.cluster_load = ClusterLoad(cost)
        self.workers = [_Worker(self.cluster_load.add_worker(max_batch), features=np.zeros(cost.num_features))
                        for _ in range(workers)]
        loads = workload.loads
        self.features = np.array([cost.request_features(x.image_tokens, x.masked_tokens, x.text_tokens)
                                  for x in loads])
        self.steps_left = [x.steps for x in loads]
        self.finished = np.full(len(loads), np.nan)
        self.decision_s = 0.0
        self._events: list[tuple[float, int, int, int, int]] = []  # (time, seq, worker, version, steps)
        self._seq = 0

    def run(self, progress=None) -> np.ndarray:
        """Latency of every request (s), in arrival order."""
        arrivals, total = self.workload.arrivals, len(self.workload.loads)
        routed = 0
        while routed < total or self._events:
            if routed < total and (not self._events or arrivals[routed] <= self._events[0][0]):
                self._route(routed, float(arrivals[routed]))
                routed += 1
                if progress is not None:
                    progress(routed, total)
                continue
            now, _, index, version, steps = heapq.heappop(self._events)
            worker = self.workers[index]
            if version == worker.version:
                self._boundary(worker, now, steps)
        return self.finished - arrivals

    def _route(self, request: int, now: float) -> None:
        load = self.workload.loads[request]
        started = time.perf_counter()
        slot = self.policy.choose(load, self.cluster_load)
        self.decision_s += time.perf_counter() - started
        self.cluster_load.assign(slot, request, load)
        worker = self.workers[slot]  # slots are 0..W-1 in creation order
        worker.queue.append(request)
        if not worker.batch:
            self._boundary(worker, now, 0)
        elif len(worker.batch) < self.max_batch:  # joins at the next step boundary
            steps = math.floor((now - worker.phase_start) / worker.step_s) + 1
            if steps < worker.event_steps:
                self._schedule(worker, steps)

    def _boundary(self, worker: _Worker, now: float, steps: int) -> None:
        """`steps` steps of the batch are done at `now`: report progress, drop finished requests, admit
        queued ones, and start the next phase."""
        cluster_load, slot = self.cluster_load, worker.slot
        running = []
        for request in worker.batch:
            self.steps_left[request] -= steps
            if self.steps_left[request] > 0:
                running.append(request)
                if steps:
                    cluster_load.advance(slot, request, self.steps_left[request])
            else:
                cluster_load.finish(slot, request)
                self.finished[request] = now
                worker.features -= self.features[request]
        while worker.queue and len(running) < self.max_batch:
            request = worker.queue.popleft()
            cluster_load.admit(slot, request)
            running.append(request)
            worker.features += self.features[request]
        worker.batch = running
        worker.version += 1
        if not running:
            worker.step_s = 0.0
            return
        worker.step_s = float(self.cost.latency(worker.features))
        if not worker.step_s > 0:  # time would stand still: every later event at `now`
            raise ValueError(f"the cost model predicts a {worker.step_s} s step for a batch of {len(running)}")
        worker.phase_start = now
        self._schedule(worker, min(self.steps_left[r] for r in running))

    def _schedule(self, worker: _Worker, steps: int) -> None:
        worker.version += 1
        worker.event_steps = steps
        self._seq += 1
        heapq.heappush(self._events, (worker.phase_start + steps * worker.step_s, self._seq,
                                      worker.slot, worker.version, steps))


def summarize(latencies: np.ndarray, decision_s: float) -> dict:
    return {"p50_s": float(np.percentile(latencies, 50)), "p95_s": float(np.percentile(latencies, 95)),
            "p99_s": float(np.percentile(latencies, 99)), "mean_s": float(latencies.mean()),
            "decision_us": 1e6 * decision_s / len(latencies)}


def _progress_printer(name: str, every_s: float = 2.0):
    started = last = time.perf_counter()

    def report(done: int, total: int) -> None:
        nonlocal last
        now = time.perf_counter()
        if now - last >= every_s or done == total and now - started >= every_s:
            last = now
            print(f"  {name}: {done}/{total} requests routed, {now - started:.1f} s", file=sys.stderr)

    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="retouch simulate", description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--rps", type=float, default=4.0,
                        help="mean arrival rate of the whole cluster (default: 0.5 per worker of the default 8, "
                             "where §6.5 sees request-count balancing degrade)")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"comma list of {', '.join(POLICIES)}")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--mask-dist", choices=tuple(MASK_BETA), default="public")
    parser.add_argument("--steps", type=int, default=28, help="denoising steps of every request")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost-model", type=Path, default=None,
                        help="a fitted CostModel JSON (`retouch profile`); default the built-in H800 Flux model")
    parser.add_argument("--image-tokens", type=int, default=None,
                        help="tokens of every request's grid (default: the cost model's meta, or its largest "
                             "profiled grid)")
    parser.add_argument("--text-tokens", type=int, default=None, help="default: the cost model's meta, else 0")
    parser.add_argument("--guidance-copies", type=int, default=1, help="batch rows per request")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here, and a PNG beside it")
    args = parser.parse_args(argv)
    policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    unknown = [name for name in policies if name not in POLICIES]
    if unknown or not policies:
        parser.error(f"--policies: unknown {unknown}; choose from {', '.join(POLICIES)}")
    if min(args.workers, args.requests, args.steps, args.max_batch, args.guidance_copies) < 1 or args.rps <= 0:
        parser.error("--workers, --requests, --steps, --max-batch, --guidance-copies must be >= 1, --rps > 0")

    model = CostModel.from_json(args.cost_model) if args.cost_model else h800_flux()
    image_tokens, text_tokens = _request_shape(model, args, parser)
    cost = StepCost(model, args.guidance_copies)
    workload = make_workload(args.requests, args.rps, args.mask_dist, image_tokens, text_tokens, args.steps,
                             args.seed)
    started = time.perf_counter()
    results, latencies = {}, {}
    for name in policies:
        print(f"{name}: {args.requests} requests at {args.rps} rps on {args.workers} workers", file=sys.stderr)
        cluster = SimulatedCluster(make_policy(name, cost), cost, workload, args.workers, args.max_batch)
        latencies[name] = cluster.run(_progress_printer(name))
        results[name] = summarize(latencies[name], cluster.decision_s)
    alone = cost.latency(cost.request_features(image_tokens, round(_mean_ratio(args.mask_dist) * image_tokens),
                                               text_tokens))
    report = {"policies": results, "workers": args.workers, "rps": args.rps, "requests": args.requests,
              "mask_dist": args.mask_dist, "cost_model": str(args.cost_model) if args.cost_model else "built-in",
              "model": model.model, "device": model.device, "steps": args.steps, "max_batch": args.max_batch,
              "seed": args.seed, "image_tokens": image_tokens, "text_tokens": text_tokens,
              "mean_mask_ratio": float(np.mean([x.masked_tokens for x in workload.loads]) / image_tokens),
              "alone_at_mean_mask_s": float(alone) * args.steps, "wall_s": time.perf_counter() - started,
              "command": "retouch simulate " + " ".join(sys.argv[1:] if argv is None else argv)}
    print(json.dumps(report))
    if args.out is not None:
        from retouch.bench.report import write_json

        write_json(report, args.out)
        _plot(report, latencies, args.out.with_suffix(".png"))
    return report


def _mean_ratio(mask_dist: str) -> float:
    alpha, beta = MASK_BETA[mask_dist]
    return alpha / (alpha + beta)


def _request_shape(model: CostModel, args, parser) -> tuple[int, int]:
    image_tokens = args.image_tokens or model.meta.get("image_tokens")
    if image_tokens is None and "grids" in model.meta:  # `retouch profile` grids: sides of square token grids
        image_tokens = max(int(side) for side in str(model.meta["grids"]).split(",")) ** 2
    if image_tokens is None:
        parser.error("--image-tokens is needed: the cost model does not say which grid it was profiled on")
    text_tokens = args.text_tokens if args.text_tokens is not None else int(model.meta.get("text_tokens", 0))
    return int(image_tokens), text_tokens


def _plot(report: dict, latencies: dict[str, np.ndarray], out: Path) -> None:
    from retouch.bench.report import pyplot

    plt = pyplot()
    if plt is None:
        return
    figure, axis = plt.subplots(figsize=(6, 4))
    for name, values in latencies.items():
        ordered = np.sort(values)
        axis.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered),
                  label=f"{name} (p95 {report['policies'][name]['p95_s']:.2f} s)")
    axis.set_xlabel("request latency (s)")
    axis.set_ylabel("fraction of requests")
    axis.set_title(f"{report['workers']} workers, {report['rps']} rps, {report['mask_dist']} masks")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
