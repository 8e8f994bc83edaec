#include "scheduler/unit_timings.h"

#include "scheduler/validate.h"

namespace pf::sched {

double UnitDurations::duration(const Instruction& in) const {
  switch (in.kind) {
    case OpKind::kForward:
      return forward_us;
    case OpKind::kBackward:
      return backward_us;
    case OpKind::kBackwardInput:
      return backward_input_us;
    case OpKind::kBackwardWeight:
      return backward_weight_us;
    case OpKind::kSendActivation:
    case OpKind::kRecvActivation:
    case OpKind::kSendGradient:
    case OpKind::kRecvGradient:
      return communication_us;
    case OpKind::kReduceGradPipelines:
    case OpKind::kReduceGradDataParallel:
    case OpKind::kCurvatureSync:
    case OpKind::kBroadcastInverses:
    case OpKind::kBroadcastGradient:
    case OpKind::kPrefetchFactors:  // the host link: one transfer, as a reduction
    case OpKind::kWriteBackState:
    case OpKind::kPrefetchInverses:
      return reduction_us;
    case OpKind::kOptimizerStep:
      return optimizer_us;
    case OpKind::kCurvatureA:
    case OpKind::kCurvatureB:
    case OpKind::kInvertA:
    case OpKind::kInvertB:
    case OpKind::kPrecondition:
      return kfac_us;
  }
  return 0;
}

std::vector<std::vector<traces::SpanTiming>> unit_timings(const Schedule& schedule,
                                                          const UnitDurations& durations) {
  return replay_timings(
      schedule, [&durations](int, const Instruction& in) { return durations.duration(in); });
}

std::vector<std::vector<traces::SpanTiming>> unit_timings(const Schedule& schedule,
                                                          double forward_us, double backward_us,
                                                          double comm_us) {
  UnitDurations durations;
  durations.forward_us = forward_us;
  durations.backward_us = backward_us;
  durations.backward_input_us = backward_us / 2;
  durations.backward_weight_us = backward_us / 2;
  durations.communication_us = comm_us;
  return unit_timings(schedule, durations);
}

}  // namespace pf::sched
