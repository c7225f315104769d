"""`retouch profile` writes cost models the planner reads; the cache benchmarks run at tiny sizes."""

import json

import pytest
import torch

from retouch.bench import copy as copy_bench
from retouch.bench import overlap
from retouch.config import ProfileOptions
from retouch.costs import FEATURES, VARIANTS, CostModel, RequestTokens
from retouch.errors import InputError, RetouchError
from retouch.planner import optimal_plan
from retouch.profile import run_profile

QUICK = dict(grids="4,6,8", batch_sizes="1,2", mask_ratios="0.25,0.5,1.0", repeats=1, load_mib="0.5,2,8")


@pytest.mark.parametrize("model, kinds", [("tiny-flux-fill", ("double", "single", "single")),
                                          ("tiny-sd3-inpaint", ("joint", "joint-last")),
                                          ("tiny-sdxl-inpaint", None)])
def test_profile_writes_a_cost_model_the_planner_reads(tmp_path, model, kinds):
    out = tmp_path / "cost.json"
    written = run_profile(ProfileOptions(model=model, out=out, **QUICK), torch.device("cpu"), torch.float32,
                          command="test", progress=False)
    loaded = CostModel.from_json(out)
    assert loaded == written and loaded.model == model
    if kinds is not None:
        assert loaded.block_kinds == kinds
    for kind in set(loaded.block_kinds):
        assert set(loaded.compute[kind]) == set(VARIANTS)
        assert all(fit.samples >= 5 for fit in loaded.compute[kind].values())
    assert loaded.load.coef[0] > 0  # more bytes take longer
    row = {kind: RequestTokens(text=0 if kind.startswith("level") else 4, image=64, masked=16,
                               cross_keys=77 if kind.startswith("level") else 0) for kind in set(loaded.block_kinds)}
    plan = optimal_plan(loaded.block_costs([row], "y"))
    assert len(plan.use_cache) == len(loaded.block_kinds)


def test_profile_records_the_timed_blocks_only_and_frees_each_point_before_the_next(tmp_path, monkeypatch):
    """Device memory at flux-size: a point records only the representative blocks it times, and its
    recording is gone (no reference left, no garbage collection needed) when the next point records."""
    import weakref

    from retouch.profile import Target

    recordings, record = [], Target.record

    def tracked(self, *args, **kwargs):
        assert all(cache() is None for cache in recordings)  # the previous points' recordings are freed
        captured, cache = record(self, *args, **kwargs)
        assert {key[2] for key in cache._tensors} == set(self.representative.values())
        recordings.append(weakref.ref(cache))
        return captured, cache

    monkeypatch.setattr(Target, "record", tracked)
    run_profile(ProfileOptions(model="tiny-flux-fill", out=tmp_path / "cost.json", **QUICK), torch.device("cpu"),
                torch.float32, command="test", progress=False)
    assert len(recordings) == 6  # 3 grids x 2 batch sizes


def test_a_load_fit_that_does_not_grow_with_bytes_is_refused(tmp_path, monkeypatch):
    """A busy machine can time the larger copies faster; the planner must not learn that loads are free."""
    from retouch import profile

    monkeypatch.setattr(profile, "profile_blocks", lambda *args: ([{"kind": "double", "variant": v, "seconds": 1.0,
                                                                    **dict.fromkeys(FEATURES, 1.0)}
                                                                   for v in VARIANTS for _ in range(6)], {}))
    monkeypatch.setattr(profile, "profile_loads", lambda *args: [{"bytes": float(b), "seconds": 1e-3 / b}
                                                                 for b in (1, 2, 4)])
    monkeypatch.setattr(profile, "build_target", lambda *args: type("T", (), {"representative": {"double": 0},
                                                                             "kinds": ("double",)})())
    out = tmp_path / "cost.json"
    with pytest.raises(RetouchError, match="did not grow with bytes"):
        run_profile(ProfileOptions(model="tiny-flux-fill", out=out, **QUICK), torch.device("cpu"), torch.float32,
                    command="test", progress=False)
    assert not out.exists()


