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
#include "tests/executor/offload_plan.h"
#include "tests/model/model_test_util.h"

namespace pf::exec {
namespace {

// The model tests' tiny BERT, with this file's vocabulary.
model::BertConfig test_config() {
  model::BertConfig config = model::testing::tiny_test_config();
  config.vocab_size = 29;
  return config;
}

struct RunResult {
  std::vector<std::vector<float>> parameters;  // per rank
  std::vector<std::int64_t> kfac_bytes;        // per rank, device (live) state
  std::vector<std::int64_t> host_bytes;        // per rank, offloaded state
  int refreshes = 0;
};

RunResult run(const sched::Schedule& schedule, float running_average, std::int64_t steps,
              const kfac::StatePlacement& placement = {}) {
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
  setup.options.kfac.placement = placement;
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

class OffloadEquivalence : public ::testing::TestWithParam<testing::OffloadCase> {};

const kfac::StatePlacement kShard = kfac::uniform_placement({kfac::Placement::kShard, 0});
// The owner inverts and broadcasts the inverses to the other replica(s) holding them.
const kfac::StatePlacement kFactorsShardedInversesReplicated{{kfac::Placement::kShard, 0},
                                                             {kfac::Placement::kReplicate, 0}};
// Over 4 replicas: the owner's pair holds the inverses (one by broadcast), the other pair
// receives the preconditioned gradient.
const kfac::StatePlacement kFactorsShardedInversesPartial{{kfac::Placement::kShard, 0},
                                                          {kfac::Placement::kPartial, 2}};

TEST_P(OffloadEquivalence, SameParametersBitForBitAndLessDeviceState) {
  const auto c = GetParam();
  const auto offload = testing::plan_offload_run(c, test_config());
  ASSERT_GT(offload.plan.offloaded_linears(), 0);
  if (c.mode == pipefisher::OffloadMode::kFactors) {
    ASSERT_EQ(offload.plan.factors_only_linears(), offload.plan.offloaded_linears());
  }
  if (c.name.ends_with("Mixed")) {  // a worker with Linears offloaded whole and factors only
    const auto& plan = offload.plan.workers[0];
    ASSERT_FALSE(plan.offloaded.empty());
    ASSERT_FALSE(plan.factors_only.empty());
  }
  const int k = offload.without.num_steps;
  const bool pipelined = c.refresh != testing::Refresh::kPlain;
  if (pipelined) {
    // The plan runs work in the next window: whole inversions, the rest of chains of pieces,
    // or curvature syncs (and the inversions after them).
    ASSERT_TRUE(offload.with.kfac_pipelined_refresh);
    const auto wrapped = testing::wrapped_work(offload.with);
    EXPECT_GT(wrapped.instructions, 0);
    if (c.refresh == testing::Refresh::kPipelinedChains) {
      EXPECT_GT(wrapped.continued, 0);
    }
    if (c.refresh == testing::Refresh::kPipelinedSyncs) {
      EXPECT_GT(wrapped.syncs, 0);
    }
  }
  const std::int64_t steps = 3 * k;  // three whole refresh windows
  const RunResult without = run(offload.without, c.running_average, steps, c.placement);
  const RunResult with = run(offload.with, c.running_average, steps, c.placement);
  EXPECT_EQ(with.refreshes, without.refreshes);
  // Pipelined: a refresh's inverses serve from the next window on (two of the three).
  EXPECT_EQ(with.refreshes, pipelined ? 2 : 3);
  ASSERT_EQ(with.parameters.size(), without.parameters.size());
  for (std::size_t r = 0; r < with.parameters.size(); ++r) {
    ASSERT_EQ(with.parameters[r].size(), without.parameters[r].size());
    EXPECT_EQ(std::memcmp(with.parameters[r].data(), without.parameters[r].data(),
                          with.parameters[r].size() * sizeof(float)),
              0)
        << "rank " << r << " differs";
  }
  // Between refreshes an offloaded Linear holds nothing on the device: the state falls by
  // exactly what the rank holds of the offloaded Linears (rank = replica * workers + worker;
  // with sharded state the owner's replicas hold factors and inverses, the inverse holders
  // without factors the inverses, the others nothing). Replicated, that is the plan's bytes.
  const auto expected = testing::offloaded_state_per_rank(c, offload, test_config());
  for (std::size_t r = 0; r < with.kfac_bytes.size(); ++r) {
    const auto& plan = offload.plan.workers[r % static_cast<std::size_t>(c.workers)];
    EXPECT_EQ(without.kfac_bytes[r] - with.kfac_bytes[r], expected[r].state) << "rank " << r;
    if (c.placement == kfac::StatePlacement{}) {
      // Whole Linears their state, factors-only ones their factors (half their state).
      EXPECT_EQ(expected[r].state,
                static_cast<std::int64_t>(plan.offloaded_bytes + plan.factors_only_bytes / 2.0));
    }
    EXPECT_EQ(without.host_bytes[r], 0);
    // Host: factors, the newest inverses and the ones they replaced.
    EXPECT_EQ(with.host_bytes[r], expected[r].host) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, OffloadEquivalence,
    ::testing::Values(
        testing::OffloadCase{"OneFOneBHost", sched::ScheduleKind::kOneFOneB, 2, 1, 2, false,
                             pipefisher::OffloadMode::kHost, 0.0F},
        testing::OffloadCase{"OneFOneBRunningAverageDividedTasks", sched::ScheduleKind::kOneFOneB,
                             2, 1, 0, true, pipefisher::OffloadMode::kHost, 0.9F},
        testing::OffloadCase{"GPipeDataParallelAuto", sched::ScheduleKind::kGPipe, 2, 2, 3, false,
                             pipefisher::OffloadMode::kAuto, 0.0F},
        testing::OffloadCase{"ChimeraHost", sched::ScheduleKind::kChimera, 2, 1, 1, false,
                             pipefisher::OffloadMode::kHost, 0.5F},
        // Factors only (--kfac-offload factors): the inverses stay on the device.
        testing::OffloadCase{"OneFOneBFactors", sched::ScheduleKind::kOneFOneB, 2, 1, 2, false,
                             pipefisher::OffloadMode::kFactors, 0.5F},
        // auto, a budget that takes every Linear's factors and some Linears whole.
        testing::OffloadCase{"OneFOneBAutoMixed",
                             sched::ScheduleKind::kOneFOneB,
                             2,
                             1,
                             2,
                             false,
                             pipefisher::OffloadMode::kAuto,
                             0.5F,
                             {},
                             testing::Refresh::kPlain,
                             0.6},
        testing::OffloadCase{"OneFOneBFactorsDividedTasks", sched::ScheduleKind::kOneFOneB, 2, 1, 0,
                             true, pipefisher::OffloadMode::kFactors, 0.9F},
        testing::OffloadCase{"ChimeraDataParallelFactors", sched::ScheduleKind::kChimera, 2, 2, 2,
                             false, pipefisher::OffloadMode::kFactors, 0.5F},
        testing::OffloadCase{
            "GPipeFactorsShardedInversesReplicatedFactors", sched::ScheduleKind::kGPipe, 2, 2, 2,
            false, pipefisher::OffloadMode::kFactors, 0.0F, kFactorsShardedInversesReplicated},
        testing::OffloadCase{"OneFOneBPipelinedChainsOfPiecesFactors",
                             sched::ScheduleKind::kOneFOneB,
                             4,
                             1,
                             0,
                             false,
                             pipefisher::OffloadMode::kFactors,
                             0.9F,
                             {},
                             testing::Refresh::kPipelinedChains},
        testing::OffloadCase{"ChimeraDataParallelHost", sched::ScheduleKind::kChimera, 2, 2, 2,
                             false, pipefisher::OffloadMode::kHost, 0.5F},
        // K-FAC state sharded across the data-parallel replicas.
        testing::OffloadCase{"OneFOneBShardTwoReplicas", sched::ScheduleKind::kOneFOneB, 2, 2, 2,
                             false, pipefisher::OffloadMode::kHost, 0.5F, kShard},
        testing::OffloadCase{"GPipeFactorsShardedInversesReplicated", sched::ScheduleKind::kGPipe,
                             2, 2, 2, false, pipefisher::OffloadMode::kHost, 0.0F,
                             kFactorsShardedInversesReplicated},
        testing::OffloadCase{"OneFOneBShardTwoReplicasAuto", sched::ScheduleKind::kOneFOneB, 2, 2,
                             2, false, pipefisher::OffloadMode::kAuto, 0.5F, kShard},
        // (Here offloading lowers no worker's simulated peak, so auto keeps nothing offloaded:
        // host, to move the state anyway.)
        testing::OffloadCase{"OneFOneBPartialFourReplicasDividedTasks",
                             sched::ScheduleKind::kOneFOneB, 2, 4, 0, true,
                             pipefisher::OffloadMode::kHost, 0.9F, kFactorsShardedInversesPartial},
        // A pipelined refresh.
        testing::OffloadCase{"OneFOneBPipelinedWholeInversions",
                             sched::ScheduleKind::kOneFOneB,
                             4,
                             1,
                             2,
                             false,
                             pipefisher::OffloadMode::kHost,
                             0.5F,
                             {},
                             testing::Refresh::kPipelinedWhole},
        testing::OffloadCase{"OneFOneBPipelinedChainsOfPieces",
                             sched::ScheduleKind::kOneFOneB,
                             4,
                             1,
                             0,
                             false,
                             pipefisher::OffloadMode::kHost,
                             0.9F,
                             {},
                             testing::Refresh::kPipelinedChains},
        testing::OffloadCase{"ChimeraPipelinedSyncsInTheNextWindow",
                             sched::ScheduleKind::kChimera,
                             4,
                             1,
                             0,
                             false,
                             pipefisher::OffloadMode::kHost,
                             0.0F,
                             {},
                             testing::Refresh::kPipelinedSyncs}),

    [](const ::testing::TestParamInfo<testing::OffloadCase>& param_info) {
      return param_info.param.name;
    });

}  // namespace
}  // namespace pf::exec
