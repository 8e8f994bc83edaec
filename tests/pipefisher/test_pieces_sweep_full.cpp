// The divisible-task sweep, all 576 cases (docs/pipefisher.md, "The sweep"): its criteria as
// documented. Labelled slow (about a minute); test_pieces_sweep.cpp runs a subset.
#include <gtest/gtest.h>

#include <vector>

#include "tests/pipefisher/sweep_checks.h"

namespace pf::pipefisher {
namespace {

TEST(PipeFisherSweep, Full) {
  std::vector<SweepResult> results;
  for (const SweepCase& config : pieces_sweep_cases()) {
    results.push_back(run_sweep_case(config));
    check_case(results.back());
  }
  const SweepSummary sum = summarize(results);
  ASSERT_EQ(sum.configurations, 576);
  EXPECT_EQ(sum.refused, 0);
  EXPECT_EQ(sum.whole_refused, 0);
  // The figures of docs/pipefisher.md, "The sweep".
  EXPECT_GE(sum.at_bound, 305);
  EXPECT_GT(sum.at_bound, sum.whole_at_bound);
  EXPECT_GE(share(sum.at_release_bound, sum.configurations), 0.85);
  EXPECT_GE(sum.within_one + sum.capped_below_bound, 552);
  EXPECT_GE(sum.not_costlier, 571);  // 566 before the curvature sync was divisible
}

}  // namespace
}  // namespace pf::pipefisher
