"""Routing policies on hand-built clusters, and the ClusterLoad bookkeeping they read."""

import numpy as np
import pytest

from retouch.costs import RequestTokens
from retouch.engine.policies import POLICIES, ClusterLoad, NoWorker, RequestLoad, make_policy
from retouch.engine.reference_costs import IMAGE_TOKENS, TEXT_TOKENS, h800_flux
from retouch.engine.step_cost import StepCost
from retouch.planner import optimal_plan

MODEL = h800_flux()
STEPS = 28


@pytest.fixture(scope="module")
def cost():
    return StepCost(MODEL)


def edit(masked: int, steps: int = STEPS) -> RequestLoad:
    return RequestLoad(IMAGE_TOKENS, masked, steps, TEXT_TOKENS)


def cluster_of(cost, *batches, max_batch: int = 8) -> ClusterLoad:
    """A cluster with one worker per entry of `batches`: the masked tokens of its running requests."""
    cluster = ClusterLoad(cost)
    request_id = 0
    for masks in batches:
        slot = cluster.add_worker(max_batch)
        for masked in masks:
            cluster.assign(slot, request_id, edit(masked))
            cluster.admit(slot, request_id)
            request_id += 1
    return cluster


def planner_step_seconds(masks: list[int]) -> float:
    """The oracle: the planner's optimal plan of the batch, from the CostModel itself."""
    rows = [{kind: RequestTokens(TEXT_TOKENS, IMAGE_TOKENS, masked) for kind in MODEL.block_kinds} for masked in masks]
    return optimal_plan(MODEL.block_costs(rows, "y")).latency_s


def test_request_load_is_validated():
    with pytest.raises(ValueError, match="masked_tokens"):
        RequestLoad(100, 101, 28)
    with pytest.raises(ValueError, match="steps"):
        RequestLoad(100, 10, 0)


def test_cluster_load_bookkeeping(cost):
    cluster = ClusterLoad(cost)
    assert [cluster.add_worker(4), cluster.add_worker(8)] == [0, 1]
    features = cost.request_features(IMAGE_TOKENS, 300, TEXT_TOKENS)
    cluster.assign(1, 7, edit(300))
    cluster.assign(1, 8, edit(50))
    assert cluster.queued.tolist() == [0, 2] and cluster.running.tolist() == [0, 0]
    assert cluster.masked_tokens.tolist() == [0, 350]
    assert cluster.in_flight.tolist() == [0, 2]
    cluster.admit(1, 7)
    cluster.admit(1, 7)  # heartbeats repeat it: nothing changes
    assert cluster.running.tolist() == [0, 1] and cluster.queued.tolist() == [0, 1]
    assert np.array_equal(cluster.running_features[1], features)
    assert np.array_equal(cluster.inflight_features[1],
                          features + cost.request_features(IMAGE_TOKENS, 50, TEXT_TOKENS))
    cluster.advance(1, 7, 20)
    assert cluster.steps_left(1, running=True) == [20] and cluster.steps_left(1, running=False) == [STEPS]
    cluster.finish(1, 7)
    cluster.finish(1, 8)
    assert cluster.in_flight.tolist() == [0, 0] and cluster.masked_tokens.tolist() == [0, 0]
    assert not cluster.inflight_features.any() and not cluster.running_features.any()
    with pytest.raises(KeyError, match="request 7"):
        cluster.finish(1, 7)
    with pytest.raises(IndexError, match="slot 5"):
        cluster.assign(5, 9, edit(1))

    cluster.assign(0, 9, edit(10))
    with pytest.raises(ValueError, match="already at slot 0"):
        cluster.assign(1, 9, edit(10))
    cluster.admit(0, 9)
    cluster.remove_worker(0)
    assert cluster.alive.tolist() == [False, True]
    assert cluster.in_flight.tolist() == [0, 0] and not cluster.inflight_features.any()
    cluster.finish(0, 9)  # forgotten with its worker: re-routing may still say so
    with pytest.raises(ValueError, match="dead"):
        cluster.assign(0, 10, edit(10))
    assert cluster.add_worker(2) == 2  # slots are not reused


