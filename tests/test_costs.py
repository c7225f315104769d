"""Cost models: the linear fit, the work features, JSON round trips, and batched block costs."""

import json

import numpy as np
import pytest

from retouch.costs import FEATURES, VARIANTS, CostModel, LinearModel, RequestTokens, block_features, fit_linear
from retouch.errors import InputError


def test_fit_recovers_a_noiseless_model_and_reports_noise():
    generator = np.random.default_rng(0)
    samples = [dict(zip(FEATURES, generator.uniform(1, 1e4, len(FEATURES)))) for _ in range(30)]
    for sample in samples:
        sample["seconds"] = 2e-3 + 1e-6 * sample["query_tokens"] + 3e-7 * sample["kv_tokens"] \
            + 1e-9 * sample["attention_pairs"] + 1e-4 * sample["rows"]
    fit = fit_linear(samples, "seconds", FEATURES)
    assert fit.r2 == pytest.approx(1.0, abs=1e-12)
    assert fit.coef == pytest.approx((1e-6, 3e-7, 1e-9, 1e-4), rel=1e-6)
    assert fit.intercept == pytest.approx(2e-3, rel=1e-6)
    for sample in samples:
        sample["seconds"] *= generator.uniform(0.5, 1.5)
    noisy = fit_linear(samples, "seconds", FEATURES)
    assert 0 < noisy.r2 < 0.99
    with pytest.raises(ValueError, match="cannot fit"):
        fit_linear(samples[:4], "seconds", FEATURES)
    with pytest.raises(KeyError, match="rows"):
        fit.predict(query_tokens=1, kv_tokens=1, attention_pairs=1)


def test_block_features_by_hand():
    rows = [RequestTokens(text=2, image=10, masked=3), RequestTokens(text=2, image=10, masked=10)]
    assert block_features(rows, "full") == {"query_tokens": 24, "kv_tokens": 24, "attention_pairs": 288, "rows": 2}
    # Y-cache: queries are text + masked, keys/values projected for every token.
    assert block_features(rows, "y") == {"query_tokens": 17, "kv_tokens": 24, "attention_pairs": 5 * 12 + 12 * 12,
                                         "rows": 2}
    assert block_features(rows, "kv")["kv_tokens"] == 17
    unet = [RequestTokens(text=0, image=16, masked=4, cross_keys=77)]
    assert block_features(unet, "kv")["attention_pairs"] == 4 * 16 + 4 * 77
    with pytest.raises(ValueError):
        RequestTokens(text=0, image=4, masked=5)


def model(kinds=("double", "double", "single")) -> CostModel:
    """Seconds = 1e-6 per query token (+ 1 ms intercept) for every fit; loads 1 ns per byte + 10 us."""
    fit = LinearModel(FEATURES, (1e-6, 0.0, 0.0, 0.0), 1e-3, 1.0, 10)
    return CostModel(model="m", device="cpu", dtype="float32", block_kinds=kinds,
                     compute={kind: {variant: fit for variant in VARIANTS} for kind in set(kinds)},
                     row_bytes={kind: {"out": 100, "k": 60, "v": 60} for kind in set(kinds)},
                     load=LinearModel(("bytes",), (1e-9,), 1e-5, 1.0, 4), meta={"command": "test"})


def test_json_round_trip_and_validation(tmp_path):
    path = tmp_path / "cost.json"
    original = model()
    original.to_json(path)
    assert CostModel.from_json(path) == original
    data = json.loads(path.read_text())
    del data["compute"]["single"]
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match="single"):
        CostModel.from_json(path)
    path.write_text("{}")
    with pytest.raises(InputError, match="not a retouch cost model"):
        CostModel.from_json(path)
    path.write_text("{not json")
    with pytest.raises(InputError, match="not a retouch cost model"):
        CostModel.from_json(path)
    with pytest.raises(InputError, match="cannot read the cost model"):
        CostModel.from_json(tmp_path / "missing.json")


def test_block_costs_of_a_batch_by_hand():
    rows = [{kind: RequestTokens(text=2, image=10, masked=4) for kind in ("double", "single")},
            {kind: RequestTokens(text=2, image=10, masked=10) for kind in ("double", "single")}]
    y = model().block_costs(rows, "y")
    assert y.full_s == pytest.approx((1e-3 + 24e-6,) * 3)
    assert y.cached_s == pytest.approx((1e-3 + 18e-6,) * 3)
    assert y.load_s == pytest.approx((1e-5 + 600e-9,) * 3)  # 6 unmasked rows x 100 bytes of "out"
    assert y.handoff_s is None
    kv = model().block_costs(rows, "kv")
    load, handoff = 1e-5 + 720e-9, 1e-5 + 600e-9  # k + v rows; the out rows a full successor needs
    assert kv.load_s == pytest.approx((load, load, load + 600e-9))  # the last block always hands over
    assert kv.handoff_s == pytest.approx((handoff, handoff, 0.0))
    every_token = [{kind: RequestTokens(text=2, image=10, masked=10) for kind in ("double", "single")}]
    assert model().block_costs(every_token, "y").load_s == (0.0, 0.0, 0.0)  # nothing to load: no copy


def test_constant_targets_and_clamped_predictions():
    samples = [{"bytes": float(b), "seconds": 1e-3} for b in (1, 2, 4, 8)]
    constant = fit_linear(samples, "seconds", ("bytes",))
    assert constant.r2 == 1.0 and constant.coef == pytest.approx((0.0,), abs=1e-15)
    assert constant.intercept == pytest.approx(1e-3)
    # A fit extrapolated below its samples can go negative; a latency cannot.
    negative = LinearModel(FEATURES, (1e-6, 0.0, 0.0, 0.0), -1.0, 1.0, 10)
    base = model()
    clamped = CostModel(model="m", device="cpu", dtype="float32", block_kinds=base.block_kinds,
                        compute={kind: {variant: negative for variant in VARIANTS} for kind in ("double", "single")},
                        row_bytes=base.row_bytes, load=LinearModel(("bytes",), (1e-9,), -1.0, 1.0, 4))
    costs = clamped.block_costs([{kind: RequestTokens(text=2, image=10, masked=4) for kind in ("double", "single")}],
                                "kv")
    assert costs.full_s == costs.cached_s == costs.load_s == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="bytes"):
        CostModel(model="m", device="cpu", dtype="float32", block_kinds=base.block_kinds, compute=base.compute,
                  row_bytes=base.row_bytes, load=LinearModel(("megabytes",), (1e-3,), 0.0, 1.0, 4))


def test_from_json_names_what_is_wrong(tmp_path):
    path = tmp_path / "cost.json"
    model().to_json(path)
    data = json.loads(path.read_text())
    data["compute"] = ["not", "a", "mapping"]
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match="not a retouch cost model"):
        CostModel.from_json(path)
    model().to_json(path)
    data = json.loads(path.read_text())
    del data["load"]
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match="load"):
        CostModel.from_json(path)
