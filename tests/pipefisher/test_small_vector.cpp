// The inline vector of the K-FAC tasks and packing items: inline up to N, the heap beyond, and
// the copies, moves and inserts the pass relies on.
#include <gtest/gtest.h>

#include <utility>
#include <vector>

#include "scheduler/pipefisher/kfac_work.h"
#include "scheduler/small_vector.h"

namespace pf {
namespace {

TEST(SmallVector, GrowsPastItsInlineValuesAndKeepsThem) {
  SmallVector<int, 2> v{1, 2};
  EXPECT_EQ(v.capacity(), 2u);
  for (int i = 3; i <= 100; ++i) v.push_back(i);
  ASSERT_EQ(v.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(v[static_cast<std::size_t>(i)], i + 1);
  v.push_back(v[0]);  // a value of its own, at a reallocation or not
  EXPECT_EQ(v.back(), 1);
}

TEST(SmallVector, CopiesMovesAndInsertsLikeAVector) {
  const std::vector<int> source{4, 5, 6};
  SmallVector<int, 2> heap = source;  // three values: on the heap
  SmallVector<int, 2> small{7};
  SmallVector<int, 2> copy = heap;
  EXPECT_TRUE(copy == heap);
  SmallVector<int, 2> moved = std::move(copy);
  EXPECT_TRUE(moved == heap);
  EXPECT_TRUE(copy.empty());  // NOLINT(bugprone-use-after-move): moved-from is empty
  moved = small;
  ASSERT_EQ(moved.size(), 1u);
  EXPECT_EQ(moved[0], 7);
  small.insert(small.end(), source.begin(), source.end());
  EXPECT_EQ(std::vector<int>(small), (std::vector<int>{7, 4, 5, 6}));
  small.insert(small.begin() + 1, source.begin(), source.begin() + 1);
  EXPECT_EQ(std::vector<int>(small), (std::vector<int>{7, 4, 4, 5, 6}));
  small = {1, 2};
  EXPECT_EQ(std::vector<int>(small), (std::vector<int>{1, 2}));
  EXPECT_FALSE(small == heap);
}

TEST(SmallVector, HoldsInstructionsAndDependencies) {
  pipefisher::KfacTask task;
  sched::Instruction in;
  in.kind = sched::OpKind::kCurvatureSync;
  task.instructions = {in};
  in.peer = 3;
  task.instructions.push_back(in);  // a sync's second replica: to the heap
  task.base_deps = {pipefisher::BaseRef{1, 2, 0}};
  const pipefisher::KfacTask copy = task;
  ASSERT_EQ(copy.instructions.size(), 2u);
  EXPECT_EQ(copy.instructions[1].peer, 3);
  EXPECT_EQ(copy.base_deps[0].position, 2);
}

}  // namespace
}  // namespace pf
