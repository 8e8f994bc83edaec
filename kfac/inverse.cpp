#include "kfac/inverse.h"

#include <omp.h>

#include <Eigen/Cholesky>
#include <Eigen/Eigenvalues>
#include <algorithm>
#include <stdexcept>
#include <string>

#include "kfac/factors.h"

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
  // Solving L L^T X = I splits into independent column blocks: one per thread. (A GEMM-rich
  // variant, L^-1 by block recursion then L^-T L^-1 by SYRK, measured no faster here.)
  const auto n = factor.rows();
  Eigen::MatrixXf inverse(n, n);
  // Below a few hundred columns a parallel region costs more than the solve.
  const int threads = n >= 256 ? omp_get_max_threads() : 1;
  const Eigen::Index block = (n + threads - 1) / threads;
#pragma omp parallel for schedule(static) if (threads > 1)
  for (int part = 0; part < threads; ++part) {
    const Eigen::Index c0 = part * block;
    const Eigen::Index width = std::min(block, n - c0);
    if (width <= 0) continue;
    auto columns = inverse.middleCols(c0, width);
    columns.setZero();
    for (Eigen::Index j = 0; j < width; ++j) columns(c0 + j, j) = 1.0F;
    llt.solveInPlace(columns);
  }
  symmetrize(inverse);
  return {std::move(inverse), false};
}

}  // namespace pf::kfac
