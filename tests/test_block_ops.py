"""The composite ops of the mask-aware blocks (csrc/block_ops.cpp) and the planned attention, against
their references over shapes, dtypes and ragged batches (empty requests, one token, no keys)."""

import pytest
import torch

from retouch import ops
from retouch.kernels.reference import rope_pairs_ref, sdpa_ragged_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(0, 1, 8), (1, 1, 8), (7, 2, 16), (33, 3, 128), (2, 5, 1, 64), (1, 40, 4, 32)]  # [..., S, heads, d]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rope_pairs_is_diffusers_rope_bit_for_bit(shape, dtype):
    generator = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=generator).to(dtype)
    angles = torch.rand(shape[-3], shape[-1] // 2, generator=generator) * 6.28
    cos = angles.cos().repeat_interleave(2, -1)  # Flux's tables repeat each angle for its pair
    sin = angles.sin().repeat_interleave(2, -1)
    out = ops.rope_pairs(x, cos, sin)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, rope_pairs_ref(x, cos, sin))


def test_rope_pairs_checks_its_inputs():
    with pytest.raises(RuntimeError, match="tables"):
        ops.rope_pairs(torch.zeros(4, 2, 8), torch.zeros(3, 8), torch.zeros(3, 8))
    with pytest.raises(RuntimeError, match="even"):
        ops.rope_pairs(torch.zeros(4, 2, 7), torch.zeros(4, 7), torch.zeros(4, 7))


RAGGED = [([5], [9]), ([0, 3, 1], [4, 0, 6]), ([1, 1, 1, 1], [1, 2, 3, 4]), ([16, 0], [16, 32]), ([12, 7], [50, 9])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", RAGGED, ids=str)
def test_sdpa_ragged_equals_per_request_sdpa(lengths, dtype):
    lengths_q, lengths_k = lengths
    generator = torch.Generator().manual_seed(len(lengths_q))
    q = torch.randn(sum(lengths_q), 2, 32, generator=generator).to(dtype)
    k, v = (torch.randn(sum(lengths_k), 2, 32, generator=generator).to(dtype) for _ in range(2))
    out = torch.ops.retouch.sdpa_ragged(q, k, v, torch.tensor(lengths_q), torch.tensor(lengths_k), 0.3)
    assert torch.equal(out, sdpa_ragged_ref(q, k, v, lengths_q, lengths_k, 0.3))
    with pytest.raises(RuntimeError, match="sum to"):
        torch.ops.retouch.sdpa_ragged(q, k, v, torch.tensor([n + 1 for n in lengths_q]), torch.tensor(lengths_k), 0.3)
    with pytest.raises(RuntimeError, match="int64 CPU"):
        torch.ops.retouch.sdpa_ragged(q, k, v, torch.tensor(lengths_q, dtype=torch.int32), torch.tensor(lengths_k), 0.3)


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
@pytest.mark.parametrize("lengths", RAGGED, ids=str)
def test_planned_attention_equals_ragged_attention(lengths, backend):
    lengths_q, lengths_k = lengths
    generator = torch.Generator().manual_seed(7 + len(lengths_q))
    q = torch.randn(sum(lengths_q), 2, 64, generator=generator)
    k, v = (torch.randn(sum(lengths_k), 2, 64, generator=generator) for _ in range(2))
    plan = ops.plan_attention(lengths_q, lengths_k, "cpu", torch.float32, 64, backend=backend)
    assert plan.backend == backend and plan.max_seqlen_q == max(lengths_q)
    expected = ops.ragged_attention(q, k, v, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q,
                                    plan.max_seqlen_k, backend="sdpa")
    torch.testing.assert_close(ops.planned_attention(q, k, v, plan), expected, atol=2e-6, rtol=2e-5)


def test_plan_attention_refuses_bad_lengths():
    with pytest.raises(ValueError, match="same requests"):
        ops.plan_attention([1, 2], [3], "cpu", torch.float32, 8)
    with pytest.raises(ValueError, match=">= 0"):
        ops.plan_attention([-1], [3], "cpu", torch.float32, 8)


def test_the_composite_ops_pass_opcheck():
    # Schema, fake (meta) kernels and dispatch are consistent: what torch.compile relies on.
    x, table = torch.randn(6, 2, 8), torch.randn(6, 8)
    torch.library.opcheck(torch.ops.retouch.rope_pairs, (x, table, table))
    q, k = torch.randn(5, 2, 8), torch.randn(9, 2, 8)
    torch.library.opcheck(torch.ops.retouch.sdpa_ragged, (q, k, k, torch.tensor([2, 3]), torch.tensor([4, 5]), 0.5))
