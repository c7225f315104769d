"""Hypothesis strategies for the input space of an edit: image sizes (odd, prime, tiny, non-square)
and masks (single pixels, 1-px lines, borders and corners, noise, empty, full, grey). Imported by
test modules (pytest puts tests/ on sys.path)."""

import numpy as np
from hypothesis import strategies as st
from PIL import Image

MASK_KINDS = ("pixels", "row", "column", "border", "corner", "noise", "empty", "full", "grey", "gradient")


def sizes(max_side: int = 70):
    """(width, height): anything from 1x1, weighted towards sizes that are not multiples of 16."""
    side = st.one_of(st.integers(1, max_side), st.sampled_from([1, 2, 3, 7, 13, 17, 31, 47, 61, 67]))
    return st.tuples(side, side).filter(lambda s: max(s) <= max_side)


@st.composite
def masks(draw, size: tuple[int, int], kinds=MASK_KINDS) -> Image.Image:
    """A mask ("L", white = repaint) of `size`."""
    width, height = size
    kind = draw(st.sampled_from(kinds))
    levels = np.zeros((height, width), np.uint8)
    x, y = draw(st.integers(0, width - 1)), draw(st.integers(0, height - 1))
    if kind == "pixels":
        levels[y, x] = draw(st.integers(1, 255))
        for _ in range(draw(st.integers(0, 2))):
            levels[draw(st.integers(0, height - 1)), draw(st.integers(0, width - 1))] = 255
    elif kind == "row":
        levels[y, :] = 255
    elif kind == "column":
        levels[:, x] = 255
    elif kind == "border":
        levels[[0, -1], :] = levels[:, [0, -1]] = 255
    elif kind == "corner":
        levels[draw(st.sampled_from([0, height - 1])), draw(st.sampled_from([0, width - 1]))] = 255
    elif kind == "noise":
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        levels = np.where(rng.random((height, width)) < 0.05, rng.integers(1, 256, (height, width)), 0)
    elif kind == "full":
        levels[:] = 255
    elif kind == "grey":
        levels[:] = draw(st.integers(1, 254))
    elif kind == "gradient":  # a feathered edge: 0 on the left, full on the right
        levels[:] = np.linspace(0, 255, width).round().astype(np.uint8)[None, :]
    return Image.fromarray(levels.astype(np.uint8), mode="L")


@st.composite
def sized_masks(draw, max_side: int = 70, kinds=MASK_KINDS) -> Image.Image:
    return draw(masks(draw(sizes(max_side)), kinds))


def random_image(size: tuple[int, int], seed: int = 0) -> Image.Image:
    """A template with content everywhere (noise over a gradient), so any change shows."""
    width, height = size
    rng = np.random.default_rng(seed)
    gradient = np.linspace(0, 200, width)[None, :, None] + np.linspace(0, 50, height)[:, None, None]
    pixels = np.clip(gradient + rng.integers(0, 56, (height, width, 3)), 0, 255)
    return Image.fromarray(pixels.astype(np.uint8))
