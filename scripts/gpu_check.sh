#!/usr/bin/env bash
# Builds the CUDA targets on a GPU machine and runs every CUDA test and benchmark, logs in $OUT
# (default /tmp/pf_gpu). Made for the lent device machine: its image (Ubuntu 24.04) has nvcc,
# CMake, ninja, PyTorch, OpenMPI, Eigen, GoogleTest, benchmark, CLI11 and nlohmann-json, but not
# utf8proc; .deb files in ./deps (git-ignored; fetch them here with
#   mkdir -p deps && (cd deps && apt-get download libutf8proc-dev libutf8proc2)
# and name deps in the device call's carry) are unpacked into / first, except packages the image
# has already.
#   scripts/gpu_check.sh [build|test|bench|torch|all]...   (default: all; test and bench build too)
# PF_GPU_BENCHES="bench_cuda ..." picks benchmark programs, PF_BENCH_FILTER a --benchmark_filter,
# PF_BENCH_REPS / PF_BENCH_MIN_TIME the repetitions (5) and seconds per run (0.2),
# PF_BENCH_TIMEOUT the seconds each program may take (600), PF_TORCH_ONLY=gemm,kfac,... parts of
# bench/torch_cuda_bench.py.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pf_gpu}
mkdir -p "$OUT"
parts=("${@:-all}")
want() { [[ " ${parts[*]} " == *" all "* || " ${parts[*]} " == *" $1 "* ]]; }

