// K-FAC state offload (docs/offload.md) on the executor's device path, run on the CPU backend
// (HostDeviceRuntime): the offloaded Linears' factors and inverses in the runtime's pinned host
// memory, the schedule's copies on each worker's copy stream ordered with its compute stream by
// events, the device layers' buffers detached after a write-back and after a preconditioning.
// A run with the offload pass's copies trains to exactly the parameters of the same device run
// without them (and, with whole tasks, of the CPU path's offload run), the host holds what the plan
// offloads (factors, newest and previous inverses: 1.5x its bytes), and the device layers hold that
// much less. The CPU backend's copies are synchronous, so these tests check what moves where and
// when, not the overlap (that needs a GPU: test_executor_cuda).
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/device/host_device_runtime.h"
#include "tests/executor/device_run.h"
#include "tests/executor/offload_plan.h"

namespace pf::exec {
namespace {

using testing::device_test_config;
using testing::OffloadCase;
using testing::plan_offload_run;
using testing::run_schedule;

void expect_same_parameters(const testing::DeviceRun& actual, const testing::DeviceRun& expected,
                            const std::string& what) {
  ASSERT_EQ(actual.values.size(), expected.values.size()) << what;
  for (const auto& [name, values] : expected.values) {
    ASSERT_TRUE(actual.values.contains(name)) << what << ": " << name;
    const auto& got = actual.values.at(name);
    ASSERT_EQ(got.size(), values.size()) << what << ": " << name;
    EXPECT_EQ(std::memcmp(got.data(), values.data(), values.size() * sizeof(float)), 0)
        << what << ": " << name << " differs";
  }
}

class DeviceOffload : public ::testing::TestWithParam<OffloadCase> {};

TEST_P(DeviceOffload, SameParametersBitForBitAndTheHostHoldsThePlan) {
  const auto c = GetParam();
  const auto config = device_test_config(4);
  const auto plans = plan_offload_run(c, config);
  ASSERT_GT(plans.plan.offloaded_linears(), 0);
  if (c.name.ends_with("Mixed")) {  // a worker with Linears offloaded whole and factors only
    ASSERT_FALSE(plans.plan.workers[0].offloaded.empty());
    ASSERT_FALSE(plans.plan.workers[0].factors_only.empty());
  }
  const bool pipelined = c.refresh != testing::Refresh::kPlain;
  if (pipelined) {
    ASSERT_GT(testing::wrapped_work(plans.with).instructions, 0);
  }
  const std::int64_t steps = 3 * plans.without.num_steps;  // three whole refresh windows
  const auto run = [&](const std::shared_ptr<device::DeviceRuntime>& runtime,
                       const sched::Schedule& schedule) {
    return run_schedule(runtime, config, schedule, "adamw", steps, true,
                        ExecutorOptions{}.dp_bucket_bytes, c.running_average, c.placement);
  };
  const auto without = run(std::make_shared<device::HostDeviceRuntime>(), plans.without);
  const auto with = run(std::make_shared<device::HostDeviceRuntime>(), plans.with);
  const auto cpu_with = run(nullptr, plans.with);
  expect_same_parameters(with, without, "device with offload vs without");
  // Divided inversions run as the same chain of pieces on both paths.
  expect_same_parameters(with, cpu_with, "device with offload vs the CPU path's offload");
  int refreshes = 0;
  for (std::size_t s = 0; s < with.steps.size(); ++s) {
    EXPECT_EQ(with.steps[s].mlm_loss, without.steps[s].mlm_loss) << "step " << s;
    EXPECT_EQ(with.steps[s].kfac_refresh, without.steps[s].kfac_refresh) << "step " << s;
    refreshes += with.steps[s].kfac_refresh ? 1 : 0;
  }
  EXPECT_EQ(refreshes, pipelined ? 2 : 3);  // pipelined: inverses serve from the next window
  // Between refreshes an offloaded Linear holds nothing on the device: its value, inverse and
  // the inverse a refresh replaced (kept by a device layer) are in host memory, on both sides:
  // 1.5x the plan's bytes (value and inverse of both factors) replicated; with sharded state
  // what each rank holds (the inverse holders without factors: the inverses, twice).
  const auto expected = testing::offloaded_state_per_rank(c, plans, config);
  ASSERT_EQ(with.kfac_state_bytes.size(), without.kfac_state_bytes.size());
  for (std::size_t r = 0; r < with.kfac_state_bytes.size(); ++r) {
    const auto& worker = plans.plan.workers[r % static_cast<std::size_t>(c.workers)];
    const auto offloaded = static_cast<std::int64_t>(worker.offloaded_bytes);
    // Factors only: their values (half the state) and nothing else.
    const auto factors = static_cast<std::int64_t>(worker.factors_only_bytes / 2.0);
    if (c.placement == kfac::StatePlacement{}) {
      EXPECT_EQ(expected[r].host, offloaded + offloaded / 2 + factors) << "rank " << r;
    }
    EXPECT_EQ(with.kfac_host_bytes[r], expected[r].host) << "rank " << r;
    EXPECT_EQ(with.kfac_host_bytes[r], cpu_with.kfac_host_bytes[r]) << "rank " << r;
    EXPECT_EQ(without.kfac_host_bytes[r], 0) << "rank " << r;
    EXPECT_EQ(without.kfac_state_bytes[r] - with.kfac_state_bytes[r], expected[r].host)
        << "rank " << r;
  }
  // Every copy ran on the host link, timed on the copy stream, with the plan's payload where
  // the rank holds what it moves (sharded: nothing where it holds none). The first window's
  // copies of the previous refresh's inversions do not run (pipelined: there was none).
  std::size_t copies = 0;
  for (const auto& e : with.events) {
    if (!sched::is_kfac_transfer(e.instruction.kind)) continue;
    ++copies;
    EXPECT_EQ(e.lane, Lane::kHostLink);
    if (c.placement == kfac::StatePlacement{}) {
      EXPECT_EQ(e.bytes, e.instruction.bytes);
    } else {
      EXPECT_TRUE(e.bytes == e.instruction.bytes || e.bytes == 0) << e.bytes;
    }
    EXPECT_LE(e.start_s, e.end_s);
  }
  std::size_t scheduled = 0, wrapped = 0;
  for (const auto& stream : plans.with.streams) {
    for (const auto& in : stream) {
      scheduled += sched::is_kfac_transfer(in.kind) ? 1 : 0;
      wrapped += sched::is_kfac_transfer(in.kind) && sched::is_wrapped(in) ? 1 : 0;
    }
  }
  EXPECT_EQ(copies, (3 * scheduled - wrapped) * static_cast<std::size_t>(c.data_parallel));
  EXPECT_EQ(with.exchange_pending, 0U);
  EXPECT_EQ(with.pending_messages, 0U);
}

// The most K-FAC memory each worker holds at once on the device path (its layers' buffers and
// the offload staging pool's), sampled after every K-FAC instruction, against the plan: the
// kept state, the largest offloaded Linear's state while it is moved and the offloaded Linears'
// factor sums, which the refresh's curvature accumulates on the device from its first step to
// their inversion (WorkerOffloadPlan::device_kfac_bytes; without the sums the plan said 6656
// bytes at once on 1F1B, where the executor measured 35072: the sums are 29696). Before the staging
// pool served the layers' own buffers, every buffer a step's copies and inversions touched stayed
// in the pool to the step's end: the whole offloaded state at once (59392 bytes here against 36352
// planned). Without offload the device holds twice the state the plan counts: the sums and the
// inverses a refresh replaced beside the values and inverses.
class DeviceOffloadResident : public ::testing::TestWithParam<OffloadCase> {};

TEST_P(DeviceOffloadResident, TheDeviceHoldsAtOnceWhatThePlanSays) {
  const auto c = GetParam();
  const auto config = device_test_config(4);
  const auto plans = plan_offload_run(c, config);
  const std::int64_t steps = 3 * plans.without.num_steps;
  const auto run = [&](const sched::Schedule& schedule) {
    return run_schedule(std::make_shared<device::HostDeviceRuntime>(), config, schedule, "adamw",
                        steps, true, ExecutorOptions{}.dp_bucket_bytes, c.running_average,
                        c.placement);
  };
  const auto without = run(plans.without);
  const auto with = run(plans.with);
  expect_same_parameters(with, without, "device with offload vs without");
  ASSERT_EQ(with.kfac_peak_resident_bytes.size(), plans.plan.workers.size());
  for (std::size_t r = 0; r < with.kfac_peak_resident_bytes.size(); ++r) {
    const auto& worker = plans.plan.workers[r];
    ASSERT_GT(worker.offloaded_bytes, 0.0) << "rank " << r;
    const double state = worker.kept_bytes + worker.offloaded_bytes + worker.factors_only_bytes;
    const double sums = state / 2.0;  // every Linear's, offloaded or not
    EXPECT_DOUBLE_EQ(pipefisher::factor_sum_bytes(worker), sums) << "rank " << r;
    EXPECT_LE(static_cast<double>(with.kfac_peak_resident_bytes[r]), worker.device_kfac_bytes)
        << "rank " << r << ": plan " << worker.device_kfac_bytes << " bytes at once, sums " << sums;
    EXPECT_EQ(static_cast<double>(without.kfac_peak_resident_bytes[r]), 2.0 * state)
        << "rank " << r;
    EXPECT_EQ(with.kfac_state_bytes[r], 0) << "rank " << r << ": left between refreshes";
  }
  // The pinned host memory is allocated before the first step (PinnedKfacState::reserve), not
  // at the write-backs: one step in, the host holds what it holds after three refreshes.
  const auto one_step =
      run_schedule(std::make_shared<device::HostDeviceRuntime>(), config, plans.with, "adamw", 1,
                   true, ExecutorOptions{}.dp_bucket_bytes, c.running_average, c.placement);
  EXPECT_EQ(one_step.kfac_host_bytes, with.kfac_host_bytes);
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, DeviceOffloadResident,
    ::testing::Values(OffloadCase{"OneFOneBHost", sched::ScheduleKind::kOneFOneB, 2, 1, 2, false,
                                  pipefisher::OffloadMode::kHost},
                      OffloadCase{"OneFOneBRunningAverage", sched::ScheduleKind::kOneFOneB, 2, 1, 2,
                                  false, pipefisher::OffloadMode::kHost, 0.5F},
                      OffloadCase{"ChimeraHost", sched::ScheduleKind::kChimera, 2, 1, 1, false,
                                  pipefisher::OffloadMode::kHost, 0.5F}),
    [](const ::testing::TestParamInfo<OffloadCase>& param_info) { return param_info.param.name; });

INSTANTIATE_TEST_SUITE_P(
    Schedules, DeviceOffload,
    ::testing::Values(
        OffloadCase{"OneFOneBHost", sched::ScheduleKind::kOneFOneB, 2, 1, 2, false,
                    pipefisher::OffloadMode::kHost},
        OffloadCase{"OneFOneBRunningAverageDividedTasks", sched::ScheduleKind::kOneFOneB, 2, 1, 0,
                    true, pipefisher::OffloadMode::kHost, 0.9F},
        OffloadCase{"OneFOneBRunningAverage", sched::ScheduleKind::kOneFOneB, 2, 1, 2, false,
                    pipefisher::OffloadMode::kHost, 0.5F},
        OffloadCase{"GPipeDataParallelAuto", sched::ScheduleKind::kGPipe, 2, 2, 3, false,
                    pipefisher::OffloadMode::kAuto},
        OffloadCase{"ChimeraHost", sched::ScheduleKind::kChimera, 2, 1, 1, false,
                    pipefisher::OffloadMode::kHost, 0.5F},
        // Factors only (--kfac-offload factors): the inverses stay on the device.
        OffloadCase{"OneFOneBFactors", sched::ScheduleKind::kOneFOneB, 2, 1, 2, false,
                    pipefisher::OffloadMode::kFactors, 0.5F},
        // auto, a budget that takes every Linear's factors and some Linears whole.
        OffloadCase{"OneFOneBAutoMixed",
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
        OffloadCase{"OneFOneBFactorsDividedTasks", sched::ScheduleKind::kOneFOneB, 2, 1, 0, true,
                    pipefisher::OffloadMode::kFactors, 0.9F},
        OffloadCase{"ChimeraDataParallelFactors", sched::ScheduleKind::kChimera, 2, 2, 2, false,
                    pipefisher::OffloadMode::kFactors, 0.5F},
        OffloadCase{"OneFOneBShardTwoReplicasFactors", sched::ScheduleKind::kOneFOneB, 2, 2, 2,
                    false, pipefisher::OffloadMode::kFactors, 0.5F,
                    kfac::uniform_placement({kfac::Placement::kShard, 0})},
        OffloadCase{"OneFOneBPipelinedChainsOfPiecesFactors",
                    sched::ScheduleKind::kOneFOneB,
                    4,
                    1,
                    0,
                    false,
                    pipefisher::OffloadMode::kFactors,
                    0.9F,
                    {},
                    testing::Refresh::kPipelinedChains},
        // K-FAC state sharded across the data-parallel replicas.
        OffloadCase{"OneFOneBShardTwoReplicas", sched::ScheduleKind::kOneFOneB, 2, 2, 2, false,
                    pipefisher::OffloadMode::kHost, 0.5F,
                    kfac::uniform_placement({kfac::Placement::kShard, 0})},
        OffloadCase{
            "GPipeFactorsShardedInversesReplicated", sched::ScheduleKind::kGPipe, 2, 2, 2, false,
            pipefisher::OffloadMode::kHost, 0.0F,
            kfac::StatePlacement{{kfac::Placement::kShard, 0}, {kfac::Placement::kReplicate, 0}}},
        // A pipelined refresh.
        OffloadCase{"OneFOneBPipelinedWholeInversions",
                    sched::ScheduleKind::kOneFOneB,
                    4,
                    1,
                    2,
                    false,
                    pipefisher::OffloadMode::kHost,
                    0.5F,
                    {},
                    testing::Refresh::kPipelinedWhole},
        OffloadCase{"OneFOneBPipelinedChainsOfPieces",
                    sched::ScheduleKind::kOneFOneB,
                    4,
                    1,
                    0,
                    false,
                    pipefisher::OffloadMode::kHost,
                    0.9F,
                    {},
                    testing::Refresh::kPipelinedChains},
        OffloadCase{"ChimeraPipelinedSyncsInTheNextWindow",
                    sched::ScheduleKind::kChimera,
                    4,
                    1,
                    0,
                    false,
                    pipefisher::OffloadMode::kHost,
                    0.0F,
                    {},
                    testing::Refresh::kPipelinedSyncs}),
    [](const ::testing::TestParamInfo<OffloadCase>& param_info) { return param_info.param.name; });

// The layer's side of offload: a detached matrix leaves the device layer (and its bytes), an
// attached one comes back bit for bit, and what needs a detached matrix says so.
TEST(DeviceOffloadLayer, DetachAndAttachMoveTheMatricesAndMissingOnesAreNamed) {
  using Matrix = device::DeviceKfacLayer::Matrix;
  device::HostDeviceRuntime runtime;
  auto layer = runtime.make_kfac_layer(nullptr, 3, 2, "layer 0 query");
  std::vector<float> a(4 * 3), g(4 * 2);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = 0.25F * static_cast<float>(i % 5) - 0.3F;
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = 0.5F - 0.125F * static_cast<float>(i % 7);
  const auto refresh = [&] {
    layer->accumulate(true, {a.data(), 4, 3}, 1.0F, 0, sched::kPieceUnits);
    layer->accumulate(false, {g.data(), 4, 2}, 2.0F, 0, sched::kPieceUnits);
    layer->finalize(true, 0.5F);
    layer->finalize(false, 0.5F);
    const auto damping = layer->damping(1e-2F, true);
    layer->invert(true, damping.a, kfac::InverseMethod::kCholesky);
    layer->invert(false, damping.b, kfac::InverseMethod::kCholesky);
  };
  refresh();
  const auto state = layer->to_host();
  const std::int64_t held = layer->device_bytes();
  EXPECT_EQ(held, static_cast<std::int64_t>(sizeof(float)) * 2 * (9 + 4));

  auto value_a = layer->detach(true, Matrix::kValue);
  auto inverse_b = layer->detach(false, Matrix::kInverse);
  ASSERT_EQ(value_a.numel(), 9);
  ASSERT_EQ(inverse_b.numel(), 4);
  EXPECT_EQ(layer->device_bytes(), held - static_cast<std::int64_t>(sizeof(float)) * (9 + 4));
  EXPECT_FALSE(layer->has_inverse(false, false));
  EXPECT_EQ(layer->detach(true, Matrix::kPreviousInverse).numel(), 0);  // none yet
  // A running average, the damping and an inversion need the value on the device.
  layer->accumulate(true, {a.data(), 4, 3}, 1.0F, 0, sched::kPieceUnits);
  EXPECT_THROW(layer->finalize(true, 0.5F), std::logic_error);
  EXPECT_THROW(layer->damping(1e-2F, true), std::logic_error);
  EXPECT_THROW(layer->invert(true, 1e-2F, kfac::InverseMethod::kCholesky), std::logic_error);
  EXPECT_THROW(layer->attach(true, Matrix::kValue,
                             tensor::Tensor::empty(runtime.backend(), {2, 2}, tensor::DType::kF32)),
               std::invalid_argument);

  EXPECT_EQ(layer->attach(true, Matrix::kValue, std::move(value_a)).numel(), 0);
  EXPECT_EQ(layer->attach(false, Matrix::kInverse, std::move(inverse_b)).numel(), 0);
  EXPECT_TRUE(layer->has_inverse(false, false));
  const auto back = layer->to_host();
  EXPECT_EQ(std::memcmp(back.a.value.data(), state.a.value.data(), 9 * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(back.b.inverse.data(), state.b.inverse.data(), 4 * sizeof(float)), 0);
  // The previous inverse travels too (a refresh's earlier steps precondition with it).
  layer->finalize(true, 0.5F);
  layer->invert(true, 1e-2F, kfac::InverseMethod::kCholesky);
  ASSERT_TRUE(layer->has_inverse(true, true));
  auto previous = layer->detach(true, Matrix::kPreviousInverse);
  EXPECT_FALSE(layer->has_inverse(true, true));
  EXPECT_EQ(std::memcmp(previous.raw_data(), state.a.inverse.data(), 9 * sizeof(float)), 0);
  layer->attach(true, Matrix::kPreviousInverse, std::move(previous));
  EXPECT_TRUE(layer->has_inverse(true, true));
}

TEST(DeviceOffloadLayer, PinnedHostBuffersAreOwnedAndMoved) {
  device::HostDeviceRuntime runtime;
  auto buffer = runtime.allocate_pinned_host(100);
  ASSERT_FALSE(buffer.empty());
  EXPECT_EQ(buffer.bytes(), 100U);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(buffer.data()) % 64, 0U);
  std::memset(buffer.data(), 7, buffer.bytes());
  device::PinnedHostBuffer moved = std::move(buffer);
  EXPECT_TRUE(buffer.empty());  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_EQ(moved.bytes(), 100U);
  EXPECT_EQ(static_cast<unsigned char*>(moved.data())[99], 7);
  moved.reset();
  EXPECT_TRUE(moved.empty());
  EXPECT_TRUE(runtime.allocate_pinned_host(0).empty());
}

}  // namespace
}  // namespace pf::exec
