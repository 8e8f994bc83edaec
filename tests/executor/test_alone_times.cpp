// exec::alone_times against the simulator's shared processor: the engine stretches known costs,
// and alone_times must give them back from the stretched spans.
#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

#include "runtime/executor/alone_times.h"
#include "scheduler/compile.h"
#include "sim/simulator.h"
#include "sim/uniform_cost_model.h"

namespace pf::exec {
namespace {

InstructionEvent compute(double start, double end, Lane lane = Lane::kCompute) {
  InstructionEvent event;
  event.lane = lane;
  event.start_s = start;
  event.end_s = end;
  event.busy_s = end - start;
  return event;
}

TEST(AloneTimes, OverlapAtCapacityOneHalvesTheSpeed) {
  // [0, 2) and [1, 3) on one core's worth: each ran alone for 1 s and beside the other for 1 s.
  const auto alone =
      alone_times({compute(0, 2), compute(1, 3), compute(0, 3, Lane::kCommunication)}, 1.0);
  EXPECT_DOUBLE_EQ(alone[0].busy_s, 1.5);
  EXPECT_DOUBLE_EQ(alone[1].busy_s, 1.5);
  EXPECT_DOUBLE_EQ(alone[2].busy_s, 3.0);  // communication keeps its time
  // Room for both: nothing changes.
  const auto roomy = alone_times({compute(0, 2), compute(1, 3, Lane::kKfac)}, 2.0);
  EXPECT_DOUBLE_EQ(roomy[0].busy_s, 2.0);
  EXPECT_DOUBLE_EQ(roomy[1].busy_s, 2.0);
  EXPECT_THROW(alone_times({}, 0.0), std::invalid_argument);
}

TEST(AloneTimes, InvertsTheSimulatorsSharedProcessor) {
  sched::ScheduleParams params;
  params.workers = 3;
  params.microbatches = 6;
  const auto schedule = sched::compile(params);
  const sim::UniformCostModel costs(sim::UniformCosts{.forward_s = 1.0, .backward_s = 2.0});
  for (const double capacity : {1.0, 1.5, 2.5}) {
    sim::SimOptions options;
    options.shared_processors.workers_per_processor = 3;
    options.shared_processors.capacity = capacity;
    const auto result = sim::simulate(schedule, costs, options);
    std::vector<InstructionEvent> events;
    for (int w = 0; w < 3; ++w) {
      for (std::size_t i = 0; i < schedule.streams[w].size(); ++i) {
        const auto& in = schedule.streams[w][i];
        if (in.kind != sched::OpKind::kForward && in.kind != sched::OpKind::kBackward) continue;
        events.push_back(compute(result.times[w][i].start_s, result.times[w][i].end_s));
        events.back().instruction = in;
      }
    }
    for (const auto& event : alone_times(events, capacity)) {
      const double cost = event.instruction.kind == sched::OpKind::kForward ? 1.0 : 2.0;
      EXPECT_NEAR(event.busy_s, cost, 1e-9) << "capacity " << capacity;
    }
  }
}

}  // namespace
}  // namespace pf::exec
