#pragma once
// What a run measured, in the simulator's own formats: a Chrome trace laid out like the
// simulated one (process per rank; compute, send, receive, K-FAC and collective lanes; flows
// from each send to its receive), and a profile (sim/measured_cost_model.h) of median busy
// times per instruction kind and chunk, so that `pipefisher_sim --profile` can replay the same
// schedule and be checked against the measured step time.
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/executor/executor.h"
#include "sim/measured_cost_model.h"

namespace pf::exec {

// Events of every rank (ThreadedExecutor::take_events or gathered from processes).
nlohmann::json measured_trace(const sched::Schedule& schedule,
                              const std::vector<InstructionEvent>& events);

// Medians over the events; steps before `warmup_steps` are left out (allocation, first touch).
sim::Profile measured_profile(const sched::Schedule& schedule,
                              const std::vector<InstructionEvent>& events, int warmup_steps,
                              const std::string& description);

// Per-step wall time (first event start to last event end over all ranks) and each rank's
// compute busy time, for overhead figures. Steps before warmup_steps are left out.
struct StepTiming {
  std::int64_t step = 0;
  double wall_s = 0.0;
  std::vector<double> compute_busy_s;  // per rank: F/B/I/W/optimizer busy time
  std::vector<double> kfac_busy_s;     // per rank: K-FAC compute busy time
};
std::vector<StepTiming> step_timings(const std::vector<InstructionEvent>& events, int ranks,
                                     int warmup_steps);

}  // namespace pf::exec
