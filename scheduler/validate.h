#pragma once
// The validator: every schedule, generated or loaded, must pass it before it is simulated, run
// or written. Rules (see docs/scheduler.md):
// - structure: one stream per worker, a consistent placement, every field in range, every
//   instruction on the worker that holds its chunk (and K-FAC work on the worker holding its
//   layer);
// - each (step, pipeline, chunk, micro-batch) has exactly one forward and one backward, or one
//   backward-input followed by one backward-weight, in dependency order;
// - with communication: every cross-worker dependency goes through exactly one send (after the
//   producing compute) and one receive (before the consuming compute) with the same pair id,
//   opposite kinds, peers pointing at each other and the same byte count; pair ids are unique;
// - reductions and the optimizer step come after the backwards they reduce / apply;
// - K-FAC: curvature A after its forward, curvature B after its backward(-input), curvature
//   sync after all curvature of its (step, layer, linear) on that worker, inversions after their
//   curvature and sync, preconditioning after every backward of its chunk in its step and
//   before that step's optimizer step;
// - the streams finish under blocking point-to-point semantics (a send and its receive
//   rendezvous); a deadlock is reported with the cycle of waiting workers.
// Failures throw ValidationError naming the worker, the position and the instruction, followed
// by the grid of workers x positions around it with the bad cell in [brackets].
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "scheduler/schedule.h"
#include "traces/span_timing.h"

namespace pf::sched {

class ValidationError : public std::invalid_argument {
 public:
  ValidationError(const std::string& message, int worker_index, int position_index)
      : std::invalid_argument(message), worker(worker_index), position(position_index) {}
  int worker = -1;    // -1 when the failure is not tied to one worker
  int position = -1;  // position in that worker's stream (may equal its length: "at the end")
};

void validate(const Schedule& schedule);

// Validates, then lays the streams out in time under blocking semantics with the given
// durations (µs per instruction). Timings are parallel to schedule.streams.
using DurationFn = std::function<double(int worker, const Instruction& instruction)>;
std::vector<std::vector<traces::SpanTiming>> replay_timings(const Schedule& schedule,
                                                            const DurationFn& duration);

}  // namespace pf::sched
