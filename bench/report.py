"""Writing benchmark results: the JSON, and matplotlib for the PNG beside it."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def write_json(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


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
