#include "kfac/cholesky_inverse_columns.h"

#include <omp.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kfac/lower_blas.h"

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
    solve_lower(trailing, slice, false);
    solve_lower(trailing, slice, true);
  }
}

}  // namespace pf::kfac
