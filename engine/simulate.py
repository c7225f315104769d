"""`retouch simulate`: routing policies on a simulated cluster, compared on the same requests.

    retouch simulate --workers 64 --rps 32 --requests 4000 [--policies a,b] [--mask-dist production]
                     [--resolutions uniform] [--slo-scale 5] [--cost-model cost.json] [--out sim.json]
    retouch simulate --find-load [--mask-dists public,production] [--worker-counts 8,64] [--resolutions ...]

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
(a paired comparison). Sides: all 1024 px, or PatchedServe's mixes of 512/768/1024 px (RESOLUTION_MIX),
batched together (a batch's cost is its requests' summed features). Deadlines: arrival + --slo-scale x
the request's unloaded latency; a policy's SLO attainment is the fraction answered by theirs.
--find-load raises the rate until the best baseline's p95 is twice the unloaded p95 (each request alone)
and compares every policy there. Prints one JSON object; latencies are arrival to last step, in seconds.

LoRA (--loras N): every request names one of N adapters, drawn from a Zipf law (--lora-zipf; SwiftDiffusion
§2: thousands of adapters, long-tailed popularity). A worker holds its --lora-cache most recently routed
adapters; a request routed to a worker that does not hold its adapter reads it, which adds --lora-miss-s to
its latency (the part of the load its first steps do not hide; the worker's steps are not slowed), and a
request for an adapter still being read there waits for the rest of that read. Each
policy then runs twice on the same arrivals: alone, and after the router's LoRA affinity
(`policies.prefer_holders`, bound --lora-affinity); each reports its adapters' hit rate.

Templates (--templates N): the same model for the templates requests edit, drawn from a Zipf law too
(--template-zipf). A worker's host memory holds its --template-cache most recently edited ones; an edit
routed to a worker without its template there waits --template-miss-s for it to be read back from the disk
tier (every worker recorded every template: none is recorded again). Each policy runs alone and after the
router's template affinity (bound --template-affinity); each reports the templates' host hit rate. With
--template-replicas K each template is recorded on K workers only (spread evenly), and its edits go there.
"""

from __future__ import annotations

import heapq
import math
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from retouch.costs import CostModel
from retouch.engine.policies import (POLICIES, ClusterLoad, Policy, RequestLoad, make_policy, prefer_holders,
                                     replica_to_add)
from retouch.engine.reference_costs import h800_flux
from retouch.engine.step_cost import StepCost
from retouch.errors import ArgumentParser, InputError

MASK_BETA = {"public": (1.9, 8.1), "production": (1.1, 8.9)}
# Output sides (px) and their shares. PatchedServe (§8.1) draws 512, 768 and 1024 px equally, and (§8.2,
# Fig. 13) lets one of them take half with the other two a quarter each. A side's grid is the cost
# model's grid scaled by (side / 1024)^2.
RESOLUTIONS = (512, 768, 1024)
RESOLUTION_MIX = {"1024": (0.0, 0.0, 1.0), "uniform": (1 / 3, 1 / 3, 1 / 3), "low": (0.5, 0.25, 0.25),
                  "medium": (0.25, 0.5, 0.25), "high": (0.25, 0.25, 0.5)}
# A fit of a model too small to time extrapolates below zero, which clamps to a step that takes no time.
MAX_WORKERS = 100_000  # simulated workers: each holds arrays of the cluster's view
REPLICA_GROWTH_BOUND = 1  # `RouterConfig.template_replicas_grow`'s default
MAX_REQUESTS = 10_000_000
ZERO_STEP_ADVICE = ("its fit extrapolates below zero here; profile a larger model or larger --grids, or simulate "
                    "--image-tokens inside the profiled grids")
SLO_SCALE = 5.0  # PatchedServe §8.1 after Clockwork: an SLO of 5x the request's execution latency


@dataclass(frozen=True)
class Workload:
    """N requests: arrival times [N] (s, ascending) and their loads (deadlines on the same clock)."""

    arrivals: np.ndarray
    loads: tuple[RequestLoad, ...]


