"""Linear cost models of a model on a device: block compute (full, Y-cache, KV-cache) from the work a
batch does, host->device load time from bytes. Fitted by `retouch profile`, read by the planner (per
step: block costs of the running batch) and by the router (per request: the cost of a worker's batch
with the request added). The paper fits latency linearly on FLOPs (§4.4, Fig. 11); here the features
are the terms FLOPs are made of, each with its own slope, so one fit serves every batch shape.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from retouch.errors import InputError
from retouch.planner import BlockCosts

VARIANTS = ("full", "y", "kv")  # compute every token / Y-cache masked compute / KV-cache masked compute
FEATURES = ("query_tokens", "kv_tokens", "attention_pairs", "rows")


@dataclass(frozen=True)
class LinearModel:
    """seconds = intercept + sum(coef[i] * features[i])."""

    features: tuple[str, ...]
    coef: tuple[float, ...]
    intercept: float
    r2: float  # coefficient of determination on the fitted samples
    samples: int

    def predict(self, **features: float) -> float:
        missing = [name for name in self.features if name not in features]
        if missing:
            raise KeyError(f"cost model needs features {missing}")
        return self.intercept + sum(c * features[name] for name, c in zip(self.features, self.coef))

    def to_dict(self) -> dict:
        return {"features": list(self.features), "coef": list(self.coef), "intercept": self.intercept,
                "r2": self.r2, "samples": self.samples}

    @classmethod
    def from_dict(cls, data: Mapping) -> LinearModel:
        model = cls(tuple(data["features"]), tuple(float(c) for c in data["coef"]), float(data["intercept"]),
                    float(data["r2"]), int(data["samples"]))
        if len(model.coef) != len(model.features):
            raise ValueError(f"{len(model.coef)} coefficients for {len(model.features)} features")
        return model


def fit_linear(samples: Sequence[Mapping[str, float]], target: str, features: Sequence[str]) -> LinearModel:
    """Ordinary least squares of `target` on `features` with an intercept; R^2 on the same samples."""
    if len(samples) < len(features) + 1:
        raise ValueError(f"{len(samples)} samples cannot fit {len(features)} features and an intercept")
    design = np.array([[1.0] + [float(s[name]) for name in features] for s in samples])
    y = np.array([float(s[target]) for s in samples])
    # Columns differ by orders of magnitude (rows vs attention pairs): solve on scaled columns.
    scale = np.abs(design).max(axis=0)
    scale[scale == 0] = 1.0
    solution, *_ = np.linalg.lstsq(design / scale, y, rcond=None)
    solution /= scale
    residual = float(((y - design @ solution) ** 2).sum())
    total = float(((y - y.mean()) ** 2).sum())
    if total == 0:  # a constant target: R^2 is 1 if the fit is exact (to rounding), else nothing is explained
        r2 = 1.0 if residual <= np.finfo(float).eps * float((y ** 2).sum()) else 0.0
    else:
        r2 = 1 - residual / total
    return LinearModel(tuple(features), tuple(float(c) for c in solution[1:]), float(solution[0]), r2, len(samples))


@dataclass(frozen=True)
class RequestTokens:
    """One batch row as one block kind sees it."""

    text: int  # always-computed prefix tokens (Flux/SD3 text); 0 for UNet blocks
    image: int  # L: image tokens of the block's level
    masked: int  # image tokens this row recomputes (0..image)
    cross_keys: int = 0  # UNet cross-attention keys (text tokens); 0 for joint attention

    def __post_init__(self):
        if min(self.text, self.image, self.masked, self.cross_keys) < 0 or self.masked > self.image:
            raise ValueError(f"token counts must be >= 0 with masked <= image, got {self}")


def block_features(rows: Sequence[RequestTokens], variant: str) -> dict[str, float]:
    """Work of one block over a batch: computed tokens, tokens whose K/V are projected, attention
    query-key pairs (self and cross), rows (per-request overheads)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    query = kv = pairs = 0
    for row in rows:
        keys = row.text + row.image
        queries = keys if variant == "full" else row.text + row.masked
        query += queries
        kv += keys if variant in ("full", "y") else queries
        pairs += queries * keys + queries * row.cross_keys
    return {"query_tokens": float(query), "kv_tokens": float(kv), "attention_pairs": float(pairs),
            "rows": float(len(rows))}


