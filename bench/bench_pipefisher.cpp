// The PipeFisher pass on BERT with the analytic cost model.
//   bench_pipefisher [benchmark flags]   time the pass (BERT-Large, 8 stages, Chimera, 64 mb ...)
//   bench_pipefisher --figures           print the docs' table (docs/pipefisher.md)
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "runtime/model/bert_config.h"
#include "scheduler/compile.h"
#include "scheduler/pipefisher/pass.h"
#include "sim/analytic_cost_model.h"

namespace {

using pf::sched::ScheduleKind;

struct Setup {
  const char* model;
  const char* device;
  ScheduleKind kind;
  int stages;
  int microbatches;
  int chunks;
};

pf::sim::AnalyticCostModel cost_model(const char* model, const char* device_name) {
  pf::sim::Workload workload;
  workload.config = pf::model::bert_preset(model);
  workload.seq_len = 128;
  workload.micro_batch_size = 32;
  const pf::sim::DeviceSpec device = pf::sim::device_preset(device_name);
  // Mixed precision: bf16 where the device has it (h100), fp16 otherwise (p100).
  workload.precision =
      device.peak_bf16_flops > 0.0 ? pf::sim::Precision::kBf16 : pf::sim::Precision::kFp16;
  return pf::sim::AnalyticCostModel(workload, device);
}

pf::sched::Schedule compiled(const Setup& setup) {
  pf::sched::ScheduleParams params;
  params.kind = setup.kind;
  params.workers = setup.stages;
  params.microbatches = setup.microbatches;
  params.chunks_per_worker = setup.chunks;
  params.num_layers = pf::model::bert_preset(setup.model).num_layers;
  return pf::sched::compile(params);
}

const Setup kTimed[] = {
    {"large", "h100", ScheduleKind::kChimera, 8, 64, 1},
    {"large", "h100", ScheduleKind::kOneFOneB, 8, 64, 1},
    {"large", "h100", ScheduleKind::kChimera, 8, 8, 1},
};

void BM_PipeFisherPass(benchmark::State& state) {
  const Setup& setup = kTimed[state.range(0)];
  const auto costs = cost_model(setup.model, setup.device);
  const auto base = compiled(setup);
  pf::pipefisher::KfacOptions options;
  options.policy = static_cast<pf::pipefisher::PackingPolicy>(state.range(1));
  int k = 0;
  for (auto _ : state) {
    const auto result = pf::pipefisher::run_pipefisher(base, costs, options);
    k = result.report.refresh_steps;
    benchmark::DoNotOptimize(k);
  }
  state.counters["k"] = k;
  state.SetLabel(std::string(setup.model) + " " + std::string(pf::sched::to_string(setup.kind)) +
                 " p=" + std::to_string(setup.stages) + " m=" + std::to_string(setup.microbatches) +
                 " " + std::string(pf::pipefisher::to_string(options.policy)));
}
BENCHMARK(BM_PipeFisherPass)->ArgsProduct({{0, 1, 2}, {0, 1, 2}})->Unit(benchmark::kMillisecond);

// The table of docs/pipefisher.md: BERT-Base/Large, 4/8 stages, four schedules, two devices.
int print_figures(int microbatches_per_stage) {
  std::printf(
      "| model | device | schedule | p | m | util before | util after | k (first-fit / "
      "best-fit) | overhead | precond. after flush | K-FAC MiB/worker |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const char* model : {"base", "large"}) {
    for (const char* device : {"h100", "p100"}) {
      for (int stages : {4, 8}) {
        for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB,
                                  ScheduleKind::kInterleaved, ScheduleKind::kChimera}) {
          const int chunks = kind == ScheduleKind::kInterleaved ? 2 : 1;
          const Setup setup{model, device, kind, stages, microbatches_per_stage * stages, chunks};
          const std::string name =
              std::string(pf::sched::to_string(kind)) + (chunks > 1 ? " (v=2)" : "");
          try {
            const auto costs = cost_model(model, device);
            const auto result = pf::pipefisher::run_pipefisher(compiled(setup), costs);
            const auto& r = result.report;
            std::printf(
                "| %s | %s | %s | %d | %d | %.1f%% | %.1f%% | %d (%d / %d) | %+.1f%% | %d/%d "
                "| %.0f |\n",
                model, device, name.c_str(), stages, setup.microbatches, 100 * r.utilization_before,
                100 * r.utilization_after, r.refresh_steps, r.first_fit_refresh_steps,
                r.best_fit_refresh_steps, 100 * r.step_time_overhead, r.preconditions_after_flush,
                r.preconditions_after_flush + r.preconditions_in_bubbles,
                r.kfac_memory_bytes / (1024.0 * 1024.0));
          } catch (const std::exception& error) {
            std::printf("| %s | %s | %s | %d | %d | n/a: %s |||||||\n", model, device, name.c_str(),
                        stages, setup.microbatches, error.what());
          }
        }
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--figures") == 0) {
      const int per_stage = i + 1 < argc ? std::atoi(argv[i + 1]) : 1;
      return print_figures(per_stage > 0 ? per_stage : 1);
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
