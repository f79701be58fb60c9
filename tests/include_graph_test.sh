#!/usr/bin/env bash
# scripts/include_graph.sh against small trees with planted arrows: each must be refused with
# its own message, and the clean tree accepted (so the check cannot pass by checking nothing).
set -uo pipefail
script="$(cd "$(dirname "$0")/.." && pwd)/scripts/include_graph.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fails=0

# A tree: the script, and the given files ("path:include path:include ...").
make_tree() {
  local tree=$1
  shift
  rm -rf "$tree"
  mkdir -p "$tree/scripts"
  cp "$script" "$tree/scripts/"
  local spec path target
  for spec in "$@"; do
    path=${spec%%:*}
    mkdir -p "$tree/$(dirname "$path")"
    : >>"$tree/$path"
    if [ "$spec" != "$path" ]; then
      for target in ${spec#*:}; do echo "#include \"$target\"" >>"$tree/$path"; done
    fi
  done
}
# expect RC TEXT -- files...: the check's exit status and a text its output holds.
expect() {
  local rc=$1 want=$2
  shift 3
  make_tree "$work/t" "$@"
  local out got
  # (Not a git tree even where $TMPDIR lies inside one: the script then lists files itself.)
  out=$(GIT_CEILING_DIRECTORIES="$work" bash "$work/t/scripts/include_graph.sh" 2>&1)
  got=$?
  if [ "$got" != "$rc" ] || [[ "$out" != *"$want"* ]]; then
    echo "FAIL: expected exit $rc and \"$want\" for $*; got $got: $out"
    fails=$((fails + 1))
  fi
}

clean=(include/zinf/status.h include/zinf/engine.h:zinf/status.h
       include/zinf/safetensors.h:zinf/status.h formats/f.cc:zinf/safetensors.h
       engine/e.cc:zinf/engine.h)
expect 0 "every include points down" -- "${clean[@]}"
# A format header that pulls in the Engine (layer 3 -> 6).
expect 1 "include/zinf/safetensors.h includes \"zinf/engine.h\": layer 3 may not include a public header of layer 6" -- \
  include/zinf/status.h include/zinf/engine.h include/zinf/safetensors.h:zinf/engine.h
# A source below the façade that includes it (engine/core, layer 4 -> 6).
expect 1 "engine/core/c.cc includes \"zinf/engine.h\": layer 4 may not include a public header of layer 6" -- \
  include/zinf/engine.h engine/core/c.cc:zinf/engine.h
# The device layer including the configuration (2 -> 3).
expect 1 "layer 2 may not include a public header of layer 3" -- \
  include/zinf/config.h device/host/h.cc:zinf/config.h
# A public header nobody placed.
expect 1 "a public header with no layer" -- include/zinf/new_thing.h engine/e.cc:zinf/new_thing.h
# A source folder with no layer, and an arrow up between source folders.
expect 1 "has no layer" -- newdir/x.cc
expect 1 "may not include engine" -- engine/e.h formats/f.cc:engine/e.h
if [ $fails -ne 0 ]; then
  echo "include_graph_test: $fails failed"
  exit 1
fi
echo "include_graph_test: the planted arrows are refused, the clean tree accepted"
