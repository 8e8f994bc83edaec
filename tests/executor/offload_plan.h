#pragma once
// Shared by the device offload tests (test_device_offload on the CPU backend, test_executor_cuda
// on a GPU): a PipeFisher schedule of the device tests' BERT and the same schedule with the
// offload pass's copies, priced with each Linear's K-FAC state at its real size.
#include <algorithm>
#include <string>
#include <utility>

#include "runtime/model/bert_config.h"
#include "scheduler/compile.h"
#include "scheduler/pipefisher/offload_pass.h"
#include "scheduler/pipefisher/pass.h"
#include "sim/uniform_cost_model.h"

namespace pf::exec::testing {

// Uniform times; each Linear's K-FAC state at its real size (fp32 A, B, A^-1, B^-1), so that the
// plan's offloaded bytes are what the workers stop holding.
class SizedCosts final : public sim::CostModel {
 public:
  SizedCosts(const model::BertConfig& config, sim::UniformCosts costs)
      : config_(config), uniform_(costs) {}
  double duration(const sched::Schedule& s, int w, const sched::Instruction& in) const override {
    return uniform_.duration(s, w, in);
  }
  double activation_bytes(const sched::Schedule& s, int p, int c) const override {
    return uniform_.activation_bytes(s, p, c);
  }
  double static_bytes(const sched::Schedule& s, int p, int c) const override {
    return uniform_.static_bytes(s, p, c);
  }
  double kfac_bytes(const sched::Schedule&, int, sched::LinearKind linear) const override {
    const double h = static_cast<double>(config_.hidden_size);
    const double i = static_cast<double>(config_.intermediate_size);
    const double d_in = linear == sched::LinearKind::kFfnOut ? i : h;
    const double d_out = linear == sched::LinearKind::kFfnIn ? i : h;
    return 2.0 * 4.0 * (d_in * d_in + d_out * d_out);
  }

 private:
  model::BertConfig config_;
  sim::UniformCostModel uniform_;
};

inline sim::UniformCosts offload_unit_costs(bool long_tasks) {
  sim::UniformCosts costs{.forward_s = 1.0, .backward_s = 2.0, .communication_s = 0.05};
  costs.curvature_a_s = costs.curvature_b_s = long_tasks ? 0.7 : 0.05;
  costs.invert_a_s = costs.invert_b_s = long_tasks ? 3.0 : 0.2;
  costs.precondition_s = long_tasks ? 1.5 : 0.02;
  costs.curvature_sync_s = 0.05;
  costs.static_bytes = 1e4;
  costs.activation_bytes = 1e3;
  costs.host_bandwidth = 1e8;
  return costs;
}

struct OffloadCase {
  std::string name;
  sched::ScheduleKind kind;
  int workers;
  int data_parallel;
  int refresh_steps;
  bool long_tasks;
  pipefisher::OffloadMode mode;
  float running_average = 0.0F;  // of the K-FAC factors (the value must come back to blend)
};

struct Plans {
  sched::Schedule without, with;
  pipefisher::OffloadPlan plan;
};

inline Plans plan_offload_run(const OffloadCase& c, const model::BertConfig& config) {
  sched::ScheduleParams params;
  params.kind = c.kind;
  params.workers = c.workers;
  params.microbatches = 4;
  params.num_layers = config.num_layers;
  params.data_parallel = c.data_parallel;
  const SizedCosts costs(config, offload_unit_costs(c.long_tasks));
  pipefisher::KfacOptions kfac;
  kfac.refresh_steps = c.refresh_steps;
  const auto pass = pipefisher::run_pipefisher(sched::compile(params), costs, kfac);
  double budget = 0.0;
  if (c.mode == pipefisher::OffloadMode::kAuto) {
    // Room for the memory without K-FAC and about half of one worker's K-FAC state.
    double other = 0.0, state = 0.0;
    for (const auto& w : pass.before.workers) other = std::max(other, w.peak_memory_bytes);
    for (const auto& w : pass.after.workers) state = std::max(state, w.peak_memory_bytes - other);
    budget = other + 0.5 * state;
  }
  auto offload = pipefisher::run_offload_pass(pass, costs, {c.mode, budget});
  return {pass.schedule, std::move(offload.schedule), std::move(offload.plan)};
}

}  // namespace pf::exec::testing
