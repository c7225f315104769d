"""The measured choice among the GPU attention paths (`retouch.ops.choose_attention`) and the padded SDPA
path it can pick: the same attention as the reference, and choices that agree with the H200 measurements
they were fitted to (bench/results/h200/attention.json)."""

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retouch import ops
from retouch.bench import attention_costs
from retouch.kernels.ragged_attention import ragged_attention_ref

# The sweep ops.ATTENTION_COSTS was fitted to (its `ms_steady` times).
MEASURED = Path(__file__).resolve().parents[1] / "bench" / "results" / "h200" / "attention.json"


def packed(lengths_q, lengths_k, heads=3, head_dim=16, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(sum(lengths), heads, head_dim, generator=generator).to(dtype)
               for lengths in (lengths_q, lengths_k, lengths_k))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
                  for lengths in (lengths_q, lengths_k))
    return q, k, v, cu_q, cu_k


@settings(max_examples=25, deadline=None)
@given(lengths_q=st.lists(st.integers(0, 9), min_size=1, max_size=4), keys=st.integers(1, 12),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_padded_plans_compute_the_reference_attention(lengths_q, keys, dtype):
    lengths_k = [keys] * len(lengths_q)
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, dtype=dtype)
    plan = ops.with_padded_queries(ops.plan_attention(lengths_q, lengths_k, "cpu", dtype, 16, backend="sdpa"))
    assert plan.backend == "sdpa" and plan.padded_rows is not None
    out = ops.planned_attention(q, k, v, plan)
    expected = ragged_attention_ref(q.float(), k.float(), v.float(), cu_q, cu_k)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_padding_needs_keys_of_one_length():
    plan = ops.plan_attention([2, 3], [5, 6], "cpu", torch.float32, 16, backend="sdpa")
    with pytest.raises(ValueError, match="keys of one nonzero length"):
        ops.with_padded_queries(plan)


@settings(max_examples=50, deadline=None)
@given(lengths_q=st.lists(st.integers(0, 4096), min_size=1, max_size=8),
       lengths_k=st.lists(st.integers(0, 4608), min_size=1, max_size=8),
       head_dim=st.sampled_from([64, 128]), heads=st.integers(1, 32))
def test_padding_is_chosen_only_where_it_is_exact(lengths_q, lengths_k, head_dim, heads):
    """Padded keys would need a mask (and leave SDPA's fast kernels): only keys of one length are padded."""
    lengths_k = (lengths_k * len(lengths_q))[:len(lengths_q)]
    backend, padded = ops.choose_attention(lengths_q, lengths_k, heads, head_dim, ops.ATTENTION_COSTS[9, head_dim])
    assert backend in ("triton", "sdpa")
    if padded:
        assert backend == "sdpa" and len(lengths_q) > 1 and len(set(lengths_k)) == 1 and lengths_k[0] > 0


def test_large_batches_go_to_sdpa_and_small_layouts_to_the_kernel():
    costs = ops.ATTENTION_COSTS[9, 128]
    # Eight Flux-size requests, whole images: SDPA, at ~1.6-1.9x the kernel's rate.
    assert ops.choose_attention([4096] * 8, [4608] * 8, 24, 128, costs)[0] == "sdpa"
    # Four requests of half a 2048-token image each: one padded call beats four (the per-call cost).
    assert ops.choose_attention([1024, 1000, 980, 1024], [2048] * 4, 10, 128, costs) == ("sdpa", True)
    # A small mask on a small image: launches dominate and the kernel has the fewest.
    assert ops.choose_attention([51], [1024], 10, 128, costs) == ("triton", False)


def test_choices_agree_with_the_measurements_they_were_fitted_to():
    """At each of the 144 measured layouts the chosen path's measured time is within 1.35x of the fastest
    path's (the fits' worst point: two requests of mixed mask ratios, where the kernel runs 1.5x slower
    than its fit), the fastest at the median, and over all of them the choice beats the kernel alone."""
    measured = json.loads(MEASURED.read_text())
    costs = {head_dim: ops.ATTENTION_COSTS[9, head_dim] for head_dim in (64, 128)}
    summary = attention_costs.replay(measured, costs)
    assert summary["points"] == 144
    assert summary["worst_vs_fastest"] >= 1 / 1.35 and summary["median_vs_fastest"] == 1.0
    assert summary["geomean_gain_vs_kernel"] > 1.05


def test_the_fit_recovers_the_costs_a_sweep_was_made_from():
    """Times made from known costs (with +-3% noise) fit back to those costs; each path is charged its work."""
    measured = json.loads(MEASURED.read_text())
    truth = {"triton": ops.AttentionCost(0.05, 0.0, 400), "sdpa_padded": ops.AttentionCost(0.08, 0.0, 600),
             "sdpa": ops.AttentionCost(0.08, 0.04, 700)}
    generator = torch.Generator().manual_seed(0)
    for point in measured["results"]:
        requests = len(point["query_lens"])
        noise = (1 + 0.06 * (torch.rand(3, generator=generator) - 0.5)).tolist()
        work = {method: 1e12 * attention_costs.work_tflop(point, method == "padded_sdpa")
                for method in attention_costs.COST_NAMES}
        point["ms_steady"] = {method: noise[i] * truth[name].ms(requests, work[method])
                              for i, (method, name) in enumerate(attention_costs.COST_NAMES.items())}
    fits = attention_costs.fit_costs(measured)
    assert set(fits) == {64, 128}
    for head_dim_fits in fits.values():
        for name, cost in head_dim_fits.items():
            assert cost.tflops == pytest.approx(truth[name].tflops, rel=0.05), name
            assert cost.fixed_ms == pytest.approx(truth[name].fixed_ms, abs=0.01), name
            assert cost.per_request_ms == pytest.approx(truth[name].per_request_ms, abs=0.01), name


