"""Image and mask input: the one definition of what a mask means (`retouch.images.as_mask`), EXIF
orientation, size checks, limits, and errors that name the input."""

import io
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageDraw

from retouch import images
from retouch.errors import InputError


def square_mask(size=64, box=(16, 16, 47, 47)) -> Image.Image:
    mask = Image.new("L", (size, size), 0)
    ImageDraw.Draw(mask).rectangle(box, fill=255)
    return mask


def levels(mask: Image.Image) -> list:
    assert mask.mode == "L"
    return np.asarray(mask).tolist()


# ---- the mask conventions, mode by mode ----

def test_alpha_mask_converts_to_white_repaint(tmp_path):
    # OpenAI convention: alpha 0 = repaint. It must become white = repaint; colours are ignored.
    rgba = Image.new("RGBA", (64, 64), (10, 20, 30, 255))
    ImageDraw.Draw(rgba).rectangle((16, 16, 47, 47), fill=(255, 255, 255, 0))
    rgba.save(tmp_path / "alpha.png")
    converted = images.load_mask(tmp_path / "alpha.png", alpha=True)
    assert converted.tobytes() == square_mask().tobytes()


def test_plain_mask_is_grayscale(tmp_path):
    square_mask().convert("RGB").save(tmp_path / "mask.png")
    mask = images.load_mask(tmp_path / "mask.png")
    assert mask.mode == "L" and mask.tobytes() == square_mask().tobytes()


def test_alpha_flag_on_mask_without_alpha(tmp_path):
    square_mask().save(tmp_path / "mask.png")
    with pytest.raises(InputError, match="no alpha channel"):
        images.load_mask(tmp_path / "mask.png", alpha=True)


@pytest.mark.parametrize("mode, pixels, expected", [
    ("L", [[0, 1, 128, 255]], [[0, 1, 128, 255]]),
    ("1", [[0, 1, 1, 0]], [[0, 255, 255, 0]]),
    ("I;16", [[0, 1, 32768, 65535]], [[0, 1, 128, 255]]),  # 16-bit: 0..65535, a faint pixel stays non-zero
    # 16-bit whatever its values: by its largest value, 255 read as white and 256 as level 1
    ("I;16", [[0, 1, 200, 65535]], [[0, 1, 1, 255]]),
    ("I;16", [[0, 1, 255, 256]], [[0, 1, 1, 1]]),
    ("I", [[0, 1, 0, 1]], [[0, 255, 0, 255]]),  # 32-bit (made in memory): by its largest value, 0..1
    ("I", [[0, 1, 128, 255]], [[0, 1, 128, 255]]),  # 0..255, as the same numbers in a numpy array
    ("F", [[0.0, 0.001, 0.5, 1.0]], [[0, 1, 128, 255]]),  # 0..1; 0.001 is still repainted
    ("F", [[0.0, 0.5, 100.0, 255.0]], [[0, 1, 100, 255]]),  # largest value > 1: 0..255
])
def test_single_channel_modes(mode, pixels, expected):
    array = np.array(pixels, dtype={"L": np.uint8, "1": bool, "I;16": np.uint16, "I": np.int32, "F": np.float32}[mode])
    mask = Image.fromarray(array).convert("1") if mode == "1" else Image.fromarray(array, mode=None)
    assert mask.mode == mode
    assert levels(images.as_mask(mask)) == expected


def test_colour_modes_read_luminance_and_alpha_masks_read_luminance_times_alpha():
    rgb = Image.new("RGB", (3, 1))
    rgb.putdata([(0, 0, 0), (255, 255, 255), (255, 0, 0)])
    assert levels(images.as_mask(rgb)) == [[0, 255, 76]]  # ITU-R 601 luma, as PIL's "L"
    palette = rgb.convert("P")
    assert levels(images.as_mask(palette)) == [[0, 255, 76]]
    # White strokes on a transparent background mark the region; transparent white is not a stroke.
    rgba = Image.new("RGBA", (4, 1))
    rgba.putdata([(255, 255, 255, 255), (255, 255, 255, 0), (0, 0, 0, 255), (255, 255, 255, 128)])
    assert levels(images.as_mask(rgba)) == [[255, 0, 0, 128]]
    assert levels(images.as_mask(rgba.convert("LA"))) == [[255, 0, 0, 128]]
    assert levels(images.as_mask(rgba, alpha=True)) == [[0, 255, 0, 127]]


