#include "runtime/train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "common/decimal_seconds.h"
#include "kernels/cpu/dense_library.h"
#include "kfac/state_placement.h"
#include "runtime/device/device_spec.h"
#include "runtime/executor/executor.h"
#include "runtime/executor/measured.h"
#include "runtime/executor/shard_batches.h"
#include "runtime/optim/adamw.h"
#include "runtime/optim/lamb.h"
#include "runtime/optim/lr_schedule.h"
#include "runtime/optim/sgd.h"
#include "runtime/train/checkpointing.h"
#include "runtime/train/periodic_evaluation.h"
#include "runtime/train/self_profile.h"
#include "scheduler/pipefisher/offload_pass.h"
#include "scheduler/pipefisher/pass.h"
#include "scheduler/schedule_json.h"
#include "sim/cli/compile_command.h"
#include "sim/machine_processors.h"
#include "sim/measured_cost_model.h"
#include "sim/profile_measurements.h"
#include "sim/simulator.h"
#include "traces/chrome_trace.h"

namespace pf::train {

namespace {

namespace fs = std::filesystem;

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<std::int64_t>(seconds + 0.5);
  std::ostringstream out;
  if (s >= 3600) out << s / 3600 << "h";
  if (s >= 60) out << (s / 60) % 60 << "m";
  out << s % 60 << "s";
  return out.str();
}

std::vector<std::string> shard_files(const std::string& directory) {
  if (!fs::is_directory(directory)) {
    throw std::invalid_argument("--data " + directory +
                                ": not a directory of shards (make one with pipefisher_data, or "
                                "pass --data synthetic)");
  }
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(directory)) {
    if (entry.is_regular_file() && entry.path().extension() == ".pfshard") {
      files.push_back(entry.path().string());
    }
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) {
    throw std::invalid_argument("--data " + directory + ": no *.pfshard files in it");
  }
  return files;
}

bool has_kfac(const sched::Schedule& schedule) {
  for (const auto& stream : schedule.streams) {
    for (const auto& in : stream) {
      if (sched::is_kfac(in.kind)) return true;
    }
  }
  return false;
}

struct RunContext {
  model::BertConfig config;
  sched::Schedule schedule;
  std::unique_ptr<exec::BatchSource> batches;
  exec::ShardBatches* shards = nullptr;
  std::int64_t micro_batch_size = 0, seq_len = 0, max_predictions = 0;
  std::string kfac_summary;
  kfac::StatePlacement kfac_placement;  // across the data-parallel replicas (the pass's choice)
  // The pass's model of the busiest replica's K-FAC state and bytes sent per refresh (-1: none).
  double kfac_model_bytes = -1.0, kfac_model_sent_per_refresh = -1.0;
  // --kfac-offload: the plan's K-FAC state on the busiest worker's device without and with
  // offload (-1: no offload).
  double kfac_offload_device_before = -1.0, kfac_offload_device_after = -1.0;
  double kfac_offload_sums = 0.0;                  // the plan's factor sums (WorkerOffloadReport)
  nlohmann::json identity;                         // what a checkpoint must share to resume
  std::optional<ckpt::TrainingCheckpoint> resume;  // --resume: the checkpoint to continue
  std::shared_ptr<device::DeviceRuntime> device;   // --device cuda; null on the CPU
  // --kfac-warmup-steps: the warm-up's schedule (K-FAC refreshed every step) and the step at
  // which the main schedule takes over, its refresh windows starting there; none: 0.
  std::optional<sched::Schedule> warmup_schedule;
  std::int64_t warmup_end = 0;
  // Where the run's refresh windows start (ExecutorOptions::window_origin): 0, or where a
  // resumed run's schedule takes over from the checkpoint's (check_kfac_resumable).
  std::int64_t window_origin = 0;
  // The checkpoint's schedule finishes its refresh before this run's takes over (a pipelined
  // refresh whose work runs on into the next window: needs_refresh_finished).
  bool finish_saved_refresh = false;
};

device::OptimizerChoice device_optimizer_choice(const TrainOptions& o) {
  device::OptimizerChoice choice;
  choice.name = o.optimizer;
  choice.adamw = optim::AdamWOptions{.weight_decay = o.weight_decay};
  choice.lamb = optim::LambOptions{.weight_decay = o.weight_decay};
  choice.sgd = optim::SgdOptions{.momentum = o.momentum, .weight_decay = o.weight_decay};
  return choice;
}

template <typename T>
exec::OptimizerFactory<T> optimizer_factory(const TrainOptions& o) {
  if (o.optimizer == "adamw") {
    return [o] {
      return std::make_unique<optim::BasicAdamW<T>>(
          optim::AdamWOptions{.weight_decay = o.weight_decay});
    };
  }
  if (o.optimizer == "sgd") {
    return [o] {
      return std::make_unique<optim::BasicSgd<T>>(
          optim::SgdOptions{.momentum = o.momentum, .weight_decay = o.weight_decay});
    };
  }
  return [o] {
    return std::make_unique<optim::BasicLamb<T>>(
        optim::LambOptions{.weight_decay = o.weight_decay});
  };
}

class MetricsWriter {
 public:
  explicit MetricsWriter(const std::string& path) {
    if (path.empty()) return;
    file_.open(path, std::ios::app);
    if (!file_) throw std::invalid_argument("--metrics " + path + ": cannot open for writing");
  }
  void write(const nlohmann::json& record) {
    if (!file_.is_open()) return;
    file_ << record.dump() << "\n";
    file_.flush();
  }

 private:
  std::ofstream file_;
};

// Steps the end-of-run summary measures when no trace or profile asks for every step.
constexpr std::int64_t kSummarySteps = 200;

