// The PipeFisher pass on BERT with the analytic cost model.
//   bench_pipefisher [benchmark flags]   time the pass (BERT-Large, 8 stages, Chimera, 64 mb ...)
//   bench_pipefisher --figures           print the docs' table (docs/pipefisher.md)
//   bench_pipefisher --zero-bubble N     zero-bubble schedules against 1F1B with K-FAC, m = N*p
//   bench_pipefisher --pieces            the divisible-task sweep (docs/pipefisher.md): one
//                                        layer per stage, N = D micro-batches, split on vs off
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <optional>
#include <string>

#include "runtime/model/bert_config.h"
#include "scheduler/compile.h"
#include "scheduler/pipefisher/kfac_work.h"
#include "scheduler/pipefisher/pass.h"
#include "sim/analytic_cost_model.h"
#include "sim/measured_cost_model.h"

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

// Zero-bubble schedules against 1F1B, K-FAC in their bubbles (docs/pipefisher.md, "Zero-bubble
// schedules"): the automatic refresh interval, and the step time at 1F1B's interval (equal
// staleness), where what does not fit runs after the flush.
std::string zero_bubble_row(const char* model, int stages, int microbatches, ScheduleKind kind,
                            int one_f_one_b_k, double one_f_one_b_step_s) {
  const int chunks = kind == ScheduleKind::kZeroBubbleV ? 2 : 1;
  const Setup setup{model, "h100", kind, stages, microbatches, chunks};
  const auto costs = cost_model(model, "h100");
  const auto base = compiled(setup);
  char automatic[160];
  try {
    const auto r = pf::pipefisher::run_pipefisher(base, costs).report;
    std::snprintf(automatic, sizeof automatic, "%d | %.1f%% | %.2f | %+.1f%%", r.refresh_steps,
                  100 * r.utilization_after, 1e3 * r.step_time_after_s, 100 * r.step_time_overhead);
  } catch (const std::exception&) {
    std::snprintf(automatic, sizeof automatic, "none | | |");  // no bubble holds the refresh
  }
  pf::pipefisher::KfacOptions fixed;
  fixed.refresh_steps = one_f_one_b_k;
  const auto f = pf::pipefisher::run_pipefisher(base, costs, fixed).report;
  char row[400];
  std::snprintf(row, sizeof row, "| %s | %d | %d | %s | %.1f%% | %.2f | %s | %.2f | %d | %.3f |\n",
                model, stages, microbatches, std::string(pf::sched::to_string(kind)).c_str(),
                100 * f.utilization_before, 1e3 * f.step_time_before_s, automatic,
                1e3 * f.step_time_after_s, f.spilled_tasks,
                one_f_one_b_step_s > 0.0 ? f.step_time_after_s / one_f_one_b_step_s : 1.0);
  return row;
}

int print_zero_bubble_figures(int microbatches_per_stage) {
  std::printf(
      "| model | p | m | schedule | util before | step before (ms) | k (auto) | util after | "
      "step after (ms) | overhead | step at 1F1B's k (ms) | spilled tasks | vs 1F1B at that k "
      "|\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const char* model : {"base", "large"}) {
    for (int stages : {4, 8}) {
      const int microbatches = microbatches_per_stage * stages;
      const Setup reference{model, "h100", ScheduleKind::kOneFOneB, stages, microbatches, 1};
      const auto one_f_one_b =
          pf::pipefisher::run_pipefisher(compiled(reference), cost_model(model, "h100")).report;
      for (ScheduleKind kind : {ScheduleKind::kOneFOneB, ScheduleKind::kZeroBubbleH1,
                                ScheduleKind::kZeroBubbleH2, ScheduleKind::kZeroBubbleV}) {
        try {
          std::fputs(zero_bubble_row(model, stages, microbatches, kind, one_f_one_b.refresh_steps,
                                     one_f_one_b.step_time_after_s)
                         .c_str(),
                     stdout);
        } catch (const std::exception& error) {
          std::printf("| %s | %d | %d | %s | n/a: %s |||||||||\n", model, stages, microbatches,
                      std::string(pf::sched::to_string(kind)).c_str(), error.what());
        }
      }
    }
  }
  return 0;
}

