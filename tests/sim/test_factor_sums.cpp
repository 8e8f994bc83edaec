// The simulator counts each Linear's factor sums (kfac::FactorState::sum) while a refresh
// accumulates them: from the first curvature of the factor to the Linear's first inversion, to
// the curvature sync's end on a replica without the factors, to the write-back of an offloaded
// Linear, and a pipelined refresh's set-aside sums from the window's start (docs/simulator.md).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "scheduler/compile.h"
#include "sim/simulator.h"
#include "sim/uniform_cost_model.h"

namespace pf::sim {
namespace {

using sched::Instruction;
using sched::OpKind;

constexpr double kState = 100.0;  // factors and inverses of the Linear
constexpr double kSumA = 10.0;
constexpr double kSumB = 20.0;

// Uniform times; the Linear's state kState, its sums kSumA and kSumB; no activation memory, so
// that the memory track is the K-FAC state alone.
class SumCosts final : public CostModel {
 public:
  SumCosts() : uniform_(make_costs()) {}
  double duration(const sched::Schedule& s, int w, const Instruction& in) const override {
    return uniform_.duration(s, w, in);
  }
  double activation_bytes(const sched::Schedule&, int, int) const override { return 0.0; }
  double static_bytes(const sched::Schedule&, int, int) const override { return 0.0; }
  double kfac_bytes(const sched::Schedule&, int, sched::LinearKind) const override {
    return kState;
  }
  double kfac_sum_bytes(const sched::Schedule&, int, sched::LinearKind,
                        bool a_factor) const override {
    return a_factor ? kSumA : kSumB;
  }

