// K-FAC state offloaded to host memory (docs/offload.md) on the executor's CPU path: a run with
// the offload pass's copies trains to exactly the parameters of the same run without them (the
// copies are memcpy's of the state), and the K-FAC state the workers hold falls by exactly the
// bytes the plan offloads.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/executor/executor.h"
#include "runtime/optim/lamb.h"
#include "scheduler/compile.h"
#include "scheduler/pipefisher/offload_pass.h"
#include "scheduler/pipefisher/pass.h"
#include "sim/uniform_cost_model.h"
#include "tests/model/model_test_util.h"

namespace pf::exec {
namespace {

// The model tests' tiny BERT, with this file's vocabulary.
model::BertConfig test_config() {
  model::BertConfig config = model::testing::tiny_test_config();
  config.vocab_size = 29;
  return config;
}

// Uniform times, and each Linear's K-FAC state at its real size (fp32 A, B, A^-1, B^-1), so that
// the plan's offloaded bytes are what the workers stop holding.
class TestCosts final : public sim::CostModel {
 public:
  TestCosts(const model::BertConfig& config, sim::UniformCosts costs)
      : config_(config), uniform_(costs) {}
  double duration(const sched::Schedule& s, int w, const sched::Instruction& in) const override {
    return uniform_.duration(s, w, in);
  }
  double activation_bytes(const sched::Schedule& s, int p, int c) const override {
    return uniform_.activation_bytes(s, p, c);
  }
  double static_bytes(const sched::Schedule& s, int p, int c) const override {
    return uniform_.static_bytes(s, p, c);
  }
  double kfac_bytes(const sched::Schedule&, int, sched::LinearKind linear) const override {
    const double h = static_cast<double>(config_.hidden_size);
    const double i = static_cast<double>(config_.intermediate_size);
    const double d_in = linear == sched::LinearKind::kFfnOut ? i : h;
    const double d_out = linear == sched::LinearKind::kFfnIn ? i : h;
    return 2.0 * 4.0 * (d_in * d_in + d_out * d_out);
  }

