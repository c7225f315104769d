"""Inputs shared by the editor tests (imported by test modules; pytest puts tests/ on sys.path)."""

import torch
from PIL import Image, ImageDraw

LATENT_ATOL = 1e-5  # fp32: the masked path differs from full compute only in summation order


def template_image(color=(40, 120, 200)) -> Image.Image:
    image = Image.new("RGB", (128, 128), color)
    ImageDraw.Draw(image).ellipse((20, 30, 90, 100), fill=(230, 200, 60))
    return image


def square_mask(box=(32, 32, 63, 63)) -> Image.Image:
    mask = Image.new("L", (128, 128), 0)
    ImageDraw.Draw(mask).rectangle(box, fill=255)
    return mask


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()
