#pragma once
// pipefisher_train's run: data, model, schedule (with K-FAC placed by the PipeFisher pass when
// asked), the executor, progress, metrics, checkpoints, the measured trace and profile.
#include <chrono>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "runtime/executor/executor.h"
#include "runtime/train/train_options.h"

namespace pf::train {

// Where the run's ranks live. This default: worker threads of this process (ThreadedExecutor).
// mpi_launch.h: one MPI process per rank, every process running run_training alike.
class Launch {
 public:
  virtual ~Launch() = default;
  Launch() = default;
  Launch(const Launch&) = delete;
  Launch& operator=(const Launch&) = delete;

  virtual bool is_root() const { return true; }  // prints, writes metrics, traces, profiles
  virtual bool multi_process() const { return false; }
  virtual std::unique_ptr<exec::Executor<float>> make_executor(exec::RunSetup<float> setup);
  virtual std::unique_ptr<exec::Executor<double>> make_executor(exec::RunSetup<double> setup);
  // The root's text on every process (the self-profile: every rank must compile one schedule).
  virtual std::string share_from_root(const std::string& text, std::chrono::milliseconds) {
    return text;
  }
  virtual std::string workers_noun() const { return "worker thread(s)"; }
  // Every rank's machine (rank = replica * workers + worker), for the shared processors: ranks
  // on one machine share its cores. Empty: every rank on this machine (threads).
  virtual std::vector<int> machine_of_rank() const { return {}; }
  // The device this process drives for `--device requested`: threads share the requested one;
  // under MPI each rank drives the GPU of its local rank over NCCL (mpi_launch.h). Throws
  // device::DeviceUnavailableError (exit 2) when the launch cannot.
  virtual tensor::Device place_device(tensor::Device requested,
                                      std::chrono::milliseconds /*wait_timeout*/) {
    return requested;
  }
};

// Returns the process exit code (0). Throws std::invalid_argument for bad input found before
// training starts (exit 2 in main), std::runtime_error for failures during it.
int run_training(const TrainOptions& options, std::ostream& out);
int run_training(const TrainOptions& options, std::ostream& out, Launch& launch);

}  // namespace pf::train
