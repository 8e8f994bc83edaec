#pragma once
// Checks shared by the divisible-task sweep's tests (test_pieces_sweep*.cpp).
#include <gtest/gtest.h>

#include "scheduler/pipefisher/pieces_sweep.h"

namespace pf::pipefisher {

// Per case: what holds in every configuration of the sweep.
inline void check_case(const SweepResult& r) {
  SCOPED_TRACE(r.config.name());
  ASSERT_TRUE(r.refused.empty()) << r.refused;
  EXPECT_TRUE(r.whole_refused.empty()) << r.whole_refused;
  const KfacReport& s = r.split;
  ASSERT_GE(s.refresh_bound, 1);
  // The search starts at the bound: k below it would mean the bound is not one.
  EXPECT_GE(s.refresh_steps, r.capped_below_bound() ? 1 : s.refresh_bound);
  EXPECT_GE(s.release_bound, s.refresh_bound - 1);
  // The bound in usable gaps counts less idle time and more overhead than the work/bubble bound.
  if (s.usable_bound > 0) {
    EXPECT_GE(s.usable_bound, s.refresh_bound);
  }
  // Every schedule the pass emits (pipelined ones with work in the next window included) is one
  // the validator accepts.
  EXPECT_EQ(r.invalid, "");
  EXPECT_GE(s.utilization_after, s.utilization_before);
  EXPECT_GT(s.idle_filled, 0.0);
  EXPECT_LE(s.idle_filled, 1.0);
  if (s.capped) {
    EXPECT_FALSE(s.warning.empty());
  } else {
    EXPECT_TRUE(s.warning.empty()) << s.warning;
  }
}

// The 64 cases the quick sweep tests run: analytic p100 and h100, micro-batch 8 and 32, D = 4
// and 8, every schedule and model.
inline bool in_quick_subset(const SweepCase& config) {
  return config.costs == "analytic" && (config.device == "p100" || config.device == "h100") &&
         config.micro_batch != 16 && config.stages != 16;
}

inline double share(int count, int of) {
  return of > 0 ? static_cast<double>(count) / of : 0.0;
}

}  // namespace pf::pipefisher
