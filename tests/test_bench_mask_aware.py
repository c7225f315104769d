"""bench/bench_mask_aware.py on the tiny model: the JSON it prints has the promised shape and content."""

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_mask_aware.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_mask_aware", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_centred_rectangle_covers_the_ratio():
    bench = load_bench()
    for ratio in (0.05, 0.2, 0.5, 1.0):
        masked = bench.centred_rectangle((32, 32), ratio)
        assert len(set(masked.tolist())) == len(masked)
        assert abs(len(masked) / 1024 - ratio) < 0.03


def test_bench_reports_all_modes_per_ratio(tmp_path, capsys):
    report = load_bench().main(["--model", "tiny-flux-fill", "--ratios", "0.25,1.0", "--repeats", "1",
                                "--out", str(tmp_path / "r.json")])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    saved = json.loads((tmp_path / "r.json").read_text())
    assert printed["results"] == saved["results"] == report["results"]
    assert [row["masked_tokens"] for row in saved["results"]] == [16, 64]
    for row in saved["results"]:
        for mode in ("y_cache", "kv_cache"):
            assert row[f"{mode}_s"] > 0
            assert abs(row[f"{mode}_speedup"] - row["full_s"] / row[f"{mode}_s"]) < 1e-2 * row[f"{mode}_speedup"]
    assert (tmp_path / "r.png").stat().st_size > 0
