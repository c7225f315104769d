"""The benchmarks behind `retouch bench`: the JSON they print has the promised shape and content."""

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retouch.bench import fidelity, flops, lora, mixed, overhead, step

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "cpu"


def assert_made_by(report: dict, bench: str) -> None:
    """A result says how it was made: its command, versions, commit and device (README, Benchmarks)."""
    assert report["command"].startswith(f"retouch bench {bench} ")
    assert report["versions"]["torch"] and "retouch_commit" in report and report["device_name"]


def test_step_times_every_mode_per_ratio(tmp_path, capsys):
    report = step.main(["--model", "tiny-flux-fill", "--mask-ratio", "0.25,1.0", "--repeats", "1",
                        "--out", str(tmp_path / "r.json")])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    saved = json.loads((tmp_path / "r.json").read_text())
    assert printed["results"] == saved["results"] == report["results"]
    assert [(row["mode"], row["masked_tokens"]) for row in saved["results"]] == [
        ("y-cache", 16), ("kv-cache", 16), ("y-cache", 64), ("kv-cache", 64)]
    for row in saved["results"]:
        assert row["mask_aware_s"] > 0
        assert row["speedup"] == pytest.approx(row["full_s"] / row["mask_aware_s"], rel=1e-2, abs=0.005)  # 2 places
    assert (tmp_path / "r.png").stat().st_size > 0
    assert_made_by(saved, "step")


def test_overhead_counts_ops_and_host_syncs_per_variant(tmp_path, capsys):
    report = overhead.main(["--model", "flux-size", "--grid", "4", "--text-tokens", "4", "--mask-ratios", "0.25",
                            "--repeats", "1", "--out", str(tmp_path / "o.json")])
    rows = {row["variant"]: row for row in report["results"]}
    assert set(rows) == {"full", "y@0.25", "kv@0.25"} and report["blocks"] == 19 + 38
    for row in rows.values():
        assert row["host_ms"] > 0 and row["ops"] == pytest.approx(row["ops_per_block"] * report["blocks"])
        assert row["host_syncs"] == 0
    # The masked blocks issue fewer ops than the stock blocks (the first target, counted).
    assert rows["y@0.25"]["ops_per_block"] < rows["full"]["ops_per_block"]
    assert rows["kv@0.25"]["ops_per_block"] < rows["full"]["ops_per_block"]
    assert report["summary"]["max_host_syncs"] == 0
    assert json.loads((tmp_path / "o.json").read_text())["results"] == report["results"]
    assert (tmp_path / "o.png").stat().st_size > 0


def test_mixed_times_one_forward_against_one_per_size_on_the_same_requests(tmp_path):
    report = mixed.main(["--model", "tiny-flux-fill", "--sizes", "64,96,128", "--per-size", "2", "--repeats", "1",
                         "--out", str(tmp_path / "m.json")])
    assert report["image_tokens"] == [16, 16, 36, 36, 64, 64]
    assert [row["mode"] for row in report["results"]] == ["y-cache", "kv-cache"]
    for row in report["results"]:
        # rounded to 3 decimals: a ratio near 0 (a noisy moment on a shared CPU) is off by up to 5e-4
        assert row["throughput_ratio"] == pytest.approx(row["per_size_s"] / row["mixed_s"], rel=1e-2, abs=5e-4)
        assert row["max_abs_difference"] <= 1e-5  # the same requests, computed both ways
    assert (tmp_path / "m.png").stat().st_size > 0
    assert_made_by(report, "mixed")


def test_lora_reports_each_batch_against_the_batch_without_lora(tmp_path):
    report = lora.main(["--model", "tiny-flux-fill", "--batch", "3", "--rank", "4", "--resolution", "64",
                        "--repeats", "1", "--skip-load", "--out", str(tmp_path / "l.json")])
    assert [row["mode"] for row in report["steps"]] == ["y-cache", "full"]
    for row in report["steps"]:
        assert set(row["seconds"]) == {"none", "1 adapter", "3 adapters"}
        for name, ratio in row["overhead"].items():
            assert ratio == pytest.approx(row["seconds"][name] / row["seconds"]["none"] - 1, abs=1e-3)
    assert "loading" not in report and (tmp_path / "l.png").stat().st_size > 0
    assert_made_by(report, "lora")


