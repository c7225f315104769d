"""How close two RGB images are: PSNR and SSIM, as `retouch bench fidelity` and `make demo` report them."""

import numpy as np
import torch
import torch.nn.functional as F


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB of two uint8 arrays of one shape (inf when they are equal)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean SSIM of two RGB uint8 images `[H, W, 3]` (Wang et al. 2004: 11x11 Gaussian window, sigma 1.5)."""
    x, y = (torch.from_numpy(img.astype(np.float64)).permute(2, 0, 1)[None] for img in (a, b))
    coords = torch.arange(11, dtype=torch.float64) - 5
    gauss = torch.exp(-coords ** 2 / (2 * 1.5 ** 2))
    window = (gauss[:, None] * gauss[None, :] / gauss.sum() ** 2).expand(3, 1, 11, 11)

    def blur(t):
        return F.conv2d(t, window, groups=3)

    mu_x, mu_y = blur(x), blur(y)
    var_x, var_y, cov = blur(x * x) - mu_x ** 2, blur(y * y) - mu_y ** 2, blur(x * y) - mu_x * mu_y
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    index = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x ** 2 + mu_y ** 2 + c1) * (var_x + var_y + c2))
    return float(index.mean())
