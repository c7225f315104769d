#!/usr/bin/env bash
# Every GPU figure of retouch, in parts that each fit one 10-minute call of a lent GPU machine.
#
#   bench/run_gpu.sh PART...
#   PART: tests headline graphs overlap kernels flux unet throughput serving compile step lora | all
#
#   tests    build retouch._C with CUDA, run the test suite on the GPU (kernels, adapters, engine)
#   headline the GPU issue's first target: flux-size at 1024 px, 28 steps, m = 0.2, cache in pinned host memory,
#            against the stock pipeline eager and compiled: image_latency_flux-size_28_y.json (Y-cache, bf16:
#            ~41 GiB pinned) and image_latency_flux-size_28_kv_fp8.json (KV-cache in float8: ~62 GiB; bf16
#            would need ~124 GiB of the machine's 128)
#   graphs   the headline with retouch's blocks compiled and replayed as CUDA graphs (--cuda-graphs):
#            image_latency_flux-size_28_y_graphs.json, image_latency_flux-size_28_kv_fp8_graphs.json. Eager,
#            the mask-aware step was launch-bound on an H200 (stop 47: a block's latency stayed at ~2.4 ms
#            from m = 0.05 to 0.3, where a full block computes in 3.4 ms)
#   overlap  the copy engine beside compute in the model: overlap_y.json and overlap_kv.json (flux, m = 0.2, every
#            block cached; eager): host cache against the cache in device memory, with the gather kernel on a
#            quarter of the SMs (the default), on every SM, and DMA copies only. Stop 52's headline step took
#            about compute + copy time
#   kernels  gather.json (host->device gather vs one contiguous copy, and beside compute), attention.json
#            (ragged attention vs SDPA/FlexAttention/flash-attn), block_latency.json (one Flux block, Fig. 15 left)
#   flux     cost_flux-size.json (retouch profile), image_latency_flux-size.json (Fig. 15 right, y/kv-cache,
#            cache in pinned host memory, planner on), overlap.json (Fig. 4 left)
#   unet     cost + image_latency for sdxl-size and sd2-size
#   throughput  throughput.json (Fig. 14: images/s vs batch size, retouch vs the diffusers pipeline)
#   serving  serving.json (Fig. 12: mean and p95 latency vs Poisson RPS, retouch vs diffusers static batching)
#   compile  the compile, host-sync and CUDA-graph tests on the GPU; overhead_flux-size.json (host time and ops
#            per forward, eager and compiled, vs the compiled stock model)
#   step     step_compiled.json (one flux-size step, the mask-aware blocks compiled and replayed as CUDA graphs,
#            as `graphs` runs them, vs the stock model eager and compiled; its own part: compiling flux-size
#            twice would not fit beside the compile part), with a profiled call of each variant at m = 0.2:
#            device busy and idle time, and Chrome traces (step_compiled_trace_*.json.gz)
#   lora     the LoRA tests on the GPU (Triton segmented kernel, loader stream and events); lora_flux-small.json
#            (step overhead of 1 and 8 adapters, sync vs async loading of a 280 MiB adapter)
#
# Every speedup is quoted against the stock model eager and under torch.compile, timed in the same run
# (`--baselines eager,compiled`); compiling flux-size adds its compile time (minutes) to the parts that
# time it (kernels' block, flux, unet, throughput, serving), so those fits are estimates until a device
# has run them.
#
# A device session's first call: RETOUCH_GPU_SMOKE=cuda bench/run_gpu.sh all   (every part at the tiny
# sizes on the GPU: what breaks there, in minutes, under bench/results/<device>-smoke/).
#
# Results go to bench/results/<device>/ (RESULTS=dir overrides), with a log per part; each JSON
# records its exact command, the package versions and the device. Where $OUT is set (the device
# tool), the logs and results of every part run are archived there too, as $OUT/<results dir>.tgz
# (Chrome traces apart, in <results dir>-traces.tgz: the tool brings back at most 8 files of 16 MiB).
# DEADLINE_S=N ends the whole run within N seconds: each step gets what is left (pytest and the
# benchmarks are interrupted, the steps after are skipped and reported), so that a call ends before
# the tool's limit with its table printed. Missing packages (diffusers, pyzmq, fastapi, ...) are
# installed from .whl/ when it exists: bench/fetch_gpu_wheels.sh
# fills it on a machine with pip.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PYTHON=${PYTHON:-python3}

