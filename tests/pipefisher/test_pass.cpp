// The whole pass on compiled schedules with the uniform cost model: validity of the augmented
// schedules, the safety margin, the refresh interval arithmetic, utilization accounting.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>

#include "scheduler/compile.h"
#include "scheduler/pipefisher/pass.h"
#include "scheduler/pipefisher/report_json.h"
#include "scheduler/pipefisher/timeline.h"
#include "scheduler/validate.h"
#include "sim/uniform_cost_model.h"

namespace pf::pipefisher {
namespace {

using sched::OpKind;
using sched::ScheduleKind;

sched::Schedule compiled(ScheduleKind kind, int workers, int microbatches, int chunks = 1) {
  sched::ScheduleParams params;
  params.kind = kind;
  params.workers = workers;
  params.microbatches = microbatches;
  params.chunks_per_worker = chunks;
  return sched::compile(params);
}

// Forward 1, backward 2 per worker; K-FAC per Linear and micro-batch small against them.
sim::UniformCosts kfac_costs(double scale = 1.0) {
  sim::UniformCosts costs;
  costs.forward_s = 1.0;
  costs.backward_s = 2.0;
  costs.curvature_a_s = 0.01 * scale;
  costs.curvature_b_s = 0.01 * scale;
  costs.curvature_sync_s = 0.02 * scale;
  costs.invert_a_s = 0.05 * scale;
  costs.invert_b_s = 0.05 * scale;
  costs.precondition_s = 0.02 * scale;
  costs.kfac_bytes = 1000.0;
  return costs;
}

// K-FAC durations stretched by a factor, everything else as the wrapped model.
class StretchedKfac final : public sim::CostModel {
 public:
  StretchedKfac(const sim::CostModel& inner, double factor) : inner_(inner), factor_(factor) {}
  double duration(const sched::Schedule& s, int w, const sched::Instruction& in) const override {
    const double d = inner_.duration(s, w, in);
    return sched::is_kfac(in.kind) ? d * factor_ : d;
  }
  double activation_bytes(const sched::Schedule& s, int p, int c) const override {
    return inner_.activation_bytes(s, p, c);
  }
  double static_bytes(const sched::Schedule& s, int p, int c) const override {
    return inner_.static_bytes(s, p, c);
  }
  double kfac_bytes(const sched::Schedule& s, int l, sched::LinearKind k) const override {
    return inner_.kfac_bytes(s, l, k);
  }

