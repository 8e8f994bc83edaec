#pragma once
// K-FAC statistics of a run for pipefisher_train's metrics, read from the executor's K-FAC state
// while it is paused between steps: how many refreshes the factors had, the damping actually
// added to each factor (pi-adjusted: d_A = sqrt(lambda) pi, d_B = sqrt(lambda) / pi, so
// pi = sqrt(d_A / d_B)), and how many inversions fell back from Cholesky to an eigensolver.
#include <nlohmann/json.hpp>

#include "runtime/executor/executor.h"

namespace pf::train {

// {"layers", "layers_inverted", "refreshes_min", "refreshes_max", "cholesky_fallbacks",
//  "pi_min", "pi_median", "pi_max", "damping_a_mean", "damping_b_mean"} over the preconditioned
// Linears of replica 0 (pi and damping over the inverted ones; absent before any inversion).
// Call only while the executor is not running.
nlohmann::json kfac_statistics(exec::ThreadedExecutor<float>& executor);

}  // namespace pf::train
