#!/usr/bin/env bash
# One-command GPU check for a CUDA machine (written for one H200): builds zinf with the CUDA
# backends for sm_90, runs the GPU tests, measures host<->GPU and NVMe->GPU bandwidth, runs
# the engine bench, zinf-train (the model on the GPU) and the Python package's GPU tests (with
# a CUDA torch) when it can, and writes logs plus a markdown summary.
#
#   bench/gpu_check.sh                     # results under ./gpu-results
#   OUT=/some/dir NVME_DIR=/mnt/nvme bench/gpu_check.sh
#
# A bare CUDA image lacks zinf's Debian dependencies (liburing, libaio, hwloc, oneTBB, xxhash,
# GoogleTest, CLI11, nlohmann-json) and cannot fetch them. bench/gpu_bundle.sh, run on a
# machine that has them, puts prebuilt sm_90 binaries and their libraries in ./gpu-bundle;
# when that folder is here this script runs those instead of building (ZINF_GPU_BUNDLE=off
# forces the source build), with the machine's own NCCL.
#
# Environment: OUT (results folder, default ./gpu-results), BUILD_DIR (default build-gpu),
# NVME_DIR (folder for the NVMe->GPU measurement; default a folder under OUT, which measures
# whatever disk OUT is on), BENCH_MIB (bytes per copy, default 1024), JOBS (default: all
# cores), CUDA_ARCH (default 90), GPU_CHECK_SECONDS (the overall budget, default 450).
#
# Honest by construction: one overall budget (every stage's timeout is cut to what is left of
# it, and the whole script runs under a backstop timeout), so it ends within 8 minutes; a
# failing stage is recorded and the script goes on. A stage that is skipped, a GPU test that
# skips, a missing binary, a trainer run on the GPU whose loss is not finite, not falling or
# not tracking the host run, NVMe figures measured without direct I/O or on a RAM disk, and a
# bundle built from other sources than this tree all count as failures. The summary names the
# libraries taken from the machine (NCCL, cuBLAS, cuDNN, the CUDA runtime) and their versions.
# Exit status: 0 only when every stage passed; 1 otherwise (always, on a machine without a
# usable GPU).
set -euo pipefail

BUDGET_S="${GPU_CHECK_SECONDS:-450}"
if [[ -z "${ZINF_GPU_CHECK_INNER:-}" ]]; then
  # The backstop: the stages' own limits end the script well before this.
  export ZINF_GPU_CHECK_INNER=1
  exec timeout --kill-after=10 "$((BUDGET_S + 20))" "$0" "$@"
