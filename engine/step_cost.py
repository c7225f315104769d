"""One denoising step's latency of a batch, vectorised over many batches (one per worker).

The router scores every worker with the request added (Algorithm 2) and the simulator steps every
worker's batch, so both need the planner's pipeline latency (`retouch.planner`, Y-cache mode) of
thousands of batches per second; `planner.optimal_plan` is exact but costs a search per batch. Here:

Features. A `CostModel` predicts a block from sums over the batch's rows (`costs.block_features`), so
a request is a fixed feature vector per block kind -- full-compute work, Y-cache work, unmasked rows --
and a batch is the sum of its requests' vectors. Callers keep per-worker sums and add a request's.

Pipeline. In Y-cache mode nothing is handed off between blocks, so in a run of identical consecutive
blocks full blocks can go first without slowing the plan (the planner's swap (b)): a plan is, per run r,
n_r cached blocks at the run's end. Its latency is T + max(0, D_j) over cached blocks j, where T is the
compute of every block and D_j how long block j's load ends after the compute stream could start it
(loads run back to back from t=0): per run only its first and last cached block matter, both linear in
the counts. Holding every other run's count, the latency in the longest run's count n is
max(a - s*n, b + c*n, d + l*n) for n >= 1 (s: its saving per block, c: cached compute, l: load): convex,
so its integer minimum is at the floor or ceiling of where the falling line meets the rising ones, or
at n = 0. The other runs' counts are enumerated: Flux has 2 runs (one if its kinds cost the same,
as in the built-in model), SD3 2 (its last block is a kind of its own), SDXL 3 (35 combinations),
SD2 7 (864 combinations: its cost grows with them). The result is the optimum over
every plan (tests compare it with `planner.optimal_plan` to 1e-9 relative: the same sums in another
order). KV-cache mode hands rows off between blocks and is not covered.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from retouch.costs import CostModel, RequestTokens, block_features

FEATURES = ("query_tokens", "kv_tokens", "attention_pairs", "rows")
# Per kind: full-compute features, Y-cache features, unmasked rows (what cached blocks load).
COLUMNS_PER_KIND = 2 * len(FEATURES) + 1
UNET_CROSS_KEYS = 77  # CLIP's padded prompt, as `retouch profile` times UNet blocks
REQUEST_CACHE_SIZE = 1 << 16  # request shapes repeat (one grid, masks of a few thousand sizes)


class StepCost:
    """Seconds of one denoising step of a batch, from the summed features of its rows.

    request_features(tokens) -> [F] for one request; latency(features [..., F]) -> [...] seconds, where
    features are sums of request vectors (a batch); an empty batch (no rows) takes 0 s.
    """

    def __init__(self, model: CostModel, guidance_copies: int = 1):
        """guidance_copies: batch rows per request (2 for classifier-free guidance run as two rows)."""
        if guidance_copies < 1:
            raise ValueError(f"guidance_copies must be >= 1, got {guidance_copies}")
        self.model = model
        self.guidance_copies = guidance_copies
        # Kinds with equal fits, row bytes and token grid are one kind here: fewer runs to enumerate.
        signatures, kind_index = [], {}
        for kind in dict.fromkeys(model.block_kinds):
            signature = (_level(kind), model.compute[kind]["full"], model.compute[kind]["y"],
                         model.row_bytes[kind]["out"])
            if signature not in signatures:
                signatures.append(signature)
            kind_index[kind] = signatures.index(signature)
        self.levels = [signature[0] for signature in signatures]
        self.num_kinds = len(signatures)
        self.num_features = self.num_kinds * COLUMNS_PER_KIND
        # One matrix product predicts every kind's full and cached block and its load: [F, 3K].
        k, width = self.num_kinds, COLUMNS_PER_KIND
        self._weights = np.zeros((self.num_features, 3 * k))
        self._intercepts = np.empty(3 * k)
        for kind, (_, full, cached, row_bytes) in enumerate(signatures):
            base = kind * width
            self._weights[base:base + 4, kind] = _coefficients(full)
            self._weights[base + 4:base + 8, k + kind] = _coefficients(cached)
            self._weights[base + 8, 2 * k + kind] = row_bytes * model.load.coef[0]
            self._intercepts[[kind, k + kind, 2 * k + kind]] = full.intercept, cached.intercept, model.load.intercept
        self._unmasked = np.arange(k) * width + 8

        kinds = [kind_index[kind] for kind in model.block_kinds]
        runs = [(kind, len(list(group))) for kind, group in itertools.groupby(kinds)]
        self.run_kind = np.array([kind for kind, _ in runs])
        self.run_length = np.array([length for _, length in runs], dtype=float)
        # The longest run is solved in closed form; every count of the others is enumerated.
        self.closed_run = int(np.argmax(self.run_length))
        others = [range(length + 1) if r != self.closed_run else range(1) for r, (_, length) in enumerate(runs)]
        self.counts = np.array(list(itertools.product(*others)), dtype=float)  # [E, R], closed run's column 0
        self._one_run = len(runs) == 1
        self._request_cache: dict[tuple[int, int, int], np.ndarray] = {}
        self._marginal_cache: dict[tuple[int, int, int], float] = {}

    @classmethod
    def from_json(cls, path, guidance_copies: int = 1) -> StepCost:
        return cls(CostModel.from_json(path), guidance_copies)

    def tokens(self, image_tokens: int, masked_tokens: int, text_tokens: int, kind: int) -> RequestTokens:
        """A request's row as merged kind `kind` sees it. UNet level l has 4**l times fewer tokens than
        the grid (level 0, latent pixels); a masked token there covers 4**l of them, so the masked count
        is rounded up (a partly masked token is computed)."""
        level = self.levels[kind]
        if level is None:
            return RequestTokens(text=text_tokens, image=image_tokens, masked=masked_tokens)
        image = max(1, image_tokens // 4 ** level)
        masked = min(image, -(-masked_tokens // 4 ** level))
        return RequestTokens(text=0, image=image, masked=masked, cross_keys=UNET_CROSS_KEYS)

    def request_features(self, image_tokens: int, masked_tokens: int, text_tokens: int = 0) -> np.ndarray:
        """[F] feature vector of one request (all its guidance rows); read-only, shared between calls."""
        key = (image_tokens, masked_tokens, text_tokens)
        vector = self._request_cache.get(key)
        if vector is None:
            if len(self._request_cache) >= REQUEST_CACHE_SIZE:
                self._request_cache.clear()
            vector = self._request_cache[key] = self._request_features(*key)
            vector.flags.writeable = False
        return vector

    def marginal_seconds(self, image_tokens: int, masked_tokens: int, text_tokens: int = 0) -> float:
        """Seconds one request adds to each step of a batch it joins: latency(2 f) - latency(f), its step
        less the step's fixed part (block overheads, the first load), which a batch pays once. Exact for
        a compute-bound batch, where the step is linear in the summed features."""
        key = (image_tokens, masked_tokens, text_tokens)
        seconds = self._marginal_cache.get(key)
        if seconds is None:
            if len(self._marginal_cache) >= REQUEST_CACHE_SIZE:
                self._marginal_cache.clear()
            features = self.request_features(*key)
            one, two = self.latency(np.stack([features, 2 * features]))
            seconds = self._marginal_cache[key] = max(0.0, float(two - one))
        return seconds

    def _request_features(self, image_tokens: int, masked_tokens: int, text_tokens: int) -> np.ndarray:
        vector = np.empty(self.num_features)
        for kind in range(self.num_kinds):
            row = self.tokens(image_tokens, masked_tokens, text_tokens, kind)
            full, cached = block_features([row], "full"), block_features([row], "y")
            base = kind * COLUMNS_PER_KIND
            vector[base:base + 4] = [full[name] for name in FEATURES]
            vector[base + 4:base + 8] = [cached[name] for name in FEATURES]
            vector[base + 8] = row.image - row.masked
        return vector * self.guidance_copies

    def block_seconds(self, features: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(full, cached, load) seconds of one block per kind: each [C, K] for features [C, F], clamped
        at zero and with no load for no bytes, exactly as `CostModel.block_costs`."""
        predicted = features @ self._weights + self._intercepts  # [C, 3K]: full, cached, then load per kind
        k = self.num_kinds
        full, cached = np.maximum(0.0, predicted[:, :k]), np.maximum(0.0, predicted[:, k:2 * k])
        load = np.where(features[:, self._unmasked] > 0, np.maximum(0.0, predicted[:, 2 * k:]), 0.0)
        return full, cached, load

    def latency(self, features: np.ndarray) -> np.ndarray:
        """Seconds of one step for each batch: features [..., F] -> [...]."""
        features = np.asarray(features, dtype=float)
        shape = features.shape[:-1]
        flat = features.reshape(-1, self.num_features)
        seconds = self.plan_latency(*self.block_seconds(flat))
        return np.where(flat[:, 3] > 0, seconds, 0.0).reshape(shape)

    def plan_latency(self, full: np.ndarray, cached: np.ndarray, load: np.ndarray) -> np.ndarray:
        """[C] latency of the optimal plan of each batch, from its per-kind block seconds (full, cached,
        load: each [C, K], K = num_kinds, as `block_seconds` returns them). See the module docstring."""
        if self._one_run:  # no other run: the closed form alone (the general case with zero prefixes)
            f, c, l = full[:, 0], cached[:, 0], load[:, 0]
            length = self.run_length[0]
            falling, first0, rising, none_cached = length * f, l, c, length * f
        else:
            f, c, l = full[:, None, self.run_kind], cached[:, None, self.run_kind], load[:, None, self.run_kind]
            length, n = self.run_length, self.counts  # [R], [E, R]
            compute = length * f - n * (f - c)  # [C, E, R]: each run's compute under the enumerated counts
            loaded = n * l
            compute_before = np.cumsum(compute, axis=-1) - compute
            load_before = np.cumsum(loaded, axis=-1) - loaded
            start = compute_before + (length - n) * f  # the compute stream reaches the run's first cached block
            first = load_before + l - start
            last = load_before + n * l - (start + (n - 1) * c)
            lag = np.where(n >= 1, np.maximum(first, last), -np.inf)  # D of each run's critical cached blocks
            r = self.closed_run
            total = compute.sum(axis=-1)  # T with the closed run all full
            before = np.maximum(0.0, lag[..., :r].max(axis=-1, initial=-np.inf))
            after = total + lag[..., r + 1:].max(axis=-1, initial=-np.inf)
            f, c, l = f[..., r], c[..., r], l[..., r]
            length, start_r, load_r = self.run_length[r], compute_before[..., r], load_before[..., r]
            # With n >= 1 blocks of the closed run cached: max(falling - s*n, first0 + c*n, rising + l*n).
            falling = total + before
            first0 = total + load_r + l - start_r - length * f
            rising = np.maximum(total + load_r - start_r - length * f + c, after)
            none_cached = np.maximum(falling, after)
        s = f - c
        # Where the falling line meets the rising ones; s <= 0 (caching saves nothing) keeps n = 0.
        useful = s > 0
        one = np.where(useful, 0.0, 1.0)  # keeps the divisions finite where s <= 0, whose result is unused
        cross = np.minimum((falling - first0) / (s + c + one), (falling - rising) / (s + l + one))
        low = np.minimum(np.maximum(np.floor(cross), 1.0), length)
        high = np.minimum(low + 1, length)  # the integers either side of the crossing
        at_low = np.maximum(np.maximum(falling - s * low, first0 + c * low), rising + l * low)
        at_high = np.maximum(np.maximum(falling - s * high, first0 + c * high), rising + l * high)
        best = np.where(useful, np.minimum(none_cached, np.minimum(at_low, at_high)), none_cached)
        return best if self._one_run else best.min(axis=-1)


def _level(kind: str) -> int | None:
    """The UNet level of a kind ("level2" -> 2); None for kinds that see the whole grid and the text."""
    return int(kind.removeprefix("level")) if kind.startswith("level") else None


def _coefficients(fit) -> list[float]:
    if tuple(fit.features) != FEATURES:
        raise ValueError(f"a compute fit must use features {FEATURES}, got {fit.features}")
    if not all(math.isfinite(value) for value in (*fit.coef, fit.intercept)):
        raise ValueError("a compute fit has a non-finite coefficient")
    return list(fit.coef)
