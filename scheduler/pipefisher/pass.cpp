#include "scheduler/pipefisher/pass.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>

#include "kfac/pieces.h"
#include "scheduler/pipefisher/defer_weights.h"
#include "scheduler/pipefisher/kfac_work.h"
#include "scheduler/pipefisher/packer.h"
#include "scheduler/pipefisher/timeline.h"
#include "scheduler/validate.h"

namespace pf::pipefisher {
namespace {

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

PackVariant of_policy(PackingPolicy policy) {
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

// Curvature, sync and inversion go first, then the preconditions of all but the refresh's last
// step (bound to their step, in what room the refresh leaves them: one that finds none runs
// after the flush, as PipeFisher runs all of them), then the last step's preconditions, which
// need the new inverses. Refresh first: the bubbles then hold as much of the refresh as they
// can, so k reaches the work/bubble bound (preconditions first took the room the refresh needed
// and cost steps: in the divisible-task sweep, docs/pipefisher.md, k was at the bound in 104 of
// 576 configurations that way against 304 this way, at about the same mean step-time overhead).
// First-fit keeps PipeFisher's priority order (all curvature A, all curvature B, syncs,
// inversions); best-fit goes factor by factor (one Linear's curvature, sync and inversions
// before the next Linear's), so that large inversions are placed while large bubbles are
// still free instead of all at the end.
// `order` (the refinement's variants, search): kLargestInversionsFirst keeps the kinds' order
// (curvature A, curvature B, syncs, inversions, broadcasts) and puts the longest inversions
// first; kLargestLinearsFirst takes best-fit's Linear-by-Linear order with the Linears of most
// work first.
std::vector<int> packing_order(const KfacWork& work, PackingPolicy policy,
                               PackOrder pack_order = PackOrder::kPolicy) {
  std::vector<int> order;
  order.reserve(work.tasks.size());
  const int last = work.refresh_steps - 1;
  std::vector<int> early;
  for (std::size_t t = 0; t < work.tasks.size(); ++t) {
    const auto& task = work.tasks[t];
    if (is_per_step(task.kind()) && task.step_bound < last) {
      early.push_back(static_cast<int>(t));
    }
  }
  std::vector<int> middle;
  for (std::size_t t = 0; t < work.tasks.size(); ++t) {
    if (!is_per_step(work.tasks[t].kind())) middle.push_back(static_cast<int>(t));
  }
  if (pack_order == PackOrder::kLargestInversionsFirst) {
    const auto rank = [&](int t) {
      switch (work.tasks[static_cast<std::size_t>(t)].kind()) {
        case OpKind::kCurvatureA:
          return 0;
        case OpKind::kCurvatureB:
          return 1;
        case OpKind::kCurvatureSync:
          return 2;
        case OpKind::kInvertA:
        case OpKind::kInvertB:
          return 3;
        default:
          return 4;
      }
    };
    std::stable_sort(middle.begin(), middle.end(), [&](int a, int b) {
      const int ra = rank(a), rb = rank(b);
      if (ra != rb) return ra < rb;
      if (ra != 3) return false;
      return work.tasks[static_cast<std::size_t>(a)].duration_s >
             work.tasks[static_cast<std::size_t>(b)].duration_s;
    });
  } else if (policy == PackingPolicy::kBestFit) {
    // Stable: within a Linear the work model's order (curvature, sync, inversion) stays. A
    // counting sort over the few (layer, Linear) keys: linear in the tasks (a comparison sort
    // of ~800k tasks was a tenth of the pass at p = 64, m = 1024).
    std::vector<std::pair<int, int>> keys;
    keys.reserve(middle.size());
    for (int t : middle) {
      const auto& in = work.tasks[static_cast<std::size_t>(t)].instructions[0];
      keys.emplace_back(in.layer, static_cast<int>(in.linear));
    }
    std::vector<std::pair<int, int>> distinct;  // the keys come in runs: dedupe those first
    for (const auto& key : keys) {
      if (distinct.empty() || distinct.back() != key) distinct.push_back(key);
    }
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    std::vector<std::size_t> bucket(keys.size());
    std::vector<std::size_t> next(distinct.size() + 1, 0);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      bucket[i] = static_cast<std::size_t>(
          std::lower_bound(distinct.begin(), distinct.end(), keys[i]) - distinct.begin());
    }
    if (pack_order == PackOrder::kLargestLinearsFirst) {
      // The Linears with the most curvature, sync and inversion work first (ties: by key).
      std::vector<double> weight(distinct.size(), 0.0);
      for (std::size_t i = 0; i < keys.size(); ++i) {
        weight[bucket[i]] += work.tasks[static_cast<std::size_t>(middle[i])].duration_s;
      }
      std::vector<std::size_t> by_weight(distinct.size());
      for (std::size_t d = 0; d < by_weight.size(); ++d) by_weight[d] = d;
      std::stable_sort(by_weight.begin(), by_weight.end(),
                       [&](std::size_t a, std::size_t b) { return weight[a] > weight[b]; });
      std::vector<std::size_t> rank_of(distinct.size());
      for (std::size_t r = 0; r < by_weight.size(); ++r) rank_of[by_weight[r]] = r;
      for (auto& b : bucket) b = rank_of[b];
    }
    for (std::size_t i = 0; i < keys.size(); ++i) ++next[bucket[i] + 1];
    for (std::size_t b = 1; b < next.size(); ++b) next[b] += next[b - 1];
    std::vector<int> sorted(middle.size());
    for (std::size_t i = 0; i < middle.size(); ++i) sorted[next[bucket[i]]++] = middle[i];
    middle = std::move(sorted);
  }
  order.insert(order.end(), middle.begin(), middle.end());
  order.insert(order.end(), early.begin(), early.end());
  for (std::size_t t = 0; t < work.tasks.size(); ++t) {
    const auto& task = work.tasks[t];
    if (is_per_step(task.kind()) && task.step_bound == last) {
      order.push_back(static_cast<int>(t));
    }
  }
  return order;
}

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

LongestBubbles longest_steady_bubbles(const BubbleMap& map) {
  LongestBubbles out;
  const auto& bubbles = map.problem.bubbles;
  out.any.assign(bubbles.size(), 0.0);
  out.collective.assign(bubbles.size(), 0.0);
  for (std::size_t w = 0; w < bubbles.size(); ++w) {
    for (const Bubble& b : bubbles[w]) {
      if (b.step < 1) continue;
      out.any[w] = std::max(out.any[w], b.end - b.start);
      if (b.accepts_collective) out.collective[w] = std::max(out.collective[w], b.end - b.start);
    }
  }
  return out;
}

// `one_step_work`: build_kfac_work(base, options, 1, duration), built once for the bounds.
std::shared_ptr<const Prepared> prepare(const sched::Schedule& base, const Timeline& timeline,
                                        const KfacOptions& options, const DurationFn& duration,
                                        int k,
                                        const std::shared_ptr<const KfacWork>& one_step_work) {
  auto prepared = std::make_shared<Prepared>();
  prepared->refresh_steps = k;
  prepared->pipelined = options.pipelined_refresh;
  prepared->work =
      k == 1 && !options.pipelined_refresh
          ? one_step_work
          : std::make_shared<const KfacWork>(build_kfac_work(base, options, k, duration));
  if (!options.pipelined_refresh) {
    prepared->bubbles = find_bubbles(base, timeline, k);
  } else {
    // One step more: step k is the next window's first step (the steady state's), whose
    // bubbles are step 0's of the repeated schedule: each pairs with the step-0 bubble of the
    // same slot (the i-th of that position with the i-th), and the two share their room.
    prepared->bubbles = find_bubbles(base, timeline, k + 1);
    auto& map = prepared->bubbles;
    map.problem.wrap_step = k;
    const double window_end = timeline.end_of_steps(k);
    for (std::size_t w = 0; w < map.problem.bubbles.size(); ++w) {
      auto& bubbles = map.problem.bubbles[w];
      // The window's gaps end with it (as find_bubbles(k) has them): the part of its last
      // step's trailing gap after the window's end is the next window's head (the wait for its
      // first forward), a wrap-step bubble whose twin is step 0's head.
      std::size_t last = bubbles.size();
      for (std::size_t i = 0; i < bubbles.size(); ++i) {
        if (bubbles[i].step == k - 1) last = i;
      }
      if (last < bubbles.size() && bubbles[last].end > window_end) {
        const auto& stream = base.streams[w];
        int head = 0;  // the step's first compute, ahead of the receives that feed it
        while (head < static_cast<int>(stream.size()) &&
               !sched::is_compute(stream[static_cast<std::size_t>(head)].kind)) {
          ++head;
        }
        while (head > 0 && sched::is_receive(stream[static_cast<std::size_t>(head - 1)].kind)) {
          --head;
        }
        Bubble tail = bubbles[last];
        tail.step = k;
        tail.start = std::max(tail.start, window_end);
        tail.slot = static_cast<int>(map.slots[w].size());
        map.slots[w].push_back(Slot{k, head});
        if (bubbles[last].start < window_end) {
          bubbles[last].end = window_end;
          bubbles.insert(bubbles.begin() + static_cast<std::ptrdiff_t>(last) + 1, tail);
        } else {
          bubbles[last] = tail;
        }
      }
      std::map<std::pair<int, int>, int> first_step;  // (position, ordinal) -> step-0 bubble
      std::map<int, int> ordinal;
      double last_own = 0.0;
      for (std::size_t i = 0; i < bubbles.size(); ++i) {
        const int position = map.slots[w][static_cast<std::size_t>(bubbles[i].slot)].position;
        if (bubbles[i].step == 0) first_step[{position, ordinal[position]++}] = static_cast<int>(i);
        if (bubbles[i].step < k) last_own = bubbles[i].end;
      }
      prepared->last_own_end.push_back(last_own);
      ordinal.clear();
      for (std::size_t i = 0; i < bubbles.size(); ++i) {
        if (bubbles[i].step != k) continue;
        const int position = map.slots[w][static_cast<std::size_t>(bubbles[i].slot)].position;
        const auto twin = first_step.find({position, ordinal[position]++});
        if (twin == first_step.end()) continue;
        bubbles[i].twin = twin->second;
        bubbles[static_cast<std::size_t>(twin->second)].twin = static_cast<int>(i);
      }
    }
  }
  return prepared;
}

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

// Whether the pass may cut the task into pieces (a divisible kind, on one worker or, a curvature
// sync, on two replicas; work beyond its kind's per-task overhead).
bool divisible(const KfacTask& task, const KfacOptions& options, const TaskOverheads& overheads) {
  return options.split && task.workers.size() <= 2 && sched::is_divisible(task.kind()) &&
         task.duration_s > overheads.of(task);
}

// The smallest piece the pass cuts a divisible task into.
double min_piece_seconds(const KfacTask& task, const KfacOptions& options,
                         const TaskOverheads& overheads) {
  return std::max(options.min_piece_overheads * overheads.of(task),
                  task.duration_s / kMinPieceDivisor);
}

// Whether no refresh interval holds the task: an indivisible one longer than every steady gap of
// a worker, or a divided collective whose smallest piece is (each member's longest gap that
// accepts a collective: a necessary condition for a common window). It runs after a flush.
bool fits_under_no_k(const KfacTask& task, const KfacOptions& options,
                     const TaskOverheads& overheads, const LongestBubbles& longest) {
  if (!divisible(task, options, overheads)) {
    return longest.never_fits(task.workers, task.duration_s, options.safety_margin);
  }
  return task.workers.size() > 1 &&
         longest.never_fits(task.workers, min_piece_seconds(task, options, overheads),
                            options.safety_margin);
}

// A pipelined plan is packed again with more of step 0 held for the wrapped work at most this
// many times (make_plan).
constexpr int kWrapHoldRounds = 4;
// The free spill tries at most this many k below the smallest that holds all of the work.
constexpr int kFreeSpillSteps = 8;

// `items`: a buffer reused from plan to plan (its contents are replaced): at p = 64, m = 1024 the
// items of one plan take ~60 MB, and a fresh buffer per plan cost as much in page faults as
// building the items.
Plan make_plan(std::shared_ptr<const Prepared> prepared, const Timeline& timeline,
               const KfacOptions& options, const PackVariant& variant,
               const LongestBubbles& longest, const TaskOverheads& overheads,
               std::vector<PackItem>& items) {
  const PackingPolicy policy = variant.policy;
  Plan plan;
  plan.refresh_steps = prepared->refresh_steps;
  plan.pipelined = prepared->pipelined;
  plan.policy = policy;
  plan.prepared = std::move(prepared);
  const KfacWork& work = plan.work();
  plan.order = packing_order(work, policy, variant.order);
  std::vector<int> item_of(work.tasks.size(), -1);
  for (std::size_t i = 0; i < plan.order.size(); ++i) {
    item_of[static_cast<std::size_t>(plan.order[i])] = static_cast<int>(i);
  }
  // A pipelined refresh: each Linear on each worker is a state key, and its inversions may run
  // in the next window until that window's first preconditioning of it starts (its release:
  // the step-0 precondition's base work, one window later).
  using LinearOnWorker = std::tuple<int, int, int, int>;  // worker, pipeline, layer, linear
  std::map<LinearOnWorker, int> state_keys;
  std::map<LinearOnWorker, double> wrap_deadline;
  const auto linear_of = [](const KfacTask& task) {
    const auto& in = task.instructions[0];
    return LinearOnWorker{task.workers[0], in.pipeline, in.layer, static_cast<int>(in.linear)};
  };
  if (plan.pipelined) {
    for (const KfacTask& task : work.tasks) {
      if (task.workers.size() != 1) continue;
      state_keys.emplace(linear_of(task), static_cast<int>(state_keys.size()));
      if (task.kind() != OpKind::kPrecondition || task.step_bound != 0) continue;
      double release = 0.0;
      for (BaseRef ref : task.base_deps) {
        ref.step = plan.refresh_steps;
        release = std::max(release, timeline.at(ref).end_s);
      }
      wrap_deadline[linear_of(task)] = release;
    }
  }
  items.clear();
  items.reserve(plan.order.size());
  for (int t : plan.order) {
    const KfacTask& task = work.tasks[static_cast<std::size_t>(t)];
    PackItem item;
    // Its inversions and preconditioning share a Linear's state with the previous refresh's
    // wrapped inversions (finalized factors, inverse chains, inverses); the curvature of the
    // window does not (it accumulates into a second set of factor sums).
    const bool uses_inverse_state = task.kind() == OpKind::kInvertA ||
                                    task.kind() == OpKind::kInvertB ||
                                    task.kind() == OpKind::kPrecondition;
    if (plan.pipelined && task.workers.size() == 1 && uses_inverse_state) {
      item.state_key = state_keys.at(linear_of(task));
      const auto deadline = wrap_deadline.find(linear_of(task));
      item.wrappable = (task.kind() == OpKind::kInvertA || task.kind() == OpKind::kInvertB) &&
                       deadline != wrap_deadline.end();
      if (item.wrappable) item.wrap_deadline = deadline->second;
    }
    if (plan.pipelined && task.kind() == OpKind::kCurvatureSync) {
      // The sync may run on into the next window too (on the sums set aside there), ending
      // before the inversions after it: by the earliest deadline of its members' Linear.
      double deadline = std::numeric_limits<double>::infinity();
      bool known = true;
      for (std::size_t r = 0; r < task.workers.size(); ++r) {
        const auto& in = task.instructions[r];
        const auto found = wrap_deadline.find(
            LinearOnWorker{task.workers[r], in.pipeline, in.layer, static_cast<int>(in.linear)});
        if (found == wrap_deadline.end()) {
          known = false;
        } else {
          deadline = std::min(deadline, found->second);
        }
      }
      item.wrappable = known;
      item.wrap_deadline = deadline;
    }
    item.workers = task.workers;
    item.duration = task.duration_s;
    for (const auto& ref : task.base_deps) {
      item.release = std::max(item.release, timeline.at(ref).end_s);
    }
    for (int dep : task.task_deps) item.preds.push_back(item_of[static_cast<std::size_t>(dep)]);
    item.step_bound = task.step_bound;
    // A divisible task fits any gap piece by piece; an indivisible one longer than every steady
    // gap fits under no k.
    item.spill_early = item.step_bound < 0 && fits_under_no_k(task, options, overheads, longest);
    if (divisible(task, options, overheads) && !item.spill_early) {
      item.divisible = true;
      item.overhead = overheads.of(task);
      item.min_piece = min_piece_seconds(task, options, overheads);
      if (variant.long_gap_fraction > 0.0 && item.workers.size() == 1 && item.step_bound < 0) {
        const double gap = longest.any[static_cast<std::size_t>(item.workers[0])];
        item.min_piece =
            std::min(task.duration_s, std::max(item.min_piece, variant.long_gap_fraction * gap /
                                                                   (1.0 + options.safety_margin)));
      }
    }
    items.push_back(std::move(item));
  }
  const auto after_flush = [&](const PackResult& packed) {
    double seconds = 0.0;
    for (std::size_t i = 0; i < items.size(); ++i) {
      seconds += packed.placements[i].spilled_s * static_cast<double>(items[i].workers.size());
    }
    return seconds;
  };
  plan.packed = pack(plan.bubbles().problem, items, policy, options.safety_margin);
  plan.total_after_flush_s = after_flush(plan.packed);
  if (plan.pipelined) {
    // The window's step-0 items (curvature, preconditions) come first in the order and fill the
    // step-0 bubbles, whose wrap-step twins the wrapped work then finds full: it spills. Hold
    // the head of step-0 room back for it (pack's wrap_hold), as much more per worker as spilled
    // of it, while that lowers the spilled items, then the work after a flush (the hold takes
    // room from the window's own work, which may spill instead).
    std::vector<double> hold(plan.bubbles().problem.bubbles.size(), 0.0);
    for (int round = 0; round < kWrapHoldRounds; ++round) {
      bool more = false;
      for (std::size_t i = 0; i < items.size(); ++i) {
        const double spilled = plan.packed.placements[i].spilled_s;
        if (!items[i].wrappable || !(spilled > 0.0)) continue;
        for (int w : items[i].workers) {
          hold[static_cast<std::size_t>(w)] += spilled * (1.0 + options.safety_margin);
        }
        more = true;
      }
      if (!more) break;
      PackResult held = pack(plan.bubbles().problem, items, policy, options.safety_margin, hold);
      const double held_after_flush = after_flush(held);
      if (std::make_pair(held.spilled_items, held_after_flush) >=
          std::make_pair(plan.packed.spilled_items, plan.total_after_flush_s)) {
        break;
      }
      plan.packed = std::move(held);
      plan.total_after_flush_s = held_after_flush;
    }
  }
  std::vector<bool> unavoidable(items.size(), false);
  for (std::size_t i = 0; i < items.size(); ++i) {
    const auto& item = items[i];
    const bool spilled = plan.packed.placements[i].spilled;
    if (spilled && item.step_bound >= 0) {
      plan.spilled_bound_s += plan.packed.placements[i].spilled_s;
    }
    if (item.step_bound >= 0) continue;
    unavoidable[i] = item.spill_early;
    if (unavoidable[i] && spilled) ++plan.unavoidable_spills;
  }
  std::vector<double> spilled_on(plan.bubbles().problem.bubbles.size(), 0.0);
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (items[i].step_bound >= 0 || unavoidable[i] || !plan.packed.placements[i].spilled) continue;
    for (int w : items[i].workers) {
      double& on = spilled_on[static_cast<std::size_t>(w)];
      on += plan.packed.placements[i].spilled_s;
      plan.busiest_spill_s = std::max(plan.busiest_spill_s, on);
    }
  }
  return plan;
}

// For each policy, the smallest k whose packing needs no curvature / sync / inversion after a
// flush (per-step preconditioning may still spill: it is needed every step whatever k is; so may
// a task longer than every steady bubble, which no k can hold), or the fixed k. The policies share
// each candidate k's work and bubbles. With curvature from every step, the last step's curvature,
// and the syncs and inversions after it, must fit in that step's bubbles. Where a worker has no
// bubble left after them (worker 0 of GPipe/1F1B ends the step with a backward), no refresh
// interval can hold them: say so instead of searching on.
std::string last_step_curvature_misfit(const Plan& plan, const KfacOptions& options) {
  const int last = plan.refresh_steps - 1;
  for (std::size_t i = 0; i < plan.order.size(); ++i) {
    if (!plan.packed.placements[i].spilled) continue;
    // Every sync and inversion waits for the last step's curvature too.
    const KfacTask& task = plan.work().tasks[static_cast<std::size_t>(plan.order[i])];
    if (is_per_step(task.kind())) continue;
    const bool collective = sched::is_kfac_collective(task.kind());
    const double release = plan.packed.placements[i].start;
    double room_after = std::numeric_limits<double>::infinity();
    for (int w : task.workers) {
      double room = 0.0;  // bubble time of the last step after the task's release
      for (const Bubble& b : plan.bubbles().problem.bubbles[static_cast<std::size_t>(w)]) {
        if (b.step == last && b.end > release && (b.accepts_collective || !collective)) {
          room += b.end - std::max(b.start, release);
        }
      }
      room_after = std::min(room_after, room);
    }
    const int w = task.workers[0];
    if (room_after < task.duration_s * (1.0 + options.safety_margin)) {
      return "with every_step curvature (--kfac-curvature), " +
             sched::short_label(task.instructions[0]) + " on worker " + std::to_string(w) +
             " finds no bubble after its release in the refresh's last step, so no refresh "
             "interval can hold it";
    }
  }
  return {};
}

// The work/bubble bound on k, and why no k can hold the work (empty when some k may).
struct Bound {
  int steps = 1;
  std::string impossible;
};

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

// A lower bound on k: no worker can do more K-FAC work in k steps than k steps' bubbles hold.
// Tasks no bubble can hold, and the work after them, run after a flush whatever k is: they do
// not bound k.
Bound refresh_lower_bound(const sched::Schedule& base, const KfacWork& work, const BubbleMap& map,
                          const LongestBubbles& longest, const KfacOptions& options,
                          const TaskOverheads& overheads) {
  // Per worker: curvature (repeated every step with every_step curvature) and the rest.
  std::vector<double> curvature(static_cast<std::size_t>(base.num_workers()), 0.0);
  std::vector<double> rest(curvature.size(), 0.0);
  const bool every_step = options.curvature == CurvatureSource::kEveryStep;
  std::vector<bool> spills_anyway(work.tasks.size(), false);
  for (std::size_t t = 0; t < work.tasks.size(); ++t) {
    const auto& task = work.tasks[t];
    if (is_per_step(task.kind())) continue;
    spills_anyway[t] = fits_under_no_k(task, options, overheads, longest);
    if (spills_anyway[t]) continue;
    const bool per_step =
        every_step && (task.kind() == OpKind::kCurvatureA || task.kind() == OpKind::kCurvatureB);
    for (int w : task.workers) {
      (per_step ? curvature : rest)[static_cast<std::size_t>(w)] +=
          task.duration_s * (1.0 + options.safety_margin);
    }
  }
  Bound bound;
  for (std::size_t w = 0; w < rest.size(); ++w) {
    if (curvature[w] + rest[w] <= 0.0) continue;
    // Idle time per step in the steady state (PipeFisher's bubble). Step 0's is larger by the
    // wait for the first forward, which no K-FAC work can use (all of it follows a forward).
    const double steady = map.capacity_s[w][1];
    const double capacity = steady;
    if (!(capacity > 0.0)) {
      if (bound.impossible.empty()) {
        bound.impossible = "worker " + std::to_string(w) + " has no idle time to fill";
      }
      continue;
    }
    if (every_step && curvature[w] >= steady) {
      bound.impossible = "with every_step curvature (--kfac-curvature), worker " +
                         std::to_string(w) + " needs " + std::to_string(1e3 * curvature[w]) +
                         " ms of curvature per step but its bubbles hold " +
                         std::to_string(1e3 * steady) + " ms";
      continue;
    }
    // k * capacity >= k * curvature + rest.
    const double steps = std::ceil(rest[w] / (capacity - curvature[w]) - 1e-9);
    bound.steps = std::max(bound.steps, static_cast<int>(std::min(steps, 1e9)));
  }
  return bound;
}

// The bound with release times: per worker, the refresh's curvature, sync and inversion run
// as a fluid (cut anywhere, no overhead beyond each task's own, the margin kept) through the gaps
// that can hold at least one piece, each task from its release on (curvature after its forward
// or backward, sync and inversion after the curvature they need); k is the step whose gaps
// finish it, + 1, the max over workers. A lower bound on any k the packer reaches (up to gaps
// that a whole task shorter than a minimum piece could still use); it exceeds refresh_bound
// where a worker's first-step gaps come before most of its work is released (worker 0 of
// GPipe/1F1B only gets its curvature B after its last backward, at the end of the step). -1
// with every_step curvature (not computed) or where no k can hold the work.
int release_lower_bound(const sched::Schedule& base, const KfacWork& work, const Timeline& timeline,
                        const BubbleMap& map, const LongestBubbles& longest,
                        const KfacOptions& options, const TaskOverheads& overheads) {
  if (options.curvature != CurvatureSource::kFirstStep) return -1;
  const double margin = 1.0 + options.safety_margin;
  std::vector<double> release(work.tasks.size(), 0.0);
  // Per worker: (release, seconds) of the work, and the smallest piece a gap must hold.
  std::vector<std::vector<std::pair<double, double>>> items(
      static_cast<std::size_t>(base.num_workers()));
  std::vector<double> smallest(items.size(), std::numeric_limits<double>::infinity());
  for (std::size_t t = 0; t < work.tasks.size(); ++t) {
    const KfacTask& task = work.tasks[t];
    for (const auto& ref : task.base_deps)
      release[t] = std::max(release[t], timeline.at(ref).end_s);
    for (int dep : task.task_deps) {
      release[t] = std::max(release[t], release[static_cast<std::size_t>(dep)]);
    }
    if (is_per_step(task.kind())) continue;
    const bool cut = divisible(task, options, overheads);
    // What no k can hold runs after a flush whatever k is: it does not bound k (as for the
    // work/bubble bound).
    if (fits_under_no_k(task, options, overheads, longest)) continue;
    const double piece =
        cut ? std::min(task.duration_s, min_piece_seconds(task, options, overheads))
            : task.duration_s;
    for (int w : task.workers) {
      items[static_cast<std::size_t>(w)].emplace_back(release[t], task.duration_s * margin);
      smallest[static_cast<std::size_t>(w)] =
          std::min(smallest[static_cast<std::size_t>(w)], piece * margin);
    }
  }
  int bound = 1;
  for (std::size_t w = 0; w < items.size(); ++w) {
    auto& work_of = items[w];
    if (work_of.empty()) continue;
    std::sort(work_of.begin(), work_of.end());
    const auto& bubbles = map.problem.bubbles[w];
    double usable_steady = 0.0;  // step 1 of the map is a whole steady step
    for (const Bubble& b : bubbles) {
      if (b.step == 1 && b.end - b.start >= smallest[w]) usable_steady += b.end - b.start;
    }
    std::size_t next = 0;
    double pending = 0.0;
    int finished_step = -1;
    for (const Bubble& b : bubbles) {
      if (b.end - b.start < smallest[w]) continue;
      double t = b.start;
      while (t < b.end) {
        while (next < work_of.size() && work_of[next].first <= t) pending += work_of[next++].second;
        const double next_release =
            next < work_of.size() ? work_of[next].first : std::numeric_limits<double>::infinity();
        const double until = std::min(b.end, next_release);
        const double done = std::min(pending, until - t);
        pending -= done;
        t = pending > 0.0 ? t + done : until;
        if (pending <= 0.0 && next == work_of.size()) break;
      }
      if (pending <= 1e-15 && next == work_of.size()) {
        finished_step = b.step;
        break;
      }
    }
    if (finished_step < 0) {
      // The rest goes through later steady steps, usable_steady at a time.
      for (; next < work_of.size(); ++next) pending += work_of[next].second;
      if (!(usable_steady > 0.0)) return -1;
      finished_step =
          map.problem.num_steps - 1 + static_cast<int>(std::ceil(pending / usable_steady - 1e-9));
    }
    bound = std::max(bound, finished_step + 1);
  }
  return bound;
}

// The bound in usable gaps: the work/bubble bound with only the idle time that can hold K-FAC
// pieces, and every piece paying the per-task overhead. Per worker, of a steady step's gaps only
// those that hold the smallest piece the pass cuts of the worker's work count (a piece's cost
// includes its overhead; an indivisible task is one piece). Three lower bounds on k, the largest
// wins, the max over workers:
// - the work over the usable idle time;
// - the work beyond each task's own overhead over the usable idle time less one overhead per
//   usable gap, the smallest of the worker's kinds' (every gap that holds work holds a piece that
//   pays at least that);
// - the work plus the overheads of the pieces each task needs at least (no piece costs more than
//   the longest usable gap holds, gap / (1 + margin): a task of d seconds is at least
//   ceil((d - o) / (gap / (1 + margin) - o)) pieces, each past its first paying o again) over the
//   usable idle time.
// With every_step curvature the step's own curvature is taken from each step's room first, as in
// the work/bubble bound. Every usable gap counts for every task (releases aside: release_bound),
// and the last piece of a task, which may be shorter than a minimum piece, uses only the gaps
// that hold one. >= refresh_bound; -1 where the work/bubble bound is impossible or a worker with
// work has no usable idle time left for it.
int usable_lower_bound(const sched::Schedule& base, const KfacWork& work, const BubbleMap& map,
                       const LongestBubbles& longest, const KfacOptions& options,
                       const TaskOverheads& overheads) {
  const double margin = 1.0 + options.safety_margin;
  const bool every_step = options.curvature == CurvatureSource::kEveryStep;
  const auto workers = static_cast<std::size_t>(base.num_workers());
  struct Held {
    double seconds;   // the whole task
    double overhead;  // its kind's
    bool divisible;
    bool repeated;  // every_step curvature: in every step
  };
  std::vector<std::vector<Held>> held(workers);
  std::vector<double> smallest(workers, std::numeric_limits<double>::infinity());
  for (const KfacTask& task : work.tasks) {
    if (is_per_step(task.kind())) continue;
    if (fits_under_no_k(task, options, overheads, longest)) continue;
    const bool cut = divisible(task, options, overheads);
    const double piece =
        cut ? std::min(task.duration_s, min_piece_seconds(task, options, overheads))
            : task.duration_s;
    for (int w : task.workers) {
      const auto v = static_cast<std::size_t>(w);
      held[v].push_back(Held{task.duration_s, overheads.of(task), cut,
                             every_step && (task.kind() == OpKind::kCurvatureA ||
                                            task.kind() == OpKind::kCurvatureB)});
      smallest[v] = std::min(smallest[v], piece * margin);
    }
  }
  int bound = 1;
  for (std::size_t w = 0; w < workers; ++w) {
    if (held[w].empty()) continue;
    // A steady step's usable idle time: [0] whole, [1] less an overhead per gap (the smallest of
    // the worker's tasks'), [2] whole.
    double gap_overhead = std::numeric_limits<double>::infinity();
    for (const Held& task : held[w]) gap_overhead = std::min(gap_overhead, task.overhead);
    std::array<double, 3> room{0.0, 0.0, 0.0};
    double largest = 0.0;
    for (const Bubble& b : map.problem.bubbles[w]) {
      if (b.step != 1 || b.end - b.start < smallest[w]) continue;
      room[0] += b.end - b.start;
      room[1] += std::max(0.0, b.end - b.start - gap_overhead * margin);
      largest = std::max(largest, b.end - b.start);
    }
    room[2] = room[0];
    // The work against each: [0] whole, [1] beyond each task's own overhead, [2] whole with the
    // overheads of the fewest pieces; per step (every_step curvature) and the rest.
    std::array<double, 3> per_step{0.0, 0.0, 0.0}, rest{0.0, 0.0, 0.0};
    const double longest_piece = largest / margin;  // the most a piece may cost
    for (const Held& task : held[w]) {
      auto& sum = task.repeated ? per_step : rest;
      double pieces = 1.0;
      const double o = task.overhead;
      if (task.divisible && task.seconds > longest_piece) {
        pieces = longest_piece > o ? std::ceil((task.seconds - o) / (longest_piece - o) - 1e-9)
                                   : std::numeric_limits<double>::infinity();
      }
      sum[0] += task.seconds * margin;
      sum[1] += std::max(0.0, task.seconds - o) * margin;
      sum[2] += (task.seconds + (pieces - 1.0) * o) * margin;
    }
    for (std::size_t part = 0; part < room.size(); ++part) {
      const double left = room[part] - per_step[part];
      const double need = rest[part];
      if (need <= 0.0) {
        if (left < 0.0) return -1;
        continue;
      }
      if (!(left > 0.0) || !std::isfinite(need)) return -1;
      const double steps = std::ceil(need / left - 1e-9);
      bound = std::max(bound, static_cast<int>(std::min(steps, 1e9)));
    }
  }
  return bound;
}

// Fewer steps, then less work after a flush; a pipelined plan (one step staler) only where it
// wins on those.
bool better(const Plan& a, const Plan& b) {
  return std::make_tuple(a.refresh_steps, a.total_after_flush_s, a.packed.spilled_items,
                         a.pipelined) < std::make_tuple(b.refresh_steps, b.total_after_flush_s,
                                                        b.packed.spilled_items, b.pipelined);
}

// The payload of a curvature-sync piece: its rows of both factors (kfac::piece_items, as the
// executor's sync of a row range), fp32; 0 where the Linears' dimensions are not given.
std::int64_t sync_piece_bytes(const sched::Instruction& in,
                              const std::vector<kfac::LinearDims>& dims) {
  if (dims.empty()) return 0;
  const auto& d = dims[static_cast<std::size_t>(in.linear)];
  const auto rows_a = kfac::piece_items(d.d_in, in.piece_begin, in.piece_end).size();
  const auto rows_b = kfac::piece_items(d.d_out, in.piece_begin, in.piece_end).size();
  return 4 * (rows_a * d.d_in + rows_b * d.d_out);
}

// Whether a pipelined plan runs part of a collective (a curvature sync) in the next window.
bool wraps_collectives(const Plan& plan) {
  const int wrap = plan.bubbles().problem.wrap_step;
  if (wrap < 0) return false;
  for (std::size_t i = 0; i < plan.order.size(); ++i) {
    const KfacTask& task = plan.work().tasks[static_cast<std::size_t>(plan.order[i])];
    if (!sched::is_kfac_collective(task.kind())) continue;
    const ItemPlacement& placed = plan.packed.placements[i];
    if (placed.step == wrap) return true;
    for (const PiecePlacement& piece : placed.pieces) {
      if (piece.step == wrap) return true;
    }
  }
  return false;
}

// Inserts the planned K-FAC instructions into the base streams repeated k times.
sched::Schedule emit(const sched::Schedule& base, const Plan& plan,
                     const std::vector<kfac::LinearDims>& dims) {
  const sched::Schedule repeated = repeat_steps(base, plan.refresh_steps);
  struct Insert {
    int step;
    int position;
    bool spilled;
    bool own;  // false: a pipelined refresh's work of the previous window (first in its slot)
    double start;
    int item;
    sched::Instruction instruction;
  };
  // A pipelined refresh's wrap step k is the next window's step 0: its work goes to step 0 of
  // the stream, as the previous refresh's (step - k: sched::is_wrapped).
  const int k = plan.refresh_steps;
  const auto insert = [&](Slot slot, bool spilled, double start, int item, sched::Instruction in) {
    const bool wrapped = plan.pipelined && slot.step == k;
    if (wrapped) {
      slot.step = 0;
      in.step = static_cast<std::int16_t>(in.step - k);
    }
    return Insert{slot.step, slot.position, spilled, !wrapped, start, item, in};
  };
  std::vector<std::vector<Insert>> inserts(static_cast<std::size_t>(base.num_workers()));
  for (std::size_t i = 0; i < plan.order.size(); ++i) {
    const KfacTask& task = plan.work().tasks[static_cast<std::size_t>(plan.order[i])];
    const ItemPlacement& placed = plan.packed.placements[i];
    if (!placed.pieces.empty()) {
      // Every member of a divided collective runs each piece (in the same order: the pieces of
      // one sync start at the same planned times on both).
      for (std::size_t r = 0; r < task.workers.size(); ++r) {
        const auto w = static_cast<std::size_t>(task.workers[r]);
        Slot previous{0, 0};
        for (const PiecePlacement& piece : placed.pieces) {
          const int bubble = r == 0 ? piece.bubble : piece.other_bubble;
          const bool spilled = bubble < 0;
          Slot slot =
              spilled
                  ? plan.bubbles().flush_slot[w][static_cast<std::size_t>(piece.step)]
                  : plan.bubbles().slots[w][static_cast<std::size_t>(
                        plan.bubbles().problem.bubbles[w][static_cast<std::size_t>(bubble)].slot)];
          // The chain's order: a rest after the flush never goes ahead of an earlier piece.
          if (std::tie(slot.step, slot.position) < std::tie(previous.step, previous.position)) {
            slot = previous;
          }
          previous = slot;
          sched::Instruction in = task.instructions[r];
          in.piece_begin = static_cast<std::uint16_t>(piece.unit_begin);
          in.piece_end = static_cast<std::uint16_t>(piece.unit_end);
          if (in.kind == OpKind::kCurvatureSync) in.bytes = sync_piece_bytes(in, dims);
          inserts[w].push_back(insert(slot, spilled, piece.start, static_cast<int>(i), in));
        }
      }
      continue;
    }
    for (std::size_t r = 0; r < task.workers.size(); ++r) {
      const auto w = static_cast<std::size_t>(task.workers[r]);
      const Slot slot =
          placed.spilled ? plan.bubbles().flush_slot[w][static_cast<std::size_t>(placed.step)]
                         : plan.bubbles().slots[w][static_cast<std::size_t>(
                               plan.bubbles()
                                   .problem.bubbles[w][static_cast<std::size_t>(placed.bubbles[r])]
                                   .slot)];
      inserts[w].push_back(
          insert(slot, placed.spilled, placed.start, static_cast<int>(i), task.instructions[r]));
    }
  }
  sched::Schedule out;
  out.params = base.params;
  out.placement = base.placement;
  out.num_steps = plan.refresh_steps;
  out.kfac_pipelined_refresh = plan.pipelined;
  out.streams.resize(base.streams.size());
  for (std::size_t w = 0; w < base.streams.size(); ++w) {
    auto& list = inserts[w];
    // In a slot, the previous refresh's work first (it precedes all of the window's work of its
    // Linear), then the planned order; work after a flush after the work in bubbles.
    std::sort(list.begin(), list.end(), [](const Insert& a, const Insert& b) {
      return std::tie(a.step, a.position, a.spilled, a.own, a.start, a.item) <
             std::tie(b.step, b.position, b.spilled, b.own, b.start, b.item);
    });
    const int n = static_cast<int>(base.streams[w].size());
    auto& stream = out.streams[w];
    stream.reserve(repeated.streams[w].size() + list.size());
    std::size_t next = 0;
    for (int step = 0; step < plan.refresh_steps; ++step) {
      for (int x = 0; x <= n; ++x) {
        while (next < list.size() && list[next].step == step && list[next].position == x) {
          stream.push_back(list[next++].instruction);
        }
        if (x < n) {
          stream.push_back(
              repeated.streams[w][static_cast<std::size_t>(step) * static_cast<std::size_t>(n) +
                                  static_cast<std::size_t>(x)]);
        }
      }
    }
    if (next != list.size()) {
      throw std::logic_error("PipeFisher pass: K-FAC work of worker " + std::to_string(w) +
                             " was planned outside the schedule");
    }
  }
  return out;
}

// The Linears of one worker in the executor's order (layer, then Linear kind), with their dims.
std::vector<kfac::LinearDims> state_dims(std::vector<HeldLinear> linears,
                                         const KfacOptions& options) {
  std::sort(linears.begin(), linears.end(), [](const HeldLinear& a, const HeldLinear& b) {
    return std::make_pair(a.layer, static_cast<int>(a.linear)) <
           std::make_pair(b.layer, static_cast<int>(b.linear));
  });
  std::vector<kfac::LinearDims> dims;
  for (const auto& linear : linears) {
    dims.push_back(options.linear_dims[static_cast<std::size_t>(linear.linear)]);
  }
  return dims;
}

// Per worker, the K-FAC state its busiest replica (most bytes) holds of each Linear: what the
// simulator charges for the worker's memory (its bytes), and the offload pass moves.
std::function<HeldKfacState(int, int, sched::LinearKind)> state_of_busiest_replica(
    const sched::Schedule& base, const KfacOptions& options) {
  const int replicas = std::max(1, base.params.data_parallel);
  auto held = preconditioned_linears(base, options);
  auto table = std::make_shared<std::map<std::tuple<int, int, int>, HeldKfacState>>();
  for (std::size_t w = 0; w < held.size(); ++w) {
    auto& linears = held[w];
    std::sort(linears.begin(), linears.end(), [](const HeldLinear& a, const HeldLinear& b) {
      return std::make_pair(a.layer, static_cast<int>(a.linear)) <
             std::make_pair(b.layer, static_cast<int>(b.linear));
    });
    const auto dims = state_dims(linears, options);
    const auto plan = kfac::plan_state(dims, replicas, options.state_placement);
    const auto cost = kfac::state_cost(plan, dims, 1);
    const auto busiest =
        static_cast<int>(std::max_element(cost.memory_bytes.begin(), cost.memory_bytes.end()) -
                         cost.memory_bytes.begin());
    for (std::size_t i = 0; i < linears.size(); ++i) {
      const auto& d = dims[i];
      const double factor_bytes = 4.0 * static_cast<double>(d.d_in * d.d_in + d.d_out * d.d_out);
      HeldKfacState state;
      state.factors = plan.layers[i].holds_factors(busiest);
      state.inverses = plan.layers[i].holds_inverses(busiest);
      state.bytes = (state.factors ? factor_bytes : 0.0) + (state.inverses ? factor_bytes : 0.0);
      (*table)[{static_cast<int>(w), linears[i].layer, static_cast<int>(linears[i].linear)}] =
          state;
    }
  }
  return [table](int worker, int layer, sched::LinearKind linear) {
    const auto it = table->find({worker, layer, static_cast<int>(linear)});
    return it == table->end() ? HeldKfacState{false, false, 0.0} : it->second;
  };
}

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

}  // namespace

