"""retouch::gather_host_rows_ (HostArena rows -> staging buffer) against the pure-PyTorch reference: exact."""

import pytest
import torch

from retouch import ops
from retouch.kernels.reference import gather_host_rows_ref

HIDDEN_SIZES = [1, 8, 769, 3072]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float8_e4m3fn]
TEMPLATE_ROWS = 37  # rows stored in the arena
STAGING_ROWS = 41  # rows of the destination buffer
SENTINEL = 0xAB


def filled_arena(row_bytes: int, generator: torch.Generator, pinned: bool = False):
    """An arena holding TEMPLATE_ROWS random rows back to back from `base`, and room for an unaligned copy."""
    arena = ops.HostArena(2 * TEMPLATE_ROWS * row_bytes + 1024, pinned=pinned)
    base = arena.allocate(TEMPLATE_ROWS * row_bytes + 64)
    memory = arena.tensor()
    memory.copy_(torch.randint(0, 256, memory.shape, dtype=torch.uint8, generator=generator))
    return arena, memory, base


def index_sets(row_bytes: int, base: int, generator: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (src_offsets, dst_rows): which template rows go to which staging rows."""
    def rows_at(template_rows, staging_rows, shift=0):
        offsets = base + shift + torch.as_tensor(template_rows, dtype=torch.long) * row_bytes
        return offsets, torch.as_tensor(staging_rows, dtype=torch.long)

    subset = torch.randperm(TEMPLATE_ROWS, generator=generator)[:13]
    return {
        "empty": rows_at([], []),
        "one": rows_at([TEMPLATE_ROWS - 1], [STAGING_ROWS - 1]),
        "all": rows_at(range(TEMPLATE_ROWS), range(TEMPLATE_ROWS)),
        "random subset": rows_at(subset, torch.randperm(STAGING_ROWS, generator=generator)[:13]),
        # An unmasked-token pattern: runs of adjacent rows on both sides, split by a masked rectangle.
        "contiguous runs": rows_at([*range(0, 10), *range(15, 25), *range(30, 37)],
                                   [*range(2, 12), *range(17, 27), *range(32, 39)]),
        "reversed": rows_at(range(TEMPLATE_ROWS - 1, -1, -1), range(TEMPLATE_ROWS)),
        "unaligned": rows_at(range(0, TEMPLATE_ROWS, 2), range(0, TEMPLATE_ROWS, 2), shift=3),
    }


def sentinel_staging(rows: int, hidden: int, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    staging = torch.empty(rows, hidden, dtype=dtype, device=device)
    staging.view(torch.uint8).fill_(SENTINEL)
    return staging


def assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor, message: str = "") -> None:
    # Bitwise, so that NaN patterns in float sentinels and float8 bytes compare exactly.
    assert torch.equal(actual.view(torch.uint8).cpu(), expected.view(torch.uint8).cpu()), message


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_matches_reference(hidden, dtype):
    generator = torch.Generator().manual_seed(hidden)
    row_bytes = hidden * dtype.itemsize
    arena, memory, base = filled_arena(row_bytes, generator)
    for name, (src_offsets, dst_rows) in index_sets(row_bytes, base, generator).items():
        staging = sentinel_staging(STAGING_ROWS, hidden, dtype)
        expected = staging.clone()
        ops.gather_host_rows_(staging, memory, src_offsets, dst_rows)
        gather_host_rows_ref(expected, memory, src_offsets, dst_rows)
        assert_bytes_equal(staging, expected, name)
        untouched = torch.ones(STAGING_ROWS, dtype=torch.bool)
        untouched[dst_rows] = False
        assert bool((staging.view(torch.uint8)[untouched] == SENTINEL).all()), name


def test_strided_staging_rows():
    # Staging rows that are the first 33 columns of a [N, 80] buffer: the other columns stay untouched.
    generator = torch.Generator().manual_seed(0)
    arena, memory, base = filled_arena(33 * 2, generator)
    src_offsets, dst_rows = index_sets(33 * 2, base, generator)["contiguous runs"]
    wide = sentinel_staging(STAGING_ROWS, 80, torch.bfloat16)
    expected = wide.clone()
    ops.gather_host_rows_(wide[:, :33], memory, src_offsets, dst_rows)
    gather_host_rows_ref(expected[:, :33], memory, src_offsets, dst_rows)
    assert_bytes_equal(wide, expected)
    assert bool((wide.view(torch.uint8)[:, 66:] == SENTINEL).all())


def test_bad_index_leaves_dst_untouched():
    memory = torch.arange(256, dtype=torch.uint8)
    staging = sentinel_staging(4, 8, torch.uint8)
    cases = [
        ([0, 249], [0, 1], "src_offsets\\[1\\] = 249.*out of range for src of 256 bytes"),
        ([0, -1], [0, 1], "src_offsets\\[1\\] = -1"),
        ([0, 8], [0, 4], "dst_rows\\[1\\] = 4 is out of range for 4 rows"),
        ([0, 8], [0, -1], "dst_rows\\[1\\] = -1"),
    ]
    for offsets, rows, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.gather_host_rows_(staging, memory, torch.tensor(offsets), torch.tensor(rows))
        assert bool((staging == SENTINEL).all()), message  # row 0 was valid, yet not written
    ops.gather_host_rows_(staging, memory, torch.tensor([248]), torch.tensor([3]))  # the last row that fits
    assert staging[3].tolist() == list(range(248, 256))


@pytest.mark.parametrize(
    "dst, src, src_offsets, dst_rows, message",
    [
        (torch.zeros(4, 2), torch.zeros(64, dtype=torch.uint8), torch.tensor([0, 8]), torch.tensor([0]),
         "src_offsets has 2 entries but dst_rows has 1"),
        (torch.zeros(4, 2), torch.zeros(64, dtype=torch.uint8), torch.tensor([0], dtype=torch.int32),
         torch.tensor([0]), "src_offsets must be int64"),
        (torch.zeros(4, 2), torch.zeros(64, dtype=torch.uint8), torch.tensor([0]),
         torch.tensor([0], dtype=torch.int32), "dst_rows must be int64"),
        (torch.zeros(4, 2), torch.zeros(16, dtype=torch.float32), torch.tensor([0]), torch.tensor([0]),
         "src must be a 1-D uint8 tensor"),
        (torch.zeros(4, 2), torch.zeros(8, 8, dtype=torch.uint8), torch.tensor([0]), torch.tensor([0]),
         "src must be a 1-D uint8 tensor"),
        (torch.zeros(4, 2), torch.zeros(64, dtype=torch.uint8)[::2], torch.tensor([0]), torch.tensor([0]),
         "src must be contiguous"),
        (torch.zeros(4, 2), torch.zeros(64, dtype=torch.uint8), torch.tensor([[0]]), torch.tensor([0]),
         "src_offsets must be 1-D"),
        (torch.zeros(2, 4, 2), torch.zeros(64, dtype=torch.uint8), torch.tensor([0]), torch.tensor([0]),
         "dst must be 2-D"),
        (torch.zeros(2, 4).t(), torch.zeros(64, dtype=torch.uint8), torch.tensor([0]), torch.tensor([0]),
         "unit stride"),
    ],
)
def test_bad_arguments(dst, src, src_offsets, dst_rows, message):
    with pytest.raises(RuntimeError, match=message):
        ops.gather_host_rows_(dst, src, src_offsets, dst_rows)


def test_bad_method():
    args = (torch.zeros(4, 2), torch.zeros(64, dtype=torch.uint8), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="method must be one of"):
        ops.gather_host_rows_(*args, method="dma")
    with pytest.raises(ValueError, match="'auto', 'kernel' or 'memcpy', got 'dma'"):
        torch.ops.retouch.gather_host_rows_(*args, "dma")  # the op checks too, for callers that skip ops.py
    for method in ops.HOST_GATHER_METHODS:  # a CPU staging buffer accepts and ignores every method
        ops.gather_host_rows_(*args, method=method)


def test_bad_max_blocks():
    args = (torch.zeros(4, 2), torch.zeros(64, dtype=torch.uint8), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="max_blocks must be >= 0"):
        ops.gather_host_rows_(*args, max_blocks=-1)
    with pytest.raises(ValueError, match="max_blocks must be >= 0"):
        torch.ops.retouch.gather_host_rows_(*args, "kernel", -1)
    ops.gather_host_rows_(*args, max_blocks=3)  # a CPU staging buffer ignores the bound


def test_row_runs():
    row_bytes = 6144
    offsets = torch.tensor([0, 1, 2, 5, 6, 9]) * row_bytes
    assert ops.row_runs(offsets, torch.tensor([0, 1, 2, 3, 4, 5]), row_bytes) == 3  # source gaps split runs
    assert ops.row_runs(offsets, torch.tensor([0, 1, 2, 8, 9, 12]), row_bytes) == 3  # gaps where runs split anyway
    assert ops.row_runs(offsets, torch.tensor([0, 2, 3, 4, 5, 6]), row_bytes) == 4  # a destination gap too
    assert ops.row_runs(offsets.flip(0), torch.arange(6), row_bytes) == 6
    assert ops.row_runs(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), row_bytes) == 0


def test_op_passes_opcheck():
    memory = torch.randint(0, 256, (512,), dtype=torch.uint8)
    args = (torch.zeros(6, 4), memory, torch.tensor([32, 0, 400]), torch.tensor([5, 0, 2]), "auto")
    torch.library.opcheck(torch.ops.retouch.gather_host_rows_.default, args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method, max_blocks", [*((method, 0) for method in ops.HOST_GATHER_METHODS),
                                                ("kernel", 1), ("kernel", 3), ("kernel", 33)])
@pytest.mark.parametrize("hidden, dtype", [(1, torch.uint8), (769, torch.float16), (3072, torch.bfloat16),
                                           (8, torch.float8_e4m3fn)])
def test_cuda_gather_matches_reference(method, max_blocks, hidden, dtype):
    """Every method, and the kernel on a bounded grid (its blocks loop over rows of every width)."""
    generator = torch.Generator().manual_seed(hidden)
    row_bytes = hidden * dtype.itemsize
    arena, memory, base = filled_arena(row_bytes, generator, pinned=True)
    assert arena.pinned and memory.is_pinned()
    for name, (src_offsets, dst_rows) in index_sets(row_bytes, base, generator).items():
        staging = sentinel_staging(STAGING_ROWS, hidden, dtype, device="cuda")
        expected = staging.clone()
        ops.gather_host_rows_(staging, memory, src_offsets, dst_rows, method=method, max_blocks=max_blocks)
        gather_host_rows_ref(expected, memory, src_offsets, dst_rows)
        torch.cuda.synchronize()
        assert_bytes_equal(staging, expected, f"{method} {name}")

    # Strided staging rows: the memcpy path cannot coalesce them, the kernel writes with the row stride.
    src_offsets, dst_rows = index_sets(row_bytes, base, generator)["contiguous runs"]
    wide = sentinel_staging(STAGING_ROWS, hidden + 8, dtype, device="cuda")
    expected = wide.clone()
    ops.gather_host_rows_(wide[:, :hidden], memory, src_offsets, dst_rows, method=method, max_blocks=max_blocks)
    gather_host_rows_ref(expected[:, :hidden], memory, src_offsets, dst_rows)
    torch.cuda.synchronize()
    assert_bytes_equal(wide, expected, f"{method} strided")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["kernel", "memcpy"])
def test_cuda_gather_is_async_and_owns_its_indices(method):
    # The caller may reuse its index tensors as soon as the call returns, before the copy has run.
    generator = torch.Generator().manual_seed(0)
    arena, memory, base = filled_arena(6144, generator, pinned=True)
    src_offsets, dst_rows = index_sets(6144, base, generator)["random subset"]
    expected = sentinel_staging(STAGING_ROWS, 3072, torch.bfloat16, device="cuda")
    gather_host_rows_ref(expected, memory, src_offsets, dst_rows)
    staging = sentinel_staging(STAGING_ROWS, 3072, torch.bfloat16, device="cuda")
    torch.cuda._sleep(10_000_000)  # keep the stream busy so that the gather is still queued below
    ops.gather_host_rows_(staging, memory, src_offsets, dst_rows, method=method)
    src_offsets.zero_()
    dst_rows.zero_()
    torch.cuda.synchronize()
    assert_bytes_equal(staging, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernel_needs_pinned_src():
    pageable = torch.zeros(1024, dtype=torch.uint8)
    staging = torch.zeros(4, 8, dtype=torch.uint8, device="cuda")
    with pytest.raises(RuntimeError, match="must be pinned"):
        ops.gather_host_rows_(staging, pageable, torch.tensor([0]), torch.tensor([0]), method="kernel")
    ops.gather_host_rows_(staging, pageable, torch.tensor([8]), torch.tensor([1]), method="auto")  # memcpy
    torch.cuda.synchronize()
    assert not staging.any()
    torch_pinned = torch.arange(256, dtype=torch.uint8).pin_memory()  # not an arena: pinned is enough
    ops.gather_host_rows_(staging, torch_pinned, torch.tensor([16]), torch.tensor([2]), method="kernel")
    torch.cuda.synchronize()
    assert staging[2].tolist() == list(range(16, 24))
