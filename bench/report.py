"""Writing benchmark results: the JSON, the environment it was measured in, and matplotlib for the PNG;
and the argument types the benchmarks share, so that a bad value fails before any model is built."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from retouch.errors import InputError, ModelError
from retouch.paths import check_writable, check_writable_folder

# Packages whose versions decide a benchmark's figures; a missing one is recorded as None.
_PACKAGES = ("torch", "triton", "diffusers", "transformers", "flash-attn", "numpy")


DTYPE_CHOICES = ("float32", "bfloat16", "float16")
MAX_SIDE = 8192  # pixels: a bigger image is a typo, not a benchmark (512 tokens a side on Flux)


def device_arg(text: str) -> str:
    """argparse `type` of `--device`: cpu, cuda or cuda:N, and a CUDA one only where there is one
    (`retouch.models.loading.checked_device`, what loading a model checks)."""
    from retouch.models.loading import checked_device  # imports diffusers: not for every user of this module

    try:
        checked_device(text)
    except ModelError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def side_pixels(text: str) -> int:
    """argparse `type` of an image side: a whole number of 16 px tokens, at most MAX_SIDE."""
    try:
        side = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of pixels, got {text!r}") from None
    if not 16 <= side <= MAX_SIDE or side % 16:
        raise argparse.ArgumentTypeError(f"must be a multiple of 16 in [16, {MAX_SIDE}], got {side}")
    return side


def positive_float(text: str) -> float:
    """argparse `type` of a rate, a duration or a budget: finite and > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def seed_arg(text: str) -> int:
    """argparse `type` of `--seed`: an integer numpy's generators take (>= 0)."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a seed is a whole number >= 0, got {text!r}") from None
    if seed < 0:
        raise argparse.ArgumentTypeError(f"a seed is a whole number >= 0, got {seed}")
    return seed


def mask_ratio(text: str) -> float:
    """argparse `type` of a single `--mask-ratio` in (0, 1]."""
    ratios = mask_ratios(text)
    if len(ratios) != 1:
        raise argparse.ArgumentTypeError(f"takes one ratio, got {text!r}")
    return ratios[0]


def out_path(text: str) -> Path:
    """argparse `type` of `--out`: checked before the benchmark runs (its folder made, a file created there).
    The JSON's path: the plot goes beside it as .png, so a .png here would be overwritten by the plot."""
    if Path(text).suffix.lower() == ".png":
        raise argparse.ArgumentTypeError(f"{text} is where the JSON goes (its plot is written beside it as .png): "
                                         "give a .json path")
    try:
        return check_writable(text)
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def out_folder(text: str) -> Path:
    """argparse `type` of an `--out` folder: one files can be written in, checked before the run."""
    try:
        return check_writable_folder(text)
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cost_model_arg(text: str) -> Path:
    """argparse `type` of `--cost-model`: a file `CostModel.from_json` reads."""
    from retouch.costs import CostModel

    try:
        CostModel.from_json(text)
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return Path(text)


def mask_ratios(text: str) -> list[float]:
    """argparse `type` of `--mask-ratios`: comma-separated numbers, each in (0, 1]."""
    try:
        ratios = [float(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError("must be comma-separated numbers") from None
    if not all(0 < r <= 1 for r in ratios):
        raise argparse.ArgumentTypeError("mask ratios must lie in (0, 1]")
    return ratios


def json_text(report: dict, indent: int | None = None) -> str:
    """Strict JSON: an infinite or NaN figure (the PSNR of equal images) is null, which every parser reads;
    Python writes `Infinity`, which JavaScript's JSON.parse and jq refuse."""
    return json.dumps(_finite(report), indent=indent, allow_nan=False)


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def write_json(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json_text(report, indent=2) + "\n")


def publish(report: dict, out: Path | None, plot: Callable[[dict, Path], None]) -> dict:
    """A benchmark's ending: its JSON on stdout, and with `out` also in that file with its PNG beside it."""
    if out:
        write_json(report, out)
        plot(report, out.with_suffix(".png"))
    print(json_text(report))
    return report


def environment(bench: str, argv: list[str] | None, device: str | torch.device) -> dict:
    """What a result needs to be reproduced: the exact command, the versions and the device.

    `argv` is the benchmark's own arguments (None: this process's sys.argv[1:])."""
    args = list(argv if argv is not None else sys.argv[1:])
    device = torch.device(device)
    versions = {"python": platform.python_version()}
    for package in _PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    versions["torch"] = torch.__version__  # with its build's tag (+cu130, +cpu), which the wheel's metadata may lack
    versions["cuda"] = torch.version.cuda
    record = {"command": " ".join(["retouch", "bench", bench, *args]), "versions": versions,
              "retouch_commit": _git_commit(), "device": str(device), "device_name": device_name(device),
              "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        record["gpu"] = {"name": properties.name, "memory_gib": round(properties.total_memory / 2**30, 1),
                         "multiprocessors": properties.multi_processor_count,
                         "capability": f"{properties.major}.{properties.minor}"}
    return record


def device_name(device: str | torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores)"


def _git_commit() -> str | None:
    """HEAD of the checkout the benchmark runs from, '+dirty' when it has changes; None outside git."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (said on stderr) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return None
    return plt
