// A processor per machine for MPI ranks on several machines (sim/machine_processors.h):
// each simulated worker on its machine's processor, with replica 0's share of that machine.
#include "sim/machine_processors.h"

#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace pf::sim {
namespace {

std::string error_of(const std::vector<int>& machines, int workers, double capacity) {
  try {
    processors_by_machine(machines, workers, capacity);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "no error";
}

TEST(MachineProcessors, OneMachineIsTheSingleMachineShare) {
  // p = 2, d = 2 on one machine: one processor, a replica's half of the capacity (what the
  // threads' shared processor gives with two replicas).
  const auto shared = processors_by_machine({0, 0, 0, 0}, 2, 3.0);
  EXPECT_EQ(shared.processor_of_worker, (std::vector<int>{0, 0}));
  EXPECT_EQ(shared.processor_capacity, (std::vector<double>{1.5}));
}

TEST(MachineProcessors, EachReplicaOnAMachineOfItsOwn) {
  // mpirun --map-by slot, 2 ranks per machine: replica 0 fills machine 0 alone.
  const auto shared = processors_by_machine({0, 0, 1, 1}, 2, 1.4);
  EXPECT_EQ(shared.processor_of_worker, (std::vector<int>{0, 0}));
  EXPECT_EQ(shared.processor_capacity, (std::vector<double>{1.4}));
}

TEST(MachineProcessors, StagesSpreadOverMachinesShareWithTheOtherReplicas) {
  // --map-by node: rank r on machine r % 2. Worker 0 (rank 0) shares machine 0 with rank 2
  // (replica 1's worker 0), worker 1 machine 1 with rank 3: half a machine each.
  const auto spread = processors_by_machine({0, 1, 0, 1}, 2, 2.0);
  EXPECT_EQ(spread.processor_of_worker, (std::vector<int>{0, 1}));
  EXPECT_EQ(spread.processor_capacity, (std::vector<double>{1.0, 1.0}));
  // Uneven: 4 workers, one replica; machines numbered by their ids' first appearance, worker
  // 0's machine 7 is processor 0, holding workers 0 and 3.
  const auto uneven = processors_by_machine({7, 2, 2, 7}, 4, 2.0);
  EXPECT_EQ(uneven.processor_of_worker, (std::vector<int>{0, 1, 1, 0}));
  EXPECT_EQ(uneven.processor_capacity, (std::vector<double>{2.0, 2.0}));
  // Replica 0 on three of machine 0's four ranks: three quarters of its capacity.
  const auto crowded = processors_by_machine({0, 0, 0, 0, 1, 1}, 3, 2.0);
  EXPECT_EQ(crowded.processor_capacity, (std::vector<double>{1.5}));
}

TEST(MachineProcessors, TheSimulatorAcceptsWhatItReturns) {
  // A worker's processor and capacity come back in range (resolve_processors checks them).
  const auto shared = processors_by_machine({3, 1, 3, 1, 0, 0}, 2, 1.0);
  EXPECT_EQ(resolve_processors(shared, 2), (std::vector<int>{0, 1}));
  EXPECT_DOUBLE_EQ(capacity_of_processor(shared, 0), 0.5);
  EXPECT_DOUBLE_EQ(capacity_of_processor(shared, 1), 0.5);
}

TEST(MachineProcessors, BadMapsAreRefused) {
  EXPECT_NE(error_of({0, 0, 1}, 2, 1.0).find("3 ranks are not a whole number of replicas of 2"),
            std::string::npos);
  EXPECT_NE(error_of({0}, 2, 1.0).find("1 ranks"), std::string::npos);
  EXPECT_NE(error_of({0, -1}, 2, 1.0).find("rank 1 on machine -1"), std::string::npos);
  EXPECT_NE(error_of({0, 1}, 2, 0.0).find("capacity"), std::string::npos);
  EXPECT_EQ(error_of({0, 1}, 2, 1.0), "no error");
}

TEST(MachineProcessors, SpansMachines) {
  EXPECT_FALSE(spans_machines({}));
  EXPECT_FALSE(spans_machines({0, 0, 0}));
  EXPECT_TRUE(spans_machines({0, 0, 1}));
}

}  // namespace
}  // namespace pf::sim
