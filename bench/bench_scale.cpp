// The simulator at scale (docs/scale.md, docs/benchmarks.md "Simulator at scale"): a 3072-GPU
// PTD-P step of the Megatron-LM paper's 1T model (t = 8, p = 64, d = 6; m = 1024 micro-batches,
// compile + simulate + report, the "p = 64, m = 1024 under 2 s"), and the configuration
// search for it and for BERT-Large on 512 GPUs.
#include <benchmark/benchmark.h>

#include "scheduler/compile.h"
#include "sim/config_search.h"
#include "sim/parallel_cost_model.h"
#include "sim/report.h"
#include "sim/simulator.h"

namespace {

using pf::sched::ScheduleKind;

void BM_ParallelStep3072(benchmark::State& state) {
  pf::sim::ParallelWorkload w;
  w.model = pf::sim::transformer_preset("megatron-1t");
  w.precision = pf::sim::Precision::kFp16;
  w.tensor_parallel = 8;
  w.recompute = pf::sim::Recompute::kFull;
  const pf::sim::ParallelCostModel costs(w, pf::sim::cluster_preset("dgx-a100"));
  pf::sched::ScheduleParams ps;
  ps.kind = state.range(0) == 1 ? ScheduleKind::kOneFOneB : ScheduleKind::kInterleaved;
  ps.chunks_per_worker = static_cast<int>(state.range(0));
  ps.workers = 64;
  ps.microbatches = 1024;
  ps.num_layers = 128;
  ps.data_parallel = 6;
  std::int64_t instructions = 0;
  for (auto _ : state) {
    const auto schedule = pf::sched::compile(ps);
    const auto result = pf::sim::simulate(schedule, costs);
    const auto report = pf::sim::report_json(schedule, result, pf::sim::RunDescription{});
    benchmark::DoNotOptimize(report.size());
    instructions = static_cast<std::int64_t>(schedule.num_instructions());
  }
  state.SetItemsProcessed(state.iterations() * instructions);
  state.counters["instructions"] = static_cast<double>(instructions);
}
BENCHMARK(BM_ParallelStep3072)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

void search(benchmark::State& state, pf::sim::SearchOptions options) {
  long candidates = 0;
  for (auto _ : state) {
    const auto result = pf::sim::search_configurations(options);
    benchmark::DoNotOptimize(result.ranked.size());
    candidates = result.enumerated;
  }
  state.counters["candidates"] = static_cast<double>(candidates);
}

void BM_SearchMegatron1T3072(benchmark::State& state) {
  pf::sim::SearchOptions o;
  o.model = pf::sim::transformer_preset("megatron-1t");
  o.cluster = pf::sim::cluster_preset("dgx-a100");
  o.gpus = 3072;
  o.global_batch = 3072;
  o.precision = pf::sim::Precision::kFp16;
  search(state, o);
}
BENCHMARK(BM_SearchMegatron1T3072)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_SearchBertLarge512(benchmark::State& state) {
  pf::sim::SearchOptions o;
  o.model = pf::sim::transformer_preset("large");
  o.cluster = pf::sim::cluster_preset("dgx-a100");
  o.gpus = 512;
  o.global_batch = 65536;
  o.seq_len = 128;
  search(state, o);
}
BENCHMARK(BM_SearchBertLarge512)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
