"""A minimal Triton kernel that tells whether Triton can run here (on a GPU, or under
TRITON_INTERPRET=1 on the CPU). `python -m retouch.kernels.probe` prints true/false."""

import torch
import triton
import triton.language as tl


@triton.jit
def add_one_kernel(
    x_ptr,  # input vector
    out_ptr,  # output vector, same length
    n,  # number of elements
    BLOCK: tl.constexpr,  # elements per program
):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < n
    x = tl.load(x_ptr + offsets, mask=in_bounds)
    tl.store(out_ptr + offsets, x + 1, mask=in_bounds)


def triton_runs(device: str) -> bool:
    x = torch.arange(100, dtype=torch.float32, device=device)
    out = torch.empty_like(x)
    add_one_kernel[(triton.cdiv(x.numel(), 64),)](x, out, x.numel(), BLOCK=64)
    return bool(torch.equal(out, x + 1))


if __name__ == "__main__":
    print("true" if triton_runs("cuda" if torch.cuda.is_available() else "cpu") else "false")
