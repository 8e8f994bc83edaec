// The event engine on small hand-built schedules (independent of the generators).
#include <gtest/gtest.h>

#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "scheduler/compile.h"
#include "sim/processor_share.h"
#include "sim/simulator.h"
#include "sim/uniform_cost_model.h"

namespace pf::sim {
namespace {

using sched::Instruction;
using sched::OpKind;
using sched::Schedule;

Instruction make(OpKind kind, int chunk, int microbatch, int peer = -1, std::int64_t pair = -1) {
  Instruction in;
  in.kind = kind;
  in.chunk = chunk;
  in.microbatch = microbatch;
  in.peer = peer;
  in.pair_id = pair;
  return in;
}

Schedule two_stage_skeleton(int microbatches) {
  Schedule s;
  s.params.kind = sched::ScheduleKind::kGPipe;
  s.params.workers = 2;
  s.params.microbatches = microbatches;
  s.placement.num_pipelines = 1;
  s.placement.chunks_per_pipeline = 2;
  s.placement.num_layers = 2;
  for (int c = 0; c < 2; ++c) {
    sched::ChunkPlacement chunk;
    chunk.chunk = c;
    chunk.worker = c;
    chunk.first_layer = c;
    chunk.num_layers = 1;
    s.placement.chunks.push_back(chunk);
  }
  s.streams.resize(2);
  return s;
}

// GPipe over two workers without communication instructions.
Schedule gpipe_compute_only(int m) {
  Schedule s = two_stage_skeleton(m);
  for (int w = 0; w < 2; ++w) {
    for (int i = 0; i < m; ++i) s.streams[w].push_back(make(OpKind::kForward, w, i));
    for (int i = 0; i < m; ++i) s.streams[w].push_back(make(OpKind::kBackward, w, i));
  }
  return s;
}

// The same with explicit sends and receives; each side names its own chunk.
Schedule gpipe_lowered(int m) {
  Schedule s = two_stage_skeleton(m);
  auto& w0 = s.streams[0];
  auto& w1 = s.streams[1];
  for (int i = 0; i < m; ++i) {
    w0.push_back(make(OpKind::kForward, 0, i));
    w0.push_back(make(OpKind::kSendActivation, 0, i, 1, 2 * i));
    w1.push_back(make(OpKind::kRecvActivation, 1, i, 0, 2 * i));
    w1.push_back(make(OpKind::kForward, 1, i));
  }
  for (int i = 0; i < m; ++i) {
    w1.push_back(make(OpKind::kBackward, 1, i));
    w1.push_back(make(OpKind::kSendGradient, 1, i, 0, 2 * i + 1));
    w0.push_back(make(OpKind::kRecvGradient, 0, i, 1, 2 * i + 1));
    w0.push_back(make(OpKind::kBackward, 0, i));
  }
  return s;
}

TEST(SimEngine, ComputeOnlyGPipeMatchesClosedForm) {
  const UniformCostModel costs(UniformCosts{.forward_s = 1.0, .backward_s = 2.0});
  const SimResult r = simulate(gpipe_compute_only(4), costs);
  EXPECT_DOUBLE_EQ(r.makespan_s, (4 + 2 - 1) * 3.0);
  EXPECT_DOUBLE_EQ(r.bubble_fraction, 1.0 / 5.0);
  EXPECT_EQ(r.workers[0].peak_stashed_microbatches, 4);
  EXPECT_DOUBLE_EQ(r.workers[1].busy_s, 12.0);
}

TEST(SimEngine, LoweredGPipeWithFreeCommunicationMatchesComputeOnly) {
  const UniformCostModel costs(UniformCosts{.forward_s = 1.0, .backward_s = 2.0});
  const SimResult a = simulate(gpipe_compute_only(3), costs);
  const SimResult b = simulate(gpipe_lowered(3), costs);
  EXPECT_DOUBLE_EQ(a.makespan_s, b.makespan_s);
}

TEST(SimEngine, CommunicationDelaysButOverlapsCompute) {
  const UniformCostModel costs(
      UniformCosts{.forward_s = 1.0, .backward_s = 2.0, .communication_s = 0.5});
  const SimResult overlapped = simulate(gpipe_lowered(3), costs);
  // Two hops on the critical path (first activation, last gradient) cost 0.5 each.
  EXPECT_DOUBLE_EQ(overlapped.makespan_s, 4 * 3.0 + 1.0);
  const SimResult serial =
      simulate(gpipe_lowered(3), costs, SimOptions{.overlap_communication = false});
  EXPECT_GT(serial.makespan_s, overlapped.makespan_s);
  // The receive on worker 1 ends when the send's transfer ends.
  EXPECT_DOUBLE_EQ(overlapped.times[1][0].end_s, 1.5);
  EXPECT_DOUBLE_EQ(overlapped.times[1][1].start_s, 1.5);
  EXPECT_GT(overlapped.workers[1].exposed_communication_s, 0.0);
}

TEST(SimEngine, ImplicitTransferUsesTheSendCost) {
  const UniformCostModel costs(
      UniformCosts{.forward_s = 1.0, .backward_s = 2.0, .communication_s = 0.5});
  EXPECT_DOUBLE_EQ(simulate(gpipe_compute_only(3), costs).makespan_s, 4 * 3.0 + 1.0);
}

TEST(SimEngine, ReceiveWithoutSendIsRejected) {
  Schedule s = gpipe_lowered(2);
  s.streams[0].erase(s.streams[0].begin() + 1);  // drop the first send
  const UniformCostModel costs(UniformCosts{});
  EXPECT_THROW(simulate(s, costs), std::invalid_argument);
}

// Both workers receive before they send: nothing can ever start.
Schedule crossed_receives() {
  Schedule s = two_stage_skeleton(1);
  s.streams[0] = {make(OpKind::kForward, 0, 0), make(OpKind::kRecvGradient, 0, 0, 1, 1),
                  make(OpKind::kBackward, 0, 0), make(OpKind::kSendActivation, 0, 0, 1, 0)};
  s.streams[1] = {make(OpKind::kRecvActivation, 1, 0, 0, 0), make(OpKind::kForward, 1, 0),
                  make(OpKind::kBackward, 1, 0), make(OpKind::kSendGradient, 1, 0, 0, 1)};
  return s;
}

TEST(SimEngine, CrossedReceivesDeadlockWithAClearError) {
  const UniformCostModel costs(UniformCosts{});
  try {
    simulate(crossed_receives(), costs);
    FAIL() << "expected a deadlock";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("deadlock"), std::string::npos) << e.what();
  }
}

TEST(SimEngine, CollectiveIsARendezvous) {
  Schedule s = gpipe_compute_only(1);
  Instruction reduce0 = make(OpKind::kReduceGradPipelines, 0, -1, 1);
  Instruction reduce1 = make(OpKind::kReduceGradPipelines, 0, -1, 0);
  s.streams[0].push_back(reduce0);
  s.streams[1].push_back(reduce1);
  UniformCosts c{.forward_s = 1.0, .backward_s = 2.0};
  c.reduction_s = 0.25;
  const SimResult r = simulate(s, UniformCostModel(c));
  // Worker 1 finishes its backward at 4, worker 0 at 6: both reduce over [6, 6.25].
  EXPECT_DOUBLE_EQ(r.times[1][2].start_s, 6.0);
  EXPECT_DOUBLE_EQ(r.times[0][2].start_s, 6.0);
  EXPECT_DOUBLE_EQ(r.makespan_s, 6.25);
}

TEST(SimEngine, NegativeCostIsRejected) {
  UniformCosts c;
  c.forward_s = -1.0;
  EXPECT_THROW(UniformCostModel{c}, std::invalid_argument);
}

TEST(SimEngine, ParsesUniformFlag) {
  const UniformCosts c = parse_uniform_costs("1,2.5,0.1");
  EXPECT_DOUBLE_EQ(c.forward_s, 1.0);
  EXPECT_DOUBLE_EQ(c.backward_s, 2.5);
  EXPECT_DOUBLE_EQ(c.communication_s, 0.1);
  EXPECT_THROW(parse_uniform_costs("1"), std::invalid_argument);
  EXPECT_THROW(parse_uniform_costs("1,x"), std::invalid_argument);
  EXPECT_THROW(parse_uniform_costs("1,2,"), std::invalid_argument);
  EXPECT_THROW(parse_uniform_costs("1,-2"), std::invalid_argument);
}

// ---- shared processors ------------------------------------------------------------------------

SharedProcessors grouped(int workers_per_processor, double capacity) {
  SharedProcessors shared;
  shared.workers_per_processor = workers_per_processor;
  shared.capacity = capacity;
  return shared;
}

SharedProcessors mapped(std::vector<int> processor_of_worker) {
  SharedProcessors shared;
  shared.processor_of_worker = std::move(processor_of_worker);
  return shared;
}

TEST(ProcessorShare, JobsBesideEachOtherSplitTheCapacity) {
  ProcessorShare processor(1.0);
  processor.add(0, 1.0, 0.0);
  EXPECT_DOUBLE_EQ(processor.next_end(), 1.0);
  processor.add(1, 1.0, 0.5);  // job 0 has half its work left, now at half speed
  EXPECT_DOUBLE_EQ(processor.rate(), 0.5);
  EXPECT_DOUBLE_EQ(processor.next_end(), 1.5);
  std::vector<std::int64_t> done;
  processor.take_done(1.5, done);
  ASSERT_EQ(done, std::vector<std::int64_t>{0});
  // Job 1 did 0.5 beside job 0 and finishes the rest alone.
  EXPECT_DOUBLE_EQ(processor.next_end(), 2.0);
  processor.take_done(2.0, done);
  EXPECT_EQ(done, (std::vector<std::int64_t>{0, 1}));
  EXPECT_EQ(processor.running(), 0);
  EXPECT_EQ(processor.next_end(), std::numeric_limits<double>::infinity());
}

TEST(ProcessorShare, CapacityRunsThatManyJobsAtFullSpeed) {
  ProcessorShare processor(2.0);
  processor.add(0, 1.0, 0.0);
  processor.add(1, 1.0, 0.0);
  EXPECT_DOUBLE_EQ(processor.rate(), 1.0);
  processor.add(2, 1.0, 0.0);  // three on two: each at 2/3
  EXPECT_DOUBLE_EQ(processor.rate(), 2.0 / 3.0);
  std::vector<std::int64_t> done;
  processor.take_done(processor.next_end(), done);
  EXPECT_EQ(done.size(), 3U);  // equal jobs end together
  EXPECT_THROW(ProcessorShare{0.0}, std::invalid_argument);
}

TEST(SimEngine, SharedProcessorWithRoomForEveryWorkerChangesNothing) {
  const UniformCostModel costs(
      UniformCosts{.forward_s = 1.0, .backward_s = 2.0, .communication_s = 0.25});
  sched::ScheduleParams params;
  params.workers = 4;
  params.microbatches = 8;
  const Schedule schedule = sched::compile(params);
  const SimResult own = simulate(schedule, costs);
  SimOptions options;
  options.shared_processors = grouped(4, 4.0);
  const SimResult shared = simulate(schedule, costs, options);
  EXPECT_NEAR(shared.makespan_s, own.makespan_s, 1e-12 * own.makespan_s);
  for (int w = 0; w < 4; ++w) {
    EXPECT_NEAR(shared.workers[w].busy_s, own.workers[w].busy_s, 1e-9) << "worker " << w;
  }
}

TEST(SimEngine, WorkersOnOneProcessorShareItsThroughput) {
  const UniformCostModel costs(UniformCosts{.forward_s = 1.0, .backward_s = 2.0});
  SimOptions options;
  options.shared_processors = grouped(2, 1.0);
  const SimResult r = simulate(gpipe_compute_only(4), costs, options);
  // Capacity 1: the processor does the 24 s of work of both workers one at a time in effect,
  // and it is never idle (one worker always has work while the other waits).
  EXPECT_NEAR(r.makespan_s, 24.0, 1e-9);
  // Worker 0's first forward runs alone; its second beside worker 1's first, at half speed.
  EXPECT_DOUBLE_EQ(r.times[0][0].end_s, 1.0);
  EXPECT_NEAR(r.times[0][1].end_s, 3.0, 1e-12);
  EXPECT_NEAR(r.times[1][0].start_s, 1.0, 1e-12);
  EXPECT_NEAR(r.times[1][0].end_s, 3.0, 1e-12);
  // Busy time is the stretched time, as a run measures it.
  EXPECT_GT(r.workers[0].busy_s, 12.0);
  // Each worker a processor of its own (two processors): the closed form again.
  options.shared_processors = grouped(1, 1.0);
  EXPECT_NEAR(simulate(gpipe_compute_only(4), costs, options).makespan_s, 15.0, 1e-12);
}

TEST(SimEngine, SharedProcessorsAreChecked) {
  const UniformCostModel costs(UniformCosts{.forward_s = 1.0, .backward_s = 2.0});
  const auto message = [&](SharedProcessors shared) {
    SimOptions options;
    options.shared_processors = std::move(shared);
    try {
      simulate(gpipe_compute_only(2), costs, options);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(mapped({0})).find("1 workers mapped, the schedule has 2"), std::string::npos);
  EXPECT_NE(message(mapped({0, 2})).find("worker 1 on processor 2"), std::string::npos);
  EXPECT_NE(message(grouped(2, 0.0)).find("capacity"), std::string::npos);
  EXPECT_NE(message(grouped(-1, 1.0)).find("-1 workers per processor"), std::string::npos);
  // An explicit map: worker 0 and 1 on processors of their own, the closed form.
  EXPECT_EQ(message(mapped({1, 0})), "no error");
  auto uneven = mapped({0, 1});
  uneven.processor_capacity = {1.0};
  EXPECT_NE(message(uneven).find("1 per-processor capacities, processor 1 is in use"),
            std::string::npos);
  uneven.processor_capacity = {1.0, -1.0};
  EXPECT_NE(message(uneven).find("processor 1 capacity -1"), std::string::npos);
  uneven.processor_capacity = {1.0, 1.0, 3.0};  // an entry no worker uses is allowed
  EXPECT_EQ(message(uneven), "no error");
}

TEST(SimEngine, EachProcessorRunsAtItsOwnCapacity) {
  const UniformCostModel costs(UniformCosts{.forward_s = 1.0, .backward_s = 2.0});
  SimOptions options;
  // One processor for both workers: its own capacity (2) overrides the common one (1), so they
  // no longer slow each other: the closed form of a processor each.
  options.shared_processors = grouped(2, 1.0);
  options.shared_processors.processor_capacity = {2.0};
  EXPECT_NEAR(simulate(gpipe_compute_only(4), costs, options).makespan_s, 15.0, 1e-12);
  // Worker 0 on a processor of half a capacity, worker 1 on a whole one: worker 0's work takes
  // twice as long, worker 1's as priced.
  options.shared_processors = mapped({0, 1});
  options.shared_processors.processor_capacity = {0.5, 1.0};
  const SimResult r = simulate(gpipe_compute_only(4), costs, options);
  for (const auto& t : r.times[0]) EXPECT_GT(t.end_s - t.start_s, 1.999) << "worker 0";
  EXPECT_NEAR(r.times[0][0].end_s, 2.0, 1e-12);
  EXPECT_NEAR(r.times[1][0].end_s - r.times[1][0].start_s, 1.0, 1e-12);
}

TEST(SimEngine, SharedProcessorStillReportsADeadlock) {
  SimOptions options;
  options.shared_processors = grouped(2, 1.0);
  EXPECT_THROW(
      simulate(crossed_receives(), UniformCostModel(UniformCosts{.forward_s = 1.0}), options),
      std::invalid_argument);
}

}  // namespace
}  // namespace pf::sim
