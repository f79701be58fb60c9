#!/usr/bin/env bash
# fp16 against bf16 and fp32 parameters on the demo GPT (zinf-train's embedded defaults, same
# seed), fp16 starting from a loss scale of 2^32 (it overflows, is skipped and halves until the
# gradients fit fp16), drawn in one PNG (bench/loss_curves.sh).
# Usage: bench/fp16_curves.sh [BUILD_DIR] [OUT_PNG] [PRESET] [STEPS]
#   defaults: build bench/fp16_curves.png small 300
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
png=${2:-bench/fp16_curves.png}
preset=${3:-small}
steps=${4:-300}
config=$PWD/bench/configs/demo_fp16_2e32.json
common="--preset $preset --steps $steps --seed 1 --config $config"
exec bench/loss_curves.sh "$build" "$png" \
  "zinf-train --preset $preset, $steps steps, seed 1: fp16 (scale from 2^32) / bf16 / fp32 parameters" \
  "fp16, scale from 2^32|$common --fp16" "bf16|$common" "fp32|$common --fp32"