def test_arrays_and_tensors():
    assert levels(images.as_mask(np.array([[False, True]]))) == [[0, 255]]
    assert levels(images.as_mask(np.array([[0, 7, 255]], np.uint8))) == [[0, 7, 255]]
    assert levels(images.as_mask(np.array([[0.0, 0.25, 1.0]]))) == [[0, 64, 255]]
    assert levels(images.as_mask(np.array([[[0], [255]]], np.uint8))) == [[0, 255]]  # [H, W, 1]
    assert levels(images.as_mask(torch.tensor([[0.0, 1.0]]))) == [[0, 255]]
    assert levels(images.as_mask(torch.tensor([[[0, 1]]], dtype=torch.int64))) == [[0, 255]]  # [1, H, W]
    assert levels(images.as_mask(torch.tensor([[True, False]]))) == [[255, 0]]
    white_rgb = np.full((1, 2, 3), 255, np.uint8)
    assert levels(images.as_mask(white_rgb)) == [[255, 255]]
    # 8-bit 0/1 is judged by its largest value like every other type: it was read as levels 0 and 1 (an
    # edit blended in at 1/255, invisible) where int64 or bool 0/1 repainted in full.
    assert levels(images.as_mask(np.array([[0, 1, 1]], np.uint8))) == [[0, 255, 255]]
    assert levels(images.as_mask(torch.tensor([[1, 0]], dtype=torch.uint8))) == [[255, 0]]
    assert levels(images.as_mask(np.zeros((1, 2), np.uint8))) == [[0, 0]]


@pytest.mark.parametrize("mask, message", [
    (None, "mask is missing"),
    (np.zeros((2, 2, 2)), r"2-D \[H, W\]"),
    (np.zeros((2,)), r"2-D \[H, W\]"),
    (np.array([[0.0, -1.0]]), "negative"),
    (np.array([[0.0, np.nan]]), "NaN"),
    (np.array([[0.0, 300.0]]), "values up to 300"),
    (np.array([[0, 70000]]), "values up to 70000"),
    (np.array([["a"]]), "a mask holds numbers"),
    ("mask.png", "must be a PIL image"),
    (np.zeros((0, 3), np.uint8), "empty"),
])
def test_bad_masks_name_the_problem(mask, message):
    with pytest.raises(InputError, match=message):
        images.as_mask(mask)


def test_size_mismatch_names_both_sizes():
    with pytest.raises(InputError, match="mask is 64x64 but image is 128x128"):
        images.as_mask(square_mask(), (128, 128))


@given(st.integers(1, 12), st.integers(1, 12), st.sampled_from(["uint8", "uint16", "int32", "float32", "float64"]),
       st.data())
@settings(max_examples=60, deadline=None)
def test_non_zero_stays_non_zero_and_zero_stays_zero(height, width, dtype, data):
    # Whatever the form, the set of repainted pixels is exactly the set of non-zero ones.
    high = {"uint8": 255, "uint16": 65535, "int32": 255, "float32": 1.0, "float64": 255.0}[dtype]
    if dtype.startswith("float"):
        values = data.draw(st.lists(st.floats(0, high, allow_subnormal=False), min_size=height * width,
                                    max_size=height * width))
    else:
        values = data.draw(st.lists(st.integers(0, high), min_size=height * width, max_size=height * width))
    array = np.array(values, dtype=dtype).reshape(height, width)
    mask = np.asarray(images.as_mask(array))
    assert np.array_equal(mask > 0, array > 0)


# ---- EXIF orientation ----

