#include "scheduler/instruction.h"

#include <array>
#include <string>

namespace pf::sched {
namespace {

constexpr std::array<std::string_view, kNumOpKinds> kOpKindNames = {"forward",
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
                                                                    "precondition",
                                                                    "broadcast_inverses",
                                                                    "broadcast_gradient",
                                                                    "prefetch_factors",
                                                                    "write_back_state",
                                                                    "prefetch_inverses"};

constexpr std::array<std::string_view, kNumLinearKinds> kLinearNames = {
    "query", "key", "value", "attention_out", "ffn_in", "ffn_out"};

// Short forms for labels: q k v ao fi fo.
constexpr std::array<std::string_view, kNumLinearKinds> kLinearShort = {"q",  "k",  "v",
                                                                        "ao", "fi", "fo"};

}  // namespace

std::string_view to_string(OpKind kind) {
  return kOpKindNames.at(static_cast<std::size_t>(kind));
}

std::optional<OpKind> op_kind_from_string(std::string_view name) {
  for (std::size_t i = 0; i < kOpKindNames.size(); ++i) {
    if (kOpKindNames[i] == name) return static_cast<OpKind>(i);
  }
  return std::nullopt;
}

std::string_view to_string(LinearKind kind) {
  return kLinearNames.at(static_cast<std::size_t>(kind));
}

std::optional<LinearKind> linear_kind_from_string(std::string_view name) {
  for (std::size_t i = 0; i < kLinearNames.size(); ++i) {
    if (kLinearNames[i] == name) return static_cast<LinearKind>(i);
  }
  return std::nullopt;
}

bool is_compute(OpKind kind) {
  return kind == OpKind::kForward || kind == OpKind::kBackward || kind == OpKind::kBackwardInput ||
         kind == OpKind::kBackwardWeight;
}

bool is_backward(OpKind kind) {
  return kind == OpKind::kBackward || kind == OpKind::kBackwardInput ||
         kind == OpKind::kBackwardWeight;
}

bool is_point_to_point(OpKind kind) {
  return is_send(kind) || is_receive(kind);
}

bool is_send(OpKind kind) {
  return kind == OpKind::kSendActivation || kind == OpKind::kSendGradient;
}

bool is_receive(OpKind kind) {
  return kind == OpKind::kRecvActivation || kind == OpKind::kRecvGradient;
}

bool is_reduction(OpKind kind) {
  return kind == OpKind::kReduceGradPipelines || kind == OpKind::kReduceGradDataParallel ||
         is_kfac_collective(kind);
}

bool is_kfac_collective(OpKind kind) {
  return kind == OpKind::kCurvatureSync || kind == OpKind::kBroadcastInverses ||
         kind == OpKind::kBroadcastGradient;
}

bool is_kfac(OpKind kind) {
  return kind == OpKind::kCurvatureA || kind == OpKind::kCurvatureB ||
         kind == OpKind::kCurvatureSync || kind == OpKind::kInvertA || kind == OpKind::kInvertB ||
         kind == OpKind::kPrecondition || kind == OpKind::kBroadcastInverses ||
         kind == OpKind::kBroadcastGradient || is_kfac_transfer(kind);
}

bool is_kfac_transfer(OpKind kind) {
  return kind == OpKind::kPrefetchFactors || kind == OpKind::kWriteBackState ||
         kind == OpKind::kPrefetchInverses;
}

bool is_divisible(OpKind kind) {
  return kind == OpKind::kCurvatureA || kind == OpKind::kCurvatureB ||
         kind == OpKind::kCurvatureSync || kind == OpKind::kInvertA || kind == OpKind::kInvertB ||
         kind == OpKind::kPrecondition;
}

std::string short_label(const Instruction& in) {
  std::string label;
  if (in.pipeline == 1) label += 'u';  // Chimera's up pipeline
  auto chunk_suffix = [&] {
    if (in.chunk >= 0) label += ".c" + std::to_string(in.chunk);
  };
  auto layer_suffix = [&] {
    label += ".L" + std::to_string(in.layer);
    label += kLinearShort.at(static_cast<std::size_t>(in.linear));
  };
  switch (in.kind) {
    case OpKind::kForward:
      label += "F";
      break;
    case OpKind::kBackward:
      label += "B";
      break;
    case OpKind::kBackwardInput:
      label += "I";
      break;
    case OpKind::kBackwardWeight:
      label += "W";
      break;
    case OpKind::kSendActivation:
      label += "SA";
      break;
    case OpKind::kRecvActivation:
      label += "RA";
      break;
    case OpKind::kSendGradient:
      label += "SG";
      break;
    case OpKind::kRecvGradient:
      label += "RG";
      break;
    case OpKind::kReduceGradPipelines:
      label += "RP";
      break;
    case OpKind::kReduceGradDataParallel:
      label += "RD";
      break;
    case OpKind::kOptimizerStep:
      label += "OPT";
      break;
    case OpKind::kCurvatureA:
      label += "CA";
      break;
    case OpKind::kCurvatureB:
      label += "CB";
      break;
    case OpKind::kCurvatureSync:
      label += "CS";
      break;
    case OpKind::kInvertA:
      label += "IA";
      break;
    case OpKind::kInvertB:
      label += "IB";
      break;
    case OpKind::kPrecondition:
      label += "P";
      break;
    case OpKind::kBroadcastInverses:
      label += "BI";
      break;
    case OpKind::kBroadcastGradient:
      label += "BG";
      break;
    case OpKind::kPrefetchFactors:
      label += "HF";  // host -> device: factors
      break;
    case OpKind::kWriteBackState:
      label += "WB";  // device -> host: factors and inverses
      break;
    case OpKind::kPrefetchInverses:
      label += "HI";  // host -> device: inverses
      break;
  }
  if (is_factors_only(in)) {
    label += "f";  // factors only: the inverses stay on the device
  } else if (in.microbatch >= 0) {
    label += std::to_string(in.microbatch);
  }
  chunk_suffix();
  if (is_kfac(in.kind)) layer_suffix();
  if (is_piece(in)) {
    label += "[" + std::to_string(in.piece_begin) + ":" + std::to_string(in.piece_end) + ")";
  }
  if (is_send(in.kind)) label += "->w" + std::to_string(in.peer);
  if (is_receive(in.kind)) label += "<-w" + std::to_string(in.peer);
  if (in.kind == OpKind::kReduceGradPipelines) label += "<->w" + std::to_string(in.peer);
  if (in.step != 0) label += "@s" + std::to_string(in.step);
  return label;
}

}  // namespace pf::sched
