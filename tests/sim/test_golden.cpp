// Golden results: the simulator against the closed-form makespans and bubbles of REFERENCE.md,
// over a grid of stages p, micro-batches m and chunks v, on compiled (lowered) schedules.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "scheduler/compile.h"
#include "scheduler/generators.h"
#include "scheduler/lowering.h"
#include "sim/simulator.h"
#include "sim/uniform_cost_model.h"

namespace pf::sim {
namespace {

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

SimResult run(const ScheduleParams& ps, UniformCosts costs, SimOptions options = {}) {
  return simulate(sched::compile(ps), UniformCostModel(costs), options);
}

TEST(SimGolden, GPipeAndOneFOneBMakespan) {
  // t_f = 1, t_b = 2: makespan (m + p - 1)(t_f + t_b), exactly.
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB}) {
    for (int p : {1, 2, 3, 4, 8}) {
      for (int m : {1, 2, 3, 4, 8, 13, 16}) {
        if (kind == ScheduleKind::kOneFOneB && m < p) continue;
        const SimResult r = run(params(kind, p, m), {.forward_s = 1.0, .backward_s = 2.0});
        EXPECT_EQ(r.makespan_s, (m + p - 1) * 3.0)
            << sched::to_string(kind) << " p=" << p << " m=" << m;
        EXPECT_DOUBLE_EQ(r.bubble_fraction, (p - 1.0) / (m + p - 1.0));
      }
    }
  }
}

TEST(SimGolden, InterleavedMakespan) {
  // A worker's forward over all its chunks takes t_f = v (each chunk 1) and t_b = 2v, so the
  // closed form (m + (p - 1)/v)(t_f + t_b) = 3 (m v + p - 1) is an exact integer.
  for (int p : {2, 3, 4}) {
    for (int v : {2, 3, 4}) {
      for (int groups : {1, 2, 3}) {
        const int m = groups * p;
        const SimResult r = run(params(ScheduleKind::kInterleaved, p, m, v),
                                {.forward_s = 1.0 * v, .backward_s = 2.0 * v});
        EXPECT_EQ(r.makespan_s, 3.0 * (m * v + p - 1)) << "p=" << p << " v=" << v << " m=" << m;
      }
    }
  }
}

TEST(SimGolden, ChimeraBubble) {
  // Convention: each worker holds one stage of each pipeline (v = 1), a slot is one stage's
  // forward or backward and forward = backward = 1 slot. With N = D the bubble ratio is
  // (D - 2) / (2N + D - 2) and the makespan 2N + D - 2 slots.
  for (int d : {2, 4, 6, 8}) {
    const SimResult r =
        run(params(ScheduleKind::kChimera, d, d), {.forward_s = 1.0, .backward_s = 1.0});
    EXPECT_EQ(r.makespan_s, 2.0 * d + d - 2.0) << "D=" << d;
    EXPECT_DOUBLE_EQ(r.bubble_fraction, (d - 2.0) / (2.0 * d + d - 2.0)) << "D=" << d;
  }
}

TEST(SimGolden, StashedActivations) {
  for (int p : {2, 4, 8}) {
    for (int m : {8, 16}) {
      const SimResult gpipe = run(params(ScheduleKind::kGPipe, p, m), {});
      const SimResult ofob = run(params(ScheduleKind::kOneFOneB, p, m), {});
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(gpipe.workers[r].peak_stashed_microbatches, m) << "p=" << p << " r=" << r;
        EXPECT_EQ(ofob.workers[r].peak_stashed_microbatches, p - r) << "p=" << p << " r=" << r;
        // Uniform memory: one byte per stashed micro-batch.
        EXPECT_DOUBLE_EQ(ofob.workers[r].peak_memory_bytes, p - r);
      }
    }
  }
}

