"""The paper-figure benchmarks (block, image) and bench/run_gpu.sh, run on the CPU at tiny sizes: the
JSON they write has the promised shape, and its numbers are consistent with each other."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from retouch.bench import block, image
from retouch.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
TINY_FLUX_COST = ROOT / "bench" / "results" / "cpu" / "cost_tiny_flux_fill.json"


def _assert_records_how_it_was_made(report: dict, bench: str):
    assert report["command"].startswith(f"retouch bench {bench} ")
    assert report["versions"]["torch"] and report["versions"]["diffusers"]
    assert report["device"] == "cpu" and report["device_name"].startswith("cpu")


def test_block_times_every_kind_in_both_modes_against_both_stock_baselines(tmp_path, capsys):
    report = block.main(["--model", "tiny-flux-fill", "--mask-ratios", "0.25,1.0", "--repeats", "1",
                         "--baselines", "eager,compiled", "--out", str(tmp_path / "block.json")])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report
    assert json.loads((tmp_path / "block.json").read_text()) == report
    assert (tmp_path / "block.png").stat().st_size > 0
    _assert_records_how_it_was_made(report, "block")
    assert list(report["baselines"]) == ["eager", "compiled"] and "torch.compile" in report["baselines"]["compiled"]
    assert report["cudagraph_skips"] is None
    rows = report["results"]
    assert {(row["kind"], row["mask_ratio"], row["mode"], row["baseline"]) for row in rows} == {
        (kind, ratio, mode, baseline) for kind in ("double", "single") for ratio in (0.25, 1.0)
        for mode in ("y-cache", "kv-cache") for baseline in ("eager", "compiled")}
    assert len(rows) == 16
    for row in rows:
        assert row["masked_tokens"] == round(row["mask_ratio"] * row["image_tokens"]) and row["image_tokens"] == 64
        assert row["speedup"] == pytest.approx(row["full_s"] / row["mask_aware_s"], rel=1e-2, abs=0.005)  # 2 places
    # Each baseline is timed once per ratio and shared by both modes' rows; each mode once, quoted twice.
    for kind in ("double", "single"):
        for ratio in (0.25, 1.0):
            point = [row for row in rows if row["kind"] == kind and row["mask_ratio"] == ratio]
            for baseline in ("eager", "compiled"):
                assert len({row["full_s"] for row in point if row["baseline"] == baseline}) == 1
            for mode in ("y-cache", "kv-cache"):
                assert len({row["mask_aware_s"] for row in point if row["mode"] == mode}) == 1
            assert len({row["full_s"] for row in point}) == 2


def test_cuda_graphs_imply_compile_and_the_compiled_baseline(capsys):
    """`--cuda-graphs` (the figures' lever against launch-bound steps) compiles retouch's side as --compile
    does, times the compiled stock model by default, and is refused off CUDA where the editor captures."""
    import argparse

    from retouch.bench import stock

    parser = argparse.ArgumentParser()
    stock.add_options(parser)
    graphs = parser.parse_args(["--cuda-graphs"])
    assert stock.compiled(graphs) and stock.chosen(graphs) == ("eager", "compiled")
    plain = parser.parse_args([])
    assert not stock.compiled(plain) and stock.chosen(plain) == ("eager",)
    # Where inductor declines to capture a core, the report says how often (and stderr, why to look).
    from torch._dynamo.utils import counters

    before = counters["inductor"]["cudagraph_skips"]
    counters["inductor"]["cudagraph_skips"] += 2
    try:
        assert stock.cudagraph_skips(graphs) == before + 2 and stock.cudagraph_skips(plain) is None
        assert "skipped capturing" in capsys.readouterr().err
    finally:
        counters["inductor"]["cudagraph_skips"] = before
    with pytest.raises(InputError, match="cuda_graphs needs a CUDA device"):
        image.main(["--model", "tiny-flux-fill", "--steps", "1", "--repeats", "1", "--mask-ratios", "0.2",
                    "--modes", "y", "--cuda-graphs"])


def test_image_latency_follows_the_issue_format_with_the_planner_on(tmp_path):
    report = image.main(["--model", "tiny-flux-fill", "--steps", "2", "--repeats", "1", "--mask-ratios", "0.2,0.9",
                         "--cost-model", str(TINY_FLUX_COST), "--out", str(tmp_path / "image_latency.json")])
    assert json.loads((tmp_path / "image_latency.json").read_text()) == report
    assert (tmp_path / "image_latency.png").stat().st_size > 0
    _assert_records_how_it_was_made(report, "image")
    assert report["model"] == "tiny-flux-fill" and report["planner"] == "optimal" and report["steps"] == 2
    assert report["cache"]["recorded"] == "kv-cache"  # one recording serves both modes
    blocks = len(json.loads(TINY_FLUX_COST.read_text())["block_kinds"])
    assert [(row["mask_ratio"], row["mode"]) for row in report["results"]] == [
        (0.1875, "y-cache"), (0.875, "y-cache"), (0.1875, "kv-cache"), (0.875, "kv-cache")]
    for row in report["results"]:
        assert set(row) >= {"mask_ratio", "mode", "full_s", "mask_aware_s", "speedup"}
        assert row["speedup"] == pytest.approx(row["full_s"] / row["mask_aware_s"], rel=1e-2, abs=0.005)  # 2 places
        assert len(row["plan"]) == blocks and set(row["plan"]) <= {"c", "f"}


def test_image_latency_at_a_strength_runs_its_last_steps_and_refuses_less_than_one(capsys):
    report = image.main(["--model", "tiny-sdxl-inpaint", "--steps", "4", "--strengths", "1,0.5", "--repeats", "1",
                         "--mask-ratios", "0.2,0.5", "--modes", "y"])
    rows = report["results"]
    assert report["cache"]["recorded"] == "y-cache"  # outputs only: a third of a KV-cache recording's bytes
    assert [(row["strength"], row["steps_run"], row["mode"]) for row in rows] == [
        (1.0, 4, "y-cache"), (1.0, 4, "y-cache"), (0.5, 2, "y-cache"), (0.5, 2, "y-cache")]
    assert rows[0]["full_s"] == rows[1]["full_s"] != rows[2]["full_s"] == rows[3]["full_s"]
    with pytest.raises(SystemExit):
        image.main(["--model", "tiny-sdxl-inpaint", "--steps", "4", "--strengths", "1,0.2"])
    assert "--strengths: strength 0.2 of 4 steps is less than one step's worth" in capsys.readouterr().err


def test_image_latency_stores_the_template_in_the_cache_dtype_asked_for():
    """--cache-dtype float8_e4m3fn: half the bytes of bf16 (a 28-step KV-cache flux-size template fits a
    128 GiB machine), a quarter of fp32 (here) plus its per-row scales."""
    common = ["--model", "tiny-flux-fill", "--steps", "2", "--repeats", "1", "--mask-ratios", "0.2", "--modes", "kv"]
    full = image.main(common)["cache"]
    fp8 = image.main([*common, "--cache-dtype", "float8_e4m3fn"])["cache"]
    assert (full["dtype"], fp8["dtype"]) == ("auto", "float8_e4m3fn")
    assert 0.25 < fp8["template_bytes"] / full["template_bytes"] < 0.3


def test_image_latency_compiled_races_eager_and_compiled_stock_in_one_run(monkeypatch):
    """`--compile`: the mask-aware edit runs compiled blocks, against two baselines timed in the same run:
    the pipeline with an unpatched twin of its denoiser eager and under torch.compile (whole model); the
    twin shares the editor's weights (no second copy of the transformer)."""
    import torch

    from retouch.adapters.base import MaskAwareAdapter
    from retouch.editor import MaskAwareEditor

    compiled, compile_, editors = [], torch.compile, []

    def recorded(target, **options):
        compiled.append(target)
        return compile_(target, **options)

    monkeypatch.setattr(torch, "compile", recorded)
    init = MaskAwareEditor.__init__

    def kept(self, *args, **kwargs):
        init(self, *args, **kwargs)
        editors.append(self)

    monkeypatch.setattr(MaskAwareEditor, "__init__", kept)
    eager_blocks, compiled_when_eager = MaskAwareAdapter.eager, []

    def counted(self):
        compiled_when_eager.append(self.compiling)
        return eager_blocks(self)

    monkeypatch.setattr(MaskAwareAdapter, "eager", counted)
    report = image.main(["--model", "tiny-flux-fill", "--steps", "2", "--repeats", "1", "--mask-ratios", "0.2",
                         "--modes", "y", "--compile"])
    assert report["compiled"] and list(report["baselines"]) == ["eager", "compiled"]
    eager, versus_compiled = report["results"]
    assert (eager["baseline"], versus_compiled["baseline"]) == ("eager", "compiled")
    assert eager["mask_aware_s"] == versus_compiled["mask_aware_s"] > 0  # one timing, quoted twice
    # The same edit with its blocks eager, timed in the same run (a warm-up and one repeat), quoted twice too.
    assert compiled_when_eager == [True, True]
    assert eager["eager_blocks_s"] == versus_compiled["eager_blocks_s"] > 0
    assert eager["speedup_eager_blocks"] == round(eager["full_s"] / eager["eager_blocks_s"], 3)
    assert eager["full_s"] != versus_compiled["full_s"]
    stock = [target for target in compiled if isinstance(target, torch.nn.Module)]
    assert [type(module).__name__ for module in stock] == ["FluxTransformer2DModel"]
    assert not any("forward" in block.__dict__ for block in stock[0].transformer_blocks)  # unpatched
    (editor,) = editors
    assert stock[0] is not editor.denoiser
    assert all(twin.data_ptr() == own.data_ptr() for twin, own in zip(stock[0].parameters(),
                                                                       editor.denoiser.parameters()))
    assert len(compiled) > 1  # and the mask-aware blocks' cores


def test_image_latency_refuses_a_cost_model_of_another_model():
    with pytest.raises(InputError, match="profiled on tiny-flux-fill, not tiny-sd2-inpaint"):
        image.main(["--model", "tiny-sd2-inpaint", "--steps", "1", "--cost-model", str(TINY_FLUX_COST)])


def test_throughput_and_serving_refuse_a_cost_model_of_another_model():
    from retouch.bench import workload

    with pytest.raises(InputError, match="profiled on tiny-flux-fill, not tiny-sdxl-inpaint"):
        workload.load_cost_model(TINY_FLUX_COST, "tiny-sdxl-inpaint")
    assert workload.load_cost_model(TINY_FLUX_COST, "tiny-flux-fill").model == "tiny-flux-fill"
    assert workload.load_cost_model(None, "tiny-flux-fill") is None


def _run_gpu(*parts: str, results: Path, out: Path | None = None, python: Path | None = None,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "RETOUCH_GPU_SMOKE": "1", "PYTHON": str(python or sys.executable), "RESULTS": str(results),
           **(env or {})}
    if out is not None:
        env["OUT"] = str(out)
    return subprocess.run(["bash", str(ROOT / "bench" / "run_gpu.sh"), *parts], capture_output=True, text=True,
                          env=env, timeout=900, start_new_session=True)


def _summary(stdout: str) -> list[str]:
    """run_gpu.sh's closing table: one line per part run (PART, seconds, ok or FAILED)."""
    table = stdout[stdout.index("== summary"):].splitlines()[1:]
    return [line for line in table if not line.startswith("failed parts:")]


def python_that(tmp_path: Path, module: str, action: str) -> Path:
    """A `python` for run_gpu.sh that runs `action` (shell) instead of `-m MODULE`, and is Python otherwise."""
    python = tmp_path / "python"
    python.write_text(f'#!/usr/bin/env bash\ncase " $* " in *" {module} "*) {action};; esac\n'
                      f'exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return python


def test_run_gpu_runs_every_part_on_the_cpu_smoke_sizes(tmp_path):
    results, out = tmp_path / "results", tmp_path / "out"
    out.mkdir()
    done = _run_gpu("headline", "overlap", "kernels", "flux", "unet", "throughput", "serving", "compile", "step",
                    "lora", results=results, out=out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    expected = ["image_latency_tiny-flux-fill_2_y", "image_latency_tiny-flux-fill_2_kv_fp8", "overlap_y", "overlap_kv",
                "attention", "gather",
                "block_latency", "cost_tiny-flux-fill", "image_latency_tiny-flux-fill", "overlap",
                "cost_tiny-sdxl-inpaint", "image_latency_tiny-sdxl-inpaint", "throughput", "serving",
                "overhead_flux-size", "step_compiled", "lora_tiny-flux-fill"]
    # The device tool brings back at most 8 files from $OUT: one archive of every part's log and results,
    # and one of the Chrome traces (the largest files).
    parts = ("headline", "overlap", "kernels", "flux", "unet", "throughput", "serving", "compile", "step", "lora")
    assert sorted(path.name for path in out.iterdir()) == ["results-traces.tgz", "results.tgz"]
    archived = {}
    for name in ("results.tgz", "results-traces.tgz"):
        with tarfile.open(out / name) as archive:
            archived |= {member.name: archive.extractfile(member).read() for member in archive.getmembers()}
    for part in parts:
        assert "exit 0" in archived.pop(f"{part}.log").decode()
    assert all(name.endswith(".json.gz") for name in tarfile.open(out / "results-traces.tgz").getnames())
    summary = _summary(done.stdout)
    assert [line.split()[0] for line in summary] == list(parts) and all(line.endswith(" ok") for line in summary)
    for name in expected:
        report = json.loads((results / f"{name}.json").read_text())
        assert report and archived[f"{name}.json"] == (results / f"{name}.json").read_bytes()
        if not name.startswith("cost_"):
            assert (results / f"{name}.png").stat().st_size > 0 and f"{name}.png" in archived
    # The headline part (28 steps on a GPU, 2 here): Y-cache in the model's dtype, KV-cache in float8 (what
    # fits the machine at 28 steps).
    for mode, dtype in (("y", "auto"), ("kv_fp8", "float8_e4m3fn")):
        headline = json.loads((results / f"image_latency_tiny-flux-fill_2_{mode}.json").read_text())
        assert headline["cache"]["dtype"] == dtype and {row["mask_ratio"] for row in headline["results"]} == {0.1875}
        assert {row["mode"] for row in headline["results"]} == {"y-cache" if mode == "y" else "kv-cache"}
    # The step part races the compiled mask-aware step against the compiled stock model (the
    # baseline users pick) as well as eager diffusers, in one run.
    raced = json.loads((results / "step_compiled.json").read_text())
    assert raced["compiled"] and list(raced["baselines"]) == ["eager", "compiled"]
    assert [(row["mode"], row["baseline"]) for row in raced["results"]] == [
        ("y-cache", "eager"), ("y-cache", "compiled"), ("kv-cache", "eager"), ("kv-cache", "compiled")]
    assert all(row["full_s"] > 0 and row["mask_aware_s"] > 0 for row in raced["results"])
    # ... and profiles one call of each variant: its summary in the JSON, its Chrome trace in the archive.
    assert set(raced["traces"]["variants"]) == {"eager", "compiled", "y-cache", "kv-cache"}
    assert {summary["trace"] for summary in raced["traces"]["variants"].values()} == {
        f"step_compiled_trace_{variant}.json.gz" for variant in ("eager", "compiled", "y-cache", "kv-cache")
    } <= set(archived)


def test_the_graphs_part_runs_the_headline_with_compiled_blocks(tmp_path):
    """`graphs` is the headline with retouch's blocks compiled (CUDA graphs on a GPU, `--compile` in the CPU
    smoke, where nothing is captured): both cache modes, each with its own file."""
    calls = tmp_path / "calls"
    python = python_that(tmp_path, "retouch.bench.image", f'echo "$*" >> {calls}; exit 0')
    done = _run_gpu("graphs", results=tmp_path / "results", python=python)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    y, kv = calls.read_text().splitlines()
    assert "--modes y --compile" in y and y.endswith("image_latency_tiny-flux-fill_2_y_graphs.json")
    assert "--modes kv --cache-dtype float8_e4m3fn --compile" in kv
    assert kv.endswith("image_latency_tiny-flux-fill_2_kv_fp8_graphs.json")


def test_a_failed_step_fails_its_part_and_the_steps_after_it_still_run(tmp_path):
    """Each step's figures stand alone, so a part goes on after a failed one; the part is then failed (its
    status used to be its last step's, so a failed benchmark or test run before it went unreported)."""
    results = tmp_path / "results"
    done = _run_gpu("kernels", results=results, python=python_that(tmp_path, "retouch.bench.attention", "exit 3"))
    assert done.returncode == 1 and "failed parts: kernels" in done.stdout, done.stdout[-3000:]
    log = (results / "kernels.log").read_text()
    assert "== FAILED (exit 3): bench attention" in log and log.rstrip().endswith("exit 1")
    assert not (results / "attention.json").exists()
    assert (results / "gather.json").exists() and (results / "block_latency.json").exists()
    assert not list(results.glob(".failed-*"))


def test_a_part_stopped_mid_way_still_brings_back_the_steps_it_finished(tmp_path):
    """The device tool kills a command at its time limit: the part's archive is rewritten after each step,
    so what finished before comes back. Here the last benchmark of the part kills the whole run."""
    out = tmp_path / "out"
    out.mkdir()
    python = python_that(tmp_path, "retouch.bench.block", "kill -KILL -$(ps -o sid= $$ | tr -d ' ')")
    done = _run_gpu("kernels", results=tmp_path / "results", out=out, python=python)
    assert done.returncode == -9
    with tarfile.open(out / "results.tgz") as archive:
        names = set(archive.getnames())
    assert {"kernels.log", "attention.json", "gather.json"} <= names and "block_latency.json" not in names


def test_the_deadline_interrupts_the_running_step_and_skips_the_rest(tmp_path):
    """DEADLINE_S ends the whole run in time: the benchmark that outlasts it is interrupted, the steps after
    it are skipped and reported, and the summary table is still printed, so that a device call ends with
    its table inside the tool's limit."""
    results, out = tmp_path / "results", tmp_path / "out"
    out.mkdir()
    python = python_that(tmp_path, "retouch.bench.attention", "exec sleep 600")  # the kernels part's second step
    done = _run_gpu("kernels", "flux", results=results, out=out, python=python, env={"DEADLINE_S": "20"})
    assert done.returncode == 1 and "failed parts: kernels flux" in done.stdout, done.stdout[-3000:]
    kernels, flux = (results / "kernels.log").read_text(), (results / "flux.log").read_text()
    assert (results / "gather.json").exists() and "== FAILED (exit 124): bench attention" in kernels
    assert "== SKIPPED (deadline)" in kernels and "== FAILED (exit 125): bench block" in kernels
    assert "== SKIPPED (deadline)" in flux and not (results / "overlap.json").exists()
    summary = _summary(done.stdout)
    assert [line.split()[::3] for line in summary] == [["kernels", "FAILED"], ["flux", "FAILED"]]
    with tarfile.open(out / "results.tgz") as archive:
        assert {"kernels.log", "flux.log", "gather.json"} <= set(archive.getnames())


def test_a_hung_test_run_is_interrupted_reported_and_the_part_goes_on(tmp_path, monkeypatch):
    """A GPU test that hangs (a stream waiting for an event that never fires) must not take the call's
    time limit: pytest is interrupted after PYTEST_LIMIT seconds and the step is reported failed."""
    monkeypatch.setenv("PYTEST_LIMIT", "1")
    results = tmp_path / "results"
    python = python_that(tmp_path, "pytest", f"exec {sys.executable} -c \"import signal, sys, time; signal.signal("
                         "signal.SIGINT, lambda *_: (print('interrupted', flush=True), sys.exit(2))); time.sleep(60)\"")
    done = _run_gpu("tests", results=results, python=python)
    assert done.returncode == 1 and "failed parts: tests" in done.stdout, done.stdout[-3000:]
    log = (results / "tests.log").read_text()
    assert "interrupted" in log and "== FAILED (exit 124): pytest tests/test_row_copy.py" in log
    assert "took" in log and log.rstrip().endswith("exit 1")


def test_run_gpu_refuses_an_unknown_part(tmp_path):
    done = _run_gpu("kernels", "everything", results=tmp_path)
    assert done.returncode == 2 and "unknown part everything" in done.stdout
    assert not list(tmp_path.glob("*.json"))  # nothing ran


def test_run_gpu_refuses_an_unknown_smoke_mode(tmp_path):
    env = {**os.environ, "RETOUCH_GPU_SMOKE": "yes", "RESULTS": str(tmp_path)}
    done = subprocess.run(["bash", str(ROOT / "bench" / "run_gpu.sh"), "kernels"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 2 and "RETOUCH_GPU_SMOKE is 0" in done.stdout and not list(tmp_path.iterdir())
