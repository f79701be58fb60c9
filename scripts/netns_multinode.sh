#!/usr/bin/env bash
# Two "nodes" x two ranks on this one machine: two network namespaces joined by a veth pair,
# addresses from the benchmarking range 198.18.0.0/15 (RFC 2544) inside the namespaces only, so
# the ranks' traffic crosses a real network stack between the nodes. Node A runs ranks 0 and 1
# (rank 0 serves the rendezvous store at MASTER_ADDR=198.18.0.1), node B ranks 2 and 3; every
# rank is a zinf-train process started the way a launcher would (RANK, WORLD_SIZE, LOCAL_RANK,
# LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). The loss curve must match one rank with four
# times the batch within 0.5 %. Then the same 2 x 2 with every parameter gathered on every use,
# plain and with ZeRO++'s hpZ (--hpz-partition-size 2: the nodes' gloo sub-groups): the same
# losses bit for bit.
#
# Usage: scripts/netns_multinode.sh ZINF_TRAIN_BIN CORPUS
# Exit 77 (skipped, with the reason) where namespaces cannot be made (not root, no `ip`, a
# container without CAP_NET_ADMIN). Everything it creates (namespaces, processes, folders) is
# removed on exit, processes by their pid.
set -u
BIN=$1
DATA=$2
TAG="zinf$$"
NS_A="${TAG}a"
NS_B="${TAG}b"
WORK=$(mktemp -d "${ZINF_TEST_DIR:-/var/tmp}/zinf-netns-XXXXXX")
PIDS=()

cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
  ip netns del "$NS_A" 2>/dev/null
  ip netns del "$NS_B" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT

skip() { echo "SKIPPED: $*"; exit 77; }
command -v ip >/dev/null || skip "no ip command (iproute2)"
[ "$(id -u)" = 0 ] || skip "network namespaces need root"
ip netns add "$NS_A" 2>"$WORK/err" || skip "ip netns add failed: $(cat "$WORK/err")"
ip netns add "$NS_B" || skip "ip netns add failed"
ip link add "${TAG}va" type veth peer name "${TAG}vb" || skip "no veth pairs here"
ip link set "${TAG}va" netns "$NS_A" && ip link set "${TAG}vb" netns "$NS_B" || exit 1
ip -n "$NS_A" addr add 198.18.0.1/24 dev "${TAG}va" || exit 1
ip -n "$NS_B" addr add 198.18.0.2/24 dev "${TAG}vb" || exit 1
for ns in "$NS_A" "$NS_B"; do
  ip -n "$ns" link set lo up || exit 1
done
ip -n "$NS_A" link set "${TAG}va" up && ip -n "$NS_B" link set "${TAG}vb" up || exit 1
# The nodes see each other only through the veth pair (each namespace has its own loopback).

ARGS=(--steps 8 --batch 2 --seq 64 --warmup 2 --data "$DATA" --json)
EXTRA=()
start_rank() {  # ns rank local_rank out-prefix
  ip netns exec "$1" env RANK="$2" WORLD_SIZE=4 LOCAL_RANK="$3" LOCAL_WORLD_SIZE=2 \
    MASTER_ADDR=198.18.0.1 MASTER_PORT=29511 OPENBLAS_NUM_THREADS=1 \
    timeout 300 "$BIN" "${ARGS[@]}" "${EXTRA[@]}" --nvme "$WORK/swap-$4-$1" >"$WORK/$4$2" \
    2>"$WORK/err$4$2" &
  PIDS+=($!)
}
run_four() {  # out-prefix
  start_rank "$NS_A" 0 0 "$1"
  start_rank "$NS_A" 1 1 "$1"
  start_rank "$NS_B" 2 0 "$1"
  start_rank "$NS_B" 3 1 "$1"
  local rc=0
  for i in 0 1 2 3; do
    wait "${PIDS[$i]}" || { echo "FAIL: rank $i exited with $?"; cat "$WORK/err$1$i"; rc=1; }
  done
  PIDS=()
  return $rc
}
run_four out || exit 1
# The collectives between the nodes really went through the veth pair.
TX=$(ip -n "$NS_B" -s -j link show "${TAG}vb" | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["stats64"]["tx"]["bytes"])')
echo "node B sent $TX bytes through its veth"
[ "$TX" -gt 50000000 ] || { echo "FAIL: only $TX bytes crossed the veth pair"; exit 1; }
OPENBLAS_NUM_THREADS=1 timeout 300 "$BIN" --steps 8 --batch 8 --seq 64 --warmup 2 --data "$DATA" \
  --json --nvme "$WORK/swap-one" >"$WORK/one" 2>"$WORK/errone" || { cat "$WORK/errone"; exit 1; }
