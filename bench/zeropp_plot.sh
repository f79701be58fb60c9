#!/usr/bin/env bash
# The loss curves of bench/zeropp_link.sh's cases (its output, one JSON line per case) in one
# PNG with gnuplot (Debian's gnuplot-nox): each case's loss per step, as a mean of 20 steps.
# Usage: bench/zeropp_plot.sh ZEROPP_LINK_OUTPUT OUT_PNG TITLE
set -euo pipefail
log=$1 png=$2 title=$3
command -v gnuplot >/dev/null || { echo "zeropp_plot.sh: needs gnuplot (apt install gnuplot-nox)" >&2; exit 2; }
work=$(mktemp -d /var/tmp/zinf-zeropp-plot-XXXXXX)
trap 'rm -rf "$work"' EXIT
/usr/bin/python3 - "$log" "$work" <<'PY'
import json, sys
cases = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
with open(sys.argv[2] + "/plots", "w") as plots:
    for i, c in enumerate(cases):
        losses = c["losses"]
        with open("%s/%d.dat" % (sys.argv[2], i), "w") as f:
            for s in range(len(losses)):
                window = losses[max(0, s - 19):s + 1]
                f.write("%d %.5f\n" % (s + 1, sum(window) / len(window)))
        words = c["flags"].split()
        # (--config FILE and --lr X are the cases' common settings, not their labels.)
        kept = [w for j, w in enumerate(words)
                if w not in ("--config", "--lr") and (j == 0 or words[j - 1] not in ("--config", "--lr"))]
        # ZeRO++'s flags by their short names, so the key fits.
        short = {"--quantized-weights": "qwZ", "--quantized-gradients": "qgZ",
                 "--hpz-partition-size": "hpZ", "--quantized-gradient-bits": "bits"}
        label = " ".join(short.get(w, w) for w in kept) or "plain ZeRO-3"
        plots.write('"%s/%d.dat" using 1:2 with lines lw 2 title "%s (%.1f MB/step)",' %
                    (sys.argv[2], i, label, c["link_bytes_per_step"] / 1e6))
PY
plots=$(sed 's/,$//' "$work/plots")
gnuplot <<GP
set terminal pngcairo size 900,540 noenhanced
set output "$png"
set title "$title (mean of 20 steps)"
set xlabel "step"
set ylabel "loss"
set key top right
set grid
plot $plots
GP
echo "wrote $png"
