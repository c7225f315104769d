"""Routing policies: which worker a new edit request goes to. The router and `retouch simulate` share
them, and share `ClusterLoad`, the router's view of its workers.

    round-robin      the next alive worker in turn
    least-requests   fewest requests running + queued (LLM routers' request-level balance)
    least-tokens     fewest masked tokens running + queued (token-level balance)
    mask-aware       the paper's Algorithm 2 (default): among workers with slack in their batch
                     (running + queued < max_batch), the one whose batch with the request added has the
                     cheapest denoising step -- the planner's pipeline latency from the cost model
                     (`StepCost`), which weighs compute and cache loading, not just token counts.
                     Algorithm 2 leaves open what happens when no worker has slack; here the request
                     goes where it is estimated to finish first: (steps until a batch slot frees for it,
                     the queue ahead taking slots first, + its own steps) x the worker's current step
                     latency.
    least-work       the fewest seconds of batch compute left on the worker: each running or queued
                     request's steps left x the seconds it adds to a batch step (join the shortest
                     expected work; the cost model prices resolution, masked tokens and cache loads).

Ties go to the first tied worker at or after a rotating cursor, so equally loaded workers (all idle,
say) take turns instead of the lowest slot taking everything.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from retouch.engine.step_cost import StepCost

POLICIES = ("round-robin", "least-requests", "least-tokens", "mask-aware", "least-work")
DEFAULT_POLICY = "mask-aware"


class NoWorker(RuntimeError):
    """No alive (and eligible) worker to route to."""


def denoiser_calls(line: tuple[int, int], steps: int, schedule: int | None = None) -> int:
    """The denoiser calls an edit running `steps` steps of a `schedule`-step schedule (by default, all of
    them; fewer below strength 1) makes on a sampler whose calls line is `line`, (per step, more)
    (`retouch.models.samplers.calls_line`: 2, -1 for Heun's; 1, 1 for PLMS). A one-step schedule is one
    call; the line holds from two, also for its last steps (a one-step tail of PLMS's makes two calls)."""
    per_step, more = line
    return max(1, per_step * steps + more) if (steps if schedule is None else schedule) >= 2 else steps


@dataclass(frozen=True)
class RequestLoad:
    """What routing knows of a request.

    image_tokens:  tokens of the denoiser's grid ((H/16)*(W/16) for Flux/SD3; latent pixels for UNets)
    masked_tokens: of those, the ones the edit recomputes (0..image_tokens)
    steps:         denoising steps the request runs
    text_tokens:   always-computed prefix tokens (Flux/SD3 text)
    deadline:      when it should be answered, on the router's clock (time.monotonic(), or the
                   simulator's); None: no SLO
    """

    image_tokens: int
    masked_tokens: int
    steps: int
    text_tokens: int = 0
    deadline: float | None = None

    def __post_init__(self):
        if self.image_tokens < 1 or not 0 <= self.masked_tokens <= self.image_tokens:
            raise ValueError(f"need image_tokens >= 1 and 0 <= masked_tokens <= image_tokens, got {self}")
        if self.steps < 1 or self.text_tokens < 0:
            raise ValueError(f"need steps >= 1 and text_tokens >= 0, got {self}")


@dataclass
class _Row:
    slot: int
    load: RequestLoad
    features: np.ndarray | None
    running: bool
    steps_left: int
    marginal_s: float = 0.0  # seconds it adds to each step of its batch (StepCost.marginal_seconds)


class ClusterLoad:
    """What the router knows about its workers, as numpy arrays over worker slots.

    A request is assigned (queued at a worker), admitted (in its running batch), advanced (progress
    reports) and finished (answered, or taken away to re-route). With a `StepCost`, each slot also keeps
    the summed cost features of its running requests and of all its requests, running + queued
    (features add up over rows, so a batch's are its requests' sum).
    Slots are never reused: a removed worker's slot stays dead.
    """

    def __init__(self, cost: StepCost | None = None):
        self.cost = cost
        self._size = 0
        self._alive = np.zeros(0, dtype=bool)
        self._max_batch = np.zeros(0, dtype=np.int64)
        self._running = np.zeros(0, dtype=np.int64)
        self._queued = np.zeros(0, dtype=np.int64)
        self._masked = np.zeros(0, dtype=np.int64)
        self._work = np.zeros(0)  # sum over running + queued requests of steps_left * marginal_s
        width = cost.num_features if cost is not None else 0
        self._running_features = np.zeros((0, width))
        self._inflight_features = np.zeros((0, width))  # running + queued
        self._rows: dict[Hashable, _Row] = {}
        self._members: list[dict[Hashable, _Row]] = []  # per slot, in assignment order (the queue's order)

    # -- workers --------------------------------------------------------------------------------------
    def add_worker(self, max_batch: int) -> int:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if self._size == len(self._alive):
            self._grow(max(8, 2 * self._size))
        slot = self._size
        self._size += 1
        self._alive[slot], self._max_batch[slot] = True, max_batch
        self._members.append({})
        return slot

    def remove_worker(self, slot: int) -> None:
        """The worker is dead: never chosen again, and its requests are forgotten."""
        self._check_slot(slot)
        self._alive[slot] = False
        for request_id in self._members[slot]:
            del self._rows[request_id]
        self._members[slot] = {}
        self._running[slot] = self._queued[slot] = self._masked[slot] = 0
        self._work[slot] = 0.0
        self._running_features[slot] = self._inflight_features[slot] = 0.0

    def _grow(self, capacity: int) -> None:
        def grown(array):
            bigger = np.zeros((capacity, *array.shape[1:]), dtype=array.dtype)
            bigger[:len(array)] = array
            return bigger

        self._alive, self._max_batch = grown(self._alive), grown(self._max_batch)
        self._running, self._queued, self._masked = grown(self._running), grown(self._queued), grown(self._masked)
        self._work = grown(self._work)
        self._running_features, self._inflight_features = grown(self._running_features), grown(self._inflight_features)

    # -- requests -------------------------------------------------------------------------------------
    def assign(self, slot: int, request_id: Hashable, load: RequestLoad) -> None:
        """The request was sent to the worker: queued there until admitted. (The router's requests are its
        edits, by number, and the recordings it asked for, by (template id, slot).)"""
        self._check_slot(slot)
        if not self._alive[slot]:
            raise ValueError(f"worker slot {slot} is dead")
        if request_id in self._rows:
            raise ValueError(f"request {request_id} is already at slot {self._rows[request_id].slot}")
        features, marginal_s = None, 0.0
        if self.cost is not None:
            features = self.cost.request_features(load.image_tokens, load.masked_tokens, load.text_tokens)
            self._inflight_features[slot] += features
            marginal_s = self.cost.marginal_seconds(load.image_tokens, load.masked_tokens, load.text_tokens)
            self._work[slot] += load.steps * marginal_s
        row = _Row(slot, load, features, running=False, steps_left=load.steps, marginal_s=marginal_s)
        self._rows[request_id] = self._members[slot][request_id] = row
        self._queued[slot] += 1
        self._masked[slot] += load.masked_tokens

    def admit(self, slot: int, request_id: Hashable) -> None:
        """The request joined the worker's running batch (again: nothing changes, so every heartbeat that
        lists it may say so)."""
        row = self._row(slot, request_id)
        if row.running:
            return
        row.running = True
        self._queued[slot] -= 1
        self._running[slot] += 1
        if row.features is not None:
            self._running_features[slot] += row.features

    def advance(self, slot: int, request_id: Hashable, steps_left: int) -> None:
        """A progress report: the request has `steps_left` denoising steps to go."""
        row = self._row(slot, request_id)
        self._work[slot] += (steps_left - row.steps_left) * row.marginal_s
        row.steps_left = steps_left

    def finish(self, slot: int, request_id: Hashable) -> None:
        """The request left the worker (answered, or taken away to re-route). A request of a removed
        worker was already forgotten: finishing it does nothing."""
        if not self._alive[slot] and request_id not in self._rows:
            return
        row = self._row(slot, request_id)
        del self._rows[request_id], self._members[slot][request_id]
        self._masked[slot] -= row.load.masked_tokens
        self._work[slot] -= row.steps_left * row.marginal_s
        if not self._members[slot]:
            self._work[slot] = 0.0  # no drift from float sums on an empty worker
        if row.features is not None:
            self._inflight_features[slot] -= row.features
            if row.running:
                self._running_features[slot] -= row.features
        if row.running:
            self._running[slot] -= 1
        else:
            self._queued[slot] -= 1

    def holds(self, slot: int, request_id: Hashable) -> bool:
        """Whether the request is at the worker slot (assigned and not finished)."""
        self._check_slot(slot)
        return request_id in self._members[slot]

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self._size:
            raise IndexError(f"no worker slot {slot} (slots 0..{self._size - 1})")

    def _row(self, slot: int, request_id: Hashable) -> _Row:
        self._check_slot(slot)
        row = self._members[slot].get(request_id)
        if row is None:
            raise KeyError(f"request {request_id} is not at worker slot {slot}")
        return row

    # -- views (arrays over slots, read-only by convention) -------------------------------------------
    @property
    def num_slots(self) -> int:
        return self._size

    @property
    def alive(self) -> np.ndarray:
        return self._alive[:self._size]

    @property
    def max_batch(self) -> np.ndarray:
        return self._max_batch[:self._size]

    @property
    def running(self) -> np.ndarray:
        return self._running[:self._size]

    @property
    def queued(self) -> np.ndarray:
        return self._queued[:self._size]

    @property
    def in_flight(self) -> np.ndarray:
        """Requests running + queued per slot."""
        return self.running + self.queued

    @property
    def masked_tokens(self) -> np.ndarray:
        """Masked tokens of the requests running + queued per slot."""
        return self._masked[:self._size]

    @property
    def remaining_work_s(self) -> np.ndarray:
        """[slots] seconds of batch compute the requests running + queued per slot still need: their
        steps left times what each adds to a step (needs a StepCost; zeros without)."""
        return self._work[:self._size]

    @property
    def running_features(self) -> np.ndarray:
        """[slots, F] summed cost features of each running batch (needs a StepCost)."""
        return self._running_features[:self._size]

    @property
    def inflight_features(self) -> np.ndarray:
        """[slots, F] summed cost features of the requests running + queued per slot."""
        return self._inflight_features[:self._size]

    def steps_left(self, slot: int, running: bool) -> list[int]:
        """Last reported steps to go of the slot's running (or queued, in queue order) requests."""
        return [row.steps_left for row in self._members[slot].values() if row.running == running]

    def queued_ahead(self, slot: int, load: RequestLoad, step_s: float) -> list[int]:
        """Steps to go of the slot's queued requests that its worker admits before `load`, as the worker
        orders its queue (`Worker.next_waiting`): least slack first among those with a deadline, slack
        counted as deadline - steps x `step_s` (the time left cancels out), the earlier first among equals;
        those without a deadline after them, in arrival order. So a request without a deadline waits for
        the whole queue, and one with a deadline only for the more urgent ones."""
        queued = [row for row in self._members[slot].values() if not row.running]
        if load.deadline is None:
            return [row.steps_left for row in queued]
        latest = load.deadline - load.steps * step_s
        return [row.steps_left for row in queued
                if row.load.deadline is not None and row.load.deadline - row.steps_left * step_s <= latest]


class Policy:
    """Chooses a worker slot for a request: `choose` returns a slot that is alive and, where `eligible`
    (a bool mask over slots) is given, eligible; NoWorker if there is none. Subclasses score every slot
    (lower is better); scores of slots that cannot be chosen are ignored."""

    name = "policy"

    def __init__(self):
        self._cursor = 0

    def choose(self, load: RequestLoad, cluster: ClusterLoad, eligible: np.ndarray | None = None) -> int:
        candidates = cluster.alive
        if eligible is not None:
            eligible = np.asarray(eligible, dtype=bool)
            if eligible.shape != candidates.shape:
                raise ValueError(f"eligible has shape {eligible.shape}, the cluster has {cluster.num_slots} slots")
            candidates = candidates & eligible
        if not candidates.any():
            raise NoWorker(f"no alive{' eligible' if eligible is not None else ''} worker among "
                           f"{cluster.num_slots} slots")
        return self._lowest(self.scores(load, cluster, candidates), candidates)

    def scores(self, load: RequestLoad, cluster: ClusterLoad, candidates: np.ndarray) -> np.ndarray:
        """[slots] score of sending `load` to each slot; only `candidates` (bool [slots]) need be right."""
        raise NotImplementedError

    def _lowest(self, scores: np.ndarray, candidates: np.ndarray) -> int:
        """The candidate of the lowest score; among ties, the first at or after the cursor (cyclically)."""
        scores = np.where(candidates, scores, np.inf)
        tied = np.flatnonzero(candidates & (scores == scores.min()))
        after = tied[tied >= self._cursor]
        slot = int(after[0] if len(after) else tied[0])
        self._cursor = slot + 1
        return slot


class RoundRobin(Policy):
    name = "round-robin"

    def scores(self, load, cluster, candidates):
        return np.zeros(cluster.num_slots)


class LeastRequests(Policy):
    name = "least-requests"

    def scores(self, load, cluster, candidates):
        return cluster.in_flight


class LeastTokens(Policy):
    name = "least-tokens"

    def scores(self, load, cluster, candidates):
        return cluster.masked_tokens


class MaskAware(Policy):
    """Algorithm 2 with the extension for a cluster without slack (see the module docstring)."""

    name = "mask-aware"

    def __init__(self, cost: StepCost | None = None):
        super().__init__()
        self.cost = cost

    def scores(self, load, cluster, candidates):
        cost = self._cost(cluster)
        features = cost.request_features(load.image_tokens, load.masked_tokens, load.text_tokens)
        slack = cluster.in_flight < cluster.max_batch
        if (slack & candidates).any():
            return np.where(slack, cost.latency(cluster.inflight_features + features), np.inf)
        return full_finish_s(load, cluster, np.flatnonzero(candidates), cost, features)

    def _cost(self, cluster: ClusterLoad) -> StepCost:
        if cluster.cost is None:
            raise ValueError("mask-aware routing needs a ClusterLoad built with a StepCost")
        if self.cost is not None and self.cost is not cluster.cost:
            raise ValueError("the policy and the ClusterLoad must share one StepCost: the cluster sums "
                             "request features with its own")
        return cluster.cost


class LeastWork(MaskAware):
    """Join the shortest expected work: the worker whose running + queued requests need the fewest
    seconds of batch compute to finish (`ClusterLoad.remaining_work_s`: steps left x what each adds to
    a step, from the cost model, so resolution, masked tokens and cache loads all count)."""

    name = "least-work"

    def scores(self, load, cluster, candidates):
        self._cost(cluster)
        return cluster.remaining_work_s


def prefer_holders(eligible: np.ndarray, holds: np.ndarray, cluster: ClusterLoad, bound: int | None) -> np.ndarray:
    """LoRA affinity, before a policy chooses: among `eligible` slots (bool [slots]), those whose workers hold
    the request's adapters (`holds`, bool [slots]), have a free batch slot and at most `bound` requests more in
    flight than the least loaded eligible slot, when there are any. Otherwise, and when `bound` is None,
    `eligible` itself: a request is not queued behind a full holder to save a read, because its load
    overlaps its first steps anyway while a queue delays all of them."""
    if bound is None or not eligible.any():
        return eligible
    in_flight = cluster.in_flight
    preferred = (eligible & holds & (in_flight < cluster.max_batch)
                 & (in_flight <= in_flight[eligible].min() + bound))
    return preferred if preferred.any() else eligible


def replica_to_add(replicas: np.ndarray, others: np.ndarray, cluster: ClusterLoad, bound: int = 1) -> int | None:
    """Where a template whose edits have outgrown its replicas is recorded next: the least loaded of `others`
    (bool [slots]) when every worker holding it (`replicas`) has more than `bound` requests in flight beyond
    it (its slot), else None. A recording there costs one generation, and the template's edits then spread
    further (with few replicas a popular template's edits piled onto them while other workers idled)."""
    if not replicas.any() or not others.any():
        return None
    in_flight = cluster.in_flight
    candidates = np.flatnonzero(others)
    least = candidates[np.argmin(in_flight[candidates])]
    return int(least) if in_flight[replicas].min() > in_flight[least] + bound else None


_POLICY_CLASSES = {cls.name: cls for cls in (RoundRobin, LeastRequests, LeastTokens, MaskAware, LeastWork)}


def make_policy(name: str, cost: StepCost | None = None) -> Policy:
    """A fresh policy by name (one of POLICIES). `cost`: the StepCost mask-aware scores with; it must be
    the ClusterLoad's (None: use the ClusterLoad's)."""
    if name not in _POLICY_CLASSES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    return _POLICY_CLASSES[name](cost) if name in ("mask-aware", "least-work") else _POLICY_CLASSES[name]()


def full_finish_s(load: RequestLoad, cluster: ClusterLoad, slots: np.ndarray, cost: StepCost,
                  features: np.ndarray, siblings: np.ndarray | None = None) -> np.ndarray:
    """[slots] seconds until `load` would finish at each of `slots`, workers whose batch is full: steps
    until a batch slot is free for it, then its own steps, all at the worker's current step latency. The
    queued requests its worker admits first (`ClusterLoad.queued_ahead`) take freed slots first; past one
    round of the batch, each further round is counted as their mean steps (an estimate: later changes of
    the batch are not modelled). `siblings` ([slots] ints): earlier images of the same request placed at
    each slot, ahead of it; they take the free batch slots first, so a worker with free slots is full for
    `load` once they have."""
    finish = np.full(cluster.num_slots, np.inf)
    for slot in map(int, slots):
        placed = 0 if siblings is None else int(siblings[slot])
        joining = min(placed, max(0, int(cluster.max_batch[slot] - cluster.in_flight[slot])))
        step_s = (float(cost.latency(cluster.running_features[slot] + joining * features))
                  or float(cost.latency(features)))
        running = sorted([*cluster.steps_left(slot, running=True), *[load.steps] * joining])
        ahead = [*cluster.queued_ahead(slot, load, step_s), *[load.steps] * (placed - joining)]
        if running:
            rounds, position = divmod(len(ahead), len(running))
            wait_steps = running[position] + rounds * (float(np.mean(ahead)) if ahead else 0.0)
        else:  # nothing runs yet: the queue ahead runs first, a batch at a time
            wait_steps = (len(ahead) // int(cluster.max_batch[slot])) * load.steps
        finish[slot] = (wait_steps + load.steps) * step_s
    return finish
