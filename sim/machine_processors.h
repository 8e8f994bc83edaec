#pragma once
// Ranks on several machines (pipefisher_train under mpirun): each machine's cores are shared by
// the ranks on it, so the simulator gives each machine a processor (docs/simulator.md "Shared
// processors"). It runs one data-parallel replica (replica 0); the other replicas run the same
// schedule beside it, so on each machine replica 0's workers get the share of its capacity that
// their rank count is of the machine's.
#include <vector>

#include "sim/simulator.h"

namespace pf::sim {

// machine_of_rank: every rank's machine (any non-negative ids), ranks in the executor's order
// (rank = replica * workers + worker, as runtime/executor/mpi_executor.h numbers them);
// workers: one replica's; machine_capacity: one machine's capacity (> 0: the self-profile measured
// on rank 0's machine, or --shared-processor C). Returns replica 0's processors: a worker on the
// processor of its machine (numbered in the order of the workers), each with capacity
// machine_capacity x (replica 0's ranks on the machine) / (ranks on the machine). Throws
// std::invalid_argument when the map is not a whole number of replicas or has a negative machine,
// or the capacity is not > 0.
SharedProcessors processors_by_machine(const std::vector<int>& machine_of_rank, int workers,
                                       double machine_capacity);

// Whether the ranks span more than one machine.
bool spans_machines(const std::vector<int>& machine_of_rank);

}  // namespace pf::sim