 private:
  static UniformCosts make_costs() {
    UniformCosts c{.forward_s = 1.0, .backward_s = 2.0};
    c.curvature_a_s = c.curvature_b_s = 0.25;
    c.curvature_sync_s = 0.5;
    c.invert_a_s = c.invert_b_s = 1.0;
    c.host_bandwidth = 100.0;  // a 50-byte copy: 0.5 s
    return c;
  }
  UniformCostModel uniform_;
};

Instruction kfac(OpKind kind, int microbatch, int step = 0) {
  Instruction in;
  in.kind = kind;
  in.chunk = 0;
  in.microbatch = microbatch;
  in.step = static_cast<std::int16_t>(step);
  in.layer = 0;
  in.linear = sched::LinearKind::kQuery;
  return in;
}

// (vector::insert trips g++ 12's -Wnull-dereference false positive; push_back + rotate does not.)
void insert_at(std::vector<Instruction>& stream, std::size_t position, const Instruction& in) {
  stream.push_back(in);
  std::rotate(stream.begin() + static_cast<std::ptrdiff_t>(position), stream.end() - 1,
              stream.end());
}

std::size_t find(const std::vector<Instruction>& stream, OpKind kind, int microbatch,
                 std::size_t from = 0) {
  for (std::size_t i = from; i < stream.size(); ++i) {
    if (stream[i].kind == kind && stream[i].microbatch == microbatch) return i;
  }
  ADD_FAILURE() << "no " << sched::to_string(kind) << " of micro-batch " << microbatch;
  return 0;
}

// 1F1B, 2 workers, 2 micro-batches; worker 0 (layer 0) gets each micro-batch's curvature A after
// its forward and B after its backward.
sched::Schedule with_curvature() {
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = 2;
  params.microbatches = 2;
  auto schedule = sched::compile(params);
  auto& stream = schedule.streams[0];
  for (int mb = 0; mb < 2; ++mb) {
    insert_at(stream, find(stream, OpKind::kForward, mb) + 1, kfac(OpKind::kCurvatureA, mb));
    insert_at(stream, find(stream, OpKind::kBackward, mb) + 1, kfac(OpKind::kCurvatureB, mb));
  }
  return schedule;
}

// The worker's memory just after everything at `time` (the track's last sample at or before).
double bytes_at(const WorkerReport& report, double time) {
  double bytes = 0.0;
  for (const auto& sample : report.memory) {
    if (sample.time_s <= time) bytes = sample.bytes;
  }
  return bytes;
}

TEST(SimFactorSums, LiveFromTheFirstCurvatureToTheFirstInversion) {
  auto schedule = with_curvature();
  auto& stream = schedule.streams[0];
  stream.push_back(kfac(OpKind::kInvertA, -1));
  stream.push_back(kfac(OpKind::kInvertB, -1));
  const SimResult r = simulate(schedule, SumCosts());
  const auto& t = r.times[0];
  const auto& memory = r.workers[0];
  const auto a0 = find(stream, OpKind::kCurvatureA, 0), a1 = find(stream, OpKind::kCurvatureA, 1);
  const auto b0 = find(stream, OpKind::kCurvatureB, 0);
  const auto invert_a = find(stream, OpKind::kInvertA, -1);
  const auto invert_b = find(stream, OpKind::kInvertB, -1);
  EXPECT_EQ(bytes_at(memory, t[a0].start_s), kState + kSumA);
  EXPECT_EQ(bytes_at(memory, t[a1].start_s), kState + kSumA);  // one A sum for the refresh
  EXPECT_EQ(bytes_at(memory, t[b0].start_s), kState + kSumA + kSumB);
  EXPECT_EQ(bytes_at(memory, t[invert_a].start_s), kState + kSumA + kSumB);
  // The first inversion finalizes both factors (the damping needs both): both sums leave.
  EXPECT_EQ(bytes_at(memory, t[invert_a].end_s), kState);
  EXPECT_EQ(bytes_at(memory, t[invert_b].end_s), kState);
  EXPECT_EQ(memory.peak_memory_bytes, kState + kSumA + kSumB);
  EXPECT_EQ(memory.memory.back().bytes, kState);
  // Without the inversions the sums stay to the end.
  const SimResult open = simulate(with_curvature(), SumCosts());
  EXPECT_EQ(open.workers[0].memory.back().bytes, kState + kSumA + kSumB);
}

TEST(SimFactorSums, EveryRefreshAllocatesAgain) {
  auto schedule = with_curvature();
  auto& stream = schedule.streams[0];
  stream.push_back(kfac(OpKind::kInvertA, -1));
  stream.push_back(kfac(OpKind::kInvertB, -1));
  stream.push_back(kfac(OpKind::kCurvatureA, 0));  // the next refresh's first curvature
  stream.push_back(kfac(OpKind::kInvertA, -1));
  const SimResult r = simulate(schedule, SumCosts());
  const auto& t = r.times[0];
  const auto invert_b = find(stream, OpKind::kInvertB, -1);
  const auto again = find(stream, OpKind::kCurvatureA, 0, invert_b);
  const auto second = find(stream, OpKind::kInvertA, -1, again);
  EXPECT_EQ(bytes_at(r.workers[0], t[invert_b].start_s), kState);
  EXPECT_EQ(bytes_at(r.workers[0], t[again].start_s), kState + kSumA);
  EXPECT_EQ(bytes_at(r.workers[0], t[second].end_s), kState);
  EXPECT_EQ(r.workers[0].peak_memory_bytes, kState + kSumA + kSumB);
}

TEST(SimFactorSums, DroppedAtTheSyncWithoutTheFactors) {
  auto schedule = with_curvature();
  auto& stream = schedule.streams[0];
  stream.push_back(kfac(OpKind::kCurvatureSync, -1));
  SimOptions options;
  options.kfac_holds_factors = [](int, int, sched::LinearKind) { return false; };
  const SimResult r = simulate(schedule, SumCosts(), options);
  const auto sync = find(stream, OpKind::kCurvatureSync, -1);
  EXPECT_EQ(bytes_at(r.workers[0], r.times[0][sync].start_s), kState + kSumA + kSumB);
  EXPECT_EQ(bytes_at(r.workers[0], r.times[0][sync].end_s), kState);
  // A holder keeps them past the sync.
  const SimResult held = simulate(schedule, SumCosts());
  EXPECT_EQ(held.workers[0].memory.back().bytes, kState + kSumA + kSumB);
  // Sized by the options where they say so.
  options.kfac_sum_bytes = [](int, sched::LinearKind, bool a_factor) {
    return a_factor ? 1.0 : 2.0;
  };
  EXPECT_EQ(simulate(schedule, SumCosts(), options).workers[0].peak_memory_bytes, kState + 3.0);
}

// A pipelined refresh: the previous refresh's sums, set aside at the window's start, until its
// wrapped inversion; the window's own from its first curvature, to the window's end (their
// inversion runs in the next window). Where the two overlap the worker holds both, once each.
TEST(SimFactorSums, PipelinedSetAsideSumsUntilTheWrappedInversion) {
  auto schedule = with_curvature();
  schedule.kfac_pipelined_refresh = true;
  auto& stream = schedule.streams[0];
  const auto a0 = find(stream, OpKind::kCurvatureA, 0);
  insert_at(stream, a0 + 1, kfac(OpKind::kInvertA, -1, -1));
  const SimResult r = simulate(schedule, SumCosts());
  const auto& t = r.times[0];
  const auto wrapped = find(stream, OpKind::kInvertA, -1);
  const auto b0 = find(stream, OpKind::kCurvatureB, 0);
  EXPECT_EQ(bytes_at(r.workers[0], 0.0), kSumA + kSumB);  // set aside (the state comes later)
  EXPECT_EQ(bytes_at(r.workers[0], t[a0].start_s), kState + 2 * kSumA + kSumB);
  EXPECT_EQ(bytes_at(r.workers[0], t[wrapped].end_s), kState + kSumA);
  EXPECT_EQ(bytes_at(r.workers[0], t[b0].start_s), kState + kSumA + kSumB);
  EXPECT_EQ(r.workers[0].peak_memory_bytes, kState + 2 * kSumA + kSumB);
  EXPECT_EQ(r.workers[0].memory.back().bytes, kState + kSumA + kSumB);
  // Not pipelined, the same stream has no set-aside sums.
  schedule.kfac_pipelined_refresh = false;
  for (auto& in : stream) {
    if (sched::is_wrapped(in)) in.step = 0;
  }
  const SimResult plain = simulate(schedule, SumCosts());
  EXPECT_EQ(bytes_at(plain.workers[0], 0.0), 0.0);
}

// An offloaded Linear: its sums on the device from the first curvature to the write-back after
// their inversion (the CUDA layer keeps the finalized sums' buffer until then), counted once
// beside the factor window's bytes.
TEST(SimFactorSums, OffloadedLinearsSumsUntilTheWriteBack) {
  auto schedule = with_curvature();
  auto& stream = schedule.streams[0];
  Instruction prefetch = kfac(OpKind::kPrefetchFactors, -1);
  prefetch.bytes = 50;
  Instruction write_back = kfac(OpKind::kWriteBackState, -1);
  write_back.bytes = 50;
  stream.push_back(prefetch);
  stream.push_back(kfac(OpKind::kInvertA, -1));
  stream.push_back(kfac(OpKind::kInvertB, -1));
  stream.push_back(write_back);
  const SimResult r = simulate(schedule, SumCosts());
  const auto& t = r.times[0];
  const auto invert_b = find(stream, OpKind::kInvertB, -1);
  const auto back = find(stream, OpKind::kWriteBackState, -1);
  EXPECT_EQ(bytes_at(r.workers[0], t[find(stream, OpKind::kCurvatureB, 0)].start_s), kSumA + kSumB);
  EXPECT_EQ(bytes_at(r.workers[0], t[invert_b].end_s), 50.0 + kSumA + kSumB);
  EXPECT_EQ(r.workers[0].peak_memory_bytes, 50.0 + kSumA + kSumB);
  EXPECT_EQ(bytes_at(r.workers[0], t[back].end_s), 0.0);
  EXPECT_EQ(r.workers[0].memory.back().bytes, 0.0);
}

}  // namespace
}  // namespace pf::sim
