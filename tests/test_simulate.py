"""`retouch simulate`: determinism, completeness, paired workloads, and policies that must tie or differ."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from retouch.engine import simulate
from retouch.engine.policies import POLICIES, RequestLoad, make_policy
from retouch.engine.reference_costs import IMAGE_TOKENS, TEXT_TOKENS, h800_flux
from retouch.engine.step_cost import StepCost
from retouch.errors import RetouchError

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "cpu"
SMALL = ["--workers", "4", "--rps", "2", "--requests", "120", "--steps", "10"]


@pytest.fixture(scope="module")
def cost():
    return StepCost(h800_flux())


def run(policy: str, cost: StepCost, workload: simulate.Workload, workers: int, max_batch: int = 8) -> np.ndarray:
    return simulate.SimulatedCluster(make_policy(policy, cost), cost, workload, workers, max_batch).run()


def test_same_seed_same_result_and_every_request_completes(capsys):
    first, second = simulate.main(SMALL), simulate.main(SMALL)
    printed = capsys.readouterr().out.strip().splitlines()
    assert json.loads(printed[0])["policies"].keys() == set(POLICIES)
    for name in POLICIES:
        for key in ("p50_s", "p95_s", "p99_s", "mean_s"):
            assert first["policies"][name][key] == second["policies"][name][key]
        assert first["policies"][name]["p95_s"] >= first["policies"][name]["p50_s"] > 0
    assert first["requests"] == 120 and first["cost_model"] == "built-in" and first["wall_s"] > 0
    different = simulate.main(SMALL + ["--seed", "1"])
    assert different["policies"]["mask-aware"]["mean_s"] != first["policies"]["mask-aware"]["mean_s"]


@pytest.mark.parametrize("workers", [1, 3])
def test_every_request_finishes_no_sooner_than_running_alone(cost, workers):
    workload = simulate.make_workload(200, 3.0, "public", IMAGE_TOKENS, TEXT_TOKENS, 12, seed=0)
    for policy in POLICIES:
        latency = run(policy, cost, workload, workers, max_batch=4)
        alone = [12 * float(cost.latency(cost.request_features(x.image_tokens, x.masked_tokens, x.text_tokens)))
                 for x in workload.loads]
        assert np.isfinite(latency).all()
        assert (latency >= np.array(alone) * (1 - 1e-12)).all()


def test_one_worker_makes_every_policy_the_same(cost):
    workload = simulate.make_workload(150, 0.5, "public", IMAGE_TOKENS, TEXT_TOKENS, 28, seed=3)
    latencies = [run(policy, cost, workload, workers=1) for policy in POLICIES]
    for latency in latencies[1:]:
        assert np.array_equal(latency, latencies[0])


def test_mask_aware_beats_round_robin_on_alternating_masks(cost):
    # Large and tiny masks in turn: round-robin sends every large one to worker 0 and every tiny one to
    # worker 1; mask-aware pairs them, so each batch's loads hide behind the other request's compute.
    loads = tuple(RequestLoad(IMAGE_TOKENS, 3900 if i % 2 == 0 else 40, 28, TEXT_TOKENS) for i in range(24))
    workload = simulate.Workload(np.arange(24) * 1.5, loads)
    mask_aware, round_robin = run("mask-aware", cost, workload, 2), run("round-robin", cost, workload, 2)
    assert np.percentile(mask_aware, 95) < np.percentile(round_robin, 95)
    assert mask_aware.mean() < round_robin.mean()


def test_a_request_joins_a_running_batch_at_the_next_step(cost):
    step = float(cost.latency(cost.request_features(IMAGE_TOKENS, 400, TEXT_TOKENS)))
    loads = (RequestLoad(IMAGE_TOKENS, 400, 10, TEXT_TOKENS), RequestLoad(IMAGE_TOKENS, 400, 2, TEXT_TOKENS))
    workload = simulate.Workload(np.array([0.0, 2.5 * step]), loads)
    latency = run("round-robin", cost, workload, workers=1)
    pair = float(cost.latency(2 * cost.request_features(IMAGE_TOKENS, 400, TEXT_TOKENS)))
    # It waits for the third step to end, then runs two steps batched.
    assert latency[1] == pytest.approx(3 * step - 2.5 * step + 2 * pair, rel=1e-12)
    assert latency[0] == pytest.approx(5 * step + 2 * pair + 3 * step, rel=1e-12)


@pytest.mark.parametrize("mask_dist, mean", [("public", 0.19), ("production", 0.11)])
def test_mask_distributions_have_the_papers_means(mask_dist, mean):
    workload = simulate.make_workload(20000, 1.0, mask_dist, 4096, 0, 28, seed=0)
    ratios = np.array([x.masked_tokens for x in workload.loads]) / 4096
    assert ratios.mean() == pytest.approx(mean, abs=0.005)
    arrivals = np.diff(workload.arrivals)
    assert (arrivals > 0).all() and arrivals.mean() == pytest.approx(1.0, rel=0.05)


def test_main_with_a_fitted_cost_model_writes_json_and_png(tmp_path):
    out = tmp_path / "sim.json"
    report = simulate.main(["--cost-model", str(RESULTS / "cost_tiny_flux_fill.json"), "--policies",
                            "least-requests,mask-aware", "--workers", "2", "--rps", "20", "--requests", "50",
                            "--mask-dist", "production", "--out", str(out)])
    assert set(report["policies"]) == {"least-requests", "mask-aware"}
    assert report["image_tokens"] == 32 * 32 and report["mask_dist"] == "production"
    assert json.loads(out.read_text())["policies"] == report["policies"]
    pytest.importorskip("matplotlib")
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.parametrize("argv, named", [(["--policies", "random"], "--policies"), (["--rps", "0"], "--rps"),
                                         (["--rps", "nan"], "--rps"), (["--slo-scale", "inf"], "--slo-scale"),
                                         (["--workers", "0"], "--workers"), (["--loras", "-1"], "--loras"),
                                         (["--workers", "100000000"], "--workers"),  # 23 GB, then a timeout
                                         (["--requests", "100000000000"], "--requests"),
                                         (["--image-tokens", "-4"], "--image-tokens"),
                                         (["--text-tokens", "-1"], "--text-tokens"),
                                         (["--loras", "5", "--lora-cache", "0"], "--lora-cache"),
                                         (["--loras", "5", "--find-load"], "--find-load"),
                                         (["--templates", "5", "--template-cache", "0"], "--template-cache"),
                                         (["--templates", "5", "--loras", "5"], "--loras"),
                                         # knobs of runs nobody asked for: they were ignored, silently
                                         (["--template-cache", "4"], "--template-cache needs --templates"),
                                         (["--template-affinity=-1"], "--template-affinity needs --templates"),
                                         (["--lora-zipf", "1.2", "--lora-affinity", "2"],
                                          "--lora-zipf, --lora-affinity need --loras")])
def test_bad_options_are_refused_in_one_line(argv, named, capsys):
    with pytest.raises(SystemExit) as exited:
        simulate.main(argv)
    error = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and named in error
    assert len(error.splitlines()) == 1 and "usage" not in error  # not argparse's whole usage block


def test_a_cost_model_that_predicts_free_steps_is_refused_before_simulating(tmp_path, capsys):
    """A fit of a model too small to time can extrapolate below zero: steps that take no time would stop the
    simulated clock."""
    model = h800_flux()
    free = {kind: {variant: replace(fit, coef=tuple(0.0 for _ in fit.coef), intercept=-1.0)
                   for variant, fit in fits.items()} for kind, fits in model.compute.items()}
    path = tmp_path / "free.json"
    replace(model, compute=free, load=replace(model.load, intercept=-1.0)).to_json(path)
    with pytest.raises(SystemExit) as exited:
        simulate.main(["--cost-model", str(path), "--image-tokens", "64", "--requests", "10"])
    assert exited.value.code == 2 and "step of 0 s" in capsys.readouterr().err
    with pytest.raises(RetouchError, match="cannot read the cost model"):
        simulate.main(["--cost-model", str(tmp_path / "missing.json")])


def test_least_work_cuts_p95_where_least_requests_stacks_large_edits(cost):
    # A burst of large and small edits in turn on 2 workers: least-requests' ties take turns, so every
    # large edit lands on worker 0; least-work splits them, and the large edits' p95 falls by > 30%.
    small = 512 ** 2 // 256
    loads = tuple(RequestLoad(IMAGE_TOKENS, 3700, 28, TEXT_TOKENS) if i % 2 == 0 else
                  RequestLoad(small, 10, 28, TEXT_TOKENS) for i in range(8))
    workload = simulate.Workload(np.arange(8) * 1e-3, loads)
    least_work, least_requests = run("least-work", cost, workload, 2), run("least-requests", cost, workload, 2)
    assert np.percentile(least_work, 95) <= 0.7 * np.percentile(least_requests, 95)
    # Steps linear in the batch's work: moving work between workers moves latency, the sum stays.
    assert least_work.mean() == pytest.approx(least_requests.mean(), rel=1e-6)


def test_slo_attainment_on_a_hand_made_case():
    loads = (RequestLoad(16, 4, 2, deadline=3.0), RequestLoad(16, 4, 2, deadline=2.0),
             RequestLoad(16, 4, 2), RequestLoad(16, 4, 2, deadline=10.0))
    workload = simulate.Workload(np.array([0.0, 1.0, 1.5, 2.0]), loads)
    # Answered at 3.0 (on time, exactly), 2.5 (late), no deadline, 10.5 (late): 1 of the 3 with one.
    assert simulate.slo_attainment(np.array([3.0, 1.5, 99.0, 8.5]), workload) == pytest.approx(1 / 3)
    untimed = simulate.Workload(workload.arrivals, tuple(replace(x, deadline=None) for x in loads))
    assert simulate.slo_attainment(np.ones(4), untimed) is None


def test_deadlines_are_a_multiple_of_the_unloaded_latency(cost):
    workload = simulate.make_workload(50, 2.0, "public", IMAGE_TOKENS, TEXT_TOKENS, 28, seed=0, resolutions="uniform")
    timed = simulate.with_deadlines(workload, cost, 3.0)
    alone = simulate.alone_seconds(cost, workload.loads)
    deadlines = np.array([x.deadline for x in timed.loads])
    assert np.allclose(deadlines, workload.arrivals + 3.0 * alone, rtol=1e-12)
    assert [replace(x, deadline=None) for x in timed.loads] == list(workload.loads)


@pytest.mark.parametrize("mix", ["uniform", "low", "high"])
def test_mixed_resolutions_follow_patchedserve_shares(mix):
    workload = simulate.make_workload(6000, 1.0, "production", IMAGE_TOKENS, 0, 28, seed=0, resolutions=mix)
    grids = np.array([x.image_tokens for x in workload.loads])
    sides = {1024: 512, 2304: 768, 4096: 1024}
    assert set(grids.tolist()) == set(sides)
    shares = [np.mean(grids == grid) for grid in sides]
    assert shares == pytest.approx(simulate.RESOLUTION_MIX[mix], abs=0.02)
    assert all(1 <= x.masked_tokens <= x.image_tokens for x in workload.loads)


def test_find_load_stops_at_twice_the_unloaded_p95_and_writes_json_and_png(tmp_path):
    out = tmp_path / "loads.json"
    report = simulate.main(["--find-load", "--mask-dists", "production", "--worker-counts", "2", "--requests", "150",
                            "--steps", "8", "--rate-step", "0.5", "--resolutions", "uniform", "--out", str(out)])
    (found,) = report["configurations"]
    best = found["policies"][found["best_baseline"]]["p95_s"]
    assert best >= 2 * found["unloaded_p95_s"]
    assert best == min(found["policies"][name]["p95_s"] for name in simulate.BASELINES)
    assert set(found["policies"]) == set(POLICIES)
    assert found["p95_cut_vs_best_baseline"] == pytest.approx(
        1 - found["policies"][found["best_policy"]]["p95_s"] / best)
    assert all(0 <= summary["slo_attainment"] <= 1 for summary in found["policies"].values())
    assert json.loads(out.read_text())["configurations"] == report["configurations"]
    pytest.importorskip("matplotlib")
    assert out.with_suffix(".png").stat().st_size > 0


def test_lora_affinity_holds_more_adapters_and_a_miss_costs_its_request_the_read(cost):
    """Hit rates of the same Zipf requests with and without affinity, and what a miss adds: one worker that
    holds one adapter misses exactly at every change of adapter, each miss adding miss_s to its request and a
    hit during that read what is left of it."""
    workload = simulate.make_workload(600, 8.0, "public", IMAGE_TOKENS, TEXT_TOKENS, 10, seed=0)
    adapters = simulate.zipf_keys(600, 300, 1.0, seed=0)
    assert np.bincount(adapters, minlength=300)[0] > np.bincount(adapters, minlength=300)[100:].mean() * 10
    hits = {}
    for affinity in (None, 0, 1):
        loras = simulate.KeyedCache(adapters, cache=8, miss_s=0.5, affinity=affinity)
        cluster = simulate.SimulatedCluster(make_policy("least-requests", cost), cost, workload, 8, 8, loras)
        cluster.run()
        hits[affinity] = cluster.hits
    assert hits[None] < hits[0] < hits[1]

    alternating = np.array([0, 0, 1, 1, 1, 0])
    arrivals = np.array([0.0, 0.2, 1.0, 1.1, 2.0, 3.0])  # requests 1 and 3 come while their adapter is read
    small = simulate.Workload(arrivals, workload.loads[:6])
    plain = run("round-robin", cost, small, workers=1)
    cluster = simulate.SimulatedCluster(make_policy("round-robin", cost), cost, small, 1, 8,
                                        simulate.KeyedCache(alternating, cache=1, miss_s=0.5))
    waited = cluster.run() - plain
    assert cluster.hits == 3 and np.allclose(waited, [0.5, 0.3, 0.5, 0.4, 0, 0.5])


def test_main_with_loras_runs_each_policy_with_and_without_affinity():
    report = simulate.main(SMALL + ["--policies", "least-requests,mask-aware", "--loras", "50", "--lora-cache", "4"])
    assert list(report["policies"]) == ["least-requests", "least-requests+lora-affinity", "mask-aware",
                                        "mask-aware+lora-affinity"]
    assert report["loras"] == {"adapters": 50, "zipf": 1.0, "cache": 4, "miss_s": 0.5, "affinity": 0}
    for summary in report["policies"].values():
        assert 0 <= summary["lora_hit_rate"] <= 1


def test_main_with_templates_runs_each_policy_with_and_without_template_affinity():
    """Templates in host memory are the same kind of cache as adapters: affinity raises their hit rate."""
    report = simulate.main(SMALL + ["--policies", "least-requests", "--templates", "40", "--template-cache", "2"])
    assert list(report["policies"]) == ["least-requests", "least-requests+template-affinity"]
    assert report["templates"] == {"templates": 40, "zipf": 1.0, "cache": 2, "miss_s": 6.0, "affinity": 0,
                                   "replicas": 0}
    assert report["loras"] is None
    rates = [summary["template_hit_rate"] for summary in report["policies"].values()]
    assert 0 <= rates[0] < rates[1] <= 1


def test_template_replicas_send_a_templates_edits_to_its_replicas_only(cost):
    """--template-replicas K: a template's edits go to its K workers (spread evenly by template), so each
    worker sees fewer templates and holds more of them; one worker per template never misses after its
    first edit when its cache holds all of its templates."""
    keyed = simulate.KeyedCache(np.arange(8) % 4, cache=1, miss_s=0.5, affinity=None, replicas=1)
    assert [int(np.flatnonzero(keyed.eligible(key, 4))[0]) for key in range(4)] == [0, 1, 2, 3]
    assert simulate.KeyedCache(np.zeros(1), 1, 0.5, replicas=0).eligible(0, 4) is None
    assert simulate.KeyedCache(np.zeros(1), 1, 0.5, replicas=2).eligible(3, 4).tolist() == [False, False, True,
                                                                                             True]
    workload = simulate.make_workload(8, 2.0, "public", IMAGE_TOKENS, TEXT_TOKENS, 10, seed=0)
    cluster = simulate.SimulatedCluster(make_policy("least-requests", cost), cost, workload, 4, 8, keyed)
    cluster.run()
    assert cluster.hits == 4  # the first edit of each template misses, the second finds it
    assert [list(worker.held) for worker in cluster.workers] == [[0], [1], [2], [3]]


def test_growing_replicas_spread_a_popular_templates_edits(cost):
    """One template, one replica, four workers: fixed, every edit queues on that one; growing (the router's
    default), the others record it as the edits pile up there, and the latencies fall."""
    workload = simulate.make_workload(40, 8.0, "public", IMAGE_TOKENS, TEXT_TOKENS, 10, seed=0)
    latencies, clusters = {}, {}
    for grow in (False, True):
        keyed = simulate.KeyedCache(np.zeros(40, dtype=int), cache=2, miss_s=0.5, replicas=1, grow=grow)
        clusters[grow] = simulate.SimulatedCluster(make_policy("least-requests", cost), cost, workload, 4, 8, keyed)
        latencies[grow] = clusters[grow].run()
    assert clusters[False].replicas_added == 0 and 1 <= clusters[True].replicas_added <= 3
    assert sum(bool(worker.held) for worker in clusters[True].workers) == 1 + clusters[True].replicas_added
    assert np.percentile(latencies[True], 95) < np.percentile(latencies[False], 95)


def test_main_with_template_replicas_adds_the_growing_replicas_run():
    report = simulate.main(SMALL + ["--policies", "least-requests", "--templates", "10", "--template-replicas", "1"])
    assert list(report["policies"]) == ["least-requests", "least-requests+template-affinity",
                                        "least-requests+template-affinity+growing-replicas"]
    assert report["policies"]["least-requests+template-affinity+growing-replicas"]["replicas_added"] >= 1
