#include "scheduler/pipefisher/report_json.h"

namespace pf::pipefisher {

nlohmann::json to_json(const KfacReport& report) {
  nlohmann::json workers = nlohmann::json::array();
  for (std::size_t w = 0; w < report.workers.size(); ++w) {
    const auto& worker = report.workers[w];
    workers.push_back({{"worker", w},
                       {"utilization_before", worker.utilization_before},
                       {"utilization_after", worker.utilization_after},
                       {"bubble_s", worker.bubble_s},
                       {"kfac_compute_s", worker.kfac_compute_s},
                       {"kfac_sync_s", worker.kfac_sync_s},
                       {"spilled_s", worker.spilled_s},
                       {"kfac_memory_bytes", worker.kfac_memory_bytes},
                       {"factor_sum_bytes", worker.factor_sum_bytes},
                       {"kfac_sent_bytes_per_refresh", worker.kfac_sent_bytes_per_refresh},
                       {"tasks", worker.tasks}});
  }
  return {{"refresh_steps", report.refresh_steps},
          {"refresh_bound", report.refresh_bound},
          {"release_bound", report.release_bound},
          {"usable_bound", report.usable_bound},
          {"weights_deferred", report.weights_deferred},
          {"pipelined_refresh", report.pipelined_refresh},
          {"wrapped_tasks", report.wrapped_tasks},
          {"plain_refresh_steps", report.plain_refresh_steps},
          {"split", report.split},
          {"capped", report.capped},
          {"warning", report.warning},
          {"idle_filled", report.idle_filled},
          {"divided_tasks", report.divided_tasks},
          {"pieces", report.pieces},
          {"after_flush_s", report.after_flush_s},
          {"after_flush_tasks", report.after_flush_tasks},
          {"policy", report.policy},
          {"first_fit_refresh_steps", report.first_fit_refresh_steps},
          {"best_fit_refresh_steps", report.best_fit_refresh_steps},
          {"refined", report.refined},
          {"fixed_interval", report.fixed_interval},
          {"curvature", report.curvature},
          {"safety_margin", report.safety_margin},
          {"spill_budget", report.spill_budget},
          {"budget_spill", report.budget_spill},
          {"free_spill", report.free_spill},
          {"holding_refresh_steps", report.holding_refresh_steps},
          {"utilization_before", report.utilization_before},
          {"utilization_after", report.utilization_after},
          {"step_time_before_s", report.step_time_before_s},
          {"step_time_after_s", report.step_time_after_s},
          {"step_time_overhead", report.step_time_overhead},
          {"kfac_memory_bytes", report.kfac_memory_bytes},
          {"factor_sum_bytes", report.factor_sum_bytes},
          {"kfac_sent_bytes_per_refresh", report.kfac_sent_bytes_per_refresh},
          {"state_placement", report.state_placement},
          {"automatic_placement", report.automatic_placement},
          {"data_parallel", report.data_parallel},
          {"tasks", report.tasks},
          {"spilled_tasks", report.spilled_tasks},
          {"preconditions_in_bubbles", report.preconditions_in_bubbles},
          {"preconditions_after_flush", report.preconditions_after_flush},
          {"pass_seconds", report.pass_seconds},
          {"workers", std::move(workers)}};
}

}  // namespace pf::pipefisher