namespace {

// The pass on `base`; `reference` (the schedule before any W was moved) gives the "before".
PassResult run_on(const sched::Schedule& base, const sched::Schedule& reference,
                  const sim::CostModel& costs, const KfacOptions& options,
                  const sim::SimOptions& sim_options) {
  const DurationFn duration = [&](int worker, const sched::Instruction& in) {
    const double seconds = costs.duration(base, worker, in);
    if (!std::isfinite(seconds) || seconds < 0.0) {
      throw std::invalid_argument("PipeFisher pass: the cost model gives " +
                                  sched::short_label(in) + " on worker " + std::to_string(worker) +
                                  " a duration of " + std::to_string(seconds) + " s");
    }
    return seconds;
  };
  // Two steps of the base schedule give the timeline, and they are the "before" of a refresh of
  // two steps (simulated once: at p = 64, m = 1024 a simulation is ~10% of the pass).
  const sim::SimResult two_steps = sim::simulate(repeat_steps(base, 2), costs, sim_options);
  const Timeline timeline =
      timeline_from_two_steps(base, two_steps, sim_options.overlap_communication);
  const BubbleMap steady = find_bubbles(base, timeline, 3);  // step 1 is a whole steady step
  const LongestBubbles longest = longest_steady_bubbles(steady);
  const TaskOverheads overheads(costs);
  // The plain refresh (PipeFisher's window); with --kfac-pipelined-refresh on the pipelined
  // one is searched too, and kept where it is better.
  KfacOptions plain = options;
  plain.pipelined_refresh = false;
  // The work of a one-step refresh: both bounds, and the candidate k = 1, use it.
  const auto one_step_work =
      std::make_shared<const KfacWork>(build_kfac_work(base, plain, 1, duration));
  const Bound bound =
      refresh_lower_bound(base, *one_step_work, steady, longest, options, overheads);
  const int release_bound =
      bound.impossible.empty()
          ? release_lower_bound(base, *one_step_work, timeline, steady, longest, options, overheads)
          : -1;
  const int usable_bound =
      bound.impossible.empty()
          ? usable_lower_bound(base, *one_step_work, steady, longest, options, overheads)
          : -1;

  std::vector<PackingPolicy> policies;
  if (options.policy != PackingPolicy::kBestFit) policies.push_back(PackingPolicy::kFirstFit);
  if (options.policy != PackingPolicy::kFirstFit) policies.push_back(PackingPolicy::kBestFit);
  std::vector<Plan> plans =
      search(base, timeline, plain, duration, policies, bound, longest, overheads, one_step_work);
  if (options.pipelined_refresh) {
    for (Plan& plan : search(base, timeline, options, duration, policies, bound, longest, overheads,
                             one_step_work)) {
      plans.push_back(std::move(plan));
    }
  }
  int plain_steps = std::numeric_limits<int>::max();
  std::vector<const Plan*> ranked;
  for (const Plan& plan : plans) {
    if (plan.free_spill_candidate) continue;  // taken below only where its step costs no more
    ranked.push_back(&plan);
    if (!plan.pipelined) plain_steps = std::min(plain_steps, plan.refresh_steps);
  }
  std::stable_sort(ranked.begin(), ranked.end(),
                   [](const Plan* a, const Plan* b) { return better(*a, *b); });
  // The best plan whose schedule is valid. Only a pipelined plan with syncs in the next window
  // can fail: its syncs must pair by stream order on both replicas, and the previous refresh's
  // go first in their slots while the window's own go by slot; where that order differs
  // between the replicas, the next plan is taken (the plain refresh's never fails). With
  // `unrefined`: of the policies' own packings only.
  // A plan's schedule into `schedule`; false where the validator refuses it.
  const auto emit_valid = [&](const Plan& plan, sched::Schedule& schedule) {
    schedule = emit(base, plan, options.linear_dims);
    if (plan.pipelined && wraps_collectives(plan)) {
      try {
        sched::validate(schedule);
      } catch (const std::invalid_argument&) {
        return false;
      }
    }
    return true;
  };
  const auto best_valid = [&](bool unrefined, sched::Schedule& schedule) -> const Plan* {
    for (const Plan* plan : ranked) {
      if (unrefined && plan->variant >= 0) continue;
      if (emit_valid(*plan, schedule)) return plan;
    }
    return nullptr;
  };
  PassResult result;
  const Plan* chosen = best_valid(false, result.schedule);
  if (chosen == nullptr) throw std::logic_error("PipeFisher pass: no valid plan");
  const auto simulate_before = [&](int steps) {
    return steps == 2 && &reference == &base
               ? two_steps
               : sim::simulate(repeat_steps(reference, steps), costs, sim_options);
  };
  sim::SimOptions common_options = sim_options;
  if (!options.linear_dims.empty()) {
    result.busiest_replica_holds = state_of_busiest_replica(base, options);
    common_options.kfac_state_bytes = [held = result.busiest_replica_holds](
                                          int worker, int layer, sched::LinearKind linear) {
      return held(worker, layer, linear).bytes;
    };
    common_options.kfac_holds_factors = [held = result.busiest_replica_holds](
                                            int worker, int layer, sched::LinearKind linear) {
      return held(worker, layer, linear).factors;
    };
    result.factor_sum_bytes = [dims = options.linear_dims](int, sched::LinearKind linear,
                                                           bool a_factor) {
      const kfac::LinearDims& d = dims[static_cast<std::size_t>(linear)];
      const double dim = static_cast<double>(a_factor ? d.d_in : d.d_out);
      return 4.0 * dim * dim;
    };
    common_options.kfac_sum_bytes = result.factor_sum_bytes;
  }
  // A pipelined refresh's second accumulator (the next window's curvature while the previous
  // refresh's sums wait for their inversion) is the simulator's own where it counts the factor
  // sums, the set-aside ones included (docs/simulator.md). Without them (the configuration
  // search's model) it is the factors' bytes again, half of the state the cost model prices.
  const auto options_for = [&](const Plan& plan) {
    sim::SimOptions after_options = common_options;
    if (plan.pipelined && !after_options.count_factor_sums) {
      auto held = after_options.kfac_state_bytes;
      after_options.kfac_state_bytes = [held, &costs, &base](int worker, int layer,
                                                             sched::LinearKind linear) {
        const double state =
            held ? held(worker, layer, linear) : costs.kfac_bytes(base, layer, linear);
        return 1.5 * state;
      };
    }
    return after_options;
  };
  const auto overhead = [](const sim::SimResult& b, const sim::SimResult& a) {
    return b.step_time_s > 0.0 ? a.step_time_s / b.step_time_s - 1.0 : 0.0;
  };
  result.before = simulate_before(chosen->refresh_steps);
  result.after = sim::simulate(result.schedule, costs, options_for(*chosen));
  if (chosen->variant >= 0) {
    // A refined plan (fewer steps than the policies' own) is kept only where it costs no more
    // step time than the policies' best plan, within 0.1 point of overhead: the refinement
    // trades nothing for its step.
    sched::Schedule schedule;
    if (const Plan* fallback = best_valid(true, schedule)) {
      sim::SimResult before = simulate_before(fallback->refresh_steps);
      sim::SimResult after = sim::simulate(schedule, costs, options_for(*fallback));
      if (overhead(result.before, result.after) > overhead(before, after) + 1e-3) {
        chosen = fallback;
        result.schedule = std::move(schedule);
        result.before = std::move(before);
        result.after = std::move(after);
      }
    }
  }
  // The free spill: from the largest k below the holding plan's down, a plan that leaves work
  // after the flush replaces it while its simulated step costs no more than the holding plan's
  // (within the refinement's 0.1 point); the first that costs more ends the walk.
  const int holding_steps =
      chosen->within_budget || !chosen->cap_reason.empty() ? -1 : chosen->refresh_steps;
  if (options.free_spill && holding_steps > 0) {
    std::vector<const Plan*> candidates;
    for (const Plan& plan : plans) {
      if (plan.free_spill_candidate && plan.refresh_steps < holding_steps) {
        candidates.push_back(&plan);
      }
    }
    std::stable_sort(candidates.begin(), candidates.end(), [](const Plan* a, const Plan* b) {
      return std::make_pair(-a->refresh_steps, a->total_after_flush_s) <
             std::make_pair(-b->refresh_steps, b->total_after_flush_s);
    });
    const double holding_overhead = overhead(result.before, result.after);
    for (std::size_t i = 0; i < candidates.size();) {
      const int k = candidates[i]->refresh_steps;
      bool taken = false;
      for (; i < candidates.size() && candidates[i]->refresh_steps == k; ++i) {
        if (taken) continue;
        const Plan& plan = *candidates[i];
        sched::Schedule schedule;
        if (!emit_valid(plan, schedule)) continue;
        sim::SimResult before = simulate_before(plan.refresh_steps);
        sim::SimResult after = sim::simulate(schedule, costs, options_for(plan));
        if (overhead(before, after) > holding_overhead + 1e-3) continue;
        chosen = &plan;
        result.schedule = std::move(schedule);
        result.before = std::move(before);
        result.after = std::move(after);
        taken = true;
      }
      if (!taken) break;
    }
  }
  result.report = make_report(base, costs, options, *chosen, result.before, result.after);
  result.report.free_spill = options.free_spill;
  result.report.holding_refresh_steps = holding_steps;
  result.report.refresh_bound = bound.impossible.empty() ? bound.steps : -1;
  result.report.release_bound = release_bound;
  result.report.usable_bound = usable_bound;
  for (const Plan& plan : plans) {
    if (plan.pipelined != chosen->pipelined || plan.variant >= 0 || plan.within_budget ||
        plan.free_spill_candidate) {
      continue;
    }
    (plan.policy == PackingPolicy::kFirstFit ? result.report.first_fit_refresh_steps
                                             : result.report.best_fit_refresh_steps) =
        plan.refresh_steps;
  }
  result.report.refined = chosen->variant >= 0;
  result.report.pipelined_refresh = chosen->pipelined;
  result.report.plain_refresh_steps = plain_steps;
  return result;
}

PassResult run_with_placement(const sched::Schedule& base, const sim::CostModel& costs,
                              const KfacOptions& options, const sim::SimOptions& sim_options) {
  const auto started = std::chrono::steady_clock::now();
  options.validate();
  PassResult result = run_on(base, base, costs, options, sim_options);
  if (options.move_weights && has_backward_weights(base)) {
    // Each W up to 1, 2, 4 forwards/backwards later, or as late as it may go; the best plan
    // (fewest steps, then the shortest step with K-FAC) wins, the unmoved one on a tie.
    sched::Schedule previous = base;
    for (int distance : {1, 2, 4, kDeferAllTheWay}) {
      sched::Schedule deferred = defer_backward_weights(base, distance);
      if (deferred.streams == previous.streams) continue;
      previous = deferred;
      sched::validate(deferred);  // a move the validator refuses is a bug: say so
      PassResult candidate = run_on(deferred, base, costs, options, sim_options);
      if (std::make_pair(candidate.report.refresh_steps, candidate.report.step_time_after_s) <
          std::make_pair(result.report.refresh_steps, result.report.step_time_after_s)) {
        result = std::move(candidate);
        result.report.weights_deferred = distance;
      }
    }
  }
  result.report.pass_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return result;
}

// The machine of the automatic placement, priced by the pass's own cost model: the link from a
// broadcast of 0 and of 64 MiB, the inversion rate from the first preconditioned Linear's
// inversions.
kfac::PlacementMachine placement_machine(const sched::Schedule& base, const sim::CostModel& costs,
                                         const KfacOptions& options,
                                         const std::vector<std::vector<HeldLinear>>& held) {
  kfac::PlacementMachine machine;
  machine.memory_budget_bytes = options.memory_budget_bytes;
  sched::Instruction probe;
  probe.kind = OpKind::kBroadcastGradient;
  probe.bytes = 0;
  const double empty = costs.duration(base, 0, probe);
  probe.bytes = std::int64_t{64} << 20;
  const double full = costs.duration(base, 0, probe);
  machine.link_latency_s = std::max(0.0, empty);
  machine.link_bandwidth = full > empty ? static_cast<double>(probe.bytes) / (full - empty) : 1e18;
  for (std::size_t w = 0; w < held.size(); ++w) {
    if (held[w].empty()) continue;
    sched::Instruction inversion;
    inversion.layer = static_cast<std::int16_t>(held[w].front().layer);
    inversion.linear = held[w].front().linear;
    inversion.kind = OpKind::kInvertA;
    double seconds = costs.duration(base, static_cast<int>(w), inversion);
    inversion.kind = OpKind::kInvertB;
    seconds += costs.duration(base, static_cast<int>(w), inversion);
    const double flops =
        kfac::inversion_flops(options.linear_dims[static_cast<std::size_t>(inversion.linear)]);
    machine.inversion_flops = seconds > 0.0 ? flops / seconds : 1e18;
    break;
  }
  return machine;
}

}  // namespace

