"""Where the tests run the Triton kernels: the GPU where there is one, else the CPU under the Triton
interpreter (conftest sets TRITON_INTERPRET=1 there). A test that keeps CPU tensors for a Triton
kernel fails on a GPU machine: compiled Triton reads device memory only (the first GPU run, stop 44)."""

import pytest
import torch

TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Tests that replay a CPU-recorded template through the Triton kernel: the interpreter computes on the
# CPU's float32, as the recording did, so the replay matches to a few ULPs. On a GPU machine the kernel
# needs CUDA tensors and a recording made there: the adapter tests' replay on the kernel device.
interpreter_replay = pytest.mark.skipif(torch.cuda.is_available(),
                                        reason="replays CPU recordings through the Triton interpreter")