fi
DEADLINE_S=$(($(date +%s) + BUDGET_S))

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-./gpu-results}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build-gpu}"
JOBS="${JOBS:-$(nproc)}"
CUDA_ARCH="${CUDA_ARCH:-90}"
BENCH_MIB="${BENCH_MIB:-1024}"
NVME_DIR="${NVME_DIR:-$OUT/nvme-scratch}"
SUMMARY="$OUT/summary.md"
# Nothing from an earlier run may pass for this one's.
rm -f "$OUT"/*.log "$SUMMARY" "$OUT/libraries.txt"

declare -a STAGE_NAMES=() STAGE_RESULTS=() STAGE_SECONDS=() STAGE_NOTES=()
FAILED=0

# run_stage NAME TIMEOUT_S COMMAND... : runs the command with a timeout, output to
# $OUT/NAME.log; records passed / FAILED (rc) / TIMED OUT in the summary; never exits.
run_stage() {
  local name="$1" limit="$2"
  shift 2
  local log="$OUT/$name.log" start rc=0
  start=$(date +%s)
  # What is left of the overall budget, less the kill grace and the summary's few seconds.
  local left=$((DEADLINE_S - start - 10))
  if ((left < 5)); then
    echo "== $name not run: the overall budget of ${BUDGET_S}s is spent" >&2
    record_stage "$name" "NOT RUN (budget spent)" 0 "${STAGE_NOTE:-}"
    FAILED=1
    STAGE_NOTE=""
    return 0
  fi
  ((limit > left)) && limit=$left
  echo "== $name (timeout ${limit}s) -> $log" >&2
  timeout --kill-after=5 "$limit" "$@" >"$log" 2>&1 || rc=$?
  local seconds=$(($(date +%s) - start)) result
  if [[ $rc -eq 0 ]]; then
    result="passed"
  elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
    result="TIMED OUT"
    FAILED=1
  else
    result="FAILED (exit $rc)"
    FAILED=1
  fi
  echo "   $result in ${seconds}s" >&2
  record_stage "$name" "$result" "$seconds" "${STAGE_NOTE:-}"
  STAGE_NOTE=""
  return 0
}

record_stage() {
  STAGE_NAMES+=("$1")
  STAGE_RESULTS+=("$2")
  STAGE_SECONDS+=("$3")
  STAGE_NOTES+=("$4")
}

# A stage that does not run checks nothing: it is a failure, with the reason.
skip_stage() {
  echo "== $1 SKIPPED (a failure): $2" >&2
  record_stage "$1" "SKIPPED (counts as failed)" 0 "$2"
  FAILED=1
}

# The last stage ran but what it showed is wrong: it fails, with the reason.
fail_last_stage() {
  local i=$((${#STAGE_NAMES[@]} - 1))
  echo "   ${STAGE_NAMES[$i]}: FAILED: $1" >&2
  STAGE_RESULTS[i]="FAILED (check)"
  STAGE_NOTES[i]="${STAGE_NOTES[$i]}; $1"
  FAILED=1
}

stage_passed() {
  local i
  for i in "${!STAGE_NAMES[@]}"; do
    [[ "${STAGE_NAMES[$i]}" == "$1" && "${STAGE_RESULTS[$i]}" == "passed" ]] && return 0
  done
  return 1
}

# ---- Environment ------------------------------------------------------------------------------
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(hostname)"
  timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
    --format=csv 2>&1 || echo "nvidia-smi failed"
  timeout 20 nvidia-smi topo -m 2>&1 || true
  nvcc --version 2>&1 | tail -n 2 || echo "nvcc not on PATH"
  lscpu 2>&1 | grep -E 'Model name|^CPU\(s\)|NUMA node\(s\)' || true
  df -h "$OUT" 2>&1 | tail -n 1 || true
} >"$OUT/environment.log" 2>&1 || true

# ---- Build (or the prebuilt bundle) -----------------------------------------------------------
BUNDLE="$ROOT/gpu-bundle"
USE_BUNDLE=0
if [[ -d "$BUNDLE/bin" && "${ZINF_GPU_BUNDLE:-auto}" != "off" ]]; then
  USE_BUNDLE=1
  # Built from exactly these sources, or refused (its results would describe other code).
  want="$(cat "$BUNDLE/fingerprint" 2>/dev/null || echo none)"
  have="$("$ROOT/bench/source_fingerprint.sh" "$ROOT" 2>/dev/null || echo unknown)"
  if [[ "$want" != "$have" ]]; then
    record_stage bundle "FAILED (refused)" 0 \
      "gpu-bundle built from other sources (commit $(cut -c1-12 "$BUNDLE/commit" 2>/dev/null)); rebuild it with bench/gpu_bundle.sh; building from source instead"
    FAILED=1
    USE_BUNDLE=0
  fi
fi

# The directory of a library (libnccl.so.2, libcublas.so.13) on this machine: the CUDA
# toolkit's, the system's, or the nvidia-<pip package>'s.
find_lib_dir() {
  local lib="$1" pip="$2" d
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/lib/x86_64-linux-gnu /usr/lib64; do
    if [[ -e "$d/$lib" ]]; then
      echo "$d"
      return 0
    fi
  done
  python3 -c "import nvidia.$pip as n; print(list(n.__path__)[0] + '/lib')" 2>/dev/null && return 0
  d="$(find /usr /opt /root -name "$lib" 2>/dev/null | head -n 1)"
  [[ -n "$d" ]] && dirname "$d"
  return 0
}

if [[ $USE_BUNDLE -eq 1 ]]; then
  BIN_DIR="$BUNDLE/bin"
  NCCL_DIR="$(find_lib_dir libnccl.so.2 nccl)"
  CUBLAS_DIR="$(find_lib_dir libcublas.so.13 cublas)"
  export LD_LIBRARY_PATH="$BUNDLE/lib${NCCL_DIR:+:$NCCL_DIR}${CUBLAS_DIR:+:$CUBLAS_DIR}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export ZINF_TRAIN_DATA="$BUNDLE/corpus.txt"
  {
    echo "bundle built at commit $(cat "$BUNDLE/commit" 2>/dev/null), needs $(cat "$BUNDLE/glibc" 2>/dev/null)"
    echo "this tree: $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
    echo "glibc here: $(ldd --version 2>&1 | head -n 1)"
    echo "NCCL: ${NCCL_DIR:-not found}; cuBLAS: ${CUBLAS_DIR:-not found}"
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    for b in "$BIN_DIR"/*; do
      echo "== ldd $b"
      ldd "$b" 2>&1 | grep -E "not found|nccl|cudart|cublas|uring|hwloc|tbb|openblas" || true
    done
  } >>"$OUT/environment.log" 2>&1
  record_stage bundle "passed" 0 \
    "prebuilt gpu-bundle of these sources (commit $(cut -c1-12 "$BUNDLE/commit" 2>/dev/null)); NCCL from ${NCCL_DIR:-nowhere (not found)}"
else
  BIN_DIR=""
  # With the trainer (OpenBLAS, CLI11) when this machine has them, else without it.
  STAGE_NOTE="with zinf-train"
  run_stage configure 30 bash -c '
    cmake -S "$0" -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZINF_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES="$2" -DZINF_BUILD_TRAIN=ON ||
      { echo "== without the trainer"; rm -f "$1/CMakeCache.txt";
        cmake -S "$0" -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZINF_CUDA=ON \
          -DCMAKE_CUDA_ARCHITECTURES="$2" -DZINF_BUILD_TRAIN=OFF; }' \
    "$ROOT" "$BUILD_DIR" "$CUDA_ARCH"
  grep -q "== without the trainer" "$OUT/configure.log" 2>/dev/null &&
    STAGE_NOTES[${#STAGE_NOTES[@]} - 1]="WITHOUT zinf-train (OpenBLAS or CLI11 missing)"
  export ZINF_TRAIN_DATA="$ROOT/train/data/corpus.txt"
fi
if [[ $USE_BUNDLE -eq 1 ]]; then
  :
elif stage_passed configure; then
  # Only what the later stages run (the full suite is CI's job): keeps the build short.
  TRAIN_TARGETS=""
  grep -q "ZINF_BUILD_TRAIN:BOOL=ON" "$BUILD_DIR/CMakeCache.txt" 2>/dev/null &&
    TRAIN_TARGETS="train_model_ops_cuda_test zinf-train"
  # The Python module when this machine has pybind11 and the Python headers.
  ninja -C "$BUILD_DIR" -t targets all 2>/dev/null | grep -q '^zinf_python:' &&
    TRAIN_TARGETS="$TRAIN_TARGETS zinf_python"
  # shellcheck disable=SC2086
  run_stage build 155 cmake --build "$BUILD_DIR" -j "$JOBS" --target cuda_device_test \
    device_contract_cuda_test engine_cuda_test zinf-gpu-bench zinf-engine-bench $TRAIN_TARGETS
else
  skip_stage build "configure failed"
fi

# ---- GPU tests --------------------------------------------------------------------------------
if [[ $USE_BUNDLE -eq 1 ]]; then
  # What `ctest -L gpu` runs: cuda_device_test, the Device contract on CUDA (its trim through
  # the driver's VMM among it) and the engine test's GPU placements.
  STAGE_NOTE="gpu-bundle: cuda_device_test, device_contract_cuda_test, engine_cuda_test, train_model_ops_cuda_test"
  run_stage gpu_tests 80 bash -c '
    rc=0
    for t in cuda_device_test device_contract_cuda_test engine_cuda_test train_model_ops_cuda_test; do
      if [[ ! -x "$0/$t" ]]; then echo "MISSING BINARY: $0/$t"; rc=1; continue; fi
      if [[ $t == engine_cuda_test ]]; then
        "$0/$t" --gtest_filter="$(cat "$1")" || rc=1
      else
        "$0/$t" || rc=1
      fi
    done
    exit $rc' "$BIN_DIR" "$BUNDLE/engine_cuda_test.filter"
elif stage_passed build; then
  STAGE_NOTE="ctest -L gpu (the Python ones run in python_gpu)"
  run_stage gpu_tests 80 ctest --test-dir "$BUILD_DIR" -L gpu -LE python --output-on-failure \
    --no-tests=error
else
  skip_stage gpu_tests "build failed"
fi
# A skipped GoogleTest case passes ctest (and its binary): on a GPU machine a GPU test that
# skips means the GPU was not usable, and checked nothing.
if [[ -f "$OUT/gpu_tests.log" ]] && grep -q "SKIPPED\|Skipped\|MISSING BINARY" "$OUT/gpu_tests.log"; then
  fail_last_stage "GPU tests skipped or missing ($(grep -c "SKIPPED \]\|Skipped\|MISSING BINARY" "$OUT/gpu_tests.log") lines): no usable GPU?"
fi

# ---- Bandwidth ----------------------------------------------------------------------------------
GPU_BENCH="${BIN_DIR:-$BUILD_DIR/bench}/zinf-gpu-bench"
if [[ -x "$GPU_BENCH" ]]; then
  mkdir -p "$NVME_DIR"
  STAGE_NOTE="$BENCH_MIB MiB per copy; NVMe folder $NVME_DIR"
  run_stage gpu_bench 40 "$GPU_BENCH" --mib "$BENCH_MIB" --iters 5 --nvme "$NVME_DIR"
  # The NVMe figures mean something only with direct I/O, on a disk.
  fstype="$(stat -f -c %T "$NVME_DIR" 2>/dev/null || echo unknown)"
  if ! stage_passed gpu_bench; then
    :  # its failure is already recorded
  elif [[ "$fstype" == tmpfs || "$fstype" == ramfs ]]; then
    fail_last_stage "the NVMe folder $NVME_DIR is on $fstype (a RAM disk): set NVME_DIR to an NVMe drive"
  elif ! grep -q "direct I/O on" "$OUT/gpu_bench.log"; then
    fail_last_stage "direct I/O was not used (the NVMe figures include the page cache)"
  fi
  rm -rf "$NVME_DIR"
else
  skip_stage gpu_bench "zinf-gpu-bench was not built"
fi

# ---- Engine bench -------------------------------------------------------------------------------
ENGINE_BENCH="${BIN_DIR:-$BUILD_DIR/bench}/zinf-engine-bench"
if [[ ! -x "$ENGINE_BENCH" ]]; then
  skip_stage engine_bench "zinf-engine-bench was not built"
else
  # Parameters on the GPU with the optimizer on the CPU, then half of the sub-groups stepped
  # by the GPU Adam (offload_optimizer.ratio 0.5), then parameters streamed from NVMe.
  mkdir -p "$NVME_DIR"
  # Then adam-bound again with bf16 gradients across PCIe (zinf.gradient_transfer_dtype),
  # with the delayed update (issue 31: the exact step against it, where copies are DMA), and
  # clipped at 1 with speculation on (the bench's norm is 1e-3 x sqrt(128 Mi) = 11.6: every
  # step rescales, so every speculated sub-group is redone).
  # Then offload_states / reload_states on the GPU (issue 41; never run on a GPU before): every
  # sub-group stepped by the GPU (ratio 0), 3 cycles, then a step; device_committed_offloaded
  # is what the pool still has mapped through the driver's VMM after the trim (it should be
  # the bench's own buffers rounded to 32 MiB chunks, not the "before" figure).
  STAGE_NOTE="zinf-engine-bench --device cuda: adam-bound, ratio 0.5, io-bound, bf16 gradients, delayed, clipped speculating, offload_states cycles"
  run_stage engine_bench 110 bash -c '
    set -e
    "$0" --device cuda --preset adam-bound --steps 4 --nvme "$1"
    "$0" --device cuda --preset adam-bound --delayed-update --steps 4 --nvme "$1"
    "$0" --device cuda --preset adam-bound --gradient-clipping 1 --speculative-step on --steps 4 --nvme "$1"
    "$0" --device cuda --preset adam-bound --optimizer-ratio 0.5 --steps 4 --nvme "$1"
    "$0" --device cuda --preset io-bound --steps 4 --nvme "$1"
    "$0" --device cuda --preset adam-bound --gradient-transfer bf16 --steps 4 --nvme "$1"
    "$0" --device cuda --preset adam-bound --optimizer-ratio 0 --offload-cycles 3 --steps 2 --nvme "$1"' \
    "$ENGINE_BENCH" "$NVME_DIR"
  rm -rf "$NVME_DIR"
fi

# ---- zinf-train: the model on the GPU ---------------------------------------------------------
TRAIN_BIN="${BIN_DIR:-$BUILD_DIR/train}/zinf-train"
if [[ ! -x "$TRAIN_BIN" ]]; then
  skip_stage train "zinf-train was not built"
else
  # The demo model (small) on the GPU and on the host device, same steps (the GPU's
  # tokens/s against the CPU's, in one run), then the 125M preset on the GPU with its
  # optimizer states on NVMe (the beyond-memory path with the model's math on the GPU).
  mkdir -p "$NVME_DIR"
  STAGE_NOTE="zinf-train: small on cuda and host (60 steps), 125M on cuda (opt. states on NVMe), small on cuda in fp16"
  run_stage train 90 bash -c '
    set -e
    "$0" --device cuda --preset small --steps 60 --json --nvme "$1" --data "$2"
    "$0" --device host --preset small --steps 60 --json --nvme "$1" --data "$2"
    "$0" --device cuda --preset 125M --seq 256 --batch 8 --steps 6 --param-tier device \
      --optimizer-tier nvme --json --nvme "$1" --data "$2"
    "$0" --device cuda --preset small --steps 60 --fp16 --json --nvme "$1" --data "$2"' \
    "$TRAIN_BIN" "$NVME_DIR" "$ZINF_TRAIN_DATA"
  rm -rf "$NVME_DIR"
  # The GPU run must learn like the host run: finite, falling, and tracking it. Tolerances: the
  # first loss (same initial weights, one forward) within 0.5 %, the last within 5 % (cuBLAS
  # and the CPU kernels round differently, and that compounds over 60 steps).
  if stage_passed train; then
    why="$(python3 - "$OUT/train.log" <<'PY' 2>&1
import json, math, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{") and '"loss_first"' in l]
if len(runs) < 2:
    print("fewer than two trainer results in train.log"); sys.exit(1)
cuda, host = runs[0], runs[1]
for name, r in [("cuda", cuda), ("host", host)] + ([("125M cuda", runs[2])] if len(runs) > 2 else []):
    a, b = r["loss_first"], r["loss_last"]
    if not (math.isfinite(a) and math.isfinite(b)):
        print(f"{name}: loss not finite ({a}, {b})"); sys.exit(1)
    if not b < a:
        print(f"{name}: loss did not fall ({a} -> {b})"); sys.exit(1)
if abs(cuda["loss_first"] - host["loss_first"]) > 0.005 * abs(host["loss_first"]):
    print(f"first loss cuda {cuda['loss_first']} vs host {host['loss_first']} (over 0.5 %)"); sys.exit(1)
if abs(cuda["loss_last"] - host["loss_last"]) > 0.05 * abs(host["loss_last"]):
    print(f"last loss cuda {cuda['loss_last']} vs host {host['loss_last']} (over 5 %)"); sys.exit(1)
# fp16 on the GPU (issue 41; never run on a GPU before): finite, learning like bf16 within 5 %.
if len(runs) > 3:
    f16 = runs[3]
    if f16.get("param_dtype") != "fp16" or not math.isfinite(f16["loss_last"]):
        print(f"fp16 run: dtype {f16.get('param_dtype')}, last loss {f16['loss_last']}"); sys.exit(1)
    if abs(f16["loss_last"] - cuda["loss_last"]) > 0.05 * abs(cuda["loss_last"]):
        print(f"fp16 last loss {f16['loss_last']} vs bf16 {cuda['loss_last']} (over 5 %; "
              f"{f16.get('skipped_steps')} skipped)"); sys.exit(1)
PY
)" || fail_last_stage "trainer check: $why"
  fi
fi

# ---- Ranks as processes on GPUs (issue 29) ------------------------------------------------------
# zinf-train --nproc 2 --device cuda: two processes, GPU r for rank r, NCCL bootstrapped through
# the ranks' rendezvous store. Needs two GPUs: with one, the stage is not applicable (NCCL
# refuses two ranks on one device) and says so; that is not counted as a failure.
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU " || true)
if [[ ! -x "$TRAIN_BIN" ]]; then
  skip_stage ranks "zinf-train was not built"
elif [[ "${GPUS:-0}" -lt 2 ]]; then
  echo "== ranks: not applicable: ${GPUS:-0} GPU(s) visible, 2 needed" >&2
  record_stage ranks "not applicable" 0 "${GPUS:-0} GPU(s) visible; zinf-train --nproc 2 --device cuda needs 2"
else
  mkdir -p "$NVME_DIR"
  STAGE_NOTE="zinf-train --nproc 2 --device cuda, small, 20 steps, vs one GPU with twice the batch"
  run_stage ranks 60 bash -c '
    set -e
    "$0" --nproc 2 --device cuda --preset small --steps 20 --batch 4 --json --nvme "$1" --data "$2"
    "$0" --device cuda --preset small --steps 20 --batch 8 --json --nvme "$1" --data "$2"' \
    "$TRAIN_BIN" "$NVME_DIR" "$ZINF_TRAIN_DATA"
  rm -rf "$NVME_DIR"
  if stage_passed ranks; then
    why="$(python3 - "$OUT/ranks.log" <<'PY' 2>&1
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{") and '"losses"' in l]
if len(runs) < 2 or runs[0].get("ranks") != 2:
    print("no two-rank result in ranks.log"); sys.exit(1)
worst = max(abs(a - b) / abs(b) for a, b in zip(runs[0]["losses"], runs[1]["losses"]))
if worst > 0.005:
    print(f"2 ranks vs 1 rank with twice the batch: losses differ by {worst:.2%} (over 0.5 %)")
    sys.exit(1)
PY
)" || fail_last_stage "ranks check: $why"
  fi
fi

# ---- zinf from PyTorch on the GPU ---------------------------------------------------------------
if [[ $USE_BUNDLE -eq 1 ]]; then
  skip_stage python_gpu "gpu-bundle: the Python module is built for one interpreter (run \
without the bundle where a CUDA torch is installed)"
elif ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" \
    >/dev/null 2>&1; then
  skip_stage python_gpu "no CUDA torch for python3 on this machine"
elif [[ ! -d "$BUILD_DIR/python/zinf" ]]; then
  skip_stage python_gpu "the Python module was not built (pybind11 or Python headers missing)"
else
  STAGE_NOTE="pytest python/tests/test_cuda_gpu.py"
  run_stage python_gpu 25 env PYTHONPATH="$BUILD_DIR/python" python3 -m pytest -q \
    -p no:cacheprovider "$ROOT/python/tests/test_cuda_gpu.py"
fi

# ---- Libraries taken from this machine ----------------------------------------------------------
# What the binaries resolve to here (not bundled, not built): the file and its version.
LIB_LINES=""
for b in "${BIN_DIR:-$BUILD_DIR/tests}/engine_cuda_test" "${BIN_DIR:-$BUILD_DIR/train}/zinf-train" \
  "${BIN_DIR:-$BUILD_DIR/bench}/zinf-gpu-bench"; do
  [[ -x "$b" ]] && ldd "$b" 2>/dev/null
done | awk '$2 == "=>" {print $1, $3}' | sort -u |
  grep -E "^lib(nccl|cublas|cublasLt|cudnn|cudart)\.so" >"$OUT/libraries.txt" 2>/dev/null || true
# A library's version: NCCL says it in its binary; the CUDA libraries by their pip package's
# dist-info beside them (nvidia_cublas-13.1.0.3) or the versioned file name they resolve to.
lib_version() {
  local name="$1" path="$2" real pkg d v
  real="$(readlink -f "$path")"
  if [[ "$name" == libnccl* ]]; then
    v="$(grep -aoE -m1 "NCCL version [0-9][0-9.]*[+a-z0-9.]*" "$real" 2>/dev/null | head -n 1)"
    [[ -n "$v" ]] && { echo "${v#NCCL version }"; return; }
  fi
  case "$name" in
    libcublas*) pkg=nvidia_cublas ;;
    libcudart*) pkg=nvidia_cuda_runtime ;;
    libcudnn*) pkg=nvidia_cudnn ;;
    libnccl*) pkg=nvidia_nccl ;;
  esac
  for d in "$(dirname "$real")/../dist-info" "$(dirname "$real")/.." "$(dirname "$real")/../.."; do
    v="$(ls -d "$d/${pkg:-none}"*-*.dist-info 2>/dev/null | head -n 1)"
    if [[ -n "$v" ]]; then
      v="$(basename "$v" .dist-info)"
      echo "${v##*-} ($(basename "$v" | sed 's/-[^-]*$//'))"
      return
    fi
  done
  basename "$real"
}
while read -r name path; do
  if [[ "$path" == "not" || ! -e "$path" ]]; then
    LIB_LINES+="| $name | NOT FOUND | - |"$'\n'
    FAILED=1
  else
    LIB_LINES+="| $name | $path | $(lib_version "$name" "$path") |"$'\n'
  fi
done <"$OUT/libraries.txt"
if [[ -n "$LIB_LINES" ]] && ! grep -q "^libcudnn" "$OUT/libraries.txt"; then
  LIB_LINES+="| libcudnn | not linked by these binaries | - |"$'\n'
fi

# ---- Summary ------------------------------------------------------------------------------------
{
  echo "# zinf GPU check"
  echo
  echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname); build dir \`$BUILD_DIR\`," \
    "CUDA arch $CUDA_ARCH."
  echo
  echo '```'
  head -n 3 "$OUT/environment.log" | tail -n 2 || true
  echo '```'
  echo
  echo "| stage | result | seconds | notes | log |"
  echo "|---|---|---|---|---|"
  for i in "${!STAGE_NAMES[@]}"; do
    log="${STAGE_NAMES[$i]}.log"
    [[ -f "$OUT/$log" ]] || log="-"
    printf '| %s | %s | %s | %s | %s |\n' "${STAGE_NAMES[$i]}" "${STAGE_RESULTS[$i]}" \
      "${STAGE_SECONDS[$i]}" "${STAGE_NOTES[$i]}" "$log"
  done
  echo
  echo "## Libraries from this machine"
  echo
  if [[ -n "$LIB_LINES" ]]; then
    echo "| library | resolved to | version (file) |"
    echo "|---|---|---|"
    printf '%s' "$LIB_LINES"
  else
    echo "(no binary was there to ask: nothing was built or bundled)"
  fi
  echo
  echo "Overall: $([[ $FAILED -eq 0 ]] && echo PASSED || echo FAILED) in $(($(date +%s) - DEADLINE_S + BUDGET_S)) s (budget ${BUDGET_S} s)."
  if [[ -f "$OUT/gpu_tests.log" ]]; then
    echo
    echo "## GPU tests"
    echo
    echo '```'
    grep -E "tests passed|tests failed|Failed|FAILED|PASSED|SKIPPED \] [0-9]+ test|\*\*\*" "$OUT/gpu_tests.log" | tail -n 40 || true
    echo '```'
  fi
  if [[ -f "$OUT/gpu_bench.log" ]] && grep -q '^{' "$OUT/gpu_bench.log"; then
    echo
    echo "## Bandwidth (GB/s = 10^9 B/s, best of 5)"
    echo
    echo "| measurement | memory / mode | GB/s | mean GB/s |"
    echo "|---|---|---|---|"
    grep '^{' "$OUT/gpu_bench.log" | python3 -c '
import json, sys
for line in sys.stdin:
    j = json.loads(line)
    if j["bench"] == "copy":
        print("| copy %s | %s | %.2f | %s |" % (j["direction"], j["memory"], j["gbps_best"],
              "%.2f" % j["gbps_mean"] if "gbps_mean" in j else "-"))
    elif j["mode"] == "serial":
        print("| NVMe read | serial | %.2f | - |" % j["nvme_read_gbps_best"])
        print("| NVMe -> GPU end to end | serial (read, then copy) | %.2f | - |"
              % j["end_to_end_gbps_best"])
    else:
        print("| NVMe -> GPU end to end | pipelined, %d MiB chunks | %.2f | - |"
              % (j["chunk_bytes"] >> 20, j["end_to_end_gbps_best"]))
' || echo "(could not parse gpu_bench.log)"
  fi
  if [[ -f "$OUT/engine_bench.log" ]] && grep -q '"median_step_seconds"' "$OUT/engine_bench.log"; then
    echo
    echo "## Engine bench on the GPU (medians of steps 2-4)"
    echo
    echo "Compute idle: the compute stream not computing between a step's first and last"
    echo "compute kernel (GPU timer), and its share of that span."
    echo
    echo "| preset | optimizer ratio | gradients | step s | compute idle s (share) | D2H MiB | overlap | NVMe busy s | copy busy s | optimizer busy s |"
    echo "|---|---|---|---|---|---|---|---|---|---|"
    grep '"median_step_seconds"' "$OUT/engine_bench.log" | python3 -c '
import json, sys
for line in sys.stdin:
    j = json.loads(line)
    print("| %s | %s | %s | %.3f | %.3f (%.0f %%) | %.0f | %.2f | %.3f | %.3f | %.3f |" % (
          j["preset"], j["optimizer_ratio"], j["gradient_transfer"], j["median_step_seconds"],
          j["median_compute_idle_seconds"], 100 * j["median_compute_idle_fraction"],
          j["median_d2h_bytes"] / 2**20, j["median_overlap_efficiency"],
          j["median_nvme_busy_seconds"], j["median_copy_busy_seconds"],
          j["median_optimizer_busy_seconds"]))
' || echo "(could not parse engine_bench.log)"
  fi
  if [[ -f "$OUT/train.log" ]] && grep -q '"tokens_per_s"' "$OUT/train.log"; then
    echo
    echo "## zinf-train (cuda, host: the small demo model; then 125M on cuda)"
    echo
    echo "| params | loss first | loss last | tokens/s | model TFLOPS | overlap | peak RSS GiB |"
    echo "|---|---|---|---|---|---|---|"
    grep '"tokens_per_s"' "$OUT/train.log" | python3 -c '
import json, sys
for line in sys.stdin:
    j = json.loads(line)
    print("| %d | %.3f | %.3f | %.0f | %.3g | %.2f | %.1f |" % (j["params"], j["loss_first"],
          j["loss_last"], j["tokens_per_s"], j.get("model_tflops", 0),
          j.get("overlap_efficiency", 0), j["peak_rss_bytes"] / 2**30))
' || echo "(could not parse train.log)"
  fi
} >"$SUMMARY"

echo "summary: $SUMMARY" >&2
cat "$SUMMARY"
exit "$FAILED"