std::vector<ScheduleParams> all_kinds(bool split) {
  std::vector<ScheduleParams> out = {
      params(ScheduleKind::kGPipe, 4, 8), params(ScheduleKind::kOneFOneB, 4, 8),
      params(ScheduleKind::kInterleaved, 4, 8, 2), params(ScheduleKind::kChimera, 4, 8)};
  for (auto& p : out) p.split_backward = split;
  return out;
}

TEST(SimGolden, CommunicationNeverShortensAndOverlapNeverLengthens) {
  for (bool split : {false, true}) {
    for (const ScheduleParams& ps : all_kinds(split)) {
      double previous = 0.0;
      for (double comm : {0.0, 0.05, 0.3, 1.0, 2.5}) {
        UniformCosts c{.forward_s = 1.0, .backward_s = 2.0, .communication_s = comm};
        c.reduction_s = comm;
        const double overlapped = run(ps, c).makespan_s;
        const double serial = run(ps, c, {.overlap_communication = false}).makespan_s;
        EXPECT_GE(overlapped, previous) << sched::to_string(ps.kind) << " comm=" << comm;
        EXPECT_GE(serial, overlapped) << sched::to_string(ps.kind) << " comm=" << comm;
        previous = overlapped;
      }
    }
  }
}

TEST(SimGolden, Deterministic) {
  for (const ScheduleParams& ps : all_kinds(false)) {
    const UniformCosts c{.forward_s = 0.3, .backward_s = 0.7, .communication_s = 0.11};
    const SimResult a = run(ps, c);
    const SimResult b = run(ps, c);
    ASSERT_EQ(a.times.size(), b.times.size());
    for (std::size_t w = 0; w < a.times.size(); ++w) {
      ASSERT_EQ(a.times[w].size(), b.times[w].size());
      EXPECT_EQ(
          0, std::memcmp(a.times[w].data(), b.times[w].data(), a.times[w].size() * sizeof(Timing)));
    }
  }
}

TEST(SimGolden, ComputeOnlyAndLoweredAgreeWithoutCommunicationCost) {
  for (const ScheduleParams& ps : all_kinds(false)) {
    const UniformCosts c{.forward_s = 1.0, .backward_s = 2.0};
    UniformCostModel model(c);
    EXPECT_EQ(simulate(sched::generate(ps), model).makespan_s,
              simulate(sched::compile(ps), model).makespan_s)
        << sched::to_string(ps.kind);
  }
}

}  // namespace
}  // namespace pf::sim

namespace pf::sim {
namespace {

// Two training steps in one schedule (as the PipeFisher pass emits for a k-step refresh): the
// figures are per step and the second step cannot start its compute before the first one's.
TEST(SimGolden, MultiStepSchedulesReportPerStep) {
  sched::Schedule one = sched::generate(params(ScheduleKind::kOneFOneB, 4, 8));
  sched::Schedule two = one;
  two.num_steps = 2;
  for (auto& stream : two.streams) {
    const std::size_t size = stream.size();
    for (std::size_t i = 0; i < size; ++i) {
      sched::Instruction next = stream[i];
      next.step = 1;
      stream.push_back(next);
    }
  }
  const UniformCostModel costs(UniformCosts{.forward_s = 1.0, .backward_s = 2.0});
  const SimResult single = simulate(sched::lower(one), costs);
  const SimResult both = simulate(sched::lower(two), costs);
  EXPECT_EQ(both.num_steps, 2);
  EXPECT_DOUBLE_EQ(both.step_time_s, both.makespan_s / 2);
  EXPECT_LE(both.makespan_s, 2 * single.makespan_s);
  EXPECT_GT(both.makespan_s, single.makespan_s + 8 * 3.0 - 1e-9);  // worker 0's second step
  for (std::size_t w = 0; w < 4; ++w) {
    EXPECT_DOUBLE_EQ(both.workers[w].busy_s, single.workers[w].busy_s);
    EXPECT_EQ(both.workers[w].peak_stashed_microbatches,
              single.workers[w].peak_stashed_microbatches);
  }
}

}  // namespace
}  // namespace pf::sim