def test_cluster_grows_past_its_first_capacity():
    cluster = ClusterLoad()
    slots = [cluster.add_worker(1) for _ in range(20)]
    cluster.assign(19, 0, edit(5))
    assert slots == list(range(20)) and cluster.in_flight[19] == 1 and cluster.alive.all()


def test_round_robin_cycles_and_skips_dead_and_ineligible():
    cluster = cluster_of(None, [], [], [], [])
    policy = make_policy("round-robin")
    assert [policy.choose(edit(10), cluster) for _ in range(5)] == [0, 1, 2, 3, 0]
    cluster.remove_worker(2)
    assert [policy.choose(edit(10), cluster) for _ in range(3)] == [1, 3, 0]
    eligible = np.array([True, False, True, True])
    assert [policy.choose(edit(10), cluster, eligible) for _ in range(3)] == [3, 0, 3]


def test_least_requests_and_least_tokens_pick_the_minimum(cost):
    cluster = cluster_of(cost, [900], [5, 5], [2000, 30, 30])
    assert make_policy("least-requests").choose(edit(10), cluster) == 0
    assert make_policy("least-tokens").choose(edit(10), cluster) == 1
    # Queued requests count too.
    cluster.assign(0, 100, edit(20))
    cluster.assign(0, 101, edit(20))
    assert make_policy("least-requests").choose(edit(10), cluster) == 1
    cluster.assign(1, 102, edit(2000))
    assert make_policy("least-tokens").choose(edit(10), cluster) == 0


def test_ties_take_turns():
    cluster = cluster_of(None, [], [5], [], [])
    policy = make_policy("least-requests")
    assert [policy.choose(edit(10), cluster) for _ in range(4)] == [0, 2, 3, 0]


@pytest.mark.parametrize("batches, cheaper", [
    # One large mask against two tiny ones: the tiny ones' batch is cheaper (fewer tokens to compute,
    # its loads hidden behind the compute) though it has more requests (least-requests picks slot 0).
    (([3700], [40, 40]), 1),
    # One medium mask against three small ones: fewer masked tokens on slot 1 (least-tokens picks it),
    # but three more rows of attention and cache loading make its batch dearer.
    (([600], [100, 100, 100]), 0)])
@pytest.mark.parametrize("new_mask", [40, 400, 2000])
def test_mask_aware_picks_the_cheaper_batch_with_the_request(cost, batches, cheaper, new_mask):
    cluster = cluster_of(cost, *batches)
    seconds = [planner_step_seconds(list(masks) + [new_mask]) for masks in batches]
    assert int(np.argmin(seconds)) == cheaper
    assert make_policy("mask-aware", cost).choose(edit(new_mask), cluster) == cheaper
    baseline = "least-requests" if cheaper == 1 else "least-tokens"
    assert make_policy(baseline).choose(edit(new_mask), cluster) != cheaper


def test_mask_aware_prefers_workers_with_slack(cost):
    cluster = cluster_of(cost, [10, 10], [3000], max_batch=2)  # slot 0 is full, however cheap
    assert make_policy("mask-aware", cost).choose(edit(10), cluster) == 1


