#!/usr/bin/env bash
# Loss curves of one zinf-train run per optimizer state dtype (fp32, bf16, int8), same seed,
# drawn in one PNG (bench/loss_curves.sh), plus the final losses.
# Usage: bench/state_dtype_curves.sh [BUILD_DIR] [OUT_PNG] [PRESET] [STEPS]
#   defaults: build bench/state_dtype_curves.png tiny 2000
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
png=${2:-bench/state_dtype_curves.png}
preset=${3:-tiny}
steps=${4:-2000}
common="--preset $preset --steps $steps --seed 1"
exec bench/loss_curves.sh "$build" "$png" \
  "zinf-train --preset $preset, $steps steps, seed 1: optimizer states fp32 / bf16 / int8" \
  "fp32 states|$common --state-dtype fp32" "bf16 states|$common --state-dtype bf16" \
  "int8 states|$common --state-dtype int8"