def make_workload(requests: int, rps: float, mask_dist: str, image_tokens: int, text_tokens: int, steps: int,
                  seed: int, resolutions: str = "1024") -> Workload:
    """Poisson arrivals at `rps`; each request's side drawn from RESOLUTION_MIX[resolutions] (its grid:
    image_tokens, the 1024 px grid, scaled by (side / 1024)^2) and its mask ratio from MASK_BETA. No
    deadlines: `with_deadlines` adds them."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rps, requests))
    ratios = rng.beta(*MASK_BETA[mask_dist], requests)
    if resolutions == "1024":  # draws nothing, so the single-size workload is the one of earlier versions
        grids = np.full(requests, image_tokens)
    else:
        grid_of = np.array([max(1, round(image_tokens * (side / RESOLUTIONS[-1]) ** 2)) for side in RESOLUTIONS])
        grids = grid_of[rng.choice(len(RESOLUTIONS), requests, p=RESOLUTION_MIX[resolutions])]
    masked = np.clip(np.rint(ratios * grids), 1, grids).astype(int)
    return Workload(arrivals, tuple(RequestLoad(int(g), int(m), steps, text_tokens) for g, m in zip(grids, masked)))


@dataclass(frozen=True)
class KeyedCache:
    """What each request needs a worker to hold, LoRA adapters or templates in host memory. keys: [N] the
    key each request names; cache: keys a worker holds (least recently routed first out); miss_s: seconds
    a request waits for a read of its key; affinity: the router's bound (`RouterConfig.lora_affinity`,
    `template_affinity`), None for the policy alone."""

    keys: np.ndarray
    cache: int
    miss_s: float
    affinity: int | None = None
    replicas: int = 0  # workers that may serve a key (`RouterConfig.template_replicas`); 0: every one
    grow: bool = False  # a key whose own requests fill its replicas gets another (`SimulatedCluster._replicas_of`)

    def eligible(self, key: int, workers: int) -> np.ndarray | None:
        """[workers] bool: the key's replicas, spread evenly over the workers by key; None: every worker."""
        if self.replicas == 0 or self.replicas >= workers:
            return None
        chosen = np.zeros(workers, dtype=bool)
        chosen[(key * self.replicas + np.arange(self.replicas)) % workers] = True
        return chosen


def zipf_keys(requests: int, count: int, exponent: float, seed: int) -> np.ndarray:
    """[requests] key indices, key k (0-based rank) drawn with probability proportional to 1/(k+1)^s. Drawn
    from a generator of its own (seed + 1): the arrivals and masks of `seed` stay those without keys."""
    weights = 1.0 / np.arange(1, count + 1) ** exponent
    return np.random.default_rng(seed + 1).choice(count, requests, p=weights / weights.sum())


def alone_seconds(cost: StepCost, loads) -> np.ndarray:
    """[N] each request's latency on an idle worker (its steps at batch 1): the unloaded latency."""
    features = np.array([cost.request_features(x.image_tokens, x.masked_tokens, x.text_tokens) for x in loads])
    return cost.latency(features) * np.array([x.steps for x in loads])


def with_deadlines(workload: Workload, cost: StepCost, slo_scale: float) -> Workload:
    """The workload with each request's deadline at arrival + slo_scale x its unloaded latency."""
    deadlines = workload.arrivals + slo_scale * alone_seconds(cost, workload.loads)
    return Workload(workload.arrivals, tuple(replace(x, deadline=float(d))
                                             for x, d in zip(workload.loads, deadlines)))


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
    held: OrderedDict = field(default_factory=OrderedDict)  # key -> when its read completes; LRU order


