#include "runtime/train/train_options.h"

#include <cmath>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <utility>

#include <CLI/CLI.hpp>

#include "runtime/device/device_spec.h"

namespace pf::train {

void add_train_options(CLI::App& app, TrainOptions& o) {
  app.add_option("--model", o.model,
                 "BERT preset (tiny, mini, small, medium, base, large) or a Hugging Face "
                 "config.json; a preset takes its vocabulary size from the data")
      ->capture_default_str();
  app.add_option("--data", o.data,
                 "Directory of pretraining shards from pipefisher_data (*.pfshard), or "
                 "'synthetic' for reproducible random batches")
      ->required();
  app.add_option("--micro-batch-size", o.micro_batch_size, "Sequences per micro-batch")
      ->capture_default_str();
  app.add_option("--seq-len", o.seq_len,
                 "Sequence length; must match the shards (default: theirs; 128 for synthetic)");
  app.add_option("--precision", o.precision,
                 "fp32, or fp64 (exact checks; no K-FAC) on the CPU; fp32, tf32 or bf16 matrix "
                 "products (fp32 weights, optimizer and K-FAC state) on --device cuda, or "
                 "bf16-operands: bf16 products whose operands are rounded to bf16 copies first "
                 "(an experiment, docs/cuda.md)")
      ->capture_default_str();
  app.add_option("--attention", o.attention,
                 "batched (cuBLAS products around a softmax kernel) or fused (flash-style "
                 "kernels, --device cuda only): how the attention core runs (docs/cuda.md)")
      ->capture_default_str();
  app.add_option("--device", o.device,
                 "cpu, or cuda / cuda:N: every worker on that one GPU (a compute and a "
                 "communication stream each)")
      ->capture_default_str();
  app.add_option("--schedule", o.schedule, "gpipe, 1f1b, interleaved or chimera")
      ->capture_default_str();
  app.add_option("--stages,-p", o.stages, "Pipeline workers p (Chimera: D, even)")
      ->capture_default_str();
  app.add_option("--chunks,-v", o.chunks, "Model chunks per worker (interleaved)")
      ->capture_default_str();
  app.add_option("--layers-per-stage", o.layers_per_stage,
                 "Encoder layers of each chunk, comma-separated in chunk order (stages x chunks "
                 "entries, each >= 1, summing to the model's layers), e.g. 3,1 for a lighter "
                 "last stage (it also runs the MLM/NSP heads); default balanced");
  app.add_option("--microbatches,-m", o.microbatches, "Micro-batches per step and replica")
      ->capture_default_str();
  app.add_option("--data-parallel", o.data_parallel, "Data-parallel replicas of the pipeline")
      ->capture_default_str();
  app.add_flag("--split-backward", o.split_backward,
               "Backward split into backward-input and backward-weight (zero-bubble style)");
  app.add_option("--schedule-file", o.schedule_file,
                 "Run a saved schedule instead (JSON, e.g. from pipefisher_sim --out or "
                 "--kfac --out, or a torch.distributed.pipelining CSV)");
  app.add_option("--optimizer", o.optimizer, "lamb (NVIDIA's BERT recipe), adamw or sgd")
      ->capture_default_str();
  app.add_option("--lr", o.lr, "Peak learning rate (default: lamb 2e-3, adamw 1e-3, sgd 0.05)");
  app.add_option("--warmup", o.warmup,
                 "Linear warm-up, then polynomial decay (power 0.5) to 0: a fraction of --steps "
                 "when < 1, else a number of steps")
      ->capture_default_str();
  app.add_option("--steps", o.steps, "Total training steps (a resumed run continues up to it)")
      ->capture_default_str();
  app.add_option("--lr-decay-steps", o.lr_decay_steps,
                 "Steps of the warm-up and decay (default: --steps); give the final --steps to a "
                 "run that will be resumed so that both parts follow one schedule");
  app.add_option("--weight-decay", o.weight_decay, "Decoupled weight decay (lamb, adamw, sgd)")
      ->capture_default_str();
  app.add_option("--momentum", o.momentum, "SGD momentum")->capture_default_str();
  pipefisher::add_kfac_options(app, o.kfac);
  app.add_option("--kfac-damping", o.kfac_damping,
                 "K-FAC Tikhonov damping lambda (pi-adjusted between the two factors)")
      ->capture_default_str();
  app.add_option("--kfac-warmup-steps", o.kfac_warmup_steps,
                 "With --kfac: refresh K-FAC every step (curvature and inverses of each step, "
                 "after its flush where the bubbles cannot hold them) for the first N steps, "
                 "then continue on the pass's k-step schedule, its refresh windows starting at "
                 "step N (0: none)")
      ->capture_default_str();
  app.add_option("--kfac-profile", o.kfac_profile,
                 "Measured profile (pipefisher_train --profile-out) for the PipeFisher pass; "
                 "without it the run profiles the schedule and the K-FAC kernels first");
  app.add_option(
      "--kfac-profile-out", o.kfac_profile_out,
      "Write the profile the PipeFisher pass used (the self-profile, or --kfac-profile's) "
      "as JSON: --kfac-profile FILE reuses it and skips profiling, pipefisher_sim "
      "--profile FILE replays it");
  app.add_option("--shared-processor", o.shared_processor,
                 "How the PipeFisher pass models the workers sharing the cores (or the one GPU): "
                 "auto (the self-profile measures their capacity together; a --kfac-profile "
                 "keeps its own), off (a processor per worker), or a capacity C >= 1 (the "
                 "workers together run C times one worker's speed)")
      ->capture_default_str();
  app.add_option("--threads-per-worker", o.threads_per_worker, "OpenMP threads of each worker")
      ->capture_default_str();
  app.add_option("--seed", o.seed, "Seed of the weights, dropout and data order")
      ->capture_default_str();
  app.add_option("--wait-timeout", o.wait_timeout_s,
                 "Seconds any worker waits for another before the run stops with a report")
      ->capture_default_str();
  app.add_option("--dp-bucket-mb", o.dp_bucket_mb,
                 "Data-parallel gradient buckets of up to this many MiB, each all-reduced as soon "
                 "as the chunk's last backward has finished it (overlapping the rest of that "
                 "backward); 0: one all-reduce per chunk after it (same parameters either way)")
      ->capture_default_str();
  app.add_option("--checkpoint-dir", o.checkpoint_dir,
                 "Directory of checkpoints (one is always written at the end)");
  app.add_option("--checkpoint-every", o.checkpoint_every, "Steps between checkpoints (0: end)")
      ->capture_default_str();
  app.add_flag("--resume", o.resume, "Continue from the latest checkpoint in --checkpoint-dir");
  app.add_flag("--kfac-replan", o.kfac_replan,
               "With --resume and --kfac: profile this machine and run the PipeFisher pass again "
               "with this run's flags (e.g. another --kfac-refresh) instead of continuing the "
               "checkpoint's K-FAC schedule; the checkpoint must then be at the end of one of its "
               "refresh windows (the new schedule's windows start there)");
  app.add_option("--metrics", o.metrics, "JSON Lines file: one record per step");
  app.add_option("--trace", o.trace, "Chrome trace of the measured run (Perfetto)");
  app.add_option("--profile-out", o.profile_out,
                 "Measured profile for pipefisher_sim --profile (same schedule)");
  app.add_option("--calibration-out", o.calibration_out,
                 "The measured profile as calibration records (each chunk's forward and backward, "
                 "each Linear's K-FAC work, the optimizer step, with the model and shapes) for "
                 "pipefisher_sim calibrate --measurements");
  app.add_option("--eval-data", o.eval_data,
                 "Held-out shards (pipefisher_data; never trained on) or 'synthetic': MLM "
                 "loss/accuracy and NSP loss/accuracy every --eval-every steps and at the end");
  app.add_option("--eval-every", o.eval_every, "Steps between evaluations (0: only at the end)")
      ->capture_default_str();
  app.add_option("--eval-batches", o.eval_batches,
                 "Micro-batches of --eval-data evaluated, the first ones in shard order (0: all)")
      ->capture_default_str();
  app.add_option("--target-loss", o.target_loss,
                 "Stop at the first evaluation whose held-out loss (MLM + NSP) is at most this; "
                 "the step and training time are reported");
  app.add_option("--log-every", o.log_every, "Steps between progress lines")->capture_default_str();
  app.add_flag("--quiet,-q", o.quiet, "Only the final summary");
}

namespace {
[[noreturn]] void bad(const std::string& message) {
  throw std::invalid_argument(message);
}
}  // namespace

std::string products_precision(const std::string& precision) {
  return precision == "bf16-operands" ? "bf16" : precision;
}

void validate_options(const TrainOptions& o) {
  if (o.micro_batch_size < 1) bad("--micro-batch-size must be >= 1");
  if (o.seq_len < 0) bad("--seq-len must be >= 1");
  if (!o.calibration_out.empty() && o.precision == "fp64") {
    bad("--calibration-out: the simulator prices fp32, tf32 and bf16 only; drop --precision fp64");
  }
  const bool on_cuda = device::parse_device(o.device).kind == tensor::DeviceKind::kCuda;
  if (on_cuda) {
    if (o.precision != "fp32" && o.precision != "tf32" && o.precision != "bf16" &&
        o.precision != "bf16-operands") {
      bad("--precision on --device " + o.device + " must be fp32, tf32, bf16 or bf16-operands " +
          "(fp64 runs on the CPU only), got '" + o.precision + "'");
    }
  } else if (o.precision != "fp32" && o.precision != "fp64") {
    bad("--precision must be fp32 or fp64, got '" + o.precision + "'");
  }
  if (o.attention != "batched" && o.attention != "fused") {
    bad("--attention must be batched or fused, got '" + o.attention + "'");
  }
  if (o.attention == "fused" && !on_cuda) {
    bad("--attention fused runs on --device cuda only (the CPU has the batched attention)");
  }
  if (o.stages < 1) bad("--stages must be >= 1");
  if (o.chunks < 1) bad("--chunks must be >= 1");
  if (o.microbatches < 1) bad("--microbatches must be >= 1");
  if (o.data_parallel < 1) bad("--data-parallel must be >= 1");
  if (o.optimizer != "lamb" && o.optimizer != "adamw" && o.optimizer != "sgd") {
    bad("--optimizer must be lamb, adamw or sgd, got '" + o.optimizer + "'");
  }
  if (!(o.lr >= 0)) bad("--lr must be > 0");
  if (!(o.warmup >= 0)) bad("--warmup must be >= 0");
  if (o.lr_decay_steps < 0) bad("--lr-decay-steps must be >= 1");
  const std::int64_t decay_steps = o.lr_decay_steps > 0 ? o.lr_decay_steps : o.steps;
  if (o.warmup >= 1 && static_cast<double>(decay_steps) <= o.warmup) {
    bad("--warmup of " + std::to_string(static_cast<std::int64_t>(o.warmup)) + " steps leaves no " +
        "step of " + (o.lr_decay_steps > 0 ? "--lr-decay-steps " : "--steps ") +
        std::to_string(decay_steps) + " after it");
  }
  if (o.steps < 1) bad("--steps must be >= 1");
  if (!(o.weight_decay >= 0)) bad("--weight-decay must be >= 0");
  if (!(o.momentum >= 0 && o.momentum < 1)) bad("--momentum must lie in [0, 1)");
  if (!(o.kfac_damping > 0)) bad("--kfac-damping must be > 0");
  if (o.kfac.enabled && o.precision == "fp64") bad("--kfac runs in fp32: drop --precision fp64");
  if (!o.kfac_profile.empty() && !o.kfac.enabled) bad("--kfac-profile needs --kfac");
  if (!o.kfac_profile_out.empty() && !o.kfac.enabled) bad("--kfac-profile-out needs --kfac");
  (void)shared_processor_choice(o.shared_processor);
  if (o.shared_processor != "auto" && !o.kfac.enabled) bad("--shared-processor needs --kfac");
  // The pass's flags that contradict each other fail here, not after the self-profile.
  if (o.kfac.enabled) (void)pipefisher::to_kfac_options(o.kfac);
  if (o.kfac.offload != "none") {
    if (!o.kfac.enabled) bad("--kfac-offload needs --kfac");
    if (o.kfac.offload == "auto" && !(o.kfac.device_memory_budget_mib > 0)) {
      bad("--kfac-offload auto needs --device-memory-budget (MiB per device, > 0)");
    }
  }
  if (o.threads_per_worker < 1) bad("--threads-per-worker must be >= 1");
  if (!(o.wait_timeout_s > 0)) bad("--wait-timeout must be > 0 seconds");
  if (!(o.dp_bucket_mb >= 0) || o.dp_bucket_mb > 1048576.0) {
    bad("--dp-bucket-mb must be in [0, 1048576] (0: no buckets)");
  }
  if (o.checkpoint_every < 0) bad("--checkpoint-every must be >= 0");
  if (o.checkpoint_every > 0 && o.checkpoint_dir.empty()) {
    bad("--checkpoint-every needs --checkpoint-dir");
  }
  if (o.resume && o.checkpoint_dir.empty()) bad("--resume needs --checkpoint-dir");
  if (o.kfac_replan && !(o.resume && o.kfac.enabled))
    bad("--kfac-replan needs --resume and --kfac");
  if (o.kfac_warmup_steps < 0) bad("--kfac-warmup-steps must be >= 0");
  if (o.kfac_warmup_steps > 0) {
    if (!o.kfac.enabled) bad("--kfac-warmup-steps needs --kfac");
    if (o.kfac.refresh_steps == 1)
      bad("--kfac-warmup-steps with --kfac-refresh 1: every step refreshes already");
    if (!o.schedule_file.empty()) bad("--kfac-warmup-steps with --schedule-file: drop one");
  }
  if (o.log_every < 1) bad("--log-every must be >= 1");
  if (o.eval_every < 0) bad("--eval-every must be >= 0");
  if (o.eval_batches < 0) bad("--eval-batches must be >= 0");
  if (o.eval_every > 0 && o.eval_data.empty()) bad("--eval-every needs --eval-data");
  if (!(o.target_loss >= 0)) bad("--target-loss must be > 0");
  if (o.target_loss > 0 && (o.eval_data.empty() || o.eval_every == 0)) {
    bad("--target-loss is checked on the held-out loss: it needs --eval-data and --eval-every");
  }
  // Files written during or at the end of the run: a missing folder is said now, not after the
  // run's work (the trace and the profiles are written once training has ended).
  const std::pair<const char*, const std::string*> outputs[] = {
      {"--metrics", &o.metrics},
      {"--trace", &o.trace},
      {"--profile-out", &o.profile_out},
      {"--calibration-out", &o.calibration_out},
      {"--kfac-profile-out", &o.kfac_profile_out}};
  for (const auto& [flag, path] : outputs) {
    if (path->empty()) continue;
    const std::filesystem::path folder = std::filesystem::path(*path).parent_path();
    std::error_code error;
    if (!folder.empty() && !std::filesystem::is_directory(folder, error)) {
      bad(std::string(flag) + " " + *path + ": the folder " + folder.string() +
          " does not exist (create it first)");
    }
  }
}

optim::PolyWarmupSchedule learning_rate_schedule(const TrainOptions& o) {
  double base = o.lr;
  if (base <= 0) base = o.optimizer == "adamw" ? 1e-3 : o.optimizer == "sgd" ? 0.05 : 2e-3;
  optim::PolyWarmupSchedule schedule;
  schedule.base_lr = static_cast<float>(base);
  schedule.total_steps = o.lr_decay_steps > 0 ? o.lr_decay_steps : o.steps;
  schedule.warmup_fraction =
      o.warmup < 1 ? o.warmup : o.warmup / static_cast<double>(schedule.total_steps);
  return schedule;
}

SharedProcessorChoice shared_processor_choice(const std::string& value) {
  if (value == "auto") return {};
  if (value == "off") return {false, 0.0};
  std::size_t used = 0;
  double capacity = 0.0;
  try {
    capacity = std::stod(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || !std::isfinite(capacity) || capacity < 1.0) {
    throw std::invalid_argument("--shared-processor: '" + value +
                                "' (allowed: auto, off, or a capacity >= 1)");
  }
  return {false, capacity};
}

}  // namespace pf::train
