#pragma once
// The discrete-event simulator: replays per-worker instruction streams against a cost model and
// predicts when every instruction runs, how busy each worker is, and how much memory it holds.
//
// CONTRACT (first draft, written before the implementation so that the simulator, the PipeFisher
// pass and the traces can be built in parallel): the names below may gain members but should not
// lose or change the ones listed.
#include <vector>

#include "scheduler/schedule.h"
#include "sim/cost_model.h"

namespace pf::sim {

struct SimOptions {
  bool overlap_communication = true;  // false: sends and receives occupy the compute lane
};

// When one instruction ran. Parallel to Schedule::streams: times[worker][position].
struct Timing {
  double start_s = 0.0;
  double end_s = 0.0;
};

struct MemorySample {
  double time_s = 0.0;
  double bytes = 0.0;
};

struct WorkerReport {
  double busy_s = 0.0;        // compute lane busy time (forward, backward, K-FAC compute)
  double idle_s = 0.0;        // step_time_s - busy_s
  double utilization = 0.0;   // busy_s / step_time_s
  double exposed_communication_s = 0.0;
  double peak_memory_bytes = 0.0;
  std::vector<MemorySample> memory;  // the counter track
};

struct SimResult {
  double makespan_s = 0.0;    // whole schedule (all of its num_steps steps)
  double step_time_s = 0.0;   // makespan_s / num_steps
  double bubble_fraction = 0.0;
  std::vector<std::vector<Timing>> times;
  std::vector<WorkerReport> workers;
};

// Throws std::invalid_argument when the schedule cannot finish (e.g. a receive with no send).
SimResult simulate(const sched::Schedule& schedule, const CostModel& costs,
                   const SimOptions& options = {});

}  // namespace pf::sim
