#!/usr/bin/env bash
# Builds, on this (GPU-less) machine, what bench/gpu_check.sh runs on a GPU machine, into
# ./gpu-bundle (git-ignored): the GPU test and bench binaries for sm_90 and the shared
# libraries they need that a bare CUDA image lacks (liburing, libaio, hwloc, oneTBB, xxhash,
# OpenBLAS, the CUDA runtime). NCCL and cuBLAS are not bundled (hundreds of MB): gpu_check.sh
# finds the GPU machine's own (CUDA toolkit, or the nvidia-nccl / nvidia-cublas pip packages).
#
#   bench/gpu_bundle.sh            # then carry gpu-bundle to the GPU machine and run
#   OUT=... bench/gpu_check.sh     # which uses the bundle when it is there
#
# Environment: BUILD_DIR (default build-gpu-bundle), CUDA_ARCH (default 90), JOBS (default 2).
# Prints the bundle's size (the device tool carries at most 64 MiB in all) and the newest
# glibc symbol version the binaries need (the GPU machine's glibc must be at least that).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build-gpu-bundle}"
CUDA_ARCH="${CUDA_ARCH:-90}"
JOBS="${JOBS:-2}"
BUNDLE="$ROOT/gpu-bundle"
TARGETS=(cuda_device_test device_contract_cuda_test engine_cuda_test train_model_ops_cuda_test zinf-gpu-bench
         zinf-engine-bench zinf-train)

cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZINF_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" -DZINF_BUILD_TRAIN=ON -DZINF_BUILD_BENCH=ON \
  -DZINF_BUILD_TESTS=ON >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS" --target "${TARGETS[@]}"

rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/bin" "$BUNDLE/lib"
for t in "${TARGETS[@]}"; do
  bin="$(find "$BUILD_DIR" -type f -name "$t" -perm -u+x | head -n 1)"
  if [[ -z "$bin" ]]; then
    echo "gpu_bundle: $t was not built" >&2
    exit 1
  fi
  cp "$bin" "$BUNDLE/bin/"
  strip --strip-debug "$BUNDLE/bin/$t"
done

# Shared libraries: everything the binaries load except the C and C++ runtimes (the GPU
# machine has its own: see the versions checked below), the driver and NCCL.
is_system() {
  case "$1" in
    linux-vdso* | ld-linux* | libc.so* | libm.so* | libdl.so* | libpthread.so* | librt.so* | \
      libstdc++.so* | libgcc_s.so* | libcuda.so* | libnccl.so* | libcublas.so* | \
      libcublasLt.so*) return 0 ;;
  esac
  return 1
}
for b in "$BUNDLE"/bin/*; do
  ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
  if ! is_system "$name"; then
    cp -L "$path" "$BUNDLE/lib/$name"
    chmod u+w "$BUNDLE/lib/$name"
    strip --strip-unneeded "$BUNDLE/lib/$name" 2>/dev/null || true
  fi
done

# The trainer's corpus (train_model_ops_cuda_test and zinf-train read it).
cp "$ROOT/train/data/corpus.txt" "$BUNDLE/corpus.txt"
# The test filter of engine_cuda_test (tests/CMakeLists.txt), for running it without ctest.
grep -o 'TEST_FILTER "[^"]*"' "$ROOT/tests/CMakeLists.txt" | head -n 1 |
  sed 's/TEST_FILTER "\(.*\)"/\1/' >"$BUNDLE/engine_cuda_test.filter"
git -C "$ROOT" rev-parse HEAD >"$BUNDLE/commit" 2>/dev/null || echo unknown >"$BUNDLE/commit"
# gpu_check.sh refuses a bundle whose sources differ from the tree it runs in.
"$ROOT/bench/source_fingerprint.sh" "$ROOT" >"$BUNDLE/fingerprint"

glibc="$(for f in "$BUNDLE"/bin/* "$BUNDLE"/lib/*; do objdump -T "$f"; done 2>/dev/null |
  grep -o 'GLIBC_[0-9.]*' | sort -V | tail -n 1)"
glibcxx="$(for f in "$BUNDLE"/bin/* "$BUNDLE"/lib/*; do objdump -T "$f"; done 2>/dev/null |
  grep -o 'GLIBCXX_[0-9.]*' | sort -V | tail -n 1)"
glibc="$glibc and $glibcxx (libstdc++)"
echo "$glibc" >"$BUNDLE/glibc"
bytes="$(du -sb "$BUNDLE" | cut -f1)"
if ((bytes >= 64 * 1024 * 1024)); then
  echo "gpu_bundle: $((bytes >> 20)) MiB in $BUNDLE, over the device tool's 64 MiB: not usable" >&2
  exit 1
fi
echo "gpu_bundle: $(du -sh "$BUNDLE" | cut -f1) in $BUNDLE (limit 64 MiB for the device tool);" \
  "needs $glibc or newer; commit $(cat "$BUNDLE/commit")"
ls -la "$BUNDLE/bin" "$BUNDLE/lib"
