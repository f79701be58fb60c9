#!/usr/bin/env bash
# Fuzzes the JSON config loader, the checkpoint manifest loader and the safetensors header
# parser with libFuzzer (clang), under AddressSanitizer + UndefinedBehaviorSanitizer, starting
# from the corpora in fuzz/corpus.
# Builds into build-fuzz/. ZINF_FUZZ_SECONDS (default 30) per target; new inputs that reach
# new code are kept in build-fuzz/corpus-* (copy interesting ones into fuzz/corpus/).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh fuzz
seconds=${ZINF_FUZZ_SECONDS:-30}
flags="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -g"
if [ ! -f build-fuzz/CMakeCache.txt ]; then
  CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DZINF_CUDA=OFF -DZINF_BUILD_TESTS=OFF -DZINF_BUILD_BENCH=OFF -DZINF_BUILD_TRAIN=OFF -DZINF_PYTHON=OFF \
    -DZINF_FUZZ=ON -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
    -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined"
fi
cmake --build build-fuzz -j "${ZINF_JOBS:-$(nproc)}" --target config_fuzzer manifest_fuzzer safetensors_fuzzer
for target in config manifest safetensors; do
  work=build-fuzz/corpus-$target
  mkdir -p "$work"
  echo "fuzzing the $target loader for ${seconds}s"
  log=build-fuzz/$target.log
  if ! ASAN_OPTIONS=detect_leaks=1 build-fuzz/fuzz/${target}_fuzzer "$work" fuzz/corpus/$target \
      -max_total_time="$seconds" -max_len=65536 -timeout=10 -print_final_stats=1 >"$log" 2>&1; then
    tail -60 "$log"
    echo "the $target fuzzer found a failure (input saved as build-fuzz/crash-* or ./crash-*)"
    exit 1
  fi
  grep -E "^(stat::number_of_executed_units|stat::new_units_added)" "$log" || true
done
