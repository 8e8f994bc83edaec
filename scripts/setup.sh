#!/usr/bin/env bash
# Installs every system dependency of the project from Debian packages.
# Idempotent: packages already present are not touched, and apt-get runs only when something
# is missing. Usage: scripts/setup.sh [--with-torch] [--with-fuzz]   (--with-torch adds PyTorch
# from PyPI (MKL, oneDNN: the baseline a user would pick) in the venv $PF_TORCH_VENV, default
# .venv-torch/ in the checkout, needed only for the PyTorch parity test, the golden fixtures and
# the PyTorch comparison benchmarks; --with-fuzz adds clang and libFuzzer for scripts/fuzz.sh).
set -euo pipefail

with_torch=0
packages=(
  build-essential cmake ninja-build pkg-config ccache git
  libeigen3-dev libopenblas-pthread-dev nlohmann-json3-dev libgtest-dev libgmock-dev libbenchmark-dev
  libopenmpi-dev openmpi-bin libutf8proc-dev libcli11-dev clang-format
  python3 python3.11-doc
)
for option in "$@"; do
  case "$option" in
    --with-torch) with_torch=1 packages+=(python3-venv) ;;
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

# PyTorch from PyPI, not Debian's python3-torch (1.13 on OpenBLAS): the benchmarks compare with
# what a user would install. Kept in a venv so the system Python stays untouched.
if ((with_torch)); then
  venv=${PF_TORCH_VENV:-"$(cd "$(dirname "$0")/.." && pwd)/.venv-torch"}
  if "$venv/bin/python" -c 'import torch, numpy' >/dev/null 2>&1; then
    echo "setup: PyTorch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') in $venv"
  else
    echo "setup: installing PyTorch and numpy from PyPI into $venv (several GB, minutes)"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check torch numpy
    echo "setup: PyTorch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') in $venv"
  fi
fi
