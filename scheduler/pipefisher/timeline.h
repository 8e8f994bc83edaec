#pragma once
// When the base schedule's instructions run over k repeated steps, and the idle intervals
// ("bubbles") of each worker's compute lane that K-FAC work may fill.
//
// The base schedule is simulated for two steps; step 0 is the start-up step and step 1 the
// steady state, repeated every `period` seconds (a synchronous pipeline flushes every step, so
// every later step has step 1's shape).
#include <vector>

#include "scheduler/pipefisher/kfac_work.h"
#include "scheduler/pipefisher/packer.h"
#include "scheduler/schedule.h"
#include "sim/cost_model.h"
#include "sim/simulator.h"

namespace pf::pipefisher {

// `base` repeated `steps` times: step = 0..steps-1, pair ids offset so they stay unique.
sched::Schedule repeat_steps(const sched::Schedule& base, int steps);

struct Timeline {
  std::vector<std::vector<sim::Timing>> first;   // [worker][position] in step 0
  std::vector<std::vector<sim::Timing>> steady;  // [worker][position] in step 1
  double first_step_end_s = 0.0;                 // makespan of step 0 alone
  double period_s = 0.0;                         // start-to-start distance of later steps
  bool overlap_communication = true;
  // Workers sharing a processor (sim::SharedProcessors, resolved): a worker's idle time is worth
  // only the processor's room beside the others' compute. Empty: a processor per worker.
  std::vector<int> processor_of;
  double processor_capacity = 1.0;

  sim::Timing at(const BaseRef& ref) const;
  double end_of_steps(int steps) const { return first_step_end_s + (steps - 1) * period_s; }
};

Timeline measure_timeline(const sched::Schedule& base, const sim::CostModel& costs,
                          const sim::SimOptions& options = {});
// The same from a simulation of repeat_steps(base, 2) the caller ran (and may reuse).
Timeline timeline_from_two_steps(const sched::Schedule& base, const sim::SimResult& two,
                                 bool overlap_communication,
                                 const sim::SharedProcessors& shared = {});

// Whether an instruction of this kind occupies the compute lane.
bool occupies_compute_lane(sched::OpKind kind, bool overlap_communication);

// Where K-FAC work goes in a worker's stream: before `position` of step `step` of the base
// stream (position may equal the stream length: at the end of the step).
struct Slot {
  int step = 0;
  int position = 0;
};

struct BubbleMap {
  PackProblem problem;                          // bubbles (tag = index into slots) and flush starts
  std::vector<std::vector<Slot>> slots;         // [worker][tag]
  std::vector<std::vector<Slot>> flush_slot;    // [worker][step]: where spilled work goes
  std::vector<std::vector<double>> capacity_s;  // [worker][step]: total bubble time
};

// The bubbles of `steps` steps: the idle stretches of each worker's compute lane between its
// forwards and backwards (and from the start, and until the schedule's end), less the other
// compute-lane work inside them (the optimizer step), and cut at each collective (a rendezvous:
// the worker issues nothing while it waits for its partner, but computes again once the
// transfer runs). A bubble's work is inserted before the receives that feed the next
// forward/backward, before the collective that ends the bubble, or before the optimizer step
// inside it (delaying that step within the bubble, and keeping preconditioning ahead of it).
// With shared processors (Timeline::processor_of) a bubble holds only the processor's room in it:
// its length is the integral of clamp(capacity - others computing, 0, 1) over its span, where
// "others" are the other workers on its processor (it keeps its start; a bubble with no room is
// dropped). K-FAC work in a worker's idle time that the other workers' compute fills would take
// their processor, not idle time (docs/simulator.md, "Shared processors").
BubbleMap find_bubbles(const sched::Schedule& base, const Timeline& timeline, int steps);

}  // namespace pf::pipefisher
