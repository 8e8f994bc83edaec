#include "runtime/executor/mpi_executor.h"

#include <cstdio>
#include <cstring>
#include <numeric>
#include <sstream>

#include "scheduler/grid.h"
#include "scheduler/validate.h"

namespace pf::exec {

std::string mpi_layout_error(int processes, int workers, int replicas) {
  return "mpirun started " + std::to_string(processes) + " process(es), the schedule needs " +
         std::to_string(workers) + " pipeline worker(s) x " + std::to_string(replicas) +
         " data-parallel replica(s) = " + std::to_string(workers * replicas) + " (one per rank, " +
         "rank = replica x " + std::to_string(workers) + " + worker): run mpirun -np " +
         std::to_string(workers * replicas);
}

namespace {

// An event on the wire: its instruction is the stream's at `position` (rank gives the stream).
struct WireEvent {
  std::int64_t global_step = 0;
  std::int64_t bytes = 0;
  std::int64_t stash_bytes = 0;
  double start_s = 0.0, end_s = 0.0, busy_s = 0.0;
  std::int32_t position = 0;
  std::int32_t lane = 0;
  std::int32_t bucket = -1;
  std::int32_t padding = 0;
};

}  // namespace

template <typename T>
struct MpiExecutor<T>::Impl {
  RunSetup<T> setup;
  comm::MpiCommunicator* comm = nullptr;
  comm::Communicator* worker_comm = nullptr;  // the worker's (NCCL on a device), or comm
  std::unique_ptr<Worker<T>> worker;

  comm::Deadline deadline() const { return comm::Clock::now() + setup.options.wait_timeout; }
};

template <typename T>
MpiExecutor<T>::MpiExecutor(RunSetup<T> setup, comm::MpiCommunicator& comm,
                            comm::Communicator* worker_comm)
    : impl_(std::make_unique<Impl>()) {
  check_run_setup(setup.config, setup.schedule);
  sched::validate(setup.schedule);
  if (setup.batches == nullptr) throw std::invalid_argument("executor: no batch source");
  if (!setup.learning_rate) throw std::invalid_argument("executor: no learning-rate schedule");
  const int workers = setup.schedule.num_workers();
  const int replicas = setup.schedule.params.data_parallel;
  if (comm.size() != workers * replicas) {
    throw std::invalid_argument(mpi_layout_error(comm.size(), workers, replicas));
  }
  if (worker_comm != nullptr &&
      (worker_comm->size() != comm.size() || worker_comm->rank() != comm.rank())) {
    throw std::invalid_argument(
        "executor: the worker's communicator (rank " + std::to_string(worker_comm->rank()) +
        " of " + std::to_string(worker_comm->size()) + ") is not the MPI world's (rank " +
        std::to_string(comm.rank()) + " of " + std::to_string(comm.size()) + ")");
  }
  impl_->setup = std::move(setup);
  impl_->comm = &comm;
  impl_->worker_comm = worker_comm != nullptr ? worker_comm : &comm;
  // Every worker's clock starts at its construction: a barrier first aligns the ranks' traces.
  comm.barrier(impl_->deadline());
  impl_->worker = std::make_unique<Worker<T>>(impl_->setup, *impl_->worker_comm);
}

template <typename T>
MpiExecutor<T>::~MpiExecutor() = default;

template <typename T>
int MpiExecutor<T>::num_ranks() const {
  return impl_->comm->size();
}
template <typename T>
const RunSetup<T>& MpiExecutor<T>::setup() const {
  return impl_->setup;
}
template <typename T>
bool MpiExecutor<T>::is_root() const {
  return impl_->comm->rank() == 0;
}
template <typename T>
Worker<T>& MpiExecutor<T>::worker() {
  return *impl_->worker;
}

template <typename T>
void MpiExecutor<T>::run(std::int64_t first_step, std::int64_t last_step,
                         const std::function<void(const StepResult&)>& on_step) {
  if (first_step < 0 || last_step < first_step) {
    throw std::invalid_argument("executor: bad step range [" + std::to_string(first_step) + ", " +
                                std::to_string(last_step) + ")");
  }
  const int rank = impl_->comm->rank();
  on_this_worker([&] {
    impl_->worker->run(first_step, last_step,
                       rank == 0 ? on_step : std::function<void(const StepResult&)>{});
  });
}

template <typename T>
void MpiExecutor<T>::finish_refresh(std::int64_t step) {
  on_this_worker([&] { impl_->worker->finish_refresh(step); });
}

template <typename T>
void MpiExecutor<T>::on_this_worker(const std::function<void()>& body) {
  const int rank = impl_->comm->rank();
  std::string message;
  int failed_position = -1;
  try {
    body();
    return;
  } catch (const WorkerError& error) {
    message = error.what();
    failed_position = error.position();
  } catch (const std::exception& error) {
    message = "rank " + std::to_string(rank) + ": " + error.what();
  }
  std::ostringstream report;
  report << "training failed: " << message << "\nrecent instructions of rank " << rank
         << " (newest last):\n"
         << impl_->worker->history();
  if (failed_position >= 0) {
    const int worker = rank % impl_->setup.schedule.num_workers();
    report << "schedule around the failed instruction (worker " << worker << ", position "
           << failed_position << "):\n"
           << sched::render_grid_around(impl_->setup.schedule, worker, failed_position);
  }
  std::fprintf(stderr, "%s", report.str().c_str());
  std::fflush(stderr);
  // NCCL's abort frees this rank's communicators (ncclCommAbort) before ending the job.
  impl_->worker_comm->abort("rank " + std::to_string(rank) + " failed (its report is above)");
}

template <typename T>
std::vector<InstructionEvent> MpiExecutor<T>::take_events() {
  const auto mine = impl_->worker->take_events();
  std::vector<WireEvent> wire(mine.size());
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const auto& e = mine[i];
    wire[i] = {e.global_step,
               e.bytes,
               e.stash_bytes,
               e.start_s,
               e.end_s,
               e.busy_s,
               static_cast<std::int32_t>(e.position),
               static_cast<std::int32_t>(e.lane),
               static_cast<std::int32_t>(e.bucket),
               0};
  }
  const auto gathered =
      impl_->comm->gather_to_root(std::as_bytes(std::span(wire)), impl_->deadline());
  std::vector<InstructionEvent> all;
  const auto& schedule = impl_->setup.schedule;
  for (std::size_t r = 0; r < gathered.size(); ++r) {
    const auto& bytes = gathered[r];
    const std::size_t count = bytes.size() / sizeof(WireEvent);
    const auto& stream = schedule.streams[r % static_cast<std::size_t>(schedule.num_workers())];
    for (std::size_t i = 0; i < count; ++i) {
      WireEvent w;
      std::memcpy(&w, bytes.data() + i * sizeof(WireEvent), sizeof(WireEvent));
      InstructionEvent e;
      e.rank = static_cast<int>(r);
      e.position = w.position;
      e.global_step = w.global_step;
      e.instruction = stream.at(static_cast<std::size_t>(w.position));
      e.lane = static_cast<Lane>(w.lane);
      e.start_s = w.start_s;
      e.end_s = w.end_s;
      e.busy_s = w.busy_s;
      e.bytes = w.bytes;
      e.bucket = w.bucket;
      e.stash_bytes = w.stash_bytes;
      all.push_back(e);
    }
  }
  return all;
}

