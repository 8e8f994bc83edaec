#include "kfac/inverse.h"

#include <Eigen/Cholesky>
#include <Eigen/Eigenvalues>
#include <algorithm>
#include <stdexcept>
#include <string>

#include "kfac/factors.h"

namespace pf::kfac {

namespace {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Inverts a lower-triangular matrix in place and zeroes its strict upper triangle:
// [L11 0; L21 L22]^-1 = [L11^-1 0; -L22^-1 L21 L11^-1  L22^-1]. With the upper triangles zero the
// two products are plain (OpenMP-threaded) GEMMs.
void invert_lower_in_place(Eigen::Ref<Eigen::MatrixXf> lower) {
  const auto n = lower.rows();
  constexpr Eigen::Index kDirect = 128;
  if (n <= kDirect) {
    Eigen::MatrixXf inverse = Eigen::MatrixXf::Identity(n, n);
    lower.triangularView<Eigen::Lower>().solveInPlace(inverse);
    lower = inverse.triangularView<Eigen::Lower>();
    return;
  }
  const auto half = n / 2;
  const auto rest = n - half;
  invert_lower_in_place(lower.topLeftCorner(half, half));
  invert_lower_in_place(lower.bottomRightCorner(rest, rest));
  lower.topRightCorner(half, rest).setZero();
  const Eigen::MatrixXf product =
      lower.bottomLeftCorner(rest, half) * lower.topLeftCorner(half, half);
  lower.bottomLeftCorner(rest, half).noalias() = -(lower.bottomRightCorner(rest, rest) * product);
}

void check_factor(const Eigen::Ref<const Eigen::MatrixXf>& factor, float damping) {
  if (factor.rows() == 0 || factor.rows() != factor.cols()) {
    throw std::invalid_argument("damped_inverse: factor is " + std::to_string(factor.rows()) +
                                " x " + std::to_string(factor.cols()) +
                                ", expected square, non-empty");
  }
  if (!(damping >= 0.0F)) {
    throw std::invalid_argument("damped_inverse: damping must be >= 0, got " +
                                std::to_string(damping));
  }
  if (!factor.allFinite()) {
    throw std::runtime_error("damped_inverse: the factor has non-finite entries (NaN or inf)");
  }
}

Eigen::MatrixXf eigen_inverse(const Eigen::Ref<const Eigen::MatrixXf>& factor, float damping) {
  const auto decomposition = eigen_factor(factor);
  const Eigen::VectorXf shifted = decomposition.values.array() + damping;
  if (shifted.minCoeff() <= 0.0F) {
    throw std::runtime_error("damped_inverse: the factor is singular and damping is 0");
  }
  const Eigen::MatrixXf scaled = decomposition.vectors * shifted.cwiseInverse().asDiagonal();
  Eigen::MatrixXf inverse = scaled * decomposition.vectors.transpose();
  symmetrize(inverse);
  return inverse;
}

}  // namespace

EigenFactor eigen_factor(const Eigen::Ref<const Eigen::MatrixXf>& factor) {
  check_factor(factor, 0.0F);
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXf> solver(factor);
  if (solver.info() != Eigen::Success) {
    throw std::runtime_error("eigen_factor: the eigen solver did not converge on a " +
                             std::to_string(factor.rows()) + " x " + std::to_string(factor.cols()) +
                             " factor");
  }
  return {solver.eigenvectors(), solver.eigenvalues().cwiseMax(0.0F)};
}

InverseResult damped_inverse(const Eigen::Ref<const Eigen::MatrixXf>& factor, float damping,
                             InverseMethod method) {
  check_factor(factor, damping);
  if (method == InverseMethod::kEigen) return {eigen_inverse(factor, damping), false};

  Eigen::MatrixXf damped = factor;
  damped.diagonal().array() += damping;
  const Eigen::LLT<Eigen::MatrixXf, Eigen::Lower> llt(damped);
  if (llt.info() != Eigen::Success) return {eigen_inverse(factor, damping), true};
  // (L L^T)^-1 = L^-T L^-1: invert the triangle by GEMM-rich block recursion, then one threaded
  // SYRK. About d^3 / 3 + d^3 / 3 + d^3 FLOP, mostly in matrix products, where solving L L^T X = I
  // column by column costs 2 d^3 in triangular solves that run several times slower.
  Eigen::MatrixXf l_inverse = llt.matrixL();
  invert_lower_in_place(l_inverse);
  const RowMatrix rows = l_inverse;  // row-major L^-1, the layout add_gram_lower reads
  const auto n = factor.rows();
  Eigen::MatrixXf inverse = Eigen::MatrixXf::Zero(n, n);
  add_gram_lower(inverse, rows.data(), n, n, 1.0F);
  fill_upper_from_lower(inverse);
  return {std::move(inverse), false};
}

}  // namespace pf::kfac
