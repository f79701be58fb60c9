#!/usr/bin/env bash
# The whole test suite: installs missing packages, configures, builds, runs ctest.
# Extra arguments go to ctest (for example: -L gpu, -R swap).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh
cd "${ZINF_BUILD_DIR:-build}"
# One seed per run for the strict host device's delays (the strict.* tests); rerun a failure
# with the seed it prints.
export ZINF_TEST_STRICT_SEED="${ZINF_TEST_STRICT_SEED:-$(( (RANDOM << 15) | RANDOM ))}"
echo "strict host device seed: ZINF_TEST_STRICT_SEED=${ZINF_TEST_STRICT_SEED}"
ctest --output-on-failure --timeout 600 -j "${ZINF_TEST_JOBS:-2}" "$@"
