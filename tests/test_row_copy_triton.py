"""The Triton row gather/scatter (on the GPU, or the interpreter on the CPU) against the reference: exact,
over a grid."""

import os
import subprocess
import sys

import pytest
import torch
from kernel_device import TRITON_DEVICE

from retouch.kernels.reference import gather_rows_ref, scatter_rows_ref
from retouch.kernels.row_copy import gather_rows_triton, scatter_rows_triton

HIDDEN_SIZES = [1, 33, 256]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NUM_ROWS = 23


def index_sets(generator):
    sets = {
        "empty": torch.empty(0, dtype=torch.long),
        "one": torch.tensor([NUM_ROWS - 1]),
        "all": torch.randperm(NUM_ROWS, generator=generator),
        "subset": torch.randperm(NUM_ROWS, generator=generator)[:5],
    }
    return {name: rows.to(TRITON_DEVICE) for name, rows in sets.items()}


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_triton_gather_scatter_match_reference(hidden, dtype, index_dtype):
    generator = torch.Generator().manual_seed(hidden)
    src = torch.randn(NUM_ROWS, hidden, generator=generator).to(device=TRITON_DEVICE, dtype=dtype)
    for name, row_idx in index_sets(generator).items():
        row_idx = row_idx.to(index_dtype)
        assert torch.equal(gather_rows_triton(src, row_idx, block_h=32), gather_rows_ref(src, row_idx)), name
        updates = torch.randn(len(row_idx), hidden, generator=generator).to(device=TRITON_DEVICE, dtype=dtype)
        dst, expected = src.clone(), src.clone()
        scatter_rows_triton(dst, row_idx, updates, block_h=32)
        scatter_rows_ref(expected, row_idx, updates)
        assert torch.equal(dst, expected), name


def test_strided_rows():
    wide = torch.randn(NUM_ROWS, 80, device=TRITON_DEVICE)
    src = wide[:, 7:47]
    row_idx = torch.tensor([4, 0, 22], device=TRITON_DEVICE)
    assert torch.equal(gather_rows_triton(src, row_idx, block_h=16), gather_rows_ref(src, row_idx))
    dst, expected = wide.clone(), wide.clone()
    updates = torch.randn(3, 40, device=TRITON_DEVICE)
    scatter_rows_triton(dst[:, 7:47], row_idx, updates, block_h=16)
    scatter_rows_ref(expected[:, 7:47], row_idx, updates)
    assert torch.equal(dst, expected)


def test_bad_arguments():
    with pytest.raises(ValueError, match="out of range"):
        gather_rows_triton(torch.zeros(4, 2), torch.tensor([4]))
    with pytest.raises(ValueError, match="int32/int64"):
        gather_rows_triton(torch.zeros(4, 2), torch.tensor([0.0]))
    with pytest.raises(ValueError, match="src must be"):
        scatter_rows_triton(torch.zeros(4, 2), torch.tensor([0]), torch.zeros(1, 3))


def test_compiled_kernels_refuse_cpu_tensors_with_a_clear_error():
    """Outside the interpreter, CPU tensors are a ValueError naming the kernel and the device, not Triton's
    launcher's "Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)" (the first GPU run)."""
    script = (
        "import torch\n"
        "from retouch.kernels.row_copy import gather_rows_triton, scatter_rows_triton\n"
        "from retouch.kernels.segmented_lora import segmented_lora_triton\n"
        "from retouch.kernels.norm_rope import norm_rope_triton\n"
        "calls = [lambda: gather_rows_triton(torch.zeros(4, 2), torch.tensor([1])),\n"
        "         lambda: scatter_rows_triton(torch.zeros(4, 2), torch.tensor([1]), torch.ones(1, 2)),\n"
        "         lambda: segmented_lora_triton(torch.zeros(3, 4), torch.zeros(3, 2), torch.zeros(1, 2, 4),\n"
        "                                       torch.zeros(1, 2, 2), torch.ones(1), [2], [(0, 3, 0)]),\n"
         "         lambda: norm_rope_triton(torch.zeros(4, 2, 8), torch.ones(8), 1e-6, None, None)]\n"
        "for call in calls:\n"
        "    try:\n"
        "        call()\n"
        "    except ValueError as error:\n"
        "        print(error)\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["gather_rows_triton", "scatter_rows_triton",
                                                      "segmented_lora_triton", "norm_rope_triton"], done.stdout
    assert all("needs CUDA tensors" in line and "got cpu" in line for line in lines)
