// The executor on one GPU (fp32 products unless said): p pipeline workers sharing the GPU (a
// compute and a communication stream each, messages as device-to-device copies ordered by
// events) against one worker on the same GPU, and against the CPU path; K-FAC in the bubbles on
// the device; instruction times from CUDA events. Skipped without a CUDA device. Written without
// a GPU: the tolerances are estimates that have never been measured.
#include <cstring>

#include <gtest/gtest.h>

#include "runtime/device/device_runtime.h"
#include "tests/executor/device_run.h"
#include "tests/executor/offload_plan.h"

namespace pf::exec {
namespace {

using testing::device_test_config;
using testing::device_test_schedule;
using testing::max_relative_difference;
using testing::run_schedule;

std::shared_ptr<device::DeviceRuntime> open_gpu(kernels::GemmPrecision precision) {
  try {
    return device::open_device_runtime({tensor::DeviceKind::kCuda, 0}, precision);
  } catch (const device::DeviceUnavailableError&) {
    return nullptr;
  }
}

class ExecutorCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    gpu_ = open_gpu(kernels::GemmPrecision::kFp32);
    if (!gpu_) GTEST_SKIP() << "no CUDA device";
  }
  std::shared_ptr<device::DeviceRuntime> gpu_;
};

struct GpuCase {
  sched::ScheduleKind kind;
  int workers;
  int chunks;
  bool split_backward;
};

class PipelinedOnOneGpu : public ExecutorCuda, public ::testing::WithParamInterface<GpuCase> {};

TEST_P(PipelinedOnOneGpu, EqualsOneWorkerOnTheGpu) {
  const auto c = GetParam();
  const auto config = device_test_config(4);
  const auto one = run_schedule(
      gpu_, config, device_test_schedule(sched::ScheduleKind::kOneFOneB, 1, 1, 4, false), "sgd", 3);
  const auto many = run_schedule(
      gpu_, config, device_test_schedule(c.kind, c.workers, c.chunks, 4, false, c.split_backward),
      "sgd", 3);
  EXPECT_LT(max_relative_difference(many, one), 1e-4);
  ASSERT_EQ(many.steps.size(), 3U);
  for (std::size_t s = 0; s < 3; ++s) {
    EXPECT_NEAR(many.steps[s].loss(), one.steps[s].loss(), 1e-4 * one.steps[s].loss());
  }
  EXPECT_EQ(many.exchange_pending, 0U);
  EXPECT_EQ(many.pending_messages, 0U);
  EXPECT_EQ(many.transient_bytes, 0U);
}

INSTANTIATE_TEST_SUITE_P(Schedules, PipelinedOnOneGpu,
                         ::testing::Values(GpuCase{sched::ScheduleKind::kOneFOneB, 2, 1, false},
                                           GpuCase{sched::ScheduleKind::kGPipe, 4, 1, false},
                                           GpuCase{sched::ScheduleKind::kInterleaved, 2, 2, false},
                                           GpuCase{sched::ScheduleKind::kOneFOneB, 2, 1, true},
                                           GpuCase{sched::ScheduleKind::kChimera, 2, 1, false}));

TEST_F(ExecutorCuda, OneGpuWorkerMatchesTheCpu) {
  const auto config = device_test_config(4);
  const auto schedule = device_test_schedule(sched::ScheduleKind::kOneFOneB, 2, 1, 4, false);
  const auto cpu = run_schedule(nullptr, config, schedule, "sgd", 3);
  const auto gpu = run_schedule(gpu_, config, schedule, "sgd", 3);
  EXPECT_LT(max_relative_difference(gpu, cpu), 1e-4);
  for (std::size_t s = 0; s < cpu.steps.size(); ++s) {
    EXPECT_NEAR(gpu.steps[s].loss(), cpu.steps[s].loss(), 1e-4 * cpu.steps[s].loss());
    EXPECT_NEAR(gpu.steps[s].grad_norm, cpu.steps[s].grad_norm, 1e-3 * cpu.steps[s].grad_norm);
  }
}

TEST_F(ExecutorCuda, LambAndAdamWOnTheGpuTrackTheCpu) {
  const auto config = device_test_config(4);
  const auto schedule = device_test_schedule(sched::ScheduleKind::kOneFOneB, 2, 1, 4, false);
  for (const char* optimizer : {"lamb", "adamw"}) {
    SCOPED_TRACE(optimizer);
    const auto cpu = run_schedule(nullptr, config, schedule, optimizer, 2, false);
    const auto gpu = run_schedule(gpu_, config, schedule, optimizer, 2, false);
    // Adam-type updates amplify rounding where a gradient is near zero: loose on parameters,
    // tight on the losses.
    EXPECT_LT(max_relative_difference(gpu, cpu), 2e-2);
    for (std::size_t s = 0; s < cpu.steps.size(); ++s) {
      EXPECT_NEAR(gpu.steps[s].loss(), cpu.steps[s].loss(), 1e-3 * cpu.steps[s].loss());
    }
  }
}

