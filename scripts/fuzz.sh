#!/usr/bin/env bash
# Builds the libFuzzer harnesses (tests/fuzz, clang, ASan + UBSan) in build/fuzz and runs each for
# a fixed time on one core, starting from the committed corpus tests/fuzz/corpus/<target>.
#   scripts/fuzz.sh [--seconds N] [--parallel J] [--seed S] [target ...]
# (default: 20 s each, one at a time, every target, a random seed; --parallel runs J harnesses at
# once, each on one core; --seed S > 0 makes libFuzzer draw the same mutations in the same order,
# so that, for these single-threaded parsers, a short run of that seed on a fresh build/fuzz (as
# CI's) tries a prefix of what a longer one tries). It ends with a table of executions and
# findings per harness.
# New coverage goes to build/fuzz/corpus/<target> (not committed); a crash, leak, sanitizer
# report, timeout (10 s) or out-of-memory (2 GiB) ends that harness and leaves the input in
# build/fuzz/artifacts/, and the script exits 1 after the table. Commit such an input under
# tests/fuzz/corpus/<target>/ with its fix: test_fuzz_corpus replays it in the normal suite.
# Needs clang++ and libFuzzer (Debian: clang libclang-rt-14-dev libomp-dev; scripts/setup.sh
# --with-fuzz installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

seconds=20
parallel=1
seed=0
targets=()
while (($#)); do
  case "$1" in
    --seconds) seconds="${2:-}"; shift 2 ;;
    --parallel) parallel="${2:-}"; shift 2 ;;
    --seed) seed="${2:-}"; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: error: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
if ! [[ "$seconds" =~ ^[1-9][0-9]*$ ]]; then
  echo "fuzz.sh: error: --seconds '$seconds' (allowed: a positive integer)" >&2
  exit 2
fi
if ! [[ "$parallel" =~ ^[1-9][0-9]*$ ]]; then
  echo "fuzz.sh: error: --parallel '$parallel' (allowed: a positive integer)" >&2
  exit 2
fi
if ! [[ "$seed" =~ ^[0-9]+$ ]]; then
  echo "fuzz.sh: error: --seed '$seed' (allowed: a non-negative integer; 0 = random)" >&2
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
cmake -S . -B build/fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ "${PF_SANITIZER_CONFIG[@]}" \
  -DPF_BUILD_FUZZERS=ON -DPF_WITH_CUDA=OFF \
  -DPF_BUILD_TESTS=OFF -DPF_BUILD_BENCHMARKS=OFF -DPF_NATIVE=OFF "${PF_LAUNCHER[@]}" >/dev/null
cmake --build build/fuzz -j "$PF_JOBS" --target "${targets[@]/#/fuzz_}"

mkdir -p build/fuzz/artifacts
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

# One harness for $seconds; its log in build/fuzz/fuzz_<target>.log, exit status non-zero on a
# finding.
fuzz_one() {
  local target="$1"
  mkdir -p "build/fuzz/corpus/$target"
  "build/fuzz/tests/fuzz/fuzz_$target" -max_total_time="$seconds" -seed="$seed" -timeout=10 \
    -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 \
    -artifact_prefix="build/fuzz/artifacts/$target-" \
    "build/fuzz/corpus/$target" "tests/fuzz/corpus/$target" >"build/fuzz/fuzz_$target.log" 2>&1
}

stat_of() {  # stat_of <log> <name>: a libFuzzer final statistic, or '-'
  local value
  value=$(sed -n "s/^stat::$2: *//p" "$1" | tail -n 1)
  echo "${value:--}"
}

echo "== ${#targets[@]} harness(es), ${seconds} s each, ${parallel} at a time"
rm -f build/fuzz/fuzz_*.status
running=0
for target in "${targets[@]}"; do
  if ((running >= parallel)); then
    wait -n || true
    running=$((running - 1))
  fi
  echo "== fuzz_$target for ${seconds} s"
  (fuzz_one "$target" && echo 0 >"build/fuzz/fuzz_$target.status" ||
    echo 1 >"build/fuzz/fuzz_$target.status") &
  running=$((running + 1))
done
wait

failed=()
printf '| harness | seconds | executions | executions/s | new inputs | corpus inputs | result |\n'
printf '|---|---:|---:|---:|---:|---:|---|\n'
for target in "${targets[@]}"; do
  log="build/fuzz/fuzz_$target.log"
  result="no finding"
  if [[ "$(cat "build/fuzz/fuzz_$target.status" 2>/dev/null)" != 0 ]]; then
    result="FINDING (build/fuzz/artifacts/$target-*)"
    failed+=("$target")
  fi
  corpus=$(find "build/fuzz/corpus/$target" "tests/fuzz/corpus/$target" -type f | wc -l)
  printf '| %s | %s | %s | %s | %s | %s | %s |\n' "$target" "$seconds" \
    "$(stat_of "$log" number_of_executed_units)" "$(stat_of "$log" average_exec_per_sec)" \
    "$(stat_of "$log" new_units_added)" "$corpus" "$result"
done
for target in "${failed[@]}"; do
  echo "---- fuzz_$target" >&2
  tail -n 40 "build/fuzz/fuzz_$target.log" >&2
done
if ((${#failed[@]})); then
  echo "fuzz.sh: ${#failed[@]} harness(es) found a problem: ${failed[*]} (inputs in build/fuzz/artifacts/)" >&2
  exit 1
fi