if [ $# -eq 0 ]; then
  sed -n "2,$(grep -n "^set -euo" "$0" | cut -d: -f1)p" "$0" | sed "$ d"
  exit 2
fi

SMOKE=${RETOUCH_GPU_SMOKE:-0}
case $SMOKE in
  0 | 1 | cuda) ;;
  *) echo "RETOUCH_GPU_SMOKE is 0 (the figures), cuda (every part at tiny sizes on the GPU) or 1 (the same on the CPU)"
     exit 2 ;;
esac
if [ "$SMOKE" != 1 ]; then
  if [ -d .whl ] && compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  device=$("$PYTHON" -c "import torch; n = torch.cuda.get_device_name(); print(next((w for w in n.lower().split() if w[0] in 'abhl' and w[1:2].isdigit()), n.split()[-1].lower()))")
fi
if [ "$SMOKE" != 0 ]; then
  # The same parts with the tiny models at tiny sizes: on the CPU it proves the glue (tests use it); on
  # a GPU (a device session's first call) it shows what breaks there in a few minutes, before any figure.
  # One UNet: SD2 runs the same adapter and the same glue as SDXL, and each costs the smoke about 10 s.
  FLUX=tiny-flux-fill UNETS=(tiny-sdxl-inpaint)
  QUICK=(--quick) BLOCK=(--repeats 1 --mask-ratios 0.2,1.0) IMAGE=(--steps 2 --repeats 1 --mask-ratios 0.2,0.9)
  PROFILE_FLUX=(--grids 4,6,8 --batch-sizes 1,2 --mask-ratios 0.3,1.0 --load-mib 0.25,1 --repeats 1)
  PROFILE_UNET=(--grids 8,12,16 --batch-sizes 1,2 --mask-ratios 0.3,1.0 --load-mib 0.25,1 --repeats 1)
  OVERLAP=(--steps 2 --repeats 1) THROUGHPUT=(--steps 2 --size 64 --batch-sizes 1 2 --repeats 1)
  SERVING=(--steps 2 --size 64 --rps 2 --requests 4)
  OVERHEAD=(--grid 2 --text-tokens 2 --mask-ratios 0.2 --repeats 1) STEP=(--mask-ratio 0.2 --repeats 1)
  HEADLINE_STEPS=2 HEADLINE=(--repeats 1)
  LORA_MODEL=tiny-flux-fill LORA=(--batch 2 --rank 4 --resolution 64 --repeats 1 --load-rank 8 --engine-resolution 64 --steps 2
    --load-repeats 1)
  # Eager baselines only: the compiled stock model's glue has its own tests and runs in the step part, and
  # each whole-model compile would cost the smoke tens of seconds.
  BASELINES=()
  if [ "$SMOKE" = 1 ]; then
    device=cpu-smoke DEV=cpu
    GRAPHS=(--compile)  # CUDA graphs are captured on CUDA only; the CPU runs the same compiled blocks
  else
    device=$device-smoke DEV=cuda
  fi
