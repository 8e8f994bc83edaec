#pragma once
// The discrete-event simulator: replays per-worker instruction streams against a cost model and
// predicts when every instruction runs, how busy each worker is, and how much memory it holds.
//
// CONTRACT (first draft, written before the implementation so that the simulator, the PipeFisher
// pass and the traces can be built in parallel): the names below may gain members but should not
// lose or change the ones listed.
//
// Semantics (docs/simulator.md has the full description):
// - Every worker has a compute lane, a send lane and a receive lane. Collectives (gradient
//   reductions, curvature sync) occupy both communication lanes. With overlap off, everything
//   runs on the compute lane.
// - An instruction starts at the latest of: the start of the previous instruction of its stream
//   (in-order issue), the end of the previous instruction on each of its lanes, and the end of
//   each data dependency (plus the transfer time where data crosses workers without an explicit
//   send/receive pair).
// - A receive ends at max(its start, the end of its matching send): the send occupies the
//   sender's lane for the transfer time and the data is there when it ends.
// - A collective with a peer is a rendezvous: all participants start together, when the last
//   one is ready, and end after the cost model's (ring all-reduce) duration.
// - With shared processors (SharedProcessors), the compute instructions of the workers on one
//   processor that run at once divide its throughput: an instruction's end then depends on what
//   starts and ends beside it, not only on its own cost.
#include <functional>
#include <vector>

#include "scheduler/schedule.h"
#include "sim/cost_model.h"

namespace pf::sim {

// Workers whose compute shares one processor: threads on one machine's cores, ranks on one GPU
// (docs/simulator.md "Shared processors"). While n compute instructions (forward, backward,
// optimizer, K-FAC) run on a processor, each progresses at min(1, capacity / n) of the speed
// its cost model prices, which is its time alone. Communication and host copies keep lanes of
// their own. Neither field set: a processor per worker, as the cost models assume.
struct SharedProcessors {
  // > 0: consecutive groups of this many workers share a processor (the last may be smaller);
  // a number >= the workers puts them all on one.
  int workers_per_processor = 0;
  // Or per worker, its processor (0 .. workers - 1); used when workers_per_processor is 0.
  std::vector<int> processor_of_worker;
  double capacity = 1.0;  // instructions a processor runs at full speed at once (> 0)
  // Or per processor (index 0 .. the highest processor used), its own capacity: machines whose
  // cores other ranks share unevenly (sim/machine_processors.h). Empty: `capacity`.
  std::vector<double> processor_capacity;
  bool enabled() const { return workers_per_processor != 0 || !processor_of_worker.empty(); }
};

// Every worker's processor (0 .. workers - 1) under `shared`; empty when it is off. Throws
// std::invalid_argument naming what is wrong (a map of another length, a processor out of range,
// a capacity that is not finite and > 0, per-processor capacities that miss a processor in use,
// a negative group).
std::vector<int> resolve_processors(const SharedProcessors& shared, int workers);

// Processor `processor`'s capacity under `shared`: its entry of processor_capacity, else
// `capacity`.
double capacity_of_processor(const SharedProcessors& shared, int processor);

struct SimOptions {
  bool overlap_communication = true;  // false: sends and receives occupy the compute lane
  bool track_memory = true;           // false: skip the memory counters (faster in loops)
  // Count the factor sums a refresh accumulates (docs/simulator.md). false: the K-FAC state of
  // factors and inverses alone, the model before 2026-11-28 (the configuration search's closed
  // form counts the sums too since then: sim/config_search.cpp).
  bool count_factor_sums = true;
  // When set, the K-FAC state one Linear adds to `worker` instead of CostModel::kfac_bytes: with
  // the state sharded across data-parallel replicas (kfac/state_placement.h) what the worker's
  // replica holding the most K-FAC state keeps of that Linear (0 where it holds none).
  std::function<double(int worker, int layer, sched::LinearKind linear)> kfac_state_bytes = {};
  // When set, whether that replica holds a Linear's factors (it finalizes and inverts them):
  // one that does not drops its factor sums at the end of the curvature sync instead of keeping
  // them to the inversion. Unset: every worker holds every Linear's factors.
  std::function<bool(int worker, int layer, sched::LinearKind linear)> kfac_holds_factors = {};
  // When set, the bytes of one factor's sums (A: a_factor) instead of CostModel::kfac_sum_bytes
  // (the PipeFisher pass sizes them from KfacOptions::linear_dims, as it does the state).
  std::function<double(int layer, sched::LinearKind linear, bool a_factor)> kfac_sum_bytes = {};
  SharedProcessors shared_processors = {};
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

// busy_s, idle_s and exposed_communication_s are per training step (totals / num_steps), so
// that utilization = busy_s / step_time_s.
struct WorkerReport {
  double busy_s = 0.0;       // compute lane busy time (forward, backward, K-FAC compute)
  double idle_s = 0.0;       // step_time_s - busy_s
  double utilization = 0.0;  // busy_s / step_time_s
  double exposed_communication_s = 0.0;  // communication not hidden behind compute
  double peak_memory_bytes = 0.0;
  double static_memory_bytes = 0.0;    // weights + gradients + optimizer state
  double peak_activation_bytes = 0.0;  // largest stash of activations
  int peak_stashed_microbatches = 0;   // largest number of stashed (chunk, micro-batch)s
  std::vector<MemorySample> memory;    // the counter track
};

struct SimResult {
  double makespan_s = 0.0;       // whole schedule (all of its num_steps steps)
  double step_time_s = 0.0;      // makespan_s / num_steps
  double bubble_fraction = 0.0;  // 1 - sum(busy) / (workers * makespan)
  int num_steps = 1;
  std::vector<std::vector<Timing>> times;
  std::vector<WorkerReport> workers;
};

// Throws std::invalid_argument when the schedule cannot finish (e.g. a receive with no send, a
// dependency on an instruction that no worker runs, a cycle) or a cost is negative or NaN.
SimResult simulate(const sched::Schedule& schedule, const CostModel& costs,
                   const SimOptions& options = {});

// The bytes of one factor's sums (A: a_factor) of a Linear as simulate() counts them:
// SimOptions::kfac_sum_bytes where set, else the cost model's.
double factor_sum_bytes(const sched::Schedule& schedule, const CostModel& costs,
                        const SimOptions& options, int layer, sched::LinearKind linear,
                        bool a_factor);

}  // namespace pf::sim
