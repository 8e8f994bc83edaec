#include "kfac/damping.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace pf::kfac {

namespace {

double normalized_trace(const Eigen::Ref<const Eigen::MatrixXf>& factor, const char* which) {
  if (factor.rows() == 0 || factor.rows() != factor.cols()) {
    throw std::invalid_argument(std::string("pi_adjustment: factor ") + which + " is " +
                                std::to_string(factor.rows()) + " x " +
                                std::to_string(factor.cols()) + ", expected square, non-empty");
  }
  double trace = 0.0;
  for (Eigen::Index i = 0; i < factor.rows(); ++i) trace += factor(i, i);
  return std::max(trace / static_cast<double>(factor.rows()), kTraceFloor);
}

}  // namespace

double pi_adjustment(const Eigen::Ref<const Eigen::MatrixXf>& a,
                     const Eigen::Ref<const Eigen::MatrixXf>& b) {
  return std::sqrt(normalized_trace(a, "A") / normalized_trace(b, "B"));
}

FactorDamping factored_damping(const Eigen::Ref<const Eigen::MatrixXf>& a,
                               const Eigen::Ref<const Eigen::MatrixXf>& b, float lambda,
                               bool pi_adjusted) {
  if (!(lambda >= 0.0F)) {
    throw std::invalid_argument("factored_damping: lambda must be >= 0, got " +
                                std::to_string(lambda));
  }
  FactorDamping damping;
  damping.pi = pi_adjusted ? pi_adjustment(a, b) : 1.0;
  const double root = std::sqrt(double{lambda});
  damping.a = static_cast<float>(root * damping.pi);
  damping.b = static_cast<float>(root / damping.pi);
  return damping;
}

}  // namespace pf::kfac
