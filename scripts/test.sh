#!/usr/bin/env bash
# The whole test suite: installs missing packages, configures, builds, runs ctest.
# Extra arguments go to ctest (for example: -L gpu, -R swap).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh
cd "${ZINF_BUILD_DIR:-build}"
ctest --output-on-failure --timeout 600 -j "${ZINF_TEST_JOBS:-2}" "$@"