 private:
  model::BertConfig config_;
  sim::UniformCostModel uniform_;
};

sim::UniformCosts unit_costs(bool long_tasks) {
  sim::UniformCosts costs{.forward_s = 1.0, .backward_s = 2.0, .communication_s = 0.05};
  costs.curvature_a_s = costs.curvature_b_s = long_tasks ? 0.7 : 0.05;
  costs.invert_a_s = costs.invert_b_s = long_tasks ? 3.0 : 0.2;
  costs.precondition_s = long_tasks ? 1.5 : 0.02;
  costs.curvature_sync_s = 0.05;
  costs.static_bytes = 1e4;
  costs.activation_bytes = 1e3;
  costs.host_bandwidth = 1e8;
  return costs;
}

struct RunResult {
  std::vector<std::vector<float>> parameters;  // per rank
  std::vector<std::int64_t> kfac_bytes;        // per rank, device (live) state
  std::vector<std::int64_t> host_bytes;        // per rank, offloaded state
  int refreshes = 0;
};

RunResult run(const sched::Schedule& schedule, float running_average, std::int64_t steps) {
  const auto config = test_config();
  SyntheticBatches batches(config, 2, 6, 2, 13);
  RunSetup<float> setup;
  setup.config = config;
  setup.schedule = schedule;
  setup.options.init_seed = 7;
  setup.options.dropout_seed = 11;
  setup.options.wait_timeout = std::chrono::seconds(60);
  setup.options.kfac.damping = 1e-2F;
  setup.options.kfac.running_average = running_average;
  setup.make_optimizer = [] {
    return std::make_unique<optim::BasicLamb<float>>(optim::LambOptions{.max_grad_norm = 0.5});
  };
  setup.learning_rate = [](std::int64_t) { return 1e-2; };
  setup.batches = &batches;
  ThreadedExecutor<float> executor(setup);
  RunResult out;
  executor.run(0, steps, [&](const StepResult& r) { out.refreshes += r.kfac_refresh ? 1 : 0; });
  for (int r = 0; r < executor.num_ranks(); ++r) {
    std::vector<float> values;
    for (auto* chunk : executor.worker(r).chunks()) {
      for (const auto& p : chunk->parameters())
        values.insert(values.end(), p.value, p.value + p.size);
    }
    out.parameters.push_back(std::move(values));
    out.kfac_bytes.push_back(executor.worker(r).kfac_state_bytes());
    out.host_bytes.push_back(executor.worker(r).kfac_host_bytes());
  }
  return out;
}

struct OffloadCase {
  std::string name;
  sched::ScheduleKind kind;
  int workers;
  int data_parallel;
  int refresh_steps;
  float running_average;
  bool long_tasks;
  pipefisher::OffloadMode mode;
};

class OffloadEquivalence : public testing::TestWithParam<OffloadCase> {};

TEST_P(OffloadEquivalence, SameParametersBitForBitAndLessDeviceState) {
  const auto c = GetParam();
  const auto config = test_config();
  sched::ScheduleParams params;
  params.kind = c.kind;
  params.workers = c.workers;
  params.microbatches = 4;
  params.num_layers = config.num_layers;
  params.data_parallel = c.data_parallel;
  const TestCosts costs(config, unit_costs(c.long_tasks));
  pipefisher::KfacOptions kfac;
  kfac.refresh_steps = c.refresh_steps;
  const auto pass = pipefisher::run_pipefisher(sched::compile(params), costs, kfac);
  double budget = 0.0;
  if (c.mode == pipefisher::OffloadMode::kAuto) {
    // Room for the memory without K-FAC and about half of one worker's K-FAC state.
    double other = 0.0, state = 0.0;
    for (const auto& w : pass.before.workers) other = std::max(other, w.peak_memory_bytes);
    for (const auto& w : pass.after.workers) state = std::max(state, w.peak_memory_bytes - other);
    budget = other + 0.5 * state;
  }
  const auto offload = pipefisher::run_offload_pass(pass, costs, {c.mode, budget});
  ASSERT_GT(offload.plan.offloaded_linears(), 0);
  const int k = pass.schedule.num_steps;
  const std::int64_t steps = 3 * k;  // three whole refreshes
  const RunResult without = run(pass.schedule, c.running_average, steps);
  const RunResult with = run(offload.schedule, c.running_average, steps);
  EXPECT_EQ(with.refreshes, without.refreshes);
  EXPECT_EQ(with.refreshes, 3);
  ASSERT_EQ(with.parameters.size(), without.parameters.size());
  for (std::size_t r = 0; r < with.parameters.size(); ++r) {
    ASSERT_EQ(with.parameters[r].size(), without.parameters[r].size());
    EXPECT_EQ(std::memcmp(with.parameters[r].data(), without.parameters[r].data(),
                          with.parameters[r].size() * sizeof(float)),
              0)
        << "rank " << r << " differs";
  }
  // Between refreshes an offloaded Linear holds nothing on the device: the state falls by
  // exactly the plan's offloaded bytes (rank = replica * workers + worker).
  for (std::size_t r = 0; r < with.kfac_bytes.size(); ++r) {
    const auto& plan = offload.plan.workers[r % static_cast<std::size_t>(c.workers)];
    EXPECT_EQ(without.kfac_bytes[r] - with.kfac_bytes[r],
              static_cast<std::int64_t>(plan.offloaded_bytes))
        << "rank " << r;
    EXPECT_EQ(without.host_bytes[r], 0);
    // Host: factors, the newest inverses and the ones they replaced.
    EXPECT_EQ(with.host_bytes[r], static_cast<std::int64_t>(1.5 * plan.offloaded_bytes))
        << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, OffloadEquivalence,
    testing::Values(OffloadCase{"OneFOneBHost", sched::ScheduleKind::kOneFOneB, 2, 1, 2, 0.0F,
                                false, pipefisher::OffloadMode::kHost},
                    OffloadCase{"OneFOneBRunningAverageDividedTasks",
                                sched::ScheduleKind::kOneFOneB, 2, 1, 0, 0.9F, true,
                                pipefisher::OffloadMode::kHost},
                    OffloadCase{"GPipeDataParallelAuto", sched::ScheduleKind::kGPipe, 2, 2, 3, 0.0F,
                                false, pipefisher::OffloadMode::kAuto},
                    OffloadCase{"ChimeraHost", sched::ScheduleKind::kChimera, 2, 1, 1, 0.5F, false,
                                pipefisher::OffloadMode::kHost}),
    [](const testing::TestParamInfo<OffloadCase>& param_info) { return param_info.param.name; });

TEST(OffloadExecutor, ShardedStateWithOffloadCopiesIsRefused) {
  // A hand-made schedule: the sharded pass's schedule with an offload copy added.
  const auto config = test_config();
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = 2;
  params.microbatches = 4;
  params.num_layers = config.num_layers;
  params.data_parallel = 2;
  const TestCosts costs(config, unit_costs(false));
  pipefisher::KfacOptions kfac;
  kfac.refresh_steps = 1;
  kfac.state_placement = kfac::uniform_placement({kfac::Placement::kShard, 0});
  for (int kind = 0; kind < sched::kNumLinearKinds; ++kind) {
    const auto linear = static_cast<sched::LinearKind>(kind);
    kfac.linear_dims.push_back({linear == sched::LinearKind::kFfnOut ? 12 : 8,
                                linear == sched::LinearKind::kFfnIn ? 12 : 8});
  }
  const auto pass = pipefisher::run_pipefisher(sched::compile(params), costs, kfac);
  EXPECT_THROW(pipefisher::run_offload_pass(pass, costs, {pipefisher::OffloadMode::kHost, 0.0}),
               std::invalid_argument);
}

}  // namespace
}  // namespace pf::exec
