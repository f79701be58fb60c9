#!/usr/bin/env bash
# ZeRO stages 3, 2 and 1 on 2 rank processes over gloo, same run, alternating order (3 2 1 1 2 3):
#  - zinf-train (the demo GPT, 2 ranks, 4 micro-steps per step): tokens/s and the final
#    parameter checksum (stage 2 must equal stage 3's; stage 1 sums each rank's micro-steps
#    first, so it differs in the last bits);
#  - zinf-engine-bench (8 layers of 1M elements, parameters and states in CPU memory): the
#    collectives and bytes each rank sends per step, and the step time.
# Usage: bench/zero_stages.sh [BUILD_DIR] [STEPS]   (defaults: build 20)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
steps=${2:-20}
py=/usr/bin/python3
work=$(mktemp -d "${TMPDIR:-/var/tmp}/zinf-stages.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores; $(date -u +%F)"
printf '%-6s %-5s %12s %18s   %s\n' run stage tokens/s checksum "engine bench per step"
run=0
for stage in 3 2 1 1 2 3; do
  run=$((run + 1))
  train=$("$build/train/zinf-train" --preset small --steps "$steps" --nproc 2 --grad-accum 4 \
    --batch 4 --seed 1 --zero-stage "$stage" --nvme "$work/t$run" --json 2>/dev/null | tail -1)
  bench=$("$build/bench/zinf-engine-bench" --nproc 2 --layers 8 --layer-elems 1048576 \
    --steps 6 --compute-ms 1 --param-tier cpu --optimizer-tier cpu --zero-stage "$stage" \
    --nvme "$work/b$run" 2>/dev/null | tail -2)
  "$py" - "$run" "$stage" "$train" "$bench" <<'PY'
import json, sys
run, stage, train, bench = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
step, summary = [json.loads(l) for l in bench.splitlines()]
print("%-6s %-5s %12.0f %18s   %d collectives, %.1f MB sent, %.1f ms median step" % (
    run, stage, train["tokens_per_s"], train["param_checksum"], step["comm_collectives"],
    step["comm_bytes_sent"] / 1e6, summary["median_step_seconds"] * 1e3))
PY
  rm -rf "$work/t$run" "$work/b$run"
done