def exif_rotated_png(image: Image.Image, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    out = io.BytesIO()
    image.save(out, format="PNG", exif=exif)
    return out.getvalue()


def test_exif_orientation_is_applied_to_image_and_mask_alike():
    # Stored 40x20, displayed rotated (orientation 6: rotate 90 degrees clockwise) as 20x40.
    stored = Image.new("RGB", (40, 20), (0, 0, 0))
    stored.putpixel((0, 0), (255, 0, 0))
    stored_mask = Image.new("L", (40, 20), 0)
    stored_mask.putpixel((0, 0), 255)
    image = images.decode_image(exif_rotated_png(stored, 6), "image")
    mask = images.as_mask(images.decode_image(exif_rotated_png(stored_mask, 6), "mask"), image.size)
    assert image.size == mask.size == (20, 40)
    assert image.getpixel((19, 0)) == (255, 0, 0) and mask.getpixel((19, 0)) == 255
    # A PIL image handed to the Python API is treated the same way.
    opened = Image.open(io.BytesIO(exif_rotated_png(stored, 6)))
    assert images.as_image(opened).size == (20, 40)


# ---- files, limits, errors ----

def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(InputError, match="not found"):
        images.load_image(tmp_path / "nope.png")
    (tmp_path / "junk.png").write_bytes(b"not an image")
    with pytest.raises(InputError, match="cannot read image") as error:
        images.load_image(tmp_path / "junk.png")
    assert str(tmp_path / "junk.png") in str(error.value)


@pytest.mark.parametrize("exif", [b"Exif\x00\x00garbagegarbage", b"Exif\x00\x00MM\x00*\x00\x00\x00\x08\xff\xff",
                                  b"Exif\x00\x00II*\x00"])
def test_a_photo_with_a_damaged_exif_block_is_read_as_it_is(exif):
    """The upload decoded, but the copy was parsed again as an image and as a mask (a 500 over HTTP)."""
    out = io.BytesIO()
    Image.new("RGB", (20, 10), "red").save(out, "JPEG", exif=exif)
    decoded = images.decode_image(out.getvalue(), "image")
    assert images.as_image(decoded).size == (20, 10)
    assert images.as_mask(decoded, (20, 10)).size == (20, 10)
    assert images.decode_image(images.png_bytes(images.as_image(decoded)), "answer").getpixel((0, 0))[0] > 200  # red


def test_errors_name_the_input_not_a_buffer():
    with pytest.raises(InputError) as error:
        images.decode_image(b"not an image", "mask")
    message = str(error.value)
    assert message.startswith("cannot read mask") and "BytesIO" not in message and "0x" not in message
    truncated = images.png_bytes(Image.new("RGB", (64, 64), "red"))[:60]
    with pytest.raises(InputError) as error:
        images.decode_image(truncated, "image")
    assert "BytesIO" not in str(error.value)


def test_oversized_image_is_refused_before_decoding(tmp_path, monkeypatch):
    Image.new("RGB", (64, 64)).save(tmp_path / "big.png")
    monkeypatch.setattr(images, "MAX_PIXELS", 64 * 63)
    with pytest.raises(InputError, match="over the limit"):
        images.load_image(tmp_path / "big.png")


@settings(max_examples=40, deadline=None)
@given(width=st.integers(1, 70), height=st.integers(1, 70), multiple=st.sampled_from([1, 8, 16]),
       slack=st.integers(-1, 0))
def test_the_pixel_limit_counts_the_canvas_an_image_is_padded_to(width, height, multiple, slack):
    """A 1x262144 strip is edited on a 16x262144 canvas: counted by its own pixels it passed a limit that
    its canvas is 16 times over."""
    padded = images.padded_size((width, height), multiple)
    assert all(side % multiple == 0 and 0 <= side - own < multiple for side, own in zip(padded, (width, height)))
    limit = padded[0] * padded[1] + slack
    data = images.png_bytes(Image.new("RGB", (width, height), "red"))
    if slack < 0:
        with pytest.raises(images.ImageTooLarge, match="over the limit") as refused:
            images.decode_image(data, "image", limit, multiple)
        assert ("padded to" in str(refused.value)) == (padded != (width, height))
    else:
        assert images.decode_image(data, "image", limit, multiple).size == (width, height)


def test_unknown_output_format():
    for refused in ("out.nope", "out.xbm", "out.pdf", "out"):  # xbm: Pillow knows it but not for RGB (it
        with pytest.raises(InputError, match="not an image format retouch writes"):  # failed after the edit)
            images.check_output_path(refused)
    images.check_output_path("out.png")


def test_images_come_as_rgb():
    assert images.as_image(Image.new("L", (3, 2), 7)).mode == "RGB"
    assert images.as_image(np.zeros((2, 3, 3), np.uint8)).size == (3, 2)
    with pytest.raises(InputError, match="image is missing"):
        images.as_image(None)
    with pytest.raises(InputError, match="uint8"):
        images.as_image(np.zeros((2, 3, 3), np.float32))


@pytest.mark.parametrize("mode, pixels, expected", [
    ("I;16", [[0, 257, 32768, 65535]], [0, 1, 128, 255]),  # 16-bit: 0..65535, a dark photo stays dark
    ("I", [[0, 257, 32768, 65535]], [0, 1, 128, 255]),
    ("F", [[0.0, 0.25, 0.5, 1.0]], [0, 64, 128, 255]),
    ("F", [[0.0, 2.0, 128.0, 255.0]], [0, 2, 128, 255]),
])
def test_deep_greyscale_images_are_scaled_not_clipped(mode, pixels, expected):
    dtype = {"I;16": np.uint16, "I": np.int32, "F": np.float32}[mode]
    image = Image.fromarray(np.array(pixels, dtype=dtype))
    assert image.mode == mode
    rgb = images.as_image(image)
    assert rgb.mode == "RGB" and [rgb.getpixel((x, 0)) for x in range(4)] == [(v, v, v) for v in expected]


def test_a_16_bit_png_upload_keeps_its_tones():
    tones = (np.arange(64, dtype=np.uint16).reshape(8, 8) * 1000)
    decoded = images.as_image(images.decode_image(images.png_bytes(Image.fromarray(tones)), "image"))
    assert np.array_equal(np.asarray(decoded)[..., 0], np.rint(tones / 257).astype(np.uint8))


@pytest.mark.parametrize("mode, pixels", [("I", [[-1, 0]]), ("I", [[0, 70000]]), ("F", [[0.0, 300.0]]),
                                          ("F", [[0.0, float("nan")]])])
def test_out_of_range_deep_images_are_refused(mode, pixels):
    dtype = {"I": np.int32, "F": np.float32}[mode]
    with pytest.raises(InputError, match="image"):
        images.as_image(Image.fromarray(np.array(pixels, dtype=dtype)))


def test_an_output_path_that_cannot_be_written_is_refused_before_any_compute(tmp_path):
    (tmp_path / "a_file.png").write_bytes(b"x")
    for bad, says in ((tmp_path / "a_file.png" / "out.png", "cannot write"), (tmp_path, "not an image format"),
                      (tmp_path / "a_file.png" / "sub" / "out.png", "cannot write")):
        with pytest.raises(InputError, match=says):
            images.check_output_path(bad)
    images.check_output_path(tmp_path / "new" / "folder" / "out.png")  # made now, so the write cannot fail later
    assert (tmp_path / "new" / "folder").is_dir()


def test_lossless_outputs_keep_every_pixel_and_lossy_ones_are_noted(tmp_path):
    """The paste-back promise (unmasked pixels equal the template's) holds only in a lossless format."""
    rng = np.random.default_rng(0)
    noisy = Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8))
    for suffix in images.LOSSLESS_SUFFIXES:
        path = images.save_image(noisy, tmp_path / f"out{suffix}")
        assert np.array_equal(np.asarray(Image.open(path).convert("RGB")), np.asarray(noisy)), suffix
        assert images.lossy_output_note(path) is None
    jpeg = images.save_image(noisy, tmp_path / "out.JPG")
    assert not np.array_equal(np.asarray(Image.open(jpeg).convert("RGB")), np.asarray(noisy))
    assert ".jpg is lossy" in images.lossy_output_note(jpeg)


