// The packer on synthetic bubbles: fit rules, the safety margin, dependencies, spilling, and
// the best-fit improvement over first-fit.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <stdexcept>

#include "scheduler/pipefisher/packer.h"

namespace pf::pipefisher {
namespace {

PackProblem one_worker(std::vector<Bubble> bubbles, int steps = 1, double flush = 100.0) {
  PackProblem problem;
  problem.num_steps = steps;
  problem.bubbles = {std::move(bubbles)};
  problem.flush_start = {std::vector<double>(static_cast<std::size_t>(steps), flush)};
  return problem;
}

PackItem item(double duration, double release = 0.0, std::vector<int> preds = {},
              int step_bound = -1) {
  PackItem it;
  it.workers = {0};
  it.duration = duration;
  it.release = release;
  it.preds = std::move(preds);
  it.step_bound = step_bound;
  return it;
}

TEST(Packer, SafetyMarginDecidesTheFit) {
  const auto problem = one_worker({{0, 0.0, 1.04, 0}, {0, 2.0, 3.05, 1}});
  const auto result = pack(problem, {item(1.0)}, PackingPolicy::kFirstFit, 0.05);
  ASSERT_FALSE(result.placements[0].spilled);
  EXPECT_EQ(result.placements[0].bubbles[0], 1);  // 1.04 < 1.05, 1.05 fits
  EXPECT_DOUBLE_EQ(result.placements[0].start, 2.0);
  EXPECT_DOUBLE_EQ(result.placements[0].end, 3.0);
  EXPECT_NEAR(result.reserved_s, 1.05, 1e-12);
}

TEST(Packer, MarginIsReservedForEveryTask) {
  // Two tasks of 1.0 with 10% margin need 2.2: the second does not fit a 2.1 bubble.
  const auto problem = one_worker({{0, 0.0, 2.1, 0}}, 1, 5.0);
  const auto result = pack(problem, {item(1.0), item(1.0)}, PackingPolicy::kFirstFit, 0.1);
  EXPECT_FALSE(result.placements[0].spilled);
  EXPECT_TRUE(result.placements[1].spilled);
  EXPECT_DOUBLE_EQ(result.placements[1].start, 5.0);
  EXPECT_EQ(result.spilled_items, 1);
}

TEST(Packer, ReleaseAndPredecessorsAreRespected) {
  const auto problem = one_worker({{0, 0.0, 10.0, 0}});
  const auto result = pack(problem, {item(1.0, 3.0), item(2.0, 0.0, {0}), item(1.0)},
                           PackingPolicy::kFirstFit, 0.0);
  EXPECT_DOUBLE_EQ(result.placements[0].start, 3.0);
  EXPECT_DOUBLE_EQ(result.placements[1].start, 4.0);
  // The bubble is filled from a cursor: the hole before the released task is not reused.
  EXPECT_DOUBLE_EQ(result.placements[2].start, 6.0);
}

TEST(Packer, SpillPropagatesToDependents) {
  const auto problem = one_worker({{0, 0.0, 1.0, 0}, {1, 5.0, 9.0, 1}}, 2, 20.0);
  const auto result =
      pack(problem, {item(2.0), item(0.5, 0.0, {0})}, PackingPolicy::kFirstFit, 0.0);
  EXPECT_FALSE(result.placements[0].spilled);
  EXPECT_EQ(result.placements[0].step, 1);
  EXPECT_DOUBLE_EQ(result.placements[1].start, 7.0);

  const auto tight = one_worker({{0, 0.0, 1.0, 0}}, 1, 20.0);
  const auto spilled = pack(tight, {item(2.0), item(0.5, 0.0, {0})}, PackingPolicy::kBestFit, 0.0);
  EXPECT_TRUE(spilled.placements[0].spilled);
  EXPECT_TRUE(spilled.placements[1].spilled);  // its predecessor spilled, although it would fit
  EXPECT_DOUBLE_EQ(spilled.placements[1].start, 22.0);
  EXPECT_EQ(spilled.spilled_items, 2);
}

TEST(Packer, StepBoundKeepsItemInItsStep) {
  PackProblem problem = one_worker({{0, 0.0, 1.0, 0}, {1, 5.0, 9.0, 1}}, 2);
  problem.flush_start[0] = {2.0, 12.0};
  const auto result =
      pack(problem, {item(2.0, 0.0, {}, 0), item(2.0, 0.0, {}, 1)}, PackingPolicy::kFirstFit, 0.0);
  EXPECT_TRUE(result.placements[0].spilled);
  EXPECT_EQ(result.placements[0].step, 0);
  EXPECT_DOUBLE_EQ(result.placements[0].start, 2.0);
  EXPECT_FALSE(result.placements[1].spilled);
  EXPECT_EQ(result.spilled_bound_items, 1);
  EXPECT_EQ(result.spilled_items, 0);
}

TEST(Packer, BoundItemsSkipBubblesPastTheirDeadline) {
  // The second bubble of step 0 lies after that step's optimizer step: bound items may not use
  // it, free items may.
  Bubble late{0, 5.0, 9.0, 1};
  late.accepts_bound = false;
  const auto problem = one_worker({{0, 0.0, 1.0, 0}, late}, 1, 20.0);
  const auto result =
      pack(problem, {item(2.0, 0.0, {}, 0), item(2.0)}, PackingPolicy::kBestFit, 0.0);
  EXPECT_TRUE(result.placements[0].spilled);
  EXPECT_FALSE(result.placements[1].spilled);
  EXPECT_EQ(result.placements[1].bubbles[0], 1);
}

TEST(Packer, BestFitKeepsLargeBubblesForLargeTasks) {
  // A small task first, then a large one. First-fit puts the small task into the large bubble
  // and the large task no longer fits this step; best-fit puts it into the small bubble.
  const auto problem = one_worker({{0, 0.0, 10.0, 0}, {0, 12.0, 13.0, 1}, {1, 20.0, 30.0, 2}}, 2);
  const std::vector<PackItem> items = {item(1.0), item(9.5)};
  const auto first = pack(problem, items, PackingPolicy::kFirstFit, 0.0);
  const auto best = pack(problem, items, PackingPolicy::kBestFit, 0.0);
  EXPECT_EQ(first.placements[0].bubbles[0], 0);
  EXPECT_EQ(first.placements[1].step, 1);
  EXPECT_EQ(best.placements[0].bubbles[0], 1);
  EXPECT_EQ(best.placements[1].step, 0);
  EXPECT_DOUBLE_EQ(best.placements[1].start, 0.0);
}

TEST(Packer, CollectiveFindsCommonWindow) {
  PackProblem problem;
  problem.num_steps = 1;
  problem.bubbles = {{{0, 0.0, 2.0, 0}, {0, 4.0, 8.0, 1}}, {{0, 1.0, 3.0, 0}, {0, 5.0, 6.5, 1}}};
  problem.flush_start = {{10.0}, {10.0}};
  PackItem sync;
  sync.workers = {0, 1};
  sync.duration = 1.5;
  const auto result = pack(problem, {sync}, PackingPolicy::kFirstFit, 0.0);
  ASSERT_FALSE(result.placements[0].spilled);
  EXPECT_DOUBLE_EQ(result.placements[0].start, 5.0);
  EXPECT_EQ(result.placements[0].bubbles, (std::vector<int>{1, 1}));
}

TEST(Packer, WrapHoldKeepsStepZeroRoomForWrappedWork) {
  // A pipelined refresh of one step: step 0 has bubble A [0, 2) and B [3, 5); the wrap step
  // (the next window's step 0) has A's twin [10, 12), the same idle time. The window's own item
  // (curvature, say) comes first and takes A; the wrappable one (an inversion released at 4.5)
  // then finds no room in step 0 nor in A's twin, and spills. Holding A's head for it moves the
  // own item to B and the wrappable one into the twin: nothing spills.
  PackProblem problem = one_worker({{0, 0.0, 2.0, 0}, {0, 3.0, 5.0, 1}, {1, 10.0, 12.0, 2}}, 2);
  problem.wrap_step = 1;
  problem.bubbles[0][0].twin = 2;
  problem.bubbles[0][2].twin = 0;
  PackItem wrapped = item(2.0, 4.5);
  wrapped.wrappable = true;
  wrapped.wrap_deadline = 20.0;
  const std::vector<PackItem> items = {item(2.0), wrapped};
  for (PackingPolicy policy : {PackingPolicy::kFirstFit, PackingPolicy::kBestFit}) {
    const auto greedy = pack(problem, items, policy, 0.0);
    EXPECT_EQ(greedy.placements[0].bubbles[0], 0);
    EXPECT_TRUE(greedy.placements[1].spilled);
    EXPECT_EQ(greedy.spilled_items, 1);

    const auto held = pack(problem, items, policy, 0.0, {2.0});
    ASSERT_FALSE(held.placements[0].spilled);
    EXPECT_EQ(held.placements[0].bubbles[0], 1);
    EXPECT_DOUBLE_EQ(held.placements[0].start, 3.0);
    ASSERT_FALSE(held.placements[1].spilled);
    EXPECT_EQ(held.placements[1].step, 1);
    EXPECT_EQ(held.placements[1].bubbles[0], 2);
    EXPECT_EQ(held.spilled_items, 0);

    // A twin ending after the wrappable work's deadline holds nothing for it: no hold there.
    PackProblem late = problem;
    late.bubbles[0][2] = {1, 30.0, 32.0, 2};
    late.bubbles[0][2].twin = 0;
    const auto not_held = pack(late, items, policy, 0.0, {2.0});
    EXPECT_EQ(not_held.placements[0].bubbles[0], 0);
    EXPECT_TRUE(not_held.placements[1].spilled);
  }
  // The held room is counted once: with 1.0 of A held, own items use A's rest after it, and a
  // wrapped item of 1.0 in the twin takes the held part only, not A's rest again.
  PackItem short_wrapped = wrapped;
  short_wrapped.duration = 1.0;
  const auto shared = pack(problem, {item(2.0), item(0.5), short_wrapped, item(0.5)},
                           PackingPolicy::kFirstFit, 0.0, {1.0});
  EXPECT_EQ(shared.placements[0].bubbles[0], 1);
  EXPECT_DOUBLE_EQ(shared.placements[1].start, 1.0);  // after the held head
  ASSERT_FALSE(shared.placements[2].spilled);
  EXPECT_EQ(shared.placements[2].bubbles[0], 2);
  ASSERT_FALSE(shared.placements[3].spilled);
  EXPECT_EQ(shared.placements[3].bubbles[0], 0);
  EXPECT_DOUBLE_EQ(shared.placements[3].start, 1.5);
  EXPECT_EQ(shared.spilled_items, 0);
  EXPECT_THROW(pack(problem, items, PackingPolicy::kFirstFit, 0.0, {1.0, 1.0}),
               std::invalid_argument);
  EXPECT_THROW(pack(problem, items, PackingPolicy::kFirstFit, 0.0, {-1.0}), std::invalid_argument);
}

// A wrapped item's dependents follow it into the wrap step, or it does not wrap
// (pack_keeping_wrapped_dependents; pack alone leaves the inversion before the sync): the stream
// runs the wrap step's work after the whole window, so a dependent spilled to the window's flush
// would run before it (a data-parallel curvature sync in the next window, its inversions
// finalizing the unsynced sums in this one: pipefisher_train failed at its first wrapped sync).
// One step: bubble A and its twin C in the wrap step, the same idle time. The sync, released
// after A, fits only C; the inversion after it fits what is left of C or not.
TEST(Packer, AWrappedItemsDependentsAreNotLeftBeforeIt) {
  const auto problem = [](double length) {
    PackProblem p = one_worker({{0, 0.0, length, 0}, {1, 10.0, 10.0 + length, 1}}, 2);
    p.wrap_step = 1;
    p.bubbles[0][0].twin = 1;
    p.bubbles[0][1].twin = 0;
    return p;
  };
  PackItem sync = item(1.5, 4.5);
  sync.wrappable = true;
  sync.wrap_deadline = 20.0;
  PackItem inversion = item(1.0, 0.0, {0});
  inversion.wrappable = true;
  inversion.wrap_deadline = 20.0;
  for (PackingPolicy policy : {PackingPolicy::kFirstFit, PackingPolicy::kBestFit}) {
    // Room for both in C: both wrap, in order.
    const auto room = pack_keeping_wrapped_dependents(problem(3.0), {sync, inversion}, policy, 0.0);
    ASSERT_FALSE(room.placements[0].spilled);
    ASSERT_FALSE(room.placements[1].spilled);
    EXPECT_EQ(room.placements[0].step, 1);
    EXPECT_EQ(room.placements[1].step, 1);
    EXPECT_GE(room.placements[1].start, room.placements[0].end);
    // Room for the sync only: it stays in its window (after the flush), the inversion after it.
    const auto greedy = pack(problem(2.0), {sync, inversion}, policy, 0.0);
    EXPECT_EQ(wrapped_before_dependents({sync, inversion}, greedy, 1), std::vector<std::size_t>{0});
    const auto tight =
        pack_keeping_wrapped_dependents(problem(2.0), {sync, inversion}, policy, 0.0);
    EXPECT_TRUE(wrapped_before_dependents({sync, inversion}, tight, 1).empty());
    EXPECT_TRUE(tight.placements[0].spilled);
    EXPECT_EQ(tight.placements[0].step, 0);
    EXPECT_TRUE(tight.placements[1].spilled);
    EXPECT_EQ(tight.placements[1].step, 0);
    EXPECT_GE(tight.placements[1].start, tight.placements[0].end);
  }
}

// The pass's refinement (docs/pipefisher.md, "Packing") on a hand-built case: per step one long
// gap (1.0) and two short ones (0.12); four short tasks (0.1, whole in a short gap) and one
// long divisible inversion (1.9, 0.05 of it the per-piece overhead). In the policies' order
// (short tasks first) the short tasks take room in the long gaps (first-fit: the head of step
// 0's; best-fit: beside the two that take step 0's short gaps) and the inversion is cut into
// the rest, paying the overhead in short gaps for 0.07 of work a piece: both need a third step.
// Longest work first with no piece under half the longest gap (the refinement's fourth
// packing) puts the inversion into the two long gaps in two pieces and the short tasks into
// the short gaps: two steps hold it all.
TEST(Packer, LongestFirstInLongGapsSavesAStep) {
  const auto problem = [](int steps) {
    std::vector<Bubble> bubbles;
    for (int s = 0; s < steps; ++s) {
      const double t = 10.0 * s;
      bubbles.push_back({s, t, t + 1.0});
      bubbles.push_back({s, t + 2.0, t + 2.12});
      bubbles.push_back({s, t + 3.0, t + 3.12});
    }
    return one_worker(std::move(bubbles), steps);
  };
  const auto inversion = [](double min_piece) {
    PackItem it = item(1.9);
    it.divisible = true;
    it.overhead = 0.05;
    it.min_piece = min_piece;
    return it;
  };
  std::vector<PackItem> policy_order(4, item(0.1));
  policy_order.push_back(inversion(0.1));
  for (auto policy : {PackingPolicy::kFirstFit, PackingPolicy::kBestFit}) {
    SCOPED_TRACE(policy == PackingPolicy::kFirstFit ? "first_fit" : "best_fit");
    const auto two = pack(problem(2), policy_order, policy, 0.0);
    EXPECT_EQ(two.spilled_items, 1);
    EXPECT_TRUE(two.placements[4].spilled);
    EXPECT_EQ(pack(problem(3), policy_order, policy, 0.0).spilled_items, 0);
  }
  std::vector<PackItem> longest_first{inversion(0.5)};
  for (int i = 0; i < 4; ++i) longest_first.push_back(item(0.1));
  const auto refined = pack(problem(2), longest_first, PackingPolicy::kBestFit, 0.0);
  EXPECT_EQ(refined.spilled_items, 0);
  ASSERT_EQ(refined.placements[0].pieces.size(), 2u);
  EXPECT_EQ(refined.placements[0].pieces[0].bubble, 0);  // the long gaps
  EXPECT_EQ(refined.placements[0].pieces[1].bubble, 3);
  for (std::size_t i = 1; i <= 4; ++i) {
    EXPECT_NE(refined.placements[i].bubbles[0] % 3, 0) << "short task " << i << " in a long gap";
  }
}

TEST(Packer, RejectsMalformedInput) {
  EXPECT_THROW(pack(one_worker({{0, 0.0, 2.0, 0}, {0, 1.0, 3.0, 1}}), {item(1.0)},
                    PackingPolicy::kFirstFit, 0.0),
               std::invalid_argument);
  EXPECT_THROW(pack(one_worker({{0, 2.0, 1.0, 0}}), {item(1.0)}, PackingPolicy::kFirstFit, 0.0),
               std::invalid_argument);
  EXPECT_THROW(
      pack(one_worker({{0, 0.0, 2.0, 0}}), {item(1.0, 0.0, {0})}, PackingPolicy::kFirstFit, 0.0),
      std::invalid_argument);
  PackItem bad = item(1.0);
  bad.workers = {3};
  EXPECT_THROW(pack(one_worker({}), {bad}, PackingPolicy::kFirstFit, 0.0), std::invalid_argument);
  EXPECT_THROW(pack(one_worker({}), {item(-1.0)}, PackingPolicy::kFirstFit, 0.0),
               std::invalid_argument);
  EXPECT_THROW(pack(one_worker({}), {item(1.0)}, PackingPolicy::kBestOfBoth, 0.0),
               std::invalid_argument);
  EXPECT_THROW(pack(one_worker({}), {item(1.0, 0.0, {}, 4)}, PackingPolicy::kFirstFit, 0.0),
               std::invalid_argument);
}

// Random problems: placements never overlap, never leave their bubble, respect release times
// and predecessors, under both policies.
TEST(Packer, RandomProblemsKeepInvariants) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (int trial = 0; trial < 50; ++trial) {
    const int workers = 1 + trial % 3;
    const int steps = 1 + trial % 4;
    PackProblem problem;
    problem.num_steps = steps;
    for (int w = 0; w < workers; ++w) {
      std::vector<Bubble> bubbles;
      double t = 0.0;
      for (int s = 0; s < steps; ++s) {
        for (int b = 0; b < 5; ++b) {
          t += unit(rng);
          const double end = t + 3.0 * unit(rng);
          bubbles.push_back({s, t, end, b});
          t = end;
        }
      }
      problem.bubbles.push_back(bubbles);
      std::vector<double> flush;
      for (int s = 0; s < steps; ++s) flush.push_back(t + 1.0 + 1000.0 * s);
      problem.flush_start.push_back(flush);
    }
    std::vector<PackItem> items;
    for (int i = 0; i < 40; ++i) {
      PackItem it;
      it.workers = {static_cast<int>(rng() % static_cast<unsigned>(workers))};
      if (workers > 1 && i % 9 == 0) it.workers = {0, 1};
      it.duration = 0.6 * unit(rng);
      it.release = 10.0 * unit(rng);
      if (i > 0 && i % 3 == 0) it.preds = {static_cast<int>(rng() % static_cast<unsigned>(i))};
      if (i % 7 == 0) it.step_bound = static_cast<int>(rng() % static_cast<unsigned>(steps));
      items.push_back(it);
    }
    for (PackingPolicy policy : {PackingPolicy::kFirstFit, PackingPolicy::kBestFit}) {
      const double margin = 0.05;
      const auto result = pack(problem, items, policy, margin);
      std::vector<std::vector<std::pair<double, double>>> busy(static_cast<std::size_t>(workers));
      for (std::size_t i = 0; i < items.size(); ++i) {
        const auto& p = result.placements[i];
        EXPECT_GE(p.start, items[i].release - 1e-12);
        for (int pred : items[i].preds) {
          EXPECT_GE(p.start, result.placements[static_cast<std::size_t>(pred)].end - 1e-12);
        }
        if (items[i].step_bound >= 0) {
          EXPECT_GE(p.step, items[i].step_bound);  // a spilled predecessor may push it later
        }
        for (std::size_t r = 0; r < items[i].workers.size(); ++r) {
          const auto w = static_cast<std::size_t>(items[i].workers[r]);
          const double reserved_end = p.start + items[i].duration * (1.0 + margin);
          if (!p.spilled) {
            const auto& b = problem.bubbles[w][static_cast<std::size_t>(p.bubbles[r])];
            EXPECT_GE(p.start, b.start - 1e-12);
            EXPECT_LE(reserved_end, b.end + 1e-9);
            if (items[i].step_bound >= 0) {
              EXPECT_EQ(b.step, items[i].step_bound);
            }
          }
          busy[w].push_back({p.start, p.spilled ? p.end : reserved_end});
        }
      }
      for (auto& intervals : busy) {
        std::sort(intervals.begin(), intervals.end());
        for (std::size_t k = 1; k < intervals.size(); ++k) {
          EXPECT_LE(intervals[k - 1].second, intervals[k].first + 1e-9)
              << "overlap in trial " << trial;
        }
      }
    }
  }
}

}  // namespace
}  // namespace pf::pipefisher
