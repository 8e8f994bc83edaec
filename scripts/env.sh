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
# Line tables only (-g1): stack traces keep file and line, and the build stays a fraction of the
# size (full -g made the statically linked test programs ~95% debug info: 10 GB for the three
# builds of scripts/test.sh, more than CI's disk). Configure by hand with -g to debug.
PF_RELEASE_CONFIG=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG")
PF_SANITIZER_CONFIG=(-DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-g1 -O1" -DPF_SANITIZE=ON)