def test_mask_aware_without_slack_goes_where_the_request_finishes_first(cost):
    cluster = cluster_of(cost, [100, 100], [100, 100], max_batch=2)
    for request_id, steps_left in enumerate([20, 25, 1, 27]):
        cluster.advance(request_id // 2, request_id, steps_left)
    assert make_policy("mask-aware", cost).choose(edit(100), cluster) == 1  # a slot frees after 1 step
    cluster.assign(1, 50, edit(100))  # now a request queues there first: it takes that slot
    assert make_policy("mask-aware", cost).choose(edit(100), cluster) == 0


@pytest.mark.parametrize("name", POLICIES)
def test_no_worker_is_a_clear_error_and_eligible_is_honoured(cost, name):
    policy = make_policy(name, cost)
    with pytest.raises(NoWorker, match="no alive worker"):
        policy.choose(edit(10), ClusterLoad(cost))
    cluster = cluster_of(cost, [5], [], [])
    cluster.remove_worker(1)
    eligible = np.array([True, True, False])
    assert {policy.choose(edit(10), cluster, eligible) for _ in range(3)} == {0}
    with pytest.raises(NoWorker, match="eligible"):
        policy.choose(edit(10), cluster, np.array([False, True, False]))
    with pytest.raises(ValueError, match="shape"):
        policy.choose(edit(10), cluster, np.array([True]))


def test_make_policy_names_the_choices(cost):
    assert [make_policy(name, cost).name for name in POLICIES] == list(POLICIES)
    with pytest.raises(ValueError, match="round-robin, least-requests, least-tokens, mask-aware"):
        make_policy("random")


def test_mask_aware_needs_the_clusters_step_cost(cost):
    with pytest.raises(ValueError, match="StepCost"):
        make_policy("mask-aware").choose(edit(10), cluster_of(None, []))
    with pytest.raises(ValueError, match="share one StepCost"):
        make_policy("mask-aware", StepCost(MODEL)).choose(edit(10), cluster_of(cost, []))
    assert make_policy("mask-aware").choose(edit(10), cluster_of(cost, [])) == 0


def test_marginal_seconds_is_what_a_request_adds_to_a_compute_bound_batch(cost):
    light, heavy = (cost.request_features(IMAGE_TOKENS, masked, TEXT_TOKENS) for masked in (400, 2000))
    added = cost.marginal_seconds(IMAGE_TOKENS, 2000, TEXT_TOKENS)
    assert added == pytest.approx(float(cost.latency(2 * heavy) - cost.latency(heavy)), rel=1e-12)
    assert float(cost.latency(light + heavy)) == pytest.approx(float(cost.latency(light)) + added, rel=1e-9)
    assert 0 < cost.marginal_seconds(IMAGE_TOKENS, 400, TEXT_TOKENS) < added < float(cost.latency(heavy))


def test_remaining_work_follows_steps_left(cost):
    cluster = cluster_of(cost, [300, 2000], [])
    per_step = [cost.marginal_seconds(IMAGE_TOKENS, masked, TEXT_TOKENS) for masked in (300, 2000)]
    assert cluster.remaining_work_s[0] == pytest.approx(STEPS * sum(per_step), rel=1e-12)
    cluster.advance(0, 1, 5)
    assert cluster.remaining_work_s[0] == pytest.approx(STEPS * per_step[0] + 5 * per_step[1], rel=1e-12)
    cluster.finish(0, 0)
    assert cluster.remaining_work_s[0] == pytest.approx(5 * per_step[1], rel=1e-12)
    cluster.finish(0, 1)
    assert cluster.remaining_work_s.tolist() == [0.0, 0.0]
    cluster.assign(1, 2, edit(10))
    cluster.remove_worker(1)
    assert cluster.remaining_work_s.tolist() == [0.0, 0.0]
    assert not ClusterLoad().add_worker(1) and not ClusterLoad().remaining_work_s.any()


def test_least_work_weighs_steps_left_not_request_counts(cost):
    # Slot 0: one large mask just started. Slot 1: three small ones about to finish. Least-requests and
    # least-tokens pick slot 0 (fewer requests; slot 1 has more masked tokens too); least-work slot 1.
    cluster = cluster_of(cost, [3000], [1200, 1200, 1200])
    for request_id in (1, 2, 3):
        cluster.advance(1, request_id, 2)
    assert make_policy("least-requests", cost).choose(edit(100), cluster) == 0
    assert make_policy("least-tokens", cost).choose(edit(100), cluster) == 0
    assert make_policy("least-work", cost).choose(edit(100), cluster) == 1
    cluster.advance(0, 0, 1)  # now the large one is nearly done too
    assert make_policy("least-work", cost).choose(edit(100), cluster) == 0


def test_least_work_needs_a_step_cost():
    with pytest.raises(ValueError, match="StepCost"):
        make_policy("least-work").choose(edit(10), cluster_of(None, []))