class SimulatedCluster:
    """The simulated workers and their event queue, routing through `policy` and a ClusterLoad."""

    def __init__(self, policy: Policy, cost: StepCost, workload: Workload, workers: int, max_batch: int,
                 keyed: KeyedCache | None = None):
        self.policy, self.cost, self.workload, self.max_batch, self.keyed = policy, cost, workload, max_batch, keyed
        self.cluster_load = ClusterLoad(cost)
        self.workers = [_Worker(self.cluster_load.add_worker(max_batch), features=np.zeros(cost.num_features))
                        for _ in range(workers)]
        loads = workload.loads
        self.features = np.array([cost.request_features(x.image_tokens, x.masked_tokens, x.text_tokens)
                                  for x in loads])
        self.steps_left = [x.steps for x in loads]
        self.finished = np.full(len(loads), np.nan)
        self.waited = np.zeros(len(loads))  # seconds each request waited for its key's read
        self.hits = 0
        self.replicas_added = 0
        self._replicas: dict[int, np.ndarray] = {}  # key -> its replicas, grown from `KeyedCache.eligible`
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
        return self.finished - arrivals + self.waited

    def _route(self, request: int, now: float) -> None:
        load = self.workload.loads[request]
        started = time.perf_counter()
        eligible = None
        if self.keyed is not None:
            key = self.keyed.keys[request]
            holds = np.array([key in worker.held for worker in self.workers])
            replicas = self._replicas_of(int(key), now)
            alive = self.cluster_load.alive if replicas is None else self.cluster_load.alive & replicas
            eligible = prefer_holders(alive, holds, self.cluster_load, self.keyed.affinity)
        slot = self.policy.choose(load, self.cluster_load, eligible)
        self.decision_s += time.perf_counter() - started
        self.cluster_load.assign(slot, request, load)
        worker = self.workers[slot]  # slots are 0..W-1 in creation order
        if self.keyed is not None:
            self._hold(worker, request, now)
        worker.queue.append(request)
        if not worker.batch:
            self._boundary(worker, now, 0)
        elif len(worker.batch) < self.max_batch:  # joins at the next step boundary
            steps = math.floor((now - worker.phase_start) / worker.step_s) + 1
            if steps < worker.event_steps:
                self._schedule(worker, steps)

    def _replicas_of(self, key: int, now: float) -> np.ndarray | None:
        """The key's replicas now ([workers] bool; None: every worker); with `KeyedCache.grow`, one more as the
        router adds it (`Router._grow_replicas`): the key's own requests in flight on its replicas exceed the
        bound per replica, and `policies.replica_to_add` finds a worker. That worker holds the key miss_s
        later (its recording: the time only, not the compute), and none is added while one is recorded."""
        replicas = self._replicas.get(key)
        if replicas is None:
            replicas = self.keyed.eligible(key, len(self.workers))
            if replicas is None:
                return None
            self._replicas[key] = replicas
        if self.keyed.grow:
            holders = [self.workers[slot] for slot in np.flatnonzero(replicas)]
            recording = any(worker.held.get(key, now) > now for worker in holders)
            own = sum(self.keyed.keys[request] == key for worker in holders
                      for request in (*worker.batch, *worker.queue))
            alive = self.cluster_load.alive
            added = None if recording or own <= REPLICA_GROWTH_BOUND * len(holders) else replica_to_add(
                alive & replicas, alive & ~replicas, self.cluster_load, REPLICA_GROWTH_BOUND)
            if added is not None:
                replicas[added] = True
                self.replicas_added += 1
                self._read(self.workers[added], key, now)
        return replicas

    def _hold(self, worker: _Worker, request: int, now: float) -> None:
        """The worker holds the request's key from now (its read starts at submission): a hit (no read),
        which still waits for a read in progress, or a miss, whose read delays the request by miss_s."""
        key = self.keyed.keys[request]
        ready = worker.held.get(key)
        if ready is not None:
            worker.held.move_to_end(key)
            self.hits += 1
            self.waited[request] = max(0.0, ready - now)
            return
        self.waited[request] = self.keyed.miss_s
        self._read(worker, key, now)

    def _read(self, worker: _Worker, key: int, now: float) -> None:
        """The worker holds `key` miss_s from now (read, or recorded), pushing out its least recent keys."""
        worker.held[key] = now + self.keyed.miss_s
        while len(worker.held) > self.keyed.cache:
            worker.held.popitem(last=False)

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
            raise InputError(f"the cost model predicts a {worker.step_s} s step for a batch of {len(running)}: "
                             f"{ZERO_STEP_ADVICE}")
        worker.phase_start = now
        self._schedule(worker, min(self.steps_left[r] for r in running))

    def _schedule(self, worker: _Worker, steps: int) -> None:
        worker.version += 1
        worker.event_steps = steps
        self._seq += 1
        heapq.heappush(self._events, (worker.phase_start + steps * worker.step_s, self._seq,
                                      worker.slot, worker.version, steps))


def slo_attainment(latencies: np.ndarray, workload: Workload) -> float | None:
    """Fraction of the requests with a deadline answered by it (None: no request has one)."""
    timed = [(i, x.deadline) for i, x in enumerate(workload.loads) if x.deadline is not None]
    if not timed:
        return None
    index, deadlines = (np.array(column) for column in zip(*timed))
    return float(np.mean(workload.arrivals[index] + latencies[index] <= deadlines))


