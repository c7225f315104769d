"""Writing benchmark results: the JSON, the environment it was measured in, and matplotlib for the PNG;
and the `--mask-ratios` argument the benchmarks share."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

# Packages whose versions decide a benchmark's figures; a missing one is recorded as None.
_PACKAGES = ("torch", "triton", "diffusers", "transformers", "flash-attn", "numpy")


def mask_ratios(text: str) -> list[float]:
    """argparse `type` of `--mask-ratios`: comma-separated numbers, each in (0, 1]."""
    try:
        ratios = [float(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError("must be comma-separated numbers") from None
    if not all(0 < r <= 1 for r in ratios):
        raise argparse.ArgumentTypeError("mask ratios must lie in (0, 1]")
    return ratios


def write_json(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


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
