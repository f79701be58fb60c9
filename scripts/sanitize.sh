#!/usr/bin/env bash
# The test suite under sanitizers: every test under AddressSanitizer + UndefinedBehaviorSanitizer,
# and the concurrent components (labels engine, nvme) under ThreadSanitizer. Builds into
# build-asan/ and build-tsan/. Run after scripts/test.sh (it installs the packages).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
# Without the Python module: an instrumented extension cannot load into an uninstrumented
# interpreter (its C++ code is the engine's, which these builds test directly).
common=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DZINF_CUDA=OFF -DZINF_BUILD_BENCH=OFF -DZINF_PYTHON=OFF)

# (The fault campaign, label chaos, runs in scripts/test.sh: it judges behaviour, and its
# kill times are scaled to an uninstrumented run.)
ZINF_BUILD_DIR=build-asan scripts/build.sh "${common[@]}" -DZINF_SANITIZE=address
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  LSAN_OPTIONS="suppressions=$PWD/../scripts/lsan.supp" \
  ctest --output-on-failure --timeout 600 -j 2 -LE 'install|chaos')

# Without the trainer: its kernels use GCC target_clones, whose ifunc resolvers run before
# TSan's runtime is up (the binaries crash at load); TSan runs the engine and nvme labels only.
ZINF_BUILD_DIR=build-tsan scripts/build.sh "${common[@]}" -DZINF_SANITIZE=thread \
  -DZINF_BUILD_TRAIN=OFF
# Not the multiprocess label: those tests fork ranks, which needs a one-thread parent (TSan runs
# a thread of its own), and gloo is not instrumented (TSan cannot see its synchronisation, so it
# would report gloo's hand-offs as races). GlooComm's locking is checked statically by
# scripts/thread_safety.sh; its ranks run under ASan.
(cd build-tsan && TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
  ctest --output-on-failure --timeout 600 -j 2 -L 'engine|nvme' -LE multiprocess)
