#include "scheduler/pipefisher/plan.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace pf::pipefisher::pass_internal {

using sched::OpKind;

namespace {

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
    // The key (layer, Linear) as one index, layer-major: the order of the pairs. Layers are
    // few and dense, so the buckets are indexed directly (a sort and a binary search per task
    // were 5% of the pass at p = 64, m = 1024).
    int first_layer = 0, end_layer = 0;  // the layers' range [first_layer, end_layer)
    for (std::size_t i = 0; i < middle.size(); ++i) {
      const int layer = work.tasks[static_cast<std::size_t>(middle[i])].instructions[0].layer;
      first_layer = i == 0 ? layer : std::min(first_layer, layer);
      end_layer = i == 0 ? layer + 1 : std::max(end_layer, layer + 1);
    }
    const auto key_of = [&](int t) {
      const auto& in = work.tasks[static_cast<std::size_t>(t)].instructions[0];
      return static_cast<std::size_t>(in.layer - first_layer) * sched::kNumLinearKinds +
             static_cast<std::size_t>(in.linear);
    };
    const std::size_t key_count =
        static_cast<std::size_t>(end_layer - first_layer) * sched::kNumLinearKinds;
    std::vector<std::size_t> bucket(middle.size());
    for (std::size_t i = 0; i < middle.size(); ++i) bucket[i] = key_of(middle[i]);
    std::vector<std::size_t> next(key_count + 1, 0);
    if (pack_order == PackOrder::kLargestLinearsFirst) {
      // The Linears with the most curvature, sync and inversion work first (ties: by key).
      std::vector<double> weight(key_count, 0.0);
      for (std::size_t i = 0; i < middle.size(); ++i) {
        weight[bucket[i]] += work.tasks[static_cast<std::size_t>(middle[i])].duration_s;
      }
      std::vector<std::size_t> by_weight(key_count);
      for (std::size_t d = 0; d < by_weight.size(); ++d) by_weight[d] = d;
      std::stable_sort(by_weight.begin(), by_weight.end(),
                       [&](std::size_t a, std::size_t b) { return weight[a] > weight[b]; });
      std::vector<std::size_t> rank_of(key_count);
      for (std::size_t r = 0; r < by_weight.size(); ++r) rank_of[by_weight[r]] = r;
      for (auto& b : bucket) b = rank_of[b];
    }
    for (std::size_t i = 0; i < bucket.size(); ++i) ++next[bucket[i] + 1];
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

}  // namespace

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
    std::vector<double> packed_with = hold;  // the hold of plan.packed
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
      packed_with = hold;
    }
    // The packing taken may leave a wrapped item's dependent before it in the stream (a
    // data-parallel sync in the next window, its inversions spilled after this window's flush:
    // pipefisher_train failed at its first wrapped sync, 2026-11-29). Repaired, that item stays
    // in its own window (packings without it are kept as they were).
    if (!wrapped_before_dependents(items, plan.packed, plan.bubbles().problem.wrap_step).empty()) {
      plan.packed = pack_keeping_wrapped_dependents(plan.bubbles().problem, items, policy,
                                                    options.safety_margin, packed_with);
      plan.total_after_flush_s = after_flush(plan.packed);
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

}  // namespace pf::pipefisher::pass_internal
