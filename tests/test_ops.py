"""The `retouch` torch ops: backends agree, schemas and fake kernels pass opcheck, bad backends fail."""

import pytest
import torch
from kernel_device import TRITON_DEVICE

from retouch import ops
from retouch.kernels.ragged_attention import ragged_attention_ref
from retouch.ragged import RaggedBatch


def packed_attention_inputs(dtype=torch.float32, device="cpu"):
    # Requests of 3 and 0 and 7 queries over 9, 5 and 9 keys: an empty request in the middle.
    generator = torch.Generator().manual_seed(0)
    cu_q = torch.tensor([0, 3, 3, 10], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 9, 14, 23], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(n, 2, 16, generator=generator).to(device=device, dtype=dtype) for n in (10, 23, 23))
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("backend", ["auto", "sdpa", "triton"])
def test_ragged_attention_backends_match_oracle(backend):
    q, k, v, cu_q, cu_k = packed_attention_inputs(device=TRITON_DEVICE)
    out = ops.ragged_attention(q, k, v, cu_q, cu_k, 7, 9, backend=backend)
    torch.testing.assert_close(out, ragged_attention_ref(q, k, v, cu_q, cu_k), atol=1e-5, rtol=1e-5)


def test_auto_backend_on_cpu_is_sdpa():
    assert ops.resolve_attention_backend("auto", torch.zeros(1, 1, 16)) == "sdpa"


def test_bad_backends():
    q, k, v, cu_q, cu_k = packed_attention_inputs()
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.ragged_attention(q, k, v, cu_q, cu_k, 7, 9, backend="magic")
    if not ops.FLASH_ATTN_AVAILABLE:
        with pytest.raises(ValueError, match="flash-attn is not installed"):
            ops.ragged_attention(q, k, v, cu_q, cu_k, 7, 9, backend="flash_attn")
    with pytest.raises(ValueError, match="row-copy backend"):
        ops.gather_rows(torch.zeros(2, 2), torch.tensor([0]), backend="magic")


def test_custom_ops_pass_opcheck():
    q, k, v, cu_q, cu_k = packed_attention_inputs()
    torch.library.opcheck(torch.ops.retouch.ragged_attention.default, (q, k, v, cu_q, cu_k, 7, 9, 0.25, "sdpa"))
    src, row_idx = torch.randn(12, 8, device=TRITON_DEVICE), torch.tensor([5, 0, 11], device=TRITON_DEVICE)
    torch.library.opcheck(torch.ops.retouch.gather_rows_triton.default, (src, row_idx))
    torch.library.opcheck(torch.ops.retouch.scatter_rows_triton_.default,
                          (src.clone(), row_idx, torch.randn(3, 8, device=TRITON_DEVICE)))


@pytest.mark.parametrize("backend", ops.ROW_COPY_BACKENDS)
def test_row_copy_backends_on_a_ragged_batch(backend):
    # Pack the masked tokens of a [B, L, H] batch with the descriptor's rows, and scatter them back.
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    hidden = torch.randn(3, 16, 8).to(device=device, dtype=torch.bfloat16)
    masked = [torch.tensor([1, 5, 9]), torch.tensor([], dtype=torch.long), torch.arange(16)]
    batch = RaggedBatch.from_masked_indices(masked, num_image_tokens=16, device=device)
    packed = ops.gather_rows(hidden.view(-1, 8), batch.query_rows, backend=backend)
    assert torch.equal(packed, hidden.view(-1, 8)[batch.query_rows])
    restored = torch.zeros_like(hidden)
    ops.scatter_rows_(restored.view(-1, 8), batch.query_rows, packed, backend=backend)
    assert torch.equal(restored.view(-1, 8)[batch.query_rows], packed)
    assert not restored.view(-1, 8)[batch.reused_rows].any()


def test_flop_counter_sees_ragged_attention():
    q, k, v, cu_q, cu_k = packed_attention_inputs()
    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
        ops.ragged_attention(q, k, v, cu_q, cu_k, 7, 9)
    heads, head_dim = q.shape[1:]
    assert counter.get_total_flops() == 4 * heads * head_dim * (3 * 9 + 0 * 5 + 7 * 9)


def test_triton_attention_plans_a_batch_once_for_all_its_blocks():
    q, k, v, cu_q, cu_k = packed_attention_inputs(device=TRITON_DEVICE)
    plans = ops.RecentPlans()
    ops._recent_plans, saved = plans, ops._recent_plans
    try:
        outs = [ops.ragged_attention(q * (i + 1), k, v, cu_q, cu_k, 7, 9, backend="triton") for i in range(3)]
        assert plans.built == 1  # three "blocks" of one forward, one validation and block map
        for i, out in enumerate(outs):
            torch.testing.assert_close(out, ragged_attention_ref(q * (i + 1), k, v, cu_q, cu_k), atol=1e-5, rtol=1e-5)
        # Equal values in another tensor (the next forward's batch) and an in-place change both re-plan.
        ops.ragged_attention(q, k, v, cu_q.clone(), cu_k, 7, 9, backend="triton")
        assert plans.built == 2
        cu_k.copy_(cu_k)
        ops.ragged_attention(q, k, v, cu_q, cu_k, 7, 9, backend="triton")
        assert plans.built == 3
        # A plan never outlives its layout: wrong totals are refused, not read out of bounds.
        with pytest.raises(ValueError, match="plan's T_q"):
            ops.ragged_attention(q[:-1], k, v, cu_q, cu_k, 7, 9, backend="triton")
    finally:
        ops._recent_plans = saved
