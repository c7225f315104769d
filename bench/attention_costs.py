"""Fit `retouch.ops.ATTENTION_COSTS` to an attention sweep (`retouch bench attention` on a GPU).

Each path's time per call is modelled as `fixed_ms + per_request_ms * B + TFLOP / tflops`, fitted to the
sweep's `ms_steady` (the device's time; one call from an idle device is the host's launch latency at
most points) by least squares on the relative error, every coefficient >= 0. The Triton kernel and
SDPA per request are charged the ragged work, padded SDPA the work padded to the longest request. It
then replays `ops.choose_attention` with the fits on the same sweep: the chosen path's measured time
against the fastest of the three at each point.

    python -m retouch.bench.attention_costs bench/results/h200/attention.json

Prints one JSON object: the fits per head_dim (paste them into `ops.ATTENTION_COSTS`) and the replay.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import sys

import numpy as np

from retouch import ops
from retouch.errors import ArgumentParser

# ops.choose_attention's paths and the sweep's names for them.
PATHS = {("triton", False): "ragged_triton", ("sdpa", True): "padded_sdpa", ("sdpa", False): "per_request_sdpa"}
COST_NAMES = {"ragged_triton": "triton", "padded_sdpa": "sdpa_padded", "per_request_sdpa": "sdpa"}


def work_tflop(point: dict, padded: bool) -> float:
    """The TFLOP a path computes at `point` (`ops.attention_flop`, as `ops.choose_attention` charges it)."""
    lengths_q = point["query_lens"]
    lengths_k = [point["tokens_per_request"]] * len(lengths_q)
    return ops.attention_flop(lengths_q, lengths_k, point["heads"], point["head_dim"], padded) / 1e12


def fit_cost(rows: list[tuple[int, float, float]]) -> ops.AttentionCost:
    """The `AttentionCost` nearest (relative error, least squares, coefficients >= 0) to `rows` of
    (requests, TFLOP, measured ms). Three coefficients: every subset is solved and the best feasible kept."""
    design = np.array([[1.0, requests, tflop] for requests, tflop, _ in rows])
    measured = np.array([ms for _, _, ms in rows])
    weighted = design / measured[:, None]  # relative error: each row divided by its measurement
    best, best_error = None, math.inf
    for size in (3, 2, 1):
        for columns in itertools.combinations(range(3), size):
            if 2 not in columns:
                continue  # without a rate the model cannot grow with the work
            solution, *_ = np.linalg.lstsq(weighted[:, columns], np.ones(len(rows)), rcond=None)
            if (solution < 0).any():
                continue
            coefficients = np.zeros(3)
            coefficients[list(columns)] = solution
            error = float(((weighted @ coefficients - 1) ** 2).sum())
            if error < best_error:
                best, best_error = coefficients, error
    if best is None or best[2] <= 0:
        raise ValueError("no fit with a positive rate: does the sweep time any work?")
    fixed, per_request, ms_per_tflop = best
    return ops.AttentionCost(round(float(fixed), 4), round(float(per_request), 4), round(1e3 / ms_per_tflop))


def fit_costs(sweep: dict, timing: str = "ms_steady") -> dict[int, dict[str, ops.AttentionCost]]:
    """`ops.ATTENTION_COSTS`' entries for one GPU, per head_dim, from `sweep` (an attention JSON)."""
    by_head_dim: dict[int, dict[str, list]] = {}
    for point in sweep["results"]:
        rows = by_head_dim.setdefault(point["head_dim"], {name: [] for name in COST_NAMES})
        for method in COST_NAMES:
            rows[method].append((len(point["query_lens"]), work_tflop(point, method == "padded_sdpa"),
                                 point[timing][method]))
    return {head_dim: {COST_NAMES[method]: fit_cost(method_rows) for method, method_rows in rows.items()}
            for head_dim, rows in sorted(by_head_dim.items())}


def replay(sweep: dict, costs: dict[int, dict[str, ops.AttentionCost]], timing: str = "ms_steady") -> dict:
    """`ops.choose_attention` with `costs` at every point of `sweep`: the chosen path's measured time as a
    fraction of the fastest path's (1 = it chose the fastest) and its gain over the kernel alone."""
    ratios, gains = [], []
    for point in sweep["results"]:
        lengths_q = point["query_lens"]
        lengths_k = [point["tokens_per_request"]] * len(lengths_q)
        chosen = PATHS[ops.choose_attention(lengths_q, lengths_k, point["heads"], point["head_dim"],
                                            costs[point["head_dim"]])]
        measured = point[timing]
        ratios.append(min(measured[path] for path in PATHS.values()) / measured[chosen])
        gains.append(measured["ragged_triton"] / measured[chosen])
    return {"points": len(ratios), "worst_vs_fastest": round(min(ratios), 3),
            "median_vs_fastest": round(statistics.median(ratios), 3),
            "geomean_gain_vs_kernel": round(math.exp(statistics.fmean(math.log(g) for g in gains)), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="retouch bench attention_costs", description=__doc__)
    parser.add_argument("sweep", help="an attention JSON of `retouch bench attention` on a GPU")
    parser.add_argument("--timing", default="ms_steady", choices=["ms_steady", "ms_p50"],
                        help="which time per call to fit (default: ms_steady, the device's time)")
    opts = parser.parse_args(argv)
    with open(opts.sweep) as file:
        sweep = json.load(file)
    missing = [point for point in sweep.get("results", []) if opts.timing not in point]
    if not sweep.get("results") or missing:
        parser.exit(2, f"{opts.sweep}: no {opts.timing} times at {len(missing)} of "
                       f"{len(sweep.get('results', []))} points\n")
    costs = fit_costs(sweep, opts.timing)
    gpu = sweep.get("environment", sweep).get("gpu")  # the sweep's JSON keeps it under "environment"
    current = {head_dim: ops.ATTENTION_COSTS.get((int(gpu["capability"].split(".")[0]), head_dim))
               for head_dim in costs} if gpu else {}
    report = {"sweep": opts.sweep, "timing": opts.timing, "device": sweep.get("device"),
              "fits": {head_dim: {name: vars(cost) for name, cost in fits.items()} for head_dim, fits in costs.items()},
              "replay_fits": replay(sweep, costs, opts.timing)}
    if current and all(current.values()):
        report["replay_current"] = replay(sweep, current, opts.timing)
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
