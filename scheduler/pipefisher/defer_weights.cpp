#include "scheduler/pipefisher/defer_weights.h"

#include <stdexcept>
#include <string>
#include <vector>

namespace pf::pipefisher {

using sched::Instruction;
using sched::OpKind;

bool has_backward_weights(const sched::Schedule& schedule) {
  for (const auto& stream : schedule.streams) {
    for (const auto& in : stream) {
      if (in.kind == OpKind::kBackwardWeight) return true;
    }
  }
  return false;
}

namespace {

// Instructions a W may not pass: they consume the weight gradient.
bool consumes_weight_gradient(OpKind kind) {
  return kind == OpKind::kOptimizerStep || kind == OpKind::kReduceGradDataParallel ||
         kind == OpKind::kReduceGradPipelines;
}

std::vector<Instruction> defer_in_stream(const std::vector<Instruction>& stream, int distance) {
  // Work on a list of positions; from the last W to the first, so that a W stops before the
  // (already moved) W after it and the Ws keep their order.
  std::vector<Instruction> out = stream;
  for (std::size_t index = out.size(); index-- > 0;) {
    if (out[index].kind != OpKind::kBackwardWeight) continue;
    std::size_t target = index;  // the W goes right after position `target`
    int passed = 0;
    for (std::size_t x = index + 1; x < out.size() && passed < distance; ++x) {
      const OpKind kind = out[x].kind;
      if (consumes_weight_gradient(kind) || kind == OpKind::kBackwardWeight) break;
      if (!sched::is_compute(kind)) continue;
      ++passed;
      target = x;
      // The sends that follow this compute stay right behind it.
      while (target + 1 < out.size() && sched::is_send(out[target + 1].kind)) ++target;
    }
    if (target == index) continue;
    const Instruction w = out[index];
    out.erase(out.begin() + static_cast<std::ptrdiff_t>(index));
    out.insert(out.begin() + static_cast<std::ptrdiff_t>(target), w);  // after the shifted target
  }
  return out;
}

}  // namespace

sched::Schedule defer_backward_weights(const sched::Schedule& base, int distance) {
  if (distance < 0) {
    throw std::invalid_argument("defer_backward_weights: distance must be >= 0, got " +
                                std::to_string(distance));
  }
  if (base.num_steps != 1) {
    throw std::invalid_argument("defer_backward_weights: the schedule must have one step, got " +
                                std::to_string(base.num_steps));
  }
  sched::Schedule out = base;
  if (distance == 0) return out;
  for (auto& stream : out.streams) stream = defer_in_stream(stream, distance);
  return out;
}

}  // namespace pf::pipefisher
