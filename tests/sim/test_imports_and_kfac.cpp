// Imported schedules simulate like generated ones; K-FAC work waits for its data.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "scheduler/compile.h"
#include "scheduler/torch_csv.h"
#include "sim/simulator.h"
#include "sim/uniform_cost_model.h"

namespace pf::sim {
namespace {

using sched::Instruction;
using sched::OpKind;
using sched::ScheduleKind;
using sched::ScheduleParams;

ScheduleParams params(ScheduleKind kind, int p, int m, int v = 1) {
  ScheduleParams out;
  out.kind = kind;
  out.workers = p;
  out.microbatches = m;
  out.chunks_per_worker = v;
  return out;
}

TEST(SimImport, TorchCsvSimulatesLikeTheGeneratedSchedule) {
  UniformCosts c{.forward_s = 1.0, .backward_s = 2.0, .communication_s = 0.1};
  c.reduction_s = 0.3;
  const UniformCostModel costs(c);
  for (const ScheduleParams& ps :
       {params(ScheduleKind::kGPipe, 4, 8), params(ScheduleKind::kOneFOneB, 4, 8),
        params(ScheduleKind::kInterleaved, 4, 8, 2), params(ScheduleKind::kChimera, 4, 8)}) {
    const auto generated = sched::compile(ps);
    const SimResult expected = simulate(generated, costs);
    for (bool with_communication : {true, false}) {
      sched::TorchCsvImportOptions options;
      options.kind = ps.kind;
      const auto imported = sched::schedule_from_torch_csv(
          sched::to_torch_csv(generated, with_communication), "generated.csv", options);
      const SimResult got = simulate(imported, costs);
      EXPECT_EQ(got.makespan_s, expected.makespan_s)
          << sched::to_string(ps.kind) << (with_communication ? " with" : " without")
          << " communication";
      EXPECT_EQ(got.bubble_fraction, expected.bubble_fraction) << sched::to_string(ps.kind);
    }
  }
}

Instruction kfac(OpKind kind, int chunk, int microbatch, int layer) {
  Instruction in;
  in.kind = kind;
  in.chunk = chunk;
  in.microbatch = microbatch;
  in.layer = layer;
  in.linear = sched::LinearKind::kQuery;
  return in;
}

// (vector::insert trips g++ 12's -Wnull-dereference false positive; push_back + rotate does not.)
void insert_at(std::vector<Instruction>& stream, std::size_t position, const Instruction& in) {
  stream.push_back(in);
  std::rotate(stream.begin() + static_cast<std::ptrdiff_t>(position), stream.end() - 1,
              stream.end());
}

std::size_t position_of(const std::vector<Instruction>& stream, OpKind kind, int microbatch) {
  for (std::size_t i = 0; i < stream.size(); ++i) {
    if (stream[i].kind == kind && stream[i].microbatch == microbatch) return i;
  }
  return stream.size();
}

TEST(SimKfac, CurvatureWaitsForItsDataAndAddsMemory) {
  auto schedule = sched::compile(params(ScheduleKind::kOneFOneB, 2, 2));
  // Worker 0 (chunk 0, layer 0): curvature A of micro-batch 1 placed right after the first
  // instruction (before forward 1 finishes on the compute lane it is issued after it anyway),
  // curvature B of micro-batch 0 after its backward, then the inversions at the end.
  auto& stream = schedule.streams[0];
  const std::size_t forward1 = position_of(stream, OpKind::kForward, 1);
  insert_at(stream, forward1 + 1, kfac(OpKind::kCurvatureA, 0, 1, 0));
  const std::size_t backward0 = position_of(stream, OpKind::kBackward, 0);
  insert_at(stream, backward0 + 1, kfac(OpKind::kCurvatureB, 0, 0, 0));
  stream.push_back(kfac(OpKind::kInvertA, 0, -1, 0));
  stream.push_back(kfac(OpKind::kInvertB, 0, -1, 0));
  UniformCosts c{.forward_s = 1.0, .backward_s = 2.0};
  c.curvature_a_s = 0.25;
  c.curvature_b_s = 0.5;
  c.invert_a_s = 1.0;
  c.invert_b_s = 1.0;
  c.kfac_bytes = 100.0;
  const UniformCostModel costs(c);
  const SimResult r = simulate(schedule, costs);
  const auto& t = r.times[0];
  const std::size_t a = position_of(stream, OpKind::kCurvatureA, 1);
  const std::size_t b = position_of(stream, OpKind::kCurvatureB, 0);
  EXPECT_GE(t[a].start_s, t[forward1].end_s);
  EXPECT_DOUBLE_EQ(t[a].end_s - t[a].start_s, 0.25);
  EXPECT_GE(t[b].start_s, t[position_of(stream, OpKind::kBackward, 0)].end_s);
  // Factors and inverses, both factor sums (a quarter of those each) from curvature B's start
  // to the first inversion, 1 micro-batch stashed then (2 at curvature A: 100 + 25 + 2).
  EXPECT_DOUBLE_EQ(r.workers[0].peak_memory_bytes, 100.0 + 2 * 25.0 + 1.0);
  // Without K-FAC work the worker is shorter by at least the K-FAC time that cannot hide.
  const SimResult base = simulate(sched::compile(params(ScheduleKind::kOneFOneB, 2, 2)), costs);
  EXPECT_GT(r.makespan_s, base.makespan_s);
}

TEST(SimKfac, CurvatureBeforeItsBackwardIsRejected) {
  auto schedule = sched::compile(params(ScheduleKind::kOneFOneB, 2, 2));
  auto& stream = schedule.streams[0];
  insert_at(stream, 0, kfac(OpKind::kCurvatureB, 0, 0, 0));
  try {
    simulate(schedule, UniformCostModel(UniformCosts{}));
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("later in the same stream"), std::string::npos)
        << e.what();
  }
}

TEST(SimKfac, CurvatureSyncIsARendezvousBetweenChimeraReplicas) {
  auto schedule = sched::compile(params(ScheduleKind::kChimera, 2, 2));
  // Each worker holds chunk 0 of one pipeline and chunk 1 of the other; layer 0 is chunk 0.
  const int down = schedule.placement.worker_of(0, 0), up = schedule.placement.worker_of(1, 0);
  Instruction sync = kfac(OpKind::kCurvatureSync, 0, -1, 0);
  sync.peer = up;
  sync.pipeline = 0;
  schedule.streams[down].push_back(sync);
  sync.peer = down;
  sync.pipeline = 1;
  schedule.streams[up].push_back(sync);
  UniformCosts c{.forward_s = 1.0, .backward_s = 1.0};
  c.curvature_sync_s = 0.5;
  const SimResult r = simulate(schedule, UniformCostModel(c));
  const auto start_down = r.times[down].back().start_s;
  const auto start_up = r.times[up].back().start_s;
  EXPECT_EQ(start_down, start_up);
  // The rendezvous waits for the later of the two workers to get there.
  const auto& d = r.times[down];
  const auto& u = r.times[up];
  EXPECT_EQ(start_down, std::max(d[d.size() - 2].start_s, u[u.size() - 2].start_s));
  EXPECT_EQ(r.times[up].back().end_s, start_up + 0.5);
}

}  // namespace
}  // namespace pf::sim
