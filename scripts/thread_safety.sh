#!/usr/bin/env bash
# The clang thread-safety analysis: every source of the engine (engine/) and of the NVMe layer
# (nvme/) compiled with -Wthread-safety -Werror (syntax only, no objects), with the include
# paths of the main build.
# Fails on any field marked GUARDED_BY touched without its lock, or a REQUIRES not met.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh fuzz  # clang
BUILD=${ZINF_BUILD_DIR:-build}
[ -f "$BUILD/build.ninja" ] || scripts/build.sh
CXX=${ZINF_TSA_CXX:-clang++}
INCLUDES=(-I. -Iinclude -I"$BUILD" -I"$BUILD/include")
status=0
n=0
for src in engine/*.cc nvme/*.cc; do
  n=$((n + 1))
  if ! "$CXX" -std=c++20 -fsyntax-only -Wthread-safety -Wthread-safety-beta -Werror \
      "${INCLUDES[@]}" "$src"; then
    echo "thread-safety: $src fails the analysis" >&2
    status=1
  fi
done
[ $status -eq 0 ] && echo "thread-safety: $n sources (engine/, nvme/) pass clang -Wthread-safety"
exit $status
