#pragma once
// Uniform costs: every chunk of every worker takes the same time, every hop the same transfer
// time. The cost model of the closed-form bubble formulas (and of the golden tests).
//
// Convention: forward_s and backward_s are one micro-batch through everything one worker holds
// in one pipeline (t_f, t_b of REFERENCE.md). With v chunks per worker a chunk takes forward_s / v
// (and backward_s / v); Chimera (v = 1 per pipeline) therefore runs one stage's forward in
// forward_s: one "slot" of the Chimera paper. A split backward gives half of a chunk's backward
// to backward-input and half to backward-weight.
#include <memory>

#include "sim/cost_model.h"

namespace pf::sim {

struct UniformCosts {
  double forward_s = 1.0;
  double backward_s = 2.0;
  double communication_s = 0.0;  // per hop: one send of activations or gradients
  // Whole-step work, 0 unless given.
  double reduction_s = 0.0;  // each gradient all-reduce (pipelines or data parallel)
  double optimizer_step_s = 0.0;
  // K-FAC work (per instruction), 0 unless given.
  double curvature_a_s = 0.0;
  double curvature_b_s = 0.0;
  double curvature_sync_s = 0.0;
  double invert_a_s = 0.0;
  double invert_b_s = 0.0;
  double precondition_s = 0.0;
  // Included in each K-FAC compute task above; a piece of a divided task pays it again. Per
  // kind (sim/kfac_overheads.h): a kind's own value where given, else kfac_task_overhead_s.
  double kfac_task_overhead_s = 0.0;
  KfacKindOverheads kfac_kind_overheads_s{};
  // K-FAC offload transfers: bytes / host_bandwidth (bytes/s); 0: they take no time.
  double host_bandwidth = 0.0;
  // Memory without a model: each stashed (chunk, micro-batch) holds activation_bytes / v, each
  // worker holds static_bytes split over its chunks, each K-FAC Linear kfac_bytes.
  double activation_bytes = 1.0;
  double static_bytes = 0.0;
  double kfac_bytes = 0.0;
};

// Parses "F,B" or "F,B,COMM" (seconds); errors name the flag and the value.
UniformCosts parse_uniform_costs(const std::string& text);

class UniformCostModel final : public CostModel {
 public:
  // memory_model (optional): answers the three memory questions instead of the byte fields of
  // UniformCosts, e.g. an analytic model of a real BERT while times stay uniform.
  explicit UniformCostModel(UniformCosts costs, std::shared_ptr<const CostModel> memory_model = {});

  double duration(const sched::Schedule& schedule, int worker,
                  const sched::Instruction& instruction) const override;
  double activation_bytes(const sched::Schedule& schedule, int pipeline, int chunk) const override;
  double static_bytes(const sched::Schedule& schedule, int pipeline, int chunk) const override;
  double kfac_bytes(const sched::Schedule& schedule, int layer,
                    sched::LinearKind linear) const override;
  double kfac_sum_bytes(const sched::Schedule& schedule, int layer, sched::LinearKind linear,
                        bool a_factor) const override;

  double kfac_task_overhead_s(sched::OpKind kind) const override {
    return kfac_overhead_of(kind, costs_.kfac_task_overhead_s, costs_.kfac_kind_overheads_s);
  }
  const UniformCosts& costs() const { return costs_; }

 private:
  UniformCosts costs_;
  std::shared_ptr<const CostModel> memory_model_;
};

}  // namespace pf::sim
