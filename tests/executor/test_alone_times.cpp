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

TEST(AloneTimes, RanksOnDifferentMachinesDoNotShareAProcessor) {
  // Ranks 0 and 1 on machine 0, rank 2 on machine 1: [0, 2) of rank 0 overlaps [1, 3) of rank 1
  // and [0, 2) of rank 2, but only rank 1's counts at capacity 1.
  const auto on_rank = [](InstructionEvent event, int rank) {
    event.rank = rank;
    return event;
  };
  const std::vector<InstructionEvent> events = {
      on_rank(compute(0, 2), 0), on_rank(compute(0, 2), 2), on_rank(compute(1, 3), 1)};
  const auto alone = alone_times_by_machine(events, 1.0, {0, 0, 1});
  ASSERT_EQ(alone.size(), 3U);
  EXPECT_DOUBLE_EQ(alone[0].busy_s, 1.5);
  EXPECT_DOUBLE_EQ(alone[1].busy_s, 2.0);  // alone on its machine, and still in its place
  EXPECT_EQ(alone[1].rank, 2);
  EXPECT_DOUBLE_EQ(alone[2].busy_s, 1.5);
  // One machine (or no map): all three share it.
  for (const std::vector<int>& one : {std::vector<int>{0, 0, 0}, std::vector<int>{}}) {
    const auto shared = alone_times_by_machine(events, 1.0, one);
    const auto expected = alone_times(events, 1.0);
    for (std::size_t i = 0; i < events.size(); ++i) {
      EXPECT_DOUBLE_EQ(shared[i].busy_s, expected[i].busy_s);
    }
  }
  try {
    (void)alone_times_by_machine(events, 1.0, {0, 1});
    FAIL() << "an event of a rank outside the map was accepted";
  } catch (const std::invalid_argument& error) {
    EXPECT_STREQ(error.what(),
                 "alone_times_by_machine: an event of rank 2, but the machine map has 2 ranks");
  }
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
