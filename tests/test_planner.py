"""The block planner: the two-stream timeline, the paper's Algorithm 1 as printed, and the exact optimum
against brute force over every plan (random blocks in both regimes, runs of identical blocks, handoffs)."""

import itertools
import json
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from retouch.bench import planner as planner_bench
from retouch.planner import (BRUTE_FORCE_MAX_BLOCKS, TIE_RTOL, BlockCosts, Plan, algorithm1, brute_force,
                             optimal_plan, simulate)

SIZES = [1, 2, 3, 5, 8, 10]
REGIMES = {"compute-bound": (0.1, 1.0), "load-bound": (1.0, 5.0)}  # load per block / cached compute
INSTANCES_PER_CASE = 12


def random_costs(rng: random.Random, n: int, regime: str, handoff: bool) -> BlockCosts:
    """Heterogeneous blocks: cached compute 0.1..1 of full, loads a regime's multiple of cached compute."""
    low, high = REGIMES[regime]
    full = [rng.uniform(0.5, 1.5) for _ in range(n)]
    cached = [f * rng.uniform(0.1, 1.0) for f in full]
    load = [c * rng.uniform(low, high) for c in cached]
    return BlockCosts(full, cached, load, [l * rng.uniform(0.2, 1.0) for l in load] if handoff else None)


def runs_costs(rng: random.Random, n: int) -> BlockCosts:
    """Runs of identical blocks from up to three kinds, costs from a small set so that zeros, equal
    costs, handoffs above loads and cached slower than full all occur (the cases the run patterns test)."""
    kinds = [tuple(rng.choice([0.0, 0.5, 1.0, 2.0, rng.uniform(0, 3)]) for _ in range(4))
             for _ in range(rng.randint(1, 3))]
    blocks = []
    while len(blocks) < n:
        blocks += [rng.choice(kinds)] * rng.randint(1, 6)
    full, cached, load, handoff = zip(*blocks[:n])
    return BlockCosts(full, cached, load, handoff)


def latencies(costs: BlockCosts) -> dict[tuple[bool, ...], float]:
    return {plan: simulate(plan, costs) for plan in itertools.product((False, True), repeat=costs.num_blocks)}


def assert_optimal(costs: BlockCosts) -> None:
    """optimal_plan matches brute force: latency, cached count (the tie rule), and the plan where unique."""
    best, plan = brute_force(costs), optimal_plan(costs)
    assert plan.latency_s == simulate(plan.use_cache, costs)
    assert plan.latency_s == pytest.approx(best.latency_s, rel=TIE_RTOL, abs=1e-300)
    assert plan.num_cached == best.num_cached
    if costs.num_blocks <= 8:
        near = [p for p, latency in latencies(costs).items() if latency <= best.latency_s * (1 + 1e-9)]
        if len(near) == 1:
            assert plan.use_cache == best.use_cache == near[0]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("handoff", [False, True])
def test_optimal_matches_brute_force(n, regime, handoff):
    rng = random.Random(f"{n}-{regime}-{handoff}")
    for _ in range(INSTANCES_PER_CASE):
        assert_optimal(random_costs(rng, n, regime, handoff))


@pytest.mark.parametrize("n", SIZES + [12])
def test_optimal_matches_brute_force_on_runs_of_identical_blocks(n):
    rng = random.Random(n)
    for _ in range(4 * INSTANCES_PER_CASE):
        assert_optimal(runs_costs(rng, n))


any_block = st.tuples(*[st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5, 3.0]) | st.floats(0, 4)] * 4)


@settings(max_examples=300, deadline=None)
@given(st.lists(any_block, min_size=1, max_size=9), st.booleans())
@example([(5e-324, 0.0, 2.1, 0.5)], False)  # a subnormal ceiling: its search gap underflowed to 0 (a hang)
def test_optimal_is_exact_on_any_blocks(blocks, repeat_blocks):
    if repeat_blocks:  # runs of identical blocks take the pattern shortcuts
        blocks = [b for b in blocks for _ in range(2)][:12]
    full, cached, load, handoff = zip(*blocks)
    assert_optimal(BlockCosts(full, cached, load, handoff))