else
  DEV=cuda FLUX=flux-size UNETS=(sdxl-size sd2-size)
  # Every speedup against the stock model eager and under torch.compile, timed in the same run.
  QUICK=() BLOCK=() IMAGE=() OVERLAP=() BASELINES=(--baselines eager,compiled)
  THROUGHPUT=(--size 1024 --steps 8 --batch-sizes 1 2 4 8 --repeats 2)
  SERVING=(--size 1024 --steps 8 --max-batch 8 --rps 0.5 1 2 4 --requests 16)
  PROFILE_FLUX=(--grids 16,32,48,64 --batch-sizes 1,2,4 --mask-ratios 0.1,0.3,0.6,1.0 --load-mib 1,16,64,256)
  PROFILE_UNET=(--grids 32,64,96,128 --batch-sizes 1,2,4)
  OVERHEAD=(--compile) STEP=(--mask-ratio 0.1,0.2,0.5) HEADLINE_STEPS=28
  HEADLINE=(--repeats 2 --baselines eager,compiled)
  LORA_MODEL=flux-small LORA=(--resolution 512 --engine-resolution 1024 --steps 28)
fi
[ -n "${GRAPHS+set}" ] || GRAPHS=(--cuda-graphs)
RESULTS=${RESULTS:-bench/results/$device}
mkdir -p "$RESULTS"
export RETOUCH_CACHE_DIR=${RETOUCH_CACHE_DIR:-/tmp/retouch-models}

built() {  # retouch imports, with a retouch._C built with CUDA
  "$PYTHON" -c "import retouch._C as c, sys; sys.exit(0 if c.built_with_cuda() else 1)" 2>/dev/null
}

build() {
  if [ "$DEV" = cpu ] || built; then
    return
  fi
  # An extension built ahead for this Python and torch (carried with the call) saves the build's minute.
  local prebuilt
  prebuilt=python/retouch/_C.$("$PYTHON" -c "import sysconfig; print(sysconfig.get_config_var('SOABI'))").so
  if [ -f "$prebuilt" ]; then
    echo "== installing retouch with the prebuilt $prebuilt"
    RETOUCH_PREBUILT=1 "$PYTHON" -m pip install -q --no-build-isolation --no-deps --no-index -e . && built && return
    echo "== the prebuilt extension does not load here: building it"
  fi
  echo "== building retouch._C with CUDA ($(nproc) jobs)"
  MAX_JOBS=$(nproc) RETOUCH_CUDA=1 "$PYTHON" -m pip install -q --no-build-isolation --no-deps --no-index -e .
}

archive() {  # every part's log and results so far, as $OUT/DIR.tgz and $OUT/DIR-traces.tgz (see the loop below)
  [ -n "${OUT:-}" ] || return 0
  local name
  name=$(basename "$RESULTS")
  find "$RESULTS" -maxdepth 1 -newer "$STARTED" \( -name '*.json' -o -name '*.png' -o -name '*.log' \) -printf '%f\n' |
    sort | tar -czf "$OUT/$name.tgz" -C "$RESULTS" -T -
  find "$RESULTS" -maxdepth 1 -newer "$STARTED" -name '*.json.gz' -printf '%f\n' | sort >"$STARTED.traces"
  if [ -s "$STARTED.traces" ]; then
    tar -czf "$OUT/$name-traces.tgz" -C "$RESULTS" -T "$STARTED.traces"
  fi
}

left() {  # seconds left before DEADLINE_S (a day where none is set)
  echo $((DEADLINE - SECONDS))
}

limited() {  # limited [--at-most N] COMMAND...: COMMAND, interrupted (SIGINT, then killed) at the deadline
  local seconds
  seconds=$(left)
  if [ "$seconds" -lt 5 ]; then
    [ "$1" = --at-most ] && shift 2
    echo "== SKIPPED (deadline): $*" >&2
    return 125
  fi
  if [ "$1" = --at-most ]; then
    [ "$2" -ge "$seconds" ] || seconds=$2
    shift 2
  fi
  timeout --signal=INT --kill-after=20 "$seconds" "$@"
}

step_failed() {  # step_failed WHAT STATUS: a step of the running part failed; the part goes on with its next steps
  echo "== FAILED (exit $2): $1"
  echo "$1" >>"$RESULTS/.failed-$part"
}

