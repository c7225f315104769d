"""`retouch bench throughput` and `retouch bench serving` on the CPU at tiny sizes: the JSON they print
is the JSON they write, and its figures are consistent with each other."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from retouch.bench import serving, throughput, workload
from retouch.masks import token_mask

TINY = ["--model", "tiny-flux-fill", "--device", "cpu", "--size", "64", "--steps", "2", "--templates", "2"]
COST_MODEL = Path(__file__).resolve().parents[1] / "bench" / "results" / "cpu" / "cost_tiny_flux_fill.json"


def _run(main, argv: list[str], out: Path, capsys) -> dict:
    returned = main([*argv, "--out", str(out)])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == printed == json.loads(json.dumps(returned))
    assert out.with_suffix(".png").stat().st_size > 0
    return printed


class CountedCompile:
    """`torch.compile` replaced by a recorder: what it was given, and how often the result ran (compiling
    for real costs a tiny model ~20 s on this CPU; test_compile.py and test_bench_figures do that)."""

    def __init__(self):
        self.targets, self.calls = [], 0

    def __call__(self, module, **options):
        self.targets.append(module)
        counter = self

        class Compiled(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.module = module

            def forward(self, *args, **kwargs):
                counter.calls += 1
                return module(*args, **kwargs)

            def __getattr__(self, name):  # the pipeline reads config, dtype, ... off its denoiser
                try:
                    return super().__getattr__(name)
                except AttributeError:
                    return getattr(module, name)

        return Compiled()


def _assert_stock_baselines(report: dict, compiled: CountedCompile, denoiser_calls_per_run: int):
    """Both stock baselines ran: the compiled one through torch.compile of an unpatched twin of the
    editor's denoiser."""
    assert list(report["baselines"]) == ["eager", "compiled"] and "torch.compile" in report["baselines"]["compiled"]
    (twin,) = compiled.targets
    assert type(twin).__name__ == "FluxTransformer2DModel"
    assert not any("forward" in block.__dict__ for block in twin.transformer_blocks)  # unpatched
    assert compiled.calls >= denoiser_calls_per_run


def test_throughput_compares_the_same_batches_against_each_stock_baseline(tmp_path, capsys, monkeypatch):
    compiled = CountedCompile()
    monkeypatch.setattr(torch, "compile", compiled)
    report = _run(throughput.main, [*TINY, "--batch-sizes", "1", "2", "--repeats", "1", "--cost-model",
                                    str(COST_MODEL), "--baselines", "compiled,eager"], tmp_path / "throughput.json",
                  capsys)
    assert report["command"].startswith("retouch bench throughput --model tiny-flux-fill")
    assert report["device"] == "cpu" and report["planner"] == "optimal" and report["mask_dist"] == "public"
    assert not report["compiled"] and report["cudagraph_skips"] is None  # no graphs asked for: none counted
    _assert_stock_baselines(report, compiled, denoiser_calls_per_run=2 * 2)  # 2 sizes x (warm-up + 1 repeat)
    rows = report["results"]
    assert [(row["batch_size"], row["baseline"]) for row in rows] == [
        (1, "eager"), (1, "compiled"), (2, "eager"), (2, "compiled")]
    for row in rows:
        for system in ("retouch", "diffusers"):
            assert row[f"{system}_s"] > 0
            assert row[f"{system}_images_per_s"] == pytest.approx(row["batch_size"] / row[f"{system}_s"])
        assert row["speedup"] == pytest.approx(row["retouch_images_per_s"] / row["diffusers_images_per_s"])
        assert 0 < row["mean_mask_ratio"] <= 1
        assert 0 <= row["cached_blocks"] <= report["blocks"]
    for first, second in (rows[:2], rows[2:]):  # retouch is timed once per batch, against both baselines
        assert first["retouch_s"] == second["retouch_s"] and first["diffusers_s"] != second["diffusers_s"]
    assert report["speedup_at_max_batch"] == {"eager": rows[2]["speedup"], "compiled": rows[3]["speedup"]}
    # Every mask-aware edit read the host cache; no template was lost and recorded again.
    assert report["cache"]["hits"] > 0 and report["cache"]["host_templates"] == 2 and report["recomputes"] == 0


