"""The vectorised step latency against the planner's exact optimum, over random batches of the built-in
and fitted cost models and random block costs of many block layouts; the built-in model's anchors.

Tolerance: `StepCost` finds the same optimum as `planner.optimal_plan` in closed form, so the two differ
only by floating-point sums taken in another order; 1e-9 relative is far above that and far below any
difference a wrong plan makes (one block of 57 is ~2% of a step)."""

from pathlib import Path

import numpy as np
import pytest

from retouch.costs import CostModel, LinearModel
from retouch.engine import reference_costs
from retouch.engine.reference_costs import h800_flux
from retouch.engine.step_cost import FEATURES, StepCost
from retouch.planner import BlockCosts, optimal_plan

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "cpu"
MODELS = {"built-in": (h800_flux, 4096, 512),
          "tiny-flux-fill": (lambda: CostModel.from_json(RESULTS / "cost_tiny_flux_fill.json"), 1024, 0),
          "flux-small": (lambda: CostModel.from_json(RESULTS / "cost_flux_small.json"), 1024, 64)}
BATCH_SIZES = [1, 2, 3, 8]
RTOL = 1e-9
# Block layouts as kinds in execution order: one run, Flux's two, a UNet's interleaved levels (SDXL-like
# and SD2's seven runs), kinds that alternate block by block.
LAYOUTS = {"one-run": ["joint"] * 24,
           "flux": ["double"] * 19 + ["single"] * 38,
           "sdxl-like": ["level1"] * 4 + ["level2"] * 20 + ["level1"] * 6,
           "sd2": (["level0"] * 2 + ["level1"] * 2 + ["level2"] * 2 + ["level3"] + ["level2"] * 3
                   + ["level1"] * 3 + ["level0"] * 3),
           "alternating": ["a", "b", "a", "c", "b", "a", "a", "c"]}


