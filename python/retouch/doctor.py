"""`retouch doctor`: what this installation can do, as one JSON object."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys

import retouch

PACKAGES = ["torch", "diffusers", "transformers", "tokenizers", "triton", "numpy", "pillow", "safetensors",
            "pyzmq", "msgpack", "fastapi", "uvicorn", "flash-attn"]


def package_versions() -> dict[str, str | None]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def triton_status(cuda_available: bool) -> dict:
    if importlib.util.find_spec("triton") is None:
        return {"importable": False, "usable": False, "mode": None, "error": "triton is not installed"}
    # A subprocess, because the interpreter mode is chosen from TRITON_INTERPRET when kernels are defined.
    env = dict(os.environ)
    mode = "gpu" if cuda_available else "interpreter"
    if not cuda_available:
        env["TRITON_INTERPRET"] = "1"
    probe = subprocess.run([sys.executable, "-m", "retouch.kernels.probe"], env=env, capture_output=True,
                           text=True, timeout=300)
    usable = probe.returncode == 0 and probe.stdout.strip() == "true"
    error = None if usable else (probe.stderr.strip().splitlines() or ["probe printed false"])[-1]
    return {"importable": True, "usable": usable, "mode": mode, "error": error}


def report() -> dict:
    import torch

    from retouch.ops import extension_info

    cuda_available = torch.cuda.is_available()
    versions = package_versions()
    return {
        "retouch": retouch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": versions,
        "torch_cuda_version": torch.version.cuda,
        "cuda_available": cuda_available,
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "nvcc": shutil.which("nvcc") or shutil.which("nvcc", path="/usr/local/cuda/bin"),
        "triton": triton_status(cuda_available),
        "extension": extension_info(),
        # Optional: detected here and at run time, never required.
        "flash_attn": {"present": importlib.util.find_spec("flash_attn") is not None,
                       "version": versions["flash-attn"]},
    }
