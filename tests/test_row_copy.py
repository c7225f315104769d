"""retouch._C row gather/scatter against the pure-PyTorch reference: exact, over a grid of shapes."""

import subprocess
import sys

import pytest
import torch

from retouch import ops
from retouch.kernels.reference import gather_rows_ref, scatter_rows_ref

HIDDEN_SIZES = [1, 8, 769, 3072]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]
INDEX_DTYPES = [torch.int32, torch.int64]
NUM_ROWS = 97


def random_rows(num_rows: int, hidden: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if dtype == torch.uint8:
        return torch.randint(0, 256, (num_rows, hidden), dtype=dtype, generator=generator)
    return torch.randn(num_rows, hidden, generator=generator).to(dtype)


def index_sets(num_rows: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "empty": torch.empty(0, dtype=torch.long),
        "one": torch.tensor([num_rows - 1]),
        "all": torch.arange(num_rows),
        "permutation": torch.randperm(num_rows, generator=generator),
        "subset": torch.randperm(num_rows, generator=generator)[: num_rows // 5],
    }


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_gather_scatter_match_reference(hidden, dtype, index_dtype):
    generator = torch.Generator().manual_seed(hidden)
    src = random_rows(NUM_ROWS, hidden, dtype, generator)
    for name, row_idx in index_sets(NUM_ROWS, generator).items():
        row_idx = row_idx.to(index_dtype)
        packed = ops.gather_rows(src, row_idx)
        assert torch.equal(packed, gather_rows_ref(src, row_idx)), name

        updates = random_rows(len(row_idx), hidden, dtype, generator)
        dst, expected = src.clone(), src.clone()
        ops.scatter_rows_(dst, row_idx, updates)
        scatter_rows_ref(expected, row_idx, updates)
        assert torch.equal(dst, expected), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows(dtype):
    # Rows of a [N, 2H] buffer viewed as [N, H]: row stride 2H, unit stride along H.
    generator = torch.Generator().manual_seed(0)
    wide = random_rows(NUM_ROWS, 2 * 33, dtype, generator)
    src = wide[:, 5:38]
    row_idx = torch.randperm(NUM_ROWS, generator=generator)[:40]
    assert torch.equal(ops.gather_rows(src, row_idx), gather_rows_ref(src, row_idx))

    updates = random_rows(40, 33, dtype, generator)
    dst_wide, expected_wide = wide.clone(), wide.clone()
    ops.scatter_rows_(dst_wide[:, 5:38], row_idx, updates)
    scatter_rows_ref(expected_wide[:, 5:38], row_idx, updates)
    assert torch.equal(dst_wide, expected_wide)  # columns outside the view untouched


def test_ragged_batch_round_trip():
    # A batch of requests over [B, L, H] with different masked-token counts (including none and all),
    # packed into [T, H] by global row index b * L + i and scattered back.
    generator = torch.Generator().manual_seed(1)
    batch, length, hidden = 4, 64, 48
    hidden_states = torch.randn(batch, length, hidden, generator=generator, dtype=torch.bfloat16)
    masked_counts = [0, 1, 37, length]
    masked_idx = [torch.randperm(length, generator=generator)[:n].sort().values for n in masked_counts]
    row_idx = torch.cat([b * length + idx for b, idx in enumerate(masked_idx)])

    packed = ops.gather_rows(hidden_states.view(-1, hidden), row_idx)
    assert packed.shape == (sum(masked_counts), hidden)
    offset = 0
    for b, idx in enumerate(masked_idx):
        assert torch.equal(packed[offset : offset + len(idx)], hidden_states[b, idx])
        offset += len(idx)

    out = torch.zeros_like(hidden_states)
    ops.scatter_rows_(out.view(-1, hidden), row_idx, packed)
    for b, idx in enumerate(masked_idx):
        assert torch.equal(out[b, idx], hidden_states[b, idx])
        unmasked = torch.ones(length, dtype=torch.bool)
        unmasked[idx] = False
        assert not out[b, unmasked].any()


def test_out_of_range_index_is_rejected_before_any_write():
    dst = torch.zeros(10, 4)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.scatter_rows_(dst, torch.tensor([2, 10]), torch.ones(2, 4))
    assert not dst.any()
    with pytest.raises(RuntimeError, match="out of range"):
        ops.gather_rows(dst, torch.tensor([-1]))


@pytest.mark.parametrize(
    "src, row_idx, message",
    [
        (torch.zeros(2, 3, 4), torch.tensor([0]), "must be 2-D"),
        (torch.zeros(4, 3).t(), torch.tensor([0]), "unit stride"),
        (torch.zeros(4, 3), torch.tensor([0.0]), "int32 or int64"),
        (torch.zeros(4, 3), torch.tensor([[0]]), "must be 1-D"),
    ],
)
def test_bad_gather_arguments(src, row_idx, message):
    with pytest.raises(RuntimeError, match=message):
        ops.gather_rows(src, row_idx)


def test_bad_scatter_arguments():
    with pytest.raises(RuntimeError, match="hidden"):
        ops.scatter_rows_(torch.zeros(4, 3), torch.tensor([0]), torch.zeros(1, 5))
    with pytest.raises(RuntimeError, match="dtype"):
        ops.scatter_rows_(torch.zeros(4, 3), torch.tensor([0]), torch.zeros(1, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="rows but row_idx"):
        ops.scatter_rows_(torch.zeros(4, 3), torch.tensor([0, 1]), torch.zeros(1, 3))


def test_ops_pass_opcheck():
    # Schema, fake (meta) kernel and dispatch agree: what torch.compile relies on.
    src = torch.randn(16, 8)
    row_idx = torch.tensor([3, 0, 15])
    torch.library.opcheck(torch.ops.retouch.gather_rows.default, (src, row_idx))
    torch.library.opcheck(torch.ops.retouch.scatter_rows_.default, (src.clone(), row_idx, torch.randn(3, 8)))


def test_extension_reports_cpu_part():
    info = ops.extension_info()
    assert info["built"] and info["cpu"] and info["error"] is None
    if torch.version.cuda is None:  # a CPU build of torch cannot have compiled the CUDA part
        assert not info["cuda"]


def test_extension_imports_on_its_own():
    # A fresh interpreter, `import retouch._C` first: the package must load torch's libraries itself.
    result = subprocess.run([sys.executable, "-c", "import retouch._C as C; print(C.built_with_cuda())"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() in ("True", "False")
