"""The ops of the mask-aware blocks (csrc/block_ops.cpp, the Triton kernels/norm_rope.py on the kernel
device) and the planned attention, against their references over shapes, dtypes and ragged batches
(empty requests, one token, no keys)."""

import pytest
import torch

from retouch import ops
from retouch.kernels.norm_rope import norm_rope_triton
from retouch.kernels.reference import rms_norm_rope_ref, rope_pairs_ref, sdpa_ragged_ref

from kernel_device import TRITON_DEVICE

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


def flux_tables(shape, generator):
    angles = torch.rand(shape[-3], shape[-1] // 2, generator=generator) * 6.28
    return angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)


# One rounding per output element apart from the norm's sum of squares, whose order differs.
NORM_TOLERANCE = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
                  torch.float16: dict(atol=2e-3, rtol=2e-3)}


def triton_on_kernel_device(x, weight, eps, cos, sin) -> torch.Tensor:
    """`norm_rope_triton` where the Triton kernels run (`TRITON_DEVICE`), brought back to x's device."""
    moved = [None if t is None else t.to(TRITON_DEVICE) for t in (x, weight, cos, sin)]
    return norm_rope_triton(moved[0], moved[1], eps, moved[2], moved[3], block_rows=4).to(x.device)


def assert_triton_close(out: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Triton's interpreter rounds fp32 -> bf16 by truncation (a GPU rounds to nearest), so its bf16
    rows may differ by an ulp per rounding: two roundings at the output's scale."""
    if out.dtype == torch.bfloat16 and out.numel():
        atol = 2 * torch.finfo(torch.bfloat16).eps * expected.float().abs().max().item()
        torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0, msg=name)
    else:
        torch.testing.assert_close(out, expected, **NORM_TOLERANCE[out.dtype], msg=name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("rope", [True, False], ids=["norm+rope", "norm"])
@pytest.mark.parametrize("weighted", [True, False], ids=["weight", "no-weight"])
def test_rms_norm_rope_equals_norm_then_rope(shape, dtype, rope, weighted):
    generator = torch.Generator().manual_seed(sum(shape) + 2 * rope + weighted)
    x = (3 * torch.randn(shape, generator=generator)).to(dtype)
    weight = torch.randn(shape[-1], generator=generator).to(dtype) if weighted else None
    cos, sin = flux_tables(shape, generator) if rope else (None, None)
    expected = rms_norm_rope_ref(x, weight, 1e-6, cos, sin)
    composite = torch.ops.retouch.rms_norm_rope.default.redispatch(
        torch._C.DispatchKeySet("CompositeExplicitAutograd"), x, weight, 1e-6, cos, sin)
    for name, out in {"op": ops.rms_norm_rope(x, weight, 1e-6, cos, sin), "composite": composite}.items():
        assert out.dtype == dtype and out.shape == x.shape, name
        torch.testing.assert_close(out, expected, **NORM_TOLERANCE[dtype], msg=name)
    triton_out = triton_on_kernel_device(x, weight, 1e-6, cos, sin)
    assert triton_out.dtype == dtype and triton_out.shape == x.shape
    assert_triton_close(triton_out, expected, "triton")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:4], ids=str)
def test_triton_rope_is_diffusers_rope(shape, dtype):
    generator = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=generator).to(dtype)
    cos, sin = flux_tables(shape, generator)
    out, expected = triton_on_kernel_device(x, None, None, cos, sin), rope_pairs_ref(x, cos, sin)
    if dtype == torch.bfloat16:
        assert_triton_close(out, expected, "triton")
    else:
        assert torch.equal(out, expected)  # the same roundings, one per element


def test_rms_norm_rope_checks_its_inputs():
    x = torch.zeros(4, 2, 8)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm_rope(x, torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="tables"):
        ops.rms_norm_rope(x, None, 1e-6, torch.zeros(3, 8), torch.zeros(3, 8))
    with pytest.raises(RuntimeError, match="both"):
        torch.ops.retouch.rms_norm_rope(x, None, 1e-6, torch.zeros(4, 8), None)
    with pytest.raises(ValueError, match="tables"):
        norm_rope_triton(x, None, 1e-6, torch.zeros(3, 8), torch.zeros(3, 8))


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
    torch.library.opcheck(torch.ops.retouch.rms_norm_rope, (x, torch.randn(8), 1e-6, table, table))
    torch.library.opcheck(torch.ops.retouch.rms_norm_rope, (x, None, 1e-5, None, None))
    q, k = torch.randn(5, 2, 8), torch.randn(9, 2, 8)
    torch.library.opcheck(torch.ops.retouch.sdpa_ragged, (q, k, k, torch.tensor([2, 3]), torch.tensor([4, 5]), 0.5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_blocks_norm_helpers_compute_what_the_modules_do(dtype):
    """`block_math.norm_rope` and `layer_norm`/`linear` stand in for the modules' forwards: torch's
    RMSNorm (its eps=None default is fp32's eps, whatever the dtype), diffusers' RMSNorm, LayerNorm
    without affine parameters, and a module whose forward a hook replaced runs that forward."""
    from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm

    from retouch.adapters.block_math import layer_norm, linear, norm_rope

    generator = torch.Generator().manual_seed(3)
    x = (4 * torch.randn(5, 3, 16, generator=generator)).to(dtype)
    for norm in (torch.nn.RMSNorm(16, eps=None), torch.nn.RMSNorm(16, eps=1e-3, elementwise_affine=False),
                 DiffusersRMSNorm(16, eps=1e-6), DiffusersRMSNorm(16, eps=1e-6, elementwise_affine=False)):
        with torch.no_grad():
            if getattr(norm, "weight", None) is not None:
                norm.weight.copy_(torch.rand(16, generator=generator) + 0.5)
        norm = norm.to(dtype)
        torch.testing.assert_close(norm_rope(norm, x), norm(x), **NORM_TOLERANCE[dtype], msg=repr(norm))
    plain = torch.nn.LayerNorm(16, elementwise_affine=False, eps=1e-6).to(dtype)
    assert torch.equal(layer_norm(plain, x), plain(x))
    lin = torch.nn.Linear(16, 4).to(dtype)
    assert torch.equal(linear(lin, x), lin(x))
    lin.forward = lambda rows: torch.full((*rows.shape[:-1], 4), 7.0, dtype=dtype)  # an offload/casting hook
    assert torch.equal(linear(lin, x), torch.full((5, 3, 4), 7.0, dtype=dtype))
