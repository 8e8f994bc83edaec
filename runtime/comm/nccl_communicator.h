#pragma once
// The communicator for one GPU per MPI process (`mpirun -np N`, NCCL). Built where NCCL is
// found (CMake: PF_HAVE_NCCL); the header names no CUDA or NCCL type.
//
// - Bootstrap: the MPI ranks form the NCCL world. Each rank drives the GPU of its local rank
//   (MPI_Comm_split_type shared, rank_device.h); rank 0 creates the unique id and broadcasts it
//   over MPI; ncclCommInitRankConfig in non-blocking mode (config.blocking = 0), so no NCCL call
//   ever blocks the host: each returns at once and the communicator polls
//   ncclCommGetAsyncError until the call has settled, under the operation's deadline.
// - Point-to-point: ncclSend / ncclRecv on the communicator's own CUDA stream. NCCL has no
//   tags: messages between two ranks match in issue order, which the schedule's pair ids fix
//   (p2p_order.h). Each isend/irecv is issued at once as a group of one; between begin_batch()
//   and end_batch() they are collected and issued as one group (ncclGroupStart/End) in
//   ascending pair id, so matching pairs never deadlock and all progress together.
// - Collectives over a group (sorted world ranks): the world's communicator for the whole
//   world; any other group gets its own NCCL communicator, created lazily at the group's first
//   collective, collectively by its members only (the group's lowest rank creates a unique id
//   and broadcasts it over MPI to the members). ncclCommSplit is not used: it is collective
//   over the parent, and ranks outside a group never call its collectives.
// - Sums: ncclAllReduce(ncclSum). NCCL fixes no reduction order (ring or tree, chosen by size
//   and topology), so unlike InProcessWorld and MpiCommunicator the members' bits may differ
//   from a sequential sum in ascending rank order. Equivalence on NCCL therefore means: within
//   a few ulps of the reference sum (a relative tolerance), while every member still receives
//   the same result as the others (NCCL broadcasts the reduced values); with one or two ranks
//   the sum is exact (x or x0 + x1).
// - Ordering with compute (DeviceCommunicator): producers' events gate the communicator's
//   stream, consumers wait on events recorded after the operations; blocking calls
//   (Request::wait, all_reduce_sum, broadcast) wait on the host for the operation's event.
// - Memory: device pointers are used in place; host memory (detected with
//   cudaPointerGetAttributes) is staged through device memory on the stream (stream-ordered
//   cudaMallocAsync / cudaFreeAsync), so the executor's host-side statistics work unchanged.
// - Watchdog (watchdog.h): every operation is registered with its rank, stream position and
//   instruction (set_activity) and a deadline (Options::operation_timeout from its issue). When
//   one passes its deadline, or ncclCommGetAsyncError reports an error, the watchdog calls
//   ncclCommAbort on every communicator of this rank (stuck kernels return) and every wait,
//   test or call from then on throws that error; the executor's MPI launch then ends the job.
// - abort(reason): aborts this rank's NCCL communicators, then the MPI job (MPI_Abort), so
//   every rank exits.
//
// Every NCCL call is checked (PF_NCCL_CHECK): a failure throws std::runtime_error naming the
// rank, the call, ncclGetErrorString and NCCL's last error text; every CUDA call likewise.
#include <chrono>
#include <memory>
#include <string>

#include "runtime/comm/device_communicator.h"
#include "runtime/comm/mpi_communicator.h"

namespace pf::comm {

struct NcclOptions {
  // Every operation's deadline, from its issue (the executor's wait timeout).
  std::chrono::milliseconds operation_timeout = std::chrono::minutes(10);
  // Allow more ranks than GPUs on a node (local rank mod GPUs); NCCL may refuse ("Duplicate GPU
  // detected"): for the experiment that asks whether it does.
  bool share_devices = false;
  std::chrono::microseconds watchdog_poll = std::chrono::milliseconds(1);
};

class NcclCommunicator final : public DeviceCommunicator {
 public:
  // Collective over the MPI world: chooses and sets this rank's GPU, creates the NCCL world.
  // Throws std::runtime_error (or TimeoutError at the deadline) naming the rank and the call.
  NcclCommunicator(MpiCommunicator& mpi, const NcclOptions& options = {});
  ~NcclCommunicator() override;

  int rank() const override;
  int size() const override;
  int device() const;  // the CUDA device this rank drives
  int local_rank() const;

  std::unique_ptr<Request> isend(int peer, std::int64_t tag,
                                 std::span<const std::byte> data) override;
  std::unique_ptr<Request> irecv(int peer, std::int64_t tag, std::span<std::byte> data) override;
  // Collect the following isend/irecv and issue them as one NCCL group in ascending pair id at
  // end_batch (a wait or test on one of them issues the batch early). Not nested.
  void begin_batch();
  void end_batch();

  void all_reduce_sum(std::span<float> data, std::span<const int> group,
                      Deadline deadline) override;
  void all_reduce_sum(std::span<double> data, std::span<const int> group,
                      Deadline deadline) override;
  void broadcast(std::span<std::byte> data, int root, std::span<const int> group,
                 Deadline deadline) override;

  void wait_on_device(const tensor::Event& ready) override;
  void order_before(tensor::Stream& stream) override;
  void order_before(Request& request, tensor::Stream& stream) override;
  void all_reduce_sum_async(std::span<float> device_data, std::span<const int> group,
                            Deadline deadline) override;
  void set_activity(int position, std::string instruction) override;

  // Aborts this rank's NCCL communicators and then the MPI job; does not return.
  void abort(const std::string& reason) override;
  // Fails this rank's communicator as the watchdog does (ncclCommAbort; every later call
  // throws AbortedError(reason)) but leaves the process running: the one-rank abort test.
  void abort_local(const std::string& reason);
  // Blocks until every operation issued so far has completed (or throws the watchdog's error).
  void synchronize();
  std::int64_t payload_bytes_sent() const override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace pf::comm