/usr/bin/python3 - "$WORK/out0" "$WORK/one" <<'PY' || exit 1
import json, sys
four = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
one = json.loads(open(sys.argv[2]).read().strip().splitlines()[-1])
assert four["ranks"] == 4 and one["ranks"] == 1, (four["ranks"], one["ranks"])
worst = max(abs(a - b) / b for a, b in zip(four["losses"], one["losses"]))
print("2 nodes x 2 ranks over veth: losses", ["%.5f" % x for x in four["losses"]])
print("1 rank, 4x the batch:         losses", ["%.5f" % x for x in one["losses"]])
print("largest relative difference %.2e (limit 5e-3)" % worst)
assert len(four["losses"]) == 8 and worst < 5e-3
PY
# ZeRO++'s hpZ with the nodes as they are (K = LOCAL_WORLD_SIZE = 2), every parameter gathered
# on every use and released for good (the backward's gathers then come from the node's shards,
# through a gloo sub-group split from the job's): the same bits as plain ZeRO-3.
echo '{"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
  "stage3_max_reuse_distance": 0}}' >"$WORK/every_use.json"
tx() { ip -n "$NS_B" -s -j link show "${TAG}vb" | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["stats64"]["tx"]["bytes"])'; }
run_counted() {  # out-prefix: runs the four ranks, writes the bytes node B sent to $WORK/tx-prefix
  local before
  before=$(tx)
  run_four "$1" || return 1
  echo $(($(tx) - before)) >"$WORK/tx-$1"
}
EXTRA=(--config "$WORK/every_use.json")
run_counted plain || exit 1
EXTRA=(--config "$WORK/every_use.json" --hpz-partition-size 2)
run_counted hpz || exit 1
# And qgZ in two hops (the gloo group across the nodes too): within 2 % of plain's losses.
EXTRA=(--config "$WORK/every_use.json" --hpz-partition-size 2 --quantized-gradients)
run_counted qgz || exit 1
/usr/bin/python3 - "$WORK" <<'PY' || exit 1
import json, sys
w = sys.argv[1]
run = {k: json.loads(open("%s/%s0" % (w, k)).read().strip().splitlines()[-1])
       for k in ("plain", "hpz", "qgz")}
sent = {k: int(open("%s/tx-%s" % (w, k)).read()) for k in run}
for k in run:
    assert run[k]["ranks"] == 4 and len(run[k]["losses"]) == 8, (k, run[k])
    print("%-5s 2 nodes x 2 ranks: node B sent %9d bytes, losses %s" %
          (k, sent[k], ["%.5f" % x for x in run[k]["losses"]]))
assert run["hpz"]["losses"] == run["plain"]["losses"], "hpZ changed the losses"
# The backward's gathers stayed inside the nodes.
assert sent["hpz"] < 0.85 * sent["plain"], sent
worst = max(abs(a - b) / b for a, b in zip(run["qgz"]["losses"], run["plain"]["losses"]))
assert worst < 0.02 and sent["qgz"] < 0.6 * sent["plain"], (worst, sent)
print("hpZ: the same losses, bit for bit, as plain ZeRO-3, on %.2fx the bytes; with qgZ in two "
      "hops within %.2e of them on %.2fx" % (sent["hpz"] / sent["plain"], worst,
                                             sent["qgz"] / sent["plain"]))
PY
echo "PASSED"
