#include "kfac/factors.h"

#include <omp.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

namespace pf::kfac {

namespace {

// Column blocks of the lower triangle, widest work first. Block j covers columns [c0, c1) and
// rows [c0, d): its cost is (d - c0) * (c1 - c0), so the first blocks are the largest and a
// dynamic schedule balances them.
constexpr std::int64_t kBlockWidth = 128;

}  // namespace

void add_gram_lower(Eigen::Ref<Eigen::MatrixXf> sum, const float* x, std::int64_t rows,
                    std::int64_t cols, float scale) {
  if (rows < 0 || cols < 0 || sum.rows() != cols || sum.cols() != cols) {
    throw std::invalid_argument("add_gram_lower: factor is " + std::to_string(sum.rows()) + " x " +
                                std::to_string(sum.cols()) + " but the input is " +
                                std::to_string(rows) + " x " + std::to_string(cols));
  }
  if (rows == 0 || cols == 0) return;
  if (x == nullptr) throw std::invalid_argument("add_gram_lower: null input");
  // The row-major T x d input is, in memory, the column-major d x T matrix x^T.
  const Eigen::Map<const Eigen::MatrixXf> xt(x, cols, rows);
  const std::int64_t blocks = (cols + kBlockWidth - 1) / kBlockWidth;
  if (blocks == 1 || omp_get_max_threads() == 1) {
    sum.selfadjointView<Eigen::Lower>().rankUpdate(xt, scale);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t block = 0; block < blocks; ++block) {
    const std::int64_t c0 = block * kBlockWidth;
    const std::int64_t width = std::min(kBlockWidth, cols - c0);
    const std::int64_t below = cols - c0 - width;
    const auto columns = xt.middleRows(c0, width);
    sum.block(c0, c0, width, width).selfadjointView<Eigen::Lower>().rankUpdate(columns, scale);
    if (below > 0) {
      sum.block(c0 + width, c0, below, width).noalias() +=
          scale * xt.middleRows(c0 + width, below) * columns.transpose();
    }
  }
}

void fill_upper_from_lower(Eigen::Ref<Eigen::MatrixXf> matrix) {
  if (matrix.rows() != matrix.cols()) {
    throw std::invalid_argument("fill_upper_from_lower: matrix is not square");
  }
  matrix.triangularView<Eigen::StrictlyUpper>() = matrix.transpose();
}

void symmetrize(Eigen::Ref<Eigen::MatrixXf> matrix) {
  if (matrix.rows() != matrix.cols())
    throw std::invalid_argument("symmetrize: matrix is not square");
  const auto n = matrix.rows();
  for (Eigen::Index j = 0; j < n; ++j) {
    for (Eigen::Index i = j + 1; i < n; ++i) {
      const float mean = 0.5F * (matrix(i, j) + matrix(j, i));
      matrix(i, j) = mean;
      matrix(j, i) = mean;
    }
  }
}

float output_grad_scale(std::int64_t loss_terms, std::int64_t tokens,
                        std::int64_t accumulation_divisor) {
  if (loss_terms <= 0 || tokens <= 0 || accumulation_divisor <= 0) {
    throw std::invalid_argument("output_grad_scale: loss_terms (" + std::to_string(loss_terms) +
                                "), tokens (" + std::to_string(tokens) +
                                ") and accumulation_divisor (" +
                                std::to_string(accumulation_divisor) + ") must be positive");
  }
  const double n = static_cast<double>(loss_terms);
  const double k = static_cast<double>(accumulation_divisor);
  return static_cast<float>(n * n * k * k / static_cast<double>(tokens));
}

}  // namespace pf::kfac
