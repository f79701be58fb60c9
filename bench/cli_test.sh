#!/usr/bin/env bash
# The benches' command lines: every bad flag exits 2 with a "zinf-...-bench:" or CLI11 line,
# --help states the exit-status convention, and zinf-nvme-bench leaves no file behind (after
# a run, and after SIGTERM). Usage: cli_test.sh BENCH_DIR SCRATCH_DIR
set -uo pipefail
bin=$1
work=$(mktemp -d "${2:-/var/tmp}/zinf-bench-cli-XXXXXX")
trap 'rm -rf "$work"' EXIT
fails=0
expect() {  # expect CODE TEXT -- command...
  local code=$1 text=$2
  shift 3
  local out rc
  out=$("$@" 2>&1)
  rc=$?
  if [[ $rc -ne $code || "$out" != *"$text"* ]]; then
    echo "FAIL: $* -> exit $rc (want $code), output: ${out:0:400}"
    fails=$((fails + 1))
  fi
}
nvme=$bin/zinf-nvme-bench
adam=$bin/zinf-adam-bench
engine=$bin/zinf-engine-bench
for b in "$nvme" "$adam" "$engine"; do
  expect 0 "Exit status: 0 done; 1 the run failed" -- "$b" --help
  expect 2 "" -- "$b" --no-such-flag
done
expect 2 "--size 4K is smaller than the block size" -- "$nvme" --dir "$work" --size 4K --block-size 1M
expect 2 "multiple of 4K" -- "$nvme" --dir "$work" --block-size 1000
expect 2 "multiple of 4K" -- "$nvme" --dir "$work" --block-size 1M,1000
expect 2 "take one --block-size" -- "$nvme" --dir "$work" --block-size 1M,8M --op mixed
expect 2 "not a finite number" -- "$nvme" --dir "$work" --seconds nan
expect 2 "" -- "$nvme" --dir "$work" --queue-depth 0
expect 2 "" -- "$nvme" --dir "$work/missing"
expect 2 "" -- "$adam" --threads 0
expect 2 "" -- "$engine" --zero-stage 4
expect 2 "" -- "$engine" --offload-cycles -1
expect 2 "" -- "$engine" --quantized-gradient-bits 3
expect 2 "" -- "$engine" --quantization-block-size 100
expect 2 "" -- "$adam" --n 0
expect 2 "unknown value" -- "$adam" --optimizer sgd --n 1024
expect 2 "unknown value" -- "$adam" --state-dtype fp16 --n 1024
# Compressed states: the bytes counted are the stored ones (bf16 gradients and copy: 12 B,
# plus 2 x 2 B bf16 states or 2 x (1 + 4/256) B int8 states), each against fp32 in the run.
out=$("$adam" --n 70000 --repeats 1 --warmup 0 --grad-dtype bf16 --param-out bf16 \
  --state-dtype fp32,bf16,int8 2>&1)
for want in '"state_dtype":"bf16"' '"bytes_per_elem":20.0' '"state_dtype":"int8"' \
  '"bytes_per_elem":16.0' '"ns_vs_fp32"'; do
  [[ $out == *"$want"* ]] || { echo "FAIL: zinf-adam-bench --state-dtype: no $want in: $out"; fails=$((fails + 1)); }
done
expect 2 "" -- "$engine" --compute-ms nan
expect 2 "" -- "$engine" --param-tier disk
expect 2 "" -- "$engine" --layer-elems 0
# A short read run: the bench file is gone afterwards.
expect 0 "gbps" -- "$nvme" --dir "$work" --size 8M --block-size 1M --seconds 0.2 --op read
if compgen -G "$work/zinf-bench-*" >/dev/null; then
  echo "FAIL: zinf-nvme-bench left $(ls "$work")"
  fails=$((fails + 1))
