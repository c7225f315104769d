#!/usr/bin/env bash
# Wheels of the packages retouch needs that the lent GPU machines lack (they have torch, triton,
# transformers, huggingface-hub, msgpack, httpx, matplotlib, ...; see /work/.library/device/KINDS.md),
# for their Python 3.12 on x86-64. Run it here, where pip reaches the registry; bench/run_gpu.sh
# installs .whl/ on the GPU machine (name .whl in the device tool's carry). The versions are ours
# (requirements.txt) so the GPU runs the code CI tests.
set -euo pipefail
cd "$(dirname "$0")/.."
# .whl/ is in .gitignore: wheels are fetched, never committed.
PACKAGES=(
  diffusers==0.42.1 importlib-metadata zipp pyzmq==27.3.0
  fastapi==0.163.2 starlette==1.10.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0
  typing-inspection==0.4.5 uvicorn==0.54.0 python-multipart==0.0.34
  # fastapi imports it at startup (telemetry); the device image lacks it
  opentelemetry-api==1.45.2
  # retouch.webhooks signs with it, and the server, its options and `retouch worker` import that
  standardwebhooks==1.1.0
)
PLATFORMS=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$tag")
done
mkdir -p .whl
for package in "${PACKAGES[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d .whl "$package"
done
du -sh .whl