pytest_gpu() {  # pytest_gpu FILE...: pytest on the GPU, every test (first contact wants the whole table)
  # A hung test (a stream waiting on an event that never fires) must not take the call's 10 minutes: after
  # PYTEST_LIMIT seconds pytest gets SIGINT and still prints what passed and failed.
  limited --at-most "${PYTEST_LIMIT:-300}" "$PYTHON" -m pytest -q -rfE -p no:cacheprovider --maxfail=30 "$@" ||
    step_failed "pytest $*" $?
  archive
}

bench() {  # bench NAME OUTFILE ARGS...: one benchmark, its JSON and PNG under $RESULTS
  local name=$1 out=$RESULTS/$2
  shift 2
  echo "== retouch bench $name $* --out $out"
  limited "$PYTHON" -m "retouch.bench.$name" "$@" --out "$out" >/dev/null || step_failed "bench $name" $?
  archive
}

profile() {  # profile MODEL ARGS...: the planner's cost models for MODEL on this device
  local model=$1
  shift
  echo "== retouch profile --model $model $*"
  limited "$PYTHON" -m retouch.cli profile --model "$model" --device "$DEV" "$@" --out "$RESULTS/cost_$model.json" ||
    step_failed "profile $model" $?
  archive
}

part_tests() {
  pytest_gpu tests/test_row_copy.py tests/test_row_copy_triton.py tests/test_host_gather.py \
    tests/test_host_arena.py tests/test_ragged_attention.py tests/test_ops.py tests/test_adapter_flux.py \
    tests/test_adapter_unet.py tests/test_adapter_sd3.py tests/test_attention_dispatch.py tests/test_cache_store.py \
    tests/test_editor_cache.py tests/test_host_tables.py tests/test_staging.py tests/test_fp8_decode.py
}

# shellcheck disable=SC2046
part_headline() {
  local steps=$HEADLINE_STEPS
  bench image "image_latency_${FLUX}_${steps}_y.json" --model "$FLUX" --device "$DEV" --steps "$steps" \
    --mask-ratios 0.2 --modes y $(planner "$FLUX") "${HEADLINE[@]}"
  bench image "image_latency_${FLUX}_${steps}_kv_fp8.json" --model "$FLUX" --device "$DEV" --steps "$steps" \
    --mask-ratios 0.2 --modes kv --cache-dtype float8_e4m3fn $(planner "$FLUX") "${HEADLINE[@]}"
}

# shellcheck disable=SC2046
part_graphs() {
  local steps=$HEADLINE_STEPS
  bench image "image_latency_${FLUX}_${steps}_y_graphs.json" --model "$FLUX" --device "$DEV" --steps "$steps" \
    --mask-ratios 0.2 --modes y "${GRAPHS[@]}" $(planner "$FLUX") "${HEADLINE[@]}"
  bench image "image_latency_${FLUX}_${steps}_kv_fp8_graphs.json" --model "$FLUX" --device "$DEV" --steps "$steps" \
    --mask-ratios 0.2 --modes kv --cache-dtype float8_e4m3fn "${GRAPHS[@]}" $(planner "$FLUX") "${HEADLINE[@]}"
}

part_overlap() {
  local mode
  for mode in y kv; do
    bench overlap "overlap_$mode.json" --model "$FLUX" --device "$DEV" --mask-ratio 0.2 --cache-mode "$mode" \
      "${OVERLAP[@]}"
  done
}

part_kernels() {
  # The gather first: its overlap figure (bench copy's overlap_*) says whether the copies hold compute back.
  bench copy gather.json --device "$DEV" "${QUICK[@]}"
  bench attention attention.json --device "$DEV" "${QUICK[@]}"
  bench block block_latency.json --model "$FLUX" --device "$DEV" "${BLOCK[@]}" "${BASELINES[@]}"
}

planner() {  # the planner's cost model for MODEL when a profile has written one (else: every block cached)
  [ -f "$RESULTS/cost_$1.json" ] && echo "--cost-model $RESULTS/cost_$1.json"
  return 0
}

