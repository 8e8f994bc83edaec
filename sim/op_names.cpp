#include "sim/op_names.h"

namespace pf::sim {

bool is_compute_kind(sched::OpKind kind) {
  using sched::OpKind;
  switch (kind) {
    case OpKind::kForward:
    case OpKind::kBackward:
    case OpKind::kBackwardInput:
    case OpKind::kBackwardWeight:
    case OpKind::kOptimizerStep:
    case OpKind::kCurvatureA:
    case OpKind::kCurvatureB:
    case OpKind::kInvertA:
    case OpKind::kInvertB:
    case OpKind::kPrecondition:
      return true;
    default:
      return false;
  }
}

bool is_kfac_kind(sched::OpKind kind) {
  return sched::is_kfac(kind);
}

std::string describe(const sched::Instruction& in, int worker, int position) {
  std::string text = "worker " + std::to_string(worker) + ", position " + std::to_string(position) +
                     ": " + std::string(sched::to_string(in.kind)) + " step " +
                     std::to_string(in.step) + " pipeline " + std::to_string(in.pipeline) +
                     " chunk " + std::to_string(in.chunk);
  if (in.microbatch >= 0) text += " micro-batch " + std::to_string(in.microbatch);
  if (in.peer >= 0) text += " peer " + std::to_string(in.peer);
  if (in.pair_id >= 0) text += " pair " + std::to_string(in.pair_id);
  if (is_kfac_kind(in.kind)) {
    text += " layer " + std::to_string(in.layer) + " " + std::string(sched::to_string(in.linear));
  }
  return text;
}

}  // namespace pf::sim