def frontier_reference(costs: BlockCosts) -> float:
    """The plain frontier DP with none of optimal_plan's cuts: per flag (last block cached), the
    (load, comp) pairs no other pair beats in both."""
    handoff = costs.handoffs
    frontier = {False: [(0.0, 0.0)], True: []}
    for i in range(costs.num_blocks):
        successors = {False: [], True: []}
        for last_cached, states in frontier.items():
            for load, comp in states:
                cached_load = load + costs.load_s[i]
                successors[True].append((cached_load, max(cached_load, comp) + costs.cached_s[i]))
                full_load = load + handoff[i - 1] if last_cached else load
                successors[False].append((full_load, max(full_load, comp) + costs.full_s[i]))
        frontier = {flag: pareto(states) for flag, states in successors.items()}
    return min(comp for states in frontier.values() for _, comp in states)


def pareto(states: list[tuple[float, float]]) -> list[tuple[float, float]]:
    kept = []
    for load, comp in sorted(states):
        if not kept or comp < kept[-1][1]:
            kept.append((load, comp))
    return kept


@pytest.mark.parametrize("mode", ["y", "kv"])
def test_optimal_at_flux_size_matches_the_plain_frontier_dp(mode):
    """57 blocks (19 double + 38 single), too many to enumerate: costs per kind, as a cost model gives
    them, with the last block's handoff folded into its load in KV-cache mode."""
    rng = random.Random(mode)
    for _ in range(6):
        kinds = []
        for count in (19, 38):
            full = rng.uniform(0.5, 1.5)
            cached = full * rng.uniform(0.1, 1.0)
            load = cached * rng.uniform(0.1, 5.0)
            kinds += [(full, cached, load, load / 2 if mode == "kv" else 0.0)] * count
        full, cached, load, handoff = map(list, zip(*kinds))
        load[-1], handoff[-1] = load[-1] + handoff[-1], 0.0
        costs = BlockCosts(full, cached, load, handoff if mode == "kv" else None)
        assert optimal_plan(costs).latency_s == pytest.approx(frontier_reference(costs), rel=TIE_RTOL)


def test_simulate_by_hand():
    costs = BlockCosts(full_s=(1.0, 1.0, 1.0), cached_s=(0.5, 0.5, 0.25), load_s=(2.0, 0.0, 1.0),
                       handoff_s=(1.0, 0.0, 0.0))
    assert simulate((False, False, False), costs) == 3.0
    # Block 0 waits 2 s for its load; block 1 (full) then waits for block 0's handoff (load stream at 3 s).
    assert simulate((True, False, False), costs) == 5.0
    # Block 2's load queues behind block 0's load and handoff: it ends at 4 s, with block 1's compute.
    assert simulate((True, False, True), costs) == 4.25
    assert simulate((False, True, True), costs) == pytest.approx(1.0 + 0.5 + 0.25)
    with pytest.raises(ValueError, match="3 blocks"):
        simulate((True,), costs)


# A first block that caching makes barely faster and a second one it makes much faster, whose load
# then queues behind the first's: the greedy caches the first and cannot afford the second.
GREEDY_TRAP = BlockCosts(full_s=(1.0, 1.0, 1.0), cached_s=(0.375, 0.125, 0.5), load_s=(0.5, 1.5, 0.25))


def test_algorithm1_follows_the_printed_recurrence():
    greedy = algorithm1(GREEDY_TRAP)
    # comp: max(0.5, 0) + 0.375 = 0.875 < 1 -> cache; max(2.0, 0.875) + 0.125 = 2.125 > 1.875 -> full;
    # max(0.75, 1.875) + 0.5 = 2.375 <= 2.875 -> cache.
    assert greedy == Plan((True, False, True), 2.375)
    best = optimal_plan(GREEDY_TRAP)
    assert best == brute_force(GREEDY_TRAP) == Plan((False, True, True), 2.25)  # 1, 1.625, then 1.75 + 0.5
    compute_bound = BlockCosts(full_s=(1.0,) * 3, cached_s=(0.5,) * 3, load_s=(0.25,) * 3)
    assert algorithm1(compute_bound) == optimal_plan(compute_bound) == Plan((True,) * 3, 1.75)


def test_algorithm1_ignores_handoffs_and_takes_ties_to_the_cache():
    costs = BlockCosts(full_s=(1.0, 1.0), cached_s=(0.5, 1.0), load_s=(0.25, 0.0), handoff_s=(2.0, 0.0))
    greedy = algorithm1(costs)
    assert greedy.use_cache == (True, True)  # block 1: cached 1.0 <= full 1.0, printed "<=" caches
    assert greedy.latency_s == simulate(greedy.use_cache, costs) == 1.75
    costs = BlockCosts(full_s=(1.0, 1.0), cached_s=(0.5, 1.5), load_s=(0.25, 0.0), handoff_s=(2.0, 0.0))
    greedy = algorithm1(costs)
    assert greedy.use_cache == (True, False)
    assert greedy.latency_s == 1.75  # its comp_N as printed, without the handoff
    assert simulate(greedy.use_cache, costs) == 3.25  # block 1 waits for block 0's 2 s handoff
    assert optimal_plan(costs) == Plan((False, False), 2.0)