def test_formats_with_transparency_keep_every_rgba_pixel_even_under_alpha_0(tmp_path):
    """A transparent template's answer: its RGBA is kept exactly (WebP rewrites colour under alpha 0
    unless told not to); other formats drop the alpha, which a note says."""
    rng = np.random.default_rng(1)
    cutout = rng.integers(0, 256, (24, 32, 4), dtype=np.uint8)
    cutout[..., 3] = np.where(rng.random((24, 32)) < 0.5, 0, 255)
    for suffix in (".png", ".webp", ".tif", ".tga"):
        path = images.save_image(Image.fromarray(cutout), tmp_path / f"out{suffix}")
        assert np.array_equal(np.asarray(Image.open(path).convert("RGBA")), cutout), suffix
        assert images.alpha_output_note(path) is None
    assert "drops the alpha" in images.alpha_output_note(tmp_path / "out.jpg")
    assert Image.open(images.save_image(Image.fromarray(cutout), tmp_path / "out.jpg")).mode == "RGB"


def test_a_16_bit_grey_colour_key_is_transparency():
    grey = Image.fromarray(np.array([[0, 1000], [65535, 1000]], dtype=np.uint16))
    grey.info["transparency"] = 1000
    assert np.asarray(images.alpha_of(grey)).tolist() == [[255, 0], [255, 0]]


