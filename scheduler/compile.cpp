#include "scheduler/compile.h"

#include "scheduler/generators.h"
#include "scheduler/validate.h"

namespace pf::sched {

Schedule compile(const ScheduleParams& params, const LoweringOptions& options) {
  Schedule schedule = lower(generate(params), options);
  validate(schedule);
  return schedule;
}

}  // namespace pf::sched
