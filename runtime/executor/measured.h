#pragma once
// What a run measured, in the simulator's own formats: a Chrome trace laid out like the
// simulated one (process per rank; compute, send, receive, K-FAC and collective lanes; flows
// from each send to its receive), and a profile (sim/measured_cost_model.h) of median busy
// times per instruction kind and chunk, so that `pipefisher_sim --profile` can replay the same
// schedule and be checked against the measured step time.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/executor/executor.h"
#include "sim/measured_cost_model.h"

namespace pf::exec {

// Events of every rank (ThreadedExecutor::take_events or gathered from processes).
nlohmann::json measured_trace(const sched::Schedule& schedule,
                              const std::vector<InstructionEvent>& events);

// Medians (robust to a noisy machine: the profile to keep for other runs) or means (what a sum
// of the run's own durations needs: the replay of this very run) over the events; steps before
// `warmup_steps` are left out (allocation, first touch).
enum class ProfileStatistic : std::uint8_t { kMedian, kMean };
sim::Profile measured_profile(const sched::Schedule& schedule,
                              const std::vector<InstructionEvent>& events, int warmup_steps,
                              const std::string& description,
                              ProfileStatistic statistic = ProfileStatistic::kMedian);

// Writes what the workers allocated into the profile: each chunk entry's static_bytes is that
// chunk's parameters, gradients and optimizer state (ChunkMemory::total), and each K-FAC entry's
// bytes its Linear's K-FAC state at its largest (LinearKfacMemory::peak_bytes), the largest over
// the ranks holding it (data-parallel replicas hold the same chunks; Chimera's two pipelines the
// same layers). Entries no rank reports keep their bytes. `ranks`: Worker::memory of every rank
// (or of some: the largest over those given).
void add_measured_memory(sim::Profile& profile, const std::vector<WorkerMemory>& ranks);

// WorkerMemory lists as JSON, for gathering them from the ranks' processes (MPI) as text.
nlohmann::json memory_to_json(const std::vector<WorkerMemory>& ranks);
// Throws std::invalid_argument naming what is malformed.
std::vector<WorkerMemory> memory_from_json(const nlohmann::json& json);

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

// A run's steady state: the window from the end of step warmup_steps - 1 (the run's start when
// warmup_steps is 0) to the end of the last recorded step, and each rank's busy time inside it.
// Steps overlap across ranks (a worker starts the next step while its neighbour finishes), so a
// window over whole steps, not a sum of per-step spans, gives the step time.
struct RunSummary {
  std::int64_t first_step = 0;  // steps [first_step, last_step) lie in the window
  std::int64_t last_step = 0;
  double window_s = 0.0;
  double step_time_s = 0.0;            // window_s / steps
  std::vector<double> compute_busy_s;  // per rank: forward, backward, optimizer
  std::vector<double> kfac_busy_s;     // per rank: K-FAC compute
  // busy / window: the measured counterparts of the simulator's utilization (before K-FAC is
  // compute only; with K-FAC adds its compute), averaged over ranks.
  double compute_utilization() const;
  double utilization_with_kfac() const;
  // Step time less the busiest rank's compute (and K-FAC) time per step, as a fraction of the
  // step: for one worker, the executor's own overhead; with a pipeline it includes the bubble.
  double idle_fraction_of_busiest() const;
};
RunSummary summarize_run(const std::vector<InstructionEvent>& events, int ranks, int warmup_steps);

}  // namespace pf::exec
