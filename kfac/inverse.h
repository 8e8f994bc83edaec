#pragma once
// Damped inverses of a Kronecker factor, (F + d I)^-1, in fp32.
#include <cstdint>
#include "kfac/eigen_core.h"

namespace pf::kfac {

enum class InverseMethod : std::uint8_t {
  kCholesky,  // LLT of F + d I, then solve against I (PipeFisher / asdl)
  kEigen,     // F = Q diag(e) Q^T, eigenvalues clamped at 0: Q diag(1 / (e + d)) Q^T
};

struct InverseResult {
  Eigen::MatrixXf inverse;
  // True when Cholesky found F + d I not positive definite in fp32 (damping too small for the
  // factor's conditioning) and the eigen path produced the inverse instead.
  bool fell_back_to_eigen = false;
};

// Throws std::invalid_argument for a non-square or empty factor or a negative damping;
// std::runtime_error when the eigen solver does not converge or the damped factor is singular.
InverseResult damped_inverse(const Eigen::Ref<const Eigen::MatrixXf>& factor, float damping,
                             InverseMethod method);

// Eigen decomposition of a symmetric factor with eigenvalues clamped at 0 (for the
// eigenvalue-product damping of precondition_eigen_exact).
struct EigenFactor {
  Eigen::MatrixXf vectors;  // columns are eigenvectors
  Eigen::VectorXf values;   // ascending, >= 0
};
EigenFactor eigen_factor(const Eigen::Ref<const Eigen::MatrixXf>& factor);

}  // namespace pf::kfac
