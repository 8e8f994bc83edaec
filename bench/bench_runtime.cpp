// The runtime's figures (docs/benchmarks.md, "Runtime"), measured side by side in one process:
//   pipeline   1F1B, p workers x 1 thread
//   single     the same global batch on one worker with p threads
//   single-1t  one worker, one thread (the executor's own overhead: step time less compute)
//   kfac       the pipeline with K-FAC placed in its bubbles by the PipeFisher pass
// The configurations run in turn, --repeats times, and every figure is the median over the
// repeats. Each run is also replayed by the simulator on its own measured durations (the
// profile pipefisher_train --profile-out writes), which gives the prediction error.
//
//   bench_runtime [--model mini] [--stages 2] [--microbatches 8] [--micro-batch-size 8]
//                 [--seq-len 128] [--steps 5] [--repeats 3] [--kfac-refresh 0]
//                 [--vocab N] (default: the preset's, 30522)
//                 [--profile-out FILE]   (the pipeline's profile, for pipefisher_sim --profile)
//   bench_runtime --smoke                (a tiny model, for the test suite)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "runtime/executor/batch_source.h"
#include "runtime/executor/executor.h"
#include "runtime/executor/measured.h"
#include "runtime/optim/lamb.h"
#include "runtime/train/self_profile.h"
#include "scheduler/compile.h"
#include "scheduler/pipefisher/pass.h"
#include "sim/measured_cost_model.h"
#include "sim/simulator.h"
#include "traces/chrome_trace.h"

