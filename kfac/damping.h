#pragma once
// Factored Tikhonov damping (Martens & Grosse, section 6.3). Instead of F + lambda I, K-FAC inverts
//   (B + d_B I) kron (A + d_A I)  with  d_A = sqrt(lambda) * pi,  d_B = sqrt(lambda) / pi,
//   pi = sqrt((tr A / d_in) / (tr B / d_out)),
// which equals B kron A + d_A B kron I + d_B I kron A + lambda I: the exact damping lambda plus two
// cross terms. pi balances them; with pi = 1 both factors get sqrt(lambda).
#include "kfac/eigen_core.h"

namespace pf::kfac {

struct FactorDamping {
  float a = 0.0F;  // added to A's diagonal
  float b = 0.0F;  // added to B's diagonal
  double pi = 1.0;
};

// Normalized traces are floored at kTraceFloor so that a zero factor (dead units) does not give
// pi = 0 or infinity.
inline constexpr double kTraceFloor = 1e-7;

// pi from the two factors (traces accumulated in double). Throws std::invalid_argument for an
// empty or non-square factor.
double pi_adjustment(const Eigen::Ref<const Eigen::MatrixXf>& a,
                     const Eigen::Ref<const Eigen::MatrixXf>& b);

// lambda must be >= 0; pi_adjusted = false gives d_A = d_B = sqrt(lambda).
FactorDamping factored_damping(const Eigen::Ref<const Eigen::MatrixXf>& a,
                               const Eigen::Ref<const Eigen::MatrixXf>& b, float lambda,
                               bool pi_adjusted = true);

}  // namespace pf::kfac
