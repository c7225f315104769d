"""The segmented LoRA kernel (Triton, interpreter on the CPU) against its reference, over ragged row
segments (empty ones, several on one adapter, rows with no adapter), ranks 4 to 128 in one batch, and
dtypes; the reference against plain per-row math."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retouch.kernels.segmented_lora import segmented_lora_ref, segmented_lora_triton

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}  # relative to values of order 1


def adapters(ranks, in_features, out_features, dtype, generator):
    """A: [G, R, in], B: [G, out, R] padded with garbage past each rank (it must never be read)."""
    max_rank = max(ranks)
    A = torch.randn(len(ranks), max_rank, in_features, generator=generator) / in_features ** 0.5
    B = torch.randn(len(ranks), out_features, max_rank, generator=generator) / max_rank ** 0.5
    for g, rank in enumerate(ranks):
        A[g, rank:] = float("nan")
        B[g, :, rank:] = float("nan")
    scales = torch.rand(len(ranks), generator=generator) + 0.5
    return A.to(dtype), B.to(dtype), scales


def run_both(x, y, A, B, scales, ranks, segments):
    expected, got = y.clone(), y.clone()
    segmented_lora_ref(x, expected, A, B, scales, ranks, segments)
    segmented_lora_triton(x, got, A, B, scales, ranks, segments)
    return expected, got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_batch_of_mixed_adapters_ranks_and_plain_rows(dtype):
    generator = torch.Generator().manual_seed(0)
    ranks = [4, 16, 128, 8]  # adapter 3 is loaded but no row uses it
    A, B, scales = adapters(ranks, 96, 80, dtype, generator)
    x = torch.randn(150, 96, generator=generator).to(dtype)
    y = torch.randn(150, 80, generator=generator).to(dtype)
    # Requests as row ranges: adapter 1 twice, an empty request, rows 40..60 and 140.. with no LoRA.
    segments = [(0, 40, 1), (60, 60, 0), (60, 97, 2), (97, 98, 0), (98, 140, 1)]
    expected, got = run_both(x, y, A, B, scales, ranks, segments)
    torch.testing.assert_close(got.float(), expected.float(), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    assert torch.equal(got[40:60], y[40:60]) and torch.equal(got[140:], y[140:])  # no LoRA: untouched
    assert not torch.equal(got[:40], y[:40])


@settings(max_examples=25, deadline=None)
@given(counts=st.lists(st.integers(0, 70), min_size=1, max_size=5), data=st.data())
def test_ragged_segments_match_the_reference(counts, data):
    ranks = data.draw(st.lists(st.sampled_from([4, 8, 16, 32, 64, 128]), min_size=1, max_size=3))
    generator = torch.Generator().manual_seed(sum(counts))
    A, B, scales = adapters(ranks, 40, 24, torch.float32, generator)
    segments, start = [], 0
    for count in counts:
        gap = data.draw(st.integers(0, 3))  # rows of requests without a LoRA between segments
        segments.append((start + gap, start + gap + count, data.draw(st.integers(0, len(ranks) - 1))))
        start += gap + count
    x = torch.randn(start + 2, 40, generator=generator)
    y = torch.randn(start + 2, 24, generator=generator)
    expected, got = run_both(x, y, A, B, scales, ranks, segments)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_the_reference_is_the_per_row_lora():
    generator = torch.Generator().manual_seed(1)
    ranks = [4, 12]
    A, B, scales = adapters(ranks, 10, 6, torch.float64, generator)
    x, y = torch.randn(5, 10, generator=generator, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    out = y.clone()
    segmented_lora_ref(x, out, A, B, scales, ranks, [(0, 2, 1), (3, 5, 0)])
    for row, adapter in ((0, 1), (1, 1), (3, 0), (4, 0)):
        rank = ranks[adapter]
        lora = scales[adapter].double() * (B[adapter, :, :rank] @ (A[adapter, :rank] @ x[row]))
        torch.testing.assert_close(out[row], y[row] + lora, rtol=1e-5, atol=1e-5)  # fp32 sums
    assert torch.equal(out[2], y[2])


@pytest.mark.parametrize("segments, ranks, message", [
    ([(0, 5, 0), (4, 8, 0)], [4], "disjoint"),
    ([(0, 20, 0)], [4], "disjoint"),
    ([(0, 5, 2)], [4], "adapters in"),
    ([(0, 5, 0)], [5], "ranks"),
])
def test_bad_segments_and_ranks_are_refused(segments, ranks, message):
    A, B, scales = adapters([4], 8, 8, torch.float32, torch.Generator().manual_seed(0))
    x, y = torch.randn(10, 8), torch.randn(10, 8)
    for op in (segmented_lora_ref, segmented_lora_triton):
        with pytest.raises(ValueError, match=message):
            op(x, y, A, B, scales, ranks, segments)
