#!/usr/bin/env bash
# Loss curves of zinf-train runs that differ only in their flags (same seed), drawn in one PNG
# with gnuplot (Debian's gnuplot-nox), with each run's mean loss over its last 100 steps.
# Usage: bench/loss_curves.sh BUILD_DIR OUT_PNG TITLE "LABEL|FLAGS" ["LABEL|FLAGS" ...]
#   FLAGS: zinf-train's, split on spaces (the run's folder is its working directory, so a
#   relative --nvme or swap folder stays inside it; give --config an absolute path).
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1 png=$2 title=$3
shift 3
command -v gnuplot >/dev/null || { echo "loss_curves.sh: needs gnuplot (apt install gnuplot-nox)" >&2; exit 2; }
work=$(mktemp -d /var/tmp/zinf-curves-XXXXXX)
trap 'rm -rf "$work"' EXIT
plots=()
i=0
for run in "$@"; do
  label=${run%%|*} flags=${run#*|}
  i=$((i + 1))
  mkdir -p "$work/$i"
  # shellcheck disable=SC2086  # the flags are split on purpose
  (cd "$work/$i" && "$OLDPWD/$build/train/zinf-train" $flags --log-every 1 --json > out.json 2> err.txt) \
    || { echo "$label: zinf-train failed:" >&2; tail -n 5 "$work/$i/err.txt" >&2; exit 1; }
  # step loss, and the mean of the last 20 steps (the curve drawn)
  awk '/^step/ { split($2, s, "/"); l[++n] = $4; sum += $4; if (n > 20) sum -= l[n - 20];
                 printf "%d %s %.5f\n", s[1], $4, sum / (n < 20 ? n : 20) }' \
    "$work/$i/err.txt" > "$work/$i.dat"
  last=$(tail -n 100 "$work/$i.dat" | awk '{ s += $2 } END { printf "%.4f", s / NR }')
  extra=$(grep -o '"skipped_steps":[0-9]*\|"tokens_per_s":[0-9.e+]*' "$work/$i/out.json" | tr '\n' ' ' || true)
  echo "$label: mean loss of the last 100 steps $last ${extra:+($extra)}"
  plots+=("\"$work/$i.dat\" using 1:3 with lines lw 2 title \"$label\"")
done
joined=$(IFS=,; echo "${plots[*]}")
gnuplot <<GP
set terminal pngcairo size 900,540 noenhanced
set output "$png"
set title "$title (mean of 20 steps)"
set xlabel "step"
set ylabel "loss"
set key top right
set grid
plot $joined
GP
echo "wrote $png"
