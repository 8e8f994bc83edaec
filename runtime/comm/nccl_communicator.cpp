#include "runtime/comm/nccl_communicator.h"

#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include "kernels/cuda/cuda_backend.h"
#include "runtime/comm/p2p_order.h"
#include "runtime/comm/rank_device.h"
#include "runtime/comm/watchdog.h"

namespace pf::comm {

namespace {

[[noreturn]] void throw_nccl_failure(int rank, const char* call, ncclResult_t code,
                                     ncclComm_t comm) {
  std::string text =
      "rank " + std::to_string(rank) + ": " + call + " failed: " + ncclGetErrorString(code);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') text += " (" + std::string(last) + ")";
  throw std::runtime_error(text);
}

[[noreturn]] void throw_cuda_failure(int rank, const char* call, cudaError_t code) {
  throw std::runtime_error("rank " + std::to_string(rank) + ": " + call + " failed: " +
                           cudaGetErrorName(code) + " (" + cudaGetErrorString(code) + ")");
}

}  // namespace

// Every NCCL call goes through this: ncclInProgress is the non-blocking communicators' "issued,
// still settling" (the caller then settles it); anything else but success throws, naming the
// rank, the call, NCCL's error string and its last error text.
#define PF_NCCL_CHECK(rank, handle, call)                                \
  do {                                                                   \
    const ncclResult_t pf_nccl_code = (call);                            \
    if (pf_nccl_code != ncclSuccess && pf_nccl_code != ncclInProgress) { \
      ::pf::comm::throw_nccl_failure(rank, #call, pf_nccl_code, handle); \
    }                                                                    \
  } while (false)

#define PF_NCCL_CUDA_CHECK(rank, call)                                                          \
  do {                                                                                          \
    const cudaError_t pf_cuda_code = (call);                                                    \
    if (pf_cuda_code != cudaSuccess) ::pf::comm::throw_cuda_failure(rank, #call, pf_cuda_code); \
  } while (false)

#define PF_NCCL_MPI_CHECK(rank, call)                                                  \
  do {                                                                                 \
    if ((call) != MPI_SUCCESS) {                                                       \
      throw std::runtime_error("rank " + std::to_string(rank) + ": " #call " failed"); \
    }                                                                                  \
  } while (false)

namespace {

// A CUDA event without timing, shared by the request, the watchdog's completion test and the
// streams that wait on it.
class DoneEvent {
 public:
  explicit DoneEvent(int rank) {
    PF_NCCL_CUDA_CHECK(rank, cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  ~DoneEvent() { cudaEventDestroy(event_); }
  DoneEvent(const DoneEvent&) = delete;
  DoneEvent& operator=(const DoneEvent&) = delete;
  cudaEvent_t get() const { return event_; }
  // Complete, or failed (the waiter then reads the error with status()).
  bool settled() const { return cudaEventQuery(event_) != cudaErrorNotReady; }
  cudaError_t status() const { return cudaEventQuery(event_); }

 private:
  cudaEvent_t event_ = nullptr;
};

// Device memory for staging host data, allocated and freed in the stream's order (freed only
// after the work issued before the free has run).
class StreamScratch {
 public:
  StreamScratch() = default;
  StreamScratch(int rank, std::size_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes > 0) PF_NCCL_CUDA_CHECK(rank, cudaMallocAsync(&data_, bytes, stream));
  }
  ~StreamScratch() {
    if (data_ != nullptr) cudaFreeAsync(data_, stream_);
  }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  void* get() const { return data_; }

 private:
  void* data_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

bool is_device_memory(const void* pointer) {
  if (pointer == nullptr) return false;
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, pointer) != cudaSuccess) {
    cudaGetLastError();  // unregistered host memory on old runtimes: not an error to keep
    return false;
  }
  return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
}

// One issued (or batched) point-to-point operation, shared by its Request and the batch.
struct P2pState {
  P2pOperation operation;
  const void* send_data = nullptr;        // device memory
  void* receive_data = nullptr;           // device memory
  std::byte* host_destination = nullptr;  // a host receive: copied here on completion
  std::unique_ptr<StreamScratch> scratch;
  std::shared_ptr<DoneEvent> done;
  Watchdog::Id id = 0;
  bool issued = false;
  bool finished = false;  // completion seen and the host copy made
};

}  // namespace

struct NcclCommunicator::Impl {
  MpiCommunicator* mpi = nullptr;
  NcclOptions options;
  int rank = 0, size = 1, local_rank = 0, device = 0;
  cudaStream_t stream = nullptr;

  // Every NCCL call on this rank's communicators, and the abort, hold this lock (the watchdog's
  // abort and error probe run on its monitor thread). It is never held across a CUDA call that
  // may wait for the device, so an abort can always take it.
  std::mutex nccl_mutex;
  ncclComm_t world = nullptr;
  std::map<std::vector<int>, ncclComm_t> groups;
  bool aborted = false;

  int activity_position = -1;
  std::string activity_instruction;
  std::atomic<std::int64_t> payload_sent{0};
  bool batching = false;
  std::vector<std::shared_ptr<P2pState>> batch;

  std::unique_ptr<Watchdog> watchdog;

  std::string where() const { return "rank " + std::to_string(rank); }
  OperationDescription describe(std::string operation) const {
    return {rank, activity_position, activity_instruction, std::move(operation)};
  }
  Deadline operation_deadline() const { return Clock::now() + options.operation_timeout; }

  // Frees every communicator of this rank at once (watchdog, abort): stuck kernels return.
  void abort_all(const std::string& /*reason*/) {
    std::lock_guard lock(nccl_mutex);
    if (aborted) return;
    aborted = true;
    for (auto& [members, comm] : groups) ncclCommAbort(comm);
    groups.clear();
    if (world != nullptr) ncclCommAbort(world);
    world = nullptr;
  }

  std::string async_error() {
    std::lock_guard lock(nccl_mutex);
    if (aborted) return {};
    auto probe = [&](ncclComm_t comm, const std::string& which) -> std::string {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t code = ncclCommGetAsyncError(comm, &state);
      if (code != ncclSuccess) state = code;
      if (state == ncclSuccess || state == ncclInProgress) return {};
      std::string text =
          where() + ": ncclCommGetAsyncError(" + which + ") reports: " + ncclGetErrorString(state);
      const char* last = ncclGetLastError(comm);
      if (last != nullptr && last[0] != '\0') text += " (" + std::string(last) + ")";
      return text;
    };
    if (world != nullptr) {
      if (auto text = probe(world, "the world's communicator"); !text.empty()) return text;
    }
    for (auto& [members, comm] : groups) {
      if (auto text = probe(comm, "the communicator of group " + group_to_string(members));
          !text.empty()) {
        return text;
      }
    }
    return {};
  }

  // Throws the watchdog's failure; for a communicator aborted without one (cannot happen:
  // every abort goes through the watchdog) a plain AbortedError.
  void check_usable() {
    watchdog->check();
    std::lock_guard lock(nccl_mutex);
    if (aborted) throw AbortedError(where() + ": the NCCL communicator was aborted");
  }

  // Polls a non-blocking communicator until its last call has settled (ncclSuccess), under
  // `deadline`; the lock is released between polls so that the watchdog can abort.
  void settle(std::unique_lock<std::mutex>& lock, ncclComm_t comm, const std::string& what,
              Deadline deadline) {
    while (true) {
      ncclResult_t state = ncclInProgress;
      PF_NCCL_CHECK(rank, comm, ncclCommGetAsyncError(comm, &state));
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        std::string text = what + " failed: " + ncclGetErrorString(state);
        const char* last = ncclGetLastError(comm);
        if (last != nullptr && last[0] != '\0') text += " (" + std::string(last) + ")";
        lock.unlock();
        watchdog->abort(text);
        watchdog->check();
        throw AbortedError(text);  // not reached: the watchdog has failed
      }
      lock.unlock();
      if (Clock::now() > deadline) {
        const std::string text = what +
                                 ": still in progress on the host at its deadline; the "
                                 "watchdog aborted the communicator";
        watchdog->time_out(text);
        watchdog->check();
        throw TimeoutError(text);  // not reached
      }
      std::this_thread::yield();
      lock.lock();
      if (aborted) {
        lock.unlock();
        watchdog->check();
        throw AbortedError(what + ": the NCCL communicator was aborted");
      }
    }
  }

  // A communicator handle for NCCL calls under `lock`; throws once aborted.
  ncclComm_t usable(std::unique_lock<std::mutex>& lock, ncclComm_t comm) {
    if (aborted || comm == nullptr) {
      lock.unlock();
      watchdog->check();
      throw AbortedError(where() + ": the NCCL communicator was aborted");
    }
    return comm;
  }

  void init_comm(ncclComm_t* comm, int members, const ncclUniqueId& id, int position,
                 const std::string& what, Deadline deadline) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // every call returns at once: the host never hangs inside NCCL
    std::unique_lock lock(nccl_mutex);
    ncclUniqueId copy = id;
    const ncclResult_t code = ncclCommInitRankConfig(comm, members, copy, position, &config);
    if (code != ncclSuccess && code != ncclInProgress) {
      throw_nccl_failure(rank, "ncclCommInitRankConfig", code, *comm);
    }
    settle(lock, *comm, what, deadline);
  }

  // The communicator of `group` (sorted world ranks including this one), created at its first
  // use, collectively by its members.
  ncclComm_t comm_of(std::span<const int> group, const std::string& what, Deadline deadline) {
    std::vector<int> members(group.begin(), group.end());
    if (!std::is_sorted(members.begin(), members.end()) ||
        std::adjacent_find(members.begin(), members.end()) != members.end()) {
      throw std::invalid_argument(what + ": the group " + group_to_string(group) +
                                  " is not in ascending order of distinct ranks");
    }
    if (std::find(members.begin(), members.end(), rank) == members.end()) {
      throw std::invalid_argument(what + ": this rank is not in the group " +
                                  group_to_string(group));
    }
    for (int member : members) {
      if (member < 0 || member >= size) {
        throw std::invalid_argument(what + ": rank " + std::to_string(member) +
                                    " of the group is out of range [0, " + std::to_string(size) +
                                    ")");
      }
    }
    {
      std::unique_lock lock(nccl_mutex);
      if (static_cast<int>(members.size()) == size) return usable(lock, world);
      if (members.size() == 1) return nullptr;  // a group of this rank alone: nothing to do
      if (const auto it = groups.find(members); it != groups.end()) return usable(lock, it->second);
    }
    // New group: its lowest rank creates the id; MPI carries it to the other members.
    ncclUniqueId id{};
    if (members.front() == rank) {
      std::unique_lock lock(nccl_mutex);
      PF_NCCL_CHECK(rank, nullptr, ncclGetUniqueId(&id));
    }
    mpi->broadcast(std::as_writable_bytes(std::span(&id, 1)), members.front(), members, deadline);
    const auto position =
        static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
    ncclComm_t comm = nullptr;
    init_comm(&comm, static_cast<int>(members.size()), id, position,
              what + ": creating the NCCL communicator of group " + group_to_string(group),
              deadline);
    std::unique_lock lock(nccl_mutex);
    if (aborted) {
      ncclCommAbort(comm);
      lock.unlock();
      watchdog->check();
      throw AbortedError(what + ": the NCCL communicator was aborted");
    }
    groups.emplace(members, comm);
    return comm;
  }

  // Registers the work issued on the stream so far with the watchdog; returns its event.
  std::pair<std::shared_ptr<DoneEvent>, Watchdog::Id> watch(const std::string& what,
                                                            Deadline deadline) {
    auto done = std::make_shared<DoneEvent>(rank);
    PF_NCCL_CUDA_CHECK(rank, cudaEventRecord(done->get(), stream));
    const auto id = watchdog->watch(describe(what), deadline, [done] { return done->settled(); });
    return {done, id};
  }

  // Waits on the host for a watched operation; a CUDA error in it throws.
  void wait_done(const DoneEvent& done, Watchdog::Id id, const std::string& what) {
    watchdog->wait(id);
    const cudaError_t status = done.status();
    if (status != cudaSuccess) {
      throw std::runtime_error(where() + ": " + what + " failed on the device: " +
                               cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")");
    }
  }

  // --- point-to-point ---

  void issue(const std::vector<std::shared_ptr<P2pState>>& operations) {
    if (operations.empty()) return;
    std::vector<P2pOperation> plain;
    for (const auto& op : operations) plain.push_back(op->operation);
    check_p2p_batch(plain, rank, size);
    const auto order = p2p_issue_order(plain);
    std::string what = "ncclGroup of " + std::to_string(operations.size()) + ": ";
    for (std::size_t i = 0; i < order.size() && i < 4; ++i) {
      what += (i > 0 ? ", " : "") + to_string(plain[order[i]]);
    }
    if (order.size() > 4) what += ", ...";
    const Deadline deadline = operation_deadline();
    {
      std::unique_lock lock(nccl_mutex);
      const ncclComm_t comm = usable(lock, world);
      PF_NCCL_CHECK(rank, comm, ncclGroupStart());
      for (const std::size_t index : order) {
        const auto& op = *operations[index];
        if (op.operation.send) {
          PF_NCCL_CHECK(rank, comm,
                        ncclSend(op.send_data, op.operation.bytes, ncclUint8, op.operation.peer,
                                 comm, stream));
        } else {
          PF_NCCL_CHECK(rank, comm,
                        ncclRecv(op.receive_data, op.operation.bytes, ncclUint8, op.operation.peer,
                                 comm, stream));
        }
      }
      PF_NCCL_CHECK(rank, comm, ncclGroupEnd());
      settle(lock, comm, to_string(describe(what)), deadline);
    }
    auto [done, id] = watch(what, deadline);
    // One event for the whole group: each request is watched on it (the watchdog retires each
    // id on its own).
    bool first = true;
    for (const auto& op : operations) {
      op->done = done;
      op->id = first
                   ? id
                   : watchdog->watch(describe(what), deadline, [done] { return done->settled(); });
      first = false;
      op->issued = true;
      if (op->operation.send) payload_sent += static_cast<std::int64_t>(op->operation.bytes);
    }
  }

  void flush_batch() {
    auto operations = std::move(batch);
    batch.clear();
    issue(operations);
  }

  void post(const std::shared_ptr<P2pState>& op) {
    if (batching) {
      batch.push_back(op);
    } else {
      issue({op});
    }
  }

  // --- collectives ---

  template <typename V>
  void all_reduce(std::span<V> data, std::span<const int> group, Deadline deadline, bool wait) {
    const std::string what = std::string("ncclAllReduce(sum) of ") + std::to_string(data.size()) +
                             " " + (std::is_same_v<V, float> ? "floats" : "doubles") + " over " +
                             group_to_string(group);
    check_usable();
    if (batching) flush_batch();
    const ncclComm_t comm = comm_of(group, where() + ": " + what, deadline);
    if (comm == nullptr || data.empty()) return;
    const bool on_device = is_device_memory(data.data());
    std::unique_ptr<StreamScratch> scratch;  // host data staged in device memory
    V* buffer = data.data();
    if (!on_device) {
      scratch = std::make_unique<StreamScratch>(rank, data.size_bytes(), stream);
      buffer = static_cast<V*>(scratch->get());
      PF_NCCL_CUDA_CHECK(rank, cudaMemcpyAsync(buffer, data.data(), data.size_bytes(),
                                               cudaMemcpyHostToDevice, stream));
    }
    {
      std::unique_lock lock(nccl_mutex);
      usable(lock, comm);
      PF_NCCL_CHECK(
          rank, comm,
          ncclAllReduce(buffer, buffer, data.size(),
                        std::is_same_v<V, float> ? ncclFloat : ncclDouble, ncclSum, comm, stream));
      settle(lock, comm, to_string(describe(what)), deadline);
    }
    payload_sent += static_cast<std::int64_t>(data.size_bytes());
    auto [done, id] = watch(what, deadline);
    if (!on_device || wait) {
      wait_done(*done, id, what);
      if (!on_device) {
        // The stream has passed the reduction: this copy cannot wait on a stuck kernel.
        PF_NCCL_CUDA_CHECK(rank, cudaMemcpyAsync(data.data(), buffer, data.size_bytes(),
                                                 cudaMemcpyDeviceToHost, stream));
        PF_NCCL_CUDA_CHECK(rank, cudaStreamSynchronize(stream));
      }
    }
  }

  void broadcast(std::span<std::byte> data, int root, std::span<const int> group,
                 Deadline deadline) {
    const std::string what = "ncclBroadcast of " + std::to_string(data.size()) +
                             " bytes from rank " + std::to_string(root) + " over " +
                             group_to_string(group);
    check_usable();
    if (batching) flush_batch();
    const auto root_it = std::find(group.begin(), group.end(), root);
    if (root_it == group.end()) {
      throw std::invalid_argument(where() + ": " + what + ": the root is not in the group");
    }
    const ncclComm_t comm = comm_of(group, where() + ": " + what, deadline);
    if (comm == nullptr || data.empty()) return;
    const int root_position = static_cast<int>(root_it - group.begin());
    const bool on_device = is_device_memory(data.data());
    std::unique_ptr<StreamScratch> scratch;  // host data staged in device memory
    std::byte* buffer = data.data();
    if (!on_device) {
      scratch = std::make_unique<StreamScratch>(rank, data.size(), stream);
      buffer = static_cast<std::byte*>(scratch->get());
      if (root == rank) {
        PF_NCCL_CUDA_CHECK(rank, cudaMemcpyAsync(buffer, data.data(), data.size(),
                                                 cudaMemcpyHostToDevice, stream));
      }
    }
    {
      std::unique_lock lock(nccl_mutex);
      usable(lock, comm);
      PF_NCCL_CHECK(
          rank, comm,
          ncclBroadcast(buffer, buffer, data.size(), ncclUint8, root_position, comm, stream));
      settle(lock, comm, to_string(describe(what)), deadline);
    }
    if (root == rank) {
      payload_sent +=
          static_cast<std::int64_t>(data.size()) * static_cast<std::int64_t>(group.size() - 1);
    }
    auto [done, id] = watch(what, deadline);
    wait_done(*done, id, what);
    if (!on_device && root != rank) {
      PF_NCCL_CUDA_CHECK(
          rank, cudaMemcpyAsync(data.data(), buffer, data.size(), cudaMemcpyDeviceToHost, stream));
      PF_NCCL_CUDA_CHECK(rank, cudaStreamSynchronize(stream));
    }
  }
};

namespace {

class NcclRequest final : public Request {
 public:
  NcclRequest(NcclCommunicator::Impl& impl, std::shared_ptr<P2pState> state)
      : impl_(&impl), state_(std::move(state)) {}
  ~NcclRequest() override {
    // An unfinished operation stays watched (its deadline still guards the job); its staging
    // memory is freed in stream order, after the operation.
  }
  NcclRequest(const NcclRequest&) = delete;
  NcclRequest& operator=(const NcclRequest&) = delete;

  bool test() override {
    issue_if_batched();
    if (state_->finished) return true;
    if (!impl_->watchdog->test(state_->id)) return false;
    finish();
    return true;
  }

  void wait(Deadline /*deadline: the watchdog enforces the one set at issue*/) override {
    issue_if_batched();
    if (state_->finished) return;
    impl_->wait_done(*state_->done, state_->id, to_string(state_->operation));
    finish();
  }

  // The event recorded after the operation (issued first if it is still in a batch).
  cudaEvent_t done_event() {
    issue_if_batched();
    return state_->done->get();
  }

 private:
  void issue_if_batched() {
    if (state_->issued) return;
    impl_->flush_batch();
    if (!state_->issued) {  // its batch failed to issue: report why, or at least what
      impl_->check_usable();
      throw std::runtime_error(impl_->where() + ": " + to_string(state_->operation) +
                               " was never issued (its batch failed)");
    }
  }
  void finish() {
    const cudaError_t status = state_->done->status();
    if (status != cudaSuccess) {
      throw std::runtime_error(impl_->where() + ": " + to_string(state_->operation) +
                               " failed on the device: " + cudaGetErrorName(status));
    }
    if (state_->host_destination != nullptr && state_->operation.bytes > 0) {
      // Complete already: this copy does not wait on the transfer.
      PF_NCCL_CUDA_CHECK(impl_->rank, cudaMemcpy(state_->host_destination, state_->receive_data,
                                                 state_->operation.bytes, cudaMemcpyDeviceToHost));
    }
    state_->finished = true;
  }

  NcclCommunicator::Impl* impl_;
  std::shared_ptr<P2pState> state_;
};

// This rank's index among the ranks of its node.
int node_local_rank(int rank) {
  MPI_Comm node = MPI_COMM_NULL;
  PF_NCCL_MPI_CHECK(
      rank, MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
  int local = 0;
  const int code = MPI_Comm_rank(node, &local);
  MPI_Comm_free(&node);
  if (code != MPI_SUCCESS) {
    throw std::runtime_error("rank " + std::to_string(rank) + ": MPI_Comm_rank(node) failed");
  }
  return local;
}

}  // namespace

NcclCommunicator::NcclCommunicator(MpiCommunicator& mpi, const NcclOptions& options)
    : impl_(std::make_unique<Impl>()) {
  Impl& impl = *impl_;
  impl.mpi = &mpi;
  impl.options = options;
  impl.rank = mpi.rank();
  impl.size = mpi.size();
  const int rank = impl.rank;
  impl.local_rank = node_local_rank(rank);
  // Every rank learns whether all could choose a GPU before any waits on another (a rank
  // without one must not leave the others in the unique id's broadcast); rank 0 reports the
  // first failure.
  std::string choice_error;
  try {
    impl.device = device_for_local_rank(rank, impl.local_rank, kernels::cuda::device_count(),
                                        options.share_devices);
  } catch (const std::invalid_argument& error) {
    choice_error = error.what();
  }
  {
    std::vector<int> world(static_cast<std::size_t>(impl.size));
    std::iota(world.begin(), world.end(), 0);
    const Deadline deadline = impl.operation_deadline();
    std::array<double, 1> failures = {choice_error.empty() ? 0.0 : 1.0};
    mpi.all_reduce_sum(std::span(failures), world, deadline);
    if (failures[0] > 0) {
      const auto texts = mpi.gather_to_root(std::as_bytes(std::span(choice_error)), deadline);
      for (const auto& text : texts) {
        if (!text.empty()) {
          throw std::invalid_argument(
              std::string(reinterpret_cast<const char*>(text.data()), text.size()));
        }
      }
      throw std::invalid_argument(choice_error.empty()
                                      ? "rank " + std::to_string(rank) +
                                            ": another rank could not choose its GPU (rank 0 "
                                            "reports it)"
                                      : choice_error);
    }
  }
  PF_NCCL_CUDA_CHECK(rank, cudaSetDevice(impl.device));
  PF_NCCL_CUDA_CHECK(rank, cudaStreamCreateWithFlags(&impl.stream, cudaStreamNonBlocking));
  impl.watchdog = std::make_unique<Watchdog>(
      [&impl](const std::string& reason) { impl.abort_all(reason); },
      [&impl] { return impl.async_error(); }, Watchdog::Options{options.watchdog_poll});
  try {
    const Deadline deadline = impl.operation_deadline();
    ncclUniqueId id{};
    if (rank == 0) PF_NCCL_CHECK(rank, nullptr, ncclGetUniqueId(&id));
    std::vector<int> world(static_cast<std::size_t>(impl.size));
    std::iota(world.begin(), world.end(), 0);
    mpi.broadcast(std::as_writable_bytes(std::span(&id, 1)), 0, world, deadline);
    ncclComm_t comm = nullptr;
    impl.init_comm(&comm, impl.size, id, rank,
                   impl.where() + ": creating the NCCL world of " + std::to_string(impl.size) +
                       " rank(s) on GPU " + std::to_string(impl.device),
                   deadline);
    std::lock_guard lock(impl.nccl_mutex);
    impl.world = comm;
  } catch (...) {
    impl.watchdog.reset();
    impl.abort_all("construction failed");
    cudaStreamDestroy(impl.stream);
    throw;
  }
}

NcclCommunicator::~NcclCommunicator() {
  Impl& impl = *impl_;
  impl.watchdog.reset();  // joins the monitor: nothing aborts behind our back from here on
  // Healthy communicators are finalized (their work flushed) within a bounded wait, then
  // destroyed; anything stuck or failed is aborted instead (never a hang at exit).
  std::lock_guard lock(impl.nccl_mutex);
  auto close = [&](ncclComm_t comm) {
    if (comm == nullptr) return;
    const ncclResult_t code = ncclCommFinalize(comm);
    ncclResult_t state = code == ncclSuccess || code == ncclInProgress ? ncclInProgress : code;
    const Deadline limit = Clock::now() + std::chrono::seconds(30);
    while (state == ncclInProgress && Clock::now() < limit) {
      if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) state = ncclInternalError;
      if (state == ncclInProgress) std::this_thread::yield();
    }
    if (state == ncclSuccess) {
      ncclCommDestroy(comm);
    } else {
      ncclCommAbort(comm);
    }
  };
  if (!impl.aborted) {
    for (auto& [members, comm] : impl.groups) close(comm);
    close(impl.world);
  }
  impl.groups.clear();
  impl.world = nullptr;
  if (impl.stream != nullptr) cudaStreamDestroy(impl.stream);
}

int NcclCommunicator::rank() const {
  return impl_->rank;
}
int NcclCommunicator::size() const {
  return impl_->size;
}
int NcclCommunicator::device() const {
  return impl_->device;
}
int NcclCommunicator::local_rank() const {
  return impl_->local_rank;
}

std::unique_ptr<Request> NcclCommunicator::isend(int peer, std::int64_t tag,
                                                 std::span<const std::byte> data) {
  Impl& impl = *impl_;
  impl.check_usable();
  auto state = std::make_shared<P2pState>();
  state->operation = {true, peer, tag, data.size()};
  check_p2p_batch(std::span(&state->operation, 1), impl.rank, impl.size);
  state->send_data = data.data();
  if (!data.empty() && !is_device_memory(data.data())) {
    // Host data: staged now (the caller may reuse its buffer once the request completes).
    state->scratch = std::make_unique<StreamScratch>(impl.rank, data.size(), impl.stream);
    PF_NCCL_CUDA_CHECK(impl.rank, cudaMemcpyAsync(state->scratch->get(), data.data(), data.size(),
                                                  cudaMemcpyHostToDevice, impl.stream));
    state->send_data = state->scratch->get();
  }
  impl.post(state);
  return std::make_unique<NcclRequest>(impl, std::move(state));
}

std::unique_ptr<Request> NcclCommunicator::irecv(int peer, std::int64_t tag,
                                                 std::span<std::byte> data) {
  Impl& impl = *impl_;
  impl.check_usable();
  auto state = std::make_shared<P2pState>();
  state->operation = {false, peer, tag, data.size()};
  check_p2p_batch(std::span(&state->operation, 1), impl.rank, impl.size);
  state->receive_data = data.data();
  if (!data.empty() && !is_device_memory(data.data())) {
    state->scratch = std::make_unique<StreamScratch>(impl.rank, data.size(), impl.stream);
    state->receive_data = state->scratch->get();
    state->host_destination = data.data();
  }
  impl.post(state);
  return std::make_unique<NcclRequest>(impl, std::move(state));
}

void NcclCommunicator::begin_batch() {
  if (impl_->batching) {
    throw std::logic_error(impl_->where() + ": NcclCommunicator::begin_batch inside a batch");
  }
  impl_->batching = true;
}

void NcclCommunicator::end_batch() {
  if (!impl_->batching) {
    throw std::logic_error(impl_->where() + ": NcclCommunicator::end_batch without begin_batch");
  }
  impl_->batching = false;
  impl_->flush_batch();
}

void NcclCommunicator::all_reduce_sum(std::span<float> data, std::span<const int> group,
                                      Deadline deadline) {
  impl_->all_reduce(data, group, deadline, true);
}

void NcclCommunicator::all_reduce_sum(std::span<double> data, std::span<const int> group,
                                      Deadline deadline) {
  impl_->all_reduce(data, group, deadline, true);
}

void NcclCommunicator::all_reduce_sum_async(std::span<float> device_data,
                                            std::span<const int> group, Deadline deadline) {
  impl_->all_reduce(device_data, group, deadline, false);
}

void NcclCommunicator::broadcast(std::span<std::byte> data, int root, std::span<const int> group,
                                 Deadline deadline) {
  impl_->broadcast(data, root, group, deadline);
}

namespace {
cudaEvent_t cuda_event_of(const tensor::Event& event, const std::string& where) {
  const auto* cuda = dynamic_cast<const kernels::cuda::CudaEvent*>(&event);
  if (cuda == nullptr) {
    throw std::invalid_argument(where +
                                ": the NCCL communicator orders itself only with CUDA "
                                "events (the executor's device is not CUDA)");
  }
  return cuda->get();
}
cudaStream_t cuda_stream_of(tensor::Stream& stream, const std::string& where) {
  const auto* cuda = dynamic_cast<const kernels::cuda::CudaStream*>(&stream);
  if (cuda == nullptr) {
    throw std::invalid_argument(where +
                                ": the NCCL communicator orders itself only with CUDA "
                                "streams (the executor's device is not CUDA)");
  }
  return cuda->get();
}
}  // namespace

void NcclCommunicator::wait_on_device(const tensor::Event& ready) {
  PF_NCCL_CUDA_CHECK(impl_->rank,
                     cudaStreamWaitEvent(impl_->stream, cuda_event_of(ready, impl_->where()), 0));
}

void NcclCommunicator::order_before(tensor::Stream& stream) {
  Impl& impl = *impl_;
  if (impl.batching) impl.flush_batch();
  DoneEvent done(impl.rank);
  PF_NCCL_CUDA_CHECK(impl.rank, cudaEventRecord(done.get(), impl.stream));
  PF_NCCL_CUDA_CHECK(impl.rank,
                     cudaStreamWaitEvent(cuda_stream_of(stream, impl.where()), done.get(), 0));
}

void NcclCommunicator::order_before(Request& request, tensor::Stream& stream) {
  auto* nccl = dynamic_cast<NcclRequest*>(&request);
  if (nccl == nullptr) {
    throw std::invalid_argument(impl_->where() +
                                ": order_before with a request of another "
                                "communicator");
  }
  PF_NCCL_CUDA_CHECK(impl_->rank, cudaStreamWaitEvent(cuda_stream_of(stream, impl_->where()),
                                                      nccl->done_event(), 0));
}

void NcclCommunicator::set_activity(int position, std::string instruction) {
  impl_->activity_position = position;
  impl_->activity_instruction = std::move(instruction);
}

void NcclCommunicator::abort(const std::string& reason) {
  std::fprintf(stderr, "rank %d: aborting the NCCL communicator and the MPI job: %s\n", impl_->rank,
               reason.c_str());
  std::fflush(stderr);
  impl_->watchdog->abort(reason);  // ncclCommAbort: this rank's kernels stop
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

void NcclCommunicator::abort_local(const std::string& reason) {
  impl_->watchdog->abort(reason);
}

void NcclCommunicator::synchronize() {
  Impl& impl = *impl_;
  impl.check_usable();
  if (impl.batching) impl.flush_batch();
  auto [done, id] =
      impl.watch("synchronize (every operation issued so far)", impl.operation_deadline());
  impl.wait_done(*done, id, "synchronize");
}

std::int64_t NcclCommunicator::payload_bytes_sent() const {
  return impl_->payload_sent.load();
}

}  // namespace pf::comm
