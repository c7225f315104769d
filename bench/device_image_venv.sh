#!/usr/bin/env bash
# A virtual environment here with the package versions of the lent GPU machines' image (Python 3.12,
# torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0, huggingface-hub 1.33.0, numpy 2.5.2; see
# /work/.library/device/KINDS.md) plus the .whl/ wheels run_gpu.sh carries there, and a build of
# retouch._C with CUDA against that torch. Running the suite in it on this CPU finds what the device
# image breaks before a session spends device time on it. Its first run found: fastapi's missing
# opentelemetry-api (now in fetch_gpu_wheels.sh); torch 2.11's inductor failing on size-oblivious traces
# (retouch.adapters.base.SIZE_OBLIVIOUS); a planner hang that only a newer hypothesis reached. Expected
# to fail there, and only there: the tests of the Triton kernels under TRITON_INTERPRET=1 (triton 3.6's
# interpreter cannot loop over a range whose bounds are runtime values; on the GPU the kernels compile), and
# tests/test_openai_sdk.py, skipped there (the SDK is not carried). Its second run (stop 41) found
# standardwebhooks missing from the carried wheels: every serving test, and `retouch serve`, failed to import.
#
#   bench/device_image_venv.sh [VENV]          # default /tmp/retouch-device-venv; downloads ~3 GB once
#   VENV/bin/python -m pytest -q tests         # in a clone of its own: the build writes python/retouch/_C*.so
#
# Not for CI: it needs PyPI's CUDA wheels of torch, and about 25 minutes for the suite on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-/tmp/retouch-device-venv}
# Asked for its own path: pyenv's python3.12 shim is on PATH even where 3.12 is not an active version.
PYTHON312=${PYTHON312:-$(python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null ||
                         echo "$HOME/.pyenv/versions/3.12.1/bin/python")}

# The image's versions (KINDS.md, "pip list, as a session saw it"), and what it has unversioned there.
IMAGE=(
  torch==2.11.0 triton==3.6.0 transformers==5.17.0 huggingface_hub==1.33.0 numpy==2.5.2 tokenizers==0.23.2
  accelerate==1.15.0 safetensors==0.8.0
  peft pillow msgpack httpx matplotlib tqdm pyyaml psutil prometheus-client hypothesis pytest pybind11 ninja
  setuptools wheel requests regex
)
[ -x "$VENV/bin/python" ] || "$PYTHON312" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "${IMAGE[@]}"
bash bench/fetch_gpu_wheels.sh  # always: an older .whl/ may lack a package added since (pip keeps what is there)
"$VENV/bin/python" -m pip install -q --no-deps .whl/*.whl

# As run_gpu.sh builds it there, for the H100/H200's sm_90 (no GPU is needed to compile).
include=$("$VENV/bin/python" -c "import nvidia, os; print(os.path.join(nvidia.__path__[0], 'cu13', 'include'))")
CPATH=$include${CPATH:+:$CPATH} TORCH_CUDA_ARCH_LIST=9.0 RETOUCH_CUDA=1 MAX_JOBS=${MAX_JOBS:-2} \
  "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps -e .
"$VENV/bin/python" -c "import torch, retouch._C as c; print('torch', torch.__version__, 'retouch._C with CUDA:', c.built_with_cuda())"
