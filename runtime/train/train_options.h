#pragma once
// pipefisher_train's command line: the options, their flags (the schedule flags spelled as
// pipefisher_sim spells them) and the checks that refuse an impossible run before any work.
#include <cstdint>
#include <string>

#include "runtime/optim/lr_schedule.h"
#include "scheduler/pipefisher/kfac_command.h"

namespace CLI {
class App;  // CLI11; only the .cpp files include it
}  // namespace CLI

namespace pf::train {

struct TrainOptions {
  // Model and data.
  std::string model = "mini";  // preset or Hugging Face config.json
  std::string data;            // shards directory (pipefisher_data), or "synthetic"
  int micro_batch_size = 8;
  int seq_len = 0;  // 0: the shards' sequence length (128 for synthetic data)
  // fp32 or fp64 (CPU); fp32, tf32, bf16 or bf16-operands products (cuda; see
  // kernels::GemmPrecision).
  std::string precision = "fp32";
  std::string attention = "batched";  // batched | fused (cuda only)
  std::string device = "cpu";         // cpu, cuda or cuda:N
  // Schedule.
  std::string schedule = "1f1b";
  int stages = 2;
  int chunks = 1;
  std::string layers_per_stage;  // "3,1": encoder layers per chunk (pipefisher_sim's flag)
  int microbatches = 4;
  int data_parallel = 1;
  bool split_backward = false;
  std::string schedule_file;  // saved or PipeFisher-augmented schedule (JSON or torch CSV)
  // Optimization.
  std::string optimizer = "lamb";  // lamb, adamw, sgd
  double lr = 0.0;                 // 0: the optimizer's default
  double warmup = 0.1;             // fraction of the steps (< 1) or a number of steps (>= 1)
  std::int64_t steps = 20;
  std::int64_t lr_decay_steps = 0;  // steps of the warm-up/decay schedule (0: --steps)
  double weight_decay = 0.01;
  double momentum = 0.9;  // sgd
  // K-FAC (PipeFisher).
  pipefisher::KfacCommandOptions kfac;
  double kfac_damping = 1e-3;
  // K-FAC refreshed every step for the first this many steps (rounded up to a multiple of the
  // main refresh interval), then on the pass's schedule: the curvature of the first steps is the
  // most stale by the next refresh (docs/convergence.md). 0: no warm-up.
  std::int64_t kfac_warmup_steps = 0;
  std::string kfac_profile;      // measured profile for the pass (else the run profiles itself)
  std::string kfac_profile_out;  // where to write the profile the pass used
  // How the pass models the workers sharing this machine's cores (or the one GPU): "auto" (the
  // self-profile measures the capacity; a --kfac-profile's own), "off" (a processor per
  // worker), or a capacity C >= 1 (docs/simulator.md "Shared processors").
  std::string shared_processor = "auto";
  // Runtime.
  int threads_per_worker = 1;
  std::uint64_t seed = 1;
  double wait_timeout_s = 600.0;
  // Data-parallel gradient buckets started during each chunk's last backward (MB = 2^20 bytes;
  // 0: one all-reduce per chunk at its DP reduction), exec::ExecutorOptions::dp_bucket_bytes.
  double dp_bucket_mb = 4.0;
  // Outputs.
  std::string checkpoint_dir;
  std::int64_t checkpoint_every = 0;  // 0: only at the end
  bool resume = false;
  // With --resume and --kfac: plan K-FAC again (self-profile and the pass, with this run's
  // flags) instead of continuing the checkpoint's k-step schedule.
  bool kfac_replan = false;
  std::string metrics;          // JSON Lines, one record per step
  std::string trace;            // Chrome trace of the measured run
  std::string profile_out;      // measured profile in the simulator's format
  std::string calibration_out;  // the profile as calibration records (pipefisher_sim calibrate)
  // Held-out evaluation (evaluation.h) and early stop.
  std::string eval_data;           // shards directory, or "synthetic"; empty: no evaluation
  std::int64_t eval_every = 0;     // steps between evaluations (0: only at the end)
  std::int64_t eval_batches = 16;  // micro-batches of the evaluation set (0: all of it)
  double target_loss = 0.0;        // > 0: stop once the evaluation loss (MLM + NSP) is <= it
  int log_every = 1;
  bool quiet = false;
};

// Registers every flag on app; --help documents them.
void add_train_options(CLI::App& app, TrainOptions& options);

// One clear error (std::invalid_argument) for a bad value or an impossible combination.
void validate_options(const TrainOptions& options);

// --precision as the simulator prices it (sim::precision_from_string): bf16-operands runs the
// bf16 products of bf16 (only how the operands reach cuBLAS differs), so it is priced as bf16.
std::string products_precision(const std::string& precision);

// The learning-rate schedule of the options: --lr (or the optimizer's default), --warmup, over
// --lr-decay-steps (else --steps).
optim::PolyWarmupSchedule learning_rate_schedule(const TrainOptions& options);

// --shared-processor's value: measure the capacity (auto), or a fixed one (0: off, a processor
// per worker). Throws std::invalid_argument naming the flag and the allowed values.
struct SharedProcessorChoice {
  bool measure = true;
  double capacity = 0.0;
};
SharedProcessorChoice shared_processor_choice(const std::string& value);

}  // namespace pf::train
