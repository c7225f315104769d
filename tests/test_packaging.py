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


def test_the_cli_and_the_head_import_no_diffusers():
    """`retouch --help`, `retouch keys`, `retouch simulate` and the head's modules (router, HTTP API) load no
    model library: importing diffusers and transformers took 3 of `retouch --help`'s 4.3 s (a limit in the
    options' checks had been imported from `retouch.models.samplers`)."""
    code = ("import sys, retouch.cli, retouch.config, retouch.server, retouch.engine.router, retouch.http_api; "
            "print(sorted(m for m in ('diffusers', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["[]"]


# Requirements the GPU runs (bench/run_gpu.sh) never import, so neither the GPU machines' image nor the
# carried wheels need them.
NOT_NEEDED_ON_THE_GPU = {"openai": "tests/test_openai_sdk.py only, which skips without it",
                         "playwright": "the playground's browser test only", "pytest-xdist": "`make test` only"}


def package_names(words) -> set[str]:
    return {word.split("==")[0].split(">=")[0].strip().lower().replace("_", "-") for word in words if word.strip()}


def shell_array(script: Path, name: str) -> set[str]:
    """The words of bash array NAME=( ... ) in `script`, comments dropped."""
    body = script.read_text().split(f"{name}=(", 1)[1].split("\n)", 1)[0]
    return package_names(word for line in body.splitlines() for word in line.split("#", 1)[0].split())


def test_every_requirement_is_on_the_gpu_machines_or_carried_there():
    """The device image's packages (`device_image_venv.sh`'s IMAGE, from the device tool's KINDS.md) and the
    wheels `fetch_gpu_wheels.sh` carries cover requirements.txt: a package missing there fails the GPU
    session that needs it (standardwebhooks did: every serving import)."""
    required = package_names(line.split("#", 1)[0] for line in (REPO / "requirements.txt").read_text().splitlines())
    image = shell_array(REPO / "bench" / "device_image_venv.sh", "IMAGE")
    carried = shell_array(REPO / "bench" / "fetch_gpu_wheels.sh", "PACKAGES")
    assert {"torch", "standardwebhooks", "diffusers"} <= required and "torch" in image and "diffusers" in carried
    assert required - image - carried - set(NOT_NEEDED_ON_THE_GPU) == set()