// Measured step time and utilization, and the simulator's replay of the measured durations on
// the same schedule: how far the run is from what its own profile predicts (executor overhead
// plus the simulator's modelling error).
void print_measured_summary(const sched::Schedule& schedule,
                            const std::vector<exec::InstructionEvent>& events, int ranks,
                            std::int64_t first_step, std::ostream& out) {
  std::int64_t last_step = first_step;
  for (const auto& event : events) last_step = std::max(last_step, event.global_step);
  // The first step allocates and touches memory: leave it out when there are others. A K-FAC
  // run from step 0 preconditions nothing until its first refresh's inverses exist (the first
  // window's last step, or the second window with a pipelined refresh): leave that window out
  // too where later steps were recorded, so that the figures and the replay are those of the
  // refresh the pass planned (BERT-mini 1F1B, k = 8: +4.2% and +8.2% over LAMB over steps 9-16,
  // +2.8% and +7.6% over steps 2-17; docs/benchmarks.md).
  const std::int64_t window = schedule.num_steps;
  const bool after_first_window = first_step == 0 && window > 1 && last_step >= window;
  const auto warmup =
      static_cast<int>(after_first_window ? window : first_step + (last_step > first_step ? 1 : 0));
  const auto summary = exec::summarize_run(events, ranks, warmup);
  if (summary.window_s <= 0) return;
  auto profile =
      exec::measured_profile(schedule, events, warmup, "this run", exec::ProfileStatistic::kMean);
  // Steps that ran none of the schedule's K-FAC offload copies (a resumed run's part of a long
  // refresh window, whose copies sit around inversions it did not reach): the replay prices
  // them free, as the profile does copies too short for the clock.
  const bool offload_copies = std::ranges::any_of(schedule.streams, [](const auto& stream) {
    return std::ranges::any_of(stream,
                               [](const auto& in) { return sched::is_kfac_transfer(in.kind); });
  });
  if (offload_copies && !(profile.host_link.bandwidth > 0.0)) profile.host_link.bandwidth = 1e12;
  const auto replay = sim::simulate(schedule, sim::MeasuredCostModel(profile, "this run"));
  out << std::fixed << std::setprecision(3) << "measured over steps " << summary.first_step + 1
      << "-" << summary.last_step << ": " << decimal_seconds(summary.step_time_s)
      << " s/step, utilization " << std::setprecision(1) << 100.0 * summary.compute_utilization()
      << "%";
  if (summary.utilization_with_kfac() > summary.compute_utilization()) {
    out << " (" << 100.0 * summary.utilization_with_kfac() << "% with K-FAC)";
  }
  if (after_first_window) {
    out << "; steps 1-" << window
        << " left out (the first K-FAC refresh window, before its inverses)";
  }
  if (summary.compute_busy_s.size() > 1) {
    // Per rank: a pipeline's bubbles differ by position, and K-FAC fills them unevenly.
    out << "\n  per rank (compute + K-FAC of the window):";
    for (std::size_t r = 0; r < summary.compute_busy_s.size(); ++r) {
      out << " " << r << ": " << 100.0 * summary.compute_busy_s[r] / summary.window_s << "%";
      if (summary.kfac_busy_s[r] > 0) {
        out << " + " << 100.0 * summary.kfac_busy_s[r] / summary.window_s << "%";
      }
      out << (r + 1 < summary.compute_busy_s.size() ? "," : "");
    }
  }
  out << "\nsimulator replay of these durations: " << decimal_seconds(replay.step_time_s)
      << " s/step (" << std::showpos << std::setprecision(1)
      << 100.0 * (replay.step_time_s - summary.step_time_s) / summary.step_time_s << std::noshowpos
      << "% vs measured)\n";
}

