#include "kfac/cholesky_inverse_columns.h"

#include <omp.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace pf::kfac {

void cholesky_inverse_columns(const Eigen::Ref<const Eigen::MatrixXf>& cholesky,
                              Eigen::Ref<Eigen::MatrixXf> inverse, Eigen::Index first,
                              Eigen::Index width) {
  const Eigen::Index n = cholesky.rows();
  if (cholesky.cols() != n || inverse.rows() != n || inverse.cols() != n || first < 0 ||
      width <= 0 || first + width > n) {
    throw std::invalid_argument("cholesky_inverse_columns: columns [" + std::to_string(first) +
                                ", " + std::to_string(first + width) + ") of a " +
                                std::to_string(n) + " x " + std::to_string(n) + " inverse");
  }
  const Eigen::Index below = n - first;
  const auto trailing = cholesky.bottomRightCorner(below, below);
  // Below a few hundred rows a parallel region costs more than the solve; slices of at least 64
  // columns, at most 8.
  const Eigen::Index parts = n >= 256 ? std::clamp<Eigen::Index>(width / 64, 1, 8) : 1;
  const int threads = static_cast<int>(std::min<Eigen::Index>(omp_get_max_threads(), parts));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (Eigen::Index part = 0; part < parts; ++part) {
    const Eigen::Index c0 = width * part / parts;
    const Eigen::Index c1 = width * (part + 1) / parts;
    if (c1 <= c0) continue;
    auto slice = inverse.block(first, first + c0, below, c1 - c0);
    slice.setZero();
    for (Eigen::Index j = c0; j < c1; ++j) slice(j, j - c0) = 1.0F;
    trailing.triangularView<Eigen::Lower>().solveInPlace(slice);
    trailing.triangularView<Eigen::Lower>().transpose().solveInPlace(slice);
  }
}

void mirror_lower(Eigen::Ref<Eigen::MatrixXf> matrix) {
  if (matrix.rows() != matrix.cols()) {
    throw std::invalid_argument("mirror_lower: matrix is " + std::to_string(matrix.rows()) + " x " +
                                std::to_string(matrix.cols()) + ", expected square");
  }
  // Tiles of 64 x 64 floats (16 KiB) read down columns of the lower triangle and write down
  // columns of the upper one, where an element-by-element transpose strides a whole column per
  // write.
  constexpr Eigen::Index kTile = 64;
  const Eigen::Index n = matrix.rows();
  for (Eigen::Index j0 = 0; j0 < n; j0 += kTile) {
    const Eigen::Index j1 = std::min(n, j0 + kTile);
    for (Eigen::Index i0 = j0; i0 < n; i0 += kTile) {
      const Eigen::Index i1 = std::min(n, i0 + kTile);
      // Upper element (j, i) = lower element (i, j), for i > j in this tile.
      for (Eigen::Index i = i0; i < i1; ++i) {
        for (Eigen::Index j = j0; j < std::min(j1, i); ++j) matrix(j, i) = matrix(i, j);
      }
    }
  }
}

}  // namespace pf::kfac
