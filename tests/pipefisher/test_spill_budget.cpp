// The spill budget (KfacOptions::spill_budget, --kfac-spill-budget): below the smallest k whose
// bubbles hold all of a refresh's curvature, sync and inversion, the smallest k that leaves at
// most the budget's share of a step after the flush on its busiest worker; at or above that k
// nothing changes (docs/pipefisher.md, "Spill budget").
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "tests/pipefisher/sweep_checks.h"

namespace pf::pipefisher {
namespace {

KfacOptions with_budget(double budget) {
  KfacOptions options;
  options.spill_budget = budget;
  return options;
}

// Analytic p100, BERT-Base, micro-batch 8, D = 4, 1F1B (bound 5): worker 0 gets its last
// curvature only after its last backward, so holding all of the work takes 6 steps; at 5 a
// little of it runs after the flush, 1.7 points of step time, within a 2% budget.
TEST(SpillBudget, ReachesTheBoundForAFewPercentOfAStep) {
  const SweepCase config{"analytic", "p100", "base", 8, 4, sched::ScheduleKind::kOneFOneB};
  const SweepResult plain = run_sweep_case(config);
  const SweepResult budget = run_sweep_case(config, with_budget(0.02));
  check_case(plain);
  check_case(budget);
  ASSERT_EQ(plain.split.refresh_bound, 5);
  EXPECT_EQ(plain.split.refresh_steps, 6);
  EXPECT_EQ(plain.split.spilled_tasks, 0);
  EXPECT_EQ(plain.split.budget_spill, 0.0);
  EXPECT_EQ(budget.split.refresh_steps, 5);
  EXPECT_GT(budget.split.spilled_tasks, 0);
  EXPECT_GT(budget.split.budget_spill, 0.0);
  EXPECT_LE(budget.split.budget_spill, 0.02);
  EXPECT_EQ(budget.split.spill_budget, 0.02);
  // What the budget buys costs no more than it allows...
  EXPECT_GT(budget.split.step_time_overhead, plain.split.step_time_overhead);
  EXPECT_LE(budget.split.step_time_overhead, plain.split.step_time_overhead + 0.02 + 1e-3);
  // ...and the report still gives the policies' own k, which hold everything.
  EXPECT_EQ(budget.split.first_fit_refresh_steps, plain.split.first_fit_refresh_steps);
  EXPECT_EQ(budget.split.best_fit_refresh_steps, plain.split.best_fit_refresh_steps);
  // A budget smaller than the spill leaves the plan as it was.
  const SweepResult tight = run_sweep_case(config, with_budget(0.001));
  EXPECT_EQ(tight.split.refresh_steps, 6);
  EXPECT_EQ(tight.split.step_time_overhead, plain.split.step_time_overhead);
}

// Where the plain pass is at the bound already, the budget changes nothing: analytic p100,
// BERT-Base, micro-batch 32, D = 4, 1F1B (k = bound = 4). A plan of the same k that spills fits
// the budget too, and a first version took it for its smaller sum of work after the flush over
// all workers: +0.8 points of step time for nothing.
TEST(SpillBudget, LeavesAPlanAtTheBoundAlone) {
  const SweepCase config{"analytic", "p100", "base", 32, 4, sched::ScheduleKind::kOneFOneB};
  const SweepResult plain = run_sweep_case(config);
  const SweepResult budget = run_sweep_case(config, with_budget(0.05));
  ASSERT_EQ(plain.split.refresh_steps, plain.split.refresh_bound);
  EXPECT_EQ(budget.split.refresh_steps, plain.split.refresh_steps);
  EXPECT_EQ(budget.split.step_time_overhead, plain.split.step_time_overhead);
  EXPECT_EQ(budget.split.budget_spill, 0.0);
}

TEST(SpillBudget, OutOfRangeIsRefusedNamingTheFlag) {
  for (const double bad : {-0.01, 1.5}) {
    try {
      with_budget(bad).validate();
      FAIL() << "accepted " << bad;
    } catch (const std::invalid_argument& error) {
      EXPECT_NE(std::string(error.what()).find("--kfac-spill-budget"), std::string::npos)
          << error.what();
    }
  }
  EXPECT_NO_THROW(with_budget(0.0).validate());
  EXPECT_NO_THROW(with_budget(1.0).validate());
}

// The sweep's subset (test_pieces_sweep.cpp's 64 cases) with a 2% budget: k at the bound in all
// but a few (56 of 64, the plain pass 35), never above the bound + 1, and each case's overhead
// at most 2 points above the plain pass's (docs/pipefisher.md, "Spill budget": 534 of the 576
// at the bound).
TEST(SpillBudget, SweepSubsetAtTheBound) {
  std::vector<SweepResult> results;
  for (const SweepCase& config : pieces_sweep_cases()) {
    if (!in_quick_subset(config)) continue;
    const SweepResult plain = run_sweep_case(config);
    results.push_back(run_sweep_case(config, with_budget(0.02)));
    const SweepResult& r = results.back();
    check_case(r);
    SCOPED_TRACE(config.name());
    EXPECT_LE(r.split.refresh_steps, plain.split.refresh_steps);
    EXPECT_LE(r.split.step_time_overhead, plain.split.step_time_overhead + 0.02 + 1e-3);
    if (r.split.refresh_steps == plain.split.refresh_steps) {
      EXPECT_EQ(r.split.step_time_overhead, plain.split.step_time_overhead);
    }
  }
  ASSERT_EQ(results.size(), 64u);
  const SweepSummary sum = summarize(results);
  EXPECT_GE(sum.at_bound, 56);
  EXPECT_EQ(sum.within_one, 64);
}

}  // namespace
}  // namespace pf::pipefisher