def test_lora_loading_reports_the_hidden_share_of_the_load_it_measured(tmp_path, monkeypatch):
    """The loading part on a tiny model: every variant timed (each asynchronous one beside the loaded adapter held
    back to its step: the bench refuses a pair whose steps differ), the load read once per round (sync reads it
    cold), and the headline share is the engine's default (load from submission), from its own figures.
    Its adapter file goes with it (each run left a folder in /tmp)."""
    import tempfile

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    report = lora.main(["--model", "tiny-flux-fill", "--batch", "2", "--rank", "4", "--resolution", "64",
                        "--repeats", "1", "--load-rank", "8", "--engine-resolution", "64", "--steps", "2",
                        "--load-repeats", "2"])
    loading = report["loading"]
    assert set(loading["e2e_s"]) == {"none", "sync", "warm", "async", "async+prefetch", "held@async",
                                     "held@async+prefetch", "sync/buffered", "async+prefetch/buffered",
                                     "held@async+prefetch/buffered"}
    assert loading["read_s"] > 0 and 0 <= loading["read_cpu_s"] and loading["adapter_mib"] > 0
    assert loading["read_fallbacks"] == 0  # every cold read found the memory the cleared adapter left
    buffered = loading["buffered_reads"]  # the same rounds reading through the page cache: its own load cost
    assert buffered["read_s"] > 0 and buffered["read_cpu_s"] >= 0
    for name, load_cost in (("async", loading["load_cost_s"]), ("async+prefetch", loading["load_cost_s"]),
                            ("async+prefetch/buffered", buffered["load_cost_s"])):
        assert 0 <= loading[name]["applied_step"] <= 2
        if load_cost > 0:
            assert loading[name]["hidden_share"] == pytest.approx(1 - loading[name]["exposed_load_s"] / load_cost,
                                                                  abs=1e-3)
        low, _, high = loading[name]["exposed_quartiles_s"]
        assert low <= high
    assert loading["hidden_share"] == loading["async+prefetch"]["hidden_share"]
    part = loading["text_encoder_part"]  # the same adapter with text-encoder factors: their part read alone
    assert 0 < part["part_mib"] < part["file_mib"] and part["read_s"] > 0
    assert not list(scratch.glob("retouch-bench-lora-*"))


@pytest.mark.parametrize("options", [["--load-repeats", "0"], ["--rank", "0"]])
def test_lora_options_are_checked(options, capsys):
    with pytest.raises(SystemExit) as exit_:
        lora.main(["--model", "tiny-flux-fill", *options])
    assert exit_.value.code == 2 and "--load-repeats" in capsys.readouterr().err


@pytest.mark.parametrize("options, named", [(["--mask-ratio", "2"], "--mask-ratio"),
                                            (["--mask-ratio", "-0.5"], "--mask-ratio"),
                                            (["--mask-ratio", "abc"], "--mask-ratio"),
                                            (["--repeats", "0"], "--repeats"),
                                            (["--resolution", "0"], "--resolution"), (["--dtype", "foo"], "--dtype"),
                                            (["--device", "gpu"], "--device"),
                                            (["--baselines", "eager,fast"], "--baselines"),
                                            (["--baselines", ""], "--baselines")])
