#include "scheduler/pipefisher/plan.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

namespace pf::pipefisher::pass_internal {

using sched::OpKind;

KfacReport make_report(const sched::Schedule& base, const sim::CostModel& costs,
                       const KfacOptions& options, const Plan& plan, const sim::SimResult& before,
                       const sim::SimResult& after) {
  KfacReport report;
  report.split = options.split;
  report.divided_tasks = plan.packed.divided_items;
  report.pieces = plan.packed.pieces;
  report.refresh_steps = plan.refresh_steps;
  report.policy = std::string(to_string(plan.policy));
  report.safety_margin = options.safety_margin;
  report.spill_budget = options.spill_budget;
  report.budget_spill =
      before.step_time_s > 0.0
          ? plan.busiest_spill_s / static_cast<double>(plan.refresh_steps) / before.step_time_s
          : 0.0;
  report.curvature = std::string(to_string(options.curvature));
  report.fixed_interval = options.refresh_steps > 0;
  report.utilization_before = 1.0 - before.bubble_fraction;
  report.utilization_after = 1.0 - after.bubble_fraction;
  report.step_time_before_s = before.step_time_s;
  report.step_time_after_s = after.step_time_s;
  report.step_time_overhead =
      before.step_time_s > 0.0 ? after.step_time_s / before.step_time_s - 1.0 : 0.0;
  const auto held = preconditioned_linears(base, options);
  const double k = plan.refresh_steps;
  report.state_placement = kfac::to_string(options.state_placement);
  report.placement = options.state_placement;
  report.data_parallel = std::max(1, base.params.data_parallel);
  report.workers.resize(static_cast<std::size_t>(base.num_workers()));
  for (std::size_t w = 0; w < report.workers.size(); ++w) {
    auto& worker = report.workers[w];
    worker.utilization_before = before.workers[w].utilization;
    worker.utilization_after = after.workers[w].utilization;
    worker.bubble_s = before.workers[w].idle_s;
    if (!options.linear_dims.empty()) {
      // Per replica, as the executor places it; the busiest replica of this worker counts.
      const auto dims = state_dims(held[w], options);
      const auto state =
          kfac::state_cost(kfac::plan_state(dims, report.data_parallel, options.state_placement),
                           dims, plan.refresh_steps);
      worker.kfac_memory_bytes = static_cast<double>(state.max_memory_bytes());
      worker.kfac_sent_bytes_per_refresh = static_cast<double>(state.max_sent_bytes());
    } else {
      for (const auto& linear : held[w]) {
        worker.kfac_memory_bytes += costs.kfac_bytes(base, linear.layer, linear.linear);
      }
    }
    // A pipelined refresh holds a second accumulator per factor: the factors' bytes again
    // (half of the replicated state of factors and inverses).
    if (plan.pipelined) worker.kfac_memory_bytes *= 1.5;
    // Every replica accumulates every Linear's sums before the sync, whatever the placement.
    for (const auto& linear : held[w]) {
      if (!options.linear_dims.empty()) {
        const auto& d = options.linear_dims[static_cast<std::size_t>(linear.linear)];
        worker.factor_sum_bytes +=
            4.0 * (static_cast<double>(d.d_in) * d.d_in + static_cast<double>(d.d_out) * d.d_out);
      } else {
        worker.factor_sum_bytes += costs.kfac_sum_bytes(base, linear.layer, linear.linear, true) +
                                   costs.kfac_sum_bytes(base, linear.layer, linear.linear, false);
      }
    }
    if (plan.pipelined) worker.factor_sum_bytes *= 2.0;
    report.factor_sum_bytes = std::max(report.factor_sum_bytes, worker.factor_sum_bytes);
    report.kfac_memory_bytes = std::max(report.kfac_memory_bytes, worker.kfac_memory_bytes);
    report.kfac_sent_bytes_per_refresh =
        std::max(report.kfac_sent_bytes_per_refresh, worker.kfac_sent_bytes_per_refresh);
  }
  report.capped = !plan.cap_reason.empty();
  for (std::size_t i = 0; i < plan.order.size(); ++i) {
    const KfacTask& task = plan.work().tasks[static_cast<std::size_t>(plan.order[i])];
    const ItemPlacement& placed = plan.packed.placements[i];
    const bool sync = sched::is_kfac_collective(task.kind());
    // A divided task pays its kind's overhead once more per extra piece.
    const int instructions = placed.pieces.empty() ? 1 : static_cast<int>(placed.pieces.size());
    const double seconds =
        task.duration_s + (instructions - 1) * costs.kfac_task_overhead_s(task.kind());
    for (int w : task.workers) {
      auto& worker = report.workers[static_cast<std::size_t>(w)];
      (sync ? worker.kfac_sync_s : worker.kfac_compute_s) += seconds / k;
      worker.spilled_s += placed.spilled_s / k;
      worker.tasks += instructions;
      report.tasks += instructions;
      report.after_flush_s += placed.spilled_s;
    }
    if (placed.spilled) ++report.after_flush_tasks;
    const int wrap = plan.bubbles().problem.wrap_step;
    if (wrap >= 0 && (placed.step == wrap || std::any_of(placed.pieces.begin(), placed.pieces.end(),
                                                         [&](const PiecePlacement& piece) {
                                                           return piece.step == wrap;
                                                         }))) {
      ++report.wrapped_tasks;
    }
    if (task.kind() == OpKind::kPrecondition) {
      ++(placed.spilled ? report.preconditions_after_flush : report.preconditions_in_bubbles);
    } else if (placed.spilled) {
      ++report.spilled_tasks;
    }
  }
  double idle = 0.0;
  double filled = 0.0;
  for (const auto& worker : report.workers) {
    idle += worker.bubble_s;
    filled += worker.kfac_compute_s - worker.spilled_s;
  }
  report.idle_filled = idle > 0.0 ? std::min(1.0, filled / idle) : 0.0;
  if (report.capped) {
    char line[512];
    std::snprintf(line, sizeof line,
                  "warning: K-FAC work does not all fit in the bubbles (%s): k = %d, %.3g ms per "
                  "refresh runs after the flush (step time %+.1f%%); set --kfac-refresh or "
                  "--kfac-max-refresh",
                  plan.cap_reason.c_str(), plan.refresh_steps, 1e3 * report.after_flush_s,
                  100.0 * report.step_time_overhead);
    report.warning = line;
  }
  return report;
}

}  // namespace pf::pipefisher::pass_internal
