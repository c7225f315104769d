"""Reading and writing the images and masks users send, with errors that say what to fix.

Every entry point (CLI, Python API, engine, HTTP) reads images with `as_image` and masks with
`as_mask`: the one definition of what a mask means.

Masks: white = repaint (diffusers' convention). A pixel's value is how much of the edit replaces the
template there: 0 keeps the template's pixel exactly, full scale takes the edit, values between blend
(a feathered brush stays feathered). Any non-zero pixel is repainted: its token is recomputed. A mask
file in a lossy format (JPEG, decoded here or a PIL image opened from one) has levels within JPEG_SNAP of
black or white snapped to them first.

    PIL "1"                          set = repaint
    "L", "P", "RGB", "CMYK", ...     luminance, 0..255
    "RGBA", "LA", "PA", "P" + tRNS   luminance x alpha: the mask as it looks over black, so white
                                     strokes on a transparent background mark the region
    alpha=True (OpenAI convention)   1 - alpha: transparent = repaint; the colours are ignored
    "I", "F", numpy arrays,          bool as 0/1; all numbers (uint8 too) by their largest
    torch tensors ([H, W]; arrays     value: <= 1 means 0..1, <= 255 means 0..255, and <= 65535
    [H, W, 1], tensors [1, H, W])     means 0..65535 (16-bit integers); negative, NaN or larger
                                     values are refused
    PIL "I;16" (16-bit PNGs)         0..65535, as their mode says (not judged by their values)
Images: converted to RGB. Greyscale images of more than 8 bits are scaled, not clipped: "I;16" and
"I" (16-bit PNGs, integer TIFFs) as 0..65535, "F" as 0..1 (or 0..255 when its values exceed 1);
negative, NaN or larger values are refused. An RGB colour profile (ICC: a phone's Display P3) stays
with the image and every answer made from it (`colour_profile`), so the pixels an edit keeps look as
they did; a grey or CMYK profile does not describe the RGB image and is dropped.
Files: the formats of READ_FORMATS only (an upload never reaches Pillow's other decoders, Ghostscript's
for EPS among them); one frame (an animated image or a multi-page TIFF is refused, not cut to its
first frame; a phone's MPO JPEG is its primary picture).
EXIF orientation is applied to images and masks alike before anything else, so a photo and the mask
drawn over it as displayed line up.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError, features

from retouch.errors import InputError
from retouch.masks import FLUX_STRIDE
from retouch.paths import check_writable

# Larger inputs are refused rather than decoded: a decompression bomb must not take the process down.
MAX_PIXELS = 8192 * 8192
# What uploads may be (Pillow's names; its JPEG reader also opens phones' MPO JPEGs). Image.open looks
# formats up among the plugins loaded, which are only the commonest until init().
Image.init()
READ_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "TIFF", "GIF") + (("AVIF",) if features.check("avif") else ())
FORMAT_NAMES = "PNG, JPEG, WebP, BMP, TIFF, GIF" + (", AVIF" if "AVIF" in READ_FORMATS else "")
# A mask decoded from a lossy file (JPEG) has its levels within JPEG_SNAP of black or white snapped to
# them: compression noise of 1-3 levels around a stroke repainted pixels faintly and recomputed tokens
# the user never marked. Feathering in between stays.
LOSSY_FORMATS = ("JPEG", "MPO")
LOSSY = "retouch.lossy"  # the decoded image's info key saying so
JPEG_SNAP = 8
# A photo's damaged EXIF block is no reason to refuse it (its orientation is then not applied), nor to
# print Pillow's two-line warning into every log.
warnings.filterwarnings("ignore", message="Corrupt EXIF data", category=UserWarning)


class ImageTooLarge(InputError):
    """An image whose header claims more pixels than allowed (the server answers 413)."""


def _open(path: Path, what: str) -> Image.Image:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{what} file not found: {path}")
    try:
        data = path.read_bytes()
    except OSError as exc:  # unreadable: permissions, a device file
        raise InputError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    return decode_image(data, f"{what} {path}", multiple=FLUX_STRIDE)  # counted as the canvas


def padded_size(size: tuple[int, int], multiple: int) -> tuple[int, int]:
    """(width, height) with each side rounded up to `multiple`: the canvas an image is edited on
    (`retouch.canvas`)."""
    return tuple(-(-side // multiple) * multiple for side in size)


def size_words(size: tuple[int, int], multiple: int) -> str:
    """"WxH", and what the canvas makes of it when padding grows it ("1x4096, padded to 16x4096")."""
    padded = padded_size(size, multiple)
    said = f"{size[0]}x{size[1]}"
    return said if padded == tuple(size) else f"{said}, padded to {padded[0]}x{padded[1]}"


def check_pixels(size: tuple[int, int], what: str, max_pixels: int, multiple: int) -> None:
    """ImageTooLarge if an image of `size`, its sides padded to `multiple` (its canvas), is over `max_pixels`."""
    width, height = padded_size(size, multiple)
    if width * height > max_pixels:
        raise ImageTooLarge(f"{what} is {size_words(size, multiple)}, over the limit of {max_pixels} pixels")


def decode_image(data: bytes, what: str, max_pixels: int | None = None, multiple: int = 1) -> Image.Image:
    """Decode an uploaded image, EXIF orientation applied. The size is checked from the header before
    any pixel is decoded, so a small file that claims to be huge (a decompression bomb) costs nothing.
    `multiple`: the sides are counted as the canvas pads them (a 1x262144 strip is edited as 16x262144)."""
    max_pixels = MAX_PIXELS if max_pixels is None else max_pixels
    try:
        with warnings.catch_warnings():  # Pillow's DecompressionBombWarning: the limit below is the one that counts
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=READ_FORMATS)
        with img:
            check_pixels(img.size, what, max_pixels, multiple)
            _one_picture(img, what)
            img.load()
            decoded = upright(img)
            if img.format in LOSSY_FORMATS:
                decoded.info[LOSSY] = True  # as a mask, its compression noise is not the user's stroke
            return decoded
    except Image.DecompressionBombError:  # PIL's own, looser check fired first
        raise ImageTooLarge(f"{what} is over the limit of {max_pixels} pixels") from None
    except UnidentifiedImageError:
        raise InputError(f"cannot read {what}: not an image in a format retouch reads ({FORMAT_NAMES})") from None
    except (OSError, SyntaxError, ValueError) as exc:  # truncated or corrupt data
        raise InputError(f"cannot read {what}: {exc}") from None


def upright(image: Image.Image) -> Image.Image:
    """The image with its EXIF orientation applied. An EXIF block that cannot be parsed leaves it as it
    is, without that block: metadata that a camera app mangled is no reason to refuse a photo, and
    Pillow parses it again wherever the image is read or written (and raises, anything from SyntaxError
    to struct.error, at each place)."""
    try:
        return ImageOps.exif_transpose(image)
    except Exception:  # noqa: BLE001 - any parse failure of the metadata, see above
        stripped = image.copy()
        stripped.info.pop("exif", None)
        return stripped


def _one_picture(image: Image.Image, what: str) -> None:
    """Refuse an animation or a multi-page file (which one frame would be edited is no choice to guess)."""
    try:
        frames = getattr(image, "n_frames", 1)
    except (ValueError, OSError, EOFError):  # counting seeks the file: one opened, loaded and closed is one
        frames = 1
    if frames > 1 and image.format != "MPO":  # MPO: a phone photo's extra frames are depth maps, previews
        raise InputError(f"{what} has {frames} frames (an animation or a multi-page file); send one picture")


def load_image(path: Path) -> Image.Image:
    """The template image file, as `as_image` reads it."""
    return as_image(_open(path, "image"), f"image {path}")


def load_image_with_alpha(path: Path) -> tuple[Image.Image, Image.Image | None]:
    """The template image file as `as_image` reads it, and its transparency (`alpha_of`)."""
    decoded = _open(path, "image")
    return as_image(decoded, f"image {path}"), alpha_of(decoded)


def load_mask(path: Path, size: tuple[int, int] | None = None, *, alpha: bool = False) -> Image.Image:
    """The mask file, as `as_mask` reads it (8-bit, white = repaint), checked against `size`."""
    return as_mask(_open(path, "mask"), size, alpha=alpha, what=f"mask {path}")


def as_image(image, what: str = "image") -> Image.Image:
    """A template as RGB, EXIF orientation applied: a PIL image or a uint8 array `[H, W]` / `[H, W, 3|4]`."""
    if image is None:
        raise InputError(f"{what} is missing")
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or not (image.ndim == 2 or (image.ndim == 3 and image.shape[2] in (1, 3, 4))):
            raise InputError(f"{what} as an array must be uint8 [H, W] or [H, W, 3|4], got {image.dtype} "
                             f"{list(image.shape)}")
        image = Image.fromarray(image.squeeze(2) if image.ndim == 3 and image.shape[2] == 1 else image)
    if not isinstance(image, Image.Image):
        raise InputError(f"{what} must be a PIL image or a uint8 array, got {type(image).__name__}")
    _one_picture(image, what)
    if image.width < 1 or image.height < 1:
        raise InputError(f"{what} is empty ({image.width}x{image.height})")
    check_pixels(image.size, what, MAX_PIXELS, FLUX_STRIDE)  # as a file's header is: a PIL image came unchecked
    profile = colour_profile(image)
    rgb = _eight_bit(upright(image), what).convert("RGB")
    rgb.info.pop("icc_profile", None)  # a grey or CMYK one would mislabel the RGB image
    if profile is not None:
        rgb.info["icc_profile"] = profile
    return rgb


def colour_profile(image: Image.Image) -> bytes | None:
    """The image's ICC profile when it describes RGB (the profile's data colour space, bytes 16-20 of
    its header, is 'RGB '): what an RGB answer made from it carries."""
    profile = image.info.get("icc_profile")
    return profile if isinstance(profile, bytes) and profile[16:20] == b"RGB " else None


def _eight_bit(image: Image.Image, what: str) -> Image.Image:
    """Greyscale images of more than 8 bits scaled to "L" (Pillow's convert clips them at 255: a 16-bit
    photo came out white); other modes as they are."""
    if not (image.mode.startswith("I") or image.mode == "F"):
        return image
    values = np.asarray(image, dtype=np.float64)
    if not np.isfinite(values).all():
        raise InputError(f"{what} has NaN or infinite values")
    low, high = (values.min(), values.max()) if values.size else (0.0, 0.0)
    if image.mode == "F":
        full_scale = 1.0 if high <= 1 else 255.0
    else:
        full_scale = 65535.0
    if low < 0 or high > full_scale:
        raise InputError(f"{what} ({image.mode}) has values from {low:g} to {high:g}; an image holds 0..65535 "
                         "(16-bit integers) or 0..1 / 0..255 (floats)")
    return Image.fromarray(np.rint(values * (255.0 / full_scale)).astype(np.uint8), mode="L")


def check_levels(image: Image.Image, what: str = "image") -> None:
    """InputError if `as_image` would refuse this decoded image's values (an integer or float image out of
    range, NaN): what an upload is checked for when it arrives, not when it is first read as a template."""
    _eight_bit(image, what)


def as_mask(mask, size: tuple[int, int] | None = None, *, alpha: bool = False, what: str = "mask") -> Image.Image:
    """The one reading of a mask (see the module docstring): 8-bit "L", white = repaint, non-zero
    wherever the input is non-zero. `size` (width, height): the image it belongs to, checked."""
    if mask is None:
        raise InputError(f"{what} is missing: send a mask (white = repaint)")
    if isinstance(mask, Image.Image):
        _one_picture(mask, what)
        levels = _image_levels(upright(mask), alpha, what)
        if mask.info.get(LOSSY) or mask.format in LOSSY_FORMATS:  # decoded here, or opened by the caller
            levels = np.where(levels <= JPEG_SNAP, 0, np.where(levels >= 255 - JPEG_SNAP, 255, levels)).astype(np.uint8)
    else:
        if alpha:
            raise InputError(f"{what}: alpha masks are images with an alpha channel (alpha 0 = repaint)")
        levels = _array_levels(mask, what)
    result = Image.fromarray(levels, mode="L")
    if result.width < 1 or result.height < 1:
        raise InputError(f"{what} is empty ({result.width}x{result.height})")
    if size is not None and result.size != tuple(size):
        raise InputError(f"{what} is {result.width}x{result.height} but image is {size[0]}x{size[1]}; "
                         "they must match" + orientation_hint(result.size, size))
    return result


def orientation_hint(mask_size: tuple[int, int], image_size: tuple[int, int]) -> str:
    """When a mask has the image's sides swapped, the likely cause: sizes are as displayed, after EXIF
    orientation, and the mask was drawn over the image as stored."""
    if tuple(mask_size) == tuple(image_size)[::-1]:
        return (" (sizes are as displayed, after EXIF orientation: a photo taken turned is stored with its "
                "sides swapped; draw the mask over the image as it is displayed)")
    return ""


def _image_levels(mask: Image.Image, alpha: bool, what: str) -> np.ndarray:
    if alpha:
        if not has_alpha(mask):
            raise InputError(f"{what} has no alpha channel, and it is read by its alpha: send a PNG (or WebP) "
                             "that is transparent (alpha 0) where to repaint")
        return 255 - np.asarray(mask.convert("RGBA").getchannel("A"))
    if mask.mode == "1" or mask.mode == "L":
        return np.asarray(mask.convert("L"))
    if mask.mode.startswith("I;16"):  # 16-bit: its mode says its scale (by its values, 255 read as white)
        values = np.asarray(mask, dtype=np.int64)
        if values.size and (values.min() < 0 or values.max() > 65535):
            raise InputError(f"{what} ({mask.mode}) has values from {values.min()} to {values.max()}; a 16-bit "
                             "mask holds 0..65535")
        return _at_least_one(np.rint(values * (255.0 / 65535.0)), values)
    if mask.mode in ("I", "F"):  # 32-bit: a 16-bit file, or numbers made in memory: judged by their values
        return _array_levels(np.asarray(mask), what)
    if has_alpha(mask):
        rgba = mask.convert("RGBA")
        luminance = np.asarray(rgba.convert("L"), dtype=np.uint32)
        opacity = np.asarray(rgba.getchannel("A"), dtype=np.uint32)
        return _at_least_one((luminance * opacity + 127) // 255, luminance * opacity)
    return np.asarray(mask.convert("RGB").convert("L"))


def _array_levels(values, what: str) -> np.ndarray:
    import torch

    if isinstance(values, torch.Tensor):  # channels first: [H, W] or [1, H, W]
        values = values.detach().cpu().numpy()
        if values.ndim == 3 and values.shape[0] == 1:
            values = values[0]
    if not isinstance(values, np.ndarray):
        raise InputError(f"{what} must be a PIL image, a numpy array or a torch tensor, got {type(values).__name__}")
    if values.ndim == 3 and values.dtype == np.uint8 and values.shape[2] in (3, 4):
        return _image_levels(Image.fromarray(values), False, what)
    if values.ndim == 3 and values.shape[2] == 1:  # numpy: channels last, [H, W, 1]
        values = values[..., 0]
    if values.ndim != 2:
        raise InputError(f"{what} must be 2-D [H, W] (or one channel), got shape {list(values.shape)}")
    if values.dtype == np.bool_:
        return values.astype(np.uint8) * 255
    if values.dtype == np.uint8:  # 0..255, or 0..1 (the largest value decides, as for every other type)
        return np.ascontiguousarray(values) if values.size == 0 or values.max() > 1 else values * np.uint8(255)
    integer = np.issubdtype(values.dtype, np.integer)
    if not (integer or np.issubdtype(values.dtype, np.floating)):
        raise InputError(f"{what} has values of type {values.dtype}; a mask holds numbers")
    numbers = values.astype(np.float64)
    if not np.isfinite(numbers).all():
        raise InputError(f"{what} has NaN or infinite values")
    low, high = (numbers.min(), numbers.max()) if numbers.size else (0.0, 0.0)
    if low < 0:
        raise InputError(f"{what} has negative values (down to {low:g}); use 0..1 or 0..255")
    if high <= 1:
        full_scale = 1.0
    elif high <= 255:
        full_scale = 255.0
    elif high <= 65535 and integer:
        full_scale = 65535.0
    else:
        raise InputError(f"{what} has values up to {high:g}; use 0..1, 0..255, or 0..65535 for 16-bit masks")
    return _at_least_one(np.rint(numbers * (255.0 / full_scale)), numbers)


def _at_least_one(levels: np.ndarray, source: np.ndarray) -> np.ndarray:
    """8-bit levels in which every pixel that is non-zero in `source` stays non-zero: a faint pixel is
    still a pixel to repaint."""
    levels = np.where((source > 0) & (levels < 1), 1, levels)
    return np.clip(levels, 0, 255).astype(np.uint8)


def has_alpha(image: Image.Image) -> bool:
    return bool({"A", "a"} & set(image.getbands())) or "transparency" in image.info


def alpha_of(image: Image.Image) -> Image.Image | None:
    """A decoded template's transparency as "L" (alpha, palette or colour-key transparency), or None if
    it has none or is opaque everywhere. The model sees its RGB; answers get the alpha back
    (`canvas.paste_alpha`), so a cut-out stays one."""
    if not has_alpha(image):
        return None
    if image.mode.startswith("I") and isinstance(image.info.get("transparency"), int):
        # a 16-bit grey colour key, which Pillow's convert("RGBA") ignores
        keyed = np.asarray(image) != image.info["transparency"]
        alpha = Image.fromarray(np.where(keyed, 255, 0).astype(np.uint8), mode="L")
    else:
        alpha = image.convert("RGBA").getchannel("A")
    return None if alpha.getextrema()[0] == 255 else alpha


def png_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


# What the CLI writes answers as: formats Pillow saves an RGB (or RGBA) picture in.
WRITE_SUFFIXES = (".png", ".webp", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp", ".gif", ".tga", ".ppm")


def check_output_path(path: Path) -> None:
    """Fail before any compute if the output cannot be written: a format not in WRITE_SUFFIXES, or a
    folder that cannot be made or written to (made now if missing)."""
    path = Path(path)
    if path.suffix.lower() not in WRITE_SUFFIXES:
        raise InputError(f"cannot write {path}: {path.suffix or 'no suffix'!r} is not an image format retouch "
                         f"writes ({', '.join(WRITE_SUFFIXES)})")
    check_writable(path)


# Formats that keep 8-bit RGB exactly, so unmasked pixels stay the template's byte for byte (WebP: written
# lossless by save_image).
LOSSLESS_SUFFIXES = (".png", ".webp", ".bmp", ".tif", ".tiff", ".ppm", ".tga")


def lossy_output_note(path: Path) -> str | None:
    """A one-line note when `path`'s format cannot keep the unmasked pixels exactly (JPEG, GIF, ...)."""
    suffix = Path(path).suffix.lower()
    if suffix in LOSSLESS_SUFFIXES:
        return None
    return (f"note: {suffix} is lossy, so unmasked pixels will be close to the template's, not equal; "
            f"write {', '.join(LOSSLESS_SUFFIXES[:2])} to keep them exactly")


