#!/usr/bin/env bash
# Installs the Debian 12 packages zinf needs to build, test and benchmark, when missing
# (with the argument `fuzz`, also what scripts/fuzz.sh needs).
# Run as root (or with sudo available); a non-root user without sudo gets the list to install.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  liburing-dev libaio-dev libtbb-dev libhwloc-dev libxxhash-dev
  nlohmann-json3-dev libcli11-dev libopenblas-dev libgloo-dev
  libgtest-dev libgmock-dev
  fio
  # The Python package (python/) and its tests: Debian's interpreter, torch and pytest.
  pybind11-dev python3-dev python3-torch python3-pytest python3-venv python3-pip
)
# `scripts/deps.sh fuzz`: also clang and its libFuzzer runtime (scripts/fuzz.sh).
if [ "${1:-}" = "fuzz" ]; then
  PACKAGES+=(clang libclang-rt-14-dev)
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "zinf: installing missing Debian packages: ${missing[*]}" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
  else
    echo "zinf: not root and no sudo; install these packages, then run again: ${missing[*]}" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
