"""Image and mask input handling: conventions, size checks, limits."""

import pytest
from PIL import Image, ImageDraw

from retouch import images
from retouch.baseline import processing_size
from retouch.errors import InputError


def square_mask(size=64, box=(16, 16, 47, 47)) -> Image.Image:
    mask = Image.new("L", (size, size), 0)
    ImageDraw.Draw(mask).rectangle(box, fill=255)
    return mask


def test_alpha_mask_converts_to_white_repaint(tmp_path):
    # OpenAI convention: alpha 0 = repaint. It must become white = repaint.
    rgba = Image.new("RGBA", (64, 64), (10, 20, 30, 255))
    ImageDraw.Draw(rgba).rectangle((16, 16, 47, 47), fill=(0, 0, 0, 0))
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


def test_size_mismatch_names_both_sizes():
    with pytest.raises(InputError, match="mask is 64x64 but image is 128x128"):
        images.check_same_size(Image.new("RGB", (128, 128)), square_mask())


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(InputError, match="not found"):
        images.load_image(tmp_path / "nope.png")
    (tmp_path / "junk.png").write_bytes(b"not an image")
    with pytest.raises(InputError, match="cannot read image"):
        images.load_image(tmp_path / "junk.png")


def test_oversized_image_is_refused_before_decoding(tmp_path, monkeypatch):
    Image.new("RGB", (64, 64)).save(tmp_path / "big.png")
    monkeypatch.setattr(images, "MAX_PIXELS", 64 * 63)
    with pytest.raises(InputError, match="over the limit"):
        images.load_image(tmp_path / "big.png")


def test_unknown_output_format():
    with pytest.raises(InputError, match="unknown image format"):
        images.check_output_path("out.nope")
    images.check_output_path("out.png")


@pytest.mark.parametrize(
    "size, multiple, expected",
    [((128, 128), 16, (128, 128)), ((100, 75), 16, (96, 80)), ((5, 5), 16, (16, 16)), ((1000, 24), 8, (1000, 24))],
)
def test_processing_size(size, multiple, expected):
    assert processing_size(*size, multiple) == expected
