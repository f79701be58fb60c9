#!/usr/bin/env bash
# Loss curves of one zinf-train run per optimizer state dtype (fp32, bf16, int8), same seed,
# drawn in one PNG with gnuplot (Debian's gnuplot-nox), plus the final losses.
# Usage: bench/state_dtype_curves.sh [BUILD_DIR] [OUT_PNG] [PRESET] [STEPS]
#   defaults: build bench/state_dtype_curves.png tiny 2000
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
png=${2:-bench/state_dtype_curves.png}
preset=${3:-tiny}
steps=${4:-2000}
command -v gnuplot >/dev/null || { echo "state_dtype_curves.sh: needs gnuplot (apt install gnuplot-nox)" >&2; exit 2; }
work=$(mktemp -d /var/tmp/zinf-curves-XXXXXX)
trap 'rm -rf "$work"' EXIT
for dtype in fp32 bf16 int8; do
  mkdir -p "$work/$dtype"
  (cd "$work/$dtype" && "$OLDPWD/$build/train/zinf-train" --preset "$preset" --steps "$steps" \
    --seed 1 --state-dtype "$dtype" --log-every 1 --json > out.json 2> err.txt)
  # step loss, and the mean of the last 20 steps (the curve drawn)
  awk '/^step/ { split($2, s, "/"); l[++n] = $4; sum += $4; if (n > 20) sum -= l[n - 20];
                 printf "%d %s %.5f\n", s[1], $4, sum / (n < 20 ? n : 20) }' \
    "$work/$dtype/err.txt" > "$work/$dtype.dat"
  last=$(tail -n 100 "$work/$dtype.dat" | awk '{ s += $2 } END { printf "%.4f", s / NR }')
  echo "$dtype: mean loss of the last 100 of $steps steps $last"
done
gnuplot <<EOF
set terminal pngcairo size 900,540 noenhanced
set output "$png"
set title "zinf-train --preset $preset, $steps steps, seed 1: optimizer states fp32 / bf16 / int8 (mean of 20 steps)"
set xlabel "step"
set ylabel "loss"
set key top right
set grid
plot "$work/fp32.dat" using 1:3 with lines lw 2 title "fp32 states", \
     "$work/bf16.dat" using 1:3 with lines lw 2 title "bf16 states", \
     "$work/int8.dat" using 1:3 with lines lw 2 dt 2 title "int8 states"
EOF
echo "wrote $png"
