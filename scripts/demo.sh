#!/usr/bin/env bash
# The main job with embedded defaults: installs missing packages, builds, and runs the NVMe
# swapper benchmark on a swap folder under the working directory (./zinf-swap).
# Extra arguments go to zinf-nvme-bench (see zinf-nvme-bench --help).
set -euo pipefail
here=$(pwd)
cd "$(dirname "$0")/.."
root=$(pwd)
scripts/deps.sh
scripts/build.sh >/dev/null
cd "$here"
mkdir -p zinf-swap
exec "$root/${ZINF_BUILD_DIR:-build}/bench/zinf-nvme-bench" --dir zinf-swap --size 1G --seconds 3 "$@"
