#include "scheduler/pipefisher/pass.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>

#include "scheduler/pipefisher/defer_weights.h"
#include "scheduler/pipefisher/kfac_work.h"
#include "scheduler/pipefisher/plan.h"
#include "scheduler/pipefisher/timeline.h"
#include "scheduler/validate.h"

namespace pf::pipefisher {

namespace pass_internal {

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

}  // namespace pass_internal

// The pass's steps (scheduler/pipefisher/plan.h).
using namespace pass_internal;

namespace {

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
  const Timeline timeline = timeline_from_two_steps(
      base, two_steps, sim_options.overlap_communication, sim_options.shared_processors);
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
  // sums, the set-aside ones included (docs/simulator.md). Without them
  // (SimOptions::count_factor_sums off) it is the factors' bytes again, half of the state the
  // cost model prices.
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
