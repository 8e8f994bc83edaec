// The PipeFisher pass on BERT with the analytic cost model.
//   bench_pipefisher [benchmark flags]   time the pass (BERT-Large, 8 stages, Chimera, 64 mb ...)
//   bench_pipefisher --figures           print the docs' table (docs/pipefisher.md)
//   bench_pipefisher --zero-bubble N     zero-bubble schedules against 1F1B with K-FAC, m = N*p
//   bench_pipefisher --pieces [CASE]     the divisible-task sweep (docs/pipefisher.md): one
//                                        layer per stage, N = D micro-batches, split on vs off;
//                                        CASE (e.g. analytic/v100/large/8/4/1f1b): that one only
//   bench_pipefisher --pieces-pipelined [CASE]  the same with --kfac-pipelined-refresh on: k on
//                                        and off against the bound, overhead beside PipeFisher's
//   (both sweeps: --spill-budget F, the pass's --kfac-spill-budget; --free-spill, the pass's
//   --kfac-free-spill on)
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "runtime/model/bert_config.h"
#include "scheduler/compile.h"
#include "scheduler/pipefisher/defer_weights.h"
#include "scheduler/pipefisher/pass.h"
#include "scheduler/pipefisher/pieces_sweep.h"
#include "sim/analytic_cost_model.h"
#include "sim/uniform_cost_model.h"

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

// The scale target (docs/benchmarks.md, "The pass at p = 64, m = 1024"): 1F1B, 64
// workers, 1024 micro-batches, uniform costs as `pipefisher_sim --uniform
// 0.001,0.002,0.00005` (F 1 ms, B 2 ms, 50 us per hop, K-FAC tasks of zero cost: ~790k tasks
// per refresh, all whole). The pass alone, without compiling or printing; argument: the policy.
void BM_PipeFisherPassP64M1024(benchmark::State& state) {
  pf::sched::ScheduleParams params;
  params.kind = ScheduleKind::kOneFOneB;
  params.workers = 64;
  params.microbatches = 1024;
  const auto base = pf::sched::compile(params);
  pf::sim::UniformCosts uniform;
  uniform.forward_s = 0.001;
  uniform.backward_s = 0.002;
  uniform.communication_s = 0.00005;
  const pf::sim::UniformCostModel costs(uniform);
  pf::pipefisher::KfacOptions options;
  options.policy = static_cast<pf::pipefisher::PackingPolicy>(state.range(0));
  int k = 0;
  for (auto _ : state) {
    const auto result = pf::pipefisher::run_pipefisher(base, costs, options);
    k = result.report.refresh_steps;
    benchmark::DoNotOptimize(k);
  }
  state.counters["k"] = k;
  state.SetLabel(std::string(pf::pipefisher::to_string(options.policy)));
}
BENCHMARK(BM_PipeFisherPassP64M1024)
    ->DenseRange(0, 2)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);

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
  // The same with the Ws movable (--kfac-move-w on): k, step time and how far they moved.
  char moved[160];
  try {
    pf::pipefisher::KfacOptions move;
    move.move_weights = true;
    const auto r = pf::pipefisher::run_pipefisher(base, costs, move).report;
    const std::string distance = r.weights_deferred == 0
                                     ? "unmoved"
                                     : (r.weights_deferred >= pf::pipefisher::kDeferAllTheWay
                                            ? "all the way"
                                            : std::to_string(r.weights_deferred));
    std::snprintf(moved, sizeof moved, "%d | %.2f | %s | %.3f", r.refresh_steps,
                  1e3 * r.step_time_after_s, distance.c_str(),
                  one_f_one_b_step_s > 0.0 ? r.step_time_after_s / one_f_one_b_step_s : 1.0);
  } catch (const std::exception&) {
    std::snprintf(moved, sizeof moved, "none | | |");
  }
  pf::pipefisher::KfacOptions fixed;
  fixed.refresh_steps = one_f_one_b_k;
  const auto f = pf::pipefisher::run_pipefisher(base, costs, fixed).report;
  char row[600];
  std::snprintf(row, sizeof row,
                "| %s | %d | %d | %s | %.1f%% | %.2f | %s | %s | %.2f | %d | %.3f |\n", model,
                stages, microbatches, std::string(pf::sched::to_string(kind)).c_str(),
                100 * f.utilization_before, 1e3 * f.step_time_before_s, automatic, moved,
                1e3 * f.step_time_after_s, f.spilled_tasks,
                one_f_one_b_step_s > 0.0 ? f.step_time_after_s / one_f_one_b_step_s : 1.0);
  return row;
}

