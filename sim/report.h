#pragma once
// What a simulation tells its user: the summary table, the --report JSON and the Chrome trace of
// the simulated run (same conventions as the compiler's trace, with real durations and memory
// counters).
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "scheduler/schedule.h"
#include "sim/simulator.h"

namespace pf::sim {

// How the run was costed, for throughput and model-FLOP utilization.
struct RunDescription {
  std::string cost_model;                 // "uniform", "analytic", "measured"
  std::string details;                    // e.g. "BERT large, S=128, b=32, bf16 on h100"
  int micro_batch_size = 0;               // sequences per micro-batch; 0: no throughput
  double model_flops_per_sequence = 0.0;  // forward + backward; 0: no MFU
  double peak_flops_per_worker = 0.0;     // at the run's precision; 0: no MFU
  // GPUs per pipeline worker: its tensor-parallel ranks (each worker stands for them all).
  int tensor_parallel = 1;
  // FLOPs executed per sequence on all ranks (recomputation included), for achieved TFLOP/s
  // per GPU; 0: model_flops_per_sequence.
  double hardware_flops_per_sequence = 0.0;
};

struct Headline {
  double step_time_s = 0.0;
  double bubble_fraction = 0.0;
  double sequences_per_s = 0.0;  // 0 when unknown
  double mfu = 0.0;  // model FLOP/s / (workers * data_parallel * tensor_parallel * peak); 0 unknown
  double achieved_tflops_per_gpu = 0.0;  // executed FLOP/s per GPU / 1e12; 0 unknown
  double mean_exposed_communication_s = 0.0;
  double max_peak_memory_bytes = 0.0;
};
Headline headline(const sched::Schedule& schedule, const SimResult& result,
                  const RunDescription& run);

// Multi-line table: headline figures, then one row per worker.
std::string summary_table(const sched::Schedule& schedule, const SimResult& result,
                          const RunDescription& run);

// {"schedule": {...}, "cost_model": ..., "step_time_s", "makespan_s", "bubble_fraction",
//  "sequences_per_s", "mfu", "achieved_tflops_per_gpu", "gpus", "exposed_communication_s",
//  "workers": [{"worker", "utilization", "busy_s", "idle_s", "exposed_communication_s",
//  "peak_memory_bytes", "static_memory_bytes", "peak_activation_bytes",
//  "peak_stashed_microbatches"}]}
nlohmann::json report_json(const sched::Schedule& schedule, const SimResult& result,
                           const RunDescription& run);

// Chrome trace with the simulated times (µs) and a "memory (MiB)" counter per worker.
nlohmann::json simulated_trace(const sched::Schedule& schedule, const SimResult& result);

// One row of the --schedule all comparison: a result, or why the schedule was skipped.
struct ComparisonRow {
  std::string name;
  std::string skipped_reason;  // empty when simulated
  Headline figures;
  int workers = 0;
  int microbatches = 0;
  int chunks_per_worker = 1;
};
std::string comparison_table(const std::vector<ComparisonRow>& rows);
nlohmann::json comparison_json(const std::vector<ComparisonRow>& rows, const RunDescription& run);

}  // namespace pf::sim