def test_step_options_are_checked(options, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        step.main(["--model", "tiny-flux-fill", *options])
    assert exit_.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.parametrize("options", [["--sizes", "64"], ["--sizes", "64,100"], ["--sizes", "a,b"],
                                     ["--sizes", "16,160000"], ["--per-size", "0"], ["--mask-ratio", "0"]])
def test_mixed_options_are_checked(options, capsys):
    with pytest.raises(SystemExit) as exit_:
        mixed.main(["--model", "tiny-flux-fill", *options])
    assert exit_.value.code == 2 and "--" in capsys.readouterr().err


SHARED_BAD_OPTIONS = [(["--out", "/proc/no/such.json"], "--out"), (["--device", "gpu"], "--device"),
                      (["--out", "plot.png"], "--out"),  # the plot, written beside the JSON, overwrote it
                      *([(["--device", "cuda"], "--device")] if not torch.cuda.is_available() else []),
                      (["--dtype", "int8"], "--dtype"),
                      (["--resolution", "99999999"], "--resolution"), (["--resolution", "17"], "--resolution"),
                      (["--cost-model", "/no/such.json"], "--cost-model"), (["--host-gib", "nan"], "--host-gib"),
                      (["--mask-ratio", "0.2,0.3"], "--mask-ratio")]


@pytest.mark.parametrize("name", ["block", "image", "overlap", "lora", "mixed", "batching", "throughput", "flops",
                                  "planner", "copy", "fidelity", "serve", "overhead", "attention"])
def test_every_benchmark_refuses_bad_shared_options_at_parsing(name, capsys):
    """An --out that cannot be written failed after the whole run; --device gpu, --dtype int8 or a resolution of
    10^8 px were tracebacks or out-of-memory kills. Each is now argparse's one line naming the flag, exit 2."""
    import importlib

    bench = importlib.import_module(f"retouch.bench.{name}")
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    flags = capsys.readouterr().out
    summary = bench.__doc__.split("\n\n")[0].split()  # the help shows it whole, not its first line cut short
    assert " ".join(summary[-4:]) in " ".join(flags.split()).replace("- ", "-")
    tried = [(options, named) for options, named in SHARED_BAD_OPTIONS if f"{named} " in flags]
    assert tried, flags
    for options, named in tried:
        with pytest.raises(SystemExit) as exit_:
            bench.main(options)
        error = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and named in error and len(error.splitlines()) == 1, error


@pytest.mark.parametrize("name, options, named", [
    ("overlap", ["--model", "nope"], "--model"), ("overlap", ["--steps", "0"], "--steps"),
    ("overlap", ["--lookahead", "-1"], "--lookahead"), ("copy", ["--tokens-per-request", "0"], "tokens_per_request"),
    ("mixed", ["--model", "tiny-flux-fill", "--repeats", "0"], "--repeats"),
    ("batching", ["--max-batch", "0"], "--max-batch"), ("batching", ["--rps", "nan"], "--rps"),
    ("serve", ["--timeout", "nan"], "--timeout"), ("lora", ["--engine-model", "nope"], "--engine-model"),
    ("lora", ["--model", "tiny-flux-fill", "--steps", "0"], "--steps"), ("serving", ["--rps", "nan"], "--rps"),
    ("serving", ["--model", "nope"], "neither a built-in model"),
    ("throughput", ["--model", "nope"], "neither a built-in model")])
def test_benchmark_specific_options_are_checked_before_building(name, options, named, capsys):
    import importlib

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"retouch.bench.{name}").main(options)
    assert exit_.value.code == 2 and named in capsys.readouterr().err


def test_flops_match_the_per_op_prediction(tmp_path):
    out = tmp_path / "flops.json"
    report = flops.main(["--model", "tiny-flux-fill", "--mask-ratios", "0.2,1.0", "--out", str(out)])
    assert json.loads(out.read_text())["results"] == report["results"] and out.with_suffix(".png").stat().st_size > 0
    rows = {(row["mask_ratio"], row["mode"]): row for row in report["results"]}
    for row in rows.values():
        assert row["flops_ratio"] == row["theory"]
    assert rows[(1.0, "y-cache")]["flops_ratio"] == rows[(1.0, "kv-cache")]["flops_ratio"] == 1.0
    partial = [row for (ratio, _), row in rows.items() if ratio < 1]
    assert all(row["flops_ratio"] < 1 for row in partial)
    assert rows[(partial[0]["mask_ratio"], "kv-cache")]["flops"] < rows[(partial[0]["mask_ratio"], "y-cache")]["flops"]


