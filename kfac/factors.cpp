#include "kfac/factors.h"

#include <omp.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "kfac/lower_blas.h"

namespace pf::kfac {

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
  // One SYRK runs on one thread. The tokens are cut into contiguous blocks, each a full SYRK into
  // its own d x d partial sum (the first into `sum`), added up in block order at the end: a d^2
  // reduction per block against 2 T d^2 / 2 of work. (Splitting the output into column blocks
  // instead measured 30% less efficient.) The cut depends on the shape only, never on the thread
  // count, so the bits are the same on any number of threads (as the products' are,
  // kernels/cpu/gemm.cpp); at most kMaxBlocks partials bound the memory.
  constexpr std::int64_t kMinRowsPerBlock = 256;
  constexpr std::int64_t kMaxBlocks = 2;
  const std::int64_t blocks =
      cols < 64 ? 1 : std::clamp<std::int64_t>(rows / kMinRowsPerBlock, 1, kMaxBlocks);
  if (blocks == 1) {
    syrk_lower(sum, xt, scale);
    return;
  }
  std::vector<Eigen::MatrixXf> partials(static_cast<std::size_t>(blocks - 1));
  const int threads = static_cast<int>(std::min<std::int64_t>(omp_get_max_threads(), blocks));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (std::int64_t block = 0; block < blocks; ++block) {
    const std::int64_t begin = rows * block / blocks;
    const std::int64_t end = rows * (block + 1) / blocks;
    const auto slice = xt.middleCols(begin, end - begin);
    if (block == 0) {
      syrk_lower(sum, slice, scale);
    } else {
      auto& partial = partials[static_cast<std::size_t>(block - 1)];
      partial = Eigen::MatrixXf::Zero(cols, cols);
      syrk_lower(partial, slice, scale);
    }
  }
  for (const auto& partial : partials) sum.triangularView<Eigen::Lower>() += partial;
}

void fill_upper_from_lower(Eigen::Ref<Eigen::MatrixXf> matrix) {
  if (matrix.rows() != matrix.cols()) {
    throw std::invalid_argument("fill_upper_from_lower: matrix is " +
                                std::to_string(matrix.rows()) + " x " +
                                std::to_string(matrix.cols()) + ", expected square");
  }
  // Tiles of 64 x 64 floats (16 KiB): read along rows of the lower triangle and write down
  // columns of the upper one inside a tile that stays in cache, where an element-by-element
  // transpose strides a whole column per element (an inverse of order 4096 is 64 MiB).
  constexpr Eigen::Index kTile = 64;
  const Eigen::Index n = matrix.rows();
  for (Eigen::Index j0 = 0; j0 < n; j0 += kTile) {
    const Eigen::Index j1 = std::min(n, j0 + kTile);
    for (Eigen::Index i0 = j0; i0 < n; i0 += kTile) {
      const Eigen::Index i1 = std::min(n, i0 + kTile);
      for (Eigen::Index i = i0; i < i1; ++i) {
        for (Eigen::Index j = j0; j < std::min(j1, i); ++j) matrix(j, i) = matrix(i, j);
      }
    }
  }
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
