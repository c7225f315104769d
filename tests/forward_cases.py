"""Mask-aware forwards of every family over ragged batches: what the sync and compile tests run
(imported by test modules; pytest puts tests/ on sys.path).

A case is a list of per-request masked-token fractions of the first level's grid: 0 is an empty mask, 1
every token (a request that records itself in the running batch, written to a second cache).
"""

from __future__ import annotations

import math

import torch

from retouch.adapters import CacheMode, MaskAwareContext, UNetMaskAwareContext
from retouch.cache import InMemoryActivationCache
from retouch.masks import UNET_LATENT_STRIDE, pixel_mask_of_tokens
from retouch.profile import build_target

FAMILY_MODELS = {"flux-fill": "tiny-flux-fill", "flux-inpaint": "tiny-flux-inpaint", "sd3": "tiny-sd3-inpaint",
                 "sdxl": "tiny-sdxl-inpaint", "sd2": "tiny-sd2-inpaint"}
GRID = 8  # tokens a side (a UNet's latent pixels)
TEXT_TOKENS = 8
EDIT_MODES = (CacheMode.Y_CACHE, CacheMode.KV_CACHE)


class Forwards:
    """A tiny denoiser of `model`, patched, with templates t0, t1, ... recorded at step 0."""

    def __init__(self, model: str, templates: int = 3, device: str = "cpu"):
        self.device = torch.device(device)
        self.target = build_target(model, self.device, torch.float32, text_tokens=TEXT_TOKENS)
        self.adapter, self.denoiser = self.target.adapter, self.target.denoiser
        self.is_unet = isinstance(self.target.record_context(1, GRID, InMemoryActivationCache()),
                                  UNetMaskAwareContext)
        _, self.cache = self.target.record(templates, GRID, self.device)

    def context(self, mode: CacheMode, fractions: list[float], block_plan=None, cache=None):
        """An edit of t0, t1, ... (in `cache`, default the templates recorded here) whose request b
        recomputes about fractions[b] of the tokens (scattered, seeded), records itself if that is 1, and
        reads t_b otherwise. Built in inference mode, as the step loop builds its contexts (`Worker.run`): a
        compiled core guards on whether its index tensors are inference tensors."""
        with torch.inference_mode():
            return self._context(mode, fractions, block_plan, cache)

    def _context(self, mode: CacheMode, fractions: list[float], block_plan, cache):
        cache = self.cache if cache is None else cache
        generator = torch.Generator().manual_seed(len(fractions) * 31 + int(1000 * sum(fractions)))
        num_tokens = GRID * GRID
        masks = [torch.randperm(num_tokens, generator=generator)[: math.ceil(f * num_tokens)].sort().values
                 for f in fractions]
        ids, steps = [f"t{b}" for b in range(len(fractions))], [0] * len(fractions)
        records = [f == 1 for f in fractions]
        record_to = InMemoryActivationCache(device=self.device) if any(records) else None
        if self.is_unet:
            pixel_masks = [pixel_mask_of_tokens(m, (GRID, GRID), UNET_LATENT_STRIDE) for m in masks]
            return UNetMaskAwareContext.edit(mode, pixel_masks, ids, steps, self.adapter.num_levels, cache,
                                             block_plan=block_plan, device=self.device, records=records,
                                             record_to=record_to)
        return MaskAwareContext.edit(mode, masks, ids, steps, TEXT_TOKENS, num_tokens, cache, block_plan=block_plan,
                                     device=self.device, records=records, record_to=record_to)

    def forward(self, context=None, batch: int | None = None) -> torch.Tensor:
        """The denoiser's output on the seeded inputs of the context's batch (or `batch`), under `context`
        (None: the model's own forward)."""
        inputs = self.target.inputs(len(context.template_ids) if batch is None else batch, GRID)
        with torch.inference_mode():
            if context is None:
                return _sample(self.denoiser(**inputs))
            with self.adapter.run(context):
                return _sample(self.denoiser(**inputs))

    def record(self, cache) -> torch.Tensor:
        """Record t0 into `cache` from the seeded inputs of a batch of one; returns the forward's output."""
        return self.forward(self.target.record_context(1, GRID, cache))


def _sample(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output.sample
