"""The initial noise of an edit, drawn one way everywhere: the baseline edit, the editor's recordings
and edits, and the engine all start from `initial_noise(pipe, seed, canvas)`, so the first one-off
edit of an image (a recording) is the baseline edit of the same request."""

from __future__ import annotations

import torch


def latent_shape(pipe, size: tuple[int, int]) -> tuple[int, int, int]:
    """(C, height/8, width/8): the latents of a canvas of `size` (width, height) pixels."""
    width, height = size
    return pipe.vae.config.latent_channels, height // pipe.vae_scale_factor, width // pipe.vae_scale_factor


def initial_noise(pipe, seed: int, size: tuple[int, int]) -> torch.Tensor:
    """Gaussian `latent_shape` latents of a canvas of `size` (width, height) pixels, from a CPU
    generator: the same noise whatever device the pipeline runs on."""
    return seeded_noise(latent_shape(pipe, size), seed)


def seeded_noise(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed))


def latents_argument(latents: torch.Tensor, family: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The pipeline's `latents` argument from `[B, C, h, w]`, on the denoiser's `device` and `dtype`:
    FluxFill takes them packed `[B, h*w/4, C*4]`."""
    latents = latents.to(device, dtype)
    return pack_flux_latents(latents) if family == "flux-fill" else latents


def pack_flux_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, (h/2)(w/2), C*4]: the Flux pipelines' 2x2 packing, token (i, j) row-major."""
    batch, channels, height, width = latents.shape
    packed = latents.view(batch, channels, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return packed.reshape(batch, (height // 2) * (width // 2), channels * 4)
