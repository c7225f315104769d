"""Inputs for `make demo`: a generated 128x128 template (sky, sun, hills) and a mask over the sun.

    python -m retouch.demo DIR   ->  DIR/template.png, DIR/mask.png
"""

import sys
from pathlib import Path

from PIL import Image, ImageDraw

SIZE = 128


def make_demo_inputs(directory: Path) -> tuple[Path, Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    template = Image.new("RGB", (SIZE, SIZE))
    draw = ImageDraw.Draw(template)
    for y in range(SIZE):  # sky gradient
        draw.line([(0, y), (SIZE, y)], fill=(70 + y // 2, 130 + y // 3, 230))
    draw.ellipse([78, 14, 110, 46], fill=(255, 214, 90))
    draw.polygon([(0, 96), (40, 70), (84, 92), (128, 74), (128, 128), (0, 128)], fill=(60, 140, 70))

    mask = Image.new("L", (SIZE, SIZE), 0)  # white = repaint
    ImageDraw.Draw(mask).rectangle([70, 6, 118, 54], fill=255)

    template_path, mask_path = directory / "template.png", directory / "mask.png"
    template.save(template_path)
    mask.save(mask_path)
    return template_path, mask_path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m retouch.demo DIR")
    for path in make_demo_inputs(Path(sys.argv[1])):
        print(f"wrote {path}")