fi
# --keep-files keeps it (and the next run reuses it); a plain run then removes it.
expect 0 "gbps" -- "$nvme" --dir "$work" --size 8M --block-size 1M --seconds 0.2 --op read --keep-files
[[ -f $work/zinf-bench-0.dat ]] || { echo "FAIL: --keep-files removed the file"; fails=$((fails + 1)); }
expect 0 "gbps" -- "$nvme" --dir "$work" --size 8M --block-size 1M --seconds 0.2 --op read
[[ ! -e $work/zinf-bench-0.dat ]] || { echo "FAIL: the kept file outlived a plain run"; fails=$((fails + 1)); }
# --fio-variants: known names only, with --compare-fio.
expect 2 "unknown variant 'fio-nope'" -- "$nvme" --dir "$work" --compare-fio --fio-variants fio-libaio,fio-nope
expect 2 "needs --compare-fio" -- "$nvme" --dir "$work" --fio-variants fio-libaio
# The paired ratio is the median of each repeat's zinf / fio, not the ratio of the medians:
# a stand-in fio reports 1, 1, 4, 4 GB/s in turn (1 MB in 1 or 0.25 ms), so that with zinf
# at Z the first is about 0.625 Z and the second 0.4 Z. Only the variant asked for runs (no
# huge pages are set up for it), and the order alternates: zinf first in repeats 0 and 2.
cat > "$work/fio" <<'SH'
#!/bin/sh
n=$(cat "$0.count" 2>/dev/null || echo 0)
echo $((n + 1)) > "$0.count"
if [ "$n" -lt 2 ]; then ms=1; else ms=0.25; fi
echo "{\"jobs\":[{\"read\":{\"io_bytes\":1000000,\"runtime\":$ms}}]}"
SH
chmod +x "$work/fio"
out=$("$nvme" --dir "$work" --size 8M --block-size 1M --seconds 0.2 --op read --repeats 4 \
  --compare-fio --fio-variants fio-libaio --fio "$work/fio" 2>&1)
if ! /usr/bin/python3 - "$out" <<'PY'; then
import json, statistics, sys
lines = [json.loads(l) for l in sys.argv[1].splitlines() if l.startswith("{")]
runs = [j for j in lines if "repeat" in j]
zinf = {j["repeat"]: j["gbps"] for j in runs if j["backend"] == "io_uring"}
fio = {j["repeat"]: j["gbps"] for j in runs if j["backend"] == "fio-libaio"}
assert fio == {0: 1.0, 1: 1.0, 2: 4.0, 3: 4.0}, fio
assert len(zinf) == 4, zinf
for j in runs:
    zinf_first = j["repeat"] % 2 == 0
    assert j["first"] == ("zinf" if zinf_first else "fio-libaio"), j
    assert j["position"] == (0 if zinf_first == (j["backend"] == "io_uring") else 1), j
(summary,) = [j for j in lines if "case" in j]
assert list(summary["fio_gbps"]) == ["fio-libaio"], summary
tol = lambda x: 2e-3 * x + 1e-3
want = statistics.median(zinf[r] / fio[r] for r in range(4))
got = summary["paired_ratio"]["fio-libaio"]
assert abs(got - want) <= tol(want), (got, want, zinf, fio)
assert summary["paired_ratio_vs_best"] == got, summary
of_medians = statistics.median(zinf.values()) / 2.5
assert abs(summary["ratio"] - of_medians) <= tol(of_medians), (summary, of_medians)
PY
  echo "FAIL: --fio-variants / paired_ratio / the run order: $out"
  fails=$((fails + 1))
fi
rm -f "$work/fio.count"
# Three tools: in repeat r the k-th run is tool (r + k) mod 3 (zinf, fio-io_uring,
# fio-io_uring-fixedbufs), each repeat's lines name its first tool, every variant ran 3
# repeats, and with no fio-libaio and no huge-page variant asked for, neither is reported.
printf '#!/bin/sh\necho "{\\"jobs\\":[{\\"read\\":{\\"io_bytes\\":1000000,\\"runtime\\":1}}]}"\n' > "$work/fio"
out=$("$nvme" --dir "$work" --size 8M --block-size 1M --seconds 0.2 --op read --repeats 3 \
  --compare-fio --fio-variants fio-io_uring-fixedbufs,fio-io_uring --fio "$work/fio" 2>&1)
if ! /usr/bin/python3 - "$out" <<'PY'; then
import json, sys
lines = [json.loads(l) for l in sys.argv[1].splitlines() if l.startswith("{")]
tools = ["io_uring", "fio-io_uring", "fio-io_uring-fixedbufs"]
runs = [j for j in lines if "repeat" in j]
assert len(runs) == 9, runs
for r in range(3):
    order = [j["backend"] for j in runs if j["repeat"] == r]
    assert order == [tools[(r + k) % 3] for k in range(3)], (r, order)
    for k, j in enumerate(j for j in runs if j["repeat"] == r):
        assert j["position"] == k, j
        assert j["first"] == ("zinf" if order[0] == "io_uring" else order[0]), j
