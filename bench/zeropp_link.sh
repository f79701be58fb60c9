#!/usr/bin/env bash
# ZeRO++ over a slow link between two "nodes" on this machine: two network namespaces x two
# zinf-train ranks (the layout of scripts/netns_multinode.sh), the veth pair between them
# limited by a tc token-bucket filter (tbf) on both ends. Each case runs the same training and
# prints one JSON line: the link's rate, the case's flags, the bytes that crossed the link each
# way (the veth counters of node B, before and after the run), rank 0's training time and
# losses.
#
# Usage: bench/zeropp_link.sh ZINF_TRAIN_BIN CORPUS STEPS "MBIT FLAGS..." ["MBIT FLAGS..." ...]
#   e.g. bench/zeropp_link.sh build/train/zinf-train train/data/corpus.txt 8 \
#          "100" "100 --quantized-weights" "400"
# ZINF_TRAIN_BIN may instead be python/examples/finetune.py (run by /usr/bin/python3 with the
# caller's PYTHONPATH, e.g. build/python): the LoRA fine-tune with an int8 base, the flags being
# finetune.py's (--preset, --lora, --frozen-weight-dtype, --config ...).
# Root only (namespaces, tc). Everything it creates is removed on exit, processes by their pid.
set -u
BIN=$1
DATA=$2
STEPS=$3
shift 3
TAG="zpp$$"
NS_A="${TAG}a"
NS_B="${TAG}b"
WORK=$(mktemp -d "${ZINF_TEST_DIR:-/var/tmp}/zinf-zeropp-XXXXXX")
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
  ip netns del "$NS_A" 2>/dev/null
  ip netns del "$NS_B" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
[ "$(id -u)" = 0 ] || { echo "needs root (network namespaces, tc)"; exit 77; }
ip netns add "$NS_A" && ip netns add "$NS_B" || exit 1
ip link add "${TAG}va" type veth peer name "${TAG}vb" || exit 1
ip link set "${TAG}va" netns "$NS_A" && ip link set "${TAG}vb" netns "$NS_B" || exit 1
ip -n "$NS_A" addr add 198.18.0.1/24 dev "${TAG}va" || exit 1
ip -n "$NS_B" addr add 198.18.0.2/24 dev "${TAG}vb" || exit 1
for ns in "$NS_A" "$NS_B"; do ip -n "$ns" link set lo up || exit 1; done
ip -n "$NS_A" link set "${TAG}va" up && ip -n "$NS_B" link set "${TAG}vb" up || exit 1

counter() {  # tx | rx bytes of node B's veth
  ip -n "$NS_B" -s -j link show "${TAG}vb" |
    /usr/bin/python3 -c "import json,sys; print(json.load(sys.stdin)[0]['stats64']['$1']['bytes'])"
}
port=29600
for case in "$@"; do
  read -r mbit flags <<<"$case"
  for pair in "$NS_A ${TAG}va" "$NS_B ${TAG}vb"; do
    read -r ns dev <<<"$pair"
    tc -n "$ns" qdisc replace dev "$dev" root tbf rate "${mbit}mbit" burst 256kb latency 100ms ||
      exit 1
  done
  tx0=$(counter tx)
  rx0=$(counter rx)
  port=$((port + 1))
  PIDS=()
  i=0
  for ns in "$NS_A" "$NS_A" "$NS_B" "$NS_B"; do
    if [[ "$BIN" == *.py ]]; then
      run=(/usr/bin/python3 "$BIN" --threads 1)
    else
      run=("$BIN" --batch 2 --seq 64 --warmup 1)
    fi
    # shellcheck disable=SC2086  # (the case's flags, split)
    ip netns exec "$ns" env RANK=$i WORLD_SIZE=4 LOCAL_RANK=$((i % 2)) LOCAL_WORLD_SIZE=2 \
      MASTER_ADDR=198.18.0.1 MASTER_PORT=$port OPENBLAS_NUM_THREADS=1 \
      PYTHONPATH="${PYTHONPATH:-}" \
      timeout 900 "${run[@]}" --steps "$STEPS" --data "$DATA" --json \
      --nvme "$WORK/swap-$i" $flags >"$WORK/out$i" 2>"$WORK/err$i" &
    PIDS+=($!)
    i=$((i + 1))
  done
  rc=0
  for j in 0 1 2 3; do
    wait "${PIDS[$j]}" || { echo "rank $j failed:"; tail -5 "$WORK/err$j"; rc=1; }
  done
  PIDS=()
  [ $rc = 0 ] || exit 1
  tx1=$(counter tx)
  rx1=$(counter rx)
  /usr/bin/python3 - "$WORK/out0" "$mbit" "$flags" $((tx1 - tx0)) $((rx1 - rx0)) "$STEPS" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
steps = int(sys.argv[6])
# zinf-train's line, or finetune.py's (its step times, no dtype field).
train = r["train_seconds"] if "train_seconds" in r else sum(r["step_seconds"])
print(json.dumps({"link_mbit": float(sys.argv[2]), "flags": sys.argv[3],
                  "node_b_tx_bytes": int(sys.argv[4]), "node_b_rx_bytes": int(sys.argv[5]),
                  "link_bytes_per_step": (int(sys.argv[4]) + int(sys.argv[5])) / steps,
                  "train_seconds": train, "tokens_per_s": r["tokens_per_s"],
                  "losses": r["losses"], "param_dtype": r.get("param_dtype"),
                  "frozen_weight_dtype": r.get("frozen_weight_dtype")}))
PY
done
