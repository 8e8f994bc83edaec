#include "scheduler/pipefisher/pass.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>

#include "scheduler/pipefisher/kfac_work.h"
#include "scheduler/pipefisher/packer.h"
#include "scheduler/pipefisher/timeline.h"

namespace pf::pipefisher {
namespace {

using sched::OpKind;

// One complete packing for one k and one policy.
struct Plan {
  int refresh_steps = 1;
  PackingPolicy policy = PackingPolicy::kFirstFit;
  KfacWork work;
  BubbleMap bubbles;
  std::vector<int> order;  // item index -> task index
  PackResult packed;
  double spilled_bound_s = 0.0;
};

// Preconditions of all but the refresh's last step go first (they run every step, so a bubble
// they take saves step time), then curvature, sync and inversion, then the last step's
// preconditions, which need the new inverses.
// First-fit keeps PipeFisher's priority order (all curvature A, all curvature B, syncs,
// inversions); best-fit goes factor by factor (one Linear's curvature, sync and inversions
// before the next Linear's), so that large inversions are placed while large bubbles are
// still free instead of all at the end.
std::vector<int> packing_order(const KfacWork& work, PackingPolicy policy) {
  std::vector<int> order;
  order.reserve(work.tasks.size());
  const int last = work.refresh_steps - 1;
  for (std::size_t t = 0; t < work.tasks.size(); ++t) {
    const auto& task = work.tasks[t];
    if (task.kind() == OpKind::kPrecondition && task.step_bound < last) {
      order.push_back(static_cast<int>(t));
    }
  }
  std::vector<int> middle;
  for (std::size_t t = 0; t < work.tasks.size(); ++t) {
    if (work.tasks[t].kind() != OpKind::kPrecondition) middle.push_back(static_cast<int>(t));
  }
  if (policy == PackingPolicy::kBestFit) {
    // Stable: within a Linear the work model's order (curvature, sync, inversion) stays.
    std::stable_sort(middle.begin(), middle.end(), [&](int a, int b) {
      const auto& ia = work.tasks[static_cast<std::size_t>(a)].instructions[0];
      const auto& ib = work.tasks[static_cast<std::size_t>(b)].instructions[0];
      return std::make_pair(ia.layer, static_cast<int>(ia.linear)) <
             std::make_pair(ib.layer, static_cast<int>(ib.linear));
    });
  }
  order.insert(order.end(), middle.begin(), middle.end());
  for (std::size_t t = 0; t < work.tasks.size(); ++t) {
    const auto& task = work.tasks[t];
    if (task.kind() == OpKind::kPrecondition && task.step_bound == last) {
      order.push_back(static_cast<int>(t));
    }
  }
  return order;
}

Plan make_plan(const sched::Schedule& base, const Timeline& timeline, const KfacOptions& options,
               const DurationFn& duration, int k, PackingPolicy policy) {
  Plan plan;
  plan.refresh_steps = k;
  plan.policy = policy;
  plan.work = build_kfac_work(base, options, k, duration);
  plan.bubbles = find_bubbles(base, timeline, k);
  plan.order = packing_order(plan.work, policy);
  std::vector<int> item_of(plan.work.tasks.size(), -1);
  for (std::size_t i = 0; i < plan.order.size(); ++i) {
    item_of[static_cast<std::size_t>(plan.order[i])] = static_cast<int>(i);
  }
  std::vector<PackItem> items;
  items.reserve(plan.order.size());
  for (int t : plan.order) {
    const KfacTask& task = plan.work.tasks[static_cast<std::size_t>(t)];
    PackItem item;
    item.workers = task.workers;
    item.duration = task.duration_s;
    for (const auto& ref : task.base_deps) {
      item.release = std::max(item.release, timeline.at(ref).end_s);
    }
    for (int dep : task.task_deps) item.preds.push_back(item_of[static_cast<std::size_t>(dep)]);
    item.step_bound = task.step_bound;
    items.push_back(std::move(item));
  }
  plan.packed = pack(plan.bubbles.problem, items, policy, options.safety_margin);
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (plan.packed.placements[i].spilled && items[i].step_bound >= 0) {
      plan.spilled_bound_s += items[i].duration;
    }
  }
  return plan;
}

// The smallest k whose packing needs no curvature / sync / inversion after a flush (per-step
// preconditioning may still spill: it is needed every step whatever k is).
Plan search(const sched::Schedule& base, const Timeline& timeline, const KfacOptions& options,
            const DurationFn& duration, PackingPolicy policy, int lower_bound) {
  if (options.refresh_steps > 0) {
    return make_plan(base, timeline, options, duration, options.refresh_steps, policy);
  }
  for (int k = std::max(1, lower_bound); k <= options.max_refresh_steps; ++k) {
    Plan plan = make_plan(base, timeline, options, duration, k, policy);
    if (plan.packed.spilled_items == 0) return plan;
  }
  throw std::runtime_error(
      "PipeFisher pass: the K-FAC work does not fit in the bubbles of " +
      std::to_string(options.max_refresh_steps) + " steps (" + std::string(to_string(policy)) +
      "); fix the refresh interval (refresh_steps) to run the rest after the flush");
}

// A lower bound on k: no worker can do more K-FAC work in k steps than k steps' bubbles hold.
int refresh_lower_bound(const sched::Schedule& base, const Timeline& timeline,
                        const KfacOptions& options, const DurationFn& duration) {
  const KfacWork work = build_kfac_work(base, options, 1, duration);
  const BubbleMap map = find_bubbles(base, timeline, 3);  // step 1 is a whole steady step
  std::vector<double> load(static_cast<std::size_t>(base.num_workers()), 0.0);
  for (const auto& task : work.tasks) {
    if (task.kind() == OpKind::kPrecondition) continue;
    for (int w : task.workers) {
      load[static_cast<std::size_t>(w)] += task.duration_s * (1.0 + options.safety_margin);
    }
  }
  int bound = 1;
  for (std::size_t w = 0; w < load.size(); ++w) {
    const double capacity = std::max(map.capacity_s[w][0], map.capacity_s[w][1]);
    if (load[w] <= 0.0) continue;
    if (!(capacity > 0.0)) {
      throw std::runtime_error("PipeFisher pass: worker " + std::to_string(w) +
                               " has no idle time to fill; fix the refresh interval "
                               "(refresh_steps) to run K-FAC work after the flush");
    }
    const double steps = std::ceil(load[w] / capacity - 1e-9);
    bound = std::max(bound, static_cast<int>(std::min(steps, 1e9)));
  }
  return bound;
}

bool better(const Plan& a, const Plan& b) {
  return std::make_tuple(a.refresh_steps, a.packed.spilled_items, a.spilled_bound_s) <
         std::make_tuple(b.refresh_steps, b.packed.spilled_items, b.spilled_bound_s);
}

// Inserts the planned K-FAC instructions into the base streams repeated k times.
sched::Schedule emit(const sched::Schedule& base, const Plan& plan) {
  const sched::Schedule repeated = repeat_steps(base, plan.refresh_steps);
  struct Insert {
    int step;
    int position;
    bool spilled;
    double start;
    int item;
    sched::Instruction instruction;
  };
  std::vector<std::vector<Insert>> inserts(static_cast<std::size_t>(base.num_workers()));
  for (std::size_t i = 0; i < plan.order.size(); ++i) {
    const KfacTask& task = plan.work.tasks[static_cast<std::size_t>(plan.order[i])];
    const ItemPlacement& placed = plan.packed.placements[i];
    for (std::size_t r = 0; r < task.workers.size(); ++r) {
      const auto w = static_cast<std::size_t>(task.workers[r]);
      const Slot slot =
          placed.spilled
              ? plan.bubbles.flush_slot[w][static_cast<std::size_t>(placed.step)]
              : plan.bubbles.slots[w][static_cast<std::size_t>(
                    plan.bubbles.problem.bubbles[w][static_cast<std::size_t>(placed.bubbles[r])]
                        .slot)];
      inserts[w].push_back(Insert{slot.step, slot.position, placed.spilled, placed.start,
                                  static_cast<int>(i), task.instructions[r]});
    }
  }
  sched::Schedule out;
  out.params = base.params;
  out.placement = base.placement;
  out.num_steps = plan.refresh_steps;
  out.streams.resize(base.streams.size());
  for (std::size_t w = 0; w < base.streams.size(); ++w) {
    auto& list = inserts[w];
    std::sort(list.begin(), list.end(), [](const Insert& a, const Insert& b) {
      return std::tie(a.step, a.position, a.spilled, a.start, a.item) <
             std::tie(b.step, b.position, b.spilled, b.start, b.item);
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

KfacReport make_report(const sched::Schedule& base, const sim::CostModel& costs,
                       const KfacOptions& options, const Plan& plan,
                       const sim::SimResult& before, const sim::SimResult& after) {
  KfacReport report;
  report.refresh_steps = plan.refresh_steps;
  report.policy = std::string(to_string(plan.policy));
  report.safety_margin = options.safety_margin;
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
  report.workers.resize(static_cast<std::size_t>(base.num_workers()));
  for (std::size_t w = 0; w < report.workers.size(); ++w) {
    auto& worker = report.workers[w];
    worker.utilization_before = before.workers[w].utilization;
    worker.utilization_after = after.workers[w].utilization;
    worker.bubble_s = before.workers[w].idle_s;
    for (const auto& linear : held[w]) {
      worker.kfac_memory_bytes += costs.kfac_bytes(base, linear.layer, linear.linear);
    }
    report.kfac_memory_bytes = std::max(report.kfac_memory_bytes, worker.kfac_memory_bytes);
  }
  for (std::size_t i = 0; i < plan.order.size(); ++i) {
    const KfacTask& task = plan.work.tasks[static_cast<std::size_t>(plan.order[i])];
    const ItemPlacement& placed = plan.packed.placements[i];
    const bool sync = task.kind() == OpKind::kCurvatureSync;
    for (int w : task.workers) {
      auto& worker = report.workers[static_cast<std::size_t>(w)];
      (sync ? worker.kfac_sync_s : worker.kfac_compute_s) += task.duration_s / k;
      if (placed.spilled) worker.spilled_s += task.duration_s / k;
      ++worker.tasks;
      ++report.tasks;
    }
    if (task.kind() == OpKind::kPrecondition) {
      ++(placed.spilled ? report.preconditions_after_flush : report.preconditions_in_bubbles);
    } else if (placed.spilled) {
      ++report.spilled_tasks;
    }
  }
  return report;
}

}  // namespace

PassResult run_pipefisher(const sched::Schedule& base, const sim::CostModel& costs,
                          const KfacOptions& options, const sim::SimOptions& sim_options) {
  const auto started = std::chrono::steady_clock::now();
  options.validate();
  const DurationFn duration = [&](int worker, const sched::Instruction& in) {
    const double seconds = costs.duration(base, worker, in);
    if (!std::isfinite(seconds) || seconds < 0.0) {
      throw std::invalid_argument("PipeFisher pass: the cost model gives " +
                                  sched::short_label(in) + " on worker " + std::to_string(worker) +
                                  " a duration of " + std::to_string(seconds) + " s");
    }
    return seconds;
  };
  const Timeline timeline = measure_timeline(base, costs, sim_options);
  const int lower_bound =
      options.refresh_steps > 0 ? options.refresh_steps
                                : refresh_lower_bound(base, timeline, options, duration);

  std::optional<Plan> first_fit, best_fit;
  if (options.policy != PackingPolicy::kBestFit) {
    first_fit = search(base, timeline, options, duration, PackingPolicy::kFirstFit, lower_bound);
  }
  if (options.policy != PackingPolicy::kFirstFit) {
    best_fit = search(base, timeline, options, duration, PackingPolicy::kBestFit, lower_bound);
  }
  const Plan& chosen = !first_fit                        ? *best_fit
                       : !best_fit                       ? *first_fit
                       : better(*best_fit, *first_fit) ? *best_fit
                                                         : *first_fit;

  PassResult result;
  result.schedule = emit(base, chosen);
  result.before = sim::simulate(repeat_steps(base, chosen.refresh_steps), costs, sim_options);
  result.after = sim::simulate(result.schedule, costs, sim_options);
  result.report = make_report(base, costs, options, chosen, result.before, result.after);
  if (first_fit) result.report.first_fit_refresh_steps = first_fit->refresh_steps;
  if (best_fit) result.report.best_fit_refresh_steps = best_fit->refresh_steps;
  result.report.pass_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return result;
}

}  // namespace pf::pipefisher
