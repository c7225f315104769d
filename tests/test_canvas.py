"""The canvas: images of any size padded (never resized) to whole patches, masks mapped to whole
tokens conservatively, and the edit pasted back at the user's resolution."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from mask_strategies import sized_masks

from retouch.canvas import Canvas, paste_alpha, paste_unmasked
from retouch.images import alpha_of

sides = st.integers(1, 70)


@given(sized_masks(), st.sampled_from([(16, 16), (16, 8)]))
@settings(max_examples=300, deadline=None)
def test_a_square_of_the_canvas_mask_is_white_exactly_when_a_pixel_in_it_is_non_zero(mask, geometry):
    """... or, when the mask repaints anything, when it holds none of the user's pixels (padding)."""
    multiple, stride = geometry
    canvas = Canvas.of(mask.size, multiple, stride)
    assert all(p % multiple == 0 and p >= s for p, s in zip(canvas.padded, mask.size))
    assert all(p - s < multiple for p, s in zip(canvas.padded, mask.size))
    canvas_mask = np.asarray(canvas.mask(mask))
    assert canvas_mask.shape == canvas.padded[::-1] and set(np.unique(canvas_mask)) <= {0, 255}
    user = np.zeros(canvas.padded[::-1], np.uint8)
    user[:mask.height, :mask.width] = np.asarray(mask)
    rows, cols = canvas.padded[1] // stride, canvas.padded[0] // stride
    for r in range(rows):
        for c in range(cols):
            square = (slice(r * stride, (r + 1) * stride), slice(c * stride, (c + 1) * stride))
            padding = r * stride >= mask.height or c * stride >= mask.width
            expected = 255 if user[square].any() or (padding and user.any()) else 0
            assert (canvas_mask[square] == expected).all()


@given(sides, sides)
@settings(max_examples=100, deadline=None)
def test_the_image_is_padded_with_its_edges_and_cropped_back_unchanged(width, height):
    rng = np.random.default_rng(width * 1000 + height)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    canvas = Canvas.of(image.size, 16, 16)
    padded = canvas.image(image)
    assert padded.size == canvas.padded
    assert canvas.crop(padded).tobytes() == image.tobytes()
    pixels = np.asarray(padded)
    assert (pixels[height:, :width] == pixels[height - 1:height, :width]).all()  # the last row, repeated
    assert (pixels[:, width:] == pixels[:, width - 1:width]).all()  # the last column, repeated


@given(sized_masks())
@settings(max_examples=100, deadline=None)
def test_paste_keeps_the_template_where_the_mask_is_zero_and_takes_the_edit_where_it_is_full(mask):
    rng = np.random.default_rng(mask.width * 100 + mask.height)
    template = rng.integers(0, 256, (mask.height, mask.width, 3), dtype=np.uint8)
    edit = rng.integers(0, 256, (mask.height, mask.width, 3), dtype=np.uint8)
    pasted = np.asarray(paste_unmasked(Image.fromarray(template), Image.fromarray(edit), mask)).astype(int)
    weight = np.asarray(mask)
    assert (pasted[weight == 0] == template[weight == 0]).all()
    assert (pasted[weight == 255] == edit[weight == 255]).all()
    expected = (template * (255 - weight[..., None].astype(int)) + edit * weight[..., None].astype(int)) / 255
    assert np.abs(pasted - expected).max() <= 0.5  # grey blends, rounded to the nearest level


@given(sized_masks())
@settings(max_examples=60, deadline=None)
def test_a_transparent_templates_alpha_comes_back_outside_the_mask_and_opaque_inside(mask):
    """What the mask keeps is the template's RGBA pixel exactly; what the model painted is opaque."""
    rng = np.random.default_rng(mask.width * 7 + mask.height)
    alpha = rng.integers(0, 256, (mask.height, mask.width), dtype=np.uint8)
    edit = rng.integers(0, 256, (mask.height, mask.width, 3), dtype=np.uint8)
    answer = paste_alpha(Image.fromarray(edit), Image.fromarray(alpha), mask)
    assert answer.mode == "RGBA"
    pixels, weight = np.asarray(answer), np.asarray(mask)
    assert (pixels[..., :3] == edit).all()
    assert (pixels[..., 3][weight == 0] == alpha[weight == 0]).all() and (pixels[..., 3][weight == 255] == 255).all()
    assert paste_alpha(Image.fromarray(edit), None, mask).mode == "RGB"  # an opaque template: as it was


def test_transparency_is_read_from_alpha_palettes_and_colour_keys_and_opaque_alpha_is_none():
    rgba = Image.new("RGBA", (4, 2), (10, 20, 30, 255))
    assert alpha_of(rgba) is None and alpha_of(rgba.convert("RGB")) is None
    rgba.putpixel((1, 1), (10, 20, 30, 0))
    assert np.asarray(alpha_of(rgba)).tolist() == [[255] * 4, [255, 0, 255, 255]]
    assert np.asarray(alpha_of(rgba.convert("LA"))).tolist() == [[255] * 4, [255, 0, 255, 255]]
    keyed = Image.new("RGB", (2, 1), (0, 0, 0))
    keyed.putpixel((1, 0), (9, 9, 9))
    keyed.info["transparency"] = (9, 9, 9)
    assert np.asarray(alpha_of(keyed)).tolist() == [[255, 0]]


def test_sizes_that_are_already_whole_are_left_alone():
    canvas = Canvas.of((128, 64), 16, 16)
    assert canvas.padded == (128, 64) and not canvas.is_padded
    assert Canvas.of((1, 1), 16, 8).padded == (16, 16)
    with pytest.raises(ValueError, match="at least one pixel"):
        Canvas.of((0, 5), 16, 16)
    with pytest.raises(ValueError, match="one size"):
        paste_unmasked(Image.new("RGB", (4, 4)), Image.new("RGB", (4, 5)), Image.new("L", (4, 4)))


@settings(max_examples=40, deadline=None)
@given(width=st.integers(1, 1100), height=st.integers(1, 1100))
def test_a_canvas_past_sd3s_position_embedding_is_refused_and_up_to_it_is_taken(width, height):
    """SD3's transformer holds a position embedding of pos_embed_max_size patches a side (192: 3072 px); a
    larger image failed inside it with a ValueError (exit 1, a 500). The UNets and Flux have no such table."""
    from types import SimpleNamespace

    from retouch.errors import InputError

    table = SimpleNamespace(config=SimpleNamespace(pos_embed_max_size=64))
    sd3 = SimpleNamespace(vae_scale_factor=8, transformer=table)
    unet = SimpleNamespace(vae_scale_factor=8, unet=object())
    padded = Canvas.for_pipeline((width, height), unet).padded
    assert padded == (-(-width // 16) * 16, -(-height // 16) * 16)
    if max(padded) > 64 * 16:
        with pytest.raises(InputError, match="at most 1024 px a side"):
            Canvas.for_pipeline((width, height), sd3)
    else:
        assert Canvas.for_pipeline((width, height), sd3).padded == padded
