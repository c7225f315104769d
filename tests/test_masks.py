"""Pixel mask -> token mask geometry, checked against a direct per-token definition."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageDraw

from retouch.masks import (FLUX_STRIDE, centred_token_rectangle, mask_ratio, masked_token_indices, pixel_mask_of_tokens,
                           pixel_mask_tensor, token_mask)


def token_mask_by_definition(pixels: torch.Tensor, stride: int, dilation: int) -> torch.Tensor:
    """Token (i, j) is masked iff some masked pixel lies in a token within `dilation` of it."""
    rows, cols = -(-pixels.shape[0] // stride), -(-pixels.shape[1] // stride)
    touched = torch.zeros(rows, cols, dtype=torch.bool)
    for i in range(rows):
        for j in range(cols):
            touched[i, j] = pixels[i * stride:(i + 1) * stride, j * stride:(j + 1) * stride].any()
    out = torch.zeros_like(touched)
    for i in range(rows):
        for j in range(cols):
            out[i, j] = touched[max(0, i - dilation):i + dilation + 1, max(0, j - dilation):j + dilation + 1].any()
    return out


@pytest.mark.parametrize("size", [(128, 128), (100, 75), (16, 16), (17, 33)])
@pytest.mark.parametrize("stride", [8, 16, 32])
@pytest.mark.parametrize("dilation", [0, 1, 2, 50, 10**9])  # past the grid: every token near a masked one
def test_token_mask_matches_definition(size, stride, dilation):
    generator = torch.Generator().manual_seed(size[0] * stride + dilation)
    pixels = torch.rand(size, generator=generator) > 0.995  # sparse specks probe the borders
    expected = token_mask_by_definition(pixels, stride, dilation)
    assert torch.equal(token_mask(pixels, stride, dilation), expected)


def test_square_mask_on_flux_grid():
    mask = Image.new("L", (128, 128), 0)
    ImageDraw.Draw(mask).rectangle((32, 32, 95, 95), fill=255)  # pixels 32..95: tokens 2..5
    tokens = token_mask(mask, FLUX_STRIDE)
    assert tokens.shape == (8, 8)
    assert tokens[2:6, 2:6].all() and tokens.sum() == 16
    assert mask_ratio(tokens) == 16 / 64
    assert masked_token_indices(tokens).tolist() == [r * 8 + c for r in range(2, 6) for c in range(2, 6)]


def test_one_pixel_off_the_grid_marks_the_neighbour_token():
    mask = Image.new("L", (128, 128), 0)
    ImageDraw.Draw(mask).rectangle((32, 32, 96, 95), fill=255)  # column 96 starts token 6
    assert token_mask(mask, FLUX_STRIDE)[2:6, 6].all()


def test_any_non_zero_pixel_is_repainted():
    # A faint or grey pixel is part of the edit (it is blended at paste-back): its token must be computed.
    gray = np.array([[0, 1, 127, 128, 255]], dtype=np.uint8)
    assert pixel_mask_tensor(gray).tolist() == [[False, True, True, True, True]]
    assert pixel_mask_tensor(torch.tensor([[0.0, 0.2, 0.7]])).tolist() == [[False, True, True]]
    with pytest.raises(ValueError, match="2-D"):
        pixel_mask_tensor(np.zeros((2, 2, 3)))


def test_empty_and_full_masks():
    assert not token_mask(torch.zeros(64, 64, dtype=torch.bool), 16).any()
    assert token_mask(torch.ones(64, 64, dtype=torch.bool), 16).all()


@pytest.mark.parametrize("ratio", [0.05, 0.2, 0.5, 1.0])
def test_centred_rectangle_covers_the_ratio_and_round_trips_through_pixels(ratio):
    tokens = centred_token_rectangle((32, 32), ratio)
    assert len(set(tokens.tolist())) == len(tokens) and abs(len(tokens) / 1024 - ratio) < 0.03
    pixels = pixel_mask_of_tokens(tokens, (32, 32), FLUX_STRIDE)
    assert masked_token_indices(token_mask(pixels, FLUX_STRIDE)).tolist() == sorted(tokens.tolist())


def token_mask_reference(pixels: torch.Tensor, stride: int, dilation: int) -> torch.Tensor:
    """Max pooling in torch: the definition token_mask computes with NumPy."""
    tokens = torch.nn.functional.max_pool2d(pixels.float()[None, None], stride, stride, ceil_mode=True)
    if dilation:
        tokens = torch.nn.functional.max_pool2d(tokens, 2 * dilation + 1, stride=1, padding=dilation)
    return tokens[0, 0] > 0


@given(st.integers(1, 40), st.integers(1, 40), st.sampled_from([1, 3, 8, 16]), st.integers(0, 3),
       st.integers(0, 2**32 - 1))
@settings(max_examples=200, deadline=None)
def test_token_mask_equals_max_pooling(height, width, stride, dilation, seed):
    pixels = torch.from_numpy(np.random.default_rng(seed).random((height, width)) < 0.03)
    assert torch.equal(token_mask(pixels, stride, dilation), token_mask_reference(pixels, stride, dilation))
