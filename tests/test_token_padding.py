"""Padding the computed tokens to buckets (the shapes CUDA graphs are captured for): the bucket sizes,
`RaggedBatch.padded`, and that a padded forward returns what the unpadded one does, for every family
and cache mode (eagerly here; compiled in test_compile.py, captured on a GPU there too)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from forward_cases import EDIT_MODES, FAMILY_MODELS, Forwards
from replay_checks import assert_close_ulps
from retouch.ragged import RaggedBatch, token_bucket

# Padding repeats rows, so a padded forward differs from the unpadded one only where a matmul over
# more rows blocks its sums otherwise: the adapter tests' tolerance.
OUTPUT_ULPS = 8


@given(st.integers(0, 1 << 20), st.sampled_from([16, 64, 128]))
def test_buckets_hold_the_count_with_bounded_padding(count, granularity):
    bucket = token_bucket(count, granularity)
    assert bucket >= count
    assert bucket - count <= max(granularity, count // 8)
    assert token_bucket(bucket, granularity) == bucket  # a bucket is its own bucket
    assert token_bucket(count + 1, granularity) >= bucket  # monotone


def test_bucket_count_is_small():
    assert len({token_bucket(n) for n in range(4096 + 512 + 1)}) <= 40


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=4), st.integers(0, 3), st.integers(0, 9))
def test_padded_batch_repeats_the_last_computed_image_token(counts, prefix, extra):
    num_image = 12
    generator = torch.Generator().manual_seed(sum(counts) + prefix)
    masks = [torch.randperm(num_image, generator=generator)[:count] for count in counts]
    batch = RaggedBatch.from_masked_indices(masks, num_image, prefix=prefix)
    padded = batch.padded(batch.num_query_tokens + extra)
    with_images = [b for b, count in enumerate(counts) if count]
    if not with_images or extra == 0:
        assert padded is batch
        return
    last = with_images[-1]
    assert padded.num_query_tokens == batch.num_query_tokens + extra
    assert torch.equal(padded.cu_seqlens_q[1:] - padded.cu_seqlens_q[:-1],
                       torch.tensor([len(idx) + extra * (b == last) for b, idx in enumerate(batch.query_idx)],
                                    dtype=torch.int32))
    for b, (idx, padded_idx) in enumerate(zip(batch.query_idx, padded.query_idx)):
        assert torch.equal(padded_idx[:len(idx)], idx)
        assert torch.equal(padded_idx[len(idx):], idx[-1:].expand(extra if b == last else 0))
    # The rows follow the same order: each request's rows, the repeats closing the padded request's.
    row_offsets = torch.tensor((0,) + batch.seq_lens).cumsum(0)
    expected_rows = torch.cat([row_offsets[b] + idx for b, idx in enumerate(padded.query_idx)])
    assert torch.equal(padded.query_rows, expected_rows)
    assert torch.equal(padded.reused_rows, batch.reused_rows)
    with pytest.raises(ValueError, match="cannot pad"):
        batch.padded(batch.num_query_tokens - 1)


@pytest.fixture(scope="module", params=list(FAMILY_MODELS))
def forwards(request):
    return Forwards(FAMILY_MODELS[request.param])


@pytest.mark.parametrize("mode", EDIT_MODES, ids=lambda mode: mode.name)
def test_padded_forward_equals_unpadded(forwards, mode):
    for case in ([0.2], [0.1, 0.6, 0.0], [0.3, 1.0]):
        forwards.adapter.pad_tokens(None)
        expected = forwards.forward(forwards.context(mode, case))
        forwards.adapter.pad_tokens(lambda count: count + 7)
        try:
            actual = forwards.forward(forwards.context(mode, case))
        finally:
            forwards.adapter.pad_tokens(None)
        assert_close_ulps(actual, expected, OUTPUT_ULPS)
