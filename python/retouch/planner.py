"""Which blocks of a denoising step read cached activations: the bubble-free pipeline of §4.2.

Per step, every transformer block (in execution order) either uses the cache -- the load stream copies
what the block reads host->device, then the compute stream computes only the masked tokens -- or
computes every token and loads nothing. The load stream copies the cached blocks' activations one after
another in block order; a cached block's compute waits for its own load. `simulate` is that two-stream
timeline and the ground truth for every planner: `algorithm1` is the paper's Algorithm 1 as printed (a
greedy, block by block), `optimal_plan` the exact optimum, `brute_force` the enumeration tests and the
planner benchmark compare both with.

Ties: plans whose latencies agree to TIE_RTOL (floats of equal sums added in another order differ in
the last bits) are equally fast; among them every planner here except `algorithm1` returns one with the
fewest cached blocks, since each cached block is PCIe traffic that competes with other requests' loads.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

TIE_RTOL = 1e-12
BRUTE_FORCE_MAX_BLOCKS = 22  # 2^22 plans x 22 blocks of float64 is already ~1 GiB of timeline


@dataclass(frozen=True)
class BlockCosts:
    """Per-block latencies in seconds, blocks in execution order (every tuple has one entry per block).

    full_s:    C_w/o, compute every token, no cache traffic.
    cached_s:  C_w.^m, compute the masked tokens, reading cached activations.
    load_s:    L^m, host->device load of what the block reads from the cache.
    handoff_s: extra load charged when cached block i is followed by a full block: block i must then hand
               over all output rows, so its recorded output rows are loaded too (KV-cache mode). None
               means zeros (Y-cache mode, where the cache holds exactly the block outputs).
    """

    full_s: tuple[float, ...]
    cached_s: tuple[float, ...]
    load_s: tuple[float, ...]
    handoff_s: tuple[float, ...] | None = None

    def __post_init__(self):
        n = len(self.full_s)
        for name in ("full_s", "cached_s", "load_s", "handoff_s"):
            values = getattr(self, name)
            if values is None:
                continue
            values = tuple(float(v) for v in values)
            if len(values) != n:
                raise ValueError(f"BlockCosts.{name} has {len(values)} entries, full_s has {n}: one per block")
            bad = [v for v in values if not (math.isfinite(v) and v >= 0.0)]
            if bad:
                raise ValueError(f"BlockCosts.{name} must be finite and >= 0 seconds, got {bad[0]!r}")
            object.__setattr__(self, name, values)

    @property
    def num_blocks(self) -> int:
        return len(self.full_s)

    @property
    def handoffs(self) -> tuple[float, ...]:
        """handoff_s with None read as zeros."""
        return self.handoff_s if self.handoff_s is not None else (0.0,) * self.num_blocks


@dataclass(frozen=True)
class Plan:
    """use_cache[i]: block i reads cached activations; latency_s: the step's blocks as the planner predicts."""

    use_cache: tuple[bool, ...]
    latency_s: float

    @property
    def num_cached(self) -> int:
        return sum(self.use_cache)


def simulate(use_cache: Sequence[bool], costs: BlockCosts) -> float:
    """Seconds until the compute stream finishes the last block under `use_cache` (one flag per block)."""
    if len(use_cache) != costs.num_blocks:
        raise ValueError(f"plan has {len(use_cache)} flags for {costs.num_blocks} blocks")
    handoff = costs.handoffs
    load = comp = 0.0
    for i, cached in enumerate(use_cache):
        if cached:
            load += costs.load_s[i]
            comp = max(load, comp) + costs.cached_s[i]
        else:
            if i > 0 and use_cache[i - 1]:
                load += handoff[i - 1]
                comp = max(load, comp)
            comp += costs.full_s[i]
    return comp


