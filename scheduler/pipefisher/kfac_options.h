#pragma once
// Options of the PipeFisher pass: how K-FAC work is chosen and packed into pipeline bubbles.
#include <string_view>
#include <vector>

#include "kfac/state_placement.h"
#include "scheduler/instruction.h"

namespace pf::pipefisher {

enum class PackingPolicy : unsigned char {
  kFirstFit,   // PipeFisher: each task in priority order into the earliest bubble that fits it
  kBestFit,    // earliest step that fits, and in that step the bubble it leaves least room in
  kBestOfBoth  // run both, keep the better plan (fewer refresh steps, then less spilled work)
};
std::string_view to_string(PackingPolicy policy);
PackingPolicy packing_policy_from_string(std::string_view name);  // throws with allowed names

enum class CurvatureSource : unsigned char {
  kFirstStep,  // curvature from the micro-batches of the refresh's first step (PipeFisher)
  kEveryStep   // curvature from every micro-batch of every step of the refresh
};
std::string_view to_string(CurvatureSource source);
CurvatureSource curvature_source_from_string(std::string_view name);

// A task is cut into at most about this many pieces however small the overhead.
inline constexpr double kMinPieceDivisor = 256.0;

std::vector<sched::LinearKind> all_linear_kinds();

struct KfacOptions {
  PackingPolicy policy = PackingPolicy::kBestOfBoth;
  // A task fits a bubble when duration * (1 + margin) fits, and reserves that much of it, so
  // that K-FAC durations up to (1 + margin) times the cost model's never delay pipeline work.
  double safety_margin = 0.05;
  int refresh_steps = 0;  // 0: as few steps as the bubbles allow; >0: fixed interval k
  // The automatic search's cap: when no k up to it runs all curvature and inversion in the
  // bubbles, k is the cap and the rest runs after the flush (with a warning in the report).
  int max_refresh_steps = 64;
  // The automatic search's trade of step time for fresher curvature: a k whose packing leaves
  // curvature, sync or inversion work after the flush is taken when that work, on its busiest
  // worker, is at most this fraction of a step per step (spilled seconds per refresh <= budget *
  // step time * k). 0 (default): only a k that holds all of it in the bubbles, PipeFisher's rule.
  // Where the bubbles hold all of a refresh's work at k + 1 but for a little at k (worker 0 of
  // GPipe/1F1B gets its last curvature only after its last backward), a budget of a few percent
  // reaches the work/bubble bound (docs/pipefisher.md, "Spill budget").
  double spill_budget = 0.0;
  // Free spill (--kfac-free-spill): the automatic search also tries the k below the smallest one
  // that holds all of the work, down to the work/bubble bound, and takes the smallest whose
  // simulated step costs no more than that holding plan's (within 0.1 point of overhead): the
  // work left after the flush runs while the step's slowest worker still preconditions, so the
  // refresh comes sooner for nothing (docs/pipefisher.md, "Free spill"). Needs the automatic k;
  // a plan the spill budget chose is kept as it is.
  bool free_spill = false;
  // Divisible tasks: the pass may cut curvature, inversion and preconditioning into pieces that
  // fill the gaps in hand (false: every task whole, the indivisible pass).
  bool split = true;
  // No piece smaller than this many times the cost model's per-task overhead (nor than
  // 1/kMinPieceDivisor of its task): with 2, every piece does at least as much work as its
  // overhead costs. (10 left the ~90 us gaps of a Chimera end worker unused: k 18 against a
  // bound of 12 for BERT-Base on an H100 at micro-batch 8, D = 8.)
  double min_piece_overheads = 2.0;
  // Split-backward (zero-bubble) schedules: also try the schedule with every W deferred 1, 2, 4
  // forwards/backwards or as late as it may go (defer_weights.h), and keep the best plan.
  bool move_weights = false;
  // Pipelined refresh (--kfac-pipelined-refresh): the refresh's inversions may also run in the
  // first gaps of the next window of k steps (before that window's preconditioning of their
  // Linear), and its inverses serve from the next window's first step on, one step staler than
  // PipeFisher's (which uses them in the window's own last step). The pass keeps the pipelined
  // plan only where it needs fewer steps than the plain one. Off by default: it changes the
  // optimizer (every preconditioning one step staler) and the device runtime does not run it.
  bool pipelined_refresh = false;
  CurvatureSource curvature = CurvatureSource::kFirstStep;
  // All six (built out of line: GCC 12 reports a false maybe-uninitialized on the inlined
  // initializer list in some callers).
  std::vector<sched::LinearKind> linears = all_linear_kinds();
  std::vector<int> layers;  // encoder layers to precondition; empty: all of them
  // Where the K-FAC state lives across the data-parallel replicas (kfac/state_placement.h):
  // sharded placements add the owner's broadcasts of inverses and preconditioned gradients.
  kfac::StatePlacement state_placement;
  // --kfac-sharding auto: the pass chooses state_placement with kfac::choose_state_placement,
  // pricing the link and the inversions with its cost model.
  bool automatic_placement = false;
  double memory_budget_bytes = 0.0;  // per replica, for the automatic choice (0: no limit)
  // (d_in, d_out) of each LinearKind, indexed by it: the broadcasts' bytes and the report's
  // memory and traffic per replica. Empty: replicated state only, memory from the cost model.
  std::vector<kfac::LinearDims> linear_dims;

  // Throws std::invalid_argument naming the bad field by its command-line flag.
  void validate() const;
};

// KfacOptions::linear_dims of a BERT-style encoder layer: (d_in, d_out) of each LinearKind,
// hidden x hidden but for the FFN's hidden -> intermediate and intermediate -> hidden.
std::vector<kfac::LinearDims> encoder_linear_dims(std::int64_t hidden, std::int64_t intermediate);

}  // namespace pf::pipefisher