 private:
  const sim::CostModel& inner_;
  double factor_;
};

struct Case {
  ScheduleKind kind;
  int workers;
  int microbatches;
  int chunks;
};

const Case kCases[] = {{ScheduleKind::kGPipe, 4, 4, 1},
                       {ScheduleKind::kOneFOneB, 4, 8, 1},
                       {ScheduleKind::kInterleaved, 4, 8, 2},
                       {ScheduleKind::kChimera, 4, 4, 1},
                       {ScheduleKind::kChimera, 4, 8, 1},
                       {ScheduleKind::kOneFOneB, 2, 2, 1},
                       // Zero-bubble H1 (split backward: curvature B after backward-input,
                       // preconditioning after the last backward-weight) keeps some bubbles.
                       {ScheduleKind::kZeroBubbleH1, 4, 8, 1}};

TEST(PipeFisherPass, AugmentedSchedulesValidateAndFillBubbles) {
  const sim::UniformCostModel costs(kfac_costs());
  for (const Case& c : kCases) {
    for (PackingPolicy policy : {PackingPolicy::kFirstFit, PackingPolicy::kBestFit}) {
      SCOPED_TRACE(std::string(sched::to_string(c.kind)) + " p=" + std::to_string(c.workers) +
                   " m=" + std::to_string(c.microbatches) + " " + std::string(to_string(policy)));
      const auto base = compiled(c.kind, c.workers, c.microbatches, c.chunks);
      KfacOptions options;
      options.policy = policy;
      const auto result = run_pipefisher(base, costs, options);
      const auto& report = result.report;
      EXPECT_NO_THROW(sched::validate(result.schedule));
      EXPECT_EQ(result.schedule.num_steps, report.refresh_steps);
      EXPECT_GE(report.refresh_steps, 1);
      EXPECT_EQ(report.spilled_tasks, 0);
      // The base streams are all there, in order, step after step.
      for (int w = 0; w < base.num_workers(); ++w) {
        std::size_t next = 0;
        const auto repeated = repeat_steps(base, report.refresh_steps);
        const auto& base_stream = repeated.streams[static_cast<std::size_t>(w)];
        for (const auto& in : result.schedule.streams[static_cast<std::size_t>(w)]) {
          if (sched::is_kfac(in.kind)) continue;
          ASSERT_LT(next, base_stream.size());
          EXPECT_EQ(in, base_stream[next]);
          ++next;
        }
        EXPECT_EQ(next, base_stream.size());
      }
      EXPECT_GE(report.utilization_after, report.utilization_before - 1e-12);
      // Utilization after = (busy compute before + placed K-FAC compute) / time.
      double busy = 0.0;
      for (std::size_t w = 0; w < report.workers.size(); ++w) {
        busy += result.before.workers[w].busy_s + report.workers[w].kfac_compute_s;
      }
      EXPECT_NEAR(report.utilization_after,
                  busy / (static_cast<double>(base.num_workers()) * result.after.step_time_s),
                  1e-9);
    }
  }
}

// K-FAC work up to (1 + margin) times longer than planned never delays a forward or backward
// of the first step, and later steps only by the preconditioning that runs after a flush.
TEST(PipeFisherPass, SafetyMarginProtectsPipelineWork) {
  const sim::UniformCostModel nominal(kfac_costs(3.0));
  for (const Case& c : kCases) {
    SCOPED_TRACE(std::string(sched::to_string(c.kind)) + " m=" + std::to_string(c.microbatches));
    const auto base = compiled(c.kind, c.workers, c.microbatches, c.chunks);
    KfacOptions options;
    options.safety_margin = 0.1;
    const auto result = run_pipefisher(base, nominal, options);
    const StretchedKfac slower(nominal, 1.0 + options.safety_margin);
    const auto after = sim::simulate(result.schedule, slower);
    double flush_per_step = 0.0;
    for (const auto& w : result.report.workers)
      flush_per_step = std::max(flush_per_step, w.spilled_s);
    flush_per_step *= 1.0 + options.safety_margin;
    for (int w = 0; w < base.num_workers(); ++w) {
      const auto& stream = result.schedule.streams[static_cast<std::size_t>(w)];
      std::size_t base_position = 0;
      for (std::size_t x = 0; x < stream.size(); ++x) {
        if (sched::is_kfac(stream[x].kind)) continue;
        const std::size_t b = base_position++;
        if (!sched::is_compute(stream[x].kind)) continue;
        const double delay = after.times[static_cast<std::size_t>(w)][x].start_s -
                             result.before.times[static_cast<std::size_t>(w)][b].start_s;
        EXPECT_LE(delay, stream[x].step * flush_per_step + 1e-9)
            << "worker " << w << " " << sched::short_label(stream[x]);
      }
    }
  }
}

// GPipe, p workers, uniform costs: each worker idles (p-1)(t_f + t_b) per step. K-FAC work per
// worker W = m * 6 * (c_A + c_B) + 6 * (i_A + i_B); with small tasks the refresh takes about
// W / (bubble - preconditioning) steps, and grows with m.
TEST(PipeFisherPass, RefreshIntervalFollowsTheArithmetic) {
  const sim::UniformCostModel costs(kfac_costs(4.0));
  const int p = 4;
  int previous_k = 0;
  for (int m : {2, 4, 8, 16, 32}) {
    SCOPED_TRACE("m=" + std::to_string(m));
    const auto base = compiled(ScheduleKind::kGPipe, p, m);
    KfacOptions options;
    options.safety_margin = 0.0;
    const auto result = run_pipefisher(base, costs, options);
    const auto& c = costs.costs();
    const double work =
        m * 6 * (c.curvature_a_s + c.curvature_b_s) + 6 * (c.invert_a_s + c.invert_b_s);
    const double bubble = (p - 1) * (c.forward_s + c.backward_s);
    const double per_step = bubble - 6 * c.precondition_s;
    const int predicted = static_cast<int>(std::ceil(work / per_step));
    EXPECT_GE(result.report.refresh_steps, predicted);
    EXPECT_LE(result.report.refresh_steps, predicted + 1);
    EXPECT_GE(result.report.refresh_steps, previous_k);
    previous_k = result.report.refresh_steps;
  }
  EXPECT_GT(previous_k, 1);
}

// The refresh needs the curvature of the step's last backward, which on worker 0 ends the step:
// without idle time after it (plain GPipe / 1F1B) the refresh takes at least two steps. With a
// data-parallel gradient all-reduce at the end of the step, every worker idles after its last
// backward, and small K-FAC work completes within the step: k = 1. (Not for Chimera: its
// curvature sync needs the communication lanes, which the gradient all-reduces hold until the
// step ends, so its refresh always reaches into a second step.)
TEST(PipeFisherPass, LargeBubblesRefreshEveryStep) {
  auto with_reduction = kfac_costs(0.1);
  with_reduction.reduction_s = 1.0;
  const sim::UniformCostModel costs(with_reduction);
  for (const Case& c : kCases) {
    if (c.kind == ScheduleKind::kChimera) continue;
    sched::ScheduleParams params;
    params.kind = c.kind;
    params.workers = c.workers;
    params.microbatches = c.microbatches;
    params.chunks_per_worker = c.chunks;
    params.data_parallel = 2;
    const auto result = run_pipefisher(sched::compile(params), costs);
    EXPECT_EQ(result.report.refresh_steps, 1)
        << sched::to_string(c.kind) << " m=" << c.microbatches;
    EXPECT_NO_THROW(sched::validate(result.schedule));
  }
  const sim::UniformCostModel no_reduction(kfac_costs(0.1));
  EXPECT_EQ(
      run_pipefisher(compiled(ScheduleKind::kOneFOneB, 4, 8), no_reduction).report.refresh_steps,
      2);
}

TEST(PipeFisherPass, FixedIntervalSpillsWhatDoesNotFit) {
  const sim::UniformCostModel costs(kfac_costs(4.0));
  const auto base = compiled(ScheduleKind::kOneFOneB, 4, 16);
  const auto automatic = run_pipefisher(base, costs);
  ASSERT_GT(automatic.report.refresh_steps, 1);
  KfacOptions options;
  options.refresh_steps = 1;
  const auto fixed = run_pipefisher(base, costs, options);
  EXPECT_EQ(fixed.report.refresh_steps, 1);
  EXPECT_TRUE(fixed.report.fixed_interval);
  EXPECT_GT(fixed.report.spilled_tasks, 0);
  EXPECT_GT(fixed.report.step_time_overhead, automatic.report.step_time_overhead);
  EXPECT_NO_THROW(sched::validate(fixed.schedule));
}

// Kept whole (--kfac-split off), an inversion longer than every bubble fits under no refresh
// interval: the automatic search runs it (and only it) after the flush and sizes k for the rest,
// instead of searching on. (Divisible, it is cut into pieces: test_pieces.cpp.)
TEST(PipeFisherPass, TaskLongerThanEveryBubbleSpillsAndKStillFound) {
  const auto base = compiled(ScheduleKind::kOneFOneB, 4, 8);
  auto oversize = kfac_costs();
  oversize.invert_b_s = 100.0;  // the step itself takes about 33 s
  KfacOptions whole;
  whole.split = false;
  const auto result = run_pipefisher(base, sim::UniformCostModel(oversize), whole);
  const auto normal = run_pipefisher(base, sim::UniformCostModel(kfac_costs()), whole);
  EXPECT_LE(result.report.refresh_steps, normal.report.refresh_steps);
  EXPECT_FALSE(result.report.fixed_interval);
  int inversions_b = 0;
  for (const auto& stream : result.schedule.streams) {
    for (const auto& in : stream) inversions_b += in.kind == OpKind::kInvertB ? 1 : 0;
  }
  EXPECT_GT(inversions_b, 0);
  EXPECT_EQ(result.report.spilled_tasks, inversions_b);
  EXPECT_EQ(normal.report.spilled_tasks, 0);
  EXPECT_NO_THROW(sched::validate(result.schedule));
}

// ZB-H2 and ZB-V leave worker 0 no idle time at all with uniform F = I = W: no refresh interval
// can hold K-FAC; the automatic search takes its cap and warns, naming the flags; a fixed
// interval runs it after the flush.
TEST(PipeFisherPass, ZeroBubbleWithoutBubblesCapsTheIntervalAndWarns) {
  const sim::UniformCostModel costs(kfac_costs());
  for (const Case& c :
       {Case{ScheduleKind::kZeroBubbleH2, 4, 8, 1}, Case{ScheduleKind::kZeroBubbleV, 4, 8, 2}}) {
    SCOPED_TRACE(std::string(sched::to_string(c.kind)));
    const auto base = compiled(c.kind, c.workers, c.microbatches, c.chunks);
    KfacOptions options;
    options.max_refresh_steps = 3;
    const auto automatic = run_pipefisher(base, costs, options);
    EXPECT_NO_THROW(sched::validate(automatic.schedule));
    EXPECT_TRUE(automatic.report.capped);
    EXPECT_EQ(automatic.report.refresh_steps, 3);
    EXPECT_EQ(automatic.report.refresh_bound, -1);
    EXPECT_NE(automatic.report.warning.find("worker 0 has no idle time to fill"), std::string::npos)
        << automatic.report.warning;
    EXPECT_NE(automatic.report.warning.find("--kfac-refresh"), std::string::npos);
    EXPECT_GT(automatic.report.after_flush_s, 0.0);
    options.refresh_steps = 2;
    const auto fixed = run_pipefisher(base, costs, options);
    EXPECT_NO_THROW(sched::validate(fixed.schedule));
    EXPECT_EQ(fixed.schedule.num_steps, 2);
    EXPECT_GT(fixed.report.spilled_tasks, 0);
    EXPECT_GT(fixed.report.step_time_overhead, 0.0);
  }
}

TEST(PipeFisherPass, EveryStepCurvatureAndJson) {
  const sim::UniformCostModel costs(kfac_costs(0.5));
  const auto base = compiled(ScheduleKind::kChimera, 4, 4);
  KfacOptions options;
  options.curvature = CurvatureSource::kEveryStep;
  options.refresh_steps = 2;
  const auto result = run_pipefisher(base, costs, options);
  EXPECT_NO_THROW(sched::validate(result.schedule));
  int curvature_steps[2] = {0, 0};
  for (const auto& stream : result.schedule.streams) {
    for (const auto& in : stream) {
      if (in.kind == OpKind::kCurvatureA) ++curvature_steps[in.step];
    }
  }
  EXPECT_GT(curvature_steps[0], 0);
  EXPECT_EQ(curvature_steps[0], curvature_steps[1]);
  const auto json = to_json(result.report);
  for (const char* key : {"refresh_steps", "utilization_before", "utilization_after",
                          "step_time_overhead", "kfac_memory_bytes", "workers"}) {
    EXPECT_TRUE(json.contains(key)) << key;
  }
  EXPECT_EQ(json["refresh_steps"], 2);
  EXPECT_DOUBLE_EQ(json["kfac_memory_bytes"].get<double>(), 2 * 6 * 1000.0);  // two stages each
  // The factor sums on top: both factors' sums of each Linear, each a quarter of its state here
  // (CostModel::kfac_sum_bytes).
  EXPECT_DOUBLE_EQ(json["factor_sum_bytes"].get<double>(), 2 * 6 * 500.0);
  EXPECT_DOUBLE_EQ(json["workers"][0]["factor_sum_bytes"].get<double>(), 2 * 6 * 500.0);
}

TEST(PipeFisherPass, BadInputIsRejected) {
  const sim::UniformCostModel costs(kfac_costs());
  const auto base = compiled(ScheduleKind::kGPipe, 2, 2);
  KfacOptions options;
  options.safety_margin = -1.0;
  EXPECT_THROW(run_pipefisher(base, costs, options), std::invalid_argument);
  auto twice = repeat_steps(base, 2);
  EXPECT_THROW(run_pipefisher(twice, costs), std::invalid_argument);
  // No bubble at all on one worker (a single worker has none): automatic k takes its cap.
  const sim::UniformCostModel heavy(kfac_costs(1.0));
  const auto single = compiled(ScheduleKind::kGPipe, 1, 2);
  EXPECT_TRUE(run_pipefisher(single, heavy).report.capped);
  options = {};
  options.refresh_steps = 1;
  EXPECT_NO_THROW(run_pipefisher(single, heavy, options));
}

}  // namespace
}  // namespace pf::pipefisher

