"""Where a user's image sits in the pipeline's working image, and how the edit comes back.

Denoisers need sides that are whole numbers of tokens (16 px for Flux, SD3 and the UNets' VAE). An
image of any size is padded, never resized, to the next multiple (edge pixels repeated) and placed at
the top-left of that canvas: every pixel of the user's image is one pixel of the canvas, so the mask
maps to tokens exactly at every size, and the edit is cropped back without resampling. The pasting
happens at the user's resolution with the user's mask (`paste_unmasked`): pixels the mask leaves at 0
are the template's own, byte for byte.

The mask the pipeline and the denoiser see (`Canvas.mask`) is binary and covers whole tokens: a
token holding any non-zero pixel is repainted in full. Pipelines that take the mask at the latent
resolution (nearest-neighbour) or binarise it at half intensity then can never drop a thin or faint
stroke.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from retouch.errors import InputError
from retouch.images import colour_profile, padded_size
from retouch.masks import token_mask


@dataclass(frozen=True)
class Canvas:
    size: tuple[int, int]  # (width, height) of the user's image
    padded: tuple[int, int]  # (width, height) the pipeline runs at: multiples of its patch
    stride: int  # pixels per side of the squares the pipeline's mask is made of (one token or latent pixel)

    @classmethod
    def of(cls, size: tuple[int, int], multiple: int, stride: int) -> Canvas:
        width, height = size
        if width < 1 or height < 1:
            raise ValueError(f"an image has at least one pixel, got {width}x{height}")
        return cls((width, height), padded_size(size, multiple), stride)

    @classmethod
    def for_pipeline(cls, size: tuple[int, int], pipe) -> Canvas:
        """The canvas of a diffusers pipeline: sides in whole latent patches (VAE /8, 2x2 patches); its
        mask in tokens for a transformer, in latent pixels for a UNet (whose levels pool them)."""
        multiple = pipe.vae_scale_factor * 2
        transformer = getattr(pipe, "transformer", None)
        stride = multiple if transformer is not None else pipe.vae_scale_factor
        canvas = cls.of(size, multiple, stride)
        # SD3's position embedding is a table of so many patches a side: larger latents are its ValueError.
        patches = getattr(getattr(transformer, "config", None), "pos_embed_max_size", None)
        if patches is not None and max(canvas.padded) > patches * multiple:
            raise InputError(f"the image is {size[0]}x{size[1]}; this model edits images of at most "
                             f"{patches * multiple} px a side (its position embedding holds {patches} patches)")
        return canvas

    @property
    def is_padded(self) -> bool:
        return self.padded != self.size

    def image(self, image: Image.Image) -> Image.Image:
        """`image` (RGB, the user's size) on the canvas, its last row and column repeated into the padding."""
        self._check(image)
        if not self.is_padded:
            return image
        pixels = np.asarray(image)
        width, height = self.size
        padded_width, padded_height = self.padded
        padded = np.pad(pixels, ((0, padded_height - height), (0, padded_width - width), (0, 0)), mode="edge")
        return Image.fromarray(padded)

    def mask(self, mask: Image.Image) -> Image.Image:
        """The pipeline's mask: `mask` ("L", the user's size) on the canvas, binary, in whole squares of
        `stride` pixels; a square is white when any pixel of the user's mask in it is non-zero, or, where
        the mask repaints anything, when it holds none of the user's pixels (padding: a UNet's latent
        pixels past a side 1-8 px over a multiple of 16). No user pixel comes from those, and left
        unmasked they would follow the template's run beside the repainted region: a full mask at such a
        size was then not the stock edit's full computation."""
        self._check(mask)
        pixels = np.zeros(self.padded[::-1], np.uint8)
        pixels[:self.size[1], :self.size[0]] = np.asarray(mask)
        squares = token_mask(pixels, self.stride).numpy()
        if squares.any():
            rows, cols = np.indices(squares.shape) * self.stride
            squares |= (rows >= self.size[1]) | (cols >= self.size[0])
        squares = squares.astype(np.uint8) * 255
        full = squares.repeat(self.stride, 0).repeat(self.stride, 1)
        return Image.fromarray(np.ascontiguousarray(full[:self.padded[1], :self.padded[0]]), mode="L")

    def empty_mask(self) -> Image.Image:
        return Image.new("L", self.padded, 0)

    def crop(self, image: Image.Image) -> Image.Image:
        """The user's part of a canvas-sized image."""
        if image.size != self.padded:
            raise ValueError(f"expected an image of the canvas size {self.padded}, got {image.size}")
        return image.crop((0, 0, *self.size)) if self.is_padded else image

    def _check(self, image: Image.Image) -> None:
        if image.size != self.size:
            raise ValueError(f"expected an image of {self.size[0]}x{self.size[1]}, got {image.width}x{image.height}")


def paste_alpha(edited: Image.Image, alpha: Image.Image | None, mask: Image.Image) -> Image.Image:
    """A transparent template's answer: `edited` (RGB) with the template's `alpha` ("L") where `mask` is
    black, opaque where it is white (what the model painted covers), blended in between; so where the
    mask is 0 the answer is the template's RGBA pixel exactly. `alpha` None: `edited` as it is."""
    if alpha is None:
        return edited
    if not (alpha.size == edited.size == mask.size):
        raise ValueError(f"alpha {alpha.size}, edit {edited.size} and mask {mask.size} must have one size")
    answer = edited.convert("RGB")  # its info (the colour profile) goes along
    answer.putalpha(Image.fromarray(_blend(np.asarray(alpha), 255, np.asarray(mask)), mode="L"))
    return answer


def paste_unmasked(template: Image.Image, edited: Image.Image, mask: Image.Image) -> Image.Image:
    """`edited` where `mask` is white, `template` where it is black, blended in between; all three at
    the user's size (mask "L" as `retouch.images.as_mask` reads it). Where the mask is 0 the result is
    the template's pixel exactly, and the result carries the template's colour profile, so those pixels
    also look the same (`retouch.images.colour_profile`)."""
    if not (template.size == edited.size == mask.size):
        raise ValueError(f"template {template.size}, edit {edited.size} and mask {mask.size} must have one size")
    blended = _blend(np.asarray(template.convert("RGB")), np.asarray(edited.convert("RGB")),
                     np.asarray(mask)[..., None])
    answer = Image.fromarray(blended, mode="RGB")
    profile = colour_profile(template)
    if profile is not None:
        answer.info["icc_profile"] = profile
    return answer


def _blend(keep, new, weight: np.ndarray) -> np.ndarray:
    """uint8 `keep` where `weight` is 0, `new` where it is 255, rounded between: exact at 0 and 255."""
    keep, new, weight = (np.asarray(a, dtype=np.uint32) for a in (keep, new, weight))
    return ((keep * (255 - weight) + new * weight + 127) // 255).astype(np.uint8)