def summarize(latencies: np.ndarray, decision_s: float, workload: Workload | None = None) -> dict:
    summary = {"p50_s": float(np.percentile(latencies, 50)), "p95_s": float(np.percentile(latencies, 95)),
               "p99_s": float(np.percentile(latencies, 99)), "mean_s": float(latencies.mean()),
               "decision_us": 1e6 * decision_s / len(latencies)}
    if workload is not None:
        summary["slo_attainment"] = slo_attainment(latencies, workload)
    return summary


BASELINES = ("round-robin", "least-requests", "least-tokens")
LOADED_P95 = 2.0  # --find-load: the load where the best baseline's p95 reaches this x the unloaded p95


def find_load(cost: StepCost, args, mask_dist: str, workers: int, image_tokens: int, text_tokens: int,
              policies: list[str]) -> dict:
    """Raise the per-worker rate in steps of --rate-step until the best of BASELINES has a p95 at least
    LOADED_P95 x the unloaded p95 (every request alone); every policy's summary at that rate."""
    per_worker = args.rate_step
    while True:
        workload = with_deadlines(make_workload(args.requests, per_worker * workers, mask_dist, image_tokens,
                                                text_tokens, args.steps, args.seed, args.resolutions),
                                  cost, args.slo_scale)
        unloaded_p95 = float(np.percentile(alone_seconds(cost, workload.loads), 95))
        results = {}
        for name in BASELINES:
            cluster = SimulatedCluster(make_policy(name, cost), cost, workload, workers, args.max_batch)
            results[name] = summarize(cluster.run(), cluster.decision_s, workload)
        best = min(BASELINES, key=lambda name: results[name]["p95_s"])
        if results[best]["p95_s"] >= LOADED_P95 * unloaded_p95 or per_worker >= args.max_rate:
            break
        per_worker = round(per_worker + args.rate_step, 6)
    for name in policies:
        if name not in results:
            cluster = SimulatedCluster(make_policy(name, cost), cost, workload, workers, args.max_batch)
            results[name] = summarize(cluster.run(), cluster.decision_s, workload)
    best_other = min((name for name in results if name not in BASELINES), key=lambda name: results[name]["p95_s"])
    print(f"{mask_dist}, {workers} workers: {per_worker * workers:g} rps, best baseline {best} "
          f"p95 {results[best]['p95_s']:.2f} s, {best_other} {results[best_other]['p95_s']:.2f} s", file=sys.stderr)
    return {"mask_dist": mask_dist, "workers": workers, "rps": per_worker * workers,
            "unloaded_p95_s": unloaded_p95, "best_baseline": best, "best_policy": best_other,
            "p95_cut_vs_best_baseline": 1 - results[best_other]["p95_s"] / results[best]["p95_s"],
            "policies": results}


def _progress_printer(name: str, every_s: float = 2.0):
    started = last = time.perf_counter()

    def report(done: int, total: int) -> None:
        nonlocal last
        now = time.perf_counter()
        if now - last >= every_s or done == total and now - started >= every_s:
            last = now
            print(f"  {name}: {done}/{total} requests routed, {now - started:.1f} s", file=sys.stderr)

    return report


def out_path(text: str) -> Path:
    """argparse `type` of `--out`: checked before the simulation runs (`retouch.bench.report.out_path`,
    imported here: that module imports torch, which the simulator does not)."""
    from retouch.bench.report import out_path as checked

    return checked(text)


# The --lora-* and --template-* knobs, by dest: their defaults (None on the command line: not given).
KNOBS = {"lora_zipf": 1.0, "lora_cache": 32, "lora_miss_s": 0.5, "lora_affinity": 0, "template_zipf": 1.0,
         "template_cache": 2, "template_miss_s": 6.0, "template_affinity": 0, "template_replicas": 0}


