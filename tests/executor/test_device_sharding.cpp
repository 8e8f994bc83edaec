// K-FAC state sharded across data-parallel replicas (kfac/state_placement.h, --kfac-sharding) on
// the executor's device path, run on the CPU backend (HostDeviceRuntime): only the owner's group
// keeps the synced factor sums and inverts, the owner's inverses are broadcast to the inverse
// holders (device buffers staged through host memory), the owner's preconditioned gradient to
// the rest. Every placement trains to the CPU path's parameters bit for bit (AdamW), and the
// device layers hold less K-FAC state than replication's.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kfac/state_placement.h"
#include "runtime/device/host_device_runtime.h"
#include "tests/executor/device_run.h"

namespace pf::exec {
namespace {

using testing::device_test_config;

sched::Schedule sharded_schedule(const model::BertConfig& config,
                                 const kfac::StatePlacement& placement, int data_parallel) {
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = 2;
  params.microbatches = 4;
  params.num_layers = config.num_layers;
  params.data_parallel = data_parallel;
  sim::UniformCosts costs{.forward_s = 1.0, .backward_s = 2.0, .communication_s = 0.05};
  costs.curvature_a_s = costs.curvature_b_s = 0.05;
  costs.invert_a_s = costs.invert_b_s = 0.2;
  costs.precondition_s = 0.02;
  costs.curvature_sync_s = 0.05;
  pipefisher::KfacOptions kfac;
  kfac.refresh_steps = 2;
  kfac.split = false;  // whole tasks: the device path equals the CPU path bit for bit
  kfac.state_placement = placement;
  for (int kind = 0; kind < sched::kNumLinearKinds; ++kind) {
    const auto linear = static_cast<sched::LinearKind>(kind);
    const std::int64_t h = config.hidden_size, i = config.intermediate_size;
    kfac.linear_dims.push_back({linear == sched::LinearKind::kFfnOut ? i : h,
                                linear == sched::LinearKind::kFfnIn ? i : h});
  }
  return pipefisher::run_pipefisher(sched::compile(params), sim::UniformCostModel(costs), kfac)
      .schedule;
}

testing::DeviceRun run_placed(const std::shared_ptr<device::DeviceRuntime>& runtime,
                              const model::BertConfig& config, const sched::Schedule& schedule,
                              const kfac::StatePlacement& placement, std::int64_t steps) {
  auto batches = testing::device_test_batches(config);
  auto setup = testing::device_test_setup(runtime, config, schedule, "adamw", batches, false);
  setup.options.kfac.placement = placement;
  ThreadedExecutor<float> executor(setup);
  testing::DeviceRun run;
  executor.run(0, steps, [&](const StepResult& r) { run.steps.push_back(r); });
  for (int r = 0; r < executor.num_ranks(); ++r) {
    run.kfac_state_bytes.push_back(executor.worker(r).kfac_state_bytes());
    for (auto* chunk : executor.worker(r).chunks()) {
      for (const auto& p : chunk->parameters()) {
        std::vector<float> host(static_cast<std::size_t>(p.size));
        if (runtime) {
          runtime->backend().copy(host.data(), p.value, host.size() * sizeof(float),
                                  tensor::CopyKind::kDeviceToHost);
          runtime->backend().synchronize();
        } else {
          host.assign(p.value, p.value + p.size);
        }
        run.values["rank" + std::to_string(r) + "." + p.name] = std::move(host);
      }
    }
  }
  return run;
}

void check(int data_parallel, const kfac::StatePlacement& placement) {
  SCOPED_TRACE("--kfac-sharding " + kfac::to_string(placement) + " over " +
               std::to_string(data_parallel) + " replicas");
  const auto config = device_test_config(4);
  const auto schedule = sharded_schedule(config, placement, data_parallel);
  const std::int64_t steps = 3 * schedule.num_steps;  // three whole refreshes
  const auto cpu = run_placed(nullptr, config, schedule, placement, steps);
  const auto device =
      run_placed(std::make_shared<device::HostDeviceRuntime>(), config, schedule, placement, steps);
  ASSERT_EQ(device.values.size(), cpu.values.size());
  for (const auto& [name, values] : cpu.values) {
    const auto& got = device.values.at(name);
    EXPECT_EQ(std::memcmp(got.data(), values.data(), values.size() * sizeof(float)), 0)
        << name << " differs from the CPU path's";
  }
  int refreshes = 0;
  for (std::size_t s = 0; s < cpu.steps.size(); ++s) {
    EXPECT_EQ(device.steps[s].loss(), cpu.steps[s].loss()) << "step " << s;
    refreshes += device.steps[s].kfac_refresh ? 1 : 0;
  }
  EXPECT_EQ(refreshes, 3);
  // Against replication on the device: the same parameters, less K-FAC state held in all.
  const kfac::StatePlacement replicate;
  const auto replicated =
      run_placed(std::make_shared<device::HostDeviceRuntime>(), config,
                 sharded_schedule(config, replicate, data_parallel), replicate, steps);
  for (const auto& [name, values] : replicated.values) {
    const auto& got = device.values.at(name);
    EXPECT_EQ(std::memcmp(got.data(), values.data(), values.size() * sizeof(float)), 0)
        << name << " differs from replication's";
  }
  std::int64_t held = 0, held_replicated = 0;
  for (const auto bytes : device.kfac_state_bytes) held += bytes;
  for (const auto bytes : replicated.kfac_state_bytes) held_replicated += bytes;
  EXPECT_LT(held, held_replicated);
}

TEST(HostDeviceSharding, ShardEqualsTheCpuPathAndReplicationAtTwoReplicas) {
  check(2, kfac::uniform_placement({kfac::Placement::kShard, 0}));
  check(2, {{kfac::Placement::kShard, 0}, {kfac::Placement::kReplicate, 0}});
}

TEST(HostDeviceSharding, PartialAndShardEqualTheCpuPathAtFourReplicas) {
  check(4, kfac::uniform_placement({kfac::Placement::kPartial, 2}));
  check(4, {{kfac::Placement::kShard, 0}, {kfac::Placement::kPartial, 2}});
}

}  // namespace
}  // namespace pf::exec