def rgb_profile() -> bytes:
    from PIL import ImageCms

    return ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()


def test_an_rgb_colour_profile_goes_with_the_image_into_every_answer_and_others_are_dropped(tmp_path):
    profile = rgb_profile()
    assert profile[16:20] == b"RGB "
    tagged = Image.new("RGB", (8, 6), (10, 200, 30))
    tagged.info["icc_profile"] = profile
    data = io.BytesIO()
    tagged.save(data, format="JPEG", icc_profile=profile)
    read = images.as_image(images.decode_image(data.getvalue(), "image"))
    assert images.colour_profile(read) == profile
    from retouch.canvas import paste_unmasked

    answer = paste_unmasked(read, Image.new("RGB", (8, 6)), Image.new("L", (8, 6), 255))
    assert answer.info["icc_profile"] == profile  # the kept pixels look as they did
    for suffix in (".png", ".jpg", ".webp", ".tif"):
        images.save_image(answer, tmp_path / f"a{suffix}")
        assert Image.open(tmp_path / f"a{suffix}").info.get("icc_profile") == profile, suffix
    grey = Image.new("L", (8, 6), 9)
    grey.info["icc_profile"] = profile[:16] + b"GRAY" + profile[20:]  # describes grey, not the RGB answer
    assert "icc_profile" not in images.as_image(grey).info and images.colour_profile(grey) is None


def test_jpeg_answers_keep_colour_edges():
    """Pillow's default JPEG (quality 75, 4:2:0 chroma) moved the colour of pixels next to a red patch by
    tens of levels; the CLI writes quality 95 without subsampling."""
    picture = np.full((32, 32, 3), 128, np.uint8)
    picture[8:24, 8:24] = (220, 20, 20)
    path = images.save_image(Image.fromarray(picture), Path("/dev/shm") / "retouch-edge-test.jpg")
    try:
        assert np.abs(np.asarray(Image.open(path)).astype(int) - picture).max() <= 12
    finally:
        path.unlink()


@pytest.mark.parametrize("save", [
    lambda out: Image.new("RGB", (8, 8)).save(out, format="TGA"),
    lambda out: Image.new("RGB", (8, 8)).save(out, format="PPM"),
    lambda out: Image.new("RGB", (8, 8)).save(out, format="PCX"),
    lambda out: Image.new("RGB", (8, 8)).save(out, format="EPS"),  # decoding it would run Ghostscript
])
def test_formats_outside_the_list_are_not_decoded(save):
    out = io.BytesIO()
    save(out)
    with pytest.raises(InputError, match="not an image in a format retouch reads"):
        images.decode_image(out.getvalue(), "image")


