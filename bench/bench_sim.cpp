// Simulator throughput: instructions replayed per second, and compile + simulate + report end to
// end, on the large case (interleaved, p = 64, v = 4, m = 1024, with communication) and a
// small one (the size the PipeFisher pass simulates in its loop).
#include <benchmark/benchmark.h>

#include "scheduler/compile.h"
#include "sim/analytic_cost_model.h"
#include "sim/report.h"
#include "sim/simulator.h"
#include "sim/uniform_cost_model.h"

namespace {

using pf::sched::ScheduleKind;
using pf::sched::ScheduleParams;

ScheduleParams params(ScheduleKind kind, int p, int v, int m) {
  ScheduleParams out;
  out.kind = kind;
  out.workers = p;
  out.chunks_per_worker = v;
  out.microbatches = m;
  return out;
}

const pf::sim::UniformCostModel& uniform_with_communication() {
  static const pf::sim::UniformCostModel costs(
      pf::sim::UniformCosts{.forward_s = 1e-3, .backward_s = 2e-3, .communication_s = 5e-5});
  return costs;
}

void simulate_only(benchmark::State& state, const ScheduleParams& ps, bool track_memory) {
  const auto schedule = pf::sched::compile(ps);
  const pf::sim::SimOptions options{.overlap_communication = true, .track_memory = track_memory};
  for (auto _ : state) {
    auto result = pf::sim::simulate(schedule, uniform_with_communication(), options);
    benchmark::DoNotOptimize(result.makespan_s);
  }
  state.SetItemsProcessed(state.iterations() *
                          static_cast<std::int64_t>(schedule.num_instructions()));
  state.counters["instructions"] = static_cast<double>(schedule.num_instructions());
}

void BM_SimulateLarge(benchmark::State& state) {
  simulate_only(state, params(ScheduleKind::kInterleaved, 64, 4, 1024), state.range(0) != 0);
}
BENCHMARK(BM_SimulateLarge)->Arg(1)->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_SimulateSmall(benchmark::State& state) {
  simulate_only(state, params(ScheduleKind::kOneFOneB, 8, 1, 32), true);
}
BENCHMARK(BM_SimulateSmall)->Unit(benchmark::kMicrosecond)->UseRealTime();

// What `pipefisher_sim --schedule interleaved -p 64 -v 4 -m 1024 --model large --report r.json`
// does, minus printing: compile, simulate with the analytic model, build the report.
void BM_CompileSimulateReportLarge(benchmark::State& state) {
  pf::sim::Workload workload;
  workload.config = pf::model::bert_preset("large");
  ScheduleParams ps = params(ScheduleKind::kInterleaved, 64, 4, 1024);
  ps.num_layers = 256;  // one layer per chunk (BERT-large has 24: use a deeper model of its width)
  workload.config.num_layers = 256;
  const pf::sim::AnalyticCostModel costs(workload, pf::sim::device_preset("h100"));
  std::int64_t instructions = 0;
  for (auto _ : state) {
    const auto schedule = pf::sched::compile(ps);
    const auto result = pf::sim::simulate(schedule, costs);
    const auto report = pf::sim::report_json(schedule, result, pf::sim::RunDescription{});
    benchmark::DoNotOptimize(report.size());
    instructions = static_cast<std::int64_t>(schedule.num_instructions());
  }
  state.SetItemsProcessed(state.iterations() * instructions);
}
BENCHMARK(BM_CompileSimulateReportLarge)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