ALPHA_SUFFIXES = (".png", ".webp", ".tif", ".tiff", ".tga", ".gif")  # formats Pillow writes transparency in


def alpha_output_note(path: Path) -> str | None:
    """A one-line note when `path`'s format cannot keep a transparent template's alpha."""
    suffix = Path(path).suffix.lower()
    return None if suffix in ALPHA_SUFFIXES else f"note: {suffix} has no transparency, so the answer drops the alpha"


def save_image(image: Image.Image, path: Path) -> Path:
    """Write an answer by its suffix, with its colour profile: WebP lossless, JPEG at quality 95 without
    chroma subsampling (Pillow's default 75 at 4:2:0 moved unmasked colour edges by tens of levels)."""
    path = Path(path)
    if image.mode == "RGBA" and path.suffix.lower() not in ALPHA_SUFFIXES:
        image = image.convert("RGB")  # the caller said so (`alpha_output_note`)
    profile = colour_profile(image)
    options = {"icc_profile": profile} if profile else {}
    suffix = path.suffix.lower()
    if suffix == ".webp":  # exact: libwebp otherwise rewrites the colour under alpha 0, which paste-back keeps
        options.update(lossless=True, exact=True)
    elif suffix in (".jpg", ".jpeg"):
        options.update(quality=95, subsampling=0)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path, **options)
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc}") from None
    return path
