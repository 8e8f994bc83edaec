// pipefisher's executor on GPUs under mpirun, one GPU per rank over NCCL (MpiExecutor with the
// NCCL communicator as the worker's): the same parameters and losses as the threaded executor
// running every worker on one GPU in this process. `mpirun -np 1` on the lent machine's GPU (the
// NCCL path of one rank: statistics all-reduced over NCCL, device streams, K-FAC); `-np 2` where
// NCCL runs two ranks on one GPU (PF_NCCL_SHARE_GPU=1) or there are two GPUs (activations and
// gradients then move by ncclSend/ncclRecv). Skipped without a CUDA device.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "kernels/cuda/cuda_backend.h"
#include "runtime/comm/nccl_communicator.h"
#include "runtime/executor/mpi_executor.h"
#include "tests/executor/device_run.h"
#include "tests/mpi/mpi_test_env.h"

namespace pf::exec {
namespace {

bool share_gpu() {
  const char* value = std::getenv("PF_NCCL_SHARE_GPU");  // NOLINT(concurrency-mt-unsafe)
  return value != nullptr && std::string(value) == "1";
}

void expect_nccl_run_equals_threads(bool kfac) {
  comm::MpiCommunicator mpi(pf::testing::mpi_session());
  const int gpus = kernels::cuda::device_count();
  if (gpus == 0) GTEST_SKIP() << "no CUDA device";
  if (mpi.size() > gpus && !share_gpu()) {
    GTEST_SKIP() << mpi.size() << " ranks, " << gpus << " GPU(s): set PF_NCCL_SHARE_GPU=1 to try "
                 << "several ranks per GPU";
  }
  comm::NcclOptions options;
  options.operation_timeout = std::chrono::seconds(60);
  options.share_devices = share_gpu();
  comm::NcclCommunicator nccl(mpi, options);
  auto runtime = device::open_device_runtime({tensor::DeviceKind::kCuda, nccl.device()});

  const int layers = 4;
  const auto config = testing::device_test_config(layers);
  const auto schedule =
      testing::device_test_schedule(sched::ScheduleKind::kOneFOneB, mpi.size(), 1, layers, kfac);
  const std::int64_t steps = kfac ? 2 * schedule.num_steps + 1 : 3;

  SyntheticBatches batches(config, 2, 6, 2, 13);
  RunSetup<float> setup;
  setup.config = config;
  setup.schedule = schedule;
  setup.options.init_seed = 7;
  setup.options.dropout_seed = 11;
  setup.options.wait_timeout = std::chrono::seconds(60);
  setup.options.kfac.damping = 1e-2F;
  device::OptimizerChoice choice;
  choice.name = "lamb";
  choice.lamb.max_grad_norm = 0.5;
  setup.make_optimizer = [choice] { return device::make_host_optimizer(choice); };
  setup.device = runtime;
  setup.device_optimizer = choice;
  setup.learning_rate = [](std::int64_t step) {
    return 1e-2 * (1.0 + 0.5 * static_cast<double>(step));
  };
  setup.batches = &batches;
  std::vector<StepResult> results;
  {
    MpiExecutor<float> executor(setup, mpi, &nccl);
    executor.run(0, steps, [&](const StepResult& r) { results.push_back(r); });
    EXPECT_GT(nccl.payload_bytes_sent(), 0);  // the step statistics went over NCCL at least
    const auto reference = testing::run_schedule(runtime, config, schedule, "lamb", steps, false);
    runtime->backend().synchronize();
    double worst = 0.0;
    for (auto* chunk : executor.worker().chunks()) {
      for (const auto& p : chunk->parameters()) {
        const auto it = reference.values.find(p.name);
        if (it == reference.values.end()) continue;  // the tied copy
        std::vector<float> mine(static_cast<std::size_t>(p.size));
        runtime->backend().copy(mine.data(), p.value, mine.size() * sizeof(float),
                                tensor::CopyKind::kDeviceToHost);
        runtime->backend().synchronize();
        double scale = 1e-3, diff = 0.0;
        for (std::size_t i = 0; i < mine.size(); ++i) {
          scale = std::max(scale, std::abs(double{it->second[i]}));
          diff = std::max(diff, std::abs(double{mine[i]} - it->second[i]));
        }
        worst = std::max(worst, diff / scale);
      }
    }
    // Sums over one or two ranks are exact on NCCL too; the tolerance only covers the GPU's
    // own run-to-run differences (atomics in reductions), as the device tests allow.
    EXPECT_LT(worst, 1e-5) << "rank " << mpi.rank();
    if (mpi.rank() == 0) {
      ASSERT_EQ(results.size(), reference.steps.size());
      for (std::size_t s = 0; s < results.size(); ++s) {
        EXPECT_NEAR(results[s].loss(), reference.steps[s].loss(),
                    1e-5 * std::abs(reference.steps[s].loss()))
            << "step " << s;
      }
    }
  }
  mpi.barrier(comm::Clock::now() + std::chrono::seconds(60));
}

TEST(NcclExecutor, OneF1BEqualsThreadsOnOneGpu) {
  expect_nccl_run_equals_threads(false);
}

TEST(NcclExecutor, KfacInTheBubblesEqualsThreadsOnOneGpu) {
  expect_nccl_run_equals_threads(true);
}

}  // namespace
}  // namespace pf::exec
