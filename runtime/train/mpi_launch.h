#pragma once
// pipefisher_train under MPI: `mpirun -np N pipefisher_train ...` starts N processes; each
// parses the same options, compiles the same schedule and runs one rank (MpiExecutor:
// rank = replica x workers + worker, N = stages x data-parallel). The program knows it runs
// under MPI from the launcher's environment (MpiSession::launched_by_mpirun: OpenMPI's
// OMPI_COMM_WORLD_SIZE, or PMI_SIZE / PMIX_RANK); started directly, it runs threads as before.
//
// Only rank 0 prints progress and the summary and writes metrics, the trace (every rank's
// events, one process per rank) and the profile. A K-FAC self-profile is measured by rank 0 and
// broadcast, so that every process places K-FAC identically. Checkpoints are written
// collectively (each process its part, rank 0 the manifest: checkpointing.h, save_checkpoint).
#include "runtime/comm/mpi_communicator.h"
#include "runtime/train/trainer.h"

namespace pf::train {

class MpiLaunch final : public Launch {
 public:
  explicit MpiLaunch(comm::MpiCommunicator& comm) : comm_(&comm) {}

  bool is_root() const override { return comm_->rank() == 0; }
  bool multi_process() const override { return true; }
  std::unique_ptr<exec::Executor<float>> make_executor(exec::RunSetup<float> setup) override;
  std::unique_ptr<exec::Executor<double>> make_executor(exec::RunSetup<double> setup) override;
  std::string share_from_root(const std::string& text, std::chrono::milliseconds wait) override;
  std::string workers_noun() const override { return "MPI process(es)"; }

 private:
  comm::MpiCommunicator* comm_;
};

}  // namespace pf::train
