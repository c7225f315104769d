"""The ragged-batch descriptor: index lists, rows and cu_seqlens agree with each other."""

import dataclasses

import pytest
import torch

from retouch.ragged import RaggedBatch


def test_descriptor_of_mixed_batch_with_text_prefix():
    masked = [torch.tensor([5, 1, 1]), torch.tensor([], dtype=torch.long), torch.arange(8)]
    batch = RaggedBatch.from_masked_indices(masked, num_image_tokens=8, prefix=2)
    assert batch.seq_lens == (10, 10, 10)
    assert [idx.tolist() for idx in batch.query_idx] == [[0, 1, 3, 7], [0, 1], list(range(10))]
    assert batch.cu_seqlens_q.tolist() == [0, 4, 6, 16] and batch.cu_seqlens_q.dtype == torch.int32
    assert batch.cu_seqlens_k.tolist() == [0, 10, 20, 30]
    assert (batch.max_seqlen_q, batch.max_seqlen_k) == (10, 10)
    assert batch.query_rows.tolist() == [0, 1, 3, 7, 10, 11] + list(range(20, 30))
    # query and reused rows partition all rows
    assert sorted(batch.query_rows.tolist() + batch.reused_rows.tolist()) == list(range(30))


def test_requests_of_different_lengths():
    batch = RaggedBatch.from_masked_indices([torch.tensor([0]), torch.tensor([3])], num_image_tokens=[4, 16])
    assert batch.cu_seqlens_k.tolist() == [0, 4, 20]
    assert batch.query_rows.tolist() == [0, 7]
    assert batch.max_seqlen_k == 16


def test_empty_batch():
    batch = RaggedBatch.from_masked_indices([], num_image_tokens=8)
    assert batch.batch_size == 0 and batch.num_query_tokens == 0
    assert batch.cu_seqlens_q.tolist() == [0] and batch.max_seqlen_q == 0


def test_gathered_rows_are_the_query_tokens():
    hidden = torch.randn(3, 6, 4)
    masked = [torch.tensor([0, 4]), torch.tensor([2]), torch.tensor([1, 2, 3])]
    batch = RaggedBatch.from_masked_indices(masked, num_image_tokens=6)
    packed = hidden.reshape(-1, 4)[batch.query_rows]
    q = batch.cu_seqlens_q.tolist()
    for b in range(3):
        assert torch.equal(packed[q[b]:q[b + 1]], hidden[b, masked[b]])


@pytest.mark.parametrize("bad", [torch.tensor([8]), torch.tensor([-1])])
def test_out_of_range_index(bad):
    with pytest.raises(ValueError, match="out of range"):
        RaggedBatch.from_masked_indices([bad], num_image_tokens=8)


def test_the_host_indices_are_the_device_ones_and_padding_keeps_them():
    batch = RaggedBatch.from_masked_indices([torch.tensor([3, 1]), torch.tensor([], dtype=torch.long)], 6, prefix=2)
    assert [idx.tolist() for idx in batch.host_query_idx()] == [idx.tolist() for idx in batch.query_idx] == [
        [0, 1, 3, 5], [0, 1]]
    padded = batch.padded(batch.num_query_tokens + 3)
    assert padded.host_query_idx() == batch.host_query_idx()  # as built: the planning reads need no repeats
    made_elsewhere = dataclasses.replace(batch, query_idx_host=())
    assert [idx.tolist() for idx in made_elsewhere.host_query_idx()] == [[0, 1, 3, 5], [0, 1]]