TEST_F(ExecutorCuda, KfacInTheBubblesMatchesTheCpu) {
  const auto config = device_test_config(4);
  const auto schedule = device_test_schedule(sched::ScheduleKind::kOneFOneB, 2, 1, 4, true);
  const std::int64_t steps = 2 * schedule.num_steps + 1;
  const auto cpu = run_schedule(nullptr, config, schedule, "sgd", steps);
  const auto gpu = run_schedule(gpu_, config, schedule, "sgd", steps);
  EXPECT_LT(max_relative_difference(gpu, cpu), 1e-3);
  ASSERT_EQ(gpu.steps.size(), cpu.steps.size());
  for (std::size_t s = 0; s < cpu.steps.size(); ++s) {
    EXPECT_EQ(gpu.steps[s].kfac_refresh, cpu.steps[s].kfac_refresh) << "step " << s;
  }
  EXPECT_EQ(gpu.transient_bytes, cpu.transient_bytes);  // the open refresh's captures
}

// K-FAC offload on the GPU: factors and inverses in pinned host memory, copies on each worker's
// copy stream ordered by events; the parameters equal the run without offload bit for bit (the
// copies are exact, the kernels the same), the host holds 1.5x the plan's bytes and the device
// layers that much less (with sharded state what each rank holds); also with K-FAC state
// sharded over two replicas, with a pipelined refresh, and factors only (the host and the
// device's saving are the factors' values).
TEST_F(ExecutorCuda, KfacOffloadEqualsNoOffloadBitForBit) {
  const auto config = device_test_config(4);
  for (const auto& c :
       {testing::OffloadCase{"OneFOneBHost", sched::ScheduleKind::kOneFOneB, 2, 1, 2, false,
                             pipefisher::OffloadMode::kHost},
        testing::OffloadCase{"ChimeraHost", sched::ScheduleKind::kChimera, 2, 1, 1, false,
                             pipefisher::OffloadMode::kHost},
        // Factors only (--kfac-offload factors): the inverses stay on the device.
        testing::OffloadCase{"OneFOneBFactors", sched::ScheduleKind::kOneFOneB, 2, 1, 2, false,
                             pipefisher::OffloadMode::kFactors},
        testing::OffloadCase{"OneFOneBAutoMixed",
                             sched::ScheduleKind::kOneFOneB,
                             2,
                             1,
                             2,
                             false,
                             pipefisher::OffloadMode::kAuto,
                             0.0F,
                             {},
                             testing::Refresh::kPlain,
                             0.3},
        testing::OffloadCase{
            "OneFOneBShardTwoReplicas", sched::ScheduleKind::kOneFOneB, 2, 2, 2, false,
            pipefisher::OffloadMode::kHost, 0.0F,
            kfac::StatePlacement{{kfac::Placement::kShard, 0}, {kfac::Placement::kReplicate, 0}}},
        testing::OffloadCase{"OneFOneBPipelinedWholeInversions",
                             sched::ScheduleKind::kOneFOneB,
                             4,
                             1,
                             2,
                             false,
                             pipefisher::OffloadMode::kHost,
                             0.0F,
                             {},
                             testing::Refresh::kPipelinedWhole}}) {
    const auto plans = testing::plan_offload_run(c, config);
    const std::int64_t steps = 3 * plans.without.num_steps;
    const auto without = run_schedule(gpu_, config, plans.without, "sgd", steps, true,
                                      ExecutorOptions{}.dp_bucket_bytes, 0.0F, c.placement);
    const auto with = run_schedule(gpu_, config, plans.with, "sgd", steps, true,
                                   ExecutorOptions{}.dp_bucket_bytes, 0.0F, c.placement);
    ASSERT_EQ(with.values.size(), without.values.size()) << c.name;
    for (const auto& [name, values] : without.values) {
      const auto& got = with.values.at(name);
      EXPECT_EQ(std::memcmp(got.data(), values.data(), values.size() * sizeof(float)), 0)
          << c.name << ": " << name;
    }
    const auto expected = testing::offloaded_state_per_rank(c, plans, config);
    for (std::size_t r = 0; r < with.kfac_host_bytes.size(); ++r) {
      EXPECT_EQ(with.kfac_host_bytes[r], expected[r].host) << c.name << " rank " << r;
      // The CUDA layer keeps a finalized factor's sums buffer for its next accumulation (its
      // finalize swaps it with the value's); an offloaded Linear's leaves at its write-back.
      EXPECT_EQ(without.kfac_state_bytes[r] - with.kfac_state_bytes[r],
                expected[r].host + expected[r].sums)
          << c.name << " rank " << r;
    }
  }
}