// --- The divisible-task sweep: PipeFisher's performance model (one encoder layer per stage,
// N = D micro-batches), analytic costs on four devices and measured-format profiles built from
// them, every schedule, split on against split off.
pf::sim::AnalyticCostModel sweep_analytic(const char* model, const char* device_name,
                                          int micro_batch) {
  pf::sim::Workload workload;
  workload.config = pf::model::bert_preset(model);
  workload.seq_len = 128;
  workload.micro_batch_size = micro_batch;
  const pf::sim::DeviceSpec device = pf::sim::device_preset(device_name);
  workload.precision =
      device.peak_bf16_flops > 0.0 ? pf::sim::Precision::kBf16 : pf::sim::Precision::kFp16;
  return pf::sim::AnalyticCostModel(workload, device);
}

pf::sched::Schedule sweep_schedule(ScheduleKind kind, int stages) {
  pf::sched::ScheduleParams params;
  params.kind = kind;
  params.workers = stages;
  params.microbatches = stages;
  params.chunks_per_worker = kind == ScheduleKind::kInterleaved ? 2 : 1;
  params.num_layers = stages * params.chunks_per_worker;  // one layer per stage
  return pf::sched::compile(params);
}

// A measured-format profile with the analytic model's per-chunk and per-Linear times (what a
// profile of PipeFisher's published per-layer times looks like), its per-task overhead included.
pf::sim::MeasuredCostModel measured_from(const pf::sim::AnalyticCostModel& analytic,
                                         const pf::sched::Schedule& schedule) {
  pf::sim::Profile profile;
  profile.description = "from the analytic model";
  for (int c = 0; c < schedule.placement.chunks_per_pipeline; ++c) {
    const auto& placed = schedule.placement.at(0, c);
    pf::sched::Instruction in;
    in.pipeline = 0;
    in.chunk = c;
    in.microbatch = 0;
    pf::sim::ChunkProfile chunk;
    chunk.chunk = c;
    in.kind = pf::sched::OpKind::kForward;
    chunk.forward_s = analytic.duration(schedule, placed.worker, in);
    in.kind = pf::sched::OpKind::kBackward;
    chunk.backward_s = analytic.duration(schedule, placed.worker, in);
    chunk.activation_bytes = analytic.activation_bytes(schedule, 0, c);
    chunk.static_bytes = analytic.static_bytes(schedule, 0, c);
    profile.chunks.push_back(chunk);
  }
  const auto& device = analytic.device();
  profile.communication = {device.link_bandwidth, device.link_latency_s,
                           pf::sim::boundary_bytes(analytic.workload())};
  profile.reduction = {device.link_bandwidth, device.link_latency_s, 0.0};
  profile.kfac_task_overhead_s = analytic.kfac_task_overhead_s();
  for (int l = 0; l < pf::sched::kNumLinearKinds; ++l) {
    pf::sched::Instruction in;
    in.layer = 0;
    in.linear = static_cast<pf::sched::LinearKind>(l);
    pf::sim::KfacProfile k;
    k.linear = in.linear;
    auto time = [&](pf::sched::OpKind kind) {
      in.kind = kind;
      return analytic.duration(schedule, 0, in);
    };
    k.curvature_a_s = time(pf::sched::OpKind::kCurvatureA);
    k.curvature_b_s = time(pf::sched::OpKind::kCurvatureB);
    k.invert_a_s = time(pf::sched::OpKind::kInvertA);
    k.invert_b_s = time(pf::sched::OpKind::kInvertB);
    k.precondition_s = time(pf::sched::OpKind::kPrecondition);
    k.bytes = analytic.kfac_bytes(schedule, 0, in.linear);
    profile.kfac.push_back(k);
  }
  return pf::sim::MeasuredCostModel(profile, "sweep profile");
}

// PipeFisher's own step-time overhead: every preconditioning after the flush (the worst worker).
double pipefisher_overhead(const pf::sim::CostModel& costs, const pf::sched::Schedule& base,
                           double step_s) {
  const auto held = pf::pipefisher::preconditioned_linears(base, pf::pipefisher::KfacOptions{});
  double worst = 0.0;
  for (std::size_t w = 0; w < held.size(); ++w) {
    double total = 0.0;
    for (const auto& linear : held[w]) {
      pf::sched::Instruction in;
      in.kind = pf::sched::OpKind::kPrecondition;
      in.layer = static_cast<std::int16_t>(linear.layer);
      in.linear = linear.linear;
      total += costs.duration(base, static_cast<int>(w), in);
    }
    worst = std::max(worst, total);
  }
  return step_s > 0.0 ? worst / step_s : 0.0;
}