(summary,) = [j for j in lines if "case" in j]
assert "fio_libaio_gbps" not in summary, summary
assert summary["fio_repeats"] == {"fio-io_uring": 3, "fio-io_uring-fixedbufs": 3}, summary
assert summary["fio_huge_pages"].startswith("no: not asked for"), summary
PY
  echo "FAIL: three-tool rotation / summary fields: $out"
  fails=$((fails + 1))
fi
expect 2 "not mixed" -- "$nvme" --dir "$work" --compare-fio --op mixed --fio-variants fio-libaio
# SIGTERM in the middle of a long write run: nothing left.
# (With --compare-fio the file keeps its name for fio: here a stand-in that just waits.)
printf '#!/bin/sh\nexec sleep 4\n' > "$work/fio"
chmod +x "$work/fio"
# (As root the bench mounts hugetlbfs and reserves huge pages for fio first: SIGTERM must give
# both back.)
pages_before=$(cat /proc/sys/vm/nr_hugepages 2>/dev/null || echo none)
mounts_before=$(grep -c zinf-hugetlbfs /proc/mounts)
"$nvme" --dir "$work" --size 16M --block-size 1M --seconds 30 --op read --compare-fio --fio "$work/fio" >/dev/null 2>&1 &
pid=$!
sleep 2
kill -TERM $pid
wait $pid
rc=$?
[[ $rc -eq 143 ]] || { echo "FAIL: the bench was not stopped by SIGTERM (exit $rc)"; fails=$((fails + 1)); }
pages_after=$(cat /proc/sys/vm/nr_hugepages 2>/dev/null || echo none)
[[ $pages_after == "$pages_before" ]] || {
  echo "FAIL: SIGTERM left nr_hugepages at $pages_after (was $pages_before)"; fails=$((fails + 1)); }
[[ $(grep -c zinf-hugetlbfs /proc/mounts) -eq $mounts_before ]] || {
  echo "FAIL: SIGTERM left a hugetlbfs mount: $(grep zinf-hugetlbfs /proc/mounts)"; fails=$((fails + 1)); }
sleep 4  # the stand-in fio ends
if compgen -G "$work/zinf-bench-*" >/dev/null; then
  echo "FAIL: a SIGTERM'ed zinf-nvme-bench left $(ls "$work")"
  fails=$((fails + 1))
fi
# zinf-engine-bench's summary: the compute-idle figure lies within the step, and bf16
# gradient transfer moves half the fp32 run's bytes to the host.
expect 2 "" -- "$engine" --gradient-transfer fp16
small=(--layers 3 --layer-elems 65536 --steps 3 --param-tier cpu --compute-ms 1
       --sub-group-elems 65536 --prefetch-elems 65536 --optimizer-threads 1 --nvme "$work")
fp32=$("$engine" "${small[@]}" 2>/dev/null | tail -n 1)
bf16=$("$engine" "${small[@]}" --gradient-transfer bf16 2>/dev/null | tail -n 1)
if ! /usr/bin/python3 - "$fp32" "$bf16" <<'PY'; then
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for j in (a, b):
    assert 0 <= j["median_compute_idle_seconds"] <= j["median_step_seconds"], j
    assert 0 <= j["median_compute_idle_fraction"] < 1, j
assert a["gradient_transfer"] == "fp32" and b["gradient_transfer"] == "bf16", (a, b)
assert a["median_d2h_bytes"] == 3 * 65536 * 4 and b["median_d2h_bytes"] * 2 == a["median_d2h_bytes"], (a, b)
# CPU seconds: the process's within the cores' time, its parts within it.
for j in (a, b):
    assert j["cpu_cores"] >= 1, j
    assert 0 < j["median_cpu_seconds_total"] <= 1.1 * j["cpu_cores"] * j["median_step_seconds"] + 0.01, j
    assert 0 <= j["median_cpu_seconds_trainer"] <= j["median_cpu_seconds_total"] + 0.01, j
    assert 0 <= j["median_cpu_seconds_optimizer"] <= j["median_cpu_seconds_total"] + 0.01, j
    assert 0 < j["median_cpu_utilisation"] <= 1.1, j
    assert j["speculated_groups"] == 0, j  # (no clipping)
