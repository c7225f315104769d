"""The Triton row gather/scatter (interpreter on CPU) against the reference: exact, over a grid."""

import pytest
import torch

from retouch.kernels.reference import gather_rows_ref, scatter_rows_ref
from retouch.kernels.row_copy import gather_rows_triton, scatter_rows_triton

HIDDEN_SIZES = [1, 33, 256]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NUM_ROWS = 23


def index_sets(generator):
    return {
        "empty": torch.empty(0, dtype=torch.long),
        "one": torch.tensor([NUM_ROWS - 1]),
        "all": torch.randperm(NUM_ROWS, generator=generator),
        "subset": torch.randperm(NUM_ROWS, generator=generator)[:5],
    }


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_triton_gather_scatter_match_reference(hidden, dtype, index_dtype):
    generator = torch.Generator().manual_seed(hidden)
    src = torch.randn(NUM_ROWS, hidden, generator=generator).to(dtype)
    for name, row_idx in index_sets(generator).items():
        row_idx = row_idx.to(index_dtype)
        assert torch.equal(gather_rows_triton(src, row_idx, block_h=32), gather_rows_ref(src, row_idx)), name
        updates = torch.randn(len(row_idx), hidden, generator=generator).to(dtype)
        dst, expected = src.clone(), src.clone()
        scatter_rows_triton(dst, row_idx, updates, block_h=32)
        scatter_rows_ref(expected, row_idx, updates)
        assert torch.equal(dst, expected), name


def test_strided_rows():
    wide = torch.randn(NUM_ROWS, 80)
    src = wide[:, 7:47]
    row_idx = torch.tensor([4, 0, 22])
    assert torch.equal(gather_rows_triton(src, row_idx, block_h=16), gather_rows_ref(src, row_idx))
    dst, expected = wide.clone(), wide.clone()
    scatter_rows_triton(dst[:, 7:47], row_idx, torch.ones(3, 40), block_h=16)
    scatter_rows_ref(expected[:, 7:47], row_idx, torch.ones(3, 40))
    assert torch.equal(dst, expected)


def test_bad_arguments():
    with pytest.raises(ValueError, match="out of range"):
        gather_rows_triton(torch.zeros(4, 2), torch.tensor([4]))
    with pytest.raises(ValueError, match="int32/int64"):
        gather_rows_triton(torch.zeros(4, 2), torch.tensor([0.0]))
    with pytest.raises(ValueError, match="src must be"):
        scatter_rows_triton(torch.zeros(4, 2), torch.tensor([0]), torch.zeros(1, 3))
