#pragma once
// One Worker per MPI process: `mpirun -np N` starts N copies of the program, each builds the
// same RunSetup and an MpiExecutor, which runs this process's rank.
//
// Ranks (the executor's order, see executor.h): rank = replica * workers + worker, so a
// replica's pipeline neighbours are adjacent MPI ranks, which mpirun's default by-slot mapping
// places on the same node first. N must equal workers x data-parallel replicas.
//
// Only the root process (rank 0) gets on_step, and take_events() gathers every rank's events
// there (aligned by a barrier right before the workers start), for one Chrome trace with a
// process per rank. A rank that fails prints its error, its recent instructions and the schedule
// around the failed instruction on stderr, then aborts the MPI job (MPI_Abort): every rank ends
// with an error at once, never waiting out its deadline.
#include <memory>

#include "runtime/comm/mpi_communicator.h"
#include "runtime/executor/executor.h"

namespace pf::exec {

template <typename T>
class MpiExecutor final : public Executor<T> {
 public:
  // Collective over the world. Validates as ThreadedExecutor does; throws std::invalid_argument
  // (on every rank alike, nothing started) when the process count is not workers x replicas.
  // `worker_comm` (optional, same world): what the worker's instructions communicate through,
  // e.g. the NCCL communicator of a device run; `comm` keeps the launch's own traffic (the
  // start barrier, gathered events) and the job's abort.
  MpiExecutor(RunSetup<T> setup, comm::MpiCommunicator& comm,
              comm::Communicator* worker_comm = nullptr);
  ~MpiExecutor() override;

  int num_ranks() const override;
  const RunSetup<T>& setup() const override;
  bool is_root() const override;
  Worker<T>& worker();  // this process's rank

  // Collective. A failure on any rank ends the job (see above): it returns only on success.
  void run(std::int64_t first_step, std::int64_t last_step,
           const std::function<void(const StepResult&)>& on_step) override;
  // Collective, failing as run() does.
  void finish_refresh(std::int64_t step) override;
  // Collective: every rank's events in the root process, empty elsewhere.
  std::vector<InstructionEvent> take_events() override;
  // Collective: every rank's K-FAC state in the root process, empty elsewhere.
  std::vector<RankKfacState> kfac_state_per_rank() override;
  std::vector<Worker<T>*> local_workers() override { return {&worker()}; }
  // Collective: every rank's text in the root process (empty elsewhere).
  std::vector<std::string> gather_to_root(const std::string& text) override;
  // Collective: rank 0's text in every process.
  std::string broadcast_from_root(const std::string& text) override;

 private:
  // `body` on this process's rank; a failure is reported on stderr with the rank's history and
  // ends the job (the communicator's abort), as run() says.
  void on_this_worker(const std::function<void()>& body);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The error for a process count that does not fit the schedule (what every rank throws).
std::string mpi_layout_error(int processes, int workers, int replicas);

extern template class MpiExecutor<float>;
extern template class MpiExecutor<double>;

}  // namespace pf::exec