int print_zero_bubble_figures(int microbatches_per_stage) {
  std::printf(
      "| model | p | m | schedule | util before | step before (ms) | k (auto) | util after | "
      "step after (ms) | overhead | k, W movable | step after (ms), W movable | Ws deferred | "
      "vs 1F1B + K-FAC, W movable | step at 1F1B's k (ms) | spilled tasks | vs 1F1B at that k "
      "|\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
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
          std::printf("| %s | %d | %d | %s | n/a: %s |||||||||||||\n", model, stages, microbatches,
                      std::string(pf::sched::to_string(kind)).c_str(), error.what());
        }
      }
    }
  }
  return 0;
}

// --- The divisible-task sweep (docs/pipefisher.md, "The sweep"): every case of
// pf::pipefisher::pieces_sweep_cases(), or the one named (costs/device/model/mb/D/schedule).
int print_pieces_sweep(const char* only, const pf::pipefisher::KfacOptions& options) {
  std::printf(
      "| costs | device | model | mb | D | schedule | bound | with release times | in usable gaps "
      "| k split (whole) | util before | util after split (whole) | overhead split (whole) | "
      "PipeFisher's | pieces | after flush split (whole) |\n|---|---|---|---|---|---|---|---|---|"
      "---|---|---|---|---|---|---|\n");
  std::vector<pf::pipefisher::SweepResult> results;
  for (const auto& config : pf::pipefisher::pieces_sweep_cases()) {
    if (only != nullptr && config.name() != only) continue;
    const auto r = pf::pipefisher::run_sweep_case(config, options);
    results.push_back(r);
    const std::string schedule = std::string(pf::sched::to_string(config.kind));
    if (!r.refused.empty()) {
      std::printf("| %s | %s | %s | %d | %d | %s | refused: %s |\n", config.costs.c_str(),
                  config.device.c_str(), config.model.c_str(), config.micro_batch, config.stages,
                  schedule.c_str(), r.refused.c_str());
      continue;
    }
    const auto& s = r.split;
    const auto& w = r.whole;
    std::printf(
        "| %s | %s | %s | %d | %d | %s | %d | %d | %d | %d%s (%d%s) | %.1f%% | %.1f%% (%.1f%%) | "
        "%+.1f%% (%+.1f%%) | %+.1f%% | %d in %d | %.2f (%.2f) ms |\n",
        config.costs.c_str(), config.device.c_str(), config.model.c_str(), config.micro_batch,
        config.stages, schedule.c_str(), s.refresh_bound, s.release_bound, s.usable_bound,
        s.refresh_steps, s.capped ? ", capped" : "", w.refresh_steps, w.capped ? ", capped" : "",
        100 * s.utilization_before, 100 * s.utilization_after, 100 * w.utilization_after,
        100 * s.step_time_overhead, 100 * w.step_time_overhead, 100 * r.pipefisher_overhead,
        s.pieces, s.divided_tasks, 1e3 * s.after_flush_s, 1e3 * w.after_flush_s);
    std::fflush(stdout);
  }
  // By cost model and schedule: the criteria's counts and the mean utilization and overheads.
  std::printf(
      "\n| costs | schedule | configurations | k at bound | at bound with release times | at bound "
      "in usable gaps | k <= bound + 1 | split off: k at its bound | util before | util after "
      "split (whole) | overhead split (whole) | PipeFisher's | overhead <= PipeFisher's |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const char* costs : {"analytic", "measured"}) {
    for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB, ScheduleKind::kInterleaved,
                      ScheduleKind::kChimera}) {
      std::vector<pf::pipefisher::SweepResult> group;
      double before = 0, after = 0, after_whole = 0, overhead = 0, overhead_whole = 0, own = 0;
      for (const auto& r : results) {
        if (r.config.costs != costs || r.config.kind != kind || !r.refused.empty()) continue;
        group.push_back(r);
        before += r.split.utilization_before;
        after += r.split.utilization_after;
        after_whole += r.whole.utilization_after;
        overhead += r.split.step_time_overhead;
        overhead_whole += r.whole.step_time_overhead;
        own += r.pipefisher_overhead;
      }
      if (group.empty()) continue;
      const double n = static_cast<double>(group.size());
      const auto g = pf::pipefisher::summarize(group);
      std::printf(
          "| %s | %s | %d | %d | %d | %d | %d | %d | %.1f%% | %.1f%% (%.1f%%) | %+.1f%% (%+.1f%%) "
          "| %+.1f%% | %d |\n",
          costs, std::string(pf::sched::to_string(kind)).c_str(), g.configurations, g.at_bound,
          g.at_release_bound, g.at_usable_bound, g.within_one, g.whole_at_bound, 100 * before / n,
          100 * after / n, 100 * after_whole / n, 100 * overhead / n, 100 * overhead_whole / n,
          100 * own / n, g.not_costlier);
    }
  }
  const auto sum = pf::pipefisher::summarize(results);
  std::printf(
      "\nconfigurations %d; refused %d (split off: %d); k at the bound %d (split off: %d); k at "
      "the bound with release times %d; k at usable_bound %d/%d; k <= bound + 1 %d; k > bound "
      "+ 1 %d; capped below the bound (bound > --kfac-max-refresh) %d; overhead <= PipeFisher's "
      "%d; schedules the validator refused %d\n",
      sum.configurations, sum.refused, sum.whole_refused, sum.at_bound, sum.whole_at_bound,
      sum.at_release_bound, sum.at_usable_bound, sum.configurations, sum.within_one,
      sum.above_bound_plus_one, sum.capped_below_bound, sum.not_costlier, sum.invalid);
  return 0;
}

