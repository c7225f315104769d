"""Mask-aware adapters: patch a loaded diffusers denoiser so each block computes only masked tokens.

Use: `adapter = patch_flux(pipe.transformer)` (or `patch_sd3`, `patch_unet` with a `UNetMaskAwareContext`), then `with adapter.run(context): pipe.transformer(...)`
with a `MaskAwareContext` per call (which tokens, which recorded templates, which cache mode).
"""

from retouch.adapters.base import MaskAwareAdapter
from retouch.adapters.context import CacheMode, MaskAwareContext, TokenLayout
from retouch.adapters.flux import FluxMaskAwareAdapter, patch_flux
from retouch.adapters.sd3 import SD3MaskAwareAdapter, patch_sd3
from retouch.adapters.unet import UNetMaskAwareAdapter, UNetMaskAwareContext, patch_unet

__all__ = ["CacheMode", "FluxMaskAwareAdapter", "MaskAwareAdapter", "MaskAwareContext", "SD3MaskAwareAdapter", "TokenLayout",
           "UNetMaskAwareAdapter", "UNetMaskAwareContext", "patch_flux", "patch_sd3", "patch_unet"]