@pytest.mark.parametrize("fmt", ["GIF", "WEBP", "PNG", "TIFF"])
def test_an_animation_or_a_multi_page_file_is_refused_not_cut_to_its_first_frame(fmt):
    frames = [Image.new("RGB", (8, 8), colour) for colour in ("red", "green", "blue")]
    out = io.BytesIO()
    frames[0].save(out, format=fmt, save_all=True, append_images=frames[1:])
    with pytest.raises(InputError, match="has 3 frames"):
        images.decode_image(out.getvalue(), "image")
    for read in (images.as_image, images.as_mask):  # the Python API's caller opened it
        with pytest.raises(InputError, match="has 3 frames"):
            read(Image.open(io.BytesIO(out.getvalue())))
    one = io.BytesIO()
    frames[0].save(one, format=fmt)
    with Image.open(io.BytesIO(one.getvalue())) as opened:  # loaded, then closed: its frames cannot be counted
        opened.load()
    assert images.as_image(opened).size == images.as_mask(opened).size == (8, 8)


def test_a_phones_mpo_jpeg_is_its_primary_picture():
    out = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(out, format="MPO", save_all=True,
                                         append_images=[Image.new("RGB", (4, 4), "blue")])
    with Image.open(io.BytesIO(out.getvalue())) as opened:
        assert opened.format == "MPO" and opened.n_frames == 2
    decoded = images.decode_image(out.getvalue(), "image")
    assert decoded.size == (8, 8) and decoded.getpixel((0, 0))[0] > 200


def test_a_mask_with_the_sides_swapped_hints_at_exif_orientation():
    with pytest.raises(InputError, match="after EXIF orientation"):
        images.as_mask(Image.new("L", (48, 80)), (80, 48))
    with pytest.raises(InputError) as other:
        images.as_mask(Image.new("L", (48, 81)), (80, 48))
    assert "EXIF" not in str(other.value)


def test_a_jpeg_masks_compression_noise_is_not_repainted():
    """A black/white mask saved as JPEG comes back with levels 1-3 around its stroke: those pixels were
    repainted faintly, and their tokens computed. Levels near black or white are snapped; feathering stays."""
    drawn = np.zeros((32, 32), np.uint8)
    drawn[8:24, 8:24] = 255
    drawn[8:24, 24:26] = 128  # a feathered edge
    out = io.BytesIO()
    Image.fromarray(drawn).save(out, format="JPEG", quality=75)
    noisy = np.asarray(Image.open(io.BytesIO(out.getvalue())))
    assert ((noisy > 0) & (noisy <= 3) & (drawn == 0)).any()  # the noise this is about
    far = np.ones_like(drawn, bool)
    far[6:26, 6:28] = False
    # decoded by retouch (CLI, HTTP), or opened by the caller of the Python API
    for source in (images.decode_image(out.getvalue(), "mask"), Image.open(io.BytesIO(out.getvalue()))):
        read = np.asarray(images.as_mask(source))
        assert (read[far] == 0).all() and (read[10:22, 10:22] == 255).all()
        assert 100 < read[16, 24] < 160  # the feathered edge is still a blend
    png = io.BytesIO()
    Image.fromarray(noisy).save(png, format="PNG")  # the same levels from a lossless file are taken as drawn
    assert (np.asarray(images.as_mask(images.decode_image(png.getvalue(), "mask"))) == noisy).all()


def test_an_image_given_as_an_object_is_held_to_the_pixel_limit_of_files(monkeypatch):
    """A 20000x20000 PIL image reached the pipeline and failed allocating 25.6 GB."""
    monkeypatch.setattr(images, "MAX_PIXELS", 64 * 64)
    assert images.as_image(Image.new("RGB", (64, 64))).size == (64, 64)
    with pytest.raises(InputError, match="over the limit of 4096 pixels"):
        images.as_image(Image.new("RGB", (64, 65)))  # a 64x80 canvas
    with pytest.raises(InputError, match="over the limit"):
        images.as_image(np.zeros((1, 5000, 3), np.uint8))


def test_a_header_over_pillows_own_limit_is_refused_without_its_warning():
    """A 10000x10000 header: Pillow warned (DecompressionBombWarning, two lines on stderr) before
    retouch's own limit refused it in one line."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", 10000, 10000, 8, 0, 0, 0, 0)  # 8-bit grey
    data = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        with pytest.raises(images.ImageTooLarge, match="10000x10000"):
            images.decode_image(data, "image")
