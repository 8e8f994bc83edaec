#pragma once
// A run's compute times as each instruction would have taken alone, when every rank's compute
// shared one processor (worker threads on one machine's cores): the inverse of the simulator's
// shared processor (sim::SharedProcessors). While n compute instructions ran at once, each went
// at min(1, capacity / n) of its own speed, so its own work is the integral of that rate over
// its span. A profile of these times, simulated with the same shared processor, gives the run
// back; with K-FAC in one worker's bubbles beside another's compute it predicts the slowdown
// that the measured durations alone would hide (docs/simulator.md "Shared processors").
#include <vector>

#include "runtime/executor/executor.h"

namespace pf::exec {

// Scales busy_s of every compute and K-FAC compute event by the mean rate over its span (other
// events unchanged). capacity > 0 and finite (std::invalid_argument otherwise); ranks' events
// must share one clock (threads of one process, or a gathered run on one machine).
std::vector<InstructionEvent> alone_times(std::vector<InstructionEvent> events, double capacity);

// The same on each machine apart: ranks of different machines (machine_of_rank[rank]) do not
// share a processor, so each machine's events are swept on their own, each machine of the same
// capacity (MPI processes on several machines, their events gathered on a common start). An
// empty machine_of_rank: one machine. std::invalid_argument for an event of a rank it lacks.
std::vector<InstructionEvent> alone_times_by_machine(std::vector<InstructionEvent> events,
                                                     double capacity,
                                                     const std::vector<int>& machine_of_rank);

}  // namespace pf::exec
