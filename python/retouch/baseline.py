"""The baseline edit: the unmodified diffusers pipeline. Every later speedup is measured against it."""

from __future__ import annotations

import inspect

import torch
from PIL import Image

from retouch.images import check_same_size
from retouch.models import quiet_libraries


def processing_size(width: int, height: int, multiple: int) -> tuple[int, int]:
    """The nearest size the pipeline accepts: latents must split into whole patches (Flux/SD3 pack 2x2)."""
    return tuple(max(multiple, round(side / multiple) * multiple) for side in (width, height))


def run_baseline_edit(
    pipe,
    image: Image.Image,
    mask: Image.Image,
    prompt: str,
    *,
    steps: int | None = None,
    seed: int = 0,
    guidance: float | None = None,
    strength: float = 1.0,
    call_defaults: dict | None = None,
    paste_back: bool = True,
) -> Image.Image:
    """Repaint the white region of `mask` in `image`; the result has the input image's size.

    With `paste_back`, pixels outside the mask are the template's own: the pipeline regenerates the
    whole image (VAE round trip included), but a user asked to edit only the masked region.
    """
    check_same_size(image, mask)
    width, height = processing_size(image.width, image.height, pipe.vae_scale_factor * 2)
    if (width, height) != image.size:
        image_in = image.resize((width, height), Image.Resampling.LANCZOS)
        mask_in = mask.resize((width, height), Image.Resampling.NEAREST)
    else:
        image_in, mask_in = image, mask

    kwargs = dict(call_defaults or {})
    kwargs.update(
        prompt=prompt,
        image=image_in,
        mask_image=mask_in,
        height=height,
        width=width,
        # A CPU generator gives the same noise whatever device the pipeline runs on.
        generator=torch.Generator("cpu").manual_seed(seed),
        strength=strength,
    )
    if steps is not None:
        kwargs["num_inference_steps"] = steps
    if guidance is not None:
        kwargs["guidance_scale"] = guidance
    accepted = inspect.signature(pipe.__call__).parameters
    kwargs = {name: value for name, value in kwargs.items() if name in accepted}

    with torch.inference_mode(), quiet_libraries():
        edited = pipe(**kwargs).images[0]
    if edited.size != image.size:
        edited = edited.resize(image.size, Image.Resampling.LANCZOS)
    return paste_unmasked(image, edited, mask) if paste_back else edited


def paste_unmasked(template: Image.Image, edited: Image.Image, mask: Image.Image) -> Image.Image:
    """`edited` inside the mask, `template` outside; binarised at half intensity as diffusers does."""
    binary = mask.convert("L").point(lambda value: 255 if value >= 128 else 0)
    return Image.composite(edited.convert("RGB"), template.convert("RGB"), binary)
