#include "runtime/train/mpi_launch.h"

#include <cstdint>
#include <numeric>
#include <vector>

#include "runtime/executor/mpi_executor.h"

namespace pf::train {

std::unique_ptr<exec::Executor<float>> MpiLaunch::make_executor(exec::RunSetup<float> setup) {
  return std::make_unique<exec::MpiExecutor<float>>(std::move(setup), *comm_);
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
