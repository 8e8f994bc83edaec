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
  // Processors numbered in the workers' order, densely: processor p is machine_of_processor[p].
  SharedProcessors shared;
  std::map<int, int> processor_of_machine;
  std::vector<int> machine_of_processor;
  std::vector<int> replica_ranks;  // per processor: replica 0's ranks on its machine
  for (int worker = 0; worker < workers; ++worker) {
    const int machine = machine_of_rank[static_cast<std::size_t>(worker)];
    const auto [at, added] =
        processor_of_machine.emplace(machine, static_cast<int>(machine_of_processor.size()));
    if (added) {
      machine_of_processor.push_back(machine);
      replica_ranks.push_back(0);
    }
    ++replica_ranks[static_cast<std::size_t>(at->second)];
    shared.processor_of_worker.push_back(at->second);
  }
  for (std::size_t p = 0; p < machine_of_processor.size(); ++p) {
    shared.processor_capacity.push_back(machine_capacity * replica_ranks[p] /
                                        ranks_on.at(machine_of_processor[p]));
  }
  shared.capacity = machine_capacity;  // a whole machine's (every processor has its own entry)
  return shared;
}

bool spans_machines(const std::vector<int>& machine_of_rank) {
  return std::adjacent_find(machine_of_rank.begin(), machine_of_rank.end(),
                            std::not_equal_to<>()) != machine_of_rank.end();
}

}  // namespace pf::sim
