#pragma once
// The PipeFisher pass's own types and steps, shared by the files that make up the pass (pass.h is
// its interface): plan.cpp packs the work of one refresh interval k; refresh_search.cpp searches
// for k; refresh_bounds.cpp bounds it from below; emit.cpp writes a plan's schedule;
// pass_report.cpp reports on it; pass.cpp runs them. Private to scheduler/pipefisher/.
#include <array>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "scheduler/pipefisher/kfac_options.h"
#include "scheduler/pipefisher/kfac_work.h"
#include "scheduler/pipefisher/packer.h"
#include "scheduler/pipefisher/pass.h"
#include "scheduler/pipefisher/timeline.h"
#include "scheduler/schedule.h"
#include "sim/cost_model.h"
#include "sim/simulator.h"

namespace pf::pipefisher::pass_internal {

using sched::OpKind;

// The work and the bubbles of one candidate k, shared by the policies that pack them.
struct Prepared {
  int refresh_steps = 1;
  bool pipelined = false;  // the bubbles hold a wrap step k (the next window's first step)
  std::vector<double> last_own_end;      // per worker: the end of its last bubble before the wrap
  std::shared_ptr<const KfacWork> work;  // k = 1: the bounds' work, shared
  BubbleMap bubbles;
};

// The order of the curvature, sync and inversion tasks (packing_order).
enum class PackOrder { kPolicy, kLargestInversionsFirst, kLargestLinearsFirst };

// How one plan is packed: a policy's own packing (the search for k), or one of the
// refinement's (search: other packings of the same work, tried below the k the policies reach).
struct PackVariant {
  PackingPolicy policy = PackingPolicy::kFirstFit;
  PackOrder order = PackOrder::kPolicy;
  // > 0: a piece of a task on one worker without a step bound costs at least this fraction of
  // the worker's longest steady gap (the task stays whole where it is shorter): the long tasks
  // take the long gaps in few pieces and leave the short gaps to the short tasks.
  double long_gap_fraction = 0.0;
};

inline PackVariant of_policy(PackingPolicy policy) {
  PackVariant variant;
  variant.policy = policy;
  return variant;
}

// One complete packing for one k and one policy.
struct Plan {
  int refresh_steps = 1;
  bool pipelined = false;  // a pipelined refresh (KfacOptions::pipelined_refresh)
  PackingPolicy policy = PackingPolicy::kFirstFit;
  int variant = -1;  // >= 0: packed by the refinement's variant of that index (search)
  std::shared_ptr<const Prepared> prepared;
  std::vector<int> order;  // item index -> task index
  PackResult packed;
  double spilled_bound_s = 0.0;
  // Spilled items (no step bound) that no k could place: longer than every steady bubble of one
  // of their workers, or after such an item. The rest spilled for want of room.
  int unavoidable_spills = 0;
  std::string cap_reason;  // non-empty: automatic k stopped at the cap with work after the flush
  int avoidable_spills() const { return packed.spilled_items - unavoidable_spills; }
  double total_after_flush_s = 0.0;  // K-FAC seconds per refresh after a flush, all workers
  // Of the avoidable spills (curvature, sync, inversion), the seconds per refresh after a flush
  // on the worker with the most (KfacOptions::spill_budget).
  double busiest_spill_s = 0.0;
  bool within_budget = false;  // taken below the policies' k for the spill budget
  // A packing of a k below the smallest that holds all of the work, for the free spill
  // (KfacOptions::free_spill): run_on takes it only where its simulated step costs no more.
  bool free_spill_candidate = false;

  const KfacWork& work() const { return *prepared->work; }
  const BubbleMap& bubbles() const { return prepared->bubbles; }
};

// The longest bubble of each worker in a steady step (steps 1 and 2 of a 3-step map; step 0's
// head, before the first forward arrives, can hold no K-FAC work, which all follows a forward):
// for any task, and for collectives. More steps only repeat these bubbles, so a task longer
// than them fits under no refresh interval.
struct LongestBubbles {
  std::vector<double> any, collective;

