"""The initial noise of an edit, drawn one way everywhere: the baseline edit, the editor's recordings
and edits, and the engine all start from `initial_noise(pipe, seed, canvas)`, so the first one-off
edit of an image (a recording) is the baseline edit of the same request."""

from __future__ import annotations

import torch


def initial_noise(pipe, seed: int, size: tuple[int, int]) -> torch.Tensor:
    """`[C, height/8, width/8]` Gaussian latents of a canvas of `size` (width, height) pixels, from a
    CPU generator: the same noise whatever device the pipeline runs on."""
    width, height = size
    shape = (pipe.vae.config.latent_channels, height // pipe.vae_scale_factor, width // pipe.vae_scale_factor)
    return torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed))


def latents_argument(pipe, family: str, latents: torch.Tensor) -> torch.Tensor:
    """The pipeline's `latents` argument from `[B, C, h, w]`: on the denoiser's device and dtype;
    FluxFill takes them packed `[B, h*w/4, C*4]`."""
    denoiser = pipe.unet if family in ("sdxl", "sd2") else pipe.transformer
    latents = latents.to(pipe.device, denoiser.dtype)
    return pack_flux_latents(latents) if family == "flux-fill" else latents


def pack_flux_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, (h/2)(w/2), C*4]: the Flux pipelines' 2x2 packing, token (i, j) row-major."""
    batch, channels, height, width = latents.shape
    packed = latents.view(batch, channels, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return packed.reshape(batch, (height // 2) * (width // 2), channels * 4)