def test_all_cached_and_none_cached():
    free_loads = BlockCosts(full_s=(1.0, 2.0, 1.0), cached_s=(0.25, 0.5, 0.25), load_s=(0.0, 0.0, 0.0))
    for planner in (optimal_plan, brute_force, algorithm1):
        assert planner(free_loads) == Plan((True, True, True), 1.0)
    no_gain = BlockCosts(full_s=(1.0, 2.0, 1.0), cached_s=(1.0, 2.5, 1.0), load_s=(0.0, 0.5, 0.0))
    for planner in (optimal_plan, brute_force):
        assert planner(no_gain) == Plan((False, False, False), 4.0)
    slow_loads = BlockCosts(full_s=(1.0,) * 4, cached_s=(0.5,) * 4, load_s=(10.0,) * 4)
    assert optimal_plan(slow_loads) == Plan((False,) * 4, 4.0)
    no_blocks = BlockCosts((), (), ())
    assert optimal_plan(no_blocks) == algorithm1(no_blocks) == brute_force(no_blocks) == Plan((), 0.0)


def test_ties_prefer_fewer_cached_blocks():
    # Cached as slow as full and every load hidden: all eight plans take 3 s.
    costs = BlockCosts(full_s=(1.0, 1.0, 1.0), cached_s=(1.0, 1.0, 1.0), load_s=(0.0, 0.5, 0.5))
    assert set(latencies(costs).values()) == {3.0}
    assert optimal_plan(costs) == brute_force(costs) == Plan((False, False, False), 3.0)
    assert algorithm1(costs).use_cache == (True, True, True)  # the printed "<=" caches on ties
    # (F, T) and (T, T) both take 2.5 s: block 1's load hides behind block 0 either way.
    costs = BlockCosts(full_s=(2.0, 1.0), cached_s=(1.0, 0.5), load_s=(1.0, 0.5))
    assert latencies(costs) == {(False, False): 3.0, (True, False): 3.0, (False, True): 2.5, (True, True): 2.5}
    assert optimal_plan(costs) == brute_force(costs) == Plan((False, True), 2.5)


def test_block_costs_are_checked():
    with pytest.raises(ValueError, match="load_s has 2 entries, full_s has 3"):
        BlockCosts((1.0, 1.0, 1.0), (0.5, 0.5, 0.5), (0.1, 0.1))
    with pytest.raises(ValueError, match="handoff_s has 1 entries"):
        BlockCosts((1.0, 1.0), (0.5, 0.5), (0.1, 0.1), (0.0,))
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="cached_s must be finite and >= 0"):
            BlockCosts((1.0,), (bad,), (0.1,))
    costs = BlockCosts([1, 2], [0.5, 1], [0, 1])
    assert costs.full_s == (1.0, 2.0) and isinstance(costs.load_s, tuple)
    assert costs.handoff_s is None and costs.handoffs == (0.0, 0.0)
    with pytest.raises(ValueError, match=f"at most {BRUTE_FORCE_MAX_BLOCKS}"):
        brute_force(BlockCosts(*[(1.0,) * (BRUTE_FORCE_MAX_BLOCKS + 1)] * 3))


def test_bench_prints_the_promised_report(tmp_path, capsys):
    args = ["--instances", "12", "--blocks", "6", "--timing-instances", "2", "--seed", "3"]
    report = planner_bench.main(args + ["--out", str(tmp_path / "planner.json")])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == json.loads((tmp_path / "planner.json").read_text()) == report
    assert (tmp_path / "planner.png").stat().st_size > 0
    assert report["exact_matches_bruteforce"] is True and report["fewest_cached_matches_bruteforce"] == 12
    assert 0 <= report["algo1_matches_bruteforce"] <= 12 and report["algo1_max_gap"] >= 0
    assert sum(group["instances"] for group in report["groups"].values()) == 12
    assert report["plan_us_57_blocks"] > 0 and report["plan_us_57_blocks_algo1"] > 0
    timings = {"plan_us_blocks", "plan_us_57_blocks", "plan_us_57_blocks_p90", "plan_us_57_blocks_algo1", "command"}
    again = planner_bench.main(args)
    assert {k: v for k, v in again.items() if k not in timings} == {k: v for k, v in report.items() if k not in timings}
