#!/usr/bin/env bash
# Builds the CUDA targets on a GPU machine and runs every CUDA test and benchmark, logs in $OUT
# (default /tmp/pf_gpu). Made for the lent device machine: its image has nvcc, CMake, ninja and
# PyTorch but not our Debian libraries, so .deb files in ./deps (apt-get download ...) are
# unpacked into / first when present.
#   scripts/gpu_check.sh [build|test|bench|torch|all]...   (default: all; test and bench build too)
# PF_GPU_BENCHES="bench_cuda ..." picks benchmark programs, PF_BENCH_FILTER a --benchmark_filter,
# PF_TORCH_ONLY=gemm,kfac,... parts of bench/torch_cuda_bench.py.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pf_gpu}
mkdir -p "$OUT"
parts=("${@:-all}")
want() { [[ " ${parts[*]} " == *" all "* || " ${parts[*]} " == *" $1 "* ]]; }

if compgen -G "deps/*.deb" >/dev/null; then
  for f in deps/*.deb; do
    case "$f" in *pkgconf* | *pkg-config*) command -v pkg-config >/dev/null && continue ;; esac
    dpkg -x "$f" /
  done
  ldconfig
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
  # GCC 13 (the image's) reports a false -Wnull-dereference in memcpy into a fresh vector
  # (runtime/checkpoint); GCC 12 (CI's) does not. Appended last so it beats the targets' flags.
  printf '#!/bin/sh\nexec %s "$@" -Wno-null-dereference\n' "$(command -v g++)" >/tmp/pf_gxx
  chmod +x /tmp/pf_gxx
  cmake -S . -B build/gpu -DCMAKE_CXX_COMPILER=/tmp/pf_gxx -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DPF_BUILD_BENCHMARKS=ON >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  cmake --build build/gpu -j16 --target "${targets[@]}" >>"$OUT/build.log" 2>&1 ||
    { grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1; }
  echo "built: ${targets[*]}"
fi
status=0
if want test; then
  for t in build/gpu/tests/*/test_*cuda; do
    echo "== $t" | tee -a "$OUT/tests.log"
    "$t" 2>&1 | tee -a "$OUT/tests.log" | grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|error"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  done
fi
if want bench; then
  for b in build/gpu/bench/bench_*cuda; do
    [[ -n "${PF_GPU_BENCHES:-}" && " $PF_GPU_BENCHES " != *" $(basename "$b") "* ]] && continue
    "$b" --benchmark_repetitions=5 --benchmark_report_aggregates_only=true \
      --benchmark_min_time=0.2 ${PF_BENCH_FILTER:+--benchmark_filter=$PF_BENCH_FILTER} 2>&1 | grep -v "_mean\|_stddev\|_cv" | tee -a "$OUT/bench.log"
  done
fi
if want torch; then
  PYTHONUNBUFFERED=1 python3 bench/torch_cuda_bench.py ${PF_TORCH_ONLY:+--only $PF_TORCH_ONLY} 2>&1 |
    tee "$OUT/torch.log"
fi
exit $status
