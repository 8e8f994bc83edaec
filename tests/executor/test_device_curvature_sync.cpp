// The K-FAC curvature sync on the executor's device path, run on the CPU backend
// (HostDeviceRuntime): each sync piece all-reduces its range of the device layers' factor sums
// (the set-aside sums for a pipelined refresh's sync run in the next window), staged through
// host memory with the in-process communicator, in place through a device communicator (the
// path NCCL takes on GPUs). Against the CPU path on the same schedule, bit for bit on every
// rank, and the replicas stay equal. Inversions and preconditionings divided into pieces are
// merged whole at their last piece's place first: the device runs those whole at their last
// piece, the CPU piece by piece (an inversion's chain, preconditioning by gradient rows: equal
// within rounding only); the syncs keep their pieces.
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/comm/in_process.h"
#include "runtime/device/host_device_communicator.h"
#include "scheduler/validate.h"
#include "tests/executor/device_run.h"
#include "tests/executor/offload_plan.h"

namespace pf::exec {
namespace {

using testing::linear_dims_of;

using testing::device_test_config;

struct RankRun {
  std::vector<std::vector<float>> parameters;  // every rank's, in its chunks' order
  std::vector<StepResult> steps;               // rank 0's
  int async_reductions = 0;                    // through the device communicators
};

std::vector<float> parameters_of(Worker<float>& worker) {
  std::vector<float> values;
  for (auto* chunk : worker.chunks()) {
    for (const auto& p : chunk->parameters())
      values.insert(values.end(), p.value, p.value + p.size);
  }
  return values;
}

// ThreadedExecutor (runtime null: the CPU path; else the device path with staged reductions).
RankRun run_threaded(const std::shared_ptr<device::DeviceRuntime>& runtime,
                     const sched::Schedule& schedule, std::int64_t steps) {
  const auto config = device_test_config(4);
  auto batches = testing::device_test_batches(config);
  ThreadedExecutor<float> executor(
      testing::device_test_setup(runtime, config, schedule, "adamw", batches, false));
  RankRun run;
  executor.run(0, steps, [&](const StepResult& r) { run.steps.push_back(r); });
  for (int r = 0; r < executor.num_ranks(); ++r) {
    run.parameters.push_back(parameters_of(executor.worker(r)));
  }
  return run;
}

// One Worker per rank on threads, each through a HostDeviceCommunicator over its InProcessWorld
// rank (the device-communicator path).
RankRun run_through_device_communicators(const sched::Schedule& schedule, std::int64_t steps) {
  const auto config = device_test_config(4);
  auto batches = testing::device_test_batches(config);
  const auto setup = testing::device_test_setup(std::make_shared<device::HostDeviceRuntime>(),
                                                config, schedule, "adamw", batches, false);
  const int ranks = schedule.num_workers() * schedule.params.data_parallel;
  comm::InProcessWorld world(ranks);
  std::vector<std::unique_ptr<device::HostDeviceCommunicator>> comms;
  std::vector<std::unique_ptr<Worker<float>>> workers;
  for (int r = 0; r < ranks; ++r) {
    comms.push_back(
        std::make_unique<device::HostDeviceCommunicator>(world.rank(r), std::chrono::seconds(60)));
    workers.push_back(std::make_unique<Worker<float>>(setup, *comms.back()));
  }
  RankRun run;
  std::vector<std::string> errors(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        workers[static_cast<std::size_t>(r)]->run(0, steps, [&](const StepResult& result) {
          if (r == 0) run.steps.push_back(result);
        });
      } catch (const std::exception& error) {
        errors[static_cast<std::size_t>(r)] = error.what();
        world.rank(r).abort(error.what());
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int r = 0; r < ranks; ++r) {
    EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
    run.parameters.push_back(parameters_of(*workers[static_cast<std::size_t>(r)]));
    run.async_reductions += comms[static_cast<std::size_t>(r)]->async_reductions();
  }
  return run;
}

void expect_bit_for_bit(const RankRun& actual, const RankRun& expected, const std::string& what) {
  ASSERT_EQ(actual.parameters.size(), expected.parameters.size()) << what;
  for (std::size_t r = 0; r < expected.parameters.size(); ++r) {
    ASSERT_EQ(actual.parameters[r].size(), expected.parameters[r].size()) << what;
    EXPECT_EQ(std::memcmp(actual.parameters[r].data(), expected.parameters[r].data(),
                          expected.parameters[r].size() * sizeof(float)),
              0)
        << what << ": rank " << r << " differs";
  }
  ASSERT_EQ(actual.steps.size(), expected.steps.size()) << what;
  for (std::size_t s = 0; s < expected.steps.size(); ++s) {
    EXPECT_EQ(actual.steps[s].mlm_loss, expected.steps[s].mlm_loss) << what << " step " << s;
    EXPECT_EQ(actual.steps[s].nsp_loss, expected.steps[s].nsp_loss) << what << " step " << s;
    EXPECT_EQ(actual.steps[s].kfac_refresh, expected.steps[s].kfac_refresh)
        << what << " step " << s;
  }
}

// Each data-parallel replica's worker w holds what replica 0's worker w holds, bit for bit.
void expect_replicas_equal(const RankRun& run, const sched::Schedule& schedule) {
  const int workers = schedule.num_workers();
  for (std::size_t r = static_cast<std::size_t>(workers); r < run.parameters.size(); ++r) {
    const auto& first = run.parameters[r % static_cast<std::size_t>(workers)];
    ASSERT_EQ(run.parameters[r].size(), first.size());
    EXPECT_EQ(std::memcmp(run.parameters[r].data(), first.data(), first.size() * sizeof(float)), 0)
        << "rank " << r << " left its replica";
  }
}

// Inversion and preconditioning pieces merged into a whole task at the last piece's place (see the
// file comment).
sched::Schedule with_whole_inversions_and_preconditioning(sched::Schedule schedule) {
  const auto inversion = [](const sched::Instruction& in) {
    return in.kind == sched::OpKind::kInvertA || in.kind == sched::OpKind::kInvertB ||
           in.kind == sched::OpKind::kPrecondition;
  };
  for (auto& stream : schedule.streams) {
    std::erase_if(stream, [&](const sched::Instruction& in) {
      return inversion(in) && in.piece_end != sched::kPieceUnits;
    });
    for (auto& in : stream) {
      if (inversion(in)) in.piece_begin = 0;
    }
  }
  return schedule;
}

int count_syncs(const sched::Schedule& schedule, bool pieces, bool wrapped) {
  int count = 0;
  for (const auto& stream : schedule.streams) {
    for (const auto& in : stream) {
      if (in.kind != sched::OpKind::kCurvatureSync) continue;
      if (pieces && !sched::is_piece(in)) continue;
      if (wrapped && !sched::is_wrapped(in)) continue;
      ++count;
    }
  }
  return count;
}

// K-FAC in the bubbles of `kind` on `workers` x `data_parallel`; sync_s long against the gaps
// divides the syncs into pieces; pipelined runs some of them in the next window.
sched::Schedule kfac_schedule(sched::ScheduleKind kind, int workers, int data_parallel,
                              double sync_s, bool pipelined) {
  sched::ScheduleParams params;
  params.kind = kind;
  params.workers = workers;
  params.microbatches = 4;
  params.num_layers = 4;
  params.data_parallel = data_parallel;
  sim::UniformCosts costs{.forward_s = 1.0, .backward_s = 2.0, .communication_s = 0.05};
  costs.curvature_a_s = costs.curvature_b_s = 0.05;
  costs.invert_a_s = costs.invert_b_s = pipelined ? 0.1 : 0.2;
  costs.precondition_s = 0.02;
  costs.curvature_sync_s = sync_s;
  pipefisher::KfacOptions kfac;
  kfac.linear_dims = linear_dims_of(device_test_config(4));
  kfac.pipelined_refresh = pipelined;
  auto schedule = with_whole_inversions_and_preconditioning(
      pipefisher::run_pipefisher(sched::compile(params), sim::UniformCostModel(costs), kfac)
          .schedule);
  sched::validate(schedule);
  return schedule;
}

void check_against_the_cpu(const sched::Schedule& schedule, std::int64_t steps) {
  const auto cpu = run_threaded(nullptr, schedule, steps);
  const auto staged = run_threaded(std::make_shared<device::HostDeviceRuntime>(), schedule, steps);
  expect_bit_for_bit(staged, cpu, "device path, staged reductions");
  const auto direct = run_through_device_communicators(schedule, steps);
  expect_bit_for_bit(direct, cpu, "device path, device communicators");
  // Every sync piece with a non-empty range went through the asynchronous device all-reduce.
  EXPECT_GE(direct.async_reductions, count_syncs(schedule, false, false));
  expect_replicas_equal(staged, schedule);
  expect_replicas_equal(direct, schedule);
  int refreshes = 0;
  for (const auto& step : cpu.steps) refreshes += step.kfac_refresh ? 1 : 0;
  EXPECT_GE(refreshes, 2);
}

// pipefisher_train --device cuda --kfac --data-parallel 2: 1F1B p = 2 x DP = 2, whole syncs.
TEST(DeviceCurvatureSync, DataParallelEqualsTheCpuPathBitForBit) {
  const auto schedule = kfac_schedule(sched::ScheduleKind::kOneFOneB, 2, 2, 0.05, false);
  ASSERT_GT(count_syncs(schedule, false, false), 0);
  check_against_the_cpu(schedule, 2 * schedule.num_steps + 1);
}

// Chimera's sync between its two pipelines' copies of a stage, cut into pieces by the pass;
// with data parallelism the group spans both replicas' data-parallel groups.
TEST(DeviceCurvatureSync, DividedSyncsEqualTheCpuPathBitForBit) {
  const auto schedule = kfac_schedule(sched::ScheduleKind::kChimera, 4, 1, 1.5, false);
  ASSERT_GT(count_syncs(schedule, true, false), 0);
  check_against_the_cpu(schedule, 2 * schedule.num_steps);
}

TEST(DeviceCurvatureSync, DividedSyncsWithDataParallelEqualTheCpuPathBitForBit) {
  const auto schedule = kfac_schedule(sched::ScheduleKind::kChimera, 4, 2, 1.5, false);
  ASSERT_GT(count_syncs(schedule, true, false), 0);
  check_against_the_cpu(schedule, 2 * schedule.num_steps);
}

// A pipelined refresh whose syncs run on into the next window: the wrapped pieces all-reduce
// the sums set aside at the window's start, which the wrapped inversions then finalize.
TEST(DeviceCurvatureSync, WrappedSyncsOfThePipelinedRefreshEqualTheCpuPathBitForBit) {
  const auto schedule = kfac_schedule(sched::ScheduleKind::kChimera, 4, 1, 3.0, true);
  ASSERT_TRUE(schedule.kfac_pipelined_refresh);
  ASSERT_GT(count_syncs(schedule, true, true), 0);
  check_against_the_cpu(schedule, 2 * schedule.num_steps + 1);
}

// A sync with nothing to sync is refused on the device layer, as on the CPU (a logic error the
// executor turns into a line naming the sync).
TEST(DeviceCurvatureSync, ASyncWithoutSumsIsRefused) {
  device::HostDeviceRuntime runtime;
  const auto layer = runtime.make_kfac_layer(nullptr, 3, 2, "layer 0 query");
  EXPECT_THROW(layer->sync_piece(true, false, 0, kfac::kPieceUnits), std::logic_error);
  EXPECT_THROW(layer->sync_piece(true, true, 0, kfac::kPieceUnits), std::logic_error);
  const std::vector<float> a = {1, 2, 3, 4, 5, 6};  // 2 tokens x 3
  layer->accumulate(true, {a.data(), 2, 3}, 1.0F, 0, kfac::kPieceUnits);
  // Two pieces cover the 3 x 3 sum once, by columns.
  const auto first = layer->sync_piece(true, false, 0, kfac::kPieceUnits / 2);
  const auto second = layer->sync_piece(true, false, kfac::kPieceUnits / 2, kfac::kPieceUnits);
  EXPECT_EQ(first.size() + second.size(), 9U);
  EXPECT_EQ(first.data() + first.size(), second.data());
  layer->set_microbatches(true, false, 4);
  EXPECT_EQ(layer->pending_microbatches(true), 4);
  EXPECT_THROW(layer->sync_piece(true, false, 5, 2), std::invalid_argument);
}

}  // namespace
}  // namespace pf::exec
