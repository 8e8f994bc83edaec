// Schedule compiler throughput: generate, lower and validate an interleaved 1F1B schedule.
// The headline case p=64, v=4, m=1024 has 524288 compute instructions (plus about 1M sends and
// receives). Args: p, v, m.
#include <benchmark/benchmark.h>

#include "scheduler/compile.h"
#include "scheduler/generators.h"
#include "scheduler/lowering.h"
#include "scheduler/validate.h"

namespace {

pf::sched::ScheduleParams params_of(const benchmark::State& state) {
  pf::sched::ScheduleParams params;
  params.kind = pf::sched::ScheduleKind::kInterleaved;
  params.workers = static_cast<int>(state.range(0));
  params.chunks_per_worker = static_cast<int>(state.range(1));
  params.microbatches = static_cast<int>(state.range(2));
  return params;
}

void report(benchmark::State& state, const pf::sched::Schedule& schedule) {
  state.counters["instructions"] = static_cast<double>(schedule.num_instructions());
  state.counters["instructions_per_s"] = benchmark::Counter(
      static_cast<double>(schedule.num_instructions()) * static_cast<double>(state.iterations()),
      benchmark::Counter::kIsRate);
}

void BM_Compile(benchmark::State& state) {
  const auto params = params_of(state);
  std::size_t instructions = 0;
  for (auto _ : state) {
    const pf::sched::Schedule schedule = pf::sched::compile(params);
    instructions = schedule.num_instructions();
    benchmark::DoNotOptimize(instructions);
  }
  state.counters["instructions"] = static_cast<double>(instructions);
}

void BM_Generate(benchmark::State& state) {
  const auto params = params_of(state);
  for (auto _ : state) {
    pf::sched::Schedule schedule = pf::sched::generate(params);
    benchmark::DoNotOptimize(schedule.streams.data());
  }
}

void BM_Lower(benchmark::State& state) {
  const pf::sched::Schedule compute_only = pf::sched::generate(params_of(state));
  pf::sched::Schedule lowered;
  for (auto _ : state) {
    lowered = pf::sched::lower(compute_only);
    benchmark::DoNotOptimize(lowered.streams.data());
  }
  report(state, lowered);
}

void BM_Validate(benchmark::State& state) {
  const pf::sched::Schedule lowered = pf::sched::lower(pf::sched::generate(params_of(state)));
  for (auto _ : state) pf::sched::validate(lowered);
  report(state, lowered);
}

}  // namespace

BENCHMARK(BM_Compile)->Args({4, 2, 8})->Args({64, 4, 1024})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Generate)->Args({4, 2, 8})->Args({64, 4, 1024})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Lower)->Args({4, 2, 8})->Args({64, 4, 1024})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Validate)->Args({4, 2, 8})->Args({64, 4, 1024})->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
