"""Ragged attention: the oracle against a padded dense computation, then the Triton kernel (under the
interpreter on a CPU) and the per-request SDPA path against the oracle, over a grid of ragged batches.

Tolerances:
- bf16/fp16, flash-attention's rule: the max error against the fp32-math oracle may be at most twice
  the max error of a plain PyTorch run in the same dtype, plus twice the error of rounding the exact
  answer to the dtype (flash-attention's `fwd_atol`).
- fp32: torch.testing's fp32 defaults (atol 1e-5, rtol 1.3e-6) against an fp64 oracle. The 2x rule
  does not transfer: plain fp32 is off by a few ulps here, and the max of a few hundred such values
  is too noisy to scale from (over 6 seeds the kernel and torch SDPA reached 1.07x and 1.12x of that
  bound while staying under 1.5e-6).
"""

import pytest
import torch
from triton.runtime.errors import OutOfResources, PTXASError

from retouch.kernels import ragged_attention as ragged_module
from retouch.kernels.ragged_attention import (
    DEFAULT_LAUNCH_CONFIG,
    HOPPER_LAUNCH_CONFIGS,
    TUNING_CANDIDATES,
    LaunchConfig,
    RaggedAttentionTuner,
    launch_config,
    plan_ragged_attention,
    query_block_map,
    ragged_attention,
    ragged_attention_ref,
    ragged_attention_sdpa,
    ragged_attention_with_plan,
    tuning_key,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# name -> (queries per request, keys per request). Queries are each request's masked tokens, keys all
# of its tokens; odd sizes, an empty request, a one-token request, all tokens masked, mixed lengths.
BATCHES = {
    "empty_and_one": ([0, 1, 5], [9, 17, 5]),
    "all_tokens": ([33, 7], [33, 7]),
    "mixed_odd": ([1, 7, 33, 70], [70, 7, 40, 70]),
    "many_small": ([2, 0, 3, 1, 9, 4, 0, 6, 5], [3, 8, 3, 2, 9, 16, 1, 6, 17]),
}
HEAD_DIMS = [64, 128, 40]
NUM_HEADS = [1, 3]
DTYPES = [torch.float32, torch.bfloat16]


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def ragged_batch(q_lens, k_lens, heads, head_dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=generator)
    k = torch.randn(sum(k_lens), heads, head_dim, generator=generator)
    v = torch.randn(sum(k_lens), heads, head_dim, generator=generator)
    return *(x.to(device=DEVICE, dtype=dtype) for x in (q, k, v)), cu_seqlens(q_lens), cu_seqlens(k_lens)


def assert_matches_oracle(out, q, k, v, cu_q, cu_k, softmax_scale=None, label=""):
    if q.dtype == torch.float32:
        oracle = ragged_attention_ref(q.double(), k.double(), v.double(), cu_q, cu_k, softmax_scale)
        torch.testing.assert_close(out.double(), oracle, atol=1e-5, rtol=1.3e-6, msg=lambda m: f"{label}: {m}")
        return
    oracle = ragged_attention_ref(q.float(), k.float(), v.float(), cu_q, cu_k, softmax_scale)
    plain = ragged_attention_ref(q, k, v, cu_q, cu_k, softmax_scale, upcast=False)
    plain_error = (plain.float() - oracle).abs().max().item()
    rounding = (oracle.to(q.dtype).float() - oracle).abs().max().item()
    error = (out.float() - oracle).abs().max().item()
    allowed = 2 * plain_error + 2 * rounding
    assert error <= allowed, f"{label}: max error {error:.3g} > allowed {allowed:.3g} (plain: {plain_error:.3g})"


def padded_dense_attention(q, k, v, q_lens, k_lens, softmax_scale=None):
    """Independent oracle: pad every request to the longest, one SDPA call with a key-padding mask."""
    batch, heads, head_dim = len(q_lens), q.shape[1], q.shape[2]
    max_q, max_k = max(q_lens), max(k_lens)
    q_pad = q.new_zeros(batch, max_q, heads, head_dim)
    k_pad = k.new_zeros(batch, max_k, heads, head_dim)
    v_pad = v.new_zeros(batch, max_k, heads, head_dim)
    key_valid = torch.zeros(batch, 1, 1, max_k, dtype=torch.bool, device=q.device)
    q_start = k_start = 0
    for b, (n_q, n_k) in enumerate(zip(q_lens, k_lens)):
        q_pad[b, :n_q] = q[q_start:q_start + n_q]
        k_pad[b, :n_k] = k[k_start:k_start + n_k]
        v_pad[b, :n_k] = v[k_start:k_start + n_k]
        key_valid[b, ..., :n_k] = True
        q_start, k_start = q_start + n_q, k_start + n_k
    out_pad = torch.nn.functional.scaled_dot_product_attention(
        q_pad.transpose(1, 2), k_pad.transpose(1, 2), v_pad.transpose(1, 2), attn_mask=key_valid, scale=softmax_scale,
    ).transpose(1, 2)
    return torch.cat([out_pad[b, :n_q] for b, n_q in enumerate(q_lens)])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("batch_name", BATCHES)
def test_oracle_matches_padded_dense_attention(batch_name, dtype):
    q_lens, k_lens = BATCHES[batch_name]
    q, k, v, cu_q, cu_k = ragged_batch(q_lens, k_lens, heads=3, head_dim=40, dtype=dtype)
    expected = padded_dense_attention(q, k, v, q_lens, k_lens)
    torch.testing.assert_close(ragged_attention_ref(q, k, v, cu_q, cu_k), expected)
    scale = 0.3
    torch.testing.assert_close(ragged_attention_ref(q, k, v, cu_q, cu_k, scale),
                               padded_dense_attention(q, k, v, q_lens, k_lens, scale))


def test_zero_keys_give_zeros_everywhere():
    # A request with queries but no keys has an empty softmax; all three paths define it as zeros.
    q_lens, k_lens = [3, 4, 2], [0, 9, 0]
    q, k, v, cu_q, cu_k = ragged_batch(q_lens, k_lens, heads=2, head_dim=64, dtype=torch.float32)
    outputs = {
        "ref": ragged_attention_ref(q, k, v, cu_q, cu_k),
        "sdpa": ragged_attention_sdpa(q, k, v, cu_q, cu_k),
        "triton": ragged_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens)),
    }
    expected_middle = padded_dense_attention(q[3:7], k, v, [4], [9])
    for name, out in outputs.items():
        assert torch.equal(out[:3], torch.zeros_like(out[:3])), name
        assert torch.equal(out[7:], torch.zeros_like(out[7:])), name
        torch.testing.assert_close(out[3:7], expected_middle, msg=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", NUM_HEADS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("batch_name", BATCHES)
def test_triton_and_sdpa_match_oracle(batch_name, head_dim, heads, dtype):
    q_lens, k_lens = BATCHES[batch_name]
    q, k, v, cu_q, cu_k = ragged_batch(q_lens, k_lens, heads, head_dim, dtype, seed=head_dim + heads)
    out = ragged_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens))
    assert out.shape == q.shape and out.dtype == dtype
    assert_matches_oracle(out, q, k, v, cu_q, cu_k, label="triton")
    assert_matches_oracle(ragged_attention_sdpa(q, k, v, cu_q, cu_k), q, k, v, cu_q, cu_k, label="sdpa")


