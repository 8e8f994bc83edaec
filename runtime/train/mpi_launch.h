#pragma once
// pipefisher_train under MPI: `mpirun -np N pipefisher_train ...` starts N processes; each
// parses the same options, compiles the same schedule and runs one rank (MpiExecutor:
// rank = replica x workers + worker, N = stages x data-parallel). The program knows it runs
// under MPI from the launcher's environment (MpiSession::launched_by_mpirun: OpenMPI's
// OMPI_COMM_WORLD_SIZE, or PMI_SIZE / PMIX_RANK); started directly, it runs threads as before.
//
// Only rank 0 prints progress and the summary and writes metrics, the trace (every rank's
// events, one process per rank) and the profile. A K-FAC self-profile runs each rank in its own
// process (train::ProfileLaunch); rank 0 gathers it, times the K-FAC kernels and broadcasts the
// profile, so that every process places K-FAC identically. Checkpoints are written
// collectively (each process its part, rank 0 the manifest: checkpointing.h, save_checkpoint).
//
// --device cuda under mpirun: one GPU per rank, the GPU of the rank's local rank (mpirun -np 8
// on a node of 8 GPUs gives GPU i to local rank i), and the worker communicates through the
// NCCL communicator (runtime/comm/nccl_communicator.h): activations and gradients move between
// GPUs on its stream, ordered with the worker's streams by events, and gradient reductions are
// NCCL all-reduces on device memory. The MPI communicator keeps the launch's own traffic (the
// shared self-profile, gathered events, the start barrier). Builds without NCCL refuse
// --device cuda under mpirun with one error line (exit 2). The NCCL communicator is created at
// place_device, collectively, before the device runtime opens.
#include <memory>
#include <vector>

#include "runtime/comm/mpi_communicator.h"
#include "runtime/train/trainer.h"

namespace pf::train {

class MpiLaunch final : public Launch {
 public:
  // machine_of_rank: every rank's machine (MpiSession::machine_of_rank()).
  MpiLaunch(comm::MpiCommunicator& comm, std::vector<int> machine_of_rank);
  ~MpiLaunch() override;

  bool is_root() const override { return comm_->rank() == 0; }
  bool multi_process() const override { return true; }
  std::unique_ptr<exec::Executor<float>> make_executor(exec::RunSetup<float> setup) override;
  std::unique_ptr<exec::Executor<double>> make_executor(exec::RunSetup<double> setup) override;
  std::string share_from_root(const std::string& text, std::chrono::milliseconds wait) override;
  std::string workers_noun() const override { return "MPI process(es)"; }
  std::vector<int> machine_of_rank() const override { return machine_of_rank_; }
  tensor::Device place_device(tensor::Device requested,
                              std::chrono::milliseconds wait_timeout) override;

 private:
  comm::MpiCommunicator* comm_;
  std::vector<int> machine_of_rank_;
  // A device run's worker communicator (NCCL), held by its base so that builds without NCCL
  // never need its definition, and the GPU it chose.
  std::unique_ptr<comm::Communicator> nccl_;
  int nccl_device_ = -1;
};

}  // namespace pf::train
