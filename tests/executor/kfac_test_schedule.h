#pragma once
// Shared by the runtime's K-FAC tests (threads and MPI): the unit costs the PipeFisher pass plans
// with, and a compiled schedule with K-FAC in its bubbles.
#include "scheduler/pipefisher/pass.h"
#include "scheduler/schedule.h"
#include "sim/uniform_cost_model.h"

namespace pf::exec::testing {

// Unit costs for the pass: K-FAC tasks short against the pipeline's work.
inline sim::UniformCosts kfac_test_costs() {
  sim::UniformCosts costs{.forward_s = 1.0, .backward_s = 2.0, .communication_s = 0.05};
  costs.curvature_a_s = costs.curvature_b_s = 0.05;
  costs.invert_a_s = costs.invert_b_s = 0.2;
  costs.precondition_s = 0.02;
  costs.curvature_sync_s = 0.05;
  return costs;
}

// `schedule` with K-FAC in its bubbles, refreshed every `refresh_steps` steps.
inline sched::Schedule with_kfac_in_bubbles(const sched::Schedule& schedule, int refresh_steps) {
  pipefisher::KfacOptions kfac;
  kfac.refresh_steps = refresh_steps;
  return pipefisher::run_pipefisher(schedule, sim::UniformCostModel(kfac_test_costs()), kfac)
      .schedule;
}

}  // namespace pf::exec::testing