def _knob_adder(parser: ArgumentParser) -> Callable[[str, type, str], None]:
    def add(flag: str, kind: type, help_: str) -> None:
        default = KNOBS[flag[2:].replace("-", "_")]
        parser.add_argument(flag, type=kind, default=None, help=f"{help_} (default {default})")

    return add


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(prog="retouch simulate", description=__doc__)
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
    parser.add_argument("--resolutions", choices=tuple(RESOLUTION_MIX), default="1024",
                        help="output sides: all 1024 px, or PatchedServe's mixes of 512/768/1024 px (uniform; "
                             "low, medium, high: that side half of the requests)")
    parser.add_argument("--slo-scale", type=float, default=SLO_SCALE,
                        help="deadline = arrival + this x the request's unloaded latency (PatchedServe: 5)")
    parser.add_argument("--find-load", action="store_true",
                        help=f"per --mask-dists x --worker-counts, raise the load until the best of "
                             f"{', '.join(BASELINES)} has a p95 >= {LOADED_P95:g}x the unloaded p95, and "
                             "compare every policy there")
    parser.add_argument("--mask-dists", default="public,production", help="--find-load: comma list")
    parser.add_argument("--worker-counts", default="8,64", help="--find-load: comma list")
    parser.add_argument("--rate-step", type=float, default=0.05, help="--find-load: rps per worker per step")
    parser.add_argument("--max-rate", type=float, default=4.0, help="--find-load: rps per worker at most")
    parser.add_argument("--loras", type=int, default=0, help="adapters requests name (0: no LoRA)")
    knob = _knob_adder(parser)
    knob("--lora-zipf", float, "Zipf exponent of adapter popularity")
    knob("--lora-cache", int, "adapters a worker holds")
    knob("--lora-miss-s", float, "seconds a request waits when its worker must read its adapter")
    knob("--lora-affinity", int, "the router's bound: in-flight requests over the least loaded worker's")
    parser.add_argument("--templates", type=int, default=0,
                        help="templates requests edit (0: one, always in host memory)")
    knob("--template-zipf", float, "Zipf exponent of template popularity")
    knob("--template-cache", int, "templates a worker's host memory holds (flux-size at 1024 px: 2 in 96 GiB)")
    knob("--template-miss-s", float, "seconds an edit waits when its worker reads its template back from disk "
                                     "(flux-size: 37 GiB at ~6 GB/s)")
    knob("--template-affinity", int, "the router's bound: in-flight requests over the least loaded worker's")
    knob("--template-replicas", int, "workers each template is recorded on (0: every worker)")
    parser.add_argument("--out", type=out_path, default=None, help="also write the JSON here, and a PNG beside it")
    args = parser.parse_args(argv)
    for count, prefix in (("loras", "lora_"), ("templates", "template_")):
        given = [name for name in KNOBS if name.startswith(prefix) and getattr(args, name) is not None]
        if given and not getattr(args, count):  # it shapes only the runs its count turns on: ignored, silently
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            parser.error(f"{flags} {'needs' if len(given) == 1 else 'need'} --{count} N (N >= 1): without it "
                         "they change nothing")
        for name in KNOBS:
            if name.startswith(prefix) and getattr(args, name) is None:
                setattr(args, name, KNOBS[name])
    policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    unknown = [name for name in policies if name not in POLICIES]
    if unknown or not policies:
        parser.error(f"--policies: unknown {unknown}; choose from {', '.join(POLICIES)}")
    for flag in ("rps", "slo_scale", "rate_step", "max_rate", "lora_zipf", "lora_miss_s", "template_zipf",
                 "template_miss_s"):
        if not math.isfinite(getattr(args, flag)):
            parser.error(f"--{flag.replace('_', '-')} must be a finite number")
    if min(args.workers, args.requests, args.steps, args.max_batch, args.guidance_copies) < 1 or args.rps <= 0:
        parser.error("--workers, --requests, --steps, --max-batch, --guidance-copies must be >= 1, --rps > 0")
    if args.workers > MAX_WORKERS or args.requests > MAX_REQUESTS:  # a typo, not a cluster: memory runs out
        parser.error(f"--workers must be at most {MAX_WORKERS} and --requests at most {MAX_REQUESTS}")
    if args.slo_scale <= 0 or args.rate_step <= 0 or args.max_rate <= 0:
        parser.error("--slo-scale, --rate-step and --max-rate must be > 0")
    if (args.image_tokens is not None and args.image_tokens < 1) or (args.text_tokens or 0) < 0:
        parser.error("--image-tokens must be >= 1 and --text-tokens >= 0")
    if args.loras < 0 or args.lora_zipf < 0 or args.lora_cache < 1 or args.lora_miss_s < 0 or args.lora_affinity < 0:
        parser.error("--loras, --lora-zipf, --lora-miss-s and --lora-affinity must be >= 0, --lora-cache >= 1")
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.loras and args.find_load:
        parser.error("--loras compares routing with and without LoRA affinity at one load: not with --find-load")
    if (args.templates < 0 or args.template_zipf < 0 or args.template_cache < 1 or args.template_miss_s < 0
            or args.template_affinity < 0 or args.template_replicas < 0):
        parser.error("--templates, --template-zipf, --template-miss-s, --template-affinity and --template-replicas "
                     "must be >= 0, --template-cache >= 1")
    if args.templates and (args.loras or args.find_load):
        parser.error("--templates compares routing with and without template affinity at one load: not with "
                     "--loras or --find-load")

    model = CostModel.from_json(args.cost_model) if args.cost_model else h800_flux()
    image_tokens, text_tokens = _request_shape(model, args, parser)
    cost = StepCost(model, args.guidance_copies)
    if args.find_load:
        return _find_loads(cost, model, args, parser, image_tokens, text_tokens, policies, argv)
    workload = with_deadlines(make_workload(args.requests, args.rps, args.mask_dist, image_tokens, text_tokens,
                                            args.steps, args.seed, args.resolutions), cost, args.slo_scale)
    if not alone_seconds(cost, workload.loads).min() > 0:
        parser.error(f"the cost model predicts a step of 0 s for a request of {image_tokens} image tokens: "
                     f"{ZERO_STEP_ADVICE}")
    started = time.perf_counter()
    results, latencies = {}, {}
    runs = [(name, name, None) for name in policies]
    kind = "lora" if args.loras else "template" if args.templates else None
    if kind is not None:
        count, zipf, cache, miss_s, affinity = (getattr(args, f"{kind}{suffix}") for suffix in (
            "s", "_zipf", "_cache", "_miss_s", "_affinity"))
        keys = zipf_keys(args.requests, count, zipf, args.seed)
        replicas = args.template_replicas if kind == "template" else 0
        runs = [(label, name, KeyedCache(keys, cache, miss_s, bound, replicas)) for name in policies
                for label, bound in ((name, None), (f"{name}+{kind}-affinity", affinity))]
        if replicas:  # the router's default: replicas that grow where a template's edits fill them
            runs += [(f"{name}+{kind}-affinity+growing-replicas", name,
                      KeyedCache(keys, cache, miss_s, affinity, replicas, grow=True)) for name in policies]
    for label, name, keyed in runs:
        print(f"{label}: {args.requests} requests at {args.rps} rps on {args.workers} workers", file=sys.stderr)
        cluster = SimulatedCluster(make_policy(name, cost), cost, workload, args.workers, args.max_batch, keyed)
        latencies[label] = cluster.run(_progress_printer(label))
        results[label] = summarize(latencies[label], cluster.decision_s, workload)
        if keyed is not None:
            results[label][f"{kind}_hit_rate"] = cluster.hits / args.requests
        if keyed is not None and keyed.grow:
            results[label]["replicas_added"] = cluster.replicas_added
    alone = cost.latency(cost.request_features(image_tokens, round(_mean_ratio(args.mask_dist) * image_tokens),
                                               text_tokens))
    report = {"policies": results, "workers": args.workers, "rps": args.rps, "requests": args.requests,
              "mask_dist": args.mask_dist, "cost_model": str(args.cost_model) if args.cost_model else "built-in",
              "model": model.model, "device": model.device, "steps": args.steps, "max_batch": args.max_batch,
              "seed": args.seed, "image_tokens": image_tokens, "text_tokens": text_tokens,
              "resolutions": args.resolutions, "slo_scale": args.slo_scale,
              "loras": {"adapters": args.loras, "zipf": args.lora_zipf, "cache": args.lora_cache,
                        "miss_s": args.lora_miss_s, "affinity": args.lora_affinity} if args.loras else None,
              "templates": {"templates": args.templates, "zipf": args.template_zipf, "cache": args.template_cache,
                            "miss_s": args.template_miss_s, "affinity": args.template_affinity,
                            "replicas": args.template_replicas} if args.templates else None,
              "unloaded_p95_s": float(np.percentile(alone_seconds(cost, workload.loads), 95)),
              "mean_mask_ratio": float(np.mean([x.masked_tokens for x in workload.loads]) / image_tokens),
              "alone_at_mean_mask_s": float(alone) * args.steps, "wall_s": time.perf_counter() - started,
              "command": "retouch simulate " + " ".join(sys.argv[1:] if argv is None else argv)}
    from retouch.bench.report import json_text, write_json

    print(json_text(report))
    if args.out is not None:
        write_json(report, args.out)
        _plot(report, latencies, args.out.with_suffix(".png"))
    return report


