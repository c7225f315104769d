"""Block planner: the paper's Algorithm 1 (as printed) and the exact DP against brute force over every
plan, and how long the exact DP takes to plan Flux's 57 blocks.

    retouch bench planner --instances 200 --blocks 12 [--seed 0] [--timing-instances 100] [--out F.json]

Comparison instances are random BlockCosts (arbitrary time units: only ratios matter). Per instance: a
load factor drawn log-uniformly in 0.1..5 times the cached compute (below 1 compute-bound, above
load-bound), cached compute 0.1..1 of full, then every block's costs drawn apart from that (heterogeneous
blocks), and every other instance with handoffs (KV-cache mode). Timing instances are shaped as a cost
model gives them for Flux: 19 double and 38 single blocks with costs per kind, both regimes, alternately
Y-cache and KV-cache (handoff = the out rows, half of k + v; the last block's folded into its load). Each
is timed as the best of 3 runs; the median over instances is reported. Prints one JSON object; progress
goes to stderr. Deterministic for a --seed, timings aside.
"""

from __future__ import annotations

import math
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from retouch.bench.report import json_text, out_path, pyplot, write_json, environment, seed_arg
from retouch.errors import ArgumentParser
from retouch.planner import TIE_RTOL, BlockCosts, algorithm1, brute_force, optimal_plan, simulate
from retouch.progress import bar

FLUX_BLOCKS = (("double", 19), ("single", 38))
MATCH_RTOL = 1e-9  # Algorithm 1 "matches" when its plan is this close to the optimum


def load_factor(rng: random.Random) -> float:
    return math.exp(rng.uniform(math.log(0.1), math.log(5.0)))


def random_costs(rng: random.Random, blocks: int, handoff: bool) -> tuple[BlockCosts, str]:
    """Heterogeneous blocks around one drawn regime; returns the costs and the regime's name."""
    factor, cached_share = load_factor(rng), rng.uniform(0.1, 1.0)
    full = [rng.uniform(0.5, 1.5) for _ in range(blocks)]
    cached = [f * min(1.0, cached_share * rng.uniform(0.7, 1.3)) for f in full]
    load = [c * factor * rng.uniform(0.7, 1.3) for c in cached]
    handoffs = [l * rng.uniform(0.3, 1.0) for l in load] if handoff else None
    return BlockCosts(full, cached, load, handoffs), "compute-bound" if factor < 1 else "load-bound"


def flux_costs(rng: random.Random, kv_cache: bool) -> BlockCosts:
    """Flux's 57 blocks, costs per kind as `CostModel.block_costs` gives them."""
    factor = load_factor(rng)
    blocks = []
    for _, count in FLUX_BLOCKS:
        full = rng.uniform(0.5, 1.5)
        cached = full * rng.uniform(0.1, 1.0)
        load = cached * factor * rng.uniform(0.7, 1.3)
        blocks += [(full, cached, load, load / 2 if kv_cache else 0.0)] * count
    full, cached, load, handoff = map(list, zip(*blocks))
    if kv_cache:  # the last block always hands over its output rows
        load[-1], handoff[-1] = load[-1] + handoff[-1], 0.0
    return BlockCosts(full, cached, load, handoff if kv_cache else None)


def best_of(planner, costs: BlockCosts, repeats: int = 3) -> float:
    """Seconds of the fastest of `repeats` runs (the others absorb the machine's noise)."""
    fastest = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        planner(costs)
        fastest = min(fastest, time.perf_counter() - started)
    return fastest


def compare(instances: list[tuple[BlockCosts, str]]) -> tuple[list[dict], list[float]]:
    """Per instance: Algorithm 1's relative excess latency over brute force's optimum, whether the exact
    DP matched brute force; and the exact DP's planning seconds."""
    rows, plan_seconds = [], []
    for costs, regime in bar(instances, "planner: Algorithm 1 and DP vs brute force", unit="instance"):
        best = brute_force(costs)
        plan_seconds.append(best_of(optimal_plan, costs))
        exact = optimal_plan(costs)
        greedy = simulate(algorithm1(costs).use_cache, costs)
        rows.append({"regime": regime, "mode": "y" if costs.handoff_s is None else "kv",
                     "exact": abs(exact.latency_s - best.latency_s) <= TIE_RTOL * best.latency_s,
                     "fewest_cached": exact.num_cached == best.num_cached,
                     "algo1_gap": (greedy - best.latency_s) / best.latency_s})
    return rows, plan_seconds


