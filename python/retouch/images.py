"""Reading and writing the images and masks users send, with errors that say what to fix.

Mask convention (diffusers): white = repaint, black = keep. An OpenAI-style mask instead marks the
region to repaint with alpha 0; `load_mask(..., alpha=True)` converts it to the diffusers convention.
"""

from __future__ import annotations

import io
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from retouch.errors import InputError

# Larger inputs are refused rather than decoded: a decompression bomb must not take the process down.
MAX_PIXELS = 8192 * 8192


class ImageTooLarge(InputError):
    """An image whose header claims more pixels than allowed (the server answers 413)."""


def _open(path: Path, what: str) -> Image.Image:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{what} file not found: {path}")
    return decode_image(path.read_bytes(), f"{what} {path}")


def decode_image(data: bytes, what: str, max_pixels: int | None = None) -> Image.Image:
    """Decode an uploaded image. The size is checked from the header before any pixel is decoded,
    so a small file that claims to be huge (a decompression bomb) costs nothing."""
    max_pixels = MAX_PIXELS if max_pixels is None else max_pixels
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height > max_pixels:
                raise ImageTooLarge(f"{what} is {img.width}x{img.height}, over the limit of {max_pixels} pixels")
            img.load()
            return img.copy()
    except Image.DecompressionBombError as exc:  # PIL's own, looser check fired first
        raise ImageTooLarge(f"{what} is over the limit of {max_pixels} pixels ({exc})") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise InputError(f"cannot read {what}: {exc}") from None


def load_image(path: Path) -> Image.Image:
    """The template image as RGB."""
    return _open(path, "image").convert("RGB")


def load_mask(path: Path, *, alpha: bool = False) -> Image.Image:
    """The mask as 8-bit grayscale, white = repaint. With `alpha`, pixels of alpha 0 are repainted."""
    mask = _open(path, "mask")
    if not alpha:
        return mask.convert("L")
    if not has_alpha(mask):
        raise InputError(f"mask {path} has no alpha channel; drop --mask-alpha for a black/white mask")
    return mask_from_alpha(mask)


def png_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def has_alpha(image: Image.Image) -> bool:
    return "A" in image.getbands() or "transparency" in image.info


def mask_from_alpha(image: Image.Image) -> Image.Image:
    """OpenAI convention -> ours: alpha 0 (transparent) = repaint = white."""
    return image.convert("RGBA").getchannel("A").point(lambda a: 255 - a)


def check_same_size(image: Image.Image, mask: Image.Image) -> None:
    if image.size != mask.size:
        raise InputError(
            f"mask is {mask.width}x{mask.height} but image is {image.width}x{image.height}; they must match")


def check_output_path(path: Path) -> None:
    """Fail before any compute if the output format is unknown."""
    if Path(path).suffix.lower() not in Image.registered_extensions():
        raise InputError(f"cannot write {path}: unknown image format {Path(path).suffix!r} (use .png or .jpg)")


def save_image(image: Image.Image, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        image.save(path)
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc}") from None
    return path