def test_serving_serves_every_request_in_every_system(tmp_path, capsys, monkeypatch):
    compiled = CountedCompile()
    monkeypatch.setattr(torch, "compile", compiled)
    rates, requests, max_batch = [4.0, 8.0], 4, 2
    report = _run(serving.main, [*TINY, "--rps", *map(str, rates), "--requests", str(requests), "--max-batch",
                                 str(max_batch), "--baselines", "eager,compiled"], tmp_path / "serving.json", capsys)
    assert report["command"].startswith("retouch bench serving --model tiny-flux-fill")
    _assert_stock_baselines(report, compiled, denoiser_calls_per_run=len(rates) * requests)
    assert list(report["systems"]) == ["retouch", "diffusers", "diffusers-compiled"]
    assert report["cudagraph_skips"] is None
    assert [row["rps"] for row in report["results"]] == rates
    for row in report["results"]:
        assert row["requests"] == requests and 0 < row["mean_mask_ratio"] <= 1
        for system in report["systems"]:
            result = row[system]
            assert result["ok"] == requests and result["failed"] == 0 and result["errors"] == {}
            latencies = result["e2e_s"]
            assert len(latencies) == requests and min(latencies) > 0
            assert min(latencies) <= result["p50_s"] <= result["p95_s"] <= result["max_s"] == max(latencies)
            assert result["mean_s"] == pytest.approx(sum(latencies) / requests)
            assert 1 <= result["mean_batch_size"] <= max_batch and result["batches"] >= 1
        for baseline, system in serving.BASELINE_SYSTEMS.items():
            # The static baseline runs a batch's steps together: its batches hold every request once.
            assert row[system]["mean_batch_size"] * row[system]["batches"] == pytest.approx(requests)
            for metric in ("mean", "p95"):
                assert row[f"{metric}_speedup"][baseline] == pytest.approx(
                    row[system][f"{metric}_s"] / row["retouch"][f"{metric}_s"])
    assert report["recomputes"] == 0


def test_serving_needs_one_device_per_worker():
    with pytest.raises(SystemExit) as exit_info:
        serving.main([*TINY, "--workers", "2"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("ratio", [0.0, 0.01, 0.19, 0.5, 1.0])
@pytest.mark.parametrize("size,stride", [(64, 16), (256, 16), (96, 8)])
def test_rectangle_masks_cover_whole_tokens(ratio, size, stride):
    rng = np.random.default_rng(0)
    grid = size // stride
    for _ in range(5):
        mask, masked = workload.rectangle_mask(rng, size, stride, ratio)
        tokens = token_mask(mask, stride)
        assert mask.size == (size, size) and tokens.shape == (grid, grid)
        assert int(tokens.sum()) == masked >= 1
        # A rectangle: its bounding box is full.
        rows, cols = tokens.any(1).nonzero().flatten(), tokens.any(0).nonzero().flatten()
        assert masked == len(rows) * len(cols)
    if ratio == 1.0:
        assert masked == grid * grid


def test_poisson_arrivals_and_mask_ratios():
    rng = np.random.default_rng(0)
    arrivals = workload.poisson_arrivals(rng, 2000, 4.0)
    assert arrivals[0] > 0 and (np.diff(arrivals) > 0).all()
    assert arrivals[-1] / len(arrivals) == pytest.approx(0.25, rel=0.1)
    assert workload.mask_ratios(rng, 2000, "public").mean() == pytest.approx(0.19, abs=0.02)
    assert workload.mask_ratios(rng, 2000, "production").mean() == pytest.approx(0.11, abs=0.02)
    assert (workload.mask_ratios(rng, 3, "public", fixed=0.3) == 0.3).all()