def _find_loads(cost, model, args, parser, image_tokens, text_tokens, policies, argv) -> dict:
    mask_dists = [name.strip() for name in args.mask_dists.split(",") if name.strip()]
    if not mask_dists or any(name not in MASK_BETA for name in mask_dists):
        parser.error(f"--mask-dists: choose from {', '.join(MASK_BETA)}")
    try:
        worker_counts = [int(count) for count in args.worker_counts.split(",")]
    except ValueError:
        parser.error("--worker-counts: a comma list of integers")
    if min(worker_counts) < 1:
        parser.error("--worker-counts must be >= 1")
    started = time.perf_counter()
    configurations = [find_load(cost, args, mask_dist, workers, image_tokens, text_tokens, policies)
                      for mask_dist in mask_dists for workers in worker_counts]
    report = {"configurations": configurations, "loaded_p95": LOADED_P95, "baselines": list(BASELINES),
              "requests": args.requests, "resolutions": args.resolutions, "slo_scale": args.slo_scale,
              "model": model.model, "device": model.device, "steps": args.steps, "max_batch": args.max_batch,
              "seed": args.seed, "image_tokens": image_tokens, "text_tokens": text_tokens,
              "wall_s": time.perf_counter() - started,
              "command": "retouch simulate " + " ".join(sys.argv[1:] if argv is None else argv)}
    from retouch.bench.report import json_text, write_json

    print(json_text(report))
    if args.out is not None:
        write_json(report, args.out)
        _plot_loads(report, args.out.with_suffix(".png"))
    return report