@dataclass(frozen=True)
class CostModel:
    """Everything the planner and the router need to predict one model on one device.

    block_kinds: the kind of each block in execution order ("double", "single", "joint", "level1", ...)
    compute:     kind -> variant -> seconds of one block from `block_features`
    row_bytes:   kind -> cache name ("out", "k", "v") -> bytes per token row as the cache stores it
    load:        seconds of a block's host->device load from its "bytes"
    """

    model: str
    device: str
    dtype: str
    block_kinds: tuple[str, ...]
    compute: Mapping[str, Mapping[str, LinearModel]]
    row_bytes: Mapping[str, Mapping[str, int]]
    load: LinearModel
    meta: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "block_kinds", tuple(self.block_kinds))
        for kind in set(self.block_kinds):
            if kind not in self.compute or set(self.compute[kind]) != set(VARIANTS):
                raise ValueError(f"cost model has no {', '.join(VARIANTS)} fits for block kind {kind!r}")
            if kind not in self.row_bytes or not {"out", "k", "v"} <= set(self.row_bytes[kind]):
                raise ValueError(f"cost model has no out/k/v row bytes for block kind {kind!r}")
        if self.load.features != ("bytes",):
            raise ValueError(f"the load model must predict from ('bytes',), got {self.load.features}")

    def block_costs(self, rows: Sequence[Mapping[str, RequestTokens]], mode: str) -> BlockCosts:
        """Planner input for a batch: `rows` holds, per batch row, each kind's `RequestTokens`;
        `mode` is "y" or "kv" (which activations cached blocks load)."""
        if mode not in ("y", "kv"):
            raise ValueError(f"mode must be 'y' or 'kv', got {mode!r}")
        full, cached, load, handoff = [], [], [], []
        features = {}  # per kind and variant: the same for every block of the kind
        for index, kind in enumerate(self.block_kinds):
            if kind not in features:
                kind_rows = [row[kind] for row in rows]
                unmasked = sum(r.image - r.masked for r in kind_rows)
                names = ("out",) if mode == "y" else ("k", "v")
                features[kind] = (block_features(kind_rows, "full"), block_features(kind_rows, mode),
                                  unmasked * sum(self.row_bytes[kind][n] for n in names),
                                  0 if mode == "y" else unmasked * self.row_bytes[kind]["out"])
            full_work, cached_work, load_bytes, handoff_bytes = features[kind]
            if index == len(self.block_kinds) - 1:  # the last block always hands over all rows
                load_bytes, handoff_bytes = load_bytes + handoff_bytes, 0
            full.append(max(0.0, self.compute[kind]["full"].predict(**full_work)))
            cached.append(max(0.0, self.compute[kind][mode].predict(**cached_work)))
            load.append(self._load_seconds(load_bytes))
            handoff.append(self._load_seconds(handoff_bytes))
        return BlockCosts(tuple(full), tuple(cached), tuple(load), None if mode == "y" else tuple(handoff))

    def _load_seconds(self, nbytes: int) -> float:
        return 0.0 if nbytes == 0 else max(0.0, self.load.predict(bytes=float(nbytes)))

    def to_json(self, path: Path | str) -> None:
        data = {"model": self.model, "device": self.device, "dtype": self.dtype, "block_kinds": list(self.block_kinds),
                "compute": {kind: {variant: fit.to_dict() for variant, fit in fits.items()}
                            for kind, fits in self.compute.items()},
                "row_bytes": {kind: dict(sizes) for kind, sizes in self.row_bytes.items()},
                "load": self.load.to_dict(), "meta": dict(self.meta)}
        Path(path).write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def from_json(cls, path: Path | str) -> CostModel:
        try:
            data = json.loads(Path(path).read_text())
            return cls(model=str(data["model"]), device=str(data["device"]), dtype=str(data["dtype"]),
                       block_kinds=tuple(data["block_kinds"]),
                       compute={kind: {variant: LinearModel.from_dict(fit) for variant, fit in fits.items()}
                                for kind, fits in data["compute"].items()},
                       row_bytes={kind: {name: int(size) for name, size in sizes.items()}
                                  for kind, sizes in data["row_bytes"].items()},
                       load=LinearModel.from_dict(data["load"]), meta=data.get("meta", {}))
        except OSError as exc:
            raise InputError(f"cannot read the cost model {path}: {exc.strerror or exc}") from None
        except (KeyError, TypeError, AttributeError, ValueError) as exc:  # ValueError: bad JSON, or a bad fit
            raise InputError(f"{path} is not a retouch cost model: {type(exc).__name__}: {exc}") from None

    def r2_summary(self) -> dict[str, float]:
        """kind/variant -> R^2 of each compute fit, and "load"."""
        summary = {f"{kind}/{variant}": fit.r2 for kind, fits in self.compute.items() for variant, fit in fits.items()}
        summary["load"] = self.load.r2
        return {name: (round(value, 4) if math.isfinite(value) else value) for name, value in summary.items()}
