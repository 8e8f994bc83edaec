# Sourced by the scripts: finds a CUDA toolkit that is installed but not on PATH.
if ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
PF_JOBS=${PF_JOBS:-$(nproc)}
PF_LAUNCHER=()
if command -v ccache >/dev/null 2>&1; then
  PF_LAUNCHER=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
# Let ccache reuse objects across checkouts in different directories (CI builds a fresh clone).
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1
