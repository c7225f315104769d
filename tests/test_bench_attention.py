"""`retouch bench attention`: every method against the oracle on ragged batches, the acceptance summary
computed from the points, the sweep and its flags. On the CPU the Triton kernel runs under the
interpreter (tests/conftest.py) and FlexAttention runs eagerly; flash-attn is unavailable there."""

import json

import pytest
import torch

from retouch.bench import attention
from retouch.errors import InputError
from retouch.kernels.ragged_attention import DEFAULT_LAUNCH_CONFIG, KERNEL_INTERPRETED, ragged_attention_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Eager FlexAttention on the CPU says it is unfused; that is the point of running it eagerly there.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
CPU_METHODS = ["ragged_triton", "ragged_triton_unplanned", "retouch_auto", "padded_sdpa", "per_request_sdpa",
               "flex_attention"]


# The CPU smoke run of the whole benchmark needs the kernel interpreted; on a GPU machine the
# benchmark itself (bench/run_gpu.sh kernels) is the run.
cpu_smoke_run = pytest.mark.skipif(not KERNEL_INTERPRETED, reason="the --quick CPU run needs TRITON_INTERPRET=1")


def packed_point(query_lens, tokens, heads, head_dim, dtype, seed=0):
    layout = attention.make_layout(tokens, "test", query_lens, torch.device(DEVICE), flex=True)
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(rows, heads, head_dim, generator=generator).to(DEVICE, dtype)
               for rows in (sum(query_lens), len(query_lens) * tokens, len(query_lens) * tokens))
    return layout, q, k, v