namespace pf::pipefisher {
namespace {

// Curvature from every step needs room after the last step's final backward, which GPipe/1F1B
// never leave on worker 0: the automatic search stops at once, takes its cap and warns.
TEST(PipeFisherPass, EveryStepCurvatureWarnsWhenNoIntervalFits) {
  KfacOptions options;
  options.curvature = CurvatureSource::kEveryStep;
  options.max_refresh_steps = 4;
  for (double scale : {0.5, 20.0}) {
    const auto result = run_pipefisher(compiled(ScheduleKind::kOneFOneB, 4, 8),
                                       sim::UniformCostModel(kfac_costs(scale)), options);
    EXPECT_NO_THROW(sched::validate(result.schedule));
    EXPECT_TRUE(result.report.capped);
    EXPECT_EQ(result.report.refresh_steps, 4);
    EXPECT_NE(result.report.warning.find("every_step"), std::string::npos) << result.report.warning;
  }
}

}  // namespace
}  // namespace pf::pipefisher

// ---- workers sharing a processor --------------------------------------------------------------

namespace pf::pipefisher {
namespace {

sim::SimOptions sharing(int workers_per_processor, double capacity) {
  sim::SimOptions options;
  options.shared_processors.workers_per_processor = workers_per_processor;
  options.shared_processors.capacity = capacity;
  return options;
}

double total_bubble_s(const BubbleMap& map) {
  double total = 0.0;
  for (const auto& worker : map.capacity_s) {
    for (const double step : worker) total += step;
  }
  return total;
}

TEST(PipeFisherSharedProcessors, BubblesHoldOnlyTheProcessorsRoom) {
  const auto base = compiled(ScheduleKind::kOneFOneB, 4, 8);
  const sim::UniformCostModel costs(kfac_costs());
  const BubbleMap own = find_bubbles(base, measure_timeline(base, costs), 3);
  // Room for every worker: the same bubbles.
  const BubbleMap roomy = find_bubbles(base, measure_timeline(base, costs, sharing(4, 4.0)), 3);
  EXPECT_NEAR(total_bubble_s(roomy), total_bubble_s(own), 1e-9);
  // Two of four at full speed: less room, and never a bubble longer than its idle span.
  const Timeline half_timeline = measure_timeline(base, costs, sharing(4, 2.0));
  const BubbleMap half = find_bubbles(base, half_timeline, 3);
  EXPECT_LT(total_bubble_s(half), total_bubble_s(own));
  EXPECT_GT(total_bubble_s(half), 0.0);
  // One processor's worth for four workers of a 1F1B pipeline: one of them always computes,
  // so no worker's idle time is the processor's.
  const BubbleMap none = find_bubbles(base, measure_timeline(base, costs, sharing(4, 1.0)), 3);
  EXPECT_NEAR(total_bubble_s(none), 0.0, 1e-9);
}

TEST(PipeFisherSharedProcessors, ThePassPlansWithTheRoomAndStaysValid) {
  const auto base = compiled(ScheduleKind::kOneFOneB, 4, 8);
  const sim::UniformCostModel costs(kfac_costs(4.0));
  const PassResult own = run_pipefisher(base, costs);
  const PassResult roomy = run_pipefisher(base, costs, {}, sharing(4, 4.0));
  EXPECT_EQ(roomy.report.refresh_steps, own.report.refresh_steps);
  EXPECT_NEAR(roomy.report.step_time_after_s, own.report.step_time_after_s,
              1e-9 * own.report.step_time_after_s);
  const PassResult half = run_pipefisher(base, costs, {}, sharing(4, 2.0));
  EXPECT_GE(half.report.refresh_steps, own.report.refresh_steps);
  EXPECT_NO_THROW(sched::validate(half.schedule));
  // The same K-FAC work on the shared processor costs more step time than on processors of
  // their own.
  EXPECT_GT(half.report.step_time_after_s, own.report.step_time_after_s);
}

}  // namespace
}  // namespace pf::pipefisher
