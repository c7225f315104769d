"""The baseline edit: the unmodified diffusers pipeline. Every later speedup is measured against it."""

from __future__ import annotations

import inspect

import torch
from PIL import Image

from retouch.canvas import Canvas, paste_unmasked
from retouch.editor import check_negative_prompt
from retouch.images import as_image, as_mask
from retouch.models import family_of_pipeline, quiet_libraries
from retouch.noise import initial_noise, latents_argument
from retouch.strength import noised_start


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
    negative_prompt: str | None = None,
) -> Image.Image:
    """Repaint the white region of `mask` in `image`; the result has the input image's size.

    The pipeline runs on the image's canvas (`retouch.canvas`: padded to whole patches, never
    resized). With `paste_back`, pixels the mask leaves at 0 are the template's own: the pipeline
    regenerates the whole image (VAE round trip included), but a user asked to edit only the masked
    region. Without it, the raw pipeline output (cropped to the image) comes back. `negative_prompt` as
    the editor takes it (`retouch.editor.check_negative_prompt`).
    """
    accepted = inspect.signature(pipe.__call__).parameters
    negative_prompt = check_negative_prompt(negative_prompt, family_of_pipeline(pipe),
                                            accepted["guidance_scale"].default if guidance is None else guidance)
    image = as_image(image)
    mask = as_mask(mask, image.size)
    canvas = Canvas.for_pipeline(image.size, pipe)
    kwargs = dict(call_defaults or {})
    kwargs.update(
        prompt=prompt,
        image=canvas.image(image),
        mask_image=canvas.mask(mask),
        width=canvas.padded[0],
        height=canvas.padded[1],
        # A CPU generator gives the same noise whatever device the pipeline runs on.
        generator=[torch.Generator("cpu").manual_seed(seed)],
        strength=strength,
    )
    # The editor's noise (`retouch.noise`): a one-off edit's first, recorded run equals this edit. Below
    # strength 1 the pipeline noises the image with it (`noised_start`), as the editor's and the engine's do.
    denoiser = pipe.unet if getattr(pipe, "unet", None) is not None else pipe.transformer
    noise = initial_noise(pipe, seed, canvas.padded)[None]
    kwargs["latents"] = latents_argument(noise, family_of_pipeline(pipe), pipe.device, denoiser.dtype)
    if steps is not None:
        kwargs["num_inference_steps"] = steps
    if guidance is not None:
        kwargs["guidance_scale"] = guidance
    if negative_prompt is not None:
        kwargs["negative_prompt"] = negative_prompt
    kwargs = {name: value for name, value in kwargs.items() if name in accepted}

    with torch.inference_mode(), quiet_libraries(), noised_start(pipe, strength, noise):
        edited = canvas.crop(pipe(**kwargs).images[0])
    return paste_unmasked(image, edited, mask) if paste_back else edited