int print_pieces_sweep() {
  std::printf(
      "| costs | device | model | mb | D | schedule | bound | k split (whole) | util before | "
      "util after split (whole) | overhead split (whole) | PipeFisher's | pieces | after flush "
      "split (whole) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  int configs = 0, refused = 0, at_bound = 0, within_one = 0, above = 0, cheaper = 0;
  int whole_at_bound = 0, whole_refused = 0;
  for (const char* costs_kind : {"analytic", "measured"}) {
    for (const char* device : {"p100", "v100", "a100", "h100"}) {
      for (const char* model : {"base", "large"}) {
        for (int mb : {8, 16, 32}) {
          const auto analytic = sweep_analytic(model, device, mb);
          for (int stages : {4, 8, 16}) {
            for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB,
                                      ScheduleKind::kInterleaved, ScheduleKind::kChimera}) {
              ++configs;
              const auto base = sweep_schedule(kind, stages);
              std::optional<pf::sim::MeasuredCostModel> measured;
              if (std::strcmp(costs_kind, "measured") == 0)
                measured = measured_from(analytic, base);
              const pf::sim::CostModel& costs =
                  measured ? static_cast<const pf::sim::CostModel&>(*measured) : analytic;
              pf::pipefisher::KfacOptions split;
              pf::pipefisher::KfacOptions whole;
              whole.split = false;
              pf::pipefisher::KfacReport r, w;
              bool ok = true;
              try {
                r = pf::pipefisher::run_pipefisher(base, costs, split).report;
              } catch (const std::exception& error) {
                ++refused;
                ok = false;
                std::printf("| %s | %s | %s | %d | %d | %s | refused: %s |\n", costs_kind, device,
                            model, mb, stages, std::string(pf::sched::to_string(kind)).c_str(),
                            error.what());
              }
              try {
                w = pf::pipefisher::run_pipefisher(base, costs, whole).report;
              } catch (const std::exception&) {
                ++whole_refused;
              }
              if (!ok) continue;
              const double own = pipefisher_overhead(costs, base, r.step_time_before_s);
              at_bound += r.refresh_steps == r.refresh_bound ? 1 : 0;
              whole_at_bound += w.refresh_steps == w.refresh_bound ? 1 : 0;
              within_one += r.refresh_steps <= r.refresh_bound + 1 ? 1 : 0;
              above += r.refresh_steps > r.refresh_bound + 1 ? 1 : 0;
              cheaper += r.step_time_overhead <= own + 1e-9 ? 1 : 0;
              std::printf(
                  "| %s | %s | %s | %d | %d | %s | %d | %d (%d%s) | %.1f%% | %.1f%% (%.1f%%) | "
                  "%+.1f%% (%+.1f%%) | %+.1f%% | %d in %d | %.2f (%.2f) ms |\n",
                  costs_kind, device, model, mb, stages,
                  std::string(pf::sched::to_string(kind)).c_str(), r.refresh_bound, r.refresh_steps,
                  w.refresh_steps, w.capped ? ", capped" : "", 100 * r.utilization_before,
                  100 * r.utilization_after, 100 * w.utilization_after, 100 * r.step_time_overhead,
                  100 * w.step_time_overhead, 100 * own, r.pieces, r.divided_tasks,
                  1e3 * r.after_flush_s, 1e3 * w.after_flush_s);
            }
          }
        }
      }
    }
  }
  std::printf(
      "\nconfigurations %d; refused %d (split off: %d); k at the bound %d (split off: %d); "
      "k <= bound + 1 %d; k > bound + 1 %d; overhead <= PipeFisher's %d\n",
      configs, refused, whole_refused, at_bound, whole_at_bound, within_one, above, cheaper);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--figures") == 0) {
      const int per_stage = i + 1 < argc ? std::atoi(argv[i + 1]) : 1;
      return print_figures(per_stage > 0 ? per_stage : 1);
    }
    if (std::strcmp(argv[i], "--pieces") == 0) return print_pieces_sweep();
    if (std::strcmp(argv[i], "--zero-bubble") == 0) {
      const int per_stage = i + 1 < argc ? std::atoi(argv[i + 1]) : 1;
      return print_zero_bubble_figures(per_stage > 0 ? per_stage : 1);
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
