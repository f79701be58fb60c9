#!/usr/bin/env bash
# NVMe bytes read per optimizer step against the accumulation steps K, one line per schedule
# and model, from JSON lines (bench/layer_major.sh's, or finetune.py's with "schedule" and
# "grad_accum"), in one PNG with gnuplot (Debian's gnuplot-nox).
# Usage: bench/layer_major_plot.sh OUT_PNG "LABEL=FILE.jsonl"...
set -euo pipefail
png=$1
shift
command -v gnuplot >/dev/null || { echo "layer_major_plot.sh: needs gnuplot (apt install gnuplot-nox)" >&2; exit 2; }
work=$(mktemp -d /var/tmp/zinf-layer-major-plot-XXXXXX)
trap 'rm -rf "$work"' EXIT
/usr/bin/python3 - "$work" "$@" <<'PY'
import json, sys
work, specs = sys.argv[1], sys.argv[2:]
plots = []
for i, spec in enumerate(specs):
    label, path = spec.split("=", 1)
    by = {}
    for line in open(path):
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        per_step = r.get("read_bytes_per_step", r.get("nvme_read_bytes_per_step"))
        by.setdefault(r["schedule"], []).append((r["grad_accum"], per_step / 1e9))
    for schedule, points in sorted(by.items()):
        name = "%s/%d-%s.dat" % (work, i, schedule)
        with open(name, "w") as f:
            for k, gb in sorted(points):
                f.write("%d %.4f\n" % (k, gb))
        dash = 1 if schedule == "layer-major" else 2
        plots.append('"%s" using 1:2 with linespoints lw 2 dt %d title "%s, %s"'
                     % (name, dash, label, schedule))
open(work + "/plots", "w").write(",".join(plots))
PY
plots=$(cat "$work/plots")
gnuplot <<GP
set terminal pngcairo size 900,540 noenhanced
set output "$png"
set title "NVMe bytes read per optimizer step against accumulation steps"
set xlabel "accumulation steps K (micro-batches per optimizer step)"
set ylabel "GB read per optimizer step"
set logscale x 2
set logscale y 10
set key right center
set grid
plot $plots
GP