def test_profile_options_are_checked():
    with pytest.raises(InputError, match="mask-ratios"):
        ProfileOptions(model="tiny-flux-fill", mask_ratios="0.5,2")
    with pytest.raises(InputError, match="grids"):
        ProfileOptions(model="tiny-flux-fill", grids="a,b")
    for bad in ("nan,8,16", "inf", "0.5,8", "8,-16"):
        with pytest.raises(InputError, match="--grids"):
            ProfileOptions(model="tiny-flux-fill", grids=bad)
    with pytest.raises(InputError, match="--batch-sizes"):
        ProfileOptions(model="tiny-flux-fill", batch_sizes="1,1.5")
    with pytest.raises(InputError, match="--grids values must be at most"):  # once 4 TB asked of the allocator
        ProfileOptions(model="tiny-flux-fill", grids="1000000,8,12,16")
    with pytest.raises(InputError, match="--batch-sizes values must be at most"):
        ProfileOptions(model="tiny-flux-fill", batch_sizes="1,2,100000")
    # The full-compute fit has one sample per (grid, batch size): too few points fail only after the timing.
    with pytest.raises(InputError, match="4 distinct points"):
        ProfileOptions(model="tiny-flux-fill", grids="8,16,16", batch_sizes="1,2,1")
    ProfileOptions(model="tiny-flux-fill", grids="8,16,24", batch_sizes="1,2")
    with pytest.raises(InputError, match="--load-mib"):
        ProfileOptions(model="tiny-flux-fill", load_mib="4,4")


def test_profile_cli_rejects_bad_input(cli_here, tmp_path):
    result = cli_here("profile", "--model", "no-such-model", "--out", tmp_path / "c.json")
    assert result.returncode == 2 and "no-such-model" in result.stderr and "Traceback" not in result.stderr
    result = cli_here("profile", "--model", "tiny-flux-fill", "--repeats", "0")
    assert result.returncode == 2 and "--repeats" in result.stderr


def test_a_load_size_the_machine_cannot_hold_is_refused_before_any_block_is_timed(tmp_path, monkeypatch):
    """`--load-mib 1,1e12` was an internal error (exit 1) after every block had been profiled."""
    import retouch.profile as profile

    built = []
    monkeypatch.setattr(profile, "build_target", lambda *args: built.append(args))
    options = ProfileOptions(model="tiny-flux-fill", out=tmp_path / "c.json", **{**QUICK, "load_mib": "1,1e12"})
    with pytest.raises(InputError, match=r"host memory for the largest --load-mib: ask for less"):
        run_profile(options, torch.device("cpu"), torch.float32, command="test")
    assert built == [] and not (tmp_path / "c.json").exists()


def test_overlap_bench_compares_every_variant_on_the_cpu(tmp_path):
    cost = tmp_path / "cost.json"
    run_profile(ProfileOptions(model="tiny-flux-fill", out=cost, **QUICK), torch.device("cpu"), torch.float32,
                command="test", progress=False)
    report = overlap.main(["--model", "tiny-flux-fill", "--device", "cpu", "--steps", "2", "--repeats", "1",
                           "--cost-model", str(cost), "--baselines", "compiled,eager",
                           "--out", str(tmp_path / "overlap.json")])
    variants = {row["variant"]: row for row in report["results"]}
    assert set(variants) == {"ideal", "planned", "pipelined", "naive", "full", "full-compiled"}
    assert variants["ideal"]["vs_ideal"] == 1.0
    assert list(report["baselines"]) == ["eager", "compiled"]
    for row in variants.values():  # every variant against both stock baselines, timed in the same run
        for baseline, full in (("eager", "full"), ("compiled", "full-compiled")):
            assert row["speedup_vs"][baseline] == pytest.approx(variants[full]["image_s"] / row["image_s"],
                                                                rel=1e-2, abs=0.005)
    assert variants["full"]["speedup_vs"]["eager"] == variants["full-compiled"]["speedup_vs"]["compiled"] == 1.0
    assert report["copy"]["bytes"] > 0 and len(report["plan"]) == 3
    assert (tmp_path / "overlap.png").exists() and json.loads((tmp_path / "overlap.json").read_text())


def test_copy_bench_quick():
    report = copy_bench.main(["--quick"])
    assert report["results"] and all(row["gather_gbps"] > 0 and row["baseline_gbps"] > 0 for row in report["results"])