def test_fp16_and_explicit_scale():
    q_lens, k_lens = BATCHES["mixed_odd"]
    q, k, v, cu_q, cu_k = ragged_batch(q_lens, k_lens, heads=3, head_dim=128, dtype=torch.float16)
    for scale in (None, 0.05):
        out = ragged_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), softmax_scale=scale)
        assert_matches_oracle(out, q, k, v, cu_q, cu_k, scale, label=f"scale {scale}")


@pytest.mark.parametrize("block_m, block_n", [(16, 16), (32, 64), (64, 32)])
def test_block_sizes_are_overridable(block_m, block_n):
    # Small blocks put several query blocks in one request and several key steps in one loop.
    q_lens, k_lens = BATCHES["mixed_odd"]
    q, k, v, cu_q, cu_k = ragged_batch(q_lens, k_lens, heads=1, head_dim=40, dtype=torch.float32)
    config = LaunchConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=3)
    out = ragged_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), config=config)
    assert_matches_oracle(out, q, k, v, cu_q, cu_k)


def test_strided_inputs_from_fused_qkv():
    # q, k, v as views of one [T, 3, heads, head_dim] projection: token stride 3 * heads * head_dim.
    lengths = [7, 33]
    generator = torch.Generator().manual_seed(1)
    qkv = torch.randn(sum(lengths), 3, 2, 64, generator=generator).to(DEVICE)
    q, k, v = qkv.unbind(1)
    cu = cu_seqlens(lengths)
    out = ragged_attention(q, k, v, cu, cu, max(lengths), max(lengths))
    assert_matches_oracle(out, q, k, v, cu, cu)


