"""`make demo`'s program on the tiny model: the table's rows, the PNG and the JSON (no timings asserted)."""

import json

import numpy as np
import pytest
from PIL import Image

from retouch import demo

SIZE = 128  # tiny-flux-fill's own: 8 x 8 tokens, the mask 4 x 4 of them
MODES = ["full compute", "Y-cache", "KV-cache"]


def test_demo_table_png_and_json(tmp_path, capsys):
    report = demo.main(["--model", "tiny-flux-fill", "--steps", "2", "--size", str(SIZE), "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    rows = {row["mode"]: row for row in report["rows"]}
    assert list(rows) == MODES
    table = printed.split("\n\n")[1].splitlines()
    assert table[0].startswith("mode") and [line.split("  ")[0].strip() for line in table[1:]] == MODES

    assert all(row["unmasked_identical"] for row in rows.values())
    assert all(line.endswith("yes") for line in table[1:])
    full = rows["full compute"]
    assert full["speedup"] == 1.0 and full["psnr_db"] is None and full["ssim"] is None
    assert full["image_tokens_computed"] == full["image_tokens"] == (SIZE // 16) ** 2
    masked_tokens = round(report["mask_ratio"] * full["image_tokens"])
    for mode in ("Y-cache", "KV-cache"):
        row = rows[mode]
        assert row["image_tokens_computed"] == masked_tokens < row["image_tokens"]
        assert row["psnr_db"] > 30 and 0.9 < row["ssim"] <= 1.0, row  # follows full compute closely

    with Image.open(tmp_path / "side_by_side.png") as picture:
        assert picture.width == 5 * SIZE and picture.height > SIZE
    assert json.loads((tmp_path / "demo.json").read_text()) == report
    with Image.open(tmp_path / "template.png") as template, Image.open(tmp_path / "mask.png") as mask:
        assert template.size == mask.size and mask.mode == "L"
        assert 0 < (np.asarray(mask) > 0).mean() < 1
    assert str(tmp_path / "side_by_side.png") in printed


def test_mask_covers_the_sun_on_whole_tokens():
    mask = np.asarray(demo.sun_mask(512)) > 0
    assert mask.sum() == 14 * 15 * 16 * 16  # 210 of 1024 tokens, no partial token
    assert mask.reshape(32, 16, 32, 16).any(axis=(1, 3)).sum() == 210
    sun = np.all(np.asarray(demo.template_image(512)) == (255, 214, 90), axis=-1)
    assert sun.any() and mask[sun].all()


@pytest.mark.parametrize("options, named", [(["--device", "gpu"], "--device"), (["--size", "8"], "--size"),
                                            (["--out", "README.md"], "--out"), (["--steps", "0"], "--steps")])
def test_bad_options_are_one_line_naming_the_flag(options, named, capsys):
    """`make demo DEMO_DEVICE=gpu` (or cuda without one, or an --out that is a file) printed a traceback."""
    with pytest.raises(SystemExit) as exit_:
        demo.parse_arguments(options)
    error = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and named in error and len(error.splitlines()) == 1, error
