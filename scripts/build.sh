#!/usr/bin/env bash
# Configures and builds zinf into ${ZINF_BUILD_DIR:-build} (Release, Ninja).
# Extra arguments go to cmake's configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${ZINF_BUILD_DIR:-build}
JOBS=${ZINF_JOBS:-$(nproc)}
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=${ZINF_BUILD_TYPE:-Release} "$@"
fi
cmake --build "$BUILD_DIR" -j "$JOBS"
