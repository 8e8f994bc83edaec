// K-FAC state offload (docs/offload.md): the planner's choice, the offload pass's copies (valid,
// on the host link, before their consumers), the simulator's timing and memory of them, and the
// validator's and file formats' handling of the new kinds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

#include "scheduler/compile.h"
#include "scheduler/pipefisher/offload_pass.h"
#include "scheduler/pipefisher/offload_planner.h"
#include "scheduler/pipefisher/pass.h"
#include "scheduler/schedule_json.h"
#include "scheduler/torch_csv.h"
#include "scheduler/validate.h"
#include "sim/uniform_cost_model.h"

namespace pf::pipefisher {
namespace {

using sched::LinearKind;
using sched::OpKind;
using sched::ScheduleKind;

// ---- planner ----------------------------------------------------------------------------------

// Each with its factor sums: half its state.
std::vector<LinearState> three_linears() {
  return {{0, 0, LinearKind::kQuery, 100.0, 50.0},
          {0, 0, LinearKind::kFfnIn, 400.0, 200.0},
          {0, 1, LinearKind::kFfnOut, 300.0, 150.0}};
}

// Six Linears of one layer, 1100 bytes of state.
std::vector<LinearState> six_linears() {
  return {{0, 0, LinearKind::kFfnIn, 400.0, 200.0}, {0, 0, LinearKind::kFfnOut, 300.0, 150.0},
          {0, 0, LinearKind::kQuery, 100.0, 50.0},  {0, 0, LinearKind::kKey, 100.0, 50.0},
          {0, 0, LinearKind::kValue, 100.0, 50.0},  {0, 0, LinearKind::kAttentionOut, 100.0, 50.0}};
}

TEST(OffloadPlanner, NoneKeepsEverythingHostOffloadsEverything) {
  const auto none = plan_offload(OffloadMode::kNone, {three_linears()}, {1000.0}, 0.0);
  EXPECT_EQ(none.offloaded_linears(), 0);
  EXPECT_DOUBLE_EQ(none.workers[0].kept_bytes, 800.0);
  // Every Linear's factor sums (half its state), which the refresh's curvature accumulates on
  // the device, offloaded or not.
  EXPECT_DOUBLE_EQ(factor_sum_bytes(none.workers[0]), 400.0);
  EXPECT_DOUBLE_EQ(none.workers[0].device_kfac_bytes, 800.0 + 400.0);
  const auto host = plan_offload(OffloadMode::kHost, {three_linears()}, {1000.0}, 0.0);
  EXPECT_EQ(host.offloaded_linears(), 3);
  EXPECT_DOUBLE_EQ(host.workers[0].offloaded_bytes, 800.0);
  // The sums, and the largest offloaded Linear while it is refreshed.
  EXPECT_DOUBLE_EQ(factor_sum_bytes(host.workers[0]), 400.0);
  EXPECT_DOUBLE_EQ(host.workers[0].device_kfac_bytes, 400.0 + 400.0);
  EXPECT_TRUE(host.warning.empty());
}

TEST(OffloadPlanner, AutoOffloadsTheFewestLargestLinearsThatFit) {
  // (What it offloads: OffloadPlanner.AutoOffloadsFactorsFirstThenWholeLinears.) A budget that
  // holds everything (the state and the sums) offloads nothing.
  auto plan = plan_offload(OffloadMode::kAuto, {three_linears()}, {1000.0}, 2200.0);
  EXPECT_EQ(plan.offloaded_linears(), 0);
  plan = plan_offload(OffloadMode::kAuto, {three_linears()}, {1000.0}, 2199.0);
  EXPECT_GT(plan.offloaded_linears(), 0);
  // Per worker: only the worker over the budget offloads.
  plan = plan_offload(OffloadMode::kAuto, {six_linears(), six_linears()}, {1000.0, 200.0}, 2000.0);
  EXPECT_EQ(plan.workers[0].offloaded.size(), 5U);
  EXPECT_EQ(plan.workers[0].factors_only.size(), 1U);
  EXPECT_TRUE(plan.workers[0].fits);
  EXPECT_EQ(plan.workers[1].offloaded.size(), 0U);
  EXPECT_EQ(plan.workers[1].factors_only.size(), 0U);
}

TEST(OffloadPlanner, FactorsOffloadsEveryLinearsFactorsAndKeepsItsInverses) {
  const auto plan = plan_offload(OffloadMode::kFactors, {three_linears()}, {1000.0}, 0.0);
  const auto& worker = plan.workers[0];
  EXPECT_TRUE(worker.offloaded.empty());
  EXPECT_TRUE(worker.kept.empty());
  ASSERT_EQ(worker.factors_only.size(), 3U);
  EXPECT_EQ(worker.factors_only[0].linear, LinearKind::kFfnIn);  // largest first
  EXPECT_EQ(plan.offloaded_linears(), 3);
  EXPECT_EQ(plan.factors_only_linears(), 3);
  EXPECT_DOUBLE_EQ(worker.factors_only_bytes, 800.0);
  EXPECT_DOUBLE_EQ(resident_bytes(worker), 400.0);  // every inverse
  // ... every Linear's factor sums, and the largest Linear's factors while it is refreshed.
  EXPECT_DOUBLE_EQ(factor_sum_bytes(worker), 400.0);
  EXPECT_DOUBLE_EQ(worker.device_kfac_bytes, 400.0 + 400.0 + 200.0);
  EXPECT_EQ(offload_mode_from_string("factors"), OffloadMode::kFactors);
  EXPECT_EQ(to_string(OffloadMode::kFactors), "factors");
}

TEST(OffloadPlanner, AutoOffloadsFactorsFirstThenWholeLinears) {
  // 1000 other + 1100 K-FAC state + 550 of sums. Offloading the largest Linear's factors saves
  // nothing at once (its factors leave, and are back while it is refreshed: the largest
  // transient), every Linear's factors save 350, and a budget under that is met only by whole
  // Linears, after every Linear's factors: 2000 takes the 400 and 300 bytes ones and three of
  // 100 whole (the last one's inverses, 50, the sums 550, the 400 one's refresh: 1000; with two
  // of 100, 1050).
  auto plan = plan_offload(OffloadMode::kAuto, {six_linears()}, {1000.0}, 2000.0);
  auto* worker = &plan.workers[0];
  ASSERT_EQ(worker->offloaded.size(), 5U);
  EXPECT_EQ(worker->offloaded[0].linear, LinearKind::kFfnIn);
  EXPECT_EQ(worker->offloaded[1].linear, LinearKind::kFfnOut);
  ASSERT_EQ(worker->factors_only.size(), 1U);
  EXPECT_TRUE(worker->kept.empty());
  EXPECT_DOUBLE_EQ(factor_sum_bytes(*worker), 550.0);
  EXPECT_DOUBLE_EQ(worker->device_kfac_bytes, 50.0 + 550.0 + 400.0);
  EXPECT_TRUE(worker->fits);
  // Every Linear's factors offloaded: its inverses (550), its sums (550) and the 400 one's
  // factors while refreshed (200), more than everything kept (1100).
  WorkerOffloadPlan factors;
  factors.kept = six_linears();
  factors.kept_bytes = 1100.0;
  while (factors.kept.size() > 0 && offload_next(factors)) {
  }
  EXPECT_EQ(factors.factors_only.size(), 6U);
  EXPECT_DOUBLE_EQ(factors.device_kfac_bytes, 550.0 + 550.0 + 200.0);
  // A budget nothing meets: everything whole (the sums and the largest Linear's refresh).
  plan = plan_offload(OffloadMode::kAuto, {three_linears()}, {1000.0}, 1650.0);
  worker = &plan.workers[0];
  EXPECT_EQ(worker->offloaded.size(), 3U);
  EXPECT_DOUBLE_EQ(worker->device_kfac_bytes, 400.0 + 400.0);
  EXPECT_FALSE(worker->fits);
  // offload_next: kept -> factors only -> whole, largest first; false once all are whole.
  WorkerOffloadPlan steps;
  steps.kept = three_linears();
  steps.kept_bytes = 800.0;
  std::vector<std::pair<std::size_t, std::size_t>> seen;  // (factors only, whole)
  while (offload_next(steps)) seen.emplace_back(steps.factors_only.size(), steps.offloaded.size());
  const std::vector<std::pair<std::size_t, std::size_t>> expected{{1, 0}, {2, 0}, {3, 0},
                                                                  {2, 1}, {1, 2}, {0, 3}};
  EXPECT_EQ(seen, expected);
  EXPECT_DOUBLE_EQ(steps.offloaded_bytes, 800.0);
  EXPECT_DOUBLE_EQ(resident_bytes(steps), 0.0);
  EXPECT_DOUBLE_EQ(factor_sum_bytes(steps), 400.0);
}

TEST(OffloadPlanner, ABudgetNothingMeetsIsAWarningAndBadInputIsRefused) {
  const auto plan = plan_offload(OffloadMode::kAuto, {three_linears()}, {1000.0}, 1200.0);
  EXPECT_EQ(plan.offloaded_linears(), 3);
  EXPECT_FALSE(plan.workers[0].fits);
  EXPECT_NE(plan.warning.find("not met"), std::string::npos) << plan.warning;
  EXPECT_THROW(plan_offload(OffloadMode::kAuto, {three_linears()}, {1000.0}, 0.0),
               std::invalid_argument);
  EXPECT_THROW(plan_offload(OffloadMode::kHost, {three_linears()}, {1.0, 2.0}, 0.0),
               std::invalid_argument);
  EXPECT_THROW(plan_offload(OffloadMode::kHost, {{{0, 0, LinearKind::kKey, -1.0}}}, {1.0}, 0.0),
               std::invalid_argument);
  EXPECT_THROW(
      plan_offload(OffloadMode::kHost, {{{0, 0, LinearKind::kKey, 1.0, -1.0}}}, {1.0}, 0.0),
      std::invalid_argument);
  EXPECT_THROW(offload_mode_from_string("disk"), std::invalid_argument);
  EXPECT_EQ(offload_mode_from_string("auto"), OffloadMode::kAuto);
}

// ---- the pass -----------------------------------------------------------------------------------

sched::Schedule compiled(ScheduleKind kind, int workers, int microbatches, int chunks = 1) {
  sched::ScheduleParams params;
  params.kind = kind;
  params.workers = workers;
  params.microbatches = microbatches;
  params.chunks_per_worker = chunks;
  return sched::compile(params);
}

sim::UniformCosts offload_costs(double host_bandwidth) {
  sim::UniformCosts costs;
  costs.forward_s = 1.0;
  costs.backward_s = 2.0;
  costs.curvature_a_s = costs.curvature_b_s = 0.01;
  costs.invert_a_s = costs.invert_b_s = 0.05;
  costs.precondition_s = 0.02;
  costs.activation_bytes = 10.0;
  costs.static_bytes = 100.0;
  costs.kfac_bytes = 1000.0;
  costs.host_bandwidth = host_bandwidth;  // a copy of 500 bytes: 500 / bandwidth seconds
  return costs;
}

std::size_t count(const sched::Schedule& s, OpKind kind) {
  std::size_t n = 0;
  for (const auto& stream : s.streams) {
    n += static_cast<std::size_t>(std::count_if(stream.begin(), stream.end(),
                                                [&](const auto& in) { return in.kind == kind; }));
  }
  return n;
}

struct PassCase {
  ScheduleKind kind;
  int workers, microbatches, chunks, refresh;
};

class OffloadPass : public testing::TestWithParam<PassCase> {};

TEST_P(OffloadPass, HostOffloadIsValidTimelyAndFreesTheDeviceState) {
  const auto c = GetParam();
  const sim::UniformCostModel costs(offload_costs(1e5));  // a 500-byte copy: 5 ms
  KfacOptions kfac;
  kfac.refresh_steps = c.refresh;
  const auto pass =
      run_pipefisher(compiled(c.kind, c.workers, c.microbatches, c.chunks), costs, kfac);
  const auto offload = run_offload_pass(pass, costs, {OffloadMode::kHost, 0.0, {}});
  EXPECT_NO_THROW(sched::validate(offload.schedule));
  const int k = offload.schedule.num_steps;
  std::size_t linears = 0;
  for (const auto& w : offload.plan.workers) linears += w.offloaded.size();
  ASSERT_GT(linears, 0U);
  // Per offloaded Linear and refresh: one or two factor prefetches and write-backs (one per
  // stretch of inversions), one inverse prefetch per step.
  const std::size_t windows = count(offload.schedule, OpKind::kPrefetchFactors);
  EXPECT_GE(windows, linears);
  EXPECT_LE(windows, 2 * linears);
  EXPECT_EQ(count(offload.schedule, OpKind::kWriteBackState), windows);
  EXPECT_EQ(count(offload.schedule, OpKind::kPrefetchInverses),
            linears * static_cast<std::size_t>(k));
  // Fast copies on their own lane in idle link time: every prefetch ends before its consumer
  // and the step time does not change.
  EXPECT_NEAR(offload.after.step_time_s, pass.after.step_time_s, 1e-9);
  for (const auto& w : offload.report.workers) EXPECT_EQ(w.late_prefetches, 0);
  for (int w = 0; w < offload.schedule.num_workers(); ++w) {
    const auto& stream = offload.schedule.streams[static_cast<std::size_t>(w)];
    const auto& times = offload.after.times[static_cast<std::size_t>(w)];
    std::map<std::tuple<int, int, int>, double> prefetched;  // (layer, linear, step) -> end
    for (std::size_t i = 0; i < stream.size(); ++i) {
      const auto& in = stream[i];
      const std::tuple<int, int, int> key{in.layer, static_cast<int>(in.linear), in.step};
      if (in.kind == OpKind::kPrefetchInverses) prefetched[key] = times[i].end_s;
      if (in.kind == OpKind::kPrecondition && in.piece_begin == 0) {
        ASSERT_TRUE(prefetched.contains(key)) << sched::short_label(in);
        EXPECT_LE(prefetched[key], times[i].start_s + 1e-12) << sched::short_label(in);
      }
    }
  }
  // Device memory: at the end of the refresh no offloaded state is on the device; the K-FAC
  // memory falls by exactly the offloaded bytes (everything, with host).
  for (int w = 0; w < offload.schedule.num_workers(); ++w) {
    const double before = pass.after.workers[w].memory.back().bytes;
    const double after = offload.after.workers[w].memory.back().bytes;
    EXPECT_DOUBLE_EQ(before - after, offload.plan.workers[w].offloaded_bytes) << "worker " << w;
    EXPECT_LE(offload.after.workers[w].peak_memory_bytes, pass.after.workers[w].peak_memory_bytes);
    // The planner's estimates count every Linear's factor sums (half its state; here every
    // Linear is offloaded), and with the plan one Linear's state while it is moved.
    const auto& r = offload.report.workers[w];
    EXPECT_DOUBLE_EQ(r.factor_sum_bytes, offload.plan.workers[w].offloaded_bytes / 2.0);
    EXPECT_DOUBLE_EQ(r.kfac_device_bytes_before, r.offloaded_bytes + r.factor_sum_bytes);
    EXPECT_DOUBLE_EQ(r.kfac_device_bytes_after, r.factor_sum_bytes + 1000.0);
  }
  // The schedule round-trips through JSON with its copies.
  const auto text = sched::to_json(offload.schedule).dump();
  EXPECT_EQ(sched::schedule_from_json(nlohmann::json::parse(text), "round trip").streams,
            offload.schedule.streams);
}

INSTANTIATE_TEST_SUITE_P(Schedules, OffloadPass,
                         testing::Values(PassCase{ScheduleKind::kOneFOneB, 4, 8, 1, 0},
                                         PassCase{ScheduleKind::kGPipe, 4, 4, 1, 2},
                                         PassCase{ScheduleKind::kInterleaved, 2, 4, 2, 0},
                                         PassCase{ScheduleKind::kChimera, 4, 4, 1, 0},
                                         PassCase{ScheduleKind::kOneFOneB, 2, 2, 1, 1}),
                         [](const testing::TestParamInfo<PassCase>& param_info) {
                           return std::string(sched::to_string(param_info.param.kind)) + "_" +
                                  std::to_string(param_info.param.workers) + "x" +
                                  std::to_string(param_info.param.microbatches) + "_k" +
                                  std::to_string(param_info.param.refresh);
                         });

// --kfac-offload factors: per Linear its factor windows (a prefetch before, a write-back of the
// factors alone after), marked factors-only, and no inverse prefetch; the inverses stay on the
// device from the Linear's first inversion on, so the K-FAC memory at the refresh's end falls
// by exactly the factors.
TEST_P(OffloadPass, FactorsOnlyOffloadMovesTheFactorsAlone) {
  const auto c = GetParam();
  const sim::UniformCostModel costs(offload_costs(1e5));  // a 500-byte copy: 5 ms
  KfacOptions kfac;
  kfac.refresh_steps = c.refresh;
  const auto pass =
      run_pipefisher(compiled(c.kind, c.workers, c.microbatches, c.chunks), costs, kfac);
  const auto offload = run_offload_pass(pass, costs, {OffloadMode::kFactors, 0.0, {}});
  EXPECT_NO_THROW(sched::validate(offload.schedule));
  std::size_t linears = 0;
  for (const auto& w : offload.plan.workers) {
    EXPECT_TRUE(w.offloaded.empty());
    EXPECT_TRUE(w.kept.empty());
    linears += w.factors_only.size();
  }
  ASSERT_GT(linears, 0U);
  EXPECT_EQ(offload.report.offloaded_linears, static_cast<int>(linears));
  EXPECT_EQ(offload.report.factors_only_linears, static_cast<int>(linears));
  EXPECT_EQ(count(offload.schedule, OpKind::kPrefetchInverses), 0U);
  const std::size_t windows = count(offload.schedule, OpKind::kPrefetchFactors);
  EXPECT_GE(windows, linears);
  EXPECT_LE(windows, 2 * linears);
  EXPECT_EQ(count(offload.schedule, OpKind::kWriteBackState), windows);
  for (const auto& stream : offload.schedule.streams) {
    for (const auto& in : stream) {
      if (!sched::is_kfac_transfer(in.kind)) continue;
      EXPECT_TRUE(sched::is_factors_only(in)) << sched::short_label(in);
      EXPECT_EQ(in.bytes, 500) << sched::short_label(in);  // the factors: half of 1000
    }
  }
  EXPECT_NEAR(offload.after.step_time_s, pass.after.step_time_s, 1e-9);
  // The whole-Linear plan's copies: each window's, and one inverse prefetch per step.
  const auto host = run_offload_pass(pass, costs, {OffloadMode::kHost, 0.0, {}});
  EXPECT_LT(offload.report.transfers, host.report.transfers);
  for (int w = 0; w < offload.schedule.num_workers(); ++w) {
    const auto& plan = offload.plan.workers[static_cast<std::size_t>(w)];
    const double before = pass.after.workers[w].memory.back().bytes;
    const double after = offload.after.workers[w].memory.back().bytes;
    EXPECT_DOUBLE_EQ(before - after, plan.factors_only_bytes / 2.0) << "worker " << w;
    EXPECT_DOUBLE_EQ(offload.report.workers[w].offloaded_bytes, plan.factors_only_bytes / 2.0);
    EXPECT_LE(offload.after.workers[w].peak_memory_bytes, pass.after.workers[w].peak_memory_bytes);
    // Whole offload frees twice as much at the refresh's end.
    EXPECT_LT(host.after.workers[w].memory.back().bytes, after);
  }
  const auto text = sched::to_json(offload.schedule).dump();
  EXPECT_EQ(sched::schedule_from_json(nlohmann::json::parse(text), "round trip").streams,
            offload.schedule.streams);
  const auto json = offload_report_json(offload.report);
  EXPECT_EQ(json.at("factors_only_linears"), static_cast<int>(linears));
  EXPECT_EQ(json.at("whole_linears"), 0);
  EXPECT_NE(format_offload_report(offload.report)
                .find("(0 whole, " + std::to_string(linears) + " factors only)"),
            std::string::npos)
      << format_offload_report(offload.report);
}

// The simulator's memory of a factors-only Linear: its inverses from its first K-FAC
// instruction on (in the steady state the previous refresh's are on the device when the window
// starts, as a kept Linear's state), its factors only between a prefetch's start and its
// write-back's end.
TEST(OffloadPass, FactorsOnlyInversesCountFromTheLinearsFirstKfacWork) {
  const sim::UniformCostModel costs(offload_costs(1e5));
  KfacOptions kfac;
  kfac.refresh_steps = 1;
  const auto pass = run_pipefisher(compiled(ScheduleKind::kOneFOneB, 2, 4), costs, kfac);
  const auto offload = run_offload_pass(pass, costs, {OffloadMode::kFactors, 0.0, {}});
  // One Linear factors-only alone in a stream of worker 0: its copies and K-FAC work.
  sched::Schedule s = offload.schedule;
  const auto& stream = s.streams[0];
  const auto first = std::find_if(stream.begin(), stream.end(), [](const auto& in) {
    return in.kind == OpKind::kPrefetchFactors;
  });
  ASSERT_NE(first, stream.end());
  const int layer = first->layer;
  const LinearKind linear = first->linear;
  std::vector<sched::Instruction> kept;
  for (const auto& in : stream) {
    if (sched::is_kfac(in.kind) && (in.layer != layer || in.linear != linear)) continue;
    kept.push_back(in);
  }
  s.streams[0] = kept;
  sched::validate(s);
  const auto simulated = sim::simulate(s, costs);
  const auto& times = simulated.times[0];
  const auto& memory = simulated.workers[0].memory;
  const auto at = [&](double t) {  // the memory just after time t
    double bytes = memory.front().bytes;
    for (const auto& sample : memory) {
      if (sample.time_s <= t) bytes = sample.bytes;
    }
    return bytes;
  };
  double kfac_start = -1, factors_start = -1, inversion_start = -1, write_back_end = -1;
  for (std::size_t i = 0; i < s.streams[0].size(); ++i) {
    const auto& in = s.streams[0][i];
    if (sched::is_kfac(in.kind) && kfac_start < 0) kfac_start = times[i].start_s;
    if (in.kind == OpKind::kPrefetchFactors && factors_start < 0) factors_start = times[i].start_s;
    if ((in.kind == OpKind::kInvertA || in.kind == OpKind::kInvertB) && inversion_start < 0) {
      inversion_start = times[i].start_s;
    }
    if (in.kind == OpKind::kWriteBackState) write_back_end = times[i].end_s;
  }
  ASSERT_LT(kfac_start, factors_start);  // the refresh's first curvature, then the factors
  ASSERT_LT(factors_start, inversion_start);
  ASSERT_LT(inversion_start, write_back_end);
  // What changes at an instant (activations are 10 bytes, the K-FAC copies 500).
  const auto jump = [&](double t) { return at(t) - at(std::nextafter(t, -1.0)); };
  // The inverses from now on, and the curvature's factor sum (a quarter of the state).
  EXPECT_NEAR(jump(kfac_start), 500.0 + 250.0, 50.0);
  EXPECT_NEAR(jump(factors_start), 500.0, 50.0);    // the factors come in
  EXPECT_NEAR(jump(inversion_start), 0.0, 50.0);    // nothing new: the inverses are there
  EXPECT_NEAR(jump(write_back_end), -500.0, 50.0);  // the factors leave
  // At the end: the inverses beside what the stream without K-FAC holds.
  sched::Schedule bare = s;
  std::erase_if(bare.streams[0], [](const auto& in) { return sched::is_kfac(in.kind); });
  EXPECT_DOUBLE_EQ(memory.back().bytes - sim::simulate(bare, costs).workers[0].memory.back().bytes,
                   500.0);
}

TEST(OffloadPass, ASlowHostLinkCostsStepTime) {
  const sim::UniformCostModel fast(offload_costs(1e5));
  const sim::UniformCostModel slow(offload_costs(50.0));  // a 500-byte copy: 10 s
  KfacOptions kfac;
  kfac.refresh_steps = 1;
  const auto base = compiled(ScheduleKind::kOneFOneB, 4, 8);
  const auto fast_run =
      run_offload_pass(run_pipefisher(base, fast, kfac), fast, {OffloadMode::kHost, 0.0, {}});
  const auto slow_run =
      run_offload_pass(run_pipefisher(base, slow, kfac), slow, {OffloadMode::kHost, 0.0, {}});
  EXPECT_GT(slow_run.after.step_time_s, fast_run.after.step_time_s + 1.0);
  EXPECT_GT(slow_run.report.step_time_overhead, 0.1);
  int late = 0;
  for (const auto& w : slow_run.report.workers) late += w.late_prefetches;
  EXPECT_GT(late, 0);
}

// A link slower than the preconditioning it feeds (a 500-byte inverse copy: 30 ms against a
// 20 ms preconditioning): the prefetches must start before the first preconditioning, and placed
// backwards from the last consumer they reach the link in the consumers' order, each as late as
// the later ones allow. (Placed forwards, each found the link taken before its consumer and went
// before all the others: the step's inverses arrived in reverse order and all waited on the
// device.)
TEST(OffloadPass, InversePrefetchesOnABusyLinkArriveInTheirConsumersOrder) {
  const sim::UniformCostModel costs(offload_costs(500.0 / 0.03));
  KfacOptions kfac;
  kfac.refresh_steps = 2;
  const auto pass = run_pipefisher(compiled(ScheduleKind::kOneFOneB, 4, 8), costs, kfac);
  const auto offload = run_offload_pass(pass, costs, {OffloadMode::kHost, 0.0, {}});
  EXPECT_NO_THROW(sched::validate(offload.schedule));
  EXPECT_NEAR(offload.after.step_time_s, pass.after.step_time_s, 1e-9);
  EXPECT_EQ(offload.report.copy_order, "prefetches-latest-first");
  int checked = 0;
  for (int w = 0; w < offload.schedule.num_workers(); ++w) {
    const auto& stream = offload.schedule.streams[static_cast<std::size_t>(w)];
    const auto& times = offload.after.times[static_cast<std::size_t>(w)];
    // (step, layer, linear) -> the prefetch's start and the preconditioning's start
    std::map<std::tuple<int, int, int>, std::pair<double, double>> copies;
    for (std::size_t i = 0; i < stream.size(); ++i) {
      const auto& in = stream[i];
      const std::tuple<int, int, int> key{in.step, in.layer, static_cast<int>(in.linear)};
      if (in.kind == OpKind::kPrefetchInverses) copies[key].first = times[i].start_s;
      if (in.kind == OpKind::kPrecondition && in.piece_begin == 0) {
        copies[key].second = times[i].start_s;
      }
    }
    std::map<int, std::vector<std::pair<double, double>>> by_step;  // consumer start, copy start
    for (const auto& [key, when] : copies) {
      by_step[std::get<0>(key)].emplace_back(when.second, when.first);
    }
    for (auto& [step, pairs] : by_step) {
      std::sort(pairs.begin(), pairs.end());
      for (std::size_t i = 1; i < pairs.size(); ++i) {
        EXPECT_LT(pairs[i - 1].second, pairs[i].second)
            << "worker " << w << " step " << step << ": the prefetch for the consumer at "
            << pairs[i].first << " s starts before the one for the consumer at "
            << pairs[i - 1].first << " s";
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 0);
}

TEST(OffloadPass, AutoMeetsTheBudgetWithTheFewestLinears) {
  const sim::UniformCostModel costs(offload_costs(1e5));
  const auto pass = run_pipefisher(compiled(ScheduleKind::kOneFOneB, 4, 8), costs, {});
  // Each worker holds 6 Linears of 1000 bytes and their factor sums, 500 bytes each, all at once
  // while the refresh accumulates them: the budget holds the sums and about 4 Linears' state.
  double other = 0.0;
  for (const auto& w : pass.before.workers) other = std::max(other, w.peak_memory_bytes);
  const double budget = other + 3000.0 + 4000.0;
  const auto automatic = run_offload_pass(pass, costs, {OffloadMode::kAuto, budget, {}});
  const auto host = run_offload_pass(pass, costs, {OffloadMode::kHost, 0.0, {}});
  EXPECT_TRUE(automatic.report.fits) << automatic.report.warning;
  for (int w = 0; w < automatic.schedule.num_workers(); ++w) {
    const auto& plan = automatic.plan.workers[static_cast<std::size_t>(w)];
    // The factors first: whole Linears only once every Linear's factors are offloaded.
    EXPECT_GE(plan.offloaded.size() + plan.factors_only.size(), 1U);
    EXPECT_LT(plan.offloaded.size(), 6U);  // fewer than everything
    if (!plan.offloaded.empty()) {
      EXPECT_TRUE(plan.kept.empty());
    }
    EXPECT_TRUE(plan.fits);
    EXPECT_LE(automatic.after.workers[w].peak_memory_bytes, budget) << "worker " << w;
    EXPECT_GT(pass.after.workers[w].peak_memory_bytes, budget) << "worker " << w;
    EXPECT_LE(host.after.workers[w].peak_memory_bytes,
              automatic.after.workers[w].peak_memory_bytes);
  }
  EXPECT_LT(automatic.report.transfers, host.report.transfers);
  EXPECT_THROW(run_offload_pass(pass, costs, {OffloadMode::kAuto, 0.0, {}}), std::invalid_argument);
  // A budget below what even full offload needs: a warning, not an error.
  const auto tight = run_offload_pass(pass, costs, {OffloadMode::kAuto, other + 10.0, {}});
  EXPECT_FALSE(tight.report.fits);
  EXPECT_NE(tight.report.warning.find("not met"), std::string::npos);
}

// Zero-length inversions (a measured profile too coarse to time them) end where the next one
// starts: a Linear's factor prefetch must still precede its inversions (it once followed their
// write-back, which sorted first at the equal deadline).
TEST(OffloadPass, ZeroLengthInversionsKeepTheirCopiesInOrder) {
  auto zero = offload_costs(1e5);
  zero.invert_a_s = zero.invert_b_s = 0.0;
  zero.precondition_s = 0.0;
  const sim::UniformCostModel costs(zero);
  for (const int refresh : {1, 4}) {
    KfacOptions kfac;
    kfac.refresh_steps = refresh;
    const auto pass = run_pipefisher(compiled(ScheduleKind::kOneFOneB, 2, 8), costs, kfac);
    OffloadResult offload;
    ASSERT_NO_THROW(offload = run_offload_pass(pass, costs, {OffloadMode::kHost, 0.0, {}}))
        << "k = " << refresh;
    EXPECT_GT(count(offload.schedule, OpKind::kPrefetchFactors), 0U);
  }
}

// Sharded K-FAC state (--kfac-sharding): each Linear's one factor window runs from its first
// inversion to its inverse broadcast (the owner sends, the other inverse holders receive, the
// new inverses on the device), written back after it; between refreshes the busiest replica
// holds none of the offloaded state.
PassResult sharded_pass(const sim::CostModel& costs, const kfac::StatePlacement& placement) {
  sched::ScheduleParams params;
  params.kind = ScheduleKind::kOneFOneB;
  params.workers = 2;
  params.microbatches = 4;
  params.data_parallel = 2;
  KfacOptions kfac;
  kfac.refresh_steps = 2;
  kfac.state_placement = placement;
  // 2 x 4 x (8^2 + 8^2) = 1024 bytes of state per Linear, about the cost model's 1000.
  kfac.linear_dims = std::vector<kfac::LinearDims>(6, kfac::LinearDims{8, 8});
  return run_pipefisher(sched::compile(params), costs, kfac);
}
const kfac::StatePlacement kFactorsShardedInversesReplicated{{kfac::Placement::kShard, 0},
                                                             {kfac::Placement::kReplicate, 0}};

TEST(OffloadPass, ShardedStateWindowsReachTheInverseBroadcast) {
  const sim::UniformCostModel costs(offload_costs(1e5));
  for (const auto& placement :
       {kfac::uniform_placement({kfac::Placement::kShard, 0}), kFactorsShardedInversesReplicated}) {
    SCOPED_TRACE(kfac::to_string(placement));
    const auto pass = sharded_pass(costs, placement);
    OffloadResult offload;
    ASSERT_NO_THROW(offload = run_offload_pass(pass, costs, {OffloadMode::kHost, 0.0, {}}));
    EXPECT_NO_THROW(sched::validate(offload.schedule));
    const bool broadcasts = count(pass.schedule, OpKind::kBroadcastInverses) > 0;
    EXPECT_EQ(broadcasts, placement == kFactorsShardedInversesReplicated);
    for (int w = 0; w < offload.schedule.num_workers(); ++w) {
      const auto& plan = offload.plan.workers[static_cast<std::size_t>(w)];
      const auto& stream = offload.schedule.streams[static_cast<std::size_t>(w)];
      // Per Linear: its write-backs, and where its broadcast is.
      std::map<std::pair<int, int>, std::vector<std::size_t>> write_backs;
      std::map<std::pair<int, int>, std::size_t> broadcast;
      for (std::size_t i = 0; i < stream.size(); ++i) {
        const std::pair<int, int> key{stream[i].layer, static_cast<int>(stream[i].linear)};
        if (stream[i].kind == OpKind::kWriteBackState) write_backs[key].push_back(i);
        if (stream[i].kind == OpKind::kBroadcastInverses) broadcast[key] = i;
      }
      EXPECT_EQ(write_backs.size(), plan.offloaded.size()) << "worker " << w;
      for (const auto& [key, positions] : write_backs) {
        if (!broadcasts) continue;
        ASSERT_EQ(positions.size(), 1U) << "one window, inversion to broadcast";
        ASSERT_TRUE(broadcast.contains(key));
        EXPECT_GT(positions.front(), broadcast.at(key));
      }
      // The plan counts what the busiest replica holds; at the refresh's end it holds none of
      // the offloaded state.
      EXPECT_GT(plan.offloaded_bytes, 0.0);
      EXPECT_DOUBLE_EQ(
          pass.after.workers[w].memory.back().bytes - offload.after.workers[w].memory.back().bytes,
          plan.offloaded_bytes)
          << "worker " << w;
      EXPECT_LE(offload.after.workers[w].peak_memory_bytes,
                pass.after.workers[w].peak_memory_bytes);
      // The planner counts the factor sums (4 x (8^2 + 8^2) bytes) of every Linear the replica
      // has K-FAC work of, factors or not: each accumulates them on the device (those without
      // the factors up to the curvature sync).
      const auto linears = plan.kept.size() + plan.offloaded.size() + plan.factors_only.size();
      EXPECT_DOUBLE_EQ(factor_sum_bytes(plan), 512.0 * static_cast<double>(linears));
      EXPECT_DOUBLE_EQ(offload.report.workers[static_cast<std::size_t>(w)].factor_sum_bytes,
                       factor_sum_bytes(plan));
    }
  }
}

// The factor window written back before its inverse broadcast (the write-back moved up, or the
// broadcast down): refused.
TEST(OffloadValidation, AWriteBackBeforeItsInverseBroadcastIsRefused) {
  const sim::UniformCostModel costs(offload_costs(1e5));
  const auto offload = run_offload_pass(sharded_pass(costs, kFactorsShardedInversesReplicated),
                                        costs, {OffloadMode::kHost, 0.0, {}});
  const auto refusal = [](const sched::Schedule& s) {
    try {
      sched::validate(s);
    } catch (const sched::ValidationError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  auto stream_of = [](sched::Schedule& s) -> std::vector<sched::Instruction>& {
    return s.streams[0];
  };
  const auto find = [](std::vector<sched::Instruction>& stream, OpKind kind, int layer,
                       LinearKind linear) {
    return std::find_if(stream.begin(), stream.end(), [&](const auto& in) {
      return in.kind == kind && (layer < 0 || (in.layer == layer && in.linear == linear));
    });
  };
  {  // the write-back just before the broadcast
    auto s = offload.schedule;
    auto& stream = stream_of(s);
    const auto broadcast = find(stream, OpKind::kBroadcastInverses, -1, LinearKind::kQuery);
    ASSERT_NE(broadcast, stream.end());
    const auto moved = *broadcast;
    const auto write_back = find(stream, OpKind::kWriteBackState, moved.layer, moved.linear);
    ASSERT_NE(write_back, stream.end());
    ASSERT_GT(write_back, broadcast);
    const auto wb = *write_back;
    stream.erase(write_back);
    stream.insert(find(stream, OpKind::kBroadcastInverses, moved.layer, moved.linear), wb);
    EXPECT_NE(refusal(s).find("before its inverse broadcast"), std::string::npos) << refusal(s);
  }
  {  // the broadcast after the write-back
    auto s = offload.schedule;
    auto& stream = stream_of(s);
    const auto broadcast = find(stream, OpKind::kBroadcastInverses, -1, LinearKind::kQuery);
    const auto moved = *broadcast;
    stream.erase(broadcast);
    stream.insert(std::next(find(stream, OpKind::kWriteBackState, moved.layer, moved.linear)),
                  moved);
    EXPECT_NE(refusal(s).find("before its inverse broadcast"), std::string::npos) << refusal(s);
  }
}

// ---- validation and formats ---------------------------------------------------------------------

sched::Schedule offloaded_schedule() {
  const sim::UniformCostModel costs(offload_costs(1e5));
  KfacOptions kfac;
  kfac.refresh_steps = 2;
  return run_offload_pass(run_pipefisher(compiled(ScheduleKind::kOneFOneB, 2, 4), costs, kfac),
                          costs, {OffloadMode::kHost, 0.0, {}})
      .schedule;
}

// Removes the first instruction of `kind` from worker 0 and expects validation to name `what`.
void expect_refused_without(OpKind kind, const std::string& what) {
  auto s = offloaded_schedule();
  auto& stream = s.streams[0];
  const auto it =
      std::find_if(stream.begin(), stream.end(), [&](const auto& in) { return in.kind == kind; });
  ASSERT_NE(it, stream.end());
  stream.erase(it);
  try {
    sched::validate(s);
    FAIL() << "validated without " << sched::to_string(kind);
  } catch (const sched::ValidationError& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

TEST(OffloadValidation, EveryUseNeedsItsCopy) {
  expect_refused_without(OpKind::kPrefetchInverses, "without its inverses on the device");
  expect_refused_without(OpKind::kPrefetchFactors, "without its factors on the device");
  expect_refused_without(OpKind::kWriteBackState, "not written back");
}

sched::Schedule factors_only_schedule() {
  const sim::UniformCostModel costs(offload_costs(1e5));
  KfacOptions kfac;
  kfac.refresh_steps = 2;
  return run_offload_pass(run_pipefisher(compiled(ScheduleKind::kOneFOneB, 2, 4), costs, kfac),
                          costs, {OffloadMode::kFactors, 0.0, {}})
      .schedule;
}

std::string refusal_of(const sched::Schedule& s) {
  try {
    sched::validate(s);
  } catch (const sched::ValidationError& e) {
    return e.what();
  }
  return "";
}

// A factors-only Linear needs no inverse prefetch, and has none: one inverse prefetch before
// one of its preconditionings (a schedule with inverse prefetches for some steps but not all)
// is refused; so is a factor copy of it not marked, and a Linear whose copies are all unmarked
// (then offloaded whole) without its inverse prefetches.
TEST(OffloadValidation, AFactorsOnlyLinearHasNoInversePrefetch) {
  const auto base = factors_only_schedule();
  ASSERT_EQ(refusal_of(base), "");
  ASSERT_EQ(count(base, OpKind::kPrefetchInverses), 0U);
  const auto& stream0 = base.streams[0];
  const auto precondition = std::find_if(stream0.begin(), stream0.end(), [](const auto& in) {
    return in.kind == OpKind::kPrecondition && in.piece_begin == 0 && in.step == 0;
  });
  ASSERT_NE(precondition, stream0.end());
  {  // an inverse prefetch for step 0 only
    auto s = base;
    auto& stream = s.streams[0];
    sched::Instruction fetch = *precondition;
    fetch.kind = OpKind::kPrefetchInverses;
    fetch.microbatch = -1;
    fetch.piece_begin = 0;
    fetch.piece_end = sched::kPieceUnits;
    fetch.bytes = 500;
    stream.insert(stream.begin() + (precondition - stream0.begin()), fetch);
    EXPECT_NE(refusal_of(s).find("offloaded factors only"), std::string::npos) << refusal_of(s);
  }
  const auto is_copy_of = [&](const sched::Instruction& in) {
    return sched::is_kfac_transfer(in.kind) && in.layer == precondition->layer &&
           in.linear == precondition->linear;
  };
  {  // one of its factor copies unmarked
    auto s = base;
    auto& stream = s.streams[0];
    const auto copy = std::find_if(stream.begin(), stream.end(), is_copy_of);
    ASSERT_NE(copy, stream.end());
    copy->microbatch = -1;
    EXPECT_NE(refusal_of(s).find("not marked factors-only"), std::string::npos) << refusal_of(s);
  }
  {  // all unmarked: offloaded whole, so every preconditioning needs its prefetch
    auto s = base;
    for (auto& in : s.streams[0]) {
      if (is_copy_of(in)) in.microbatch = -1;
    }
    EXPECT_NE(refusal_of(s).find("without its inverses on the device"), std::string::npos)
        << refusal_of(s);
  }
  // The other rules hold for factors-only Linears too.
  for (const auto kind : {OpKind::kPrefetchFactors, OpKind::kWriteBackState}) {
    auto s = base;
    auto& stream = s.streams[0];
    stream.erase(std::find_if(stream.begin(), stream.end(),
                              [&](const auto& in) { return in.kind == kind; }));
    EXPECT_NE(refusal_of(s), "") << sched::to_string(kind);
  }
}

TEST(OffloadValidation, AWriteBackBeforeItsInversionIsRefused) {
  auto s = offloaded_schedule();
  auto& stream = s.streams[0];
  const auto write_back = std::find_if(stream.begin(), stream.end(), [](const auto& in) {
    return in.kind == OpKind::kWriteBackState;
  });
  ASSERT_NE(write_back, stream.end());
  const auto moved = *write_back;
  stream.erase(write_back);
  const auto factors = std::find_if(stream.begin(), stream.end(), [&](const auto& in) {
    return in.kind == OpKind::kPrefetchFactors && in.layer == moved.layer &&
           in.linear == moved.linear;
  });
  stream.insert(std::next(factors), moved);
  EXPECT_THROW(sched::validate(s), sched::ValidationError);
}

TEST(OffloadFormats, TorchCsvRefusesTheCopiesAndNamesKindsRoundTrip) {
  sched::Schedule one_step = offloaded_schedule();
  one_step.num_steps = 1;
  EXPECT_THROW(sched::to_torch_csv(one_step, true), std::invalid_argument);
  for (const auto kind :
       {OpKind::kPrefetchFactors, OpKind::kWriteBackState, OpKind::kPrefetchInverses}) {
    EXPECT_EQ(sched::op_kind_from_string(sched::to_string(kind)), kind);
    EXPECT_TRUE(sched::is_kfac_transfer(kind));
    EXPECT_TRUE(sched::is_kfac(kind));
  }
}

}  // namespace
}  // namespace pf::pipefisher
