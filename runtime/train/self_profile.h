#pragma once
// What the PipeFisher pass needs to place K-FAC work on this machine: measured times of the
// base schedule's instructions (a few steps of a throw-away copy of the model on synthetic
// batches of the run's shapes) and of the K-FAC kernels at the model's Linear sizes.
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "runtime/device/device_runtime.h"
#include "runtime/executor/executor.h"
#include "runtime/train/train_options.h"
#include "sim/measured_cost_model.h"

namespace pf::train {

struct ProfileShape {
  std::int64_t micro_batch_size = 8;
  std::int64_t seq_len = 128;
  std::int64_t max_predictions = 20;
};

// The run's optimizer, so that the profile prices its step (an SGD step costs a fraction of a
// LAMB step: 0.04 against 0.35 s for BERT-mini on one core).
struct ProfileOptimizer {
  exec::OptimizerFactory<float> make;  // empty: SGD
  device::OptimizerChoice device = sgd_choice();

  static device::OptimizerChoice sgd_choice() {
    device::OptimizerChoice choice;
    choice.name = "sgd";
    return choice;
  }
};

// Where the profile's schedule runs. By default on threads of this process. Under mpirun, through
// the launch's executor: one process per rank, each on its own machine (its cores or its GPU),
// so each rank is timed where it will train, its messages and all-reduces cross the real links,
// and no process holds more than its own rank's model. The call is then collective; the root
// process gathers the events, times the K-FAC kernels and returns the profile, the others an
// empty one (the trainer shares the root's).
struct ProfileLaunch {
  std::function<std::unique_ptr<exec::Executor<float>>(exec::RunSetup<float>)> make_executor;
  // Every rank's machine (empty: one machine): compute shares a processor within a machine only.
  std::vector<int> machine_of_rank;
  // Ranks whose compute shares the root's processor, for the K-FAC kernels timed together
  // (0: every rank: threads of one process; under mpirun the root machine's ranks, or 1 with a
  // GPU per rank).
  int ranks_sharing_root_processor = 0;
};

// Runs `steps` steps (the first is warm-up) of `base` and times the K-FAC kernels; the profile
// has chunk entries for every chunk and one K-FAC entry per Linear kind (all layers). On the CPU
// with more than one rank, the workers share this machine's cores: the K-FAC kernels are timed
// alone and on one thread per rank at once, the profile's shared_processor_capacity is what the
// two say the cores give together, and the schedule's measured times become times alone
// (exec::alone_times), so that the simulator shares the capacity as the run does; the profile
// holds one replica's share of it (the capacity over the data-parallel replicas, which run the
// same schedule beside each other), as the simulator runs one replica. With a device
// (--device cuda) both run there: the schedule on the executor's device path (times from its
// stream marks), the K-FAC kernels through the device's K-FAC layers (host time around each call
// and a wait for the stream), one stream per rank at once for the capacity. `shared` not
// measuring (--shared-processor off or C) skips the timing at once and takes its capacity (0:
// none, the measured times as they are).
sim::Profile profile_schedule(const model::BertConfig& config, const sched::Schedule& base,
                              const ProfileShape& shape, const exec::ExecutorOptions& options,
                              int steps = 3,
                              const std::shared_ptr<device::DeviceRuntime>& device = nullptr,
                              const ProfileOptimizer& optimizer = {},
                              const SharedProcessorChoice& shared = {},
                              const ProfileLaunch& launch = {});

// Field by field, the median over rounds of one Linear's K-FAC kernel times (the upper middle of
// an even count; bytes and the Linear from the first round). std::invalid_argument for none.
sim::KfacProfile median_of_rounds(const std::vector<sim::KfacProfile>& rounds);

// The rounds in which the self-profile times the K-FAC kernels alone and then together when it
// measures the shared cores' capacity: the capacity is the median of the rounds' (one round
// whose second thread the machine held back measured 1.09 among 1.76-1.98 on a 2-vCPU EPYC VM,
// and the pass then chose k = 64 where the others chose 7-10).
inline constexpr int kCapacityRounds = 3;

// The host link of K-FAC offload (--kfac-offload). On the CPU (no device): the rate of a memcpy
// between two host buffers of `bytes` (the copies runtime/executor/host_kfac_state.h makes),
// the median of a few, no latency. On a device: measure_device_host_link.
sim::LinkProfile measure_host_copy(std::size_t bytes = std::size_t{16} << 20,
                                   const std::shared_ptr<device::DeviceRuntime>& device = nullptr);
// The device's host link as the executor's device path uses it: copies of `bytes` between the
// runtime's pinned host memory and device memory on a stream, each waited for; the latency is
// a 4 KiB copy's time, the bandwidth the rest of a `bytes` copy's (the slower direction's
// median of five each).
sim::LinkProfile measure_device_host_link(device::DeviceRuntime& device, std::size_t bytes);

}  // namespace pf::train
