#!/usr/bin/env bash
# NVMe bytes read per optimizer step and seconds per sample against the accumulation steps,
# for zinf-train's two schedules (--schedule micro-batch and layer-major), in one run: for
# each K the two schedules back to back (the order alternating with K), the swap folder
# removed before every run. One JSON line per run on stdout (zinf-train's, with "flags",
# "read_bytes_per_step" and "seconds_per_sample" added); progress on stderr.
# Usage: bench/layer_major.sh ZINF_TRAIN SWAP_FOLDER STEPS "K..." [zinf-train flags...]
#   e.g. bench/layer_major.sh build/train/zinf-train /var/tmp/zinf3b 2 "1 4 8 16" \
#          --config bench/configs/gpt3b_nvme.json --layers 40 --d-model 2560 --heads 32 \
#          --batch 1 --seq 16 --warmup 100
# SWAP_FOLDER must be the one the flags put the swap files in (it is removed before each run).
set -euo pipefail
bin=$1 swap=$2 steps=$3 ks=$4
shift 4
case "$swap" in /var/tmp/*|/tmp/*|./*) ;; *) echo "layer_major.sh: SWAP_FOLDER must be under /var/tmp, /tmp or ./" >&2; exit 2 ;; esac
i=0
for k in $ks; do
  if (( i % 2 == 0 )); then order="micro-batch layer-major"; else order="layer-major micro-batch"; fi
  i=$((i + 1))
  for schedule in $order; do
    rm -rf "$swap"
    echo "layer_major.sh: K=$k, $schedule" >&2
    if ! line=$("$bin" "$@" --steps "$steps" --grad-accum "$k" --schedule "$schedule" --json | tail -1); then
      echo "layer_major.sh: K=$k, $schedule failed (its error above); going on" >&2
      continue
    fi
    /usr/bin/python3 - "$line" "$k" "$schedule" "$steps" "$*" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
k, schedule, steps = int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
r["flags"] = sys.argv[5] + " --grad-accum %d --schedule %s" % (k, schedule)
r["read_bytes_per_step"] = r["nvme_read_bytes"] / steps
r["seconds_per_sample"] = r["train_seconds"] / (steps * k * r["batch"])
print(json.dumps(r))
PY
  done
done
rm -rf "$swap"
