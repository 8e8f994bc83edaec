#pragma once
// The whole compiler: generate, lower, validate.
#include "scheduler/lowering.h"
#include "scheduler/schedule.h"

namespace pf::sched {

Schedule compile(const ScheduleParams& params, const LoweringOptions& options = {});

}  // namespace pf::sched