def test_no_queries_at_all():
    q, k, v, cu_q, cu_k = ragged_batch([0, 0], [5, 3], heads=2, head_dim=64, dtype=torch.float32)
    for out in (ragged_attention(q, k, v, cu_q, cu_k, 0, 5), ragged_attention_ref(q, k, v, cu_q, cu_k),
                ragged_attention_sdpa(q, k, v, cu_q, cu_k)):
        assert out.shape == (0, 2, 64)


@pytest.mark.parametrize("block_m", [16, 64, 128])
@pytest.mark.parametrize("batch_name", BATCHES)
def test_query_block_map_covers_each_row_once(batch_name, block_m):
    q_lens, _ = BATCHES[batch_name]
    cu_q = cu_seqlens(q_lens)
    block_request, block_in_request = query_block_map(cu_q, sum(q_lens), block_m, max(q_lens))
    covered = torch.zeros(sum(q_lens), dtype=torch.int64)
    starts = cu_q.tolist()
    for request, index in zip(block_request.tolist(), block_in_request.tolist()):
        if request == len(q_lens):
            continue  # spare program
        first = starts[request] + index * block_m
        assert starts[request] <= first < starts[request + 1], "block starts outside its request"
        covered[first:min(first + block_m, starts[request + 1])] += 1
    assert torch.equal(covered, torch.ones_like(covered))


FUNCTIONS = {
    "triton": lambda q, k, v, cu_q, cu_k: ragged_attention(q, k, v, cu_q, cu_k, 64, 64),
    "triton_plan": lambda q, k, v, cu_q, cu_k: ragged_attention_with_plan(
        q, k, v, plan_ragged_attention(cu_q, cu_k, 64, 64, DEFAULT_LAUNCH_CONFIG)),
    "ref": ragged_attention_ref,
    "sdpa": ragged_attention_sdpa,
}
# A plan is built from cu_seqlens alone, so a wrong end shows as rows that do not match the plan.
PLAN_MESSAGES = {"wrong_end": "the plan's T_q = 7 and T_k = 10 rows, got 7 and 11"}


def bad_inputs():
    q, k, v, cu_q, cu_k = ragged_batch([3, 4], [5, 6], heads=2, head_dim=64, dtype=torch.float32)
    return {
        "heads": ((q, k[:, :1], v[:, :1], cu_q, cu_k), "agree on \\[heads, head_dim\\]"),
        "head_dim": ((q[..., :32], k, v, cu_q, cu_k), "agree on \\[heads, head_dim\\]"),
        "k_v_shape": ((q, k, v[:-1], cu_q, cu_k), "k and v must have the same shape"),
        "rank": ((q.flatten(1), k, v, cu_q, cu_k), "q must be \\[tokens, heads, head_dim\\]"),
        "dtype_mix": ((q.double(), k, v, cu_q, cu_k), "share a dtype"),
        "cu_dtype": ((q, k, v, cu_q.long(), cu_k), "cu_seqlens_q must be int32"),
        "not_monotone": ((q, k, v, torch.tensor([0, 8, 7], dtype=torch.int32, device=DEVICE), cu_k),
                         "cu_seqlens_q must be non-decreasing"),
        "not_from_zero": ((q, k, v, cu_q, torch.tensor([1, 5, 11], dtype=torch.int32, device=DEVICE)),
                          "cu_seqlens_k must start at 0"),
        "wrong_end": ((q, k, v, cu_q, torch.tensor([0, 5, 10], dtype=torch.int32, device=DEVICE)),
                      "must end at T_k = 11"),
        "request_count": ((q, k, v, cu_q, torch.tensor([0, 5, 6, 11], dtype=torch.int32, device=DEVICE)),
                          "same number of requests"),
        "device": ((q, k, v, cu_q.to("meta"), cu_k), "one device"),
    }


@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize("case", bad_inputs().keys())
def test_bad_input_is_a_clear_value_error(case, function):
    args, message = bad_inputs()[case]
    if function == "triton_plan":
        message = PLAN_MESSAGES.get(case, message)
    with pytest.raises(ValueError, match=message):
        FUNCTIONS[function](*args)


def test_kernel_only_arguments():
    q, k, v, cu_q, cu_k = ragged_batch([3, 4], [5, 6], heads=2, head_dim=64, dtype=torch.float32)
    with pytest.raises(ValueError, match="max_seqlen_q = 3 is below the longest query run 4"):
        ragged_attention(q, k, v, cu_q, cu_k, 3, 6)
    with pytest.raises(ValueError, match="max_seqlen_k = 5 is below"):
        ragged_attention(q, k, v, cu_q, cu_k, 4, 5)
    with pytest.raises(ValueError, match="supports"):
        ragged_attention(q.double(), k.double(), v.double(), cu_q, cu_k, 4, 6)
    with pytest.raises(ValueError, match="max_seqlen_q = 3 is below the longest query run 4"):
        plan_ragged_attention(cu_q, cu_k, 3, 6, DEFAULT_LAUNCH_CONFIG)


