"""How close mask-aware edits come to full compute of the same edit, and whether the template survives.

    retouch bench fidelity --model tiny-flux-fill --mask-ratios 0.1,0.2,0.3 [--cache-dtypes auto,bfloat16,float8_e4m3fn]

The template is registered with one prompt and seed; each edit (another prompt and seed, a centred
rectangle covering the mask ratio) runs mask-aware and with full compute from the same initial noise.
Reports PSNR and SSIM of the mask-aware image against the full-compute one, over the masked region
and the whole image, and whether unmasked pixels equal the template after blending. With random
weights this measures consistency with full compute, not image quality. `--cache-dtypes` repeats
the comparison with the activations stored in other dtypes (auto: the model's own, lossless; fp8 e4m3
with per-channel scales quarters the host memory and PCIe bytes of fp32).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from PIL import Image, ImageDraw

from retouch.cache import CacheStore, StoreConfig
from retouch.editor import CACHE_MODES, load
from retouch.image_metrics import psnr, ssim
from retouch.masks import centred_token_rectangle, pixel_mask_of_tokens
from retouch.progress import bar


def template_image(size: int) -> Image.Image:
    image = Image.new("RGB", (size, size))
    draw = ImageDraw.Draw(image)
    for y in range(size):
        draw.line([(0, y), (size, y)], fill=(70 + y * 90 // size, 130 + y * 60 // size, 230))
    draw.ellipse([size * 5 // 8, size // 8, size * 7 // 8, size * 3 // 8], fill=(255, 214, 90))
    draw.rectangle([0, size * 3 // 4, size, size], fill=(60, 140, 70))
    return image


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="retouch bench fidelity", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-flux-fill")
    parser.add_argument("--mask-ratios", dest="ratios", default="0.1,0.2,0.3")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", type=int, default=128, help="template side in pixels")
    parser.add_argument("--cache-dtypes", default="auto", help="storage dtypes of the cache, comma-separated")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)

    template = template_image(args.size)
    grid = (args.size // 16, args.size // 16)
    results = []
    settings = [(m, d) for m in CACHE_MODES for d in args.cache_dtypes.split(",")]
    ratios = [float(r) for r in args.ratios.split(",")]
    points = bar(desc="fidelity: mask-aware vs full compute", total=len(settings) * len(ratios), unit="point")
    for mode, cache_dtype in settings:
        editor = load(args.model, cache_mode=mode, cache=CacheStore(StoreConfig(host_bytes=1 << 30, dtype=cache_dtype)))
        template_id = editor.register_template(template, prompt="a sunny landscape", steps=args.steps, seed=0)
        for ratio in ratios:
            tokens = centred_token_rectangle(grid, ratio)
            mask = pixel_mask_of_tokens(tokens, grid, 16)
            edited = np.asarray(editor.edit(template_id, mask, "a red hot-air balloon", seed=7))
            full = np.asarray(editor.edit(template_id, mask, "a red hot-air balloon", seed=7, full_compute=True))
            inside = np.asarray(mask) > 127
            results.append({
                "mask_ratio": round(len(tokens) / (grid[0] * grid[1]), 4), "mode": f"{mode}-cache",
                "cache_dtype": cache_dtype, "cache_bytes": editor.cache.nbytes(template_id),
                "psnr_db": round(psnr(edited, full), 2), "ssim": round(ssim(edited, full), 4),
                "psnr_masked_db": round(psnr(edited[inside], full[inside]), 2),
                "unmasked_equal_template": bool(np.array_equal(edited[~inside], np.asarray(template)[~inside])),
            })
            points.set_postfix_str(f"{mode}-cache {cache_dtype} m={results[-1]['mask_ratio']}: "
                                   f"{results[-1]['psnr_db']} dB", refresh=False)
            points.update()
        editor.adapter.unpatch()
    points.close()
    report = {"bench": "fidelity", "command": "retouch bench fidelity " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": args.model, "steps": args.steps, "size": args.size,
              "note": "random weights: consistency with full compute, not image quality", "results": results}
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
