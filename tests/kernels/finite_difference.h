#pragma once
// Central finite differences in double precision for checking backward passes.
#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace pf::testing {

inline std::vector<double> random_vector(std::size_t count, std::mt19937_64& rng,
                                         double scale = 1.0) {
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<double> values(count);
  for (auto& value : values) value = normal(rng);
  return values;
}

// d loss / d values[i] by central differences, for every i (tiny tensors only).
inline std::vector<double> numeric_gradient(std::vector<double>& values,
                                            const std::function<double()>& loss,
                                            double step = 1e-6) {
  std::vector<double> gradient(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    const double saved = values[i];
    values[i] = saved + step;
    const double plus = loss();
    values[i] = saved - step;
    const double minus = loss();
    values[i] = saved;
    gradient[i] = (plus - minus) / (2 * step);
  }
  return gradient;
}

// Central differences have error O(step^2 * f''') + O(eps * |f| / step): with step 1e-6 and
// double rounding that is ~1e-9 relative, so 1e-6 leaves a wide margin while catching any
// wrong term (which shows up at order 1).
inline void expect_gradients_near(const std::vector<double>& analytic,
                                  const std::vector<double>& numeric, const std::string& what,
                                  double tolerance = 1e-6) {
  ASSERT_EQ(analytic.size(), numeric.size()) << what;
  double scale = 1e-3;
  for (double value : numeric) scale = std::max(scale, std::abs(value));
  for (std::size_t i = 0; i < analytic.size(); ++i) {
    ASSERT_NEAR(analytic[i], numeric[i], tolerance * scale) << what << " element " << i;
  }
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double total = 0;
  for (std::size_t i = 0; i < a.size(); ++i) total += a[i] * b[i];
  return total;
}

}  // namespace pf::testing
