#!/usr/bin/env bash
# Installs every system dependency of the project from Debian packages.
# Idempotent: packages already present are not touched, and apt-get runs only when something
# is missing. Usage: scripts/setup.sh [--with-torch] [--with-fuzz]   (--with-torch adds PyTorch
# and OpenBLAS, needed only to regenerate golden fixtures and to run the PyTorch comparison
# benchmarks; --with-fuzz adds clang and libFuzzer for scripts/fuzz.sh).
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config ccache git
  libeigen3-dev nlohmann-json3-dev libgtest-dev libgmock-dev libbenchmark-dev
  libopenmpi-dev openmpi-bin libutf8proc-dev libcli11-dev clang-format
  python3 python3.11-doc
)
for option in "$@"; do
  case "$option" in
    --with-torch) packages+=(python3-torch python3-numpy libopenblas0-pthread) ;;
    --with-fuzz) packages+=(clang libclang-rt-14-dev libomp-dev) ;;
    *) echo "setup: error: unknown option '$option' (allowed: --with-torch, --with-fuzz)" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  sudo_cmd=()
  if [[ $(id -u) -ne 0 ]]; then sudo_cmd=(sudo); fi
  # apt and dpkg print a screen per package: keep it in a log, show it only on failure.
  log=$(mktemp /tmp/pipefisher-setup.XXXXXX.log)
  echo "setup: installing ${#missing[@]} Debian package(s): ${missing[*]} (log: $log)"
  if ! { "${sudo_cmd[@]}" apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq \
      --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "setup: apt-get failed (full log: $log)" >&2
    exit 1
  fi
  echo "setup: installed"
fi