PassResult run_pipefisher(const sched::Schedule& base, const sim::CostModel& costs,
                          const KfacOptions& options, const sim::SimOptions& sim_options) {
  if (!options.automatic_placement) return run_with_placement(base, costs, options, sim_options);
  if (options.linear_dims.empty()) {
    throw std::invalid_argument(
        "--kfac-sharding auto: the pass needs the Linears' dimensions (KfacOptions::linear_dims)");
  }
  options.validate();
  const int replicas = std::max(1, base.params.data_parallel);
  const auto held = preconditioned_linears(base, options);
  std::vector<std::vector<kfac::LinearDims>> workers;
  for (const auto& linears : held) workers.push_back(state_dims(linears, options));
  const auto machine = placement_machine(base, costs, options, held);
  KfacOptions fixed = options;
  fixed.automatic_placement = false;
  // Chimera shares each stage's factors between its pipelines: only replication is supported.
  const auto choose = [&](int refresh_steps) {
    if (base.placement.num_pipelines > 1) return kfac::StatePlacement{};
    return kfac::choose_state_placement(workers, replicas, refresh_steps, machine).chosen;
  };
  // The choice depends on k (gradient broadcasts every step, the rest once per refresh) and k
  // on the choice: choose for the fixed or the cap's k, run, and choose again for the k found.
  fixed.state_placement = choose(options.refresh_steps > 0 ? options.refresh_steps : 1);
  PassResult result = run_with_placement(base, costs, fixed, sim_options);
  const auto again = choose(result.report.refresh_steps);
  if (!(again == fixed.state_placement)) {
    fixed.state_placement = again;
    result = run_with_placement(base, costs, fixed, sim_options);
  }
  result.report.automatic_placement = true;
  return result;
}

}  // namespace pf::pipefisher
