#!/usr/bin/env bash
# Prints one sha256 over zinf's sources (C++, CUDA, CMake, Python, scripts) under the tree
# given (default: this one), in a fixed order, without git: gpu_bundle.sh records it in the
# bundle and gpu_check.sh refuses a bundle built from other sources (the device machine's copy
# of the tree may have no .git).
set -euo pipefail
ROOT="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
cd "$ROOT"
# Every folder that holds sources (a folder missing here is an error, not a smaller hash).
PATHS=(CMakeLists.txt cmake common nvme cpu_adam device formats config engine interop include c_api
       train bench python tests fuzz scripts)
for p in "${PATHS[@]}"; do
  [ -e "$p" ] || { echo "source_fingerprint: $ROOT/$p is missing" >&2; exit 1; }
done
find "${PATHS[@]}" \
  -path python/build -prune -o -path 'python/*.egg-info' -prune -o -type f \
  \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name 'CMakeLists.txt' \
  -o -name '*.cmake' -o -name '*.in' -o -name '*.py' -o -name '*.sh' \) -print |
  LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1
