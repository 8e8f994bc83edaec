#include "scheduler/pipefisher/plan.h"

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace pf::pipefisher::pass_internal {

using sched::OpKind;

namespace {

// The free spill tries at most this many k below the smallest that holds all of the work.
constexpr int kFreeSpillSteps = 8;

}  // namespace

// The refinement's packings (search), in the order tried. Each lowered k in a row of the
// 576-configuration sweep where the other three did not; the 15 other packings tried lowered
// none that these miss (docs/pipefisher.md, "Packing").
const std::vector<PackVariant>& refinement_variants() {
  static const std::vector<PackVariant> variants = [] {
    const auto variant = [](PackingPolicy policy, PackOrder order, double long_gap_fraction) {
      PackVariant v;
      v.policy = policy;
      v.order = order;
      v.long_gap_fraction = long_gap_fraction;
      return v;
    };
    return std::vector<PackVariant>{
        // Best-fit, the Linears with the most work first (their long inversions take the long
        // gaps while those are free).
        variant(PackingPolicy::kBestFit, PackOrder::kLargestLinearsFirst, 0.0),
        // Best-fit, in first-fit's order of kinds with the longest inversions first.
        variant(PackingPolicy::kBestFit, PackOrder::kLargestInversionsFirst, 0.0),
        // First-fit, the longest inversions first.
        variant(PackingPolicy::kFirstFit, PackOrder::kLargestInversionsFirst, 0.0),
        // Best-fit, the Linears with the most work first, no piece under half the longest gap.
        variant(PackingPolicy::kBestFit, PackOrder::kLargestLinearsFirst, 0.5),
    };
  }();
  return variants;
}

std::vector<Plan> search(const sched::Schedule& base, const Timeline& timeline,
                         const KfacOptions& options, const DurationFn& duration,
                         const std::vector<PackingPolicy>& policies, const Bound& bound,
                         const LongestBubbles& longest, const TaskOverheads& overheads,
                         const std::shared_ptr<const KfacWork>& one_step_work) {
  std::map<int, std::shared_ptr<const Prepared>> prepared;  // by k, shared by the policies
  std::vector<PackItem> items;                              // make_plan's buffer
  auto plan_for = [&](int k, const PackVariant& variant) {
    auto& entry = prepared[k];
    if (!entry) entry = prepare(base, timeline, options, duration, k, one_step_work);
    return make_plan(entry, timeline, options, variant, longest, overheads, items);
  };
  // Whether packing k steps must leave curvature / sync / inversion after a flush, known without
  // packing: a task (not one that fits no bubble under any k) released after the last bubble of
  // one of its workers ends finds no bubble (worker 0 of GPipe/1F1B gets its last curvature B
  // after the step's last backward: k = 1 never holds it). The pack of such a k is skipped, not
  // changed: where its plan is needed (at the cap, or to say why every_step curvature misfits)
  // it is packed as before.
  const int cap = options.max_refresh_steps;
  std::map<int, bool> spills_for_sure;
  auto surely_spills = [&](int k) {
    if (k >= cap || options.curvature == CurvatureSource::kEveryStep) return false;
    const auto known = spills_for_sure.find(k);
    if (known != spills_for_sure.end()) return known->second;
    auto& entry = prepared[k];
    if (!entry) entry = prepare(base, timeline, options, duration, k, one_step_work);
    const auto& bubbles = entry->bubbles.problem.bubbles;
    bool spills = false;
    for (const KfacTask& task : entry->work->tasks) {
      if (task.step_bound >= 0) continue;
      if (fits_under_no_k(task, options, overheads, longest)) {
        continue;  // spills under every k (spill_early), not counted against k
      }
      double release = 0.0;
      for (const auto& ref : task.base_deps) release = std::max(release, timeline.at(ref).end_s);
      // Pipelined: only inversions and syncs may use the wrap step, and they have no base work.
      spills = std::any_of(task.workers.begin(), task.workers.end(), [&](int w) {
        const auto& mine = bubbles[static_cast<std::size_t>(w)];
        const double last_end = entry->pipelined ? entry->last_own_end[static_cast<std::size_t>(w)]
                                                 : (mine.empty() ? 0.0 : mine.back().end);
        return mine.empty() || last_end <= release;
      });
      if (spills) break;
    }
    spills_for_sure[k] = spills;
    return spills;
  };
  std::vector<Plan> plans;
  // The smallest k of the plans so far that hold all the work (cap + 1: none does).
  const auto smallest_holding_k = [&] {
    int reached = cap + 1;
    for (const Plan& plan : plans) {
      if (plan.cap_reason.empty() && !plan.within_budget && !plan.free_spill_candidate) {
        reached = std::min(reached, plan.refresh_steps);
      }
    }
    return reached;
  };
  for (PackingPolicy policy : policies) {
    if (options.refresh_steps > 0) {
      plans.push_back(plan_for(options.refresh_steps, of_policy(policy)));
      continue;
    }
    // Where no k can hold the work, the cap: the most steps to spread what runs after the flush.
    if (!bound.impossible.empty() || bound.steps > cap) {
      Plan plan = plan_for(cap, of_policy(policy));
      plan.cap_reason = !bound.impossible.empty()
                            ? bound.impossible
                            : "the work/bubble bound " + std::to_string(bound.steps) +
                                  " exceeds --kfac-max-refresh " + std::to_string(cap);
      plans.push_back(std::move(plan));
      continue;
    }
    // Walk up from the lower bound, galloping after a few steps, then bisect between the last k
    // that spilled and the first that did not (spilling shrinks as k grows: more bubbles for
    // the same work).
    int failed = std::max(1, bound.steps) - 1;
    int step = 1;
    int k = std::max(1, bound.steps);
    std::optional<Plan> fits;
    std::optional<Plan> at_cap;
    std::string misfit;
    while (k <= cap) {
      if (!surely_spills(k)) {
        Plan plan = plan_for(k, of_policy(policy));
        if (plan.avoidable_spills() == 0) {
          fits = std::move(plan);
          break;
        }
        if (options.curvature == CurvatureSource::kEveryStep) {
          misfit = last_step_curvature_misfit(plan, options);
          if (!misfit.empty()) break;
        }
        if (k == cap) at_cap = std::move(plan);
      }
      failed = k;
      k = std::min(k + step, std::max(k + 1, cap));
      // One step at a time near the bound (the usual case), doubling beyond.
      if (k - std::max(1, bound.steps) >= 4) step *= 2;
    }
    if (!fits) {
      Plan plan = at_cap ? std::move(*at_cap) : plan_for(cap, of_policy(policy));
      plan.cap_reason = !misfit.empty() ? misfit
                                        : "the work does not fit in the bubbles of " +
                                              std::to_string(cap) + " steps (--kfac-max-refresh)";
      plans.push_back(std::move(plan));
      continue;
    }
    while (fits->refresh_steps - failed > 1) {
      const int middle = failed + (fits->refresh_steps - failed) / 2;
      if (surely_spills(middle)) {
        failed = middle;
        continue;
      }
      Plan plan = plan_for(middle, of_policy(policy));
      if (plan.avoidable_spills() == 0) {
        fits = std::move(plan);
      } else {
        failed = middle;
      }
    }
    plans.push_back(std::move(*fits));
  }
  // The refinement: below the smallest k the policies reached (down to the bound), other
  // packings of the same work, the longest work first, kept where one runs all curvature, sync
  // and inversion in the bubbles. The policies can cut the long inversions into whatever room
  // the short tasks left, more pieces than the long gaps need, each paying the per-task
  // overhead (docs/pipefisher.md, "Packing"). Only with best_of_both's automatic k:
  // first_fit and best_fit stay the policies they name. Where k is at the bound (most rows),
  // nothing more is packed.
  if (options.policy == PackingPolicy::kBestOfBoth && options.refresh_steps == 0 &&
      bound.impossible.empty() && bound.steps <= cap) {
    const int reached = smallest_holding_k();
    const std::vector<PackVariant>& variants = refinement_variants();
    for (int k = reached - 1; k >= std::max(1, bound.steps) && reached <= cap; --k) {
      if (surely_spills(k)) break;
      bool found = false;
      for (std::size_t v = 0; v < variants.size() && !found; ++v) {
        Plan plan = plan_for(k, variants[v]);
        if (plan.avoidable_spills() != 0) continue;
        plan.variant = static_cast<int>(v);
        plans.push_back(std::move(plan));
        found = true;
      }
      if (!found) break;
    }
  }
  // The spill budget (KfacOptions::spill_budget): below the smallest k that holds all of the
  // work, the smallest k whose plan (any policy's) leaves at most the budget's share of each
  // step after the flush on its busiest worker. Only below that k: at it the plan that holds
  // everything stays (a spilling plan of the same k would only cost time).
  if (options.spill_budget > 0.0 && options.refresh_steps == 0 && bound.impossible.empty() &&
      bound.steps <= cap) {
    const int reached = smallest_holding_k();
    bool found = false;
    for (int k = std::max(1, bound.steps); k < reached && !found; ++k) {
      const double allowed = options.spill_budget * timeline.period_s * static_cast<double>(k);
      for (PackingPolicy policy : policies) {
        Plan plan = plan_for(k, of_policy(policy));
        if (plan.busiest_spill_s > allowed) continue;
        plan.within_budget = true;
        plans.push_back(std::move(plan));
        found = true;
        break;
      }
    }
  }
  // The free spill (KfacOptions::free_spill): below the smallest k that holds all of the work,
  // down to the bound, each k's packing with the least work after the flush (of the policies'),
  // at most kFreeSpillSteps of them: run_on simulates them from the largest k down.
  if (options.free_spill && options.refresh_steps == 0 && bound.impossible.empty() &&
      bound.steps <= cap) {
    const int reached = smallest_holding_k();
    const int lowest = std::max({1, bound.steps, reached - kFreeSpillSteps});
    for (int k = reached - 1; k >= lowest && reached <= cap; --k) {
      std::optional<Plan> least;
      for (PackingPolicy policy : policies) {
        Plan plan = plan_for(k, of_policy(policy));
        if (!least || plan.total_after_flush_s < least->total_after_flush_s) {
          least = std::move(plan);
        }
      }
      least->free_spill_candidate = true;
      plans.push_back(std::move(*least));
    }
  }
  return plans;
}

// Fewer steps, then less work after a flush; a pipelined plan (one step staler) only where it
// wins on those.
bool better(const Plan& a, const Plan& b) {
  return std::make_tuple(a.refresh_steps, a.total_after_flush_s, a.packed.spilled_items,
                         a.pipelined) < std::make_tuple(b.refresh_steps, b.total_after_flush_s,
                                                        b.packed.spilled_items, b.pipelined);
}

}  // namespace pf::pipefisher::pass_internal
