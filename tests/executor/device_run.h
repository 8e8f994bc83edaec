#pragma once
// Shared by the executor's device tests (test_executor_device on the CPU backend, and
// test_executor_cuda on a GPU): a small BERT, schedules with and without K-FAC in the bubbles,
// and one run of the ThreadedExecutor on a given DeviceRuntime (null: the CPU path) returning
// what the tests compare, parameters downloaded to the host.
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/device/device_runtime.h"
#include "runtime/device/host_device_runtime.h"
#include "runtime/executor/executor.h"
#include "scheduler/compile.h"
#include "scheduler/pipefisher/pass.h"
#include "sim/uniform_cost_model.h"

namespace pf::exec::testing {

inline model::BertConfig device_test_config(int layers = 4) {
  model::BertConfig config;
  config.name = "test";
  config.vocab_size = 29;
  config.hidden_size = 16;
  config.num_layers = layers;
  config.num_heads = 2;
  config.intermediate_size = 24;
  config.max_position_embeddings = 10;
  config.type_vocab_size = 2;
  config.hidden_dropout = 0.1F;
  config.attention_dropout = 0.1F;
  return config;
}

inline sched::Schedule device_test_schedule(sched::ScheduleKind kind, int workers, int chunks,
                                            int layers, bool kfac, bool split_backward = false) {
  sched::ScheduleParams params;
  params.kind = kind;
  params.workers = workers;
  params.microbatches = 4;
  params.chunks_per_worker = chunks;
  params.num_layers = layers;
  params.split_backward = split_backward;
  auto schedule = sched::compile(params);
  if (!kfac) return schedule;
  sim::UniformCosts costs{.forward_s = 1.0, .backward_s = 2.0, .communication_s = 0.05};
  costs.curvature_a_s = costs.curvature_b_s = 0.05;
  costs.invert_a_s = costs.invert_b_s = 0.2;
  costs.precondition_s = 0.02;
  pipefisher::KfacOptions options;
  options.refresh_steps = 2;
  return pipefisher::run_pipefisher(schedule, sim::UniformCostModel(costs), options).schedule;
}

// A pipelined K-FAC refresh (--kfac-pipelined-refresh on): 1F1B on 4 workers with inversions
// long against the gaps, so that the pass runs a refresh's inversions in the next window. With
// `split` (the plan of ExecutorKfac.PipelinedRefreshEqualsSequential) some are the rest of a
// chain of pieces begun in the refresh's own window; without, every task is whole.
inline sched::Schedule device_test_pipelined_schedule(int layers, bool split) {
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = 4;
  params.microbatches = 4;
  params.num_layers = layers;
  sim::UniformCosts costs{.forward_s = 1.0, .backward_s = 2.0, .communication_s = 0.05};
  costs.curvature_a_s = costs.curvature_b_s = 0.05;
  costs.invert_a_s = costs.invert_b_s = 1.0;
  costs.precondition_s = 0.02;
  costs.curvature_sync_s = 0.05;
  pipefisher::KfacOptions options;
  options.pipelined_refresh = true;
  options.split = split;
  // Whole tasks: k fixed at the pipelined plan's 2 (the plain refresh needs 3).
  if (!split) options.refresh_steps = 2;
  return pipefisher::run_pipefisher(sched::compile(params), sim::UniformCostModel(costs), options)
      .schedule;
}

struct DeviceRun {
  std::map<std::string, std::vector<float>> values;  // every parameter (the tied copy once)
  std::vector<StepResult> steps;
  std::vector<InstructionEvent> events;
  std::size_t pending_messages = 0;
  std::size_t exchange_pending = 0;
  std::size_t transient_bytes = 0;
  std::vector<std::int64_t> kfac_state_bytes;  // per rank (Worker::kfac_state_bytes)
  std::vector<std::int64_t> kfac_host_bytes;   // per rank (Worker::kfac_host_bytes)
  // per rank (Worker::kfac_peak_resident_bytes)
  std::vector<std::int64_t> kfac_peak_resident_bytes;
  std::vector<WorkerMemory> memory;  // per rank (Worker::memory)
};

// The batches every device test trains on.
inline SyntheticBatches device_test_batches(const model::BertConfig& config) {
  constexpr std::int64_t kMicroBatch = 2, kSeqLen = 6, kPredictions = 2;
  return SyntheticBatches(config, kMicroBatch, kSeqLen, kPredictions, 13);
}

// The run's setup on `runtime` (null: the CPU path), reading `batches`.
inline RunSetup<float> device_test_setup(
    const std::shared_ptr<device::DeviceRuntime>& runtime, const model::BertConfig& config,
    const sched::Schedule& schedule, const std::string& optimizer, BatchSource& batches,
    bool record_events = true, std::int64_t dp_bucket_bytes = ExecutorOptions{}.dp_bucket_bytes) {
  RunSetup<float> setup;
  setup.config = config;
  setup.schedule = schedule;
  setup.options.init_seed = 7;
  setup.options.dropout_seed = 11;
  setup.options.wait_timeout = std::chrono::seconds(60);
  setup.options.kfac.damping = 1e-2F;
  setup.options.record_events = record_events;
  setup.options.dp_bucket_bytes = dp_bucket_bytes;
  device::OptimizerChoice choice;
  choice.name = optimizer;
  choice.lamb.max_grad_norm = 0.5;
  setup.make_optimizer = [choice] { return device::make_host_optimizer(choice); };
  setup.device = runtime;
  setup.device_optimizer = choice;
  setup.learning_rate = [](std::int64_t step) {
    return 1e-2 * (1.0 + 0.5 * static_cast<double>(step));
  };
  setup.batches = &batches;
  return setup;
}

inline DeviceRun run_schedule(const std::shared_ptr<device::DeviceRuntime>& runtime,
                              const model::BertConfig& config, const sched::Schedule& schedule,
                              const std::string& optimizer, std::int64_t steps,
                              bool record_events = true,
                              std::int64_t dp_bucket_bytes = ExecutorOptions{}.dp_bucket_bytes,
                              float kfac_running_average = 0.0F,
                              const kfac::StatePlacement& kfac_placement = {}) {
  auto batches = device_test_batches(config);
  auto setup = device_test_setup(runtime, config, schedule, optimizer, batches, record_events,
                                 dp_bucket_bytes);
  setup.options.kfac.running_average = kfac_running_average;
  setup.options.kfac.placement = kfac_placement;
  ThreadedExecutor<float> executor(setup);
  DeviceRun run;
  executor.run(0, steps, [&](const StepResult& r) { run.steps.push_back(r); });
  run.events = executor.take_events();
  run.pending_messages = executor.pending_messages();
  if (runtime) run.exchange_pending = runtime->exchange().pending();
  const auto tied = model::tied_parameter_names();
  for (int r = 0; r < executor.num_ranks(); ++r) {
    run.transient_bytes += executor.worker(r).transient_memory().total();
    run.kfac_state_bytes.push_back(executor.worker(r).kfac_state_bytes());
    run.kfac_host_bytes.push_back(executor.worker(r).kfac_host_bytes());
    run.kfac_peak_resident_bytes.push_back(executor.worker(r).kfac_peak_resident_bytes());
    run.memory.push_back(executor.worker(r).memory());
    for (auto* chunk : executor.worker(r).chunks()) {
      for (const auto& p : chunk->parameters()) {
        if (p.name == tied.second || run.values.contains(p.name)) continue;
        std::vector<float> host(static_cast<std::size_t>(p.size));
        if (runtime) {
          runtime->backend().synchronize();
          runtime->backend().copy(host.data(), p.value, host.size() * sizeof(float),
                                  tensor::CopyKind::kDeviceToHost);
          runtime->backend().synchronize();
        } else {
          host.assign(p.value, p.value + p.size);
        }
        run.values[p.name] = std::move(host);
      }
    }
  }
  return run;
}

// Largest |a - b| / max(max |b| of the tensor, 1e-3) over the parameters of both runs.
inline double max_relative_difference(const DeviceRun& actual, const DeviceRun& expected) {
  EXPECT_EQ(actual.values.size(), expected.values.size());
  double worst = 0.0;
  for (const auto& [name, values] : expected.values) {
    const auto it = actual.values.find(name);
    EXPECT_NE(it, actual.values.end()) << name;
    if (it == actual.values.end()) continue;
    double scale = 0.0, diff = 0.0;
    for (std::size_t i = 0; i < values.size(); ++i) {
      scale = std::max(scale, std::abs(double{values[i]}));
      diff = std::max(diff, std::abs(double{it->second[i]} - values[i]));
    }
    worst = std::max(worst, diff / std::max(scale, 1e-3));
  }
  return worst;
}

}  // namespace pf::exec::testing