// --- The same sweep with --kfac-pipelined-refresh on (docs/pipefisher.md, "The pipelined
// refresh"): k against the work/bubble bound with the option on and off (the plain refresh's k,
// searched in the same run), and the step-time overhead beside PipeFisher's own at the k taken.
int print_pipelined_sweep(const char* only, pf::pipefisher::KfacOptions options) {
  options.pipelined_refresh = true;
  std::printf(
      "| costs | device | model | mb | D | schedule | bound | in usable gaps | k off | k on | "
      "pipelined | tasks in the next window | overhead | PipeFisher's |\n|---|---|---|---|---|---|"
      "---|---|---|---|---|---|---|---|\n");
  std::vector<pf::pipefisher::SweepResult> results;
  for (const auto& config : pf::pipefisher::pieces_sweep_cases()) {
    if (only != nullptr && config.name() != only) continue;
    const auto r = pf::pipefisher::run_sweep_case(config, options);
    results.push_back(r);
    const std::string schedule = std::string(pf::sched::to_string(config.kind));
    if (!r.refused.empty()) {
      std::printf("| %s | %s | %s | %d | %d | %s | refused: %s |\n", config.costs.c_str(),
                  config.device.c_str(), config.model.c_str(), config.micro_batch, config.stages,
                  schedule.c_str(), r.refused.c_str());
      continue;
    }
    const auto& s = r.split;
    std::printf(
        "| %s | %s | %s | %d | %d | %s | %d | %d | %d | %d%s | %s | %d | %+.1f%% | "
        "%+.1f%% |%s%s\n",
        config.costs.c_str(), config.device.c_str(), config.model.c_str(), config.micro_batch,
        config.stages, schedule.c_str(), s.refresh_bound, s.usable_bound, s.plain_refresh_steps,
        s.refresh_steps, s.capped ? ", capped" : "", s.pipelined_refresh ? "yes" : "no",
        s.wrapped_tasks, 100 * s.step_time_overhead, 100 * r.pipefisher_overhead,
        r.invalid.empty() ? "" : " invalid: ", r.invalid.c_str());
    std::fflush(stdout);
  }
  std::printf(
      "\n| schedule | configurations | k at bound: off | on | k <= bound + 1: off | on | k at the "
      "bound in usable gaps | pipelined plans | with work in the next window | overhead on | "
      "PipeFisher's | overhead <= PipeFisher's |\n|---|---|---|---|---|---|---|---|---|---|---|"
      "---|\n");
  const auto row = [&](const std::string& name, const auto& in_group) {
    std::vector<pf::pipefisher::SweepResult> group;
    double overhead = 0, own = 0;
    for (const auto& r : results) {
      if (!in_group(r) || !r.refused.empty()) continue;
      group.push_back(r);
      overhead += r.split.step_time_overhead;
      own += r.pipefisher_overhead;
    }
    if (group.empty()) return;
    const double n = static_cast<double>(group.size());
    const auto g = pf::pipefisher::summarize(group);
    std::printf("| %s | %d | %d | %d | %d | %d | %d | %d | %d | %+.1f%% | %+.1f%% | %d |\n",
                name.c_str(), g.configurations, g.plain_at_bound, g.at_bound, g.plain_within_one,
                g.within_one, g.at_usable_bound, g.pipelined_plans, g.wrapping_plans,
                100 * overhead / n, 100 * own / n, g.not_costlier);
  };
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB, ScheduleKind::kInterleaved,
                    ScheduleKind::kChimera}) {
    row(std::string(pf::sched::to_string(kind)),
        [&](const pf::pipefisher::SweepResult& r) { return r.config.kind == kind; });
  }
  row("all", [](const pf::pipefisher::SweepResult&) { return true; });
  const auto sum = pf::pipefisher::summarize(results);
  std::printf(
      "\nconfigurations %d; refused %d; k at the bound %d (off: %d); k at usable_bound %d/%d; "
      "k <= bound + 1 %d (off: %d); k > bound + 1 %d; pipelined plans %d, %d with work in the "
      "next window; schedules the validator refused %d\n",
      sum.configurations, sum.refused, sum.at_bound, sum.plain_at_bound, sum.at_usable_bound,
      sum.configurations, sum.within_one, sum.plain_within_one, sum.above_bound_plus_one,
      sum.pipelined_plans, sum.wrapping_plans, sum.invalid);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  pf::pipefisher::KfacOptions sweep_options;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--spill-budget") == 0)
      sweep_options.spill_budget = std::atof(argv[i + 1]);
  }
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--free-spill") == 0) sweep_options.free_spill = true;
  }
  const auto case_after = [&](int i) {
    return i + 1 < argc && std::strncmp(argv[i + 1], "--", 2) != 0 ? argv[i + 1] : nullptr;
  };
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--figures") == 0) {
      const int per_stage = i + 1 < argc ? std::atoi(argv[i + 1]) : 1;
      return print_figures(per_stage > 0 ? per_stage : 1);
    }
    if (std::strcmp(argv[i], "--pieces") == 0)
      return print_pieces_sweep(case_after(i), sweep_options);
    if (std::strcmp(argv[i], "--pieces-pipelined") == 0) {
      return print_pipelined_sweep(case_after(i), sweep_options);
    }
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
