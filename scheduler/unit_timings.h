#pragma once
// A lockstep layout of a schedule in time with fixed durations per kind: every instruction
// starts when its worker is free and its inputs exist; sends and receives (and the pipeline
// reductions) start together at the later of the two workers (blocking rendezvous). Used for
// the compiler's own traces and pictures; the simulator gives real durations.
#include <vector>

#include "scheduler/schedule.h"
#include "traces/span_timing.h"

namespace pf::sched {

struct UnitDurations {
  double forward_us = 1;
  double backward_us = 2;  // full backward
  double backward_input_us = 1;
  double backward_weight_us = 1;
  double communication_us = 0;  // sends and receives
  double reduction_us = 0;      // gradient reductions and curvature sync
  double optimizer_us = 0;
  double kfac_us = 0.5;  // curvature, inversion, preconditioning
  double duration(const Instruction& instruction) const;
};

// Timings parallel to schedule.streams. Validates the schedule first (throws ValidationError).
std::vector<std::vector<traces::SpanTiming>> unit_timings(const Schedule& schedule,
                                                          const UnitDurations& durations);
std::vector<std::vector<traces::SpanTiming>> unit_timings(const Schedule& schedule,
                                                          double forward_us = 1,
                                                          double backward_us = 2,
                                                          double comm_us = 0);

}  // namespace pf::sched
