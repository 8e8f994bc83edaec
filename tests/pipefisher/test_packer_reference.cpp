// The packer with its best-fit room index against the reference (the linear scan it replaced,
// tests/pipefisher/reference_packer.cpp): the same placement, item for item and piece for piece,
// bit for bit, on random bubbles and on the bubbles and K-FAC work of compiled schedules.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>

#include "scheduler/compile.h"
#include "scheduler/pipefisher/kfac_work.h"
#include "scheduler/pipefisher/packer.h"
#include "scheduler/pipefisher/timeline.h"
#include "sim/uniform_cost_model.h"
#include "tests/pipefisher/reference_packer.h"

namespace pf::pipefisher {
namespace {

void expect_same(const PackResult& got, const PackResult& want, const std::string& where) {
  ASSERT_EQ(got.placements.size(), want.placements.size()) << where;
  EXPECT_EQ(got.spilled_items, want.spilled_items) << where;
  EXPECT_EQ(got.spilled_bound_items, want.spilled_bound_items) << where;
  EXPECT_EQ(got.reserved_s, want.reserved_s) << where;
  EXPECT_EQ(got.divided_items, want.divided_items) << where;
  EXPECT_EQ(got.pieces, want.pieces) << where;
  for (std::size_t i = 0; i < got.placements.size(); ++i) {
    const ItemPlacement& a = got.placements[i];
    const ItemPlacement& b = want.placements[i];
    const std::string at = where + ", item " + std::to_string(i);
    ASSERT_EQ(a.spilled, b.spilled) << at;
    ASSERT_EQ(a.step, b.step) << at;
    ASSERT_EQ(a.start, b.start) << at;
    ASSERT_EQ(a.end, b.end) << at;
    ASSERT_EQ(a.bubbles, b.bubbles) << at;
    ASSERT_EQ(a.spilled_s, b.spilled_s) << at;
    ASSERT_EQ(a.pieces.size(), b.pieces.size()) << at;
    for (std::size_t p = 0; p < a.pieces.size(); ++p) {
      ASSERT_EQ(a.pieces[p].bubble, b.pieces[p].bubble) << at << ", piece " << p;
      ASSERT_EQ(a.pieces[p].step, b.pieces[p].step) << at << ", piece " << p;
      ASSERT_EQ(a.pieces[p].start, b.pieces[p].start) << at << ", piece " << p;
      ASSERT_EQ(a.pieces[p].end, b.pieces[p].end) << at << ", piece " << p;
      ASSERT_EQ(a.pieces[p].unit_begin, b.pieces[p].unit_begin) << at << ", piece " << p;
      ASSERT_EQ(a.pieces[p].unit_end, b.pieces[p].unit_end) << at << ", piece " << p;
      ASSERT_EQ(a.pieces[p].other_bubble, b.pieces[p].other_bubble) << at << ", piece " << p;
    }
  }
}

void compare_policies(const PackProblem& problem, const std::vector<PackItem>& items, double margin,
                      const std::string& where) {
  for (PackingPolicy policy : {PackingPolicy::kFirstFit, PackingPolicy::kBestFit}) {
    expect_same(pack(problem, items, policy, margin),
                reference::pack(problem, items, policy, margin),
                where + " (" + std::string(to_string(policy)) + ")");
  }
}

// Random bubbles with many equal and nearly equal lengths (ties are where an index could pick
// another bubble than the scan), items of every kind: divisible, collective, step-bound,
// zero-length, spilling early, with predecessors; collectives divisible too (cut into the
// windows their workers have free at once).
TEST(PackerReference, RandomProblemsPlaceExactlyAsTheLinearScan) {
  std::mt19937 rng(20261123);
  int divided_collectives = 0;
  for (int round = 0; round < 60; ++round) {
    const int workers = 1 + static_cast<int>(rng() % 4);
    const int steps = 1 + static_cast<int>(rng() % 3);
    PackProblem problem;
    problem.num_steps = steps;
    const double lengths[] = {0.0, 0.5, 1.0, 1.0, 1.0 + 1e-13, 2.0, 3.5, 1e-3};
    for (int w = 0; w < workers; ++w) {
      std::vector<Bubble> bubbles;
      std::vector<double> flush;
      double t = 0.0;
      for (int s = 0; s < steps; ++s) {
        const int count = 1 + static_cast<int>(rng() % 12);
        for (int b = 0; b < count; ++b) {
          t += lengths[rng() % 8] * 0.5;  // busy time before the bubble
          Bubble bubble;
          bubble.step = s;
          bubble.start = t;
          bubble.end = t + lengths[rng() % 8];
          bubble.slot = b;
          bubble.accepts_bound = rng() % 5 != 0;
          bubble.bound_not_before = rng() % 4 == 0 ? bubble.start + 0.25 : 0.0;
          bubble.accepts_collective = rng() % 4 != 0;
          bubbles.push_back(bubble);
          t = bubble.end;
        }
        t += 1.0;
        flush.push_back(t);
      }
      problem.bubbles.push_back(std::move(bubbles));
      problem.flush_start.push_back(std::move(flush));
    }
    std::vector<PackItem> items;
    const int count = 5 + static_cast<int>(rng() % 60);
    const double durations[] = {0.0, 0.25, 0.5, 1.0, 1.0, 2.0, 4.0, 1e-3};
    for (int i = 0; i < count; ++i) {
      PackItem item;
      item.workers = {static_cast<int>(rng() % static_cast<unsigned>(workers))};
      if (workers > 1 && rng() % 6 == 0) {
        const int other = (item.workers[0] + 1) % workers;
        item.workers.push_back(other);
      }
      item.duration = durations[rng() % 8];
      item.release = static_cast<double>(rng() % 40) * 0.25;
      if (i > 0 && rng() % 3 == 0) item.preds.push_back(static_cast<int>(rng() % i));
      if (item.workers.size() == 1 && rng() % 5 == 0) {
        item.step_bound = static_cast<int>(rng() % static_cast<unsigned>(steps));
      }
      if (item.step_bound < 0 && item.duration > 0.1 && rng() % 2 == 0) {
        item.divisible = true;
        item.overhead = 0.01;
        item.min_piece = rng() % 2 == 0 ? 0.02 : item.duration / 256.0;
      }
      item.spill_early = item.step_bound < 0 && !item.divisible && rng() % 10 == 0;
      items.push_back(std::move(item));
    }
    compare_policies(problem, items, (round % 3) * 0.05, "round " + std::to_string(round));
    const auto packed = pack(problem, items, PackingPolicy::kFirstFit, 0.0);
    for (std::size_t i = 0; i < items.size(); ++i) {
      if (items[i].workers.size() > 1 && !packed.placements[i].pieces.empty()) {
        ++divided_collectives;
      }
    }
  }
  EXPECT_GT(divided_collectives, 0);  // the case is exercised
}

sched::Schedule compiled(sched::ScheduleKind kind, int workers, int microbatches, int chunks) {
  sched::ScheduleParams params;
  params.kind = kind;
  params.workers = workers;
  params.microbatches = microbatches;
  params.chunks_per_worker = chunks;
  return sched::compile(params);
}

// The pass's own problems: the bubbles of k steps of a compiled schedule and its K-FAC work in
// the work model's order, at K-FAC costs small (most fits whole) to large (most is cut).
TEST(PackerReference, CompiledSchedulesPlaceExactlyAsTheLinearScan) {
  using sched::ScheduleKind;
  struct Case {
    ScheduleKind kind;
    int workers, microbatches, chunks;
  };
  const Case cases[] = {{ScheduleKind::kGPipe, 4, 8, 1},
                        {ScheduleKind::kOneFOneB, 4, 16, 1},
                        {ScheduleKind::kInterleaved, 4, 8, 2},
                        {ScheduleKind::kChimera, 4, 4, 1},
                        {ScheduleKind::kZeroBubbleH1, 4, 8, 1}};
  for (const Case& c : cases) {
    const sched::Schedule base = compiled(c.kind, c.workers, c.microbatches, c.chunks);
    for (double scale : {0.2, 1.0, 5.0, 30.0}) {
      sim::UniformCosts uniform;
      uniform.forward_s = 1.0;
      uniform.backward_s = 2.0;
      uniform.communication_s = 0.05;
      uniform.reduction_s = 0.1;
      uniform.optimizer_step_s = 0.05;
      uniform.curvature_a_s = 0.01 * scale;
      uniform.curvature_b_s = 0.012 * scale;
      uniform.curvature_sync_s = 0.02 * scale;
      uniform.invert_a_s = 0.05 * scale;
      uniform.invert_b_s = 0.07 * scale;
      uniform.precondition_s = 0.02 * scale;
      uniform.kfac_task_overhead_s = 0.001;
      const sim::UniformCostModel costs(uniform);
      const Timeline timeline = measure_timeline(base, costs, {});
      const DurationFn duration = [&](int w, const sched::Instruction& in) {
        return costs.duration(base, w, in);
      };
      for (int k : {1, 2, 3}) {
        const BubbleMap map = find_bubbles(base, timeline, k);
        const KfacWork work = build_kfac_work(base, KfacOptions{}, k, duration);
        std::vector<PackItem> items;
        for (const KfacTask& task : work.tasks) {
          PackItem item;
          item.workers = task.workers;
          item.duration = task.duration_s;
          for (const auto& ref : task.base_deps) {
            item.release = std::max(item.release, timeline.at(ref).end_s);
          }
          item.preds = task.task_deps;
          item.step_bound = task.step_bound;
          if (sched::is_divisible(task.kind()) && task.duration_s > uniform.kfac_task_overhead_s) {
            item.divisible = true;
            item.overhead = uniform.kfac_task_overhead_s;
            item.min_piece = std::max(2.0 * uniform.kfac_task_overhead_s, task.duration_s / 256.0);
          }
          items.push_back(std::move(item));
        }
        compare_policies(map.problem, items, 0.05,
                         std::string(sched::to_string(c.kind)) + ", scale " +
                             std::to_string(scale) + ", k = " + std::to_string(k));
      }
    }
  }
}

}  // namespace
}  // namespace pf::pipefisher
