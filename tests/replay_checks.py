"""Checks shared by the adapter tests (imported by test modules; pytest puts tests/ on sys.path)."""

import torch


def assert_close_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: int) -> float:
    """|actual - expected| <= ulps * fp32 eps * max|expected|: the masked path differs from full compute
    only in summation order (matmuls over other row counts), a few ulps at the output's scale."""
    atol = ulps * torch.finfo(torch.float32).eps * expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    assert error <= atol, f"max error {error:.3g} > {atol:.3g}"
    return error


def masked_indices(num_image: int, grid: tuple[int, int]) -> list[torch.Tensor]:
    """Three requests' masked tokens: ~20% random tokens, a ~20% rectangle, no token at all."""
    generator = torch.Generator().manual_seed(7)
    scattered = torch.randperm(num_image, generator=generator)[: num_image // 5].sort().values
    height, width = grid
    rectangle = torch.zeros(grid, dtype=torch.bool)
    rectangle[1: 1 + height // 2, 2: 2 + (2 * width + 4) // 5] = True
    return [scattered, rectangle.flatten().nonzero().flatten(), torch.empty(0, dtype=torch.long)]
