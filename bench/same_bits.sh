#!/usr/bin/env bash
# Fixed-seed zinf-train runs over the engine's paths (NVMe and CPU states, speculation kept,
# redone and off, the delayed update, parameters on the device tier, fp32 parameters, int8
# states, 2 ranks, bf16 gradient transfer, accumulation), one line each: name, param checksum,
# last loss. Two builds that print the same lines train the same bits: a refactor's check.
#
#   bench/same_bits.sh [BUILD_DIR] [PARENT_DIR]   (defaults: build, /var/tmp; the swap folder
#                                                  is a new one inside PARENT_DIR, removed after)
#   diff <(bench/same_bits.sh /tmp/build-old) <(bench/same_bits.sh build)
# (--gradient-transfer is a zinf-train flag from issue 40 on: an older build fails the last two.)
set -euo pipefail
build=${1:-build}
bin="$build/train/zinf-train"
[ -x "$bin" ] || { echo "same_bits: no $bin (build first)" >&2; exit 2; }
swap=$(mktemp -d "${2:-/var/tmp}/zinf-same-bits.XXXXXX")
trap 'rm -rf "$swap"' EXIT
run() {
  local name=$1
  shift
  rm -rf "${swap:?}"/*
  local line
  line=$("$bin" --preset small --steps 6 --batch 2 --seq 64 --warmup 1 --log-every 100 --json \
    --nvme "$swap" "$@" 2>/dev/null | tail -n 1)
  # {"...","loss_last":X,...,"param_checksum":"H",...}: no JSON tool needed for two fields.
  local sum=${line#*\"param_checksum\":\"}
  local loss=${line#*\"loss_last\":}
  echo "$name ${sum%%\"*} ${loss%%,*}"
}
run nvme-states --optimizer-tier nvme
run clipped-speculation-redone --optimizer-tier nvme --gradient-clipping 0.05 --speculative-step on
run clipped-speculation-cpu-states --optimizer-tier cpu --gradient-clipping 0.05 --speculative-step on
run clipped-no-speculation --optimizer-tier nvme --gradient-clipping 1.0 --speculative-step off
run speculation-kept --optimizer-tier nvme --gradient-clipping 1000 --speculative-step on
run delayed-update --optimizer-tier nvme --param-tier nvme --delayed-update
run device-tier-accumulation --optimizer-tier cpu --param-tier device --grad-accum 2
run device-tier-nvme-speculation --optimizer-tier nvme --param-tier device --gradient-clipping 0.05 --speculative-step on
run fp32-parameters --optimizer-tier nvme --gradient-clipping 0.05 --speculative-step on --fp32
run int8-states --optimizer-tier cpu --param-tier device --gradient-clipping 0.05 --speculative-step on --state-dtype int8
run two-ranks-accumulation --optimizer-tier nvme --nproc 2 --grad-accum 2
run bf16-gradients-accumulation --optimizer-tier nvme --gradient-transfer bf16 --grad-accum 2
run two-ranks-bf16-gradients --optimizer-tier nvme --nproc 2 --gradient-transfer bf16 --grad-accum 2
