#pragma once
// The communicator for one worker per MPI process (OpenMPI, `mpirun -np N`).
//
// - Point-to-point: MPI_Isend / MPI_Irecv on a private duplicate of MPI_COMM_WORLD, the pair id
//   as the MPI tag (MPI's non-overtaking rule gives the interface's FIFO per (peer, tag)).
// - Progress off the compute path: a progress thread of the communicator polls every
//   outstanding request (MPI_Testsome), so a large message moves while its sender computes;
//   waits block on that thread's completions until their deadline. MPI must therefore provide
//   MPI_THREAD_MULTIPLE (Debian's OpenMPI does); MpiSession checks it at initialisation.
// - Collectives over a group use one MPI communicator per group (MPI_Comm_create_group, made
//   at the group's first collective and cached). Sums are deterministic and bit-identical to
//   InProcessWorld's: each member owns a segment of the vector, receives that segment from every
//   member (MPI_Ialltoallv), adds the contributions in ascending rank order, and the segments
//   are sent back by each owner. MPI_Allreduce / MPI_Iallreduce are not used: their order of
//   additions is unspecified, so their sums would differ from InProcessWorld's in the last bits.
//   Every collective first exchanges (kind, size, root) so that members which disagree get an
//   error naming both sides instead of corrupt data.
// - Non-blocking sums (iall_reduce_sum: data-parallel gradient buckets) are the same two phases
//   as a state machine: phase 1 (headers and parts to their owners) is posted when issued,
//   phase 2 (the owners' sums back) by the rank's own thread inside test() / wait() once phase 1
//   is complete; the progress thread only moves the posted messages. Everything stays on the
//   worker thread, so a group's sequence numbers (the collectives' identities) are taken in
//   program order on every member, and blocking collectives (curvature sync) interleave with
//   buckets in flight. Each (collective, phase) has its own tag (from the group, its sequence
//   number and the phase), so messages of sums in flight together never match each other's
//   receives; phase 2 is still posted in issue order per group.
// - Deadlines: every wait polls until its deadline, then throws TimeoutError naming the rank,
//   the peer or group, and the tag or collective. Creating a group's communicator is the one
//   step without a deadline (MPI offers no non-blocking form); it happens once per group.
// - abort(reason): prints the reason on stderr with the rank, then MPI_Abort(MPI_COMM_WORLD):
//   mpirun ends every rank with an error. (InProcessWorld raises AbortedError in the other
//   threads instead; processes cannot be reached that way, so the job ends as a whole.)
//
// Every MPI call is checked (PF_MPI_CHECK); a failure throws std::runtime_error naming the rank
// and the call.
#include <memory>
#include <string>
#include <vector>

#include "runtime/comm/communicator.h"

namespace pf::comm {

// MPI's lifetime in this process: MPI_Init_thread(MPI_THREAD_MULTIPLE) ... MPI_Finalize. One per
// process, created before and destroyed after every MpiCommunicator. Its start-up collectives
// (the split by machine, the all-gather of every rank's machine) have no deadline, as
// MPI_Init_thread has none: every rank reaches them straight after it, before any work, and
// mpirun ends the job if a rank dies on the way.
class MpiSession {
 public:
  // Throws std::runtime_error when MPI is already initialised or provides less than
  // MPI_THREAD_MULTIPLE (the message says which level it gave and what is needed).
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  int world_rank() const { return rank_; }
  int world_size() const { return size_; }
  // The processes on this process's machine (MPI_COMM_TYPE_SHARED), this one included: all of
  // them when the job runs on one machine.
  int node_size() const { return node_size_; }
  // Every world rank's machine, numbered 0, 1, ... in the order of each machine's lowest rank
  // (rank 0 is on machine 0): all zeros when the job runs on one machine.
  const std::vector<int>& machine_of_rank() const { return machine_of_rank_; }

  // True when this process was started by an MPI launcher (mpirun / mpiexec / srun with PMI):
  // OMPI_COMM_WORLD_SIZE (OpenMPI), PMI_SIZE (MPICH, Slurm) or PMIX_RANK is set.
  static bool launched_by_mpirun();

 private:
  int rank_ = 0;
  int size_ = 1;
  int node_size_ = 1;
  std::vector<int> machine_of_rank_{0};
};

// One rank's communicator over MPI_COMM_WORLD (duplicated: its traffic never meets other
// users'). Constructing and destroying it are collective over the world. Not thread-safe: one
// thread (the worker) calls it; its own progress thread runs inside.
class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(const MpiSession& session);
  ~MpiCommunicator() override;

  int rank() const override;
  int size() const override;

  std::unique_ptr<Request> isend(int peer, std::int64_t tag,
                                 std::span<const std::byte> data) override;
  std::unique_ptr<Request> irecv(int peer, std::int64_t tag, std::span<std::byte> data) override;

  void all_reduce_sum(std::span<float> data, std::span<const int> group,
                      Deadline deadline) override;
  void all_reduce_sum(std::span<double> data, std::span<const int> group,
                      Deadline deadline) override;
  std::unique_ptr<Request> iall_reduce_sum(std::span<float> data, std::span<const int> group,
                                           Deadline deadline) override;
  std::unique_ptr<Request> iall_reduce_sum(std::span<double> data, std::span<const int> group,
                                           Deadline deadline) override;
  void broadcast(std::span<std::byte> data, int root, std::span<const int> group,
                 Deadline deadline) override;

  // Prints "rank R: aborting the MPI job: <reason>" on stderr and calls MPI_Abort; does not
  // return.
  void abort(const std::string& reason) override;
  std::int64_t payload_bytes_sent() const override;

  // Every rank waits for every other (tests and the process runner's start line).
  void barrier(Deadline deadline);
  // Gathers each rank's bytes to rank 0 (others get an empty result), in rank order.
  std::vector<std::vector<std::byte>> gather_to_root(std::span<const std::byte> data,
                                                     Deadline deadline);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace pf::comm
