// Moving backward-weight (W) work: defer_backward_weights on zero-bubble schedules (order kept,
// never past the optimizer step, the result validates and simulates), and the pass with
// --kfac-move-w on (valid, simulated, never more refresh steps than with the Ws unmoved).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "runtime/model/bert_config.h"
#include "scheduler/compile.h"
#include "scheduler/pipefisher/defer_weights.h"
#include "scheduler/pipefisher/pass.h"
#include "scheduler/pipefisher/timeline.h"
#include "scheduler/validate.h"
#include "sim/analytic_cost_model.h"
#include "sim/simulator.h"
#include "sim/uniform_cost_model.h"

namespace pf::pipefisher {
namespace {

using sched::OpKind;
using sched::ScheduleKind;

sched::Schedule compiled(ScheduleKind kind, int workers, int microbatches, int chunks = 1,
                         int layers = 0) {
  sched::ScheduleParams params;
  params.kind = kind;
  params.workers = workers;
  params.microbatches = microbatches;
  params.chunks_per_worker = chunks;
  if (layers > 0) params.num_layers = layers;
  return sched::compile(params);
}

// The compute instructions of a stream, as labels ("F0.c0", "I1.c0", "W0.c0", ...).
std::vector<std::string> computes(const std::vector<sched::Instruction>& stream) {
  std::vector<std::string> out;
  for (const auto& in : stream) {
    if (sched::is_compute(in.kind)) out.push_back(sched::short_label(in));
  }
  return out;
}

TEST(DeferWeights, ZeroBubbleH1StreamsMoveAsSpecified) {
  const auto base = compiled(ScheduleKind::kZeroBubbleH1, 4, 4);
  // Worker 0 of ZB-H1 p = 4, m = 4: F0 F1 F2 F3 I0 W0 I1 W1 I2 W2 I3 W3.
  ASSERT_EQ(computes(base.streams[0]),
            (std::vector<std::string>{"F0.c0", "F1.c0", "F2.c0", "F3.c0", "I0.c0", "W0.c0", "I1.c0",
                                      "W1.c0", "I2.c0", "W2.c0", "I3.c0", "W3.c0"}));
  EXPECT_EQ(defer_backward_weights(base, 0).streams, base.streams);
  const auto one = defer_backward_weights(base, 1);
  EXPECT_EQ(computes(one.streams[0]),
            (std::vector<std::string>{"F0.c0", "F1.c0", "F2.c0", "F3.c0", "I0.c0", "I1.c0", "W0.c0",
                                      "I2.c0", "W1.c0", "I3.c0", "W2.c0", "W3.c0"}));
  const auto all = defer_backward_weights(base, kDeferAllTheWay);
  EXPECT_EQ(computes(all.streams[0]),
            (std::vector<std::string>{"F0.c0", "F1.c0", "F2.c0", "F3.c0", "I0.c0", "I1.c0", "I2.c0",
                                      "I3.c0", "W0.c0", "W1.c0", "W2.c0", "W3.c0"}));
  const sim::UniformCostModel costs(sim::UniformCosts{});
  for (const auto* schedule : {&one, &all}) {
    EXPECT_NO_THROW(sched::validate(*schedule));
    for (const auto& stream : schedule->streams) {
      // The optimizer step stays after every W.
      ASSERT_FALSE(stream.empty());
      EXPECT_EQ(stream.back().kind, OpKind::kOptimizerStep);
    }
    const auto simulated = sim::simulate(*schedule, costs);
    EXPECT_GT(simulated.step_time_s, 0.0);
  }
  // Deferring all the way makes worker 0 run its four Ws after its last I: a longer step.
  EXPECT_GT(sim::simulate(all, costs).step_time_s, sim::simulate(base, costs).step_time_s);
  EXPECT_THROW(defer_backward_weights(base, -1), std::invalid_argument);
  EXPECT_THROW(defer_backward_weights(repeat_steps(base, 2), 1), std::invalid_argument);
}

TEST(DeferWeights, SchedulesWithoutWsAreLeftAlone) {
  const auto base = compiled(ScheduleKind::kOneFOneB, 4, 8);
  EXPECT_FALSE(has_backward_weights(base));
  EXPECT_EQ(defer_backward_weights(base, kDeferAllTheWay).streams, base.streams);
  EXPECT_TRUE(has_backward_weights(compiled(ScheduleKind::kZeroBubbleV, 4, 8, 2)));
}

// BERT-Base on the h100 preset, micro-batch 32: the case of docs/pipefisher.md.
sim::AnalyticCostModel bert_base_h100() {
  sim::Workload workload;
  workload.config = model::bert_preset("base");
  workload.seq_len = 128;
  workload.micro_batch_size = 32;
  workload.precision = sim::Precision::kBf16;
  return sim::AnalyticCostModel(workload, sim::device_preset("h100"));
}

TEST(DeferWeights, PassWithMovableWsValidatesSimulatesAndNeverNeedsMoreSteps) {
  const auto costs = bert_base_h100();
  struct Case {
    ScheduleKind kind;
    int chunks;
  };
  int moved = 0;
  for (const Case& c : {Case{ScheduleKind::kZeroBubbleH1, 1}, Case{ScheduleKind::kZeroBubbleH2, 1},
                        Case{ScheduleKind::kZeroBubbleV, 2}, Case{ScheduleKind::kOneFOneB, 1}}) {
    SCOPED_TRACE(std::string(sched::to_string(c.kind)));
    const auto base = compiled(c.kind, 4, 4, c.chunks, 12);
    const auto fixed = run_pipefisher(base, costs);
    KfacOptions options;
    options.move_weights = true;
    const auto result = run_pipefisher(base, costs, options);
    EXPECT_NO_THROW(sched::validate(result.schedule));
    EXPECT_EQ(result.schedule.num_steps, result.report.refresh_steps);
    EXPECT_LE(result.report.refresh_steps, fixed.report.refresh_steps);
    // "Before" is the schedule as generated, whatever moved.
    EXPECT_DOUBLE_EQ(result.report.step_time_before_s, fixed.report.step_time_before_s);
    const auto simulated = sim::simulate(result.schedule, costs);
    EXPECT_NEAR(simulated.step_time_s, result.report.step_time_after_s,
                1e-9 * simulated.step_time_s);
    if (c.kind == ScheduleKind::kOneFOneB) {
      EXPECT_EQ(result.report.weights_deferred, 0);
      EXPECT_EQ(result.schedule.streams, fixed.schedule.streams);
    }
    if (result.report.weights_deferred > 0) {
      ++moved;
      EXPECT_TRUE(result.report.refresh_steps < fixed.report.refresh_steps ||
                  result.report.step_time_after_s < fixed.report.step_time_after_s);
    }
  }
  // docs/pipefisher.md: at p = m = 4 moving the Ws takes ZB-H1 and ZB-H2 from 8 to 6 steps and
  // makes ZB-V's step shorter.
  EXPECT_GE(moved, 2);
}

}  // namespace
}  // namespace pf::pipefisher
