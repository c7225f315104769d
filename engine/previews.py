"""Cheap pictures of an edit's latents while it denoises (progress previews).

A linear map from the VAE's latent space to RGB, applied per latent pixel: one small matmul on the
latent grid, no decoder, an image 1/8 of the canvas side. The map is fitted per model from the VAE's
own encoder (solid colours in, their mean latents out, least squares), not taken from a table: the
built-in models have random weights, and a fit serves any fine-tuned VAE too. Early steps look like
coloured noise and later ones like a blurred edit, as in every diffusion UI that shows them.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from retouch.engine.recipes import vae_latents

FIT_COLOURS = 32  # > latent channels + 1 (16 for Flux/SD3): an over-determined fit
FIT_SIDE = 32  # pixels: a solid colour needs no more, and the encoder stays cheap on a CPU
FIT_BATCH = 8


class LatentPreviewer:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, family: str, vae_scale_factor: int):
        """`weight` [C, 3] and `bias` [3] map VAE latents to RGB in [-1, 1]."""
        self.weight, self.bias = weight, bias
        self.family, self.vae_scale_factor = family, vae_scale_factor

    @classmethod
    def fit(cls, pipe, family: str) -> LatentPreviewer:
        vae = pipe.vae
        parameter = next(vae.parameters())
        colours = np.random.default_rng(0).uniform(-1.0, 1.0, (FIT_COLOURS, 3))
        colours[:8] = [[x, y, z] for x in (-1, 1) for y in (-1, 1) for z in (-1, 1)]  # the cube's corners
        means = []
        with torch.inference_mode():
            for start in range(0, FIT_COLOURS, FIT_BATCH):
                chunk = torch.tensor(colours[start:start + FIT_BATCH], dtype=parameter.dtype, device=parameter.device)
                images = chunk[:, :, None, None].expand(-1, -1, FIT_SIDE, FIT_SIDE).contiguous()
                latents = vae.encode(images).latent_dist.mean
                means.append(latents.float().mean((2, 3)).cpu())
        features = torch.cat(means).double()
        design = torch.cat([features, torch.ones(len(features), 1, dtype=torch.float64)], 1)
        solution = torch.linalg.lstsq(design, torch.tensor(colours)).solution
        weight = solution[:-1].to(parameter.device, torch.float32)
        bias = solution[-1].to(parameter.device, torch.float32)
        return cls(weight, bias, family, pipe.vae_scale_factor)

    def image(self, pipe, latents: torch.Tensor, canvas) -> Image.Image:
        """`latents` [1, ...] as the denoiser sees them, of a request on `canvas` -> an RGB picture
        of the user's part of the canvas, one pixel per latent pixel."""
        with torch.inference_mode():
            spatial = vae_latents(pipe, self.family, latents, canvas.padded)[0].float()
            rgb = torch.einsum("chw,cd->hwd", spatial, self.weight) + self.bias
            pixels = ((rgb.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu().numpy()
        width, height = canvas.size
        side = self.vae_scale_factor
        return Image.fromarray(pixels[:-(-height // side), :-(-width // side)], mode="RGB")