template <typename T>
std::vector<RankKfacState> MpiExecutor<T>::kfac_state_per_rank() {
  const RankKfacState mine{impl_->worker->kfac_state_bytes(), impl_->worker->kfac_bytes_sent(),
                           impl_->worker->kfac_host_bytes(),
                           impl_->worker->kfac_peak_resident_bytes()};
  const auto gathered = impl_->comm->gather_to_root(
      std::as_bytes(std::span<const RankKfacState>(&mine, 1)), impl_->deadline());
  std::vector<RankKfacState> all;
  for (const auto& bytes : gathered) {
    RankKfacState state;
    if (bytes.size() != sizeof state) {
      throw std::runtime_error("K-FAC state gather: a rank sent " + std::to_string(bytes.size()) +
                               " bytes, expected " + std::to_string(sizeof state));
    }
    std::memcpy(&state, bytes.data(), sizeof state);
    all.push_back(state);
  }
  return all;
}

template <typename T>
std::vector<std::string> MpiExecutor<T>::gather_to_root(const std::string& text) {
  const auto gathered = impl_->comm->gather_to_root(
      std::as_bytes(std::span(text.data(), text.size())), impl_->deadline());
  std::vector<std::string> all;
  all.reserve(gathered.size());
  for (const auto& bytes : gathered) {
    all.emplace_back(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }
  return all;
}

template <typename T>
std::string MpiExecutor<T>::broadcast_from_root(const std::string& text) {
  std::vector<int> world(static_cast<std::size_t>(impl_->comm->size()));
  std::iota(world.begin(), world.end(), 0);
  const auto deadline = impl_->deadline();
  const bool root = impl_->comm->rank() == 0;
  std::uint64_t length = root ? text.size() : 0;
  impl_->comm->broadcast(std::as_writable_bytes(std::span(&length, 1)), 0, world, deadline);
  std::string shared = root ? text : std::string(length, '\0');
  impl_->comm->broadcast(std::as_writable_bytes(std::span(shared.data(), shared.size())), 0, world,
                         deadline);
  return shared;
}

template class MpiExecutor<float>;
template class MpiExecutor<double>;

}  // namespace pf::exec
