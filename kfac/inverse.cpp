#include "kfac/inverse.h"

#include <omp.h>

#include <Eigen/Cholesky>
#include <Eigen/Eigenvalues>
#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/ops.h"
#include "kfac/factors.h"
#include "kfac/padded_storage.h"

namespace pf::kfac {

namespace {

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
  const Eigen::LLT<Eigen::Ref<Eigen::MatrixXf>, Eigen::Lower> llt(damped);  // in place
  if (llt.info() != Eigen::Success) return {eigen_inverse(factor, damping), true};
  // Solving L L^T X = I splits into independent column blocks: one per thread. (A GEMM-rich
  // variant, L^-1 by block recursion then L^-T L^-1 by SYRK, measured no faster here.)
  Eigen::MatrixXf inverse_storage = padded_square_storage(n);
  auto inverse = square(inverse_storage, n);
  // Below a few hundred columns a parallel region costs more than the solve. The blocks are cut
  // by the order only (at most kMaxParts of at least 128 columns), not by the thread count: a
  // blocked triangular solve rounds a column differently with the width of its block, and the
  // inverse must be the same on any number of threads.
  constexpr Eigen::Index kMaxParts = 8;
  const Eigen::Index parts = n >= 256 ? std::min<Eigen::Index>(kMaxParts, n / 128) : 1;
  const Eigen::Index block = (n + parts - 1) / parts;
  const int threads = static_cast<int>(std::min<Eigen::Index>(omp_get_max_threads(), parts));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (Eigen::Index part = 0; part < parts; ++part) {
    const Eigen::Index c0 = part * block;
    const Eigen::Index width = std::min(block, n - c0);
    if (width <= 0) continue;
    auto columns = inverse.middleCols(c0, width);
    columns.setZero();
    for (Eigen::Index j = 0; j < width; ++j) columns(c0 + j, j) = 1.0F;
    llt.solveInPlace(columns);
  }
  symmetrize(inverse);
  return {Eigen::MatrixXf(inverse), false};
}

}  // namespace pf::kfac
