#!/usr/bin/env bash
# Builds the libFuzzer harnesses (tests/fuzz, clang, ASan + UBSan) in build/fuzz and runs each for
# a fixed time on one core, starting from the committed corpus tests/fuzz/corpus/<target>.
#   scripts/fuzz.sh [--seconds N] [target ...]      (default: 20 s each, every target)
# New coverage goes to build/fuzz/corpus/<target> (not committed); a crash, leak, sanitizer
# report, timeout (10 s) or out-of-memory (2 GiB) stops the run, leaves the input in
# build/fuzz/artifacts/ and exits 1. Commit such an input under tests/fuzz/corpus/<target>/
# with its fix: test_fuzz_corpus replays it in the normal suite.
# Needs clang++ and libFuzzer (Debian: clang libclang-rt-14-dev libomp-dev; scripts/setup.sh
# --with-fuzz installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

seconds=20
targets=()
while (($#)); do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: error: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
if ! [[ "$seconds" =~ ^[1-9][0-9]*$ ]]; then
  echo "fuzz.sh: error: --seconds '$seconds' (allowed: a positive integer)" >&2
  exit 2
fi
if ! command -v clang++ >/dev/null 2>&1; then
  echo "fuzz.sh: error: clang++ not found (scripts/setup.sh --with-fuzz installs it)" >&2
  exit 2
fi
if ((${#targets[@]} == 0)); then
  # Every target has a seed directory (make_fuzz_corpus writes them; test_fuzz_corpus checks).
  for dir in tests/fuzz/corpus/*/; do targets+=("$(basename "$dir")"); done
fi

echo "== fuzz build (clang, ASan + UBSan, libFuzzer)"
cmake -S . -B build/fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_CXX_FLAGS_DEBUG="-g -O1" -DPF_SANITIZE=ON -DPF_BUILD_FUZZERS=ON -DPF_WITH_CUDA=OFF \
  -DPF_BUILD_TESTS=OFF -DPF_BUILD_BENCHMARKS=OFF -DPF_NATIVE=OFF "${PF_LAUNCHER[@]}" >/dev/null
cmake --build build/fuzz -j "$PF_JOBS" --target "${targets[@]/#/fuzz_}"

mkdir -p build/fuzz/artifacts
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
for target in "${targets[@]}"; do
  mkdir -p "build/fuzz/corpus/$target"
  echo "== fuzz_$target for ${seconds} s"
  log="build/fuzz/fuzz_$target.log"
  if ! "build/fuzz/tests/fuzz/fuzz_$target" -max_total_time="$seconds" -timeout=10 \
      -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 \
      -artifact_prefix="build/fuzz/artifacts/$target-" \
      "build/fuzz/corpus/$target" "tests/fuzz/corpus/$target" >"$log" 2>&1; then
    tail -n 40 "$log"
    echo "fuzz.sh: fuzz_$target found a problem (input in build/fuzz/artifacts/)" >&2
    exit 1
  fi
  grep -E 'stat::number_of_executed_units|stat::new_units_added' "$log" | tr '\n' ' '
  echo
done