@pytest.mark.parametrize("field, value, message", [
    ("block_m", 48, "block_m must be a power of two >= 16"),
    ("block_n", 8, "block_n must be a power of two >= 16"),
    ("num_warps", 6, "num_warps must be a power of two"),
    ("num_stages", 0, "num_stages must be >= 1"),
])
def test_launch_config_is_validated(field, value, message):
    with pytest.raises(ValueError, match=message):
        LaunchConfig(**{field: value})


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_hopper_table_serves_16_bit_at_its_head_dims(head_dim, dtype):
    assert launch_config(head_dim, dtype, (9, 0)) == HOPPER_LAUNCH_CONFIGS[head_dim]
    assert launch_config(head_dim, dtype, (9, 0)) != DEFAULT_LAUNCH_CONFIG


@pytest.mark.parametrize("head_dim, dtype, capability", [
    (64, torch.bfloat16, (8, 0)),  # Ampere
    (128, torch.float16, (10, 0)),  # Blackwell: not measured against this table
    (64, torch.float32, (9, 0)),
    (40, torch.bfloat16, (9, 0)),
    (128, torch.bfloat16, None),  # CPU / interpreter
])
def test_launch_config_falls_back_outside_the_table(head_dim, dtype, capability):
    assert launch_config(head_dim, dtype, capability) == DEFAULT_LAUNCH_CONFIG


def test_wrapper_launches_with_the_table_config(monkeypatch):
    # Pretend to be an H100: without a config, the wrapper must launch the table's entry (and the
    # kernel must be right with it: 64 x 64 tiles, 4 warps, 3 stages at head_dim 64).
    launched = []
    original_launch = ragged_module._launch

    def spy_launch(q, k, v, plan, *args, **kwargs):
        launched.append(plan.config)
        return original_launch(q, k, v, plan, *args, **kwargs)

    monkeypatch.setattr(ragged_module, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(ragged_module, "_launch", spy_launch)
    q_lens, k_lens = BATCHES["mixed_odd"]
    q, k, v, cu_q, cu_k = ragged_batch(q_lens, k_lens, heads=2, head_dim=64, dtype=torch.bfloat16)
    out = ragged_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens))
    assert launched == [HOPPER_LAUNCH_CONFIGS[64]]
    assert_matches_oracle(out, q, k, v, cu_q, cu_k)
    explicit = LaunchConfig(block_m=32, block_n=16)
    ragged_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), config=explicit)
    assert launched[-1] == explicit


def test_one_plan_serves_many_calls():
    # One plan per batch, reused by every layer: each call must match the oracle on its own q, k, v.
    q_lens, k_lens = BATCHES["many_small"]
    config = LaunchConfig(block_m=16, block_n=16)
    plan = None
    for layer in range(3):
        q, k, v, cu_q, cu_k = ragged_batch(q_lens, k_lens, heads=2, head_dim=64, dtype=torch.float32, seed=layer)
        plan = plan or plan_ragged_attention(cu_q, cu_k, max(q_lens), max(k_lens), config)
        assert_matches_oracle(ragged_attention_with_plan(q, k, v, plan), q, k, v, cu_q, cu_k, label=f"layer {layer}")
    assert plan.config == config and plan.num_requests == len(q_lens)
    assert (plan.total_q, plan.total_k) == (sum(q_lens), sum(k_lens))
    with pytest.raises(ValueError, match="the plan's T_q"):
        ragged_attention_with_plan(q[1:], k, v, plan)


def test_tuning_key_buckets():
    q = torch.zeros(300, 3, 64, dtype=torch.bfloat16)
    assert tuning_key(q, 1).max_seqlen_q_bucket == 64
    assert tuning_key(q, 64).max_seqlen_q_bucket == 64
    assert tuning_key(q, 65).max_seqlen_q_bucket == 128
    assert tuning_key(q, 300).max_seqlen_q_bucket == 512
    key = tuning_key(q, 300)
    assert (key.head_dim, key.dtype, key.capability, key.grid_waves_bucket) == (64, "bfloat16", None, 1)


def no_timing(run):
    raise AssertionError("the tuner timed a candidate off the GPU")