namespace {

using namespace pf;

struct Settings {
  std::string model = "mini";
  int stages = 2;
  int microbatches = 8;
  std::int64_t micro_batch_size = 8;
  std::int64_t seq_len = 128;
  int steps = 5;
  int repeats = 3;
  int kfac_refresh = 0;
  std::string profile_out;
  int vocab = 0;  // 0: the preset's
};

struct Measurement {
  double step_time_s = 0.0;
  double compute_utilization = 0.0;
  double utilization_with_kfac = 0.0;
  double idle_of_busiest = 0.0;    // (step - busiest rank's busy time) / step
  double replay_error = 0.0;       // (simulated - measured) / measured, median durations
  double replay_error_mean = 0.0;  // the same with mean durations
  sim::Profile profile;
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

sched::Schedule compile_schedule(sched::ScheduleKind kind, int workers, const Settings& s,
                                 int layers) {
  sched::ScheduleParams params;
  params.kind = kind;
  params.workers = workers;
  params.microbatches = s.microbatches;
  params.num_layers = layers;
  return sched::compile(params);
}

// Steps before `warmup_steps` are left out of every figure.
Measurement run(const model::BertConfig& config, const sched::Schedule& schedule,
                int threads_per_worker, const Settings& s, int warmup_steps = 1) {
  exec::SyntheticBatches batches(config, s.micro_batch_size, s.seq_len,
                                 std::max<std::int64_t>(1, (s.seq_len * 15 + 50) / 100), 3);
  exec::RunSetup<float> setup;
  setup.config = config;
  setup.schedule = schedule;
  setup.options.threads_per_worker = threads_per_worker;
  setup.options.init_seed = 1;
  setup.options.dropout_seed = 2;
  setup.options.record_events = true;
  setup.make_optimizer = [] { return std::make_unique<optim::Lamb>(); };
  setup.learning_rate = [](std::int64_t) { return 1e-3; };
  setup.batches = &batches;
  exec::ThreadedExecutor<float> executor(setup);
  executor.run(0, s.steps);
  const auto events = executor.take_events();
  const auto summary = exec::summarize_run(events, executor.num_ranks(), warmup_steps);
  Measurement m;
  m.step_time_s = summary.step_time_s;
  m.compute_utilization = summary.compute_utilization();
  m.utilization_with_kfac = summary.utilization_with_kfac();
  m.idle_of_busiest = summary.idle_fraction_of_busiest();
  m.profile = exec::measured_profile(schedule, events, warmup_steps, "bench_runtime");
  const auto replay = sim::simulate(schedule, sim::MeasuredCostModel(m.profile, "bench_runtime"));
  m.replay_error = (replay.step_time_s - m.step_time_s) / m.step_time_s;
  const auto mean_profile = exec::measured_profile(schedule, events, warmup_steps, "bench_runtime",
                                                   exec::ProfileStatistic::kMean);
  const auto mean_replay =
      sim::simulate(schedule, sim::MeasuredCostModel(mean_profile, "bench_runtime"));
  m.replay_error_mean = (mean_replay.step_time_s - m.step_time_s) / m.step_time_s;
  return m;
}

int parse_int(const char* flag, const char* value) {
  char* end = nullptr;
  const long parsed = std::strtol(value, &end, 10);
  if (end == value || *end != '\0' || parsed < 0 || parsed > 1 << 20) {
    throw std::invalid_argument(std::string(flag) + " " + value + ": not a count");
  }
  return static_cast<int>(parsed);
}

Settings parse(int argc, char** argv) {
  Settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--smoke") {
      s.model = "tiny";
      s.micro_batch_size = 2;
      s.seq_len = 16;
      s.microbatches = 4;
      s.steps = 2;
      s.repeats = 1;
      s.kfac_refresh = 2;  // a tiny model's K-FAC work does not fit its tiny bubbles
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument(flag + ": needs a value (see the header)");
    const char* value = argv[++i];
    if (flag == "--model") {
      s.model = value;
    } else if (flag == "--stages") {
      s.stages = parse_int(argv[i - 1], value);
    } else if (flag == "--microbatches") {
      s.microbatches = parse_int(argv[i - 1], value);
    } else if (flag == "--micro-batch-size") {
      s.micro_batch_size = parse_int(argv[i - 1], value);
    } else if (flag == "--seq-len") {
      s.seq_len = parse_int(argv[i - 1], value);
    } else if (flag == "--steps") {
      s.steps = std::max(2, parse_int(argv[i - 1], value));
    } else if (flag == "--repeats") {
      s.repeats = std::max(1, parse_int(argv[i - 1], value));
    } else if (flag == "--kfac-refresh") {
      s.kfac_refresh = parse_int(argv[i - 1], value);
    } else if (flag == "--vocab") {
      s.vocab = parse_int(argv[i - 1], value);
    } else if (flag == "--profile-out") {
      s.profile_out = value;
    } else {
      throw std::invalid_argument("unknown flag " + flag +
                                  " (see the header of bench_runtime.cpp)");
    }
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) try {
  const Settings s = parse(argc, argv);
  auto config = model::bert_preset(s.model);
  if (s.vocab > 0) config.vocab_size = s.vocab;
  const int layers = config.num_layers;
  const auto pipeline = compile_schedule(sched::ScheduleKind::kOneFOneB, s.stages, s, layers);
  const auto single = compile_schedule(sched::ScheduleKind::kGPipe, 1, s, layers);

  // The PipeFisher schedule from a self-profile, as pipefisher_train --kfac builds it.
  exec::ExecutorOptions profile_options;
  profile_options.threads_per_worker = 1;
  const auto profile = train::profile_schedule(
      config, pipeline,
      {s.micro_batch_size, s.seq_len, std::max<std::int64_t>(1, (s.seq_len * 15 + 50) / 100)},
      profile_options, 3, nullptr,
      {[] { return std::make_unique<optim::Lamb>(); }, device::OptimizerChoice{}});
  pipefisher::KfacOptions kfac_options;
  kfac_options.refresh_steps = s.kfac_refresh;
  sim::SimOptions simulation;
  simulation.shared_processors = sim::shared_processors_of(profile);
  const auto pass = pipefisher::run_pipefisher(
      pipeline, sim::MeasuredCostModel(profile, "self-profile"), kfac_options, simulation);
  // Whole refreshes after the first, so that the K-FAC work measured is k steps' worth: the first
  // window's steps precondition nothing until its inverses exist (with k = 8 the first seven;
  // measured over steps 1-8 until 2026-11-29, k = 8 on BERT-mini cost +2.7% to +4.8% where its
  // whole refreshes cost +4.2% to +8.2%, docs/benchmarks.md).
  const int k = pass.schedule.num_steps;
  Settings kfac_settings = s;
  kfac_settings.steps = k + std::max(1, (s.steps - 1) / k) * k;

  std::map<std::string, std::vector<Measurement>> runs;
  for (int r = 0; r < s.repeats; ++r) {
    runs["pipeline"].push_back(run(config, pipeline, 1, s));
    runs["single"].push_back(run(config, single, s.stages, s));
    runs["single-1t"].push_back(run(config, single, 1, s));
    runs["kfac"].push_back(run(config, pass.schedule, 1, kfac_settings, k));
    std::fprintf(stderr, "repeat %d/%d done\n", r + 1, s.repeats);
  }
  auto figure = [&](const std::string& name, double Measurement::*field) {
    std::vector<double> values;
    for (const auto& m : runs[name]) values.push_back(m.*field);
    return median(values);
  };
  const double sequences =
      static_cast<double>(s.microbatches) * static_cast<double>(s.micro_batch_size);
  std::printf(
      "bench_runtime: BERT %s (vocab %d), seq %lld, %d micro-batches of %lld, %d steps (first "
      "left out; with K-FAC %d, the first refresh window of %d left out), median of %d repeats\n",
      s.model.c_str(), config.vocab_size, static_cast<long long>(s.seq_len), s.microbatches,
      static_cast<long long>(s.micro_batch_size), s.steps, kfac_settings.steps, k, s.repeats);
  std::printf("%-42s %10s %10s %12s %12s %14s %14s\n", "run", "s/step", "seq/s", "utilization",
              "+K-FAC", "replay median", "replay mean");
  const std::vector<std::pair<std::string, std::string>> rows = {
      {"pipeline", "1F1B p=" + std::to_string(s.stages) + " x 1 thread"},
      {"single", "1 worker x " + std::to_string(s.stages) + " threads"},
      {"single-1t", "1 worker x 1 thread"},
      {"kfac", "1F1B p=" + std::to_string(s.stages) +
                   " + K-FAC (k=" + std::to_string(pass.schedule.num_steps) + ")"}};
  for (const auto& [key, label] : rows) {
    const double step = figure(key, &Measurement::step_time_s);
    std::printf("%-42s %10.4f %10.2f %11.1f%% %11.1f%% %+13.1f%% %+13.1f%%\n", label.c_str(), step,
                sequences / step, 100.0 * figure(key, &Measurement::compute_utilization),
                100.0 * figure(key, &Measurement::utilization_with_kfac),
                100.0 * figure(key, &Measurement::replay_error),
                100.0 * figure(key, &Measurement::replay_error_mean));
  }
  const double pipeline_step = figure("pipeline", &Measurement::step_time_s);
  std::printf("\nexecutor overhead (1 worker x 1 thread: step time less compute): %.2f%%\n",
              100.0 * figure("single-1t", &Measurement::idle_of_busiest));
  std::printf("throughput pipeline / single worker (same global batch): %.3f\n",
              figure("single", &Measurement::step_time_s) / pipeline_step);
  std::printf(
      "simulator replay of the pipeline's measured profile: %+.1f%% step time (median durations), "
      "%+.1f%% (mean durations)\n",
      100.0 * figure("pipeline", &Measurement::replay_error),
      100.0 * figure("pipeline", &Measurement::replay_error_mean));
  std::printf(
      "K-FAC: utilization %.1f%% -> %.1f%% measured (%.1f%% -> %.1f%% predicted), step time "
      "%+.1f%% measured (%+.1f%% predicted), k = %d; the self-profile's capacity of the shared "
      "cores %.2f\n",
      100.0 * figure("pipeline", &Measurement::compute_utilization),
      100.0 * figure("kfac", &Measurement::utilization_with_kfac),
      100.0 * pass.report.utilization_before, 100.0 * pass.report.utilization_after,
      100.0 * (figure("kfac", &Measurement::step_time_s) / pipeline_step - 1.0),
      100.0 * pass.report.step_time_overhead, pass.schedule.num_steps,
      profile.shared_processor_capacity);
  if (!s.profile_out.empty()) {
    traces::write_json_file(s.profile_out, sim::profile_to_json(runs["pipeline"].back().profile));
    std::printf("profile (median durations) of the last pipeline run, measured %.4f s/step: %s\n",
                runs["pipeline"].back().step_time_s, s.profile_out.c_str());
  }
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "bench_runtime: %s\n", error.what());
  return 2;
}