  // 0 on a worker without bubbles: that is the "no idle time" error's case, not this one.
  bool never_fits(const SmallVector<int, 2>& workers, double duration, double margin) const {
    return std::any_of(workers.begin(), workers.end(), [&](int w) {
      const double longest = (workers.size() > 1 ? collective : any)[static_cast<std::size_t>(w)];
      return longest > 0.0 && duration * (1.0 + margin) > longest;
    });
  }
};

// The cost model's K-FAC task overhead of each kind (sim::CostModel::kfac_task_overhead_s): what
// a task of the kind pays whatever its size, and each piece of it again.
class TaskOverheads {
 public:
  explicit TaskOverheads(const sim::CostModel& costs) {
    for (int k = 0; k < sched::kNumOpKinds; ++k) {
      const auto kind = static_cast<OpKind>(k);
      const double seconds = costs.kfac_task_overhead_s(kind);
      if (!std::isfinite(seconds) || seconds < 0.0) {
        throw std::invalid_argument("PipeFisher pass: the cost model's K-FAC task overhead of " +
                                    std::string(sched::to_string(kind)) + " is " +
                                    std::to_string(seconds) + " s");
      }
      seconds_[static_cast<std::size_t>(k)] = seconds;
    }
  }
  double of(OpKind kind) const { return seconds_[static_cast<std::size_t>(kind)]; }
  double of(const KfacTask& task) const { return of(task.kind()); }

 private:
  std::array<double, sched::kNumOpKinds> seconds_{};
};

// The work/bubble bound on k, and why no k can hold the work (empty when some k may).
struct Bound {
  int steps = 1;
  std::string impossible;
};

// --- plan.cpp: one packing of one k ---

LongestBubbles longest_steady_bubbles(const BubbleMap& map);

// The work and bubbles of a refresh of k steps (`one_step_work`: the work of k = 1, shared).
std::shared_ptr<const Prepared> prepare(const sched::Schedule& base, const Timeline& timeline,
                                        const KfacOptions& options, const DurationFn& duration,
                                        int k,
                                        const std::shared_ptr<const KfacWork>& one_step_work);

bool divisible(const KfacTask& task, const KfacOptions& options, const TaskOverheads& overheads);
double min_piece_seconds(const KfacTask& task, const KfacOptions& options,
                         const TaskOverheads& overheads);
bool fits_under_no_k(const KfacTask& task, const KfacOptions& options,
                     const TaskOverheads& overheads, const LongestBubbles& longest);

// Packs the prepared work with `variant`; `items` is a buffer reused from plan to plan.
Plan make_plan(std::shared_ptr<const Prepared> prepared, const Timeline& timeline,
               const KfacOptions& options, const PackVariant& variant,
               const LongestBubbles& longest, const TaskOverheads& overheads,
               std::vector<PackItem>& items);

// With every_step curvature: why the plan's last step cannot hold its own curvature (empty if
// it can).
std::string last_step_curvature_misfit(const Plan& plan, const KfacOptions& options);

// --- refresh_search.cpp: the search for k ---

// The plans of the search for k: each policy's (the smallest k that holds all of the work, or
// the cap's), then the refinement's, the spill budget's and the free spill's candidates.
std::vector<Plan> search(const sched::Schedule& base, const Timeline& timeline,
                         const KfacOptions& options, const DurationFn& duration,
                         const std::vector<PackingPolicy>& policies, const Bound& bound,
                         const LongestBubbles& longest, const TaskOverheads& overheads,
                         const std::shared_ptr<const KfacWork>& one_step_work);

// The ranking of plans: fewer steps, then less work after a flush.
bool better(const Plan& a, const Plan& b);

// --- refresh_bounds.cpp: lower bounds on k ---

Bound refresh_lower_bound(const sched::Schedule& base, const KfacWork& work, const BubbleMap& map,
                          const LongestBubbles& longest, const KfacOptions& options,
                          const TaskOverheads& overheads);
int release_lower_bound(const sched::Schedule& base, const KfacWork& work, const Timeline& timeline,
                        const BubbleMap& map, const LongestBubbles& longest,
                        const KfacOptions& options, const TaskOverheads& overheads);
int usable_lower_bound(const sched::Schedule& base, const KfacWork& work, const BubbleMap& map,
                       const LongestBubbles& longest, const KfacOptions& options,
                       const TaskOverheads& overheads);

// --- emit.cpp: a plan's schedule ---

bool wraps_collectives(const Plan& plan);
sched::Schedule emit(const sched::Schedule& base, const Plan& plan,
                     const std::vector<kfac::LinearDims>& dims);

// --- pass.cpp and pass_report.cpp ---

std::vector<kfac::LinearDims> state_dims(std::vector<HeldLinear> linears,
                                         const KfacOptions& options);
KfacReport make_report(const sched::Schedule& base, const sim::CostModel& costs,
                       const KfacOptions& options, const Plan& plan, const sim::SimResult& before,
                       const sim::SimResult& after);

}  // namespace pf::pipefisher::pass_internal
