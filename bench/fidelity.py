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
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from retouch.bench.report import MAX_SIDE, environment, mask_ratios, out_path, publish, pyplot
from retouch.cache import CacheStore, StoreConfig
from retouch.cache.layout import STORAGE_DTYPES
from retouch.editor import CACHE_MODES, load
from retouch.errors import COMMON_HELP, ArgumentParser
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
    parser = ArgumentParser(prog="retouch bench fidelity", description=__doc__)
    parser.add_argument("--model", default="tiny-flux-fill")
    parser.add_argument("--mask-ratios", dest="ratios", type=mask_ratios, help=COMMON_HELP["mask_ratios"],
                        default="0.1,0.2,0.3")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", type=int, default=128, help="template side in pixels (a multiple of 16)")
    parser.add_argument("--cache-dtypes", type=cache_dtypes, default="auto",
                        help=f"storage dtypes of the cache, comma-separated: auto, {', '.join(STORAGE_DTYPES)}")
    parser.add_argument("--out", type=out_path, default=None, help="also write the JSON here, and a PNG beside it")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if not 16 <= args.size <= MAX_SIDE or args.size % 16:
        parser.error(f"--size must be a multiple of 16 in [16, {MAX_SIDE}], got {args.size}")

    template = template_image(args.size)
    grid = (args.size // 16, args.size // 16)
    results = []
    settings = [(m, d) for m in CACHE_MODES for d in args.cache_dtypes]
    ratios = args.ratios
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
    report = {**environment("fidelity", argv, "cpu"), "model": args.model, "steps": args.steps, "size": args.size,
              "note": "random weights: consistency with full compute, not image quality", "results": results}
    return publish(report, args.out, plot)


def cache_dtypes(text: str) -> list[str]:
    """argparse `type` of `--cache-dtypes`: comma-separated storage dtypes."""
    names = text.split(",")
    unknown = [name for name in names if name != "auto" and name not in STORAGE_DTYPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown cache dtype {unknown[0]!r}; choose from auto, "
                                         f"{', '.join(STORAGE_DTYPES)}")
    return names


def plot(report: dict, path: Path) -> None:
    """PSNR against full compute over the mask ratio, whole image and masked region, a line per cache
    mode and storage dtype."""
    plt = pyplot()
    if plt is None:
        return
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    series = sorted({(row["mode"], row["cache_dtype"]) for row in report["results"]})
    for axis, key, title in zip(axes, ("psnr_db", "psnr_masked_db"), ("whole image", "masked region")):
        for mode, dtype in series:
            rows = [row for row in report["results"] if (row["mode"], row["cache_dtype"]) == (mode, dtype)]
            axis.plot([row["mask_ratio"] for row in rows], [row[key] for row in rows], marker="o",
                      linestyle="-" if mode == "y-cache" else "--", label=f"{mode}, {dtype}")
        axis.set_title(title)
        axis.set_xlabel("mask ratio")
    axes[0].set_ylabel("PSNR vs full compute (dB)")
    axes[1].legend(fontsize=8)
    figure.suptitle(f"{report['model']}, {report['size']} px, {report['steps']} steps: mask-aware vs full compute "
                    "(random weights)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