def exact_latency(model: CostModel, step_cost: StepCost, masks: list[int], image: int, text: int) -> float:
    rows = [{kind: step_cost.tokens(image, masked, text, 0) for kind in model.block_kinds} for masked in masks]
    return optimal_plan(model.block_costs(rows, "y")).latency_s


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("batch", BATCH_SIZES)
def test_latency_is_the_optimal_plan_of_random_batches(name, batch):
    make, image, text = MODELS[name]
    model = make()
    step_cost = StepCost(model)
    generator = np.random.default_rng(batch)
    for _ in range(15):
        # Masks from none to all tokens: small masks make steps load-bound, large ones compute-bound.
        masks = [int(m) for m in generator.choice([0, 1, image // 50, image // 5, image // 2, image], batch)]
        features = sum(step_cost.request_features(image, masked, text) for masked in masks)
        expected = exact_latency(model, step_cost, masks, image, text)
        assert float(step_cost.latency(features)) == pytest.approx(expected, rel=RTOL)


def layout_model(kinds: list[str]) -> CostModel:
    """A CostModel whose only use here is its block layout (plan_latency takes block seconds)."""
    fits = {kind: {variant: LinearModel(FEATURES, (1e-6 * (i + 1), 0.0, 0.0, 0.0), 0.0, 1.0, 5)
                   for variant in ("full", "y", "kv")} for i, kind in enumerate(dict.fromkeys(kinds))}
    return CostModel("layout", "cpu", "float32", tuple(kinds), fits,
                     {kind: {"out": 8, "k": 8, "v": 8} for kind in fits}, LinearModel(("bytes",), (1e-9,), 0.0, 1.0, 5))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("regime", [0.2, 1.0, 5.0])  # load per block / full compute per block
def test_plan_latency_is_optimal_for_any_block_costs(layout, regime):
    step_cost = StepCost(layout_model(LAYOUTS[layout]))
    generator = np.random.default_rng(int(regime * 10))
    batches, kinds = 40, step_cost.num_kinds
    # Zeros, cached slower than full (caching never pays) and equal costs all occur.
    full = generator.choice([0.0, 1.0, 0.5], (batches, kinds)) * generator.uniform(0.5, 1.5, (batches, kinds))
    cached = full * generator.choice([0.0, 0.3, 1.0, 1.2], (batches, kinds)) * generator.uniform(0.5, 1.0, (batches, kinds))
    load = generator.uniform(0.0, regime, (batches, kinds))
    latency = step_cost.plan_latency(full, cached, load)
    block_kind = np.repeat(step_cost.run_kind, step_cost.run_length.astype(int))
    for b in range(batches):
        costs = BlockCosts(full[b, block_kind], cached[b, block_kind], load[b, block_kind])
        assert latency[b] == pytest.approx(optimal_plan(costs).latency_s, rel=RTOL, abs=1e-15)


def test_latency_keeps_batch_dimensions_and_empty_batches_take_no_time():
    step_cost = StepCost(h800_flux())
    rows = np.stack([step_cost.request_features(4096, masked, 512) for masked in (10, 800, 4096)])
    batches = np.stack([rows, 2 * rows])  # [2, 3, F]
    latency = step_cost.latency(batches)
    assert latency.shape == (2, 3)
    assert latency[1, 2] == pytest.approx(float(step_cost.latency(2 * rows[2])), rel=1e-15)
    assert float(step_cost.latency(np.zeros(step_cost.num_features))) == 0.0


def test_kinds_that_cost_the_same_are_one_run():
    assert StepCost(h800_flux()).run_length.tolist() == [57.0]
    small = StepCost(CostModel.from_json(RESULTS / "cost_flux_small.json"))
    assert small.run_length.tolist() == [2.0, 4.0]


def test_unet_levels_see_fewer_tokens_and_round_masked_up():
    step_cost = StepCost(layout_model(["level0", "level2"]))
    assert step_cost.levels == [0, 2]
    level2 = step_cost.tokens(image_tokens=4096, masked_tokens=17, text_tokens=99, kind=1)
    assert (level2.image, level2.masked, level2.text, level2.cross_keys) == (256, 2, 0, 77)
    assert step_cost.tokens(4096, 4096, 0, kind=1).masked == 256


def test_guidance_copies_are_rows_of_the_request():
    one, two = StepCost(h800_flux()), StepCost(h800_flux(), guidance_copies=2)
    features = one.request_features(4096, 500, 512)
    assert np.array_equal(two.request_features(4096, 500, 512), 2 * features)
    assert float(two.latency(two.request_features(4096, 500, 512))) == float(one.latency(2 * features))
    with pytest.raises(ValueError, match="guidance_copies"):
        StepCost(h800_flux(), guidance_copies=0)


def step_seconds(step_cost: StepCost, ratio: float, batch: int = 1) -> float:
    image = reference_costs.IMAGE_TOKENS
    features = step_cost.request_features(image, round(ratio * image), reference_costs.TEXT_TOKENS)
    return float(step_cost.latency(batch * features))


def test_builtin_model_reproduces_the_papers_figures():
    step_cost, steps = StepCost(h800_flux()), reference_costs.STEPS
    # §3: 2.27 s at mask ratio 20% (Y-cache); §6.3: 1.9x faster than full compute there.
    assert step_seconds(step_cost, 0.2) * steps == pytest.approx(2.27, rel=1e-9)
    assert step_seconds(step_cost, 1.0) * steps == pytest.approx(2.27 * 1.9, rel=1e-9)
    # The calibration assumed a compute-bound step at 20%: cached compute per block exceeds its load.
    image = reference_costs.IMAGE_TOKENS
    _, cached, load = step_cost.block_seconds(step_cost.request_features(image, round(0.2 * image), 512)[None])
    assert cached[0, 0] > load[0, 0]
    # Fig. 15: latency linear in the mask ratio (equal steps of the ratio, equal steps of latency).
    ratios = [0.1, 0.2, 0.3, 0.4]
    differences = np.diff([step_seconds(step_cost, r) for r in ratios])
    assert differences == pytest.approx(differences[0], rel=0.01)
    # §1, not used in the fit: masking magnifies the batching gain at batch 4 by 1.29x.
    gain = {ratio: 4 * step_seconds(step_cost, ratio) / step_seconds(step_cost, ratio, batch=4) for ratio in (0.2, 1.0)}
    assert gain[0.2] / gain[1.0] == pytest.approx(1.29, rel=0.1)