def gap_summary(rows: list[dict]) -> dict:
    gaps = [row["algo1_gap"] for row in rows]
    return {"instances": len(rows), "algo1_matches_bruteforce": sum(gap <= MATCH_RTOL for gap in gaps),
            "algo1_max_gap": max(gaps, default=0.0), "algo1_mean_gap": statistics.fmean(gaps) if gaps else 0.0}


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(prog="retouch bench planner", description=__doc__)
    parser.add_argument("--instances", type=int, default=200, help="random instances compared with brute force")
    parser.add_argument("--blocks", type=int, default=12, help="blocks per compared instance (2^blocks plans)")
    parser.add_argument("--timing-instances", type=int, default=100, help="Flux-shaped 57-block instances timed")
    parser.add_argument("--seed", type=seed_arg, default=0)
    parser.add_argument("--out", type=out_path, default=None, help="also write the JSON here, and a PNG beside it")
    args = parser.parse_args(argv)
    if args.instances < 1 or args.timing_instances < 1 or not 1 <= args.blocks <= 20:
        parser.error("--instances and --timing-instances must be >= 1, --blocks in 1..20")

    rng = random.Random(args.seed)
    instances = [random_costs(rng, args.blocks, handoff=index % 2 == 1) for index in range(args.instances)]
    rows, plan_seconds = compare(instances)
    print(f"timing {args.timing_instances} Flux-shaped instances of 57 blocks", file=sys.stderr)
    flux = [flux_costs(rng, kv_cache=index % 2 == 1) for index in range(args.timing_instances)]
    optimal_us = [best_of(optimal_plan, costs) * 1e6 for costs in flux]
    algo1_us = [best_of(algorithm1, costs) * 1e6 for costs in flux]

    summary = gap_summary(rows)
    report = {"bench": "planner",
              **environment("planner", argv, "cpu"),
              "instances": args.instances, "blocks": args.blocks, "seed": args.seed,
              "exact_matches_bruteforce": all(row["exact"] for row in rows),
              "fewest_cached_matches_bruteforce": sum(row["fewest_cached"] for row in rows),
              "algo1_matches_bruteforce": summary["algo1_matches_bruteforce"],
              "algo1_max_gap": summary["algo1_max_gap"], "algo1_mean_gap": summary["algo1_mean_gap"],
              "groups": {f"{regime}/{mode}": gap_summary([row for row in rows
                                                          if row["regime"] == regime and row["mode"] == mode])
                         for regime in ("compute-bound", "load-bound") for mode in ("y", "kv")},
              "plan_us_blocks": statistics.median(plan_seconds) * 1e6,
              "timing_instances": args.timing_instances,
              "plan_us_57_blocks": statistics.median(optimal_us),
              "plan_us_57_blocks_p90": statistics.quantiles(optimal_us, n=10)[-1] if len(optimal_us) > 1
              else optimal_us[0],
              "plan_us_57_blocks_algo1": statistics.median(algo1_us),
              "python": platform.python_version()}
    if args.out:
        write_report(report, rows, optimal_us, algo1_us, args.out)
    print(json_text(report))
    return report


def write_report(report: dict, rows: list[dict], optimal_us: list[float], algo1_us: list[float],
                 out: Path) -> None:
    """The JSON at `out`, and beside it a PNG: Algorithm 1's gap per group, planning times at 57 blocks."""
    write_json(report, out)
    plt = pyplot()
    if plt is None:
        return
    import matplotlib.ticker
    figure, (gaps, times) = plt.subplots(1, 2, figsize=(10, 3.8))
    groups = list(report["groups"])
    gaps.hist([[100 * row["algo1_gap"] for row in rows if f"{row['regime']}/{row['mode']}" == group]
               for group in groups], bins=30, stacked=True, label=groups)
    gaps.set_xlabel("Algorithm 1 latency above the optimum (%)")
    gaps.set_ylabel("instances")
    gaps.set_title(f"{report['instances']} instances of {report['blocks']} blocks")
    gaps.legend(fontsize=8)
    bins = np.geomspace(min(algo1_us + optimal_us), max(algo1_us + optimal_us), 40)
    times.hist([optimal_us, algo1_us], bins=bins, histtype="step", label=["exact DP", "Algorithm 1"])
    times.axvline(report["plan_us_57_blocks"], color="black", linestyle="--", linewidth=1)
    times.set_xscale("log")
    times.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    times.set_xlabel("planning time, 57 blocks (us, best of 3)")
    times.set_ylabel("instances")
    times.set_title(f"median exact DP {report['plan_us_57_blocks']:.0f} us")
    times.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
