#include "sim/uniform_cost_model.h"

#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace pf::sim {
namespace {

int chunks_per_worker(const sched::Schedule& schedule) {
  return std::max(1, schedule.params.chunks_per_worker);
}

double checked(double value, const char* field) {
  if (!std::isfinite(value) || value < 0.0) {
    throw std::invalid_argument(std::string("uniform costs: ") + field + " = " +
                                std::to_string(value) + " (must be finite and >= 0)");
  }
  return value;
}

}  // namespace

UniformCosts parse_uniform_costs(const std::string& text) {
  std::vector<double> values;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    std::size_t used = 0;
    double value = 0.0;
    try {
      value = std::stod(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || !std::isfinite(value) || value < 0.0) {
      throw std::invalid_argument("--uniform: '" + item + "' in '" + text +
                                  "' is not a non-negative number of seconds");
    }
    values.push_back(value);
  }
  if (values.size() < 2 || values.size() > 3 || text.empty() || text.back() == ',') {
    throw std::invalid_argument("--uniform expects F,B or F,B,COMM (seconds), got '" + text + "'");
  }
  UniformCosts costs;
  costs.forward_s = values[0];
  costs.backward_s = values[1];
  costs.communication_s = values.size() == 3 ? values[2] : 0.0;
  return costs;
}

UniformCostModel::UniformCostModel(UniformCosts costs, std::shared_ptr<const CostModel> memory)
    : costs_(costs), memory_model_(std::move(memory)) {
  checked(costs_.forward_s, "forward_s");
  checked(costs_.backward_s, "backward_s");
  checked(costs_.communication_s, "communication_s");
  checked(costs_.reduction_s, "reduction_s");
  checked(costs_.optimizer_step_s, "optimizer_step_s");
  checked(costs_.curvature_a_s, "curvature_a_s");
  checked(costs_.curvature_b_s, "curvature_b_s");
  checked(costs_.curvature_sync_s, "curvature_sync_s");
  checked(costs_.invert_a_s, "invert_a_s");
  checked(costs_.invert_b_s, "invert_b_s");
  checked(costs_.precondition_s, "precondition_s");
  checked(costs_.activation_bytes, "activation_bytes");
  checked(costs_.static_bytes, "static_bytes");
  checked(costs_.kfac_bytes, "kfac_bytes");
  check_kfac_overheads(costs_.kfac_task_overhead_s, costs_.kfac_kind_overheads_s, "uniform costs");
  checked(costs_.host_bandwidth, "host_bandwidth");
}

double UniformCostModel::duration(const sched::Schedule& schedule, int /*worker*/,
                                  const sched::Instruction& instruction) const {
  using sched::OpKind;
  const double v = chunks_per_worker(schedule);
  switch (instruction.kind) {
    case OpKind::kForward:
      return costs_.forward_s / v;
    case OpKind::kBackward:
      return costs_.backward_s / v;
    case OpKind::kBackwardInput:
    case OpKind::kBackwardWeight:
      return costs_.backward_s / (2.0 * v);
    case OpKind::kSendActivation:
    case OpKind::kRecvActivation:
    case OpKind::kSendGradient:
    case OpKind::kRecvGradient:
      return costs_.communication_s;
    case OpKind::kReduceGradPipelines:
    case OpKind::kReduceGradDataParallel:
      return costs_.reduction_s;
    case OpKind::kOptimizerStep:
      return costs_.optimizer_step_s;
    case OpKind::kCurvatureA:
      return kfac_piece_seconds(costs_.curvature_a_s, kfac_task_overhead_s(instruction.kind),
                                instruction);
    case OpKind::kCurvatureB:
      return kfac_piece_seconds(costs_.curvature_b_s, kfac_task_overhead_s(instruction.kind),
                                instruction);
    case OpKind::kCurvatureSync:  // a piece: its share plus the overhead
      return kfac_piece_seconds(costs_.curvature_sync_s, kfac_task_overhead_s(instruction.kind),
                                instruction);
    case OpKind::kBroadcastInverses:  // one K-FAC collective (the model has no bandwidth)
    case OpKind::kBroadcastGradient:
      return costs_.curvature_sync_s;
    case OpKind::kInvertA:
      return kfac_piece_seconds(costs_.invert_a_s, kfac_task_overhead_s(instruction.kind),
                                instruction);
    case OpKind::kInvertB:
      return kfac_piece_seconds(costs_.invert_b_s, kfac_task_overhead_s(instruction.kind),
                                instruction);
    case OpKind::kPrecondition:
      return kfac_piece_seconds(costs_.precondition_s, kfac_task_overhead_s(instruction.kind),
                                instruction);
    case OpKind::kPrefetchFactors:
    case OpKind::kWriteBackState:
    case OpKind::kPrefetchInverses:
      return costs_.host_bandwidth > 0.0
                 ? static_cast<double>(instruction.bytes) / costs_.host_bandwidth
                 : 0.0;
  }
  return 0.0;
}

double UniformCostModel::activation_bytes(const sched::Schedule& schedule, int pipeline,
                                          int chunk) const {
  if (memory_model_) return memory_model_->activation_bytes(schedule, pipeline, chunk);
  return costs_.activation_bytes / chunks_per_worker(schedule);
}

double UniformCostModel::static_bytes(const sched::Schedule& schedule, int pipeline,
                                      int chunk) const {
  if (memory_model_) return memory_model_->static_bytes(schedule, pipeline, chunk);
  const int pipelines = std::max(1, schedule.placement.num_pipelines);
  return costs_.static_bytes / (chunks_per_worker(schedule) * pipelines);
}

double UniformCostModel::kfac_bytes(const sched::Schedule& schedule, int layer,
                                    sched::LinearKind linear) const {
  if (memory_model_) return memory_model_->kfac_bytes(schedule, layer, linear);
  return costs_.kfac_bytes;
}

double UniformCostModel::kfac_sum_bytes(const sched::Schedule& schedule, int layer,
                                        sched::LinearKind linear, bool a_factor) const {
  if (memory_model_) return memory_model_->kfac_sum_bytes(schedule, layer, linear, a_factor);
  return CostModel::kfac_sum_bytes(schedule, layer, linear, a_factor);
}

}  // namespace pf::sim
