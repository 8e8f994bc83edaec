#include "sim/machine_processors.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>

namespace pf::sim {

SharedProcessors processors_by_machine(const std::vector<int>& machine_of_rank, int workers,
                                       double machine_capacity) {
  const auto ranks = static_cast<int>(machine_of_rank.size());
  if (workers < 1 || ranks < workers || ranks % workers != 0) {
    throw std::invalid_argument("shared processors by machine: " + std::to_string(ranks) +
                                " ranks are not a whole number of replicas of " +
                                std::to_string(workers) + " worker(s)");
  }
  if (!std::isfinite(machine_capacity) || machine_capacity <= 0.0) {
    throw std::invalid_argument("shared processors by machine: capacity " +
                                std::to_string(machine_capacity) + " (must be finite and > 0)");
  }
  std::map<int, int> ranks_on;  // machine -> its ranks
  for (int rank = 0; rank < ranks; ++rank) {
    const int machine = machine_of_rank[static_cast<std::size_t>(rank)];
    if (machine < 0) {
      throw std::invalid_argument("shared processors by machine: rank " + std::to_string(rank) +
                                  " on machine " + std::to_string(machine));
    }
    ++ranks_on[machine];
  }
  SharedProcessors shared;
  std::map<int, int> processor_of_machine;
  std::vector<int> replica_ranks;  // per processor: replica 0's ranks on its machine
  for (int worker = 0; worker < workers; ++worker) {
    const int machine = machine_of_rank[static_cast<std::size_t>(worker)];
    const auto [at, added] =
        processor_of_machine.emplace(machine, static_cast<int>(processor_of_machine.size()));
    if (added) replica_ranks.push_back(0);
    ++replica_ranks[static_cast<std::size_t>(at->second)];
    shared.processor_of_worker.push_back(at->second);
  }
  for (const auto& [machine, processor] : processor_of_machine) {
    const double share = replica_ranks[static_cast<std::size_t>(processor)] /
                         static_cast<double>(ranks_on.at(machine));
    shared.processor_capacity.resize(
        std::max(shared.processor_capacity.size(), static_cast<std::size_t>(processor) + 1));
    shared.processor_capacity[static_cast<std::size_t>(processor)] = machine_capacity * share;
  }
  shared.capacity = machine_capacity;  // processors no worker uses (none here)
  return shared;
}

bool spans_machines(const std::vector<int>& machine_of_rank) {
  return std::adjacent_find(machine_of_rank.begin(), machine_of_rank.end(),
                            std::not_equal_to<>()) != machine_of_rank.end();
}

}  // namespace pf::sim