if compgen -G "deps/*.deb" >/dev/null && [[ ! -e /tmp/pf_debs_done ]]; then
  # Unpacked into a staging folder first: the image's / is merged-/usr (/lib -> usr/lib) and a
  # Debian 12 package's ./lib (libnl-3-200's) would replace that link with a folder, breaking the
  # linker; such folders are moved under usr/ before the copy into /.
  stage=/tmp/pf_debs
  rm -rf "$stage" && mkdir -p "$stage"
  # What the image had before (env.log): its own MPI and PMIx stay, since mixing a Debian
  # libpmix with the image's PMIx plugins can crash mpirun.
  { echo "before the .deb files: mpirun $(command -v mpirun || echo none)"
    dpkg -l 2>/dev/null | grep -E "openmpi|pmix|mpich|libevent|hwloc" | awk '{print $2, $3}'; } \
    >"$OUT/image_packages.log" 2>&1
  for f in deps/*.deb; do
    case "$f" in *pkgconf* | *pkg-config*) command -v pkg-config >/dev/null && continue ;; esac
    package=$(basename "$f" | cut -d_ -f1)
    # Installed already under its name or its Ubuntu 64-bit-time name (libfoo1t64).
    if dpkg -s "$package" >/dev/null 2>&1 || dpkg -s "${package}t64" >/dev/null 2>&1; then
      echo "deps: $package is the image's, kept" >>"$OUT/image_packages.log"
      continue
    fi
    dpkg -x "$f" "$stage"
  done
  for d in lib lib64 bin sbin; do
    if [[ -d $stage/$d && ! -L $stage/$d ]]; then
      mkdir -p "$stage/usr/$d"
      cp -a "$stage/$d/." "$stage/usr/$d/"
      rm -rf "${stage:?}/$d"
    fi
  done
  cp -a "$stage/." /
  ldconfig
  touch /tmp/pf_debs_done
fi
# dpkg -x runs no maintainer scripts, so Debian's alternatives links for OpenMPI are missing.
for tool in mpirun mpiexec mpicxx mpicc; do
  if ! command -v $tool >/dev/null && [[ -e /usr/bin/$tool.openmpi ]]; then
    ln -sf $tool.openmpi /usr/bin/$tool
  fi
done
# NCCL: the image has it only as PyTorch's wheel (nvidia/nccl: include/nccl.h, lib/libnccl.so.2,
# no unversioned libnccl.so for find_library): point NCCL_HOME at a folder that has both.
if [[ -z "${NCCL_HOME:-}" ]] && ! compgen -G "/usr/local/cuda/include/nccl.h" >/dev/null; then
  nccl_header=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "include", "nccl.h"))' 2>/dev/null)
  if [[ -f "$nccl_header" ]]; then
    nccl_root=$(dirname "$(dirname "$nccl_header")")
    mkdir -p /tmp/pf_nccl/lib
    ln -sfn "$nccl_root/include" /tmp/pf_nccl/include
    ln -sf "$nccl_root"/lib/libnccl.so.2 /tmp/pf_nccl/lib/libnccl.so
    export NCCL_HOME=/tmp/pf_nccl
  fi
fi
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; nvcc --version | tail -2;
  g++ --version | head -1; cmake --version | head -1; } 2>&1 | tee "$OUT/env.log"

targets=(test_kernels_cuda bench_cuda)
[[ -f tests/kfac/test_kfac_cuda.cpp ]] && targets+=(test_kfac_cuda)
[[ -f bench/bench_kfac_cuda.cpp ]] && targets+=(bench_kfac_cuda)
[[ -f tests/kfac/test_optim_cuda.cpp ]] && targets+=(test_optim_cuda)
[[ -f tests/model/test_model_cuda.cpp ]] && targets+=(test_model_cuda)
[[ -f bench/bench_model_cuda.cpp ]] && targets+=(bench_model_cuda)
[[ -n "${PF_GPU_EXTRA_TARGETS:-}" ]] && targets+=($PF_GPU_EXTRA_TARGETS)
if want build || want test || want bench; then
  # GCC 13 (the image's) warns where GCC 12 (CI's, which keeps -Werror) does not, e.g. a false
  # -Wnull-dereference in memcpy into a fresh vector: a lease is too short to lose to a new
  # compiler's warning, so warnings stay warnings here (appended last, it beats -Werror).
  printf '#!/bin/sh\nexec %s "$@" -Wno-error\n' "$(command -v g++)" >/tmp/pf_gxx
  chmod +x /tmp/pf_gxx
  cmake -S . -B build/gpu -DCMAKE_CXX_COMPILER=/tmp/pf_gxx -DCMAKE_CUDA_HOST_COMPILER=/tmp/pf_gxx -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DPF_BUILD_BENCHMARKS=ON >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  cmake --build build/gpu -j16 --target "${targets[@]}" >>"$OUT/build.log" 2>&1 ||
    { grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1; }
  echo "built: ${targets[*]}"
fi
status=0
if want test; then
  for t in build/gpu/tests/*/test_*cuda; do
    echo "== $t" | tee -a "$OUT/tests.log"
    timeout "${PF_GPU_TEST_TIMEOUT:-180}" "$t" 2>&1 | tee -a "$OUT/tests.log" |
      grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|error"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  done
fi
if want bench; then
  for b in build/gpu/bench/bench_*cuda; do
    [[ -n "${PF_GPU_BENCHES:-}" && " $PF_GPU_BENCHES " != *" $(basename "$b") "* ]] && continue
    timeout "${PF_BENCH_TIMEOUT:-600}" "$b" --benchmark_repetitions="${PF_BENCH_REPS:-5}" \
      --benchmark_report_aggregates_only=true --benchmark_min_time="${PF_BENCH_MIN_TIME:-0.2}" \
      ${PF_BENCH_FILTER:+--benchmark_filter=$PF_BENCH_FILTER} 2>&1 |
      grep --line-buffered -v "_mean\|_stddev\|_cv" | tee -a "$OUT/bench.log"
  done
fi
if want torch; then
  PYTHONUNBUFFERED=1 timeout "${PF_BENCH_TIMEOUT:-600}" python3 bench/torch_cuda_bench.py \
    ${PF_TORCH_ONLY:+--only $PF_TORCH_ONLY} 2>&1 | tee "$OUT/torch.log"
fi
exit $status