def all_methods():
    config = attention.BenchConfig(device=DEVICE, tune=False)
    return attention.setup_methods(config, torch.device(DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_method_matches_the_oracle_on_a_ragged_batch(head_dim, dtype):
    # One query, a partial block, every token: flex's document mask and the padding must both hold up.
    query_lens, tokens = [1, 17, 40], 40
    layout, q, k, v = packed_point(query_lens, tokens, heads=2, head_dim=head_dim, dtype=dtype, seed=head_dim)
    methods = all_methods()
    runs = attention.method_runs(methods, layout, q, k, v, DEFAULT_LAUNCH_CONFIG)
    assert set(runs) == set(methods.names) >= set(CPU_METHODS)
    oracle = ragged_attention_ref(q.double(), k.double(), v.double(), layout.cu_seqlens_q, layout.cu_seqlens_k)
    if dtype == torch.float32:
        allowed = 1e-5
    else:  # flash-attention's rule, as in tests/test_ragged_attention.py
        plain = ragged_attention_ref(q, k, v, layout.cu_seqlens_q, layout.cu_seqlens_k, upcast=False)
        rounding = (oracle.to(dtype).double() - oracle).abs().max().item()
        allowed = 2 * (plain.double() - oracle).abs().max().item() + 2 * rounding
    for name, run in runs.items():
        out = run()
        assert out.shape == q.shape and out.dtype == dtype, name
        error = (out.double() - oracle).abs().max().item()
        assert error <= allowed, f"{name}: max error {error:.3g} > allowed {allowed:.3g}"
    diffs, tolerance, errors = attention.check_against_reference(runs, q, k, v, layout.cu_seqlens_q,
                                                                 layout.cu_seqlens_k)
    assert errors == {} and set(diffs) == set(runs)
    assert all(diff <= tolerance for diff in diffs.values()), (diffs, tolerance)


def test_check_records_wrong_and_failing_methods():
    layout, q, k, v = packed_point([3, 5], 8, heads=1, head_dim=64, dtype=torch.bfloat16)

    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory")

    runs = {"right": lambda: ragged_attention_ref(q, k, v, layout.cu_seqlens_q, layout.cu_seqlens_k),
            "zeros": lambda: torch.zeros_like(q), "fails": out_of_memory}
    diffs, tolerance, errors = attention.check_against_reference(runs, q, k, v, layout.cu_seqlens_q,
                                                                 layout.cu_seqlens_k)
    assert set(diffs) == {"right", "zeros"} and "out of memory" in errors["fails"]
    assert diffs["right"] <= tolerance < diffs["zeros"]


@cpu_smoke_run
def test_quick_run_measures_and_summarises(tmp_path):
    out = tmp_path / "attention.json"
    report = attention.main(["--quick", "--device", "cpu", "--out", str(out)])
    assert report["methods"] == CPU_METHODS
    assert report["baselines"] == ["padded_sdpa", "per_request_sdpa", "flex_attention"]
    assert "flash_attn_varlen" in report["unavailable"] and "torch_varlen" in report["unavailable"]
    assert "CUDA in fp16/bf16 only" in report["unavailable"]["torch_varlen"]
    assert "cudnn_varlen" not in report["config"]["methods"]  # named in --methods only (45-80 ms a call)
    assert report["triton_interpreted"] and report["flex_compile"] == "eager"
    assert report["environment"]["command"] == f"retouch bench attention --quick --device cpu --out {out}"
    assert report["environment"]["versions"]["torch"] == torch.__version__
    # Off the GPU the tuner times nothing: one table entry per key.
    assert report["tuning"] and all(t["source"] == "table" and t["timings_ms"] == {} for t in report["tuning"])

    rows = report["results"]
    assert {(r["batch"], r["mask_ratio"]) for r in rows} == {(b, m) for b in (1, 3) for m in ("0.2", "1", "mixed")}
    for row in rows:
        assert set(row["ms_p50"]) == set(row["ms_p95"]) == set(row["ms_steady"]) == set(row["tflops"]) \
            == set(CPU_METHODS)
        assert row["errors"] == {} and all(row["matches_reference"].values())
        assert row["launch_config"] == DEFAULT_LAUNCH_CONFIG.name and row["launch_config_source"] == "table"
        # Speedups and rates come from the steady-state times; the idle-device latency has its own ratio.
        steady, p50 = row["ms_steady"], row["ms_p50"]
        assert row["tflops"]["padded_sdpa"] == pytest.approx(row["tflop"] / (steady["padded_sdpa"] / 1e3))
        assert row["speedup_vs_padded_sdpa"] == pytest.approx(steady["padded_sdpa"] / steady["ragged_triton"])
        assert row["latency_speedup_vs_padded_sdpa"] == pytest.approx(p50["padded_sdpa"] / p50["ragged_triton"])
        best = min(report["baselines"], key=steady.get)
        assert row["best_baseline"] == best
        assert row["speedup_vs_best_baseline"] == pytest.approx(steady[best] / steady["ragged_triton"])
        assert row["auto_speedup_vs_padded_sdpa"] == pytest.approx(steady["padded_sdpa"] / steady["retouch_auto"])
        assert row["tflop"] == pytest.approx(4 * 2 * 64 * sum(row["query_lens"]) * 64 / 1e12)

    summary = report["summary"]
    worst = min(r["speedup_vs_padded_sdpa"] for r in rows)
    m1_worst = min(r["speedup_vs_best_baseline"] for r in rows if r["mask_ratio"] == "1")
    assert summary["points"] == len(rows) == 6 and summary["errors"] == 0
    assert summary["auto_worst_ratio_vs_padded"] == min(r["auto_speedup_vs_padded_sdpa"] for r in rows)
    assert summary["worst_ratio_vs_padded"] == worst
    assert summary["all_points_at_least_padded_sdpa"] == (worst >= 1.0)
    assert summary["m1_ratio_vs_best_baseline_min"] == m1_worst
    assert summary["m1_within_10pct_of_best_baseline"] == (m1_worst >= 0.9)
    assert summary["all_outputs_match_reference"] is True

    assert json.loads(out.read_text())["summary"] == summary
    assert report["plot"] == str(out.with_suffix(".png")) and out.with_suffix(".png").stat().st_size > 0


@cpu_smoke_run
def test_methods_and_max_points_select_the_work():
    report = attention.main(["--quick", "--device", "cpu", "--no-tune", "--methods", "ragged_triton", "padded_sdpa",
                             "flash_attn_varlen", "cudnn_varlen", "--max-points", "2", "--head-dims", "128"])
    assert report["methods"] == ["ragged_triton", "padded_sdpa"]
    assert set(report["unavailable"]) == {"flash_attn_varlen", "cudnn_varlen"}
    assert "CUDA in fp16/bf16 only" in report["unavailable"]["cudnn_varlen"]
    assert report["tuning"] == []
    rows = report["results"]
    assert len(rows) == 2 and all(set(r["ms_p50"]) == {"ragged_triton", "padded_sdpa"} for r in rows)
    assert all(r["head_dim"] == 128 and r["best_baseline"] == "padded_sdpa" for r in rows)
    assert all(r["speedup_vs_best_baseline"] == r["speedup_vs_padded_sdpa"] for r in rows)


def test_steady_time_is_per_call_of_back_to_back_bursts():
    calls = {"a": 0, "b": 0}

    def counted(name):
        def run():
            calls[name] += 1
        return run

    steady = attention.steady_ms({name: counted(name) for name in calls}, torch.device("cpu"), bursts=3, burst=4)
    assert calls == {"a": 12, "b": 12} and set(steady) == {"a", "b"} and all(ms > 0 for ms in steady.values())
    with pytest.raises(ValueError, match="bursts and burst must be >= 1"):
        attention.BenchConfig(device="cpu", burst=0)


def row(mask_ratio, vs_padded, vs_best, matches=True, errors=None):
    return {"tokens_per_request": 1024, "head_dim": 64, "batch": 1, "mask_ratio": mask_ratio,
            "speedup_vs_padded_sdpa": vs_padded, "speedup_vs_best_baseline": vs_best, "best_baseline": "padded_sdpa",
            "matches_reference": {"ragged_triton": matches}, "errors": errors or {}}


def test_summary_applies_the_acceptance_checks():
    passing = [row("0.05", 3.0, 1.2), row("1", 1.0, 0.95), row("mixed", 1.5, 1.1)]
    summary = attention.summarize(passing)
    assert summary["acceptance_passed"] and summary["all_points_at_least_padded_sdpa"]
    assert summary["worst_ratio_vs_padded"] == 1.0 and summary["m1_ratio_vs_best_baseline_min"] == 0.95
    assert summary["worst_point_vs_padded"] == "L=1024 d=64 B=1 m=1"

    slower_than_padded = attention.summarize([row("0.05", 0.97, 0.97), *passing[1:]])
    assert not slower_than_padded["all_points_at_least_padded_sdpa"] and not slower_than_padded["acceptance_passed"]
    assert slower_than_padded["worst_ratio_vs_padded"] == 0.97

    behind_best_at_m1 = attention.summarize([passing[0], row("1", 1.2, 0.85)])
    assert behind_best_at_m1["all_points_at_least_padded_sdpa"]
    assert not behind_best_at_m1["m1_within_10pct_of_best_baseline"] and not behind_best_at_m1["acceptance_passed"]

    padded_failed = row("0.05", None, None, errors={"padded_sdpa": "OutOfMemoryError"})
    not_measured = attention.summarize([padded_failed, passing[1]])
    assert not not_measured["all_points_at_least_padded_sdpa"] and not_measured["errors"] == 1
    assert not attention.summarize([*passing, row("0.5", 2.0, 1.0, matches=False)])["acceptance_passed"]
    assert not attention.summarize([row("0.5", 2.0, 1.0)])["m1_within_10pct_of_best_baseline"]  # no m = 1 point


def test_default_sweep_is_the_issue_grid():
    config = attention.BenchConfig(device="cuda")
    points = attention.sweep_points(config)
    assert len(points) == 3 * 4 * 6 * 2
    assert {layout[0] for layout, _ in points} == {1024, 2048, 4096}
    assert {len(layout[2]) for layout, _ in points} == {1, 2, 4, 8}
    assert {layout[1] for layout, _ in points} == {"0.05", "0.1", "0.2", "0.5", "1", "mixed"}
    assert {head_dim for _, head_dim in points} == {64, 128}
    # Head sizes innermost: both share one layout (and one FlexAttention block mask).
    assert points[0][0] == points[1][0] and points[0][1] != points[1][1]
    assert attention.sweep_points(attention.BenchConfig(device="cuda", max_points=5)) == points[:5]


def test_flags_derive_from_the_config():
    config, quick, out = attention.parse_args(["--device", "cpu", "--no-tune", "--tokens-per-request", "64", "128",
                                               "--heads", "3", "--max-points", "4", "--flex-compile", "static"])
    assert not quick and out is None
    assert (config.tune, config.tokens_per_request, config.heads, config.max_points, config.flex_compile) == \
        (False, [64, 128], 3, 4, "static")
    assert attention.parse_args(["--quick"])[0].tokens_per_request == [64]
    for bad in (["--methods", "padded_sdpa"], ["--methods", "ragged_triton", "nope"], ["--mask-ratios", "0"],
                ["--flex-compile", "sometimes"], ["--max-points", "0"]):
        with pytest.raises(SystemExit) as exit_:  # a usage error (one line, exit 2), not an internal error
            attention.parse_args(bad)
        assert exit_.value.code == 2


def test_torch_varlen_gets_the_packed_batch_in_its_own_argument_order():
    """torch's varlen_attn runs on CUDA only: here a stand-in with its signature checks what the benchmark
    passes (packed q/k/v, cumulative query and key rows, longest query and key run) and answers with
    the reference, which the benchmark's output must then be."""
    import dataclasses
    import inspect

    varlen = pytest.importorskip("torch.nn.attention.varlen").varlen_attn
    query_lens, tokens = [3, 0, 9], 12
    layout, q, k, v = packed_point(query_lens, tokens, heads=2, head_dim=64, dtype=torch.float32)
    seen = {}

    def stand_in(*args, **kwargs):
        seen.update(inspect.signature(varlen).bind(*args, **kwargs).arguments)
        return ragged_attention_ref(seen["query"], seen["key"], seen["value"], seen["cu_seq_q"], seen["cu_seq_k"])

    methods = dataclasses.replace(all_methods(), names=["ragged_triton", "torch_varlen"], torch_varlen=stand_in)
    out = attention.method_runs(methods, layout, q, k, v, DEFAULT_LAUNCH_CONFIG)["torch_varlen"]()
    assert seen["query"] is q and seen["key"] is k and seen["value"] is v
    assert seen["cu_seq_q"].tolist() == [0, 3, 3, 12] and seen["cu_seq_k"].tolist() == [0, 12, 24, 36]
    assert (seen["max_q"], seen["max_k"]) == (9, tokens)
    torch.testing.assert_close(out, ragged_attention_ref(q, k, v, layout.cu_seqlens_q, layout.cu_seqlens_k))


def test_the_cudnn_probe_says_why_it_cannot_run():
    """The probe runs cuDNN's varlen attention in a process of its own before a sweep; where it fails (here:
    no GPU) the method is reported unavailable with the probe's last line, and the sweep goes on."""
    reason = attention.probe_cudnn_varlen("bfloat16")
    assert reason is not None and reason.startswith("probe: ") and "\n" not in reason


def test_on_a_cpu_without_the_interpreter_asked_for_it_says_how(monkeypatch):
    """`retouch bench attention --quick` loads Triton before the bench could ask for its interpreter: every
    kernel point failed and the run still ended 0. It now says to set TRITON_INTERPRET=1 first."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(InputError, match="TRITON_INTERPRET=1 retouch bench attention"):
        attention.main(["--quick", "--device", "cpu"])