def test_fidelity_against_full_compute(tmp_path):
    out = tmp_path / "fidelity.json"
    report = fidelity.main(["--mask-ratios", "0.2", "--steps", "2", "--out", str(out)])
    assert json.loads(out.read_text())["results"] == report["results"] and out.with_suffix(".png").stat().st_size > 0
    assert report["command"].startswith("retouch bench fidelity")
    assert {row["mode"] for row in report["results"]} == {"y-cache", "kv-cache"}
    for row in report["results"]:
        assert row["unmasked_equal_template"]
        # A cache from another prompt and seed perturbs the edit only slightly (random weights).
        assert row["psnr_db"] > 30 and 0.9 < row["ssim"] <= 1.0


@pytest.mark.parametrize("argv, named", [(["--cache-dtypes", "fp8"], "--cache-dtypes"),
                                         (["--mask-ratios", "0"], "--mask-ratios"),
                                         (["--size", "100"], "--size"), (["--steps", "0"], "--steps"),
                                         (["--size", "1600000"], "--size")])  # once drawn until memory ran out
def test_fidelity_refuses_bad_options(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        fidelity.main(argv)
    assert exit_info.value.code == 2 and named in capsys.readouterr().err


def test_ssim_and_psnr_definitions():
    import numpy as np

    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    assert fidelity.ssim(image, image) == pytest.approx(1.0)
    assert fidelity.psnr(image, image) == float("inf")
    noisy = np.clip(image.astype(int) + 10, 0, 255).astype(np.uint8)
    assert fidelity.ssim(image, noisy) < 1.0 and fidelity.psnr(image, noisy) < 40


def test_cli_dispatches_benchmarks(cli):
    result = cli("bench", "flops", "--model", "tiny-flux-fill", "--mask-ratios", "1.0")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["results"][0]["flops_ratio"] == 1.0
    unknown = cli("bench", "nope")
    assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1


def test_batching_compares_every_mode_on_the_same_arrivals(tmp_path):
    from retouch.bench import batching

    out = tmp_path / "batching.json"
    report = batching.main(["--compare", "--requests", "6", "--rps", "50", "--steps", "3", "--size", "64",
                            "--templates", "2", "--out", str(out)])
    assert set(report["modes"]) == {"static", "naive", "disagg"}
    for mode in report["modes"].values():
        assert mode["ok"] == 6 and mode["failed"] == 0
        assert 0 < mode["p50_s"] <= mode["p95_s"] and mode["overhead_per_step_s"] >= 0
    assert report["modes"]["disagg"]["interruptions"] == 0
    assert report["disagg_p95_over_static_p95"] == report["modes"]["disagg"]["p95_s"] / report["modes"]["static"]["p95_s"]
    assert 0 < report["mean_mask_ratio"] < 1
    assert json.loads(out.read_text())["requests"] == 6 and out.with_suffix(".png").exists()
    assert_made_by(report, "batching")


@pytest.mark.parametrize("bench", ["overhead", "block", "image"])
@pytest.mark.parametrize("ratios, message", [("0.2,x", "comma-separated numbers"), ("0.2,1.5", "must lie in (0, 1]"),
                                             ("0", "must lie in (0, 1]")])
def test_mask_ratios_are_checked_before_anything_runs(bench, ratios, message, capsys):
    import importlib

    with pytest.raises(SystemExit) as exited:
        importlib.import_module(f"retouch.bench.{bench}").main(["--mask-ratios", ratios])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_benchmark_json_is_strict_json(tmp_path):
    """PSNR of equal images is infinite: Python would write `Infinity`, which JSON.parse and jq refuse."""
    from retouch.bench.report import json_text, write_json

    report = {"psnr_db": float("inf"), "nested": [{"x": float("nan")}, (1.5, float("-inf"))], "n": 3}
    write_json(report, tmp_path / "r.json")

    def refuse(constant):
        raise ValueError(constant)

    for text in ((tmp_path / "r.json").read_text(), json_text(report)):
        assert json.loads(text, parse_constant=refuse) == {"psnr_db": None, "nested": [{"x": None}, [1.5, None]],
                                                            "n": 3}


def test_step_trace_profiles_each_variant_once_and_writes_its_chrome_trace(tmp_path):
    import gzip

    report = step.main(["--model", "tiny-flux-fill", "--mask-ratio", "0.5,0.25", "--repeats", "1", "--trace",
                        "--out", str(tmp_path / "s.json")])
    traces = report["traces"]
    assert traces["mask_ratio"] == 0.25  # the timed ratio nearest 0.2
    assert set(traces["variants"]) == {"eager", "y-cache", "kv-cache"}
    for name, summary in traces["variants"].items():
        assert summary["wall_ms"] > 0 and summary["host_ops"] > 0 and summary["kernels"] == 0  # a CPU: no device
        assert summary["device_busy_ms"] is None and summary["device_idle_share"] is None
        assert 0 < len(summary["top"]) <= 5 and sum(op["share"] for op in summary["top"]) <= 1.0001
        with gzip.open(tmp_path / summary["trace"]) as trace:
            assert json.load(trace)["traceEvents"]
    # The masked forwards issue fewer ops than the stock one.
    assert traces["variants"]["y-cache"]["host_ops"] < traces["variants"]["eager"]["host_ops"]


def test_device_busy_time_counts_overlapping_streams_once():
    """A kernel on the compute stream and a copy on the copy stream that overlap are one busy interval;
    the gaps between are the device waiting for the host."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from retouch.bench import trace

    def event(name, start, end, device_type=DeviceType.CUDA):
        span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
        return SimpleNamespace(name=name, time_range=span, device_type=device_type, cpu_parent=None,
                               cpu_time_total=end - start)

    events = [event("gemm", 0, 400), event("copy", 300, 600), event("gemm", 800, 1000),
              event("aten::linear", 0, 50, DeviceType.CPU)]
    summary = trace.summarize(events, wall_s=1e-3, device=torch.device("cuda"))
    assert summary["device_busy_ms"] == 0.8 and summary["device_idle_share"] == 0.2
    assert summary["kernels"] == 3 and summary["host_ops"] == 1
    assert summary["top"][0] == {"name": "gemm", "ms": 0.6, "share": 0.6667}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 60)), max_size=12))
def test_busy_time_is_the_measure_of_the_union_of_the_intervals(spans):
    """Whatever streams overlap, nest or touch: the busy time is the time at least one interval covers."""
    from retouch.bench.trace import covered_us

    intervals = [(float(start), float(start + length)) for start, length in spans]
    covered = {tick for start, length in spans for tick in range(start, start + length)}
    assert covered_us(intervals) == len(covered)


def test_a_cost_model_of_another_model_is_a_one_line_error_naming_the_flag(capsys):
    """It was SystemExit(message): the message, but exit 1, the CLI's code for its own failures."""
    from retouch.cli import main

    assert main(["bench", "image", "--model", "tiny-sd3-inpaint", "--device", "cpu",
                 "--cost-model", str(RESULTS / "cost_tiny_flux_fill.json")]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("retouch: error: --cost-model") and "profiled on tiny-flux-fill" in error


@pytest.mark.parametrize("name", ["batching", "planner", "serve", "throughput", "image"])
def test_a_negative_seed_is_refused_at_parsing(name, capsys):
    """numpy's generators refuse it: after the model was built (exit 1)."""
    import importlib

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"retouch.bench.{name}").main(["--seed", "-1"])
    assert exit_.value.code == 2 and "--seed" in capsys.readouterr().err



def test_an_adapter_held_back_to_step_k_is_ready_from_the_kth_question():
    asked = []
    held = lora._held_back(lambda futures: asked.append(futures) or True, 2)
    assert [held("f") for _ in range(4)] == [False, False, True, True] and asked == ["f", "f"]
