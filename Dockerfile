# syntax=docker/dockerfile:1
# The retouch image for a multi-host deployment (deploy/k8s): one image for the head
# (`retouch serve --workers 0`) and the GPU workers (`retouch worker`).
#
#   docker build -t retouch:0.1.0 .
#   docker run --rm --gpus all retouch:0.1.0 doctor
#
# Two stages: the devel image has nvcc to build retouch._C with its CUDA kernels; the runtime image
# gets the finished virtual environment. Both install python3.11 from the same Ubuntu packages, so the
# venv's interpreter link (/opt/retouch/bin/python -> /usr/bin/python3.11) holds in both.
ARG CUDA_VERSION=12.8.1
ARG UBUNTU=ubuntu22.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-dev python3.11-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/retouch && /opt/retouch/bin/python -m pip install --upgrade pip
ENV PATH=/opt/retouch/bin:$PATH
WORKDIR /src

# requirements.txt pins the CPU torch used for development; the image takes the same version built
# for CUDA 12.8, then the rest of the pinned set but the test tools (`serve` and `worker` import none of
# them; playwright alone brings a Node driver).
COPY requirements.txt .
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128 \
 && grep -vE '^(torch|pytest|pytest-xdist|hypothesis|playwright|openai)==' requirements.txt \
    > /tmp/requirements-without-torch.txt \
 && pip install -r /tmp/requirements-without-torch.txt \
 && python -c "import torch; assert torch.version.cuda, 'a CPU torch replaced the CUDA build'"

COPY pyproject.toml setup.py README.md ./
COPY csrc csrc
COPY python python
COPY engine engine
COPY kernels kernels
COPY bench bench
# RETOUCH_CUDA=1: setup.py fails instead of quietly building a CPU-only extension. A100 (sm_80) and
# H100/H200 (sm_90), with sm_90's PTX for GPUs newer than both (the driver compiles it at load);
# CUDA_HOME is read by torch.utils.cpp_extension.
ENV TORCH_CUDA_ARCH_LIST="8.0;9.0+PTX" RETOUCH_CUDA=1 CUDA_HOME=/usr/local/cuda
ARG MAX_JOBS=8
RUN MAX_JOBS=${MAX_JOBS} pip install --no-build-isolation . \
 && cd / && python -c "import torch, retouch._C as c; assert c.built_with_cuda(), 'retouch._C has no CUDA kernels'"

FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU}
ENV DEBIAN_FRONTEND=noninteractive
# gcc and the Python headers stay: Triton compiles its launcher stubs and torch.compile (--compile)
# its C++ wrappers at run time. libcudart, which retouch._C links, comes with the runtime image.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-dev gcc g++ \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/retouch /opt/retouch
# A numeric user, so Kubernetes' runAsNonRoot can verify it.
RUN groupadd --gid 10001 retouch && useradd --uid 10001 --gid 10001 --create-home retouch
USER 10001:10001
WORKDIR /home/retouch
ENV PATH=/opt/retouch/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
    RETOUCH_CACHE_DIR=/home/retouch/.cache/retouch/models
# 8000: HTTP (head), 5555: router (head; workers connect to it), 8001: worker health and metrics.
EXPOSE 8000 5555 8001
ENTRYPOINT ["retouch"]
CMD ["--help"]