// The curvature sync on the GPU: 1F1B p = 2 x DP = 2 (four workers sharing the GPU, the factor
// sums' pieces staged through host memory) and Chimera (the sync between its two pipelines).
TEST_F(ExecutorCuda, KfacCurvatureSyncsMatchTheCpu) {
  const auto config = device_test_config(4);
  for (const auto kind : {sched::ScheduleKind::kOneFOneB, sched::ScheduleKind::kChimera}) {
    SCOPED_TRACE(std::string(sched::to_string(kind)));
    sched::ScheduleParams params;
    params.kind = kind;
    params.workers = kind == sched::ScheduleKind::kChimera ? 4 : 2;
    params.microbatches = 4;
    params.num_layers = 4;
    params.data_parallel = kind == sched::ScheduleKind::kChimera ? 1 : 2;
    sim::UniformCosts costs{.forward_s = 1.0, .backward_s = 2.0, .communication_s = 0.05};
    costs.curvature_a_s = costs.curvature_b_s = costs.curvature_sync_s = 0.05;
    costs.invert_a_s = costs.invert_b_s = 0.2;
    costs.precondition_s = 0.02;
    pipefisher::KfacOptions options;
    options.refresh_steps = 2;
    const auto schedule =
        pipefisher::run_pipefisher(sched::compile(params), sim::UniformCostModel(costs), options)
            .schedule;
    const std::int64_t steps = 2 * schedule.num_steps + 1;
    const auto cpu = run_schedule(nullptr, config, schedule, "sgd", steps, false);
    const auto gpu = run_schedule(gpu_, config, schedule, "sgd", steps, false);
    EXPECT_LT(max_relative_difference(gpu, cpu), 1e-3);
    ASSERT_EQ(gpu.steps.size(), cpu.steps.size());
    for (std::size_t s = 0; s < cpu.steps.size(); ++s) {
      EXPECT_EQ(gpu.steps[s].kfac_refresh, cpu.steps[s].kfac_refresh) << "step " << s;
      EXPECT_NEAR(gpu.steps[s].loss(), cpu.steps[s].loss(), 1e-3 * cpu.steps[s].loss());
    }
  }
}

TEST_F(ExecutorCuda, InstructionTimesComeFromTheDevice) {
  const auto config = device_test_config(4);
  const auto schedule = device_test_schedule(sched::ScheduleKind::kOneFOneB, 2, 1, 4, true);
  const auto cpu = run_schedule(nullptr, config, schedule, "sgd", 2);
  const auto gpu = run_schedule(gpu_, config, schedule, "sgd", 2);
  ASSERT_EQ(gpu.events.size(), cpu.events.size());
  double busy = 0.0;
  for (const auto& e : gpu.events) {
    EXPECT_LE(e.start_s, e.end_s);
    EXPECT_GE(e.start_s, 0.0);
    busy += e.busy_s;
  }
  EXPECT_GT(busy, 0.0);
}

// Both bf16 paths (fp32 operands rounded inside cuBLAS, and operands rounded to bf16 copies
// first) on a pipeline of two workers, each with its own stream and copies.
TEST_F(ExecutorCuda, Bf16ProductsStayCloseToFp32) {
  const auto config = device_test_config(4);
  const auto schedule = device_test_schedule(sched::ScheduleKind::kOneFOneB, 2, 1, 4, false);
  const auto fp32 = run_schedule(gpu_, config, schedule, "sgd", 2, false);
  for (const auto precision :
       {kernels::GemmPrecision::kBf16, kernels::GemmPrecision::kBf16Operands}) {
    const auto bf16 = open_gpu(precision);
    ASSERT_TRUE(bf16);
    const auto low = run_schedule(bf16, config, schedule, "sgd", 2, false);
    ASSERT_EQ(low.steps.size(), fp32.steps.size());
    for (std::size_t s = 0; s < fp32.steps.size(); ++s) {
      EXPECT_NEAR(low.steps[s].loss(), fp32.steps[s].loss(), 2e-2 * fp32.steps[s].loss())
          << kernels::to_string(precision) << ", step " << s;
    }
  }
}

}  // namespace
}  // namespace pf::exec
