"""Where a Triton kernel can run: compiled, on CUDA tensors only; under TRITON_INTERPRET=1, on the CPU."""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction


def check_triton_device(kernel: object, what: str, *tensors: torch.Tensor, hint: str = "") -> None:
    """A clear ValueError where Triton's own launcher would fail with "Pointer argument (at 0) cannot be
    accessed from Triton (cpu tensor?)" (seen on the first GPU run, stop 44); `hint` ends the message."""
    if isinstance(kernel, InterpretedFunction):
        return
    for tensor in tensors:
        if tensor.device.type != "cuda":
            raise ValueError(f"{what}: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU), "
                             f"got {tensor.device}{hint}")
