#!/usr/bin/env bash
# The clang thread-safety analysis: every source of the engine (engine/ and below), the NVMe layer
# (nvme/), the device backends (host; CUDA where its headers are installed), the C API and the
# Python module's C++ (where pybind11 is installed)
# compiled with -Wthread-safety -Werror (syntax only, no objects), with the include paths of
# the main build.
# Fails on any field marked GUARDED_BY touched without its lock, or a REQUIRES not met.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh fuzz  # clang
BUILD=${ZINF_BUILD_DIR:-build}
[ -f "$BUILD/build.ninja" ] || scripts/build.sh
CXX=${ZINF_TSA_CXX:-clang++}
INCLUDES=(-I. -Iinclude -I"$BUILD" -I"$BUILD/include")
SOURCES=(engine/*.cc engine/core/*.cc engine/persistence/*.cc nvme/*.cc device/host/*.cc config/*.cc
         formats/*.cc interop/*.cc c_api/*.cc)
# The Python module's C++ where pybind11 and Debian's Python headers are installed.
PY_INCLUDE=$(/usr/bin/python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])' \
             2>/dev/null || true)
if [ -n "$PY_INCLUDE" ] && [ -f "$PY_INCLUDE/Python.h" ] && [ -f /usr/include/pybind11/pybind11.h ]; then
  SOURCES+=(python/src/*.cc)
  INCLUDES+=(-I"$PY_INCLUDE")
else
  echo "thread-safety: no pybind11 or Python headers: the Python module is not analysed"
fi
# The CUDA backend's C++ (not the kernels) where the toolkit's headers are installed.
CUDA_INCLUDE=${CUDA_HOME:-/usr/local/cuda}/include
if [ -f "$CUDA_INCLUDE/cuda_runtime.h" ] && [ -f "$CUDA_INCLUDE/nccl.h" ]; then
  SOURCES+=(device/cuda/cuda_device.cc device/cuda/nccl_comm.cc)
  INCLUDES+=(-DZINF_HAVE_CUDA=1 -I"$CUDA_INCLUDE")
else
  echo "thread-safety: no CUDA headers under $CUDA_INCLUDE: the CUDA backend is not analysed"
fi
status=0
n=0
for src in "${SOURCES[@]}"; do
  n=$((n + 1))
  if ! "$CXX" -std=c++20 -fsyntax-only -Wthread-safety -Wthread-safety-beta -Werror \
      "${INCLUDES[@]}" "$src"; then
    echo "thread-safety: $src fails the analysis" >&2
    status=1
  fi
done
[ $status -eq 0 ] && echo "thread-safety: $n sources (engine/ and below, nvme/, the device backends, the C API, the Python module) pass clang -Wthread-safety"
exit $status