def _plot_loads(report: dict, out: Path) -> None:
    """p95 per policy per configuration, over the best baseline's p95 (1 = it; the 30% target at 0.7)."""
    from retouch.bench.report import pyplot

    plt = pyplot()
    if plt is None:
        return
    configurations = report["configurations"]
    names = list(configurations[0]["policies"])
    figure, axis = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        ratios = [c["policies"][name]["p95_s"] / c["policies"][c["best_baseline"]]["p95_s"] for c in configurations]
        axis.bar(np.arange(len(configurations)) + k * width, ratios, width, label=name)
    axis.axhline(0.7, color="black", linestyle="--", linewidth=1, label="target: 30% below the best baseline")
    axis.set_xticks(np.arange(len(configurations)) + 0.4 - width / 2,
                    [f"{c['mask_dist']}, {c['workers']} w\n{c['rps']:g} rps" for c in configurations])
    axis.set_ylabel("p95 / best baseline's p95")
    axis.set_title(f"{report['resolutions']} resolutions: where the best baseline's p95 is "
                   f"{report['loaded_p95']:g}x unloaded")
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)


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
        summary = report["policies"][name]
        hits = "".join(f", {what} hits {summary[key]:.0%}" for key, what in (
            ("lora_hit_rate", "LoRA"), ("template_hit_rate", "host")) if key in summary)
        axis.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered),
                  label=f"{name} (p95 {summary['p95_s']:.2f} s{hits})")
    axis.set_xlabel("request latency (s)")
    everything = np.concatenate(list(latencies.values()))
    if np.max(everything) > 20 * np.median(everything):  # a queue of minutes beside runs of seconds
        axis.set_xscale("log")
        axis.set_xlabel("request latency (s, log scale)")
    axis.set_ylabel("fraction of requests")
    loras, templates = report.get("loras"), report.get("templates")
    keyed_title = (f"\n{loras['adapters']} LoRAs (Zipf {loras['zipf']:g}), {loras['cache']} held per worker, "
                   f"a miss +{loras['miss_s']:g} s, affinity bound {loras['affinity']}" if loras else
                   f"\n{templates['templates']} templates (Zipf {templates['zipf']:g}), {templates['cache']} in "
                   f"host memory per worker,\na read from disk +{templates['miss_s']:g} s, affinity bound "
                   f"{templates['affinity']}, recorded on "
                   f"{templates.get('replicas') or 'every'} worker(s)" if templates else "")
    if templates and templates.get("replicas"):
        keyed_title += "\n(+growing-replicas: one more where all are busy)"
    axis.set_title(f"{report['workers']} workers, {report['rps']} rps, {report['mask_dist']} masks{keyed_title}",
                   fontsize=10 if keyed_title else None)
    # the curves rise at the right; on a log scale at the left
    axis.legend(loc="lower right" if axis.get_xscale() == "log" else "upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
