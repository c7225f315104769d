"""`make demo`: one edit of a generated template, with full compute and mask-aware (Y-cache, KV-cache).

    python -m retouch.demo [--out out/demo] [--model flux-demo] [--steps 8] [--device cpu]

Registers the template once (full compute, every block's outputs, keys and values recorded: a KV-cache
recording serves both modes), then times the same edit (prompt, seed, mask) three ways end to end, text
encoders, denoising, VAE and paste-back included, and prints one table: latency, speedup over full
compute, image tokens computed per step, PSNR and SSIM against full compute, and whether every pixel
outside the mask is the template's own. Writes OUT/side_by_side.png and OUT/demo.json, and the
template and mask as OUT/template.png and OUT/mask.png.

The built-in models have random weights: the repainted region is noise, and PSNR/SSIM measure how
closely mask-aware inference follows full compute, not image quality.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from retouch.bench.report import device_arg, out_folder
from retouch.config import resolve_device
from retouch.editor import EditRequest, MaskAwareEditor
from retouch.errors import ArgumentParser
from retouch.image_metrics import psnr, ssim
from retouch.masks import FLUX_STRIDE
from retouch.models import get_spec, list_models
from retouch.models.loading import load_for_bench
from retouch.progress import note, pipeline_bar

DEFAULT_MODEL = "flux-demo"
DEFAULT_STEPS = 8
RUNS = 2  # each edit is timed this many times and the fastest kept: the first run of a mode pays warm-up
TEMPLATE_PROMPT = "a sunny landscape with hills"
EDIT_PROMPT = "a red hot-air balloon"
EDIT_SEED = 7
# The mode each row runs in: None is the unmodified pipeline (full compute), the reference.
MODES = {"full compute": None, "Y-cache": "y", "KV-cache": "kv"}
REFERENCE = "full compute"
# The sun and the sky around it, in 32nds of the side (left, top, right, bottom), snapped to 16-px tokens:
# 14 x 15 of the 32 x 32 tokens at 512 px, 20.5% of the image.
MASK_BOX = (17, 1, 31, 16)
DIFFERENCE_GAIN = 32  # |full - Y-cache| is 1-3 grey levels at most masked pixels with flux-demo: amplified to be seen


def template_image(size: int) -> Image.Image:
    """A sky gradient, a sun and green hills, drawn at `size` x `size`."""
    image = Image.new("RGB", (size, size))
    draw = ImageDraw.Draw(image)
    for y in range(size):
        draw.line([(0, y), (size, y)], fill=(70 + 64 * y // size, 130 + 43 * y // size, 230))

    def scaled(points):  # drawn on a 128-px grid
        return [(x * size // 128, y * size // 128) for x, y in points]

    draw.ellipse(scaled([(78, 14), (110, 46)]), fill=(255, 214, 90))
    draw.polygon(scaled([(0, 96), (40, 70), (84, 92), (128, 74), (128, 128), (0, 128)]), fill=(60, 140, 70))
    return image


def sun_mask(size: int) -> Image.Image:
    """White (repaint) over the sun and the sky around it, on whole tokens; black elsewhere."""
    tokens = size // FLUX_STRIDE
    left, top, right, bottom = (round(edge * tokens / 32) * FLUX_STRIDE for edge in MASK_BOX)
    mask = Image.new("L", (size, size), 0)
    ImageDraw.Draw(mask).rectangle([left, top, right - 1, bottom - 1], fill=255)
    return mask


def time_edits(editor: MaskAwareEditor, request: EditRequest, runs: int) -> tuple[dict, dict]:
    """The edit in every mode of MODES, `runs` times with the modes interleaved (a machine that slows
    down mid-way slows all of them alike). Returns ({mode: fastest seconds}, {mode: image [H, W, 3]})."""
    seconds = {label: float("inf") for label in MODES}
    images = {}
    for run in range(1, runs + 1):
        for label, cache_mode in MODES.items():
            if cache_mode is not None:
                editor.switch_cache_mode(cache_mode)
            with pipeline_bar(editor.pipe, f"edit, {label}, run {run}/{runs}"):
                started = time.perf_counter()
                image = editor.edit_many([request], full_compute=cache_mode is None)[0]
                seconds[label] = min(seconds[label], time.perf_counter() - started)
            images[label] = np.asarray(image)
    return seconds, images


def compare(seconds: dict, images: dict, template: np.ndarray, inside: np.ndarray, computed: int,
            total: int) -> list[dict]:
    """One row per mode: latency, speedup, tokens, fidelity to full compute, unmasked pixels kept.
    `template`: [H, W, 3] uint8; `inside`: [H, W] bool, the pixels the mask repaints."""
    reference = images[REFERENCE]
    rows = []
    for label, image in images.items():
        is_reference = label == REFERENCE
        rows.append({
            "mode": label,
            "latency_s": round(seconds[label], 3),
            "speedup": round(seconds[REFERENCE] / seconds[label], 2),
            "image_tokens_computed": total if is_reference else computed,
            "image_tokens": total,
            "psnr_db": None if is_reference else round(psnr(image, reference), 2),
            "psnr_masked_db": None if is_reference else round(psnr(image[inside], reference[inside]), 2),
            "ssim": None if is_reference else round(ssim(image, reference), 4),
            "unmasked_identical": bool(np.array_equal(image[~inside], template[~inside])),
        })
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows as plain aligned text: the mode left, numbers right."""
    header = ("mode", "latency s", "speedup", "image tokens computed", "PSNR dB", "SSIM", "unmasked pixels identical")
    cells = [header] + [(
        row["mode"], f"{row['latency_s']:.2f}", f"{row['speedup']:.2f}x",
        f"{row['image_tokens_computed']}/{row['image_tokens']}",
        "-" if row["psnr_db"] is None else f"{row['psnr_db']:.2f}",
        "-" if row["ssim"] is None else f"{row['ssim']:.4f}",
        "yes" if row["unmasked_identical"] else "NO") for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    lines = []
    for line in cells:
        first, *numbers, last = line
        lines.append("  ".join([first.ljust(widths[0]), *(cell.rjust(w) for cell, w in zip(numbers, widths[1:-1])),
                                last]))
    return "\n".join(lines)


def side_by_side(panels: list[tuple[str, Image.Image]], path: Path) -> None:
    """The panels (one size) in a row, each under a small label."""
    width, height = panels[0][1].size
    font_size = max(10, width // 32)
    font = ImageFont.load_default(size=font_size)
    label_height = font_size + 8
    sheet = Image.new("RGB", (width * len(panels), height + label_height), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (label, image) in enumerate(panels):
        sheet.paste(image.convert("RGB"), (i * width, label_height))
        draw.text((i * width + 4, 4), label, fill="black", font=font)
    sheet.save(path, optimize=True)


def demo_panels(template: Image.Image, mask: Image.Image, images: dict) -> list[tuple[str, Image.Image]]:
    """Template, mask, full compute, Y-cache and their amplified difference, labelled."""
    full, masked = images[REFERENCE], images["Y-cache"]
    difference = np.abs(full.astype(np.int16) - masked.astype(np.int16)) * DIFFERENCE_GAIN
    ratio = float(np.mean(np.asarray(mask) > 0))
    return [("template", template), (f"mask ({ratio:.1%})", mask), ("full compute", Image.fromarray(full)),
            ("mask-aware (Y-cache)", Image.fromarray(masked)),
            (f"|full - Y-cache| x{DIFFERENCE_GAIN}", Image.fromarray(np.clip(difference, 0, 255).astype(np.uint8)))]


def demo_device(text: str) -> str:
    """argparse `type` of `--device`: auto, or what the benchmarks take (a CUDA one only where there is one)."""
    return text if text == "auto" else device_arg(text)


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m retouch.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=out_folder, default=Path("out/demo"),
                        help="folder for side_by_side.png, demo.json")
    parser.add_argument("--model", choices=[spec.name for spec in list_models()], default=DEFAULT_MODEL,
                        metavar="MODEL", help=f"a built-in model (default {DEFAULT_MODEL}; see `retouch models`)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--size", type=int, default=None,
                        help="pixels per side, a multiple of 16 (default: the model's)")
    parser.add_argument("--device", type=demo_device, default="cpu", help="cpu, cuda, cuda:N or auto")
    args = parser.parse_args(argv)
    args.size = args.size or get_spec(args.model).resolution
    if args.size % FLUX_STRIDE or args.size < 2 * FLUX_STRIDE:
        parser.error(f"--size must be a multiple of {FLUX_STRIDE} and at least {2 * FLUX_STRIDE}, got {args.size}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the demo; prints the table and returns what OUT/demo.json holds."""
    args = parse_arguments(argv)
    spec, size = get_spec(args.model), args.size
    device, dtype = resolve_device(args.device, "auto")
    note(f"building {spec.name} on {device} with random weights")
    editor = MaskAwareEditor(load_for_bench(spec.name, device, dtype), cache_mode="kv")
    template, mask = template_image(size), sun_mask(size)
    with pipeline_bar(editor.pipe, f"register template ({size}px, {args.steps} steps)"):
        started = time.perf_counter()
        template_id = editor.register_template(template, prompt=TEMPLATE_PROMPT, steps=args.steps, seed=0)
        registration_s = time.perf_counter() - started
    request = EditRequest(template_id, mask, EDIT_PROMPT, seed=EDIT_SEED)
    inputs = editor.prepare_edit(editor.check_request(request))
    computed, total = len(inputs.masked_idx), editor.num_tokens(inputs.template)
    seconds, images = time_edits(editor, request, RUNS)
    editor.cache.close()
    inside = np.asarray(mask) > 0
    rows = compare(seconds, images, np.asarray(template), inside, computed, total)

    args.out.mkdir(parents=True, exist_ok=True)
    picture, numbers = args.out / "side_by_side.png", args.out / "demo.json"
    side_by_side(demo_panels(template, mask, images), picture)
    template.save(args.out / "template.png")  # inputs to try `retouch edit` and the API on
    mask.save(args.out / "mask.png")
    report = {"model": spec.name, "description": spec.description, "size": size, "steps": args.steps,
              "device": str(device), "dtype": str(dtype).removeprefix("torch."),
              "mask_ratio": round(float(inside.mean()), 4), "registration_s": round(registration_s, 3),
              "timing": f"a whole edit, the faster of {RUNS} runs",
              "edit": {"template_prompt": TEMPLATE_PROMPT, "prompt": EDIT_PROMPT, "seed": EDIT_SEED},
              "rows": rows, "side_by_side": str(picture)}
    numbers.write_text(json.dumps(report, indent=2) + "\n")

    print(f"{spec.name}, {size}x{size} ({total} image tokens), {args.steps} steps, {device} {report['dtype']}; "
          f"mask: the sun and the sky around it, {inside.mean():.1%} of the image; "
          f"template registered once in {registration_s:.2f} s\n")
    print(format_table(rows) + "\n")
    print(f"latency: a whole edit (text encoders, {args.steps} denoising steps, VAE, paste-back), the faster of "
          f"{RUNS} runs; PSNR/SSIM: the whole image against full compute (random weights: how closely "
          "mask-aware follows full compute, not image quality)")
    print(f"side by side: {picture} (template, mask, full compute, Y-cache, difference); numbers: {numbers}")
    print(f"model: {spec.name}: {spec.description}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