template <typename T>
int train(const TrainOptions& o, RunContext& context, std::ostream& out, Launch& launch) {
  const auto& config = context.config;
  exec::RunSetup<T> setup;
  setup.config = config;
  setup.schedule = context.schedule;
  setup.options.threads_per_worker = o.threads_per_worker;
  setup.options.wait_timeout =
      std::chrono::milliseconds(static_cast<std::int64_t>(o.wait_timeout_s * 1000.0));
  setup.options.init_seed = o.seed;
  setup.options.dropout_seed = o.seed + 1;
  setup.options.dp_bucket_bytes = static_cast<std::int64_t>(o.dp_bucket_mb * 1048576.0);
  setup.options.kfac.damping = static_cast<float>(o.kfac_damping);
  setup.options.kfac.placement = context.kfac_placement;
  setup.options.window_origin = context.window_origin;
  // A run that is all warm-up (--kfac-warmup-steps >= --steps) runs the warm-up's schedule:
  // its checkpoints say so, as the warm-up executor's do.
  if (!context.warmup_schedule && context.warmup_end >= o.steps) {
    setup.options.kfac_warmup_end = context.warmup_end;
  }
  // Events feed the summary (a bounded window of a long run), the trace and the profile.
  setup.options.record_events = true;
  if (o.trace.empty() && o.profile_out.empty() && o.calibration_out.empty()) {
    setup.options.record_events_before_step =
        (context.resume ? context.resume->step : 0) + kSummarySteps + 1;
  }
  setup.make_optimizer = optimizer_factory<T>(o);
  setup.device = context.device;
  setup.device_optimizer = device_optimizer_choice(o);
  const auto lr_schedule = learning_rate_schedule(o);
  setup.learning_rate = [lr_schedule](std::int64_t step) {
    return static_cast<double>(lr_schedule.learning_rate(step));
  };
  setup.batches = context.batches.get();

  // With a K-FAC warm-up the run starts on the warm-up's schedule and moves to the main one at
  // context.warmup_end, carrying weights, optimizer and K-FAC state over in a checkpoint held in
  // memory: the inverses of the warm-up's last step serve the main schedule's first window.
  std::int64_t first_step = context.resume ? context.resume->step : 0;
  const bool warming_up = context.warmup_schedule && first_step < context.warmup_end;
  const std::int64_t record_events_from = setup.options.record_events_before_step;
  // A refresh the checkpoint's schedule finishes in its next window: finished there first, on an
  // executor of its own (gone before this run's is made).
  std::optional<ckpt::TrainingCheckpoint> finished_resume;
  if (context.resume && context.finish_saved_refresh) {
    finished_resume = finish_saved_refresh<T>(
        *context.resume, setup, context.identity,
        [&launch](exec::RunSetup<T> saved) { return launch.make_executor(std::move(saved)); });
  }
  std::unique_ptr<exec::Executor<T>> executor_owner;
  if (warming_up) {
    auto warmup_setup = setup;
    warmup_setup.schedule = *context.warmup_schedule;
    warmup_setup.options.kfac_warmup_end = context.warmup_end;
    executor_owner = launch.make_executor(std::move(warmup_setup));
  } else {
    executor_owner = launch.make_executor(setup);
  }
  if (context.resume) {
    restore_checkpoint(*executor_owner, finished_resume ? *finished_resume : *context.resume);
  }
  const auto& layout = setup.schedule.params;
  const std::int64_t sequences_per_step = static_cast<std::int64_t>(layout.microbatches) *
                                          layout.data_parallel * context.micro_batch_size;
  if (!o.quiet) {
    out << "pipefisher_train: BERT " << config.name << " (" << config.num_layers
        << " layers, hidden " << config.hidden_size << ", vocab " << config.vocab_size << "), "
        << sched::to_string(layout.kind) << " on " << setup.schedule.num_workers() << " "
        << launch.workers_noun() << " x " << layout.data_parallel << " replica(s), "
        << layout.microbatches << " micro-batches of " << context.micro_batch_size << " x "
        << context.seq_len << " tokens per step, " << o.optimizer << ", " << o.steps << " steps";
    if (context.device) {
      out << ", on " << tensor::to_string(context.device->device()) << " ("
          << kernels::to_string(context.device->precision()) << " products, "
          << kernels::to_string(context.device->attention()) << " attention)";
    } else {
      out << ", on the CPU (dense kernels: " << kernels::cpu::dense_library().summary << ")";
    }
    out << "\n";
    if (!context.kfac_summary.empty()) out << context.kfac_summary;
  }

  PeriodicEvaluation<T> evaluation(o, config, context.micro_batch_size, context.seq_len,
                                   context.max_predictions, *executor_owner);
  MetricsWriter metrics(executor_owner->is_root() ? o.metrics : std::string());
  const bool tty = isatty(STDOUT_FILENO) != 0 && &out == &std::cout;
  const auto start = std::chrono::steady_clock::now();
  double last_loss = 0.0;
  std::int64_t done = 0;
  double train_time_s = 0.0;  // summed step times (pauses for evaluation left out)
  auto on_step = [&](const exec::StepResult& r) {
    ++done;
    last_loss = r.loss();
    train_time_s += r.seconds;
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double per_step = elapsed / static_cast<double>(done);
    const double throughput = static_cast<double>(sequences_per_step) / r.seconds;
    metrics.write({{"step", r.step + 1},
                   {"loss", r.loss()},
                   {"mlm_loss", r.mlm_loss},
                   {"nsp_loss", r.nsp_loss},
                   {"lr", r.learning_rate},
                   {"grad_norm", r.grad_norm},
                   {"step_time_s", r.seconds},
                   {"train_time_s", train_time_s},
                   {"sequences_per_s", throughput},
                   {"kfac_refresh", r.kfac_refresh}});
    const bool last = r.step + 1 == o.steps;
    if (o.quiet || (!last && (r.step + 1) % o.log_every != 0)) return;
    std::ostringstream line;
    line << "step " << std::setw(5) << r.step + 1 << "/" << o.steps << "  loss " << std::fixed
         << std::setprecision(4) << r.loss() << " (mlm " << r.mlm_loss << ", nsp " << r.nsp_loss
         << ")  lr " << std::scientific << std::setprecision(2) << r.learning_rate << std::fixed
         << "  " << std::setprecision(1) << throughput << " seq/s"
         << (r.kfac_refresh ? "  K-FAC refresh" : "") << "  ETA "
         << format_duration(per_step * static_cast<double>(o.steps - r.step - 1));
    if (tty && !last) {
      out << "\r" << line.str() << "   " << std::flush;
    } else {
      out << (tty ? "\r" : "") << line.str() << "\n" << std::flush;  // logs follow along
    }
  };
  std::vector<std::int64_t> pauses;  // steps where the run paused to evaluate
  RunPauses evaluation_pauses;
  evaluation_pauses.segment_end = [&](std::int64_t from) {
    return evaluation.segment_end(from, o.steps);
  };
  evaluation_pauses.after_segment = [&](std::int64_t step) {
    const bool stop = evaluation.at_pause(
        *executor_owner, step, train_time_s, step == o.steps,
        [&](const nlohmann::json& r) { metrics.write(r); }, out);
    if (!stop && step < o.steps) pauses.push_back(step);
    return stop;
  };
  std::filesystem::path saved_in_warmup;  // the warm-up's last checkpoint
  if (warming_up) {
    // The warm-up's steps, with its checkpoints before its end (they record it, so that a
    // resume plans both schedules again), then its state into the main schedule's executor.
    TrainOptions warmup_options = o;
    warmup_options.steps = context.warmup_end;
    saved_in_warmup =
        run_with_checkpoints(*executor_owner, warmup_options, first_step, context.identity,
                             context.shards, on_step, {}, evaluation_pauses, false);
    // The warm-up's end is no evaluation's pause (its events end with its executor).
    if (!pauses.empty() && pauses.back() == context.warmup_end) pauses.pop_back();
    if (!evaluation.target_step()) {
      // Each process's ranks, under threads and MPI alike (the layout stays, so they do too).
      const auto state =
          collect_local_checkpoint(*executor_owner, context.warmup_end, context.identity);
      first_step = context.warmup_end;
      setup.options.window_origin = first_step;  // the main schedule's windows start here
      if (record_events_from != std::numeric_limits<std::int64_t>::max()) {
        setup.options.record_events_before_step = first_step + kSummarySteps + 1;
      }
      executor_owner.reset();  // its workers' memory, before the next executor's
      executor_owner = launch.make_executor(setup);
      restore_local_checkpoint(*executor_owner, state);
      // The checkpoint due at the warm-up's end: the main schedule's, its windows from here.
      if (!o.checkpoint_dir.empty() && o.checkpoint_every > 0 &&
          first_step % o.checkpoint_every == 0 && first_step < o.steps) {
        (void)save_checkpoint(*executor_owner, first_step, context.identity, context.shards,
                              o.checkpoint_dir, {});
      }
    }
  }
  auto& executor = *executor_owner;
  const auto& schedule = executor.setup().schedule;
  // The stash arenas' peak in the steps the profile keeps (after the first, which grows them).
  for (auto* worker : executor.local_workers()) {
    worker->reset_peak_stash_bytes(o.steps - first_step > 1 ? first_step + 1 : first_step);
  }
  // A target reached inside the warm-up ends the run there, with the checkpoint the warm-up
  // saved at that step.
  const auto checkpoint = !evaluation.target_step()
                              ? run_with_checkpoints(executor, o, first_step, context.identity,
                                                     context.shards, on_step, {}, evaluation_pauses)
                              : saved_in_warmup;
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  auto events = executor.take_events();
  const auto kfac_states = context.kfac_model_bytes >= 0.0 ? executor.kfac_state_per_rank()
                                                           : std::vector<exec::RankKfacState>{};
  // Every rank's parameters, gradients, optimizer and K-FAC state (the profile's static and
  // K-FAC bytes), gathered as text: each process describes its own workers. Collective.
  std::vector<exec::WorkerMemory> memory;
  {
    std::vector<exec::WorkerMemory> mine;
    for (const auto* worker : executor.local_workers()) mine.push_back(worker->memory());
    for (const auto& text : executor.gather_to_root(exec::memory_to_json(mine).dump())) {
      auto part = exec::memory_from_json(nlohmann::json::parse(text));
      memory.insert(memory.end(), part.begin(), part.end());
    }
    std::sort(memory.begin(), memory.end(),
              [](const auto& a, const auto& b) { return a.rank < b.rank; });
  }
  if (!executor.is_root()) return 0;  // the root process reports for every rank
  close_pauses(events, pauses);
  if (!o.trace.empty()) {
    traces::write_json_file(o.trace, exec::measured_trace(schedule, events));
  }
  if (!o.profile_out.empty() || !o.calibration_out.empty()) {
    const auto profile_of = [&](exec::ProfileStatistic statistic) {
      auto profile = exec::measured_profile(
          schedule, events, std::min<std::int64_t>(1, o.steps - 1),
          "pipefisher_train " + std::string(sched::to_string(schedule.params.kind)) + ", " +
              config.name + ", micro-batch " + std::to_string(context.micro_batch_size) + " x " +
              std::to_string(context.seq_len),
          statistic);
      exec::add_measured_memory(profile, memory);
      return profile;
    };
    if (!o.profile_out.empty()) {
      traces::write_json_file(o.profile_out,
                              sim::profile_to_json(profile_of(exec::ProfileStatistic::kMedian)));
    }
    if (!o.calibration_out.empty()) {
      // Means, not the profile's medians: a device fitted to them prices whole steps, and a
      // step is the sum of its instructions (the slow first micro-batch after the optimizer
      // step included).
      const auto profile = profile_of(exec::ProfileStatistic::kMean);
      const sim::ProfileWorkload workload{
          .config = config,
          .seq_len = static_cast<int>(context.seq_len),
          .micro_batch_size = static_cast<int>(context.micro_batch_size),
          .precision = sim::precision_from_string(products_precision(o.precision)),
          .attention = sim::attention_from_string(o.attention)};
      nlohmann::json tags = {{"schedule", std::string(sched::to_string(schedule.params.kind))},
                             {"stages", schedule.params.workers},
                             {"threads_per_worker", o.threads_per_worker},
                             {"statistic", "mean"}};
      // The CPU's rates depend on the library that ran its dense kernels.
      if (!context.device) tags["dense_library"] = kernels::cpu::dense_library().summary;
      traces::write_json_file(o.calibration_out,
                              sim::measurements_from_profile(profile, schedule, workload, tags));
    }
  }
  out << "done: " << done << " steps in " << format_duration(elapsed) << " ("
      << std::setprecision(1) << std::fixed
      << static_cast<double>(done * sequences_per_step) / elapsed << " sequences/s"
      << (pauses.empty() ? "" : ", evaluations included") << "), final loss "
      << std::setprecision(4) << last_loss << "\n";
  print_measured_summary(schedule, events, executor.num_ranks(), first_step, out);
  if (!kfac_states.empty() && schedule.params.data_parallel > 1) {
    std::int64_t held = 0, sent = -1;
    for (const auto& state : kfac_states) {
      held = std::max(held, state.state_bytes);
      sent = std::max(sent, state.sent_bytes);
    }
    const double refreshes = static_cast<double>(done) / schedule.num_steps;
    out << std::setprecision(3) << "K-FAC state per rank, measured: at most "
        << static_cast<double>(held) / (1024.0 * 1024.0) << " MiB held (model "
        << context.kfac_model_bytes / (1024.0 * 1024.0) << " MiB)";
    if (sent >= 0 && refreshes > 0) {
      out << ", " << static_cast<double>(sent) / refreshes / (1024.0 * 1024.0)
          << " MiB sent per refresh (model "
          << context.kfac_model_sent_per_refresh / (1024.0 * 1024.0) << " MiB)";
    }
    out << "\n";
  }
  if (!kfac_states.empty() && context.kfac_offload_device_after >= 0.0) {
    // The most K-FAC memory a rank held at once (its layers and the offload staging pool,
    // sampled after each K-FAC instruction) beside the plan's, and what was left at the end
    // (between refreshes an offloaded Linear holds nothing). The plan counts the kept state, one
    // offloaded Linear's state while it is moved and every Linear's factor sums, which the
    // curvature accumulates on the device (docs/offload.md); the host holds values, newest and
    // previous inverses (1.5x).
    std::int64_t peak = 0, end = 0, host = 0;
    for (const auto& state : kfac_states) {
      peak = std::max(peak, state.peak_resident_bytes);
      end = std::max(end, state.state_bytes);
      host = std::max(host, state.host_bytes);
    }
    constexpr double kMiB = 1024.0 * 1024.0;
    out << std::setprecision(3) << "K-FAC offload, measured: at most "
        << static_cast<double>(peak) / kMiB << " MiB of K-FAC state per rank on the "
        << (executor.setup().device ? "device" : "worker") << " at once ("
        << static_cast<double>(end) / kMiB << " MiB at the end), "
        << static_cast<double>(host) / kMiB << " MiB in host memory (plan: at most "
        << context.kfac_offload_device_after / kMiB << " MiB on the device at once, "
        << context.kfac_offload_sums / kMiB << " MiB of them factor sums; "
        << context.kfac_offload_device_before / kMiB << " MiB without offload)\n";
  }
  {
    // This process's workers (threads: every rank; MPI: the root's own).
    const auto workers = executor.local_workers();
    out << "stash arenas: peak";
    for (const auto* worker : workers) {
      out << (worker == workers.front() ? " " : ", ") << "rank " << worker->rank() << " "
          << worker->peak_stash_bytes() << " B";
    }
    out << " (steps after the first; the profile's activation_bytes replays it)\n";
    // On a device the optimizer instruction's measured time is its update alone; the rest of a
    // step's end (waits for the other workers and for the streams) is here, where a slow step
    // with idle compute shows its cause.
    if (executor.setup().device) {
      out << std::fixed << std::setprecision(2)
          << "step end, host ms per step (steps after the first):";
      const auto ms = [](double seconds, std::int64_t steps) {
        return 1e3 * seconds / static_cast<double>(steps);
      };
      for (const auto* worker : workers) {
        const auto t = worker->step_end_times();
        if (t.steps == 0) continue;
        out << (worker == workers.front() ? " " : "; ") << "rank " << worker->rank() << " sends "
            << ms(t.sends_s, t.steps) << ", tied embedding " << ms(t.tied_embedding_s, t.steps)
            << ", gradient norm " << ms(t.gradient_norm_s, t.steps) << ", statistics all-reduce "
            << ms(t.statistics_s, t.steps) << ", update " << ms(t.update_s, t.steps)
            << ", device sync " << ms(t.synchronize_s, t.steps);
      }
      out << "\n";
    }
  }
  {
    // Every rank's, counted from what its workers allocated (the profile's static_bytes and
    // K-FAC bytes replay them: pipefisher_sim's peak memory is their sum with the stash peak).
    out << "static memory (parameters + gradients + optimizer state):";
    for (const auto& rank : memory) {
      std::int64_t params = 0, grads = 0, optimizer = 0;
      for (const auto& chunk : rank.chunks) {
        params += chunk.parameter_bytes;
        grads += chunk.gradient_bytes;
        optimizer += chunk.optimizer_bytes;
      }
      out << (&rank == &memory.front() ? " " : ", ") << "rank " << rank.rank << " "
          << rank.static_bytes() << " B (" << params << " + " << grads << " + " << optimizer << ")";
    }
    out << "\n";
    if (has_kfac(schedule)) {
      out << "K-FAC state (each Linear at its largest):";
      for (const auto& rank : memory) {
        out << (&rank == &memory.front() ? " " : ", ") << "rank " << rank.rank << " "
            << rank.kfac_bytes() << " B";
      }
      out << "\n";
    }
  }
  if (const auto& device = executor.setup().device) {
    const auto stats = device->backend().stats();
    out << std::setprecision(3) << "device memory: peak "
        << static_cast<double>(stats.peak_bytes_in_use) / (1024.0 * 1024.0)
        << " MiB allocated by this process\n";
  }
  if (!o.metrics.empty()) out << "metrics: " << o.metrics << "\n";
  if (!o.trace.empty()) out << "trace: " << o.trace << " (open in https://ui.perfetto.dev)\n";
  if (!o.profile_out.empty()) out << "profile: " << o.profile_out << "\n";
  if (!o.calibration_out.empty()) out << "calibration records: " << o.calibration_out << "\n";
  if (!checkpoint.empty()) out << "checkpoint: " << checkpoint.string() << "\n";
  return 0;
}

}  // namespace

