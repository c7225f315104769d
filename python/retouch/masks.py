"""Token geometry: which tokens of a denoiser a pixel mask touches.

A token covers a `stride` x `stride` square of pixels: 16 for Flux and SD3 (VAE /8, then 2x2 patches),
8 * 2**level for the transformer blocks of a UNet level (SDXL, SD2). A token is masked if any pixel of
its square is: a token that is partly repainted must be recomputed. An optional margin of `dilation`
tokens around the mask is recomputed too, for seams (paper §3.1 reuses activations only where the
content is untouched).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image

# Pixels per image token.
FLUX_STRIDE = 16
SD3_STRIDE = 16
UNET_LATENT_STRIDE = 8  # a UNet level l has stride 8 * 2**l


def pixel_mask_array(mask: Image.Image | np.ndarray | torch.Tensor) -> np.ndarray:
    """A boolean `[H, W]` array, True = repaint, from a PIL mask (white = repaint), array or tensor.
    Any non-zero pixel is repainted (`retouch.images.as_mask` defines what a mask's values mean)."""
    if isinstance(mask, Image.Image):
        mask = mask.convert("L")
    if isinstance(mask, torch.Tensor):
        mask = mask.detach().cpu().numpy()
    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"a pixel mask must be 2-D [H, W], got shape {tuple(mask.shape)}")
    return mask != 0


def pixel_mask_tensor(mask: Image.Image | np.ndarray | torch.Tensor) -> torch.Tensor:
    """`pixel_mask_array` as a tensor."""
    return torch.from_numpy(pixel_mask_array(mask))


def token_mask(mask, stride: int, dilation: int = 0) -> torch.Tensor:
    """Pixel mask `[H, W]` -> token mask `[ceil(H/stride), ceil(W/stride)]` (bool).

    A token is masked if any pixel it covers is, or (with `dilation`) if a masked token lies within
    `dilation` tokens of it (Chebyshev distance). NumPy, not torch: request threads call it, and a
    torch kernel with an OpenMP team of its own on such a thread halves the step loop's speed on a CPU.
    """
    if stride < 1 or dilation < 0:
        raise ValueError(f"stride must be >= 1 and dilation >= 0, got {stride} and {dilation}")
    pixels = pixel_mask_array(mask)
    height, width = pixels.shape
    rows, cols = math.ceil(height / stride), math.ceil(width / stride)
    padded = np.zeros((rows * stride, cols * stride), dtype=bool)
    padded[:height, :width] = pixels
    tokens = padded.reshape(rows, stride, cols, stride).any(axis=(1, 3))
    dilation = min(dilation, max(rows, cols))  # a wider margin reaches no further token (a huge one hung here)
    if dilation:
        window = 2 * dilation + 1
        for axis in (0, 1):  # a square window is a row window after a column window
            widths = [(0, 0), (0, 0)]
            widths[axis] = (dilation, dilation)
            tokens = np.lib.stride_tricks.sliding_window_view(np.pad(tokens, widths), window, axis=axis).any(-1)
    return torch.from_numpy(np.ascontiguousarray(tokens))


def masked_token_indices(token_mask_2d: torch.Tensor) -> torch.Tensor:
    """Row-major indices (int64, sorted) of the masked tokens: the order the denoisers flatten in."""
    return token_mask_2d.flatten().nonzero().flatten()


def mask_ratio(token_mask_2d: torch.Tensor) -> float:
    """Fraction of tokens masked: the m of the paper's Table 1."""
    return float(token_mask_2d.float().mean())


def centred_token_rectangle(grid: tuple[int, int], ratio: float) -> torch.Tensor:
    """Row-major indices of a centred rectangle covering about `ratio` of a `grid` of tokens: a
    synthetic mask for benchmarks (real masks are contiguous regions)."""
    rows, cols = grid
    height = min(rows, max(1, round(math.sqrt(ratio * rows * cols))))
    width = min(cols, max(1, round(ratio * rows * cols / height)))
    top, left = (rows - height) // 2, (cols - width) // 2
    r, c = torch.meshgrid(torch.arange(top, top + height), torch.arange(left, left + width), indexing="ij")
    return (r * cols + c).flatten()


def pixel_mask_of_tokens(token_idx: torch.Tensor, grid: tuple[int, int], stride: int) -> Image.Image:
    """The pixel mask (white = repaint) that marks exactly the tokens `token_idx` of a `grid`."""
    tokens = torch.zeros(grid[0] * grid[1], dtype=torch.uint8)
    tokens[token_idx] = 255
    pixels = tokens.view(grid).repeat_interleave(stride, 0).repeat_interleave(stride, 1)
    return Image.fromarray(pixels.numpy(), mode="L")