def test_the_fit_needs_steady_times(tmp_path, capsys):
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"results": [{"head_dim": 64, "ms_p50": {}}]}))
    with pytest.raises(SystemExit) as exit_info:
        attention_costs.main([str(sweep)])
    assert exit_info.value.code == 2 and "no ms_steady times at 1 of 1 points" in capsys.readouterr().err


def test_the_cpu_and_unmeasured_gpus_keep_their_backends():
    assert ops.attention_costs(128, torch.bfloat16, None) is None
    assert ops.attention_costs(128, torch.float32, (9, 0)) is None
    assert ops.attention_costs(80, torch.bfloat16, (9, 0)) is None
    assert ops.attention_costs(128, torch.bfloat16, (8, 0)) is None
    plan = ops.plan_attention([4096] * 8, [4608] * 8, "cpu", torch.bfloat16, 128, heads=24)
    assert plan.backend == "sdpa" and plan.padded_rows is None


def test_a_measured_gpu_plans_the_chosen_path(monkeypatch):
    """plan_attention follows choose_attention where costs are known (the CPU stands in for the GPU)."""
    monkeypatch.setattr(ops, "attention_costs", lambda head_dim, dtype, capability: ops.ATTENTION_COSTS[9, 128])
    lengths_q, lengths_k = [6, 2, 9], [11] * 3
    monkeypatch.setattr(ops, "choose_attention", lambda *args: ("sdpa", True))
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, heads=2, head_dim=128)
    plan = ops.plan_attention(lengths_q, lengths_k, "cpu", torch.float32, 128, heads=2)
    assert plan.padded_rows is not None
    torch.testing.assert_close(ops.planned_attention(q, k, v, plan), ragged_attention_ref(q, k, v, cu_q, cu_k),
                               atol=1e-5, rtol=1e-5)
    # Without heads, "auto" is what it was: no measured choice.
    assert ops.plan_attention(lengths_q, lengths_k, "cpu", torch.float32, 128).padded_rows is None


def test_the_cudnn_backend_passes_the_packed_layout_as_torchs_nested_sdpa_does(monkeypatch):
    """cuDNN runs on CUDA only: a stand-in with aten::_cudnn_attention_forward's arguments checks what the
    "cudnn" backend passes (contiguous packed rows, int32 cumulative lengths, the longest runs, no bias, no
    log-sum-exp, no dropout, not causal, the scale) and answers with the reference, which every entry point
    (the op, a plan) must then return."""
    lengths_q, lengths_k = [3, 5, 9], [12, 12, 12]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, head_dim=64)
    names = [argument.name for argument in torch.ops.aten._cudnn_attention_forward.default._schema.arguments]
    seen = {}

    def stand_in(*args, scale=None):
        seen.update(zip(names, args), scale=scale)
        return ragged_attention_ref(seen["query"], seen["key"], seen["value"], seen["cum_seq_q"],
                                    seen["cum_seq_k"], scale), None

    monkeypatch.setattr(torch.ops.aten, "_cudnn_attention_forward", stand_in)
    out = ops.cudnn_varlen(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, cu_q.long(), cu_k, 9, 12, 0.125)
    assert all(seen[name].is_contiguous() for name in ("query", "key", "value"))
    assert seen["cum_seq_q"].dtype == seen["cum_seq_k"].dtype == torch.int32
    assert seen["cum_seq_q"].tolist() == [0, 3, 8, 17] and seen["cum_seq_k"].tolist() == [0, 12, 24, 36]
    assert (seen["max_q"], seen["max_k"], seen["attn_bias"], seen["scale"]) == (9, 12, None, 0.125)
    assert (seen["compute_log_sumexp"], seen["dropout_p"], seen["is_causal"]) == (False, 0.0, False)
    expected = ragged_attention_ref(q, k, v, cu_q, cu_k, 0.125)
    torch.testing.assert_close(out, expected)
    plan = ops.AttentionPlan((3, 5, 9), (12, 12, 12), torch.tensor(lengths_q), torch.tensor(lengths_k), cu_q, cu_k,
                             "cudnn")
    torch.testing.assert_close(ops.planned_attention(q, k, v, plan, 0.125), expected)


def test_the_cudnn_backend_refuses_what_cudnn_cannot_run():
    q, k, v, cu_q, cu_k = packed([3], [12], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'cudnn' runs on CUDA in fp16/bf16 only"):
        ops.ragged_attention(q, k, v, cu_q, cu_k, 3, 12, backend="cudnn")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN's attention runs on a GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_cudnn_backend_computes_the_reference_attention_on_a_gpu(head_dim):
    lengths_q, lengths_k = [1, 40, 7, 129], [130, 130, 130, 130]
    q, k, v, cu_q, cu_k = (t.cuda() for t in packed(lengths_q, lengths_k, heads=4, head_dim=head_dim,
                                                    dtype=torch.bfloat16))
    out = ops.ragged_attention(q, k, v, cu_q, cu_k, max(lengths_q), 130, backend="cudnn")
    expected = ragged_attention_ref(q.float(), k.float(), v.float(), cu_q, cu_k)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