def test_tuner_falls_back_to_the_table_without_timing():
    """Off the GPU (CPU tensors, on any machine) the tuner times nothing and answers the table's config."""
    tuner = RaggedAttentionTuner(measure_ms=no_timing)
    q_lens, k_lens = BATCHES["mixed_odd"]
    q, k, v, cu_q, cu_k = (x.cpu() for x in ragged_batch(q_lens, k_lens, heads=2, head_dim=64, dtype=torch.bfloat16))
    config = tuner.config_for(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens))
    assert config == launch_config(64, torch.bfloat16, None) == DEFAULT_LAUNCH_CONFIG
    (result,) = tuner.results.values()
    assert result.source == "table" and result.timings_ms == {} and result.skipped == {}
    assert result.to_json()["config_name"] == config.name
    # Cached per key: the same bucket adds nothing, another max_seqlen_q bucket adds a key.
    tuner.config_for(q, k, v, cu_q, cu_k, max(q_lens) + 1, max(k_lens))
    assert len(tuner.results) == 1
    tuner.config_for(q, k, v, cu_q, cu_k, 1000, max(k_lens))
    assert len(tuner.results) == 2
    q, k, v, cu_q, cu_k = (x.to(DEVICE) for x in (q, k, v, cu_q, cu_k))
    assert_matches_oracle(ragged_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), config=config),
                          q, k, v, cu_q, cu_k)


def test_tuner_picks_the_fastest_candidate_and_skips_what_does_not_fit():
    # The timing loop without a GPU: fake runs and fake timings; one candidate over shared memory, one
    # that ptxas rejects (the "fastest" of all, were they timed).
    fast, slow, rejected, too_big = (TUNING_CANDIDATES[i] for i in (0, 1, 5, -1))
    times = {fast.name: 1.0, slow.name: 2.0, too_big.name: 0.5, rejected.name: 0.1}
    failures = {too_big: OutOfResources(300_000, 232_448, "shared memory"), rejected: PTXASError("ptxas fatal")}
    ran = []

    def run_of(config):
        def run():
            ran.append(config.name)
            if config in failures:
                raise failures[config]
        run.config = config
        return run

    tuner = RaggedAttentionTuner(candidates=[slow, too_big, fast, rejected],
                                 measure_ms=lambda run: times[run.config.name])
    key = tuning_key(torch.zeros(8, 1, 64), 8)
    result = tuner.pick(key, {config: run_of(config) for config in tuner.candidates}, fallback=DEFAULT_LAUNCH_CONFIG)
    assert result.config == fast and result.source == "tuned"
    assert result.timings_ms == {slow.name: 2.0, fast.name: 1.0}
    assert set(result.skipped) == {too_big.name, rejected.name}
    assert "shared memory" in result.skipped[too_big.name] and "ptxas" in result.skipped[rejected.name]
    assert sorted(ran) == sorted(config.name for config in tuner.candidates)
    nothing_fits = tuner.pick(key, {too_big: run_of(too_big)}, fallback=DEFAULT_LAUNCH_CONFIG)
    assert nothing_fits.config == DEFAULT_LAUNCH_CONFIG and nothing_fits.source == "table"


def test_tuner_does_not_swallow_bugs():
    def broken():
        raise IndexError("a bug, not a config that does not fit")

    tuner = RaggedAttentionTuner(measure_ms=no_timing)
    with pytest.raises(IndexError):
        tuner.pick(tuning_key(torch.zeros(8, 1, 64), 8), {TUNING_CANDIDATES[0]: broken}, DEFAULT_LAUNCH_CONFIG)


def test_tuning_candidates_cover_the_issue_space():
    assert len(set(TUNING_CANDIDATES)) == 2 * 3 * 2 * 3
    assert {c.block_n for c in TUNING_CANDIDATES} == {32, 64, 128}
    assert all(config in TUNING_CANDIDATES for config in HOPPER_LAUNCH_CONFIGS.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="tuning times kernels on a GPU")
def test_tuner_on_gpu_picks_a_timed_candidate():
    q_lens, k_lens = BATCHES["mixed_odd"]
    q, k, v, cu_q, cu_k = ragged_batch(q_lens, k_lens, heads=2, head_dim=64, dtype=torch.bfloat16)
    tuner = RaggedAttentionTuner(candidates=TUNING_CANDIDATES[:4])
    result = tuner.result_for(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens))
    assert result.source == "tuned" and result.config in TUNING_CANDIDATES[:4]
    assert len(result.timings_ms) + len(result.skipped) == 4
    out = ragged_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), config=result.config)
    assert_matches_oracle(out, q, k, v, cu_q, cu_k)
