#pragma once
// The PipeFisher pass: fills the bubbles of a synchronous pipeline schedule with K-FAC
// curvature, sync, inversion and preconditioning work, spreading one refresh of the curvature
// and inverses over as few steps k as the bubbles allow (or a fixed k), and emits the
// augmented k-step schedule.
#include <functional>
#include <string>
#include <vector>

#include "scheduler/pipefisher/kfac_options.h"
#include "scheduler/schedule.h"
#include "sim/cost_model.h"
#include "sim/simulator.h"

namespace pf::pipefisher {

struct WorkerKfacReport {
  double utilization_before = 0.0;
  double utilization_after = 0.0;
  double kfac_compute_s = 0.0;     // K-FAC compute per step (curvature, inversion, precondition)
  double kfac_sync_s = 0.0;        // curvature sync per step (communication lanes)
  double spilled_s = 0.0;          // of that, per step, run after the flush instead of in bubbles
  double bubble_s = 0.0;           // idle compute time per step before filling (simulated)
  double kfac_memory_bytes = 0.0;  // factors and inverses held (the busiest replica's)
  // The factors' running sums a refresh accumulates on top (kfac::FactorState::sum, fp32, both
  // factors of every Linear the worker preconditions, all open at once before the first
  // inversion; twice with a pipelined refresh, whose previous window's sums wait for their
  // wrapped inversions): what the simulator counts in its peak (docs/simulator.md, "Memory").
  double factor_sum_bytes = 0.0;
  // Bytes the busiest replica of this worker sends per refresh for the K-FAC state (factor
  // sync, broadcasts; kfac::state_cost); 0 without KfacOptions::linear_dims.
  double kfac_sent_bytes_per_refresh = 0.0;
  int tasks = 0;  // K-FAC instructions per refresh
};

struct KfacReport {
  int refresh_steps = 1;  // k
  // The work/bubble bound on k: per worker ceil(K-FAC work per refresh * (1 + margin) / idle
  // time per step), the max over workers (PipeFisher's (N T_curv + T_inv) / bubble); -1 where
  // no k can hold the work (a worker without idle time, or every_step curvature longer than a
  // step's bubbles).
  int refresh_bound = -1;
  // The bound with the work's release times: the same work run as a fluid through each worker's
  // gaps (those that can hold a piece), each task from its release on; >= refresh_bound up to
  // the gaps too short for a piece. Where the first step's gaps come before most of the work
  // (worker 0 of GPipe/1F1B gets its curvature B only after its last backward) it is
  // refresh_bound + 1. -1 with every_step curvature or where no k can hold the work.
  int release_bound = -1;
  // The bound in usable gaps: the work/bubble bound with only the idle time that can hold K-FAC
  // pieces (a steady step's gaps that hold the smallest piece the pass cuts of the worker's work)
  // and each piece paying the per-task overhead (a usable gap does at most its length less one
  // overhead of work; a task longer than the longest usable gap is that many pieces at least,
  // each past the first paying the overhead again); >= refresh_bound. Up to it k is the cost of
  // splitting, above it the packer's. -1 where refresh_bound is, or where a worker with work has
  // no usable gap.
  int usable_bound = -1;
  // With --kfac-move-w on (split-backward schedules): how far the Ws were moved (forwards /
  // backwards passed, kDeferAllTheWay: as late as they may go), 0 where unmoved won.
  int weights_deferred = 0;
  // --kfac-pipelined-refresh on: whether the chosen plan is pipelined (inverses serve from the
  // next window's first step; wrapped_tasks of the refresh's tasks run, wholly or in part, in
  // the next window's first gaps), and the k of the best plain plan (PipeFisher's window).
  bool pipelined_refresh = false;
  int wrapped_tasks = 0;
  int plain_refresh_steps = -1;
  bool split = true;                 // tasks may be cut into pieces (--kfac-split)
  bool capped = false;               // the automatic k hit max_refresh_steps or the work cannot fit
  std::string warning;               // one line when work runs after the flush (capped), or empty
  double idle_filled = 0.0;          // K-FAC time in the bubbles / idle time before filling
  int divided_tasks = 0;             // tasks run as two or more pieces
  int pieces = 0;                    // pieces of those tasks
  double after_flush_s = 0.0;        // per refresh, summed over workers: K-FAC work after a flush
  int after_flush_tasks = 0;         // tasks (whole or their last piece) run after a flush
  std::string policy;                // the packing that produced the schedule
  int first_fit_refresh_steps = -1;  // k under PipeFisher's first-fit (-1: not run)
  int best_fit_refresh_steps = -1;   // k under best-fit (-1: not run)
  // The plan is one of the refinement's other packings of the work (best_of_both's automatic k:
  // longest work first), at a k below both policies' own.
  bool refined = false;
  double safety_margin = 0.0;
  // --kfac-spill-budget, and the curvature, sync and inversion work that the plan runs after the
  // flush though some k could hold it, per step on its busiest worker, as a fraction of the step
  // time before filling (<= spill_budget where the automatic k took it; 0 where none spilled).
  double spill_budget = 0.0;
  double budget_spill = 0.0;
  // --kfac-free-spill, and the smallest k whose plan holds all of the curvature, sync and
  // inversion in the bubbles (the chosen plan's, save the refinement's; with a free spill the
  // chosen k is below it and its step costs no more).
  bool free_spill = false;
  int holding_refresh_steps = -1;
  std::string curvature;  // first_step / every_step
  bool fixed_interval = false;
  double utilization_before = 0.0;  // 1 - bubble fraction of the base schedule over k steps
  double utilization_after = 0.0;
  double step_time_before_s = 0.0;
  double step_time_after_s = 0.0;
  double step_time_overhead = 0.0;            // after / before - 1
  double kfac_memory_bytes = 0.0;             // the largest per-worker addition
  double factor_sum_bytes = 0.0;              // the largest per-worker factor sums
  double kfac_sent_bytes_per_refresh = 0.0;   // the largest per-worker (busiest replica)
  std::string state_placement = "replicate";  // kfac::to_string of the placement used
  kfac::StatePlacement placement;             // the placement used
  bool automatic_placement = false;           // chosen by --kfac-sharding auto
  int data_parallel = 1;
  int tasks = 0;          // K-FAC instructions per refresh (all workers)
  int spilled_tasks = 0;  // curvature / sync / inversion run after a flush
  int preconditions_in_bubbles = 0;
  int preconditions_after_flush = 0;
  double pass_seconds = 0.0;  // wall time of the pass itself
  std::vector<WorkerKfacReport> workers;
};

// What one data-parallel replica holds of a Linear's K-FAC state (kfac/state_placement.h).
struct HeldKfacState {
  bool factors = true;   // the factors' values (it inverts)
  bool inverses = true;  // the inverses
  double bytes = 0.0;    // of those, fp32
};

struct PassResult {
  sched::Schedule schedule;  // the augmented k-step schedule
  sim::SimResult before;     // the base schedule repeated k times
  sim::SimResult after;      // the augmented schedule
  KfacReport report;
  // With KfacOptions::linear_dims: what the replica of each worker holding the most K-FAC state
  // keeps of each Linear (`after` counts its bytes, and its factor sums up to the inversion where
  // it holds the factors, to the curvature sync where not); empty otherwise (the cost model's
  // kfac_bytes, factors and inverses).
  // The offload pass plans, prices and counts its copies for that replica.
  std::function<HeldKfacState(int worker, int layer, sched::LinearKind linear)>
      busiest_replica_holds;
  // With KfacOptions::linear_dims: the bytes of one factor's sums (d x d fp32), which `after`
  // counts while a refresh accumulates them; empty otherwise (CostModel::kfac_sum_bytes).
  std::function<double(int layer, sched::LinearKind linear, bool a_factor)> factor_sum_bytes;
};

// `base` is a compiled one-step schedule (with communication, as from sched::compile). Throws
// std::invalid_argument on a bad schedule or options. Never refuses for lack of bubbles: when no
// k up to options.max_refresh_steps runs all curvature and inversion in the bubbles, k is the
// cap and the report's warning says what runs after the flush.
PassResult run_pipefisher(const sched::Schedule& base, const sim::CostModel& costs,
                          const KfacOptions& options = {}, const sim::SimOptions& sim_options = {});

}  // namespace pf::pipefisher
