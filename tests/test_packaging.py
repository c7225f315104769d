"""A built wheel (what `pip install .` installs) holds the mapped packages and the extension."""

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_maps_engine_and_kernels_into_the_package(tmp_path):
    # --no-build-isolation: build against this venv's torch (an isolated build installs torch==2.13.0
    # from pyproject.toml's build requirements first, which is slower but produces the same layout).
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(tmp_path),
         str(REPO)],
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = tmp_path.glob("retouch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ["retouch/__init__.py", "retouch/cli.py", "retouch/ops.py", "retouch/models/__init__.py",
                   "retouch/engine/__init__.py", "retouch/kernels/__init__.py", "retouch/kernels/reference.py",
                   "retouch/kernels/ragged_attention.py", "retouch/bench/__init__.py", "retouch/bench/step.py"]:
        assert module in names, module
    assert any(name.startswith("retouch/_C") and name.endswith(".so") for name in names)
    assert not any(name.startswith(("engine/", "kernels/", "bench/", "python/")) for name in names)
    entry_points = next(name for name in names if name.endswith("entry_points.txt"))
    assert "retouch = retouch.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_submodules_are_attributes_after_a_plain_import():
    # `import retouch` stays light (no diffusers), yet retouch.editor, retouch.engine, ... work at once.
    code = ("import sys, retouch; assert 'diffusers' not in sys.modules; "
            "print(retouch.editor.MaskAwareEditor.__name__, retouch.engine.api.Engine.__name__, retouch.canvas.Canvas.__name__); "
            "import pytest\n"
            "with pytest.raises(AttributeError, match='no attribute'): retouch.no_such_module")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["MaskAwareEditor", "Engine", "Canvas"]
