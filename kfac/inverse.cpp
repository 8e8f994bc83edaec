#include "kfac/inverse.h"

#include <Eigen/Cholesky>
#include <Eigen/Eigenvalues>
#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

#include "kernels/ops.h"
#include "kfac/cholesky_inverse_columns.h"
#include "kfac/factors.h"
#include "kfac/lower_blas.h"
#include "kfac/padded_storage.h"

namespace pf::kfac {

namespace {

// Columns of the inverse per cholesky_inverse_columns call (the inversion chain's block).
constexpr Eigen::Index kInverseColumnBlock = 128;

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
  // inverse = scaled V^T through kernels::gemm (its blocks cut by shape only, so the bits do not
  // depend on the thread count, as Eigen's threaded product's do). A column-major n x n matrix
  // read row-major is its transpose: inverse^T = V scaled^T.
  const auto n = factor.rows();
  auto row_major = [n](const Eigen::MatrixXf& m) {
    return kernels::ConstMatrixView<float>{m.data(), n, n, m.outerStride()};
  };
  Eigen::MatrixXf inverse(n, n);
  kernels::gemm<float>(row_major(decomposition.vectors), kernels::Transpose::kYes,
                       row_major(scaled), kernels::Transpose::kNo, {inverse.data(), n, n});
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

  // Both L and the inverse in padded storage (kfac/padded_storage.h): same bits, no cache-set
  // conflicts at power-of-two orders.
  const auto n = factor.rows();
  Eigen::MatrixXf cholesky_storage = padded_square_storage(n);
  auto damped = square(cholesky_storage, n);
  damped = factor;
  damped.diagonal().array() += damping;
  if (!cholesky_lower(damped)) return {eigen_inverse(factor, damping), true};
  // X = L^-T L^-1 by blocks of columns, the lower triangle only (cholesky_inverse_columns.h:
  // n^3 FLOPs where solving against I in full took 2 n^3), then mirrored. The blocks are cut by
  // the order only, so the inverse is the same on any number of threads.
  Eigen::MatrixXf inverse_storage = padded_square_storage(n);
  auto inverse = square(inverse_storage, n);
  const auto cholesky = square(std::as_const(cholesky_storage), n);
  for (Eigen::Index first = 0; first < n; first += kInverseColumnBlock) {
    cholesky_inverse_columns(cholesky, inverse, first, std::min(kInverseColumnBlock, n - first));
  }
  fill_upper_from_lower(inverse);
  return {Eigen::MatrixXf(inverse), false};
}

}  // namespace pf::kfac
