#include "runtime/train/mpi_launch.h"

#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include "runtime/device/device_runtime.h"
#include "runtime/executor/mpi_executor.h"
#if PF_HAVE_NCCL
#include "runtime/comm/nccl_communicator.h"
#endif

namespace pf::train {

MpiLaunch::MpiLaunch(comm::MpiCommunicator& comm, std::vector<int> machine_of_rank)
    : comm_(&comm), machine_of_rank_(std::move(machine_of_rank)) {}
MpiLaunch::~MpiLaunch() = default;

tensor::Device MpiLaunch::place_device(tensor::Device requested,
                                       std::chrono::milliseconds wait_timeout) {
  if (requested.kind == tensor::DeviceKind::kCpu) return requested;
  const std::string name = tensor::to_string(requested);
  if (requested.index != 0) {
    throw device::DeviceUnavailableError(
        "--device " + name +
        " under mpirun: each rank drives the GPU of its local rank; pass "
        "--device cuda");
  }
#if PF_HAVE_NCCL
  if (!nccl_) {
    comm::NcclOptions options;
    options.operation_timeout = wait_timeout;
    try {
      auto nccl = std::make_unique<comm::NcclCommunicator>(*comm_, options);
      nccl_device_ = nccl->device();
      nccl_ = std::move(nccl);
    } catch (const std::invalid_argument& error) {  // no GPU for some rank: bad input, exit 2
      throw device::DeviceUnavailableError("--device " + name + " under mpirun: " + error.what());
    }
  }
  return {requested.kind, nccl_device_};
#else
  (void)wait_timeout;
  throw device::DeviceUnavailableError(
      "--device " + name +
      " under mpirun: this build has no NCCL (one GPU per rank needs it; "
      "run without mpirun for workers on one GPU)");
#endif
}

std::unique_ptr<exec::Executor<float>> MpiLaunch::make_executor(exec::RunSetup<float> setup) {
  comm::Communicator* worker_comm = nullptr;
#if PF_HAVE_NCCL
  if (setup.device) worker_comm = nccl_.get();
#endif
  return std::make_unique<exec::MpiExecutor<float>>(std::move(setup), *comm_, worker_comm);
}
std::unique_ptr<exec::Executor<double>> MpiLaunch::make_executor(exec::RunSetup<double> setup) {
  return std::make_unique<exec::MpiExecutor<double>>(std::move(setup), *comm_);
}

std::string MpiLaunch::share_from_root(const std::string& text, std::chrono::milliseconds wait) {
  std::vector<int> world(static_cast<std::size_t>(comm_->size()));
  std::iota(world.begin(), world.end(), 0);
  const auto deadline = comm::Clock::now() + wait;
  std::uint64_t length = is_root() ? text.size() : 0;
  comm_->broadcast(std::as_writable_bytes(std::span(&length, 1)), 0, world, deadline);
  std::string shared = is_root() ? text : std::string(length, '\0');
  comm_->broadcast(std::as_writable_bytes(std::span(shared.data(), shared.size())), 0, world,
                   deadline);
  return shared;
}

}  // namespace pf::train