std::unique_ptr<exec::Executor<float>> Launch::make_executor(exec::RunSetup<float> setup) {
  return std::make_unique<exec::ThreadedExecutor<float>>(std::move(setup));
}
std::unique_ptr<exec::Executor<double>> Launch::make_executor(exec::RunSetup<double> setup) {
  return std::make_unique<exec::ThreadedExecutor<double>>(std::move(setup));
}

int run_training(const TrainOptions& o, std::ostream& out) {
  Launch threads;
  return run_training(o, out, threads);
}

int run_training(const TrainOptions& o, std::ostream& out, Launch& launch) {
  validate_options(o);
  // The CPU's dense library (a bad PF_CPU_DENSE_LIBRARY is an input error, reported before any
  // kernel runs).
  (void)kernels::cpu::dense_library();
  RunContext context;
  // The device first: a missing one is the first thing to report (exit 2, one line).
  const tensor::Device device = launch.place_device(
      device::parse_device(o.device),
      std::chrono::milliseconds(static_cast<std::int64_t>(o.wait_timeout_s * 1000.0)));
  context.device = device::open_device_runtime(device,
                                               device.kind == tensor::DeviceKind::kCpu
                                                   ? kernels::GemmPrecision::kFp32
                                                   : kernels::parse_gemm_precision(o.precision),
                                               kernels::parse_attention_algorithm(o.attention));
  context.config = model::resolve_bert_config(o.model);
  const bool preset = !fs::exists(o.model);
  context.micro_batch_size = o.micro_batch_size;

  // The schedule first (its micro-batch and replica counts size the data streams).
  cli::CompileCommandOptions compile;
  compile.schedule = o.schedule;
  compile.stages = o.stages;
  compile.chunks = o.chunks;
  compile.microbatches = o.microbatches;
  compile.data_parallel = o.data_parallel;
  compile.split_backward = o.split_backward;
  compile.layers = context.config.num_layers;
  compile.layers_per_stage = o.layers_per_stage;
  compile.schedule_file = o.schedule_file;

  if (o.data == "synthetic") {
    context.seq_len = o.seq_len > 0 ? o.seq_len : 128;
    context.max_predictions = std::max<std::int64_t>(1, (context.seq_len * 15 + 50) / 100);
  } else {
    const auto files = shard_files(o.data);
    data::LoaderOptions probe;
    probe.shards = files;
    probe.micro_batch_size = static_cast<std::size_t>(o.micro_batch_size);
    probe.prefetch_batches = 1;
    data::ShardLoader loader(probe);
    context.seq_len = static_cast<std::int64_t>(loader.seq_length());
    context.max_predictions = static_cast<std::int64_t>(loader.max_predictions());
    if (o.seq_len > 0 && o.seq_len != context.seq_len) {
      throw std::invalid_argument("--seq-len " + std::to_string(o.seq_len) + ": the shards in " +
                                  o.data + " hold sequences of " + std::to_string(context.seq_len));
    }
    const auto vocab = static_cast<int>(loader.vocab_size());
    if (preset) {
      context.config.vocab_size = vocab;
    } else if (context.config.vocab_size != vocab) {
      throw std::invalid_argument(
          "--model " + o.model + ": vocab_size " + std::to_string(context.config.vocab_size) +
          ", but the shards were made with a vocabulary of " + std::to_string(vocab));
    }
  }
  if (context.seq_len > context.config.max_position_embeddings) {
    throw std::invalid_argument("sequence length " + std::to_string(context.seq_len) +
                                " exceeds the model's max_position_embeddings " +
                                std::to_string(context.config.max_position_embeddings));
  }
  const std::int64_t element = o.precision == "fp64" ? 8 : 4;
  compile.activation_bytes =
      context.micro_batch_size * context.seq_len * context.config.hidden_size * element;
  compile.gradient_bytes = compile.activation_bytes;
  context.schedule = cli::build_schedule(compile);
  exec::check_run_setup(context.config, context.schedule);
  const auto& params = context.schedule.params;
  const int replica_microbatches = params.microbatches;
  context.identity =
      run_identity(o, context.config, context.seq_len, context.max_predictions, params.microbatches,
                   params.data_parallel,
                   o.data == "synthetic" ? std::vector<std::string>{} : shard_files(o.data));
  bool resume_schedule = false;  // a K-FAC run continues the checkpoint's k-step schedule
  if (o.resume) {
    context.resume = load_resume_checkpoint(o.checkpoint_dir, context.identity);
    if (context.resume->step >= o.steps) {
      throw std::invalid_argument("--steps " + std::to_string(o.steps) + ": the checkpoint " +
                                  context.resume->directory.string() + " is at step " +
                                  std::to_string(context.resume->step) +
                                  " already (--steps is the total)");
    }
    // A checkpoint saved inside a K-FAC warm-up holds the warm-up's schedule (a refresh every
    // step): the run plans the warm-up's and the main schedule again, and moves to the main one
    // where the warm-up ends.
    const std::int64_t saved_warmup_end = checkpoint_warmup_end(*context.resume);
    if (saved_warmup_end > 0 && o.kfac_warmup_steps == 0 && !o.kfac_replan) {
      throw std::invalid_argument(
          "--resume: checkpoint " + context.resume->directory.string() +
          " was saved inside a K-FAC warm-up of " + std::to_string(saved_warmup_end) +
          " steps (its schedule refreshes every step): resume it with --kfac-warmup-steps " +
          std::to_string(saved_warmup_end) +
          " to move to the main schedule there, or with --kfac-replan to plan the main schedule "
          "from this step");
    }
    const bool plan_warmup = o.kfac_warmup_steps > 0 &&
                             (saved_warmup_end > 0 || context.resume->step < o.kfac_warmup_steps);
    resume_schedule = o.kfac.enabled && !o.kfac_replan && !plan_warmup && o.schedule_file.empty() &&
                      same_layout(*context.resume, context.schedule);
  }
  if (resume_schedule) {
    context.schedule = sched::schedule_from_json(
        context.resume->schedule, (context.resume->directory / "schedule.json").string());
    // The schedule's K-FAC broadcasts follow the placement it was compiled with.
    context.kfac_placement = checkpoint_kfac_placement(*context.resume);
    context.kfac_summary = "PipeFisher: K-FAC refresh every " +
                           std::to_string(context.schedule.num_steps) +
                           " step(s) (the checkpoint's schedule)\n";
  }

  exec::ExecutorOptions profile_options;
  profile_options.threads_per_worker = o.threads_per_worker;
  profile_options.init_seed = o.seed;
  profile_options.kfac.damping = static_cast<float>(o.kfac_damping);
  if (o.kfac.enabled && !resume_schedule) {
    if (has_kfac(context.schedule)) {
      throw std::invalid_argument("--schedule-file " + o.schedule_file +
                                  " already holds K-FAC work: drop --kfac to run it as it is");
    }
    sim::Profile profile;
    std::string source = o.kfac_profile;
    const SharedProcessorChoice shared_choice = shared_processor_choice(o.shared_processor);
    // Under mpirun every process runs its rank of the profile's schedule; rank 0's process
    // gathers, times the K-FAC kernels and shares the profile (one schedule for every process).
    const auto share_wait =
        std::chrono::milliseconds(static_cast<std::int64_t>(o.wait_timeout_s * 1e3));
    if (!o.kfac_profile.empty()) {
      profile = sim::profile_from_json_file(o.kfac_profile);
    } else {
      if (!o.quiet)
        out << "profiling the schedule and the K-FAC kernels for the PipeFisher pass...\n";
      ProfileLaunch profile_launch;
      profile_launch.make_executor = [&launch](exec::RunSetup<float> setup) {
        return launch.make_executor(std::move(setup));
      };
      profile_launch.machine_of_rank = launch.machine_of_rank();
      if (launch.multi_process()) {
        // The K-FAC kernels timed together stand for the ranks on rank 0's machine (its cores),
        // or for none with a GPU per rank.
        const auto& machines = profile_launch.machine_of_rank;
        profile_launch.ranks_sharing_root_processor =
            context.device ? 1
                           : static_cast<int>(std::count(machines.begin(), machines.end(),
                                                         machines.empty() ? 0 : machines[0]));
      }
      profile = profile_schedule(
          context.config, context.schedule,
          {context.micro_batch_size, context.seq_len, context.max_predictions}, profile_options, 3,
          context.device, {optimizer_factory<float>(o), device_optimizer_choice(o)}, shared_choice,
          profile_launch);
      if (launch.multi_process()) {  // one profile, so that every process compiles one schedule
        profile = sim::profile_from_json(nlohmann::json::parse(launch.share_from_root(
                                             sim::profile_to_json(profile).dump(), share_wait)),
                                         "self-profile");
      }
      source = "self-profile";
    }
    pipefisher::KfacCommandOptions kfac_command = o.kfac;
    // --kfac-sharding auto on a resume of the same layout keeps the K-FAC state's placement in
    // the checkpoint: each rank then holds the Linears it saved (no state moves between the
    // replicas, though sharded state could: checkpointing.h), whatever this machine's profile
    // would choose now.
    bool placement_from_checkpoint = false;
    if (context.resume && !context.resume->kfac.empty() &&
        kfac::parse_kfac_sharding(kfac_command.sharding).automatic &&
        same_layout(*context.resume, context.schedule)) {
      kfac_command.sharding = kfac::to_string(checkpoint_kfac_placement(*context.resume));
      placement_from_checkpoint = true;
    }
    kfac_command.linear_dims = pipefisher::encoder_linear_dims(context.config.hidden_size,
                                                               context.config.intermediate_size);
    const auto offload_options = pipefisher::to_offload_options(kfac_command);
    if (offload_options.mode != pipefisher::OffloadMode::kNone) {
      // The offload pass sizes each Linear's state (fp32 A, B and their inverses) and prices its
      // copies on the host link: a memcpy on the CPU (its offload copies), copies between
      // pinned host memory and the device on a device.
      for (auto& entry : profile.kfac) {
        if (entry.bytes > 0.0 || !entry.linear) continue;
        const auto& dims = kfac_command.linear_dims[static_cast<std::size_t>(*entry.linear)];
        entry.bytes = 2.0 * 4.0 *
                      (static_cast<double>(dims.d_in) * static_cast<double>(dims.d_in) +
                       static_cast<double>(dims.d_out) * static_cast<double>(dims.d_out));
      }
      if (!(profile.host_link.bandwidth > 0.0)) {
        // Measured once, in rank 0's process, and shared: every process then places the same
        // copies and compiles one schedule (under mpirun each would time its own link).
        if (launch.is_root()) {
          profile.host_link = measure_host_copy(std::size_t{16} << 20, context.device);
        }
        if (launch.multi_process()) {
          const auto shared = nlohmann::json::parse(
              launch.share_from_root(nlohmann::json{{"bandwidth", profile.host_link.bandwidth},
                                                    {"latency_s", profile.host_link.latency_s}}
                                         .dump(),
                                     share_wait));
          profile.host_link.bandwidth = shared.at("bandwidth").get<double>();
          profile.host_link.latency_s = shared.at("latency_s").get<double>();
        }
      }
    }
    // --shared-processor off or C: that capacity for the pass (one replica's share of it, as
    // the self-profile's), a --kfac-profile's too.
    const int replicas = std::max(1, context.schedule.params.data_parallel);
    if (!shared_choice.measure) {
      profile.shared_processor_capacity = shared_choice.capacity / replicas;
      profile.shared_processor_replicas = replicas;
    }
    // A --kfac-profile of another replica count: this run's replica share of the same capacity.
    if (profile.shared_processor_capacity > 0.0 && profile.shared_processor_replicas != replicas) {
      profile.shared_processor_capacity *=
          profile.shared_processor_replicas / static_cast<double>(replicas);
      profile.shared_processor_replicas = replicas;
    }
    // MPI processes on several machines: each machine's cores are shared by its own ranks, a
    // processor per machine of the capacity measured on rank 0's (sim/machine_processors.h).
    // The profile says so, for pipefisher_sim --profile to simulate the same; a --kfac-profile's
    // machines were another launch's.
    const auto machine_of_rank = launch.machine_of_rank();
    const bool several_machines = sim::spans_machines(machine_of_rank);
    profile.shared_processor_machines.clear();
    if (several_machines && profile.shared_processor_capacity > 0.0)
      profile.shared_processor_machines = machine_of_rank;
    if (!o.kfac_profile_out.empty() && launch.is_root()) {
      traces::write_json_file(o.kfac_profile_out, sim::profile_to_json(profile));
      if (!o.quiet) out << "PipeFisher pass profile: " << o.kfac_profile_out << "\n";
    }
    const sim::MeasuredCostModel measured(profile, source);
    // Worker threads share this machine's cores (or, with a device, the one GPU): the pass
    // simulates them sharing one processor of the capacity the self-profile measured (none in a
    // profile without one). Not under mpirun with a device: every rank has a GPU of its own (the
    // profile's times are times alone all the same).
    if (context.device && launch.multi_process()) profile.shared_processor_capacity = 0.0;
    sim::SimOptions simulation;
    simulation.shared_processors = sim::shared_processors_of(profile, replicas);
    auto pass = pipefisher::run_pipefisher(context.schedule, measured,
                                           pipefisher::to_kfac_options(kfac_command), simulation);
    std::string offload_summary;
    if (offload_options.mode != pipefisher::OffloadMode::kNone) {
      auto offload = pipefisher::run_offload_pass(pass, measured, offload_options, simulation);
      std::ostringstream line;
      line << "K-FAC offload (" << offload.report.mode << "): " << offload.report.offloaded_linears
           << " Linears' state in host memory ("
           << offload.report.offloaded_linears - offload.report.factors_only_linears << " whole, "
           << offload.report.factors_only_linears << " factors only), " << offload.report.transfers
           << " copies per refresh; predicted step time " << std::fixed << std::setprecision(3)
           << 1e3 * offload.report.step_time_before_s << " -> "
           << 1e3 * offload.report.step_time_after_s << " ms, peak memory "
           << offload.report.max_peak_memory_before / (1024.0 * 1024.0) << " -> "
           << offload.report.max_peak_memory_after / (1024.0 * 1024.0) << " MiB\n";
      if (!offload.report.warning.empty()) line << offload.report.warning << "\n";
      context.kfac_offload_device_before = context.kfac_offload_device_after = 0.0;
      for (const auto& worker : offload.report.workers) {
        context.kfac_offload_device_before =
            std::max(context.kfac_offload_device_before, worker.kfac_device_bytes_before);
        context.kfac_offload_device_after =
            std::max(context.kfac_offload_device_after, worker.kfac_device_bytes_after);
        context.kfac_offload_sums = std::max(context.kfac_offload_sums, worker.factor_sum_bytes);
      }
      offload_summary = line.str();
      pass.schedule = std::move(offload.schedule);
    }
    context.kfac_placement = pass.report.placement;
    context.kfac_model_bytes = pass.report.kfac_memory_bytes;
    context.kfac_model_sent_per_refresh = pass.report.kfac_sent_bytes_per_refresh;
    std::ostringstream summary;
    summary << "PipeFisher: K-FAC refresh every " << pass.report.refresh_steps
            << " step(s); predicted utilization " << std::fixed << std::setprecision(1)
            << 100.0 * pass.report.utilization_before << "% -> "
            << 100.0 * pass.report.utilization_after << "%, step time " << std::showpos
            << 100.0 * pass.report.step_time_overhead << std::noshowpos << "% ("
            << decimal_seconds(pass.report.step_time_before_s) << " -> "
            << decimal_seconds(pass.report.step_time_after_s) << " s/step; " << source;
    if (several_machines && simulation.shared_processors.enabled()) {
      const auto& shared = simulation.shared_processors;
      summary << "; the ranks span "
              << 1 + *std::max_element(machine_of_rank.begin(), machine_of_rank.end())
              << " machines, each machine's cores shared by its ranks: capacity "
              << std::setprecision(2) << shared.capacity << " each, a replica's share";
      for (std::size_t p = 0; p < shared.processor_capacity.size(); ++p)
        summary << (p == 0 ? " " : ", ") << shared.processor_capacity[p];
    } else if (simulation.shared_processors.enabled()) {
      const double share = simulation.shared_processors.capacity;
      summary << "; the workers share the cores, capacity " << std::setprecision(2)
              << share * replicas;
      if (replicas > 1) summary << " (" << share << " per replica)";
    } else if (several_machines) {
      summary << "; the ranks span several machines, no shared processor";
    }
    summary << ")\n";
    if (pass.report.data_parallel > 1) {
      summary << "K-FAC state over " << pass.report.data_parallel
              << " data-parallel replicas: " << pass.report.state_placement
              << (pass.report.automatic_placement ? " (auto)" : "")
              << (placement_from_checkpoint ? " (--kfac-sharding auto: the checkpoint's)" : "")
              << "; model per rank at most " << std::setprecision(3)
              << pass.report.kfac_memory_bytes / (1024.0 * 1024.0) << " MiB held, "
              << pass.report.kfac_sent_bytes_per_refresh / (1024.0 * 1024.0)
              << " MiB sent per refresh\n";
    }
    summary << offload_summary;
    if (context.device && !launch.multi_process() && context.schedule.num_workers() > 1) {
      // The workers share one device, so a worker's bubble is another's compute (an H200,
      // BERT-Large 1F1B p = 4, a GPU per worker in the model: predicted +3.1%, measured +76%;
      // docs/cuda.md). The shared processor models that, with the capacity the self-profile
      // measured on the device; not yet checked against a GPU run.
      summary << "note: the " << context.schedule.num_workers()
              << " workers share one GPU, so K-FAC work in one worker's bubbles competes with the "
                 "others' compute; "
              << (profile.shared_processor_capacity > 0.0
                      ? "the prediction shares the GPU as the self-profile measured it\n"
                      : "the predicted step time assumes a GPU per worker\n");
    }
    if (o.kfac_warmup_steps > 0) {
      // The warm-up: the same pass with a refresh every step (what the bubbles cannot hold runs
      // after the flush); the main schedule takes over after it, its windows starting there.
      auto warmup_command = kfac_command;
      warmup_command.refresh_steps = 1;
      // Each step's refresh whole within it: nothing runs on into the main schedule, whose
      // first window (pipelined or not) preconditions with the warm-up's last inverses.
      warmup_command.pipelined_refresh = "off";
      warmup_command.spill_budget = 0.0;
      warmup_command.free_spill = "off";
      auto warmup_kfac = pipefisher::to_kfac_options(warmup_command);
      // The main schedule's placement across the replicas: each rank keeps the state it holds
      // when the main schedule takes over (restore_local_checkpoint).
      warmup_kfac.automatic_placement = false;
      warmup_kfac.state_placement = pass.report.placement;
      auto warmup = pipefisher::run_pipefisher(context.schedule, measured, warmup_kfac, simulation);
      if (offload_options.mode != pipefisher::OffloadMode::kNone) {
        // The warm-up offloads as the main schedule does: the device holds no more K-FAC
        // state from step 0 on (each Linear moves whole between the two at the switch).
        warmup.schedule =
            pipefisher::run_offload_pass(warmup, measured, offload_options, simulation).schedule;
      }
      const std::int64_t k = pass.report.refresh_steps;
      context.warmup_end = o.kfac_warmup_steps;
      summary << "K-FAC warm-up: a refresh every step for the first "
              << std::min(context.warmup_end, o.steps)
              << " step(s) (--kfac-warmup-steps), predicted step time " << std::showpos
              << std::setprecision(1) << 100.0 * warmup.report.step_time_overhead << std::noshowpos
              << "% (" << decimal_seconds(warmup.report.step_time_after_s) << " s/step); ";
      if (context.warmup_end < o.steps) {
        summary << "then every " << k << " step(s)\n";
        context.warmup_schedule = warmup.schedule;
      } else {  // the whole run is the warm-up: one schedule, as --kfac-refresh 1
        summary << "that is every step of the run\n";
        pass.schedule = warmup.schedule;
      }
    }
    context.kfac_summary = summary.str();
    context.schedule = pass.schedule;
  }
  if (context.resume) {
    // Resumed inside the warm-up: its executor continues the checkpoint.
    const bool in_warmup = context.warmup_schedule && context.resume->step < context.warmup_end;
    const auto& resumed_schedule = in_warmup ? *context.warmup_schedule : context.schedule;
    context.window_origin =
        check_kfac_resumable(*context.resume, resumed_schedule, context.kfac_placement);
    context.finish_saved_refresh =
        needs_refresh_finished(*context.resume, resumed_schedule, context.kfac_placement);
    if (drops_refresh_in_progress(*context.resume, resumed_schedule, context.kfac_placement)) {
      context.kfac_summary +=
          "K-FAC: the checkpoint is inside a refresh window of its schedule (step " +
          std::to_string(context.resume->step) +
          "): this run's schedule drops that refresh's curvature so far and starts its own "
          "windows there; the inverses held serve until its first refresh\n";
    }
    if (context.finish_saved_refresh) {
      context.kfac_summary +=
          "K-FAC: the checkpoint's schedule finishes its refresh (the pipelined work it places in "
          "the next window) before this run's schedule takes over at step " +
          std::to_string(context.resume->step) + "\n";
    }
  }

  if (o.data == "synthetic") {
    context.batches = std::make_unique<exec::SyntheticBatches>(
        context.config, context.micro_batch_size, context.seq_len, context.max_predictions,
        o.seed + 2);
  } else {
    data::LoaderOptions loader;
    loader.shards = shard_files(o.data);
    loader.micro_batch_size = static_cast<std::size_t>(o.micro_batch_size);
    loader.seed = o.seed;
    auto shards = std::make_unique<exec::ShardBatches>(
        loader, params.data_parallel, replica_microbatches,
        context.resume ? checkpoint_loader_positions(*context.resume, params.data_parallel)
                       : std::vector<data::LoaderPosition>{},
        context.resume ? context.resume->step : 0);
    context.shards = shards.get();
    context.batches = std::move(shards);
  }
  if (o.precision == "fp64") return train<double>(o, context, out, launch);
  return train<float>(o, context, out, launch);
}

}  // namespace pf::train
