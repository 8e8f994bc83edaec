#include "sim/op_names.h"

#include <array>

namespace pf::sim {
namespace {

constexpr std::array<std::string_view, sched::kNumOpKinds> kKindNames = {
    "forward",
    "backward",
    "backward_input",
    "backward_weight",
    "send_activation",
    "recv_activation",
    "send_gradient",
    "recv_gradient",
    "reduce_grad_pipelines",
    "reduce_grad_data_parallel",
    "optimizer_step",
    "curvature_a",
    "curvature_b",
    "curvature_sync",
    "invert_a",
    "invert_b",
    "precondition"};

constexpr std::array<std::string_view, sched::kNumLinearKinds> kLinearNames = {
    "query", "key", "value", "attention_out", "ffn_in", "ffn_out"};

}  // namespace

std::string_view kind_name(sched::OpKind kind) {
  return kKindNames[static_cast<int>(kind)];
}

std::optional<sched::OpKind> kind_from_name(std::string_view name) {
  for (int k = 0; k < sched::kNumOpKinds; ++k) {
    if (kKindNames[k] == name) return static_cast<sched::OpKind>(k);
  }
  return std::nullopt;
}

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
  return kind >= sched::OpKind::kCurvatureA && kind <= sched::OpKind::kPrecondition;
}

std::string_view linear_name(sched::LinearKind kind) {
  return kLinearNames[static_cast<int>(kind)];
}

std::optional<sched::LinearKind> linear_from_name(std::string_view name) {
  for (int k = 0; k < sched::kNumLinearKinds; ++k) {
    if (kLinearNames[k] == name) return static_cast<sched::LinearKind>(k);
  }
  return std::nullopt;
}

std::string describe(const sched::Instruction& in, int worker, int position) {
  std::string text = "worker " + std::to_string(worker) + ", position " + std::to_string(position) +
                     ": " + std::string(kind_name(in.kind)) + " step " + std::to_string(in.step) +
                     " pipeline " + std::to_string(in.pipeline) + " chunk " +
                     std::to_string(in.chunk);
  if (in.microbatch >= 0) text += " micro-batch " + std::to_string(in.microbatch);
  if (in.peer >= 0) text += " peer " + std::to_string(in.peer);
  if (in.pair_id >= 0) text += " pair " + std::to_string(in.pair_id);
  if (is_kfac_kind(in.kind)) {
    text += " layer " + std::to_string(in.layer) + " " + std::string(linear_name(in.linear));
  }
  return text;
}

}  // namespace pf::sim
