#!/usr/bin/env bash
# The include graph points one way: a source may include its own folder, the public headers
# (include/zinf/) and folders of lower layers, never a folder above it or a sibling of its own
# layer; a public header includes only public and system headers. Layers, lowest first (see
# docs/layout.md):
#   0 common/            1 nvme/, cpu_adam/     2 device/ (host/, cuda/, device_pool.h)
#   3 formats/, config/  4 engine/core/         5 engine/persistence/
#   6 engine/ (the façade and the optimizer pipeline)        7 interop/
#   8 c_api/, train/, bench/, python/, tests/, fuzz/ (users of everything below)
# Public headers (include/zinf/) have the layer of the code that implements them (public_layer_of):
# a source includes public headers of its layer or below, a public header those of its layer or
# below, so a format header never pulls in the Engine. A new public header needs a layer there.
# Both include forms count ("x/y.h" and <x/y.h>: the build puts the root on the include path);
# a relative include ("../y.h") is resolved against the including file. A source in a folder
# with no layer is an error (give it one here). Prints every arrow that points back up.
set -euo pipefail
cd "$(dirname "$0")/.."

# The folder a path belongs to: the longest of the known folders that prefixes it.
folder_of() {
  case "$1" in
    engine/core/*) echo engine/core ;;
    engine/persistence/*) echo engine/persistence ;;
    device/host/*) echo device/host ;;
    device/cuda/*) echo device/cuda ;;
    include/zinf/*) echo include/zinf ;;
    */*) echo "${1%%/*}" ;;
    *) echo . ;;
  esac
}
layer_of() {
  case "$1" in
    common) echo 0 ;;
    nvme | cpu_adam) echo 1 ;;
    device | device/host | device/cuda) echo 2 ;;
    formats | config) echo 3 ;;
    engine/core) echo 4 ;;
    engine/persistence) echo 5 ;;
    engine) echo 6 ;;
    interop) echo 7 ;;
    c_api | train | bench | python | tests | fuzz) echo 8 ;;
    *) echo "" ;;
  esac
}

# The layer of a public header: that of the folder implementing it.
public_layer_of() {
  case "${1##*/}" in
    status.h | align.h | log.h | crash_point.h | field_count.h) echo 0 ;;  # common/ (field_count.h: header-only)
    io.h | swap.h) echo 1 ;;                               # nvme/
    cpu_adam.h) echo 1 ;;                                  # cpu_adam/
    device.h | comm.h | cuda.h | runtime.h) echo 2 ;;      # device/
    config.h) echo 3 ;;                                    # config/
    safetensors.h) echo 3 ;;                               # formats/
    engine_types.h | plan.h) echo 4 ;;                     # engine/core/
    engine.h) echo 6 ;;                                    # engine/
    safetensors_engine.h) echo 7 ;;                        # interop/
    zinf.h) echo 8 ;;                                      # c_api/
    *) echo "" ;;
  esac
}

# The tracked sources and the new ones not yet added (every source outside build/ when this
# is not a git checkout).
list_sources() {
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files --cached --others --exclude-standard -- '*.h' '*.cc' '*.cu' '*.cuh'
  else
    find . -path ./build -prune -o -path './build-*' -prune -o -type f \( -name '*.h' \
      -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \) -print | sed 's|^\./||'
  fi
}

# A path with its "." and ".." parts folded away.
normalize() {
  local IFS=/ part
  local -a out=()
  for part in $1; do
    case "$part" in
      "" | .) ;;
      ..) [ ${#out[@]} -gt 0 ] && unset 'out[${#out[@]}-1]' ;;
      *) out+=("$part") ;;
    esac
  done
  echo "${out[*]}"
}

bad=0
checked=0
while IFS= read -r file; do
  [ -f "$file" ] || continue  # deleted in the work tree, not yet in the index
  from=$(folder_of "$file")
  if [ "$from" = include/zinf ]; then
    from_layer=$(public_layer_of "$file")
  else
    from_layer=$(layer_of "$from")
  fi
  if [ -z "$from_layer" ]; then
    echo "include_graph: $file has no layer ($from/); add it to scripts/include_graph.sh" >&2
    bad=1
    continue
  fi
  checked=$((checked + 1))
  dir=$(dirname "$file")
  while IFS= read -r target; do
    # A relative include names a file beside the source (or below/above it).
    if [[ "$target" == ../* || "$target" == ./* ]] || { [[ "$target" != */* ]] && [ -f "$dir/$target" ]; }; then
      target=$(normalize "$dir/$target")
    fi
    case "$target" in
      zinf/*)  # a public header: of this layer or below
        to_layer=$(public_layer_of "$target")
        if [ -z "$to_layer" ]; then
          echo "include_graph: $file includes \"$target\", a public header with no layer; add it to public_layer_of" >&2
          bad=1
        elif [ "$to_layer" -gt "$from_layer" ] && [ "$from_layer" -lt 8 ]; then
          echo "include_graph: $file includes \"$target\": layer $from_layer may not include a public header of layer $to_layer" >&2
          bad=1
        fi
        continue
        ;;
    esac
    [ -f "$target" ] || continue  # a system or third-party header
    to=$(folder_of "$target")
    to_layer=$(layer_of "$to")
    if [ "$from" = include/zinf ]; then
      echo "include_graph: $file includes \"$target\": a public header includes only zinf/ and system headers" >&2
      bad=1
      continue
    fi
    [ "$to" = "$from" ] && continue
    # The device backends share device/'s own headers; the other way round is not allowed.
    if [ "$to" = device ] && [[ "$from" == device/* ]]; then continue; fi
    if [ -z "$to_layer" ] || { [ "$to_layer" -ge "$from_layer" ] && [ "$from_layer" -lt 8 ]; }; then
      echo "include_graph: $file includes \"$target\": $from (layer $from_layer) may not include $to (layer ${to_layer:-none})" >&2
      bad=1
    fi
  done < <(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*["<]\([^">]*\)[">].*/\1/p' "$file")
done < <(list_sources)
if [ $bad -ne 0 ]; then
  echo "include_graph: arrows point back up; move the code to the lower layer or pass it in" >&2
  exit 1
fi
echo "include_graph: $checked sources, every include points down or sideways within its folder"