def algorithm1(costs: BlockCosts) -> Plan:
    """The paper's Algorithm 1 exactly as printed, with per-block costs for block i-1 at step i.

    Greedy: a block uses the cache when that finishes it no later than computing it in full given the
    blocks before, ties going to the cache (the printed `<=`). It ignores handoff_s, and latency_s is its
    comp_N as printed, which is below simulate(plan) when a handoff is charged.
    """
    n = costs.num_blocks
    comp, load, use_cache = [0.0] * (n + 1), [0.0] * (n + 1), [False] * n
    for i in range(1, n + 1):
        full, cached, loading = costs.full_s[i - 1], costs.cached_s[i - 1], costs.load_s[i - 1]
        if max(load[i - 1] + loading, comp[i - 1]) + cached <= comp[i - 1] + full:
            load[i] = load[i - 1] + loading
            comp[i] = max(load[i - 1] + loading, comp[i - 1]) + cached
            use_cache[i - 1] = True
        else:
            load[i] = load[i - 1]
            comp[i] = comp[i - 1] + full
            use_cache[i - 1] = False
    return Plan(tuple(use_cache), comp[n])


def brute_force(costs: BlockCosts) -> Plan:
    """The fastest of all 2^N plans (ties: fewest cached blocks), timelines vectorised over plans.

    plans: [2^N, N] bool, plan p caching block i iff bit i of p is set; each column is one step of
    `simulate`, with the same float operations, so latencies agree bit for bit.
    """
    n = costs.num_blocks
    if n > BRUTE_FORCE_MAX_BLOCKS:
        raise ValueError(f"brute force over {n} blocks means 2^{n} plans; at most {BRUTE_FORCE_MAX_BLOCKS}")
    plans = (np.arange(1 << n)[:, None] >> np.arange(n)) & 1 == 1
    handoff = costs.handoffs
    load = np.zeros(1 << n)
    comp = np.zeros(1 << n)
    for i in range(n):
        cached = plans[:, i]
        handing_over = plans[:, i - 1] & ~cached if i > 0 else np.zeros_like(cached)
        load = np.where(cached, load + costs.load_s[i], np.where(handing_over, load + handoff[i - 1], load))
        waited = np.where(cached | handing_over, np.maximum(load, comp), comp)
        comp = waited + np.where(cached, costs.cached_s[i], costs.full_s[i])
    num_cached = plans.sum(axis=1)
    fastest = np.flatnonzero(comp <= comp.min() * (1 + TIE_RTOL))
    best = fastest[np.lexsort((comp[fastest], num_cached[fastest]))[0]]
    return Plan(tuple(bool(b) for b in plans[best]), float(comp[best]))


def optimal_plan(costs: BlockCosts) -> Plan:
    """The plan of least simulate() latency (ties: fewest cached blocks), found exactly.

    A forward DP over blocks. Its state after a prefix of blocks is (comp, load, cached so far, whether
    the last block was cached): comp and load are the two streams' finishing times, the flag says whether
    a full next block is charged a handoff.

    Exactness. The rest of the timeline is a max-plus expression in (load, comp): it only adds constants
    and takes maxima, so the final latency is nondecreasing in both (float + and max are monotone too).
    Hence a state whose comp, load and cached count are all <= another's, and which has no handoff pending
    where the other has one, finishes no later with no more cached blocks under every continuation: the
    other is dropped, leaving per layer the Pareto frontier of (load, comp, count) per flag. Three more
    cuts, each losing no optimal plan:
    - Bound: a state is dropped when `_KnapsackBound` -- a lower bound on every completion -- exceeds a
      target T. If some plan finishes by T, its states are never dropped, so the best survivor is optimal.
      T starts just above the bound of the empty prefix and grows 4x in gap until a plan fits; the
      all-full plan is always one, so the last T is at most its latency.
    - Runs: in a run of identical consecutive blocks (C cached, F full), these swaps never make a plan
      slower and keep its number of cached blocks, each shown by comparing the two max-plus expressions
      term by term (the loads are the same or fewer, none needed earlier):
      (a) after a full block or the start, "C^m F" -> "F C^m": a run entered so is F^b C^c;
      (b) with no handoff cost around, "C F" -> "F C" anywhere: so is a run entered after a cached block,
          which otherwise may open with a leading cached segment, C^a F^b C^c;
      (c) if cached <= full and (handoff <= load or cached <= load), "C C F^b C" -> "C F^b C C" inside a
          run: a leading segment of two or more is followed by full blocks only, C^a F^b.
      The search walks only these patterns and jumps over the forced rest of a run in closed form. By
      (a), a state whose last block is full also dominates one whose last block is cached.
    - Lag: once comp - load covers every load still to come, loads can never stall compute again, and each
      remaining block simply takes its cheaper variant -- or, where the tie tolerance allows, computes in
      full after all, smallest savings first, to cache fewer blocks.
    Closed-form jumps round differently from simulate()'s running sums, in the last bits only (far inside
    TIE_RTOL); the returned latency_s is simulate() of the plan.

    Cost: a few hundred states for Flux's 57 blocks, whose costs come per block kind (see `retouch bench
    planner`). Many distinct blocks of nearly equal cost are the hard case (the problem contains a
    knapsack): there the frontier, and the time, can grow by orders of magnitude.
    """
    if costs.num_blocks == 0:
        return Plan((), 0.0)
    search = _FrontierSearch(costs)
    ceiling = simulate([False] * costs.num_blocks, costs)
    floor = search.bound.at(0, 0.0, 0.0)
    # The bound is typically within 1% of the optimum. A gap that underflows (subnormal costs) would never
    # move the target: then go straight to the ceiling, which the all-full plan meets.
    gap = (floor or ceiling) / 256 or ceiling
    while True:
        target = min(floor + gap, ceiling)
        found = search.run(target)
        if found is not None and found[0] <= target * (1 + TIE_RTOL):
            break
        floor, gap = target, gap * 4
    _, _, mask = found
    use_cache = tuple(bool(mask >> i & 1) for i in range(costs.num_blocks))
    return Plan(use_cache, simulate(use_cache, costs))