PY
  echo "FAIL: zinf-engine-bench summaries: $fp32 / $bf16"
  fails=$((fails + 1))
fi
# Clipping below the bench's norm: with speculation every speculated sub-group is redone, none
# kept; with it off, none is speculated.
clip_on=$("$engine" "${small[@]}" --gradient-clipping 0.01 --speculative-step on 2>/dev/null | tail -n 1)
clip_off=$("$engine" "${small[@]}" --gradient-clipping 0.01 --speculative-step off 2>/dev/null | tail -n 1)
if ! /usr/bin/python3 - "$clip_on" "$clip_off" <<'PY'; then
import json, sys
on, off = json.loads(sys.argv[1]), json.loads(sys.argv[2])
assert on["gradient_clipping"] == 0.01 and on["speculative_step"] == "on", on
assert on["kept_groups"] == 0 and on["redone_groups"] == on["speculated_groups"], on
assert off["speculated_groups"] == 0 and off["redone_groups"] == 0, off
PY
  echo "FAIL: zinf-engine-bench with clipping: $clip_on / $clip_off"
  fails=$((fails + 1))
fi
# --nproc 2: the engine's collectives traced and replayed by gloo alone. Counts and bytes, not
# times: 3 layers gather 5 times (the last layer's backward keeps its forward gather) and reduce
# 3 gradients, 32768 elements per rank each; with ZeRO++ as int8 blocks of 256 plus a scale.
# The traced collectives belong to the step that issued them; the counters' medians count them
# as they complete, so a prefetch issued at a step's end may land in the next: those are within
# one collective of the traced bytes.
plain=$("$engine" "${small[@]}" --nproc 2 2>/dev/null | tail -n 1)
zpp=$("$engine" "${small[@]}" --nproc 2 --quantized-weights --quantized-gradients 2>/dev/null | tail -n 1)
if ! /usr/bin/python3 - "$plain" "$zpp" <<'PY'; then
import json, sys
plain, zpp = json.loads(sys.argv[1]), json.loads(sys.argv[2])
part = 65536 // 2
one = {id(plain): part * 4, id(zpp): part + part // 256 * 4}  # one collective's bytes
assert plain["collective_bytes_sent"] == 8 * part * 4, plain
assert zpp["collective_bytes_sent"] == 8 * (part + part // 256 * 4), zpp
for j in (plain, zpp):
    assert j["ranks"] == 2 and j["peer"].startswith("gloo alone replaying"), j
    assert j["collectives_per_step"] == 8, j
    assert abs(j["median_comm_bytes_sent"] - j["collective_bytes_sent"]) <= one[id(j)], j
    assert 0 < j["median_collective_seconds"] <= j["median_collective_seconds_with_waits"], j
    assert j["peer_seconds"] > 0 and j["collective_efficiency"] > 0, j
PY
  echo "FAIL: zinf-engine-bench --nproc 2: $plain / $zpp"
  fails=$((fails + 1))
fi
# 4 ranks as 2 nodes (hpZ) with all of ZeRO++: 3 gathers across every rank, the backward's
# 2 from the node's shards, 2 all-to-alls (node, then across) per gradient; the sub-groups'
# bytes are the collectives', not the job communicator's counters.
hpz=$("$engine" "${small[@]}" --nproc 4 --quantized-weights --quantized-gradients \
      --hpz-partition-size 2 2>/dev/null | tail -n 1)
if ! /usr/bin/python3 - "$hpz" <<'PY'; then
import json, sys
j = json.loads(sys.argv[1])
assert j["ranks"] == 4 and j["collectives_per_step"] == 11, j
assert j["collective_bytes_sent"] > j["median_comm_bytes_sent"] > 0, j
assert 0 < j["median_collective_seconds"] <= j["median_collective_seconds_with_waits"], j
PY
  echo "FAIL: zinf-engine-bench --nproc 4 with hpZ: $hpz"
  fails=$((fails + 1))
fi
echo "$fails failure(s)"
[[ $fails -eq 0 ]]
