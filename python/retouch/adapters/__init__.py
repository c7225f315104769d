"""Mask-aware adapters: patch a loaded diffusers denoiser so each block computes only masked tokens.

Use: `adapter = patch_flux(pipe.transformer)`, then `with adapter.run(context): pipe.transformer(...)`
with a `MaskAwareContext` per call (which tokens, which recorded templates, which cache mode).
"""

from retouch.adapters.context import CacheMode, MaskAwareContext, TokenLayout
from retouch.adapters.flux import FluxMaskAwareAdapter, patch_flux

__all__ = ["CacheMode", "FluxMaskAwareAdapter", "MaskAwareContext", "TokenLayout", "patch_flux"]