# shellcheck disable=SC2046
part_flux() {
  profile "$FLUX" "${PROFILE_FLUX[@]}"
  bench image "image_latency_$FLUX.json" --model "$FLUX" --device "$DEV" $(planner "$FLUX") "${IMAGE[@]}" \
    "${BASELINES[@]}"
  bench overlap overlap.json --model "$FLUX" --device "$DEV" --mask-ratio 0.2 $(planner "$FLUX") "${OVERLAP[@]}" \
    "${BASELINES[@]}"
}

# shellcheck disable=SC2046
part_unet() {
  local model
  for model in "${UNETS[@]}"; do
    profile "$model" "${PROFILE_UNET[@]}"
    bench image "image_latency_$model.json" --model "$model" --device "$DEV" $(planner "$model") "${IMAGE[@]}" \
      "${BASELINES[@]}"
  done
}

part_throughput() {
  # shellcheck disable=SC2046
  bench throughput throughput.json --model "$FLUX" --device "$DEV" $(planner "$FLUX") "${THROUGHPUT[@]}" \
    "${BASELINES[@]}"
}

part_serving() {
  # shellcheck disable=SC2046
  bench serving serving.json --model "$FLUX" --device "$DEV" $(planner "$FLUX") "${SERVING[@]}" "${BASELINES[@]}"
}

part_compile() {
  if [ "$DEV" = cuda ]; then
    pytest_gpu tests/test_compile.py tests/test_host_syncs.py tests/test_block_ops.py \
      tests/test_token_padding.py
  fi
  # The narrow model (flux-size depth, tiny width) in both modes: host time is what it measures.
  bench overhead overhead_flux-size.json --model flux-size --device "$DEV" "${OVERHEAD[@]}"
}

part_step() {
  bench step step_compiled.json --model "$FLUX" --device "$DEV" "${GRAPHS[@]}" --trace "${STEP[@]}"
}

part_lora() {
  if [ "$DEV" = cuda ]; then
    pytest_gpu tests/test_lora_batching.py tests/test_lora_engine.py tests/test_lora_files.py tests/test_lora_host_memory.py \
      tests/test_lora_raw_file.py tests/test_lora_text_encoders.py
  fi
  bench lora "lora_$LORA_MODEL.json" --model "$LORA_MODEL" --device "$DEV" "${LORA[@]}"
}

ALL_PARTS=(tests headline graphs overlap kernels flux unet throughput serving compile step lora)
parts=("$@")
[ "${parts[*]}" = all ] && parts=("${ALL_PARTS[@]}")
for part in "${parts[@]}"; do
  declare -F "part_$part" >/dev/null || {
    echo "unknown part $part (${ALL_PARTS[*]} all)"
    exit 2
  }
done
DEADLINE=$((SECONDS + ${DEADLINE_S:-86400}))
STARTED=$RESULTS/.started
touch "$STARTED"
build
failed=()
summary=()
for part in "${parts[@]}"; do
  log=$RESULTS/$part.log
  echo "== part $part -> $log"
  started=$SECONDS
  status=0
  rm -f "$RESULTS/.failed-$part"
  # A part runs every step even after one fails (each step's figures stand alone); any failed step fails it.
  ( set -o pipefail; "part_$part" 2>&1 | tee "$log" ) || status=$?
  if [ "$status" -eq 0 ] && [ -s "$RESULTS/.failed-$part" ]; then
    status=1
  fi
  rm -f "$RESULTS/.failed-$part"
  echo "== part $part took $((SECONDS - started)) s, exit $status" | tee -a "$log"
  verdict=ok
  [ "$status" -eq 0 ] || { failed+=("$part"); verdict=FAILED; }
  summary+=("$(printf '%-10s %5d s  %s' "$part" $((SECONDS - started)) "$verdict")")
  # The device tool returns at most 8 files from $OUT: one archive of every part's log and results (and one
  # of the traces), rewritten after each step, so that a part stopped at the tool's time limit still brings
  # back what it finished.
  archive
done
rm -f "$STARTED" "$STARTED.traces"
echo "== summary"
printf '%s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed parts: ${failed[*]}"
  exit 1
fi