class _KnapsackBound:
    """Lower bound on the latency of blocks i.. from a state (comp, load), for every i.

    Relaxation: compute needs at least comp + sum over the remaining blocks of full or cached (W - saving,
    W = sum of full); if any block is cached, the load stream needs load + the loads of the cached ones +
    at least `tail` after the last of them (its own compute, or its handoff, then the full blocks behind
    it); and blocks may be cached fractionally. The least max(comp + W - saving, load + tail + loaded) is
    then a fractional knapsack: fill by saving per second loaded, (full - cached) / load, until the two
    streams meet. Blocks with equal costs are one item; beyond MAX_ITEMS distinct blocks, neighbours in
    ratio order share an item at the group's best ratio (saving kept, load cut to saving / ratio), which
    only loosens the bound and keeps each row short.
    """

    MAX_ITEMS = 8

    def __init__(self, costs: BlockCosts):
        n = costs.num_blocks
        full, cached, load, handoff = costs.full_s, costs.cached_s, costs.load_s, costs.handoffs
        saving = [f - c if f > c else 0.0 for f, c in zip(full, cached)]  # caching a slower block saves 0
        ratio = {j: s / l if l > 0 else math.inf for j, (s, l) in enumerate(zip(saving, load)) if s > 0}
        # Items: blocks of equal ratio, best ratio first; at most MAX_ITEMS, grouping neighbours.
        distinct = sorted(set(ratio.values()), reverse=True)
        per_item = max(1, -(-len(distinct) // self.MAX_ITEMS))
        item_ratio = distinct[::per_item]
        item_of_ratio = {r: rank // per_item for rank, r in enumerate(distinct)}
        item_load = [[0.0] * n for _ in item_ratio]  # [item][block]: load of the block as the item counts it
        item_saving = [[0.0] * n for _ in item_ratio]
        for j, r in ratio.items():
            k = item_of_ratio[r]
            item_load[k][j] = load[j] if per_item == 1 else saving[j] / item_ratio[k]
            item_saving[k][j] = saving[j]
        # Per item, sums over blocks i.. (index i), for the rows built on demand.
        self.item_load = [_suffix_sums(column) for column in item_load]
        self.item_saving = [_suffix_sums(column) for column in item_saving]
        self.remaining_full = _suffix_sums(full)
        self.total_saving = _suffix_sums(saving)
        # Block j cached last: a full block j+1 waits for j's handoff (or j's compute), then all full.
        tails = [max(c, h) + w for c, h, w in zip(cached, handoff, self.remaining_full[1:-1])] + [cached[-1]]
        self.tail = list(accumulate(reversed(tails), min))[::-1] + [0.0]
        self.rows = [None] * (n + 1)

    def row(self, i: int) -> tuple:
        """(W, tail, breakpoints of loaded + saved, of loaded, total saving) over blocks i.., built once."""
        if self.rows[i] is None:
            loaded = list(accumulate((column[i] for column in self.item_load), initial=0.0))
            saved = accumulate((column[i] for column in self.item_saving), initial=0.0)
            breakpoints = [a + b for a, b in zip(loaded, saved)]
            self.rows[i] = (self.remaining_full[i], self.tail[i], breakpoints, loaded, self.total_saving[i])
        return self.rows[i]

    def at(self, i: int, comp: float, load: float) -> float:
        return self.evaluate(self.row(i), comp, load)

    @staticmethod
    def evaluate(row: tuple, comp: float, load: float) -> float:
        remaining_full, tail, breakpoints, loaded, total_saving = row
        # The streams meet where loaded + saved = comp - (load + tail) + remaining_full.
        need = comp - load - tail + remaining_full
        if need < 0:  # loading anything at all ends after computing everything in full
            return comp + remaining_full
        k = bisect_right(breakpoints, need) - 1
        if k == len(breakpoints) - 1:  # compute-bound even with every useful block cached
            return comp + remaining_full - total_saving
        fraction = (need - breakpoints[k]) / (breakpoints[k + 1] - breakpoints[k])
        return load + tail + loaded[k] + fraction * (loaded[k + 1] - loaded[k])


def _suffix_sums(values: Sequence[float]) -> list[float]:
    """sums[i] = sum(values[i:]), with sums[len(values)] = 0."""
    return list(accumulate(reversed(values), initial=0.0))[::-1]


class _FrontierSearch:
    """The frontier DP of `optimal_plan` for one BlockCosts; run(target) is one bounded pass.

    A state is (comp, load, cached count, last block cached, mask of cached blocks); layers[i] holds the
    states before block i. Candidates are complete plans: (latency, cached count, mask, block of the lag
    cut that finished them, or N).
    """

    def __init__(self, costs: BlockCosts):
        self.n = costs.num_blocks
        blocks = list(zip(costs.full_s, costs.cached_s, costs.load_s, costs.handoffs))
        self.bound = _KnapsackBound(costs)
        self.steps = _block_steps(blocks)
        # Lag cut: every load still to come from block i (the greedy finish is built on first use).
        loads_ahead = _suffix_sums([load + handoff for _, _, load, handoff in blocks])
        self.load_ahead = [ahead + step[3] for ahead, step in zip(loads_ahead, self.steps)] + [0.0]
        self.greedy = None

    def run(self, target: float) -> tuple[float, int, int] | None:
        """The best complete plan among those not cut at `target`, or None if all were."""
        candidates = []
        layers = [[] for _ in range(self.n + 1)]
        layers[0].append((0.0, 0.0, 0, False, 0))
        for i in range(self.n):
            if layers[i]:  # runs jump over the layers inside them
                frontier, target = self._prune(i, layers[i], target, candidates)
                self._expand(i, frontier, layers)
        candidates.extend((comp, count, mask, self.n) for comp, _, count, _, mask in layers[self.n])
        if not candidates:
            return None
        limit = min(latency for latency, _, _, _ in candidates) * (1 + TIE_RTOL)
        tied = [self._fewest_cached(*candidate, limit) for candidate in candidates if candidate[0] <= limit]
        count, latency, mask = min(tied)
        return latency, count, mask

    def _fewest_cached(self, latency: float, count: int, mask: int, lag_cut_at: int,
                       limit: float) -> tuple[int, float, int]:
        """(cached count, latency, mask) of a candidate, after uncaching what the tie tolerance allows.

        Past a lag cut at block i no load can stall compute, so computing a cached block j >= i in full
        costs exactly its saving: drop the smallest savings while the plan stays within `limit`."""
        savings = sorted((self.steps[j][0] - self.steps[j][1], j) for j in range(lag_cut_at, self.n)
                         if mask >> j & 1)
        for saving, j in savings:
            if latency + saving > limit:
                break
            latency, count, mask = latency + saving, count - 1, mask & ~(1 << j)
        return count, latency, mask

    def _prune(self, i: int, states: list, target: float, candidates: list) -> tuple[list, float]:
        """The states before block i that survive the bound, lag and dominance cuts. States the lag cut
        finishes go to candidates, and the target drops to the best of them."""
        states.sort()
        row, bound = self.bound.row(i), self.bound.evaluate
        slack = 1 - TIE_RTOL
        load_ahead = self.load_ahead[i]
        frontier = []
        for state in states:
            comp, load, count, last_cached, mask = state
            if bound(row, comp, load) * slack > target:
                continue
            if comp - load >= load_ahead:
                rest_s, rest_count, rest_mask = self._greedy_finish(i)
                candidates.append((comp + rest_s, count + rest_count, mask | rest_mask, i))
                target = min(target, comp + rest_s)
                continue
            for other in frontier:  # sorted by comp: every kept state has comp <= this one's
                if other[1] <= load and other[2] <= count and (last_cached or not other[3]):
                    break
            else:
                frontier.append(state)
        return frontier, target

    def _greedy_finish(self, i: int) -> tuple[float, int, int]:
        """(seconds, cached count, mask) of blocks i.. each in its cheaper variant: the lag cut's finish."""
        if self.greedy is None:
            self.greedy = [(0.0, 0, 0)] * (self.n + 1)
            for j in range(self.n - 1, -1, -1):
                full, cached = self.steps[j][:2]
                seconds, count, mask = self.greedy[j + 1]
                take = cached < full
                self.greedy[j] = (seconds + min(full, cached), count + take, mask | take << j)
        return self.greedy[i]

    def _expand(self, i: int, frontier: list, layers: list) -> None:
        """Both choices for block i from every frontier state, into the layers they end in."""
        full, cached, loading, handoff, end, leading, leading_then_full = self.steps[i]
        rest = end - i - 1  # blocks left in the run after block i
        run_mask = (1 << end) - (1 << i)
        after = layers[i + 1]
        for comp, load, count, last_cached, mask in frontier:
            cached_load = load + loading
            cached_comp = max(cached_load, comp) + cached
            if rest == 0 or (last_cached and leading):
                after.append((cached_comp, cached_load, count + 1, True, mask | 1 << i))
            else:  # a trailing segment caches the rest of the run
                end_load = cached_load + rest * loading
                end_comp = max(cached_comp + rest * cached, end_load + cached)
                layers[end].append((end_comp, end_load, count + 1 + rest, True, mask | run_mask))
            if not last_cached:
                after.append((comp + full, load, count, False, mask))
                continue
            handed_load = load + handoff
            handed_comp = max(handed_load, comp) + full
            if leading_then_full:  # a leading segment of two or more: full blocks to the end of the run
                layers[end].append((handed_comp + rest * full, handed_load, count, False, mask))
            else:
                after.append((handed_comp, handed_load, count, False, mask))


def _block_steps(blocks: list[tuple[float, float, float, float]]) -> list[tuple]:
    """Per block, what the search needs to take it: (full, cached, load, handoff charged if the block
    before was cached, end of its run, whether a cached last block may stay cached -- a leading segment --,
    whether a leading segment this long must be followed by full blocks), after optimal_plan's patterns."""
    n = len(blocks)
    run_end = [n] * n
    for i in range(n - 2, -1, -1):
        run_end[i] = run_end[i + 1] if blocks[i] == blocks[i + 1] else i + 1
    steps, begin = [], 0
    for i, (full, cached, load, handoff) in enumerate(blocks):
        if i > 0 and blocks[i] != blocks[i - 1]:
            begin = i
        handoff_before = blocks[i - 1][3] if i > 0 else 0.0
        leading = i > begin or (i > 0 and (handoff_before > 0 or handoff > 0))  # (b)
        leading_then_full = i - begin >= 2 and cached <= full and (handoff <= load or cached <= load)  # (c)
        steps.append((full, cached, load, handoff_before, run_end[i], leading, leading_then_full))
    return steps
