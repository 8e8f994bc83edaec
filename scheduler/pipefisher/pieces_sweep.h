#pragma once
// The divisible-task sweep (docs/pipefisher.md, "The sweep"): PipeFisher's performance model
// (one BERT encoder layer per stage, N = D micro-batches) over devices, models, micro-batch
// sizes, pipeline depths and schedules, with the analytic cost model and with a measured-format
// profile built from it, the pass with divisible tasks beside the indivisible pass and beside
// PipeFisher's own preconditioning after the flush. Shared by bench_pipefisher --pieces and the
// tests that assert its criteria.
#include <string>
#include <vector>

#include "scheduler/pipefisher/pass.h"
#include "scheduler/schedule.h"

namespace pf::pipefisher {

struct SweepCase {
  std::string costs = "analytic";  // analytic, or measured (a profile built from the analytic)
  std::string device = "h100";     // an analytic device preset: p100, v100, a100, h100
  std::string model = "base";      // BERT preset: base, large
  int micro_batch = 32;
  int stages = 4;                                             // D, and N = D micro-batches
  sched::ScheduleKind kind = sched::ScheduleKind::kOneFOneB;  // interleaved: v = 2

  std::string name() const;  // costs/device/model/micro_batch/stages/schedule
};

// All of them: {analytic, measured} x {p100, v100, a100, h100} x {base, large} x {8, 16, 32} x
// {4, 8, 16} x {gpipe, 1f1b, interleaved, chimera}: 576.
std::vector<SweepCase> pieces_sweep_cases();

struct SweepResult {
  SweepCase config;
  std::string refused;  // the pass's error, or empty
  KfacReport split;     // --kfac-split on (default options)
  std::string invalid;  // the validator's error on the split pass's schedule, or empty
  std::string whole_refused;
  KfacReport whole;  // --kfac-split off
  // PipeFisher's own step-time overhead: the base schedule over split.refresh_steps steps with
  // every step's preconditioning after the flush (ahead of the optimizer step), simulated.
  double pipefisher_overhead = 0.0;

  bool capped_below_bound() const {  // the bound exceeds --kfac-max-refresh: k is the cap
    return split.capped && split.refresh_bound > split.refresh_steps;
  }
};

// The schedule of a case: N = D micro-batches, one encoder layer per stage (per chunk).
sched::Schedule sweep_schedule(const SweepCase& config);

// Runs one case; never throws for a refusal (recorded in the result).
SweepResult run_sweep_case(const SweepCase& config, const KfacOptions& options = {});

struct SweepSummary {
  int configurations = 0;
  int refused = 0;
  int whole_refused = 0;
  int at_bound = 0;          // k == refresh_bound
  int whole_at_bound = 0;    // the same for the indivisible pass
  int at_release_bound = 0;  // k == release_bound (the bound with the work's release times)
  int at_usable_bound = 0;   // k == usable_bound (the bound in the gaps that hold a piece)
  int invalid = 0;           // schedules the validator refused (SweepResult::invalid)
  int within_one = 0;        // k <= refresh_bound + 1
  int above_bound_plus_one = 0;
  int capped_below_bound = 0;  // bound > --kfac-max-refresh: k is the cap
  int not_costlier = 0;        // step-time overhead <= PipeFisher's own (+ 0.1 point)
  // With --kfac-pipelined-refresh on (KfacOptions::pipelined_refresh): the plain refresh's k
  // (KfacReport::plain_refresh_steps) against the same bound, and the plans the pass took
  // pipelined, and of those, the ones that run work in the next window.
  int plain_at_bound = 0;
  int plain_within_one = 0;
  int pipelined_plans = 0;
  int wrapping_plans = 0;
};
SweepSummary summarize(const std::vector<SweepResult>& results);

}  // namespace pf::pipefisher
