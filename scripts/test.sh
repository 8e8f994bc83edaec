#!/usr/bin/env bash
# Builds the project twice (optimised, and with ASan + UBSan) and runs the whole test suite on
# both, then runs every libFuzzer harness briefly (clang, ASan + UBSan). This is the README's
# test command and exactly what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --with-fuzz
source scripts/env.sh

echo "== release build (CUDA targets compiled where nvcc exists)"
cmake -S . -B build/release -G Ninja "${PF_RELEASE_CONFIG[@]}" "${PF_LAUNCHER[@]}"
cmake --build build/release -j "$PF_JOBS"
ctest --test-dir build/release --output-on-failure -j "$PF_JOBS"

echo "== sanitizer build (ASan + UBSan)"
cmake -S . -B build/asan -G Ninja "${PF_SANITIZER_CONFIG[@]}" \
  -DPF_WITH_CUDA=OFF -DPF_BUILD_BENCHMARKS=OFF "${PF_LAUNCHER[@]}"
cmake --build build/asan -j "$PF_JOBS"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build/asan --output-on-failure -j "$PF_JOBS" -LE no_sanitizer

# The libFuzzer harnesses, briefly (setup.sh --with-fuzz installed clang and libFuzzer above; the
# check keeps the script usable where they cannot be installed). The corpus replay
# (test_fuzz_corpus) runs in both builds above.
if command -v clang++ >/dev/null 2>&1 &&
   compgen -G "/usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a" >/dev/null; then
  echo "== fuzzing (libFuzzer, ASan + UBSan, ${PF_FUZZ_SECONDS:-10} s per harness, seed ${PF_FUZZ_SEED:-1})"
  # A fixed seed: the run repeats what `scripts/fuzz.sh --seed 1` tried before landing.
  scripts/fuzz.sh --seconds "${PF_FUZZ_SECONDS:-10}" --seed "${PF_FUZZ_SEED:-1}"
else
  echo "== fuzzing skipped: no clang/libFuzzer (scripts/setup.sh --with-fuzz installs them)"
fi
