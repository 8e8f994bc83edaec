#pragma once
// The K-FAC offload pass (ZeRO-Infinity for K-FAC; docs/offload.md). Runs after the PipeFisher
// pass: for the Linears the planner offloads (offload_planner.h) it adds the copies between
// device and host memory to the k-step schedule, on each worker's host link (PCIe), so that the
// state lives in host memory between uses:
// - prefetch_factors (host -> device) before the Linear's first inversion of the refresh,
// - write_back_state (device -> host: factors and new inverses) right after its last inversion,
// - prefetch_inverses (host -> device) before each step's preconditioning, released after it
//   (not for a Linear offloaded factors only: its inverses stay on the device, its write-back
//   moves the factors alone; sched::is_factors_only marks its copies).
// Each prefetch goes into the latest idle stretch of the host link that still ends before its
// consumer starts in the PipeFisher pass's simulated timeline (so it is on the device in time
// and the inverses stay there as briefly as possible), of the stretches the copies placed before
// it left (CopyOrder); where no stretch is long enough it goes as early as its own dependencies
// allow. sched::validate checks the order of every copy and its consumer.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "scheduler/pipefisher/offload_planner.h"
#include "scheduler/pipefisher/pass.h"

namespace pf::pipefisher {

// The order a worker's copies are placed in, each where the link is free in the room the ones
// placed before it left (docs/offload.md, "Placing the copies"):
enum class CopyOrder : std::uint8_t {
  // Every copy by its deadline (a prefetch's consumer's start, a write-back's inversion's end).
  // Slack before the consumers; but where the link is busy before a run of consumers, each
  // prefetch goes before those placed already: a step's prefetches stack up in reverse order.
  kByDeadline,
  // The write-backs first, as early as they can go; then the prefetches backwards from the
  // latest deadline: they arrive in their consumers' order, as late as the link allows.
  kPrefetchesLatestFirst,
};
// "by-deadline" | "prefetches-latest-first".
std::string_view to_string(CopyOrder order);
// --kfac-offload-copies: "best" (nullopt) or one of the above; throws std::invalid_argument
// naming the flag otherwise.
std::optional<CopyOrder> copy_order_from_string(std::string_view name);

struct OffloadOptions {
  OffloadMode mode = OffloadMode::kNone;
  double device_memory_budget_bytes = 0.0;  // --device-memory-budget (MiB on the command line)
  // One order, or (nullopt) both, each simulated, the better kept: within the budget (auto),
  // else the shorter step, else the lower peak.
  std::optional<CopyOrder> copy_order;
};

struct WorkerOffloadReport {
  int offloaded_linears = 0;     // whole and factors only
  int factors_only_linears = 0;  // of those, factors only (the inverses on the device)
  int kept_linears = 0;
  // The planner's estimates of the K-FAC bytes on the device at once (WorkerOffloadPlan):
  // without offload, all the state and the factor sums; with the plan, device_kfac_bytes.
  double kfac_device_bytes_before = 0.0;
  double kfac_device_bytes_after = 0.0;
  // Of both, every Linear's factor sums (factor_sum_bytes): the refresh's curvature accumulates
  // them on the device, offloaded or not.
  double factor_sum_bytes = 0.0;
  double offloaded_bytes = 0.0;     // in host memory: whole states and factors
  double peak_memory_before = 0.0;  // simulated peak, PipeFisher schedule without offload
  double peak_memory_after = 0.0;   // simulated peak, with offload
  int transfers = 0;                // copies per refresh (k steps)
  double transfer_bytes = 0.0;      // per refresh
  double transfer_s = 0.0;          // host-link time per refresh
  int late_prefetches = 0;          // placed without a stretch that ends before their consumer
};

struct OffloadReport {
  std::string mode = "none";
  double budget_bytes = 0.0;
  bool fits = true;
  std::string warning;              // the planner's, when the budget is not met
  int offloaded_linears = 0;        // whole and factors only
  int factors_only_linears = 0;     // of those, factors only
  int transfers = 0;                // per refresh, all workers
  double step_time_before_s = 0.0;  // the PipeFisher schedule without offload
  double step_time_after_s = 0.0;
  double step_time_overhead = 0.0;  // after / before - 1
  double max_peak_memory_before = 0.0;
  double max_peak_memory_after = 0.0;
  // How the copies were placed, of the two ways tried (docs/offload.md): "by-deadline" or
  // "prefetches-latest-first".
  std::string copy_order;
  std::vector<WorkerOffloadReport> workers;
};

struct OffloadResult {
  sched::Schedule schedule;  // the k-step schedule with the copies (as given with kNone)
  sim::SimResult after;      // its simulation
  OffloadPlan plan;
  OffloadReport report;
};

// `pipefisher`: the PipeFisher pass's result on a schedule (its `before` gives each worker's
// memory without K-FAC, its `after` the timeline the copies are placed in). kAuto offloads the
// largest Linears of every worker over the budget until all fit; when they never do, it keeps
// the plan it tried with the lowest simulated peak (possibly nothing offloaded) and warns.
// Throws std::invalid_argument for kAuto without a budget, and when the cost model cannot price
// the host link.
OffloadResult run_offload_pass(const PassResult& pipefisher, const sim::CostModel& costs,
                               const OffloadOptions& options,
                               const sim::SimOptions& sim_options = {});

// A one-paragraph table for pipefisher_sim: per worker the Linears offloaded, K-FAC device
// memory before/after, the simulated peaks and the host-link time; then the step times.
std::string format_offload_report(const OffloadReport& report);
// The `kfac_offload` object of pipefisher_sim's --report.
nlohmann::json offload_report_json(const OffloadReport& report);

}  // namespace pf::pipefisher
