#include "scheduler/pipefisher/plan.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace pf::pipefisher::pass_internal {

using sched::OpKind;

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

}  // namespace pf::pipefisher::pass_internal
