"""Build of retouch: the Python package, and the native extension retouch._C from csrc/.

The package is assembled from three source folders (the design card's layout):
    python/retouch -> retouch
    engine         -> retouch.engine
    kernels        -> retouch.kernels
    bench          -> retouch.bench
setuptools maps them with package_dir; both `pip install .` and `pip install -e .` honour it.

The C++ (CPU) part of retouch._C builds everywhere. The CUDA sources are added when torch has CUDA
and a CUDA toolkit is found; RETOUCH_CUDA=0 skips them, RETOUCH_CUDA=1 makes their absence an error.
RETOUCH_PREBUILT=1 builds nothing and uses the retouch._C already in python/retouch (bench/run_gpu.sh:
one built ahead for the GPU machines' Python and torch, which saves a minute of a lent GPU's time).
"""

import os
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent

# Read by torch.utils.cpp_extension at import time, so it must be set before that import.
if "CUDA_HOME" not in os.environ and Path("/usr/local/cuda/bin/nvcc").exists():
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import torch  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def relative_sources(pattern: str) -> list[str]:
    # setuptools requires source paths relative to setup.py.
    return sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(pattern))


def build_cuda() -> bool:
    requested = os.environ.get("RETOUCH_CUDA", "auto")
    available = torch.version.cuda is not None and CUDA_HOME is not None
    if requested == "1" and not available:
        raise RuntimeError(
            f"RETOUCH_CUDA=1 but torch {torch.__version__} has no CUDA or no CUDA toolkit was found")
    return available and requested != "0"


def native_extension():
    cpu_sources = [s for s in relative_sources("csrc/*.cpp") if not s.endswith("_cuda.cpp")]
    compile_args = {"cxx": ["-O3", "-ffp-contract=off"]}  # kernels round as their references do
    if not build_cuda():
        return CppExtension("retouch._C", cpu_sources, extra_compile_args=compile_args)
    cuda_sources = relative_sources("csrc/*_cuda.cpp") + relative_sources("csrc/**/*.cu")
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        # torch takes the targets from the visible GPUs; with none (a build host, a CUDA torch on a CPU
        # machine) its list would be empty and the build fail: the A100 and H100/H200 generations.
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
    compile_args["cxx"].append("-DRETOUCH_WITH_CUDA")
    compile_args["nvcc"] = ["-O3", "--expt-relaxed-constexpr", "-DRETOUCH_WITH_CUDA"]
    return CUDAExtension("retouch._C", cpu_sources + cuda_sources, extra_compile_args=compile_args)


class BuildNative(BuildExtension):
    """build_ext with one object folder for every kind of build.

    An editable install builds in a fresh temporary folder, so every `pip install -e .` and every
    wheel recompiled all of csrc/ (about a minute). Sharing build/native lets ninja recompile only
    the sources that changed, whichever build runs next. (Two builds at once would share it: run one.)
    """

    def finalize_options(self):
        if self.build_temp is None:  # an explicit --build-temp still wins
            self.build_temp = str(ROOT / "build" / "native")
        super().finalize_options()


PACKAGE_DIRS = {"": "python", "retouch.engine": "engine", "retouch.kernels": "kernels", "retouch.bench": "bench"}


def packages() -> list[str]:
    found = find_packages("python")
    for package, folder in PACKAGE_DIRS.items():
        if package:
            found += [package] + [f"{package}.{sub}" for sub in find_packages(folder)]
    return found


setup(
    packages=packages(),
    package_dir=PACKAGE_DIRS,
    package_data={"retouch.playground": ["*.html", "*.css", "*.js"]},
    ext_modules=[] if os.environ.get("RETOUCH_PREBUILT") == "1" else [native_extension()],
    cmdclass={"build_ext": BuildNative},
)
