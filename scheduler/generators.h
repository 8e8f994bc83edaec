#pragma once
// The schedule generators: GPipe, 1F1B, interleaved 1F1B (Megatron order), Chimera and the
// zero-bubble ZB-H1, ZB-H2 and ZB-V (always split backwards). They emit
// compute-only streams (forward / backward, or backward-input + backward-weight when
// params.split_backward) plus the placement; lower() adds communication, reductions and the
// optimizer step.
#include "scheduler/schedule.h"

namespace pf::sched {

// Throws std::invalid_argument naming the rule that failed and what would be allowed, e.g.
// "interleaved needs micro-batches to be a multiple of stages (m=6, p=4): use m = 4, 8, 12, ...".
void check_params(const ScheduleParams& params);

// The activation-memory limit of the zero-bubble H kinds: params.max_in_flight, or the kind's
// own (zbh1: p, zbh2: 2p - 1).
int zero_bubble_max_in_flight(const ScheduleParams& params);

// Compute-only schedule for params (one training step, step 0). Calls check_params.
Schedule generate(const ScheduleParams& params);

// The same per-step streams run num_steps times (step field 0..num_steps-1, num_steps set), for
// multi-step schedules such as a K-FAC refresh spread over k steps. Takes a one-step schedule
// without communication (lower() the result); throws std::invalid_argument otherwise.
Schedule repeat_steps(const Schedule& one_step, int num_steps);

}  // namespace pf::sched
