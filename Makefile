# Two commands for a newcomer:
#   make demo   create .venv, install retouch, time one edit of a generated template with full compute and
#               mask-aware (Y-cache, KV-cache) on the built-in flux-demo model (CPU, 1-3 minutes)
#   make test   same set-up, then the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.retouch-installed
DEMO_DIR := out/demo
DEMO_MODEL ?= flux-demo
NATIVE_SOURCES := $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*.cu csrc/cuda/*.h)

.PHONY: install demo test cuda clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml setup.py $(NATIVE_SOURCES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
	@echo "building retouch._C (about a minute)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-build-isolation -e .
	touch $@

demo: install
	$(BIN)/python -m retouch.demo --out $(DEMO_DIR) --model $(DEMO_MODEL)

# Test files run in parallel, up to 4 at once (a test file's module fixtures load its models once), each
# process with its share of the cores (tests/conftest.py): about 8 minutes on 2 cores, cold.
test: install
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile

# Compile every .cu file in csrc/ with nvcc for sm_80 and sm_90 (no GPU or CUDA torch needed).
cuda:
	cmake -S . -B build/cuda -DRETOUCH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="80;90"
	cmake --build build/cuda

clean:
	rm -rf build out python/retouch/_C*.so python/*.egg-info
