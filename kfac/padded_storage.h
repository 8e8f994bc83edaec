#pragma once
// Square fp32 matrices stored with a padded leading dimension, for damped_inverse's Cholesky
// factorization and its solve against the identity. With a leading dimension that is a multiple
// of 512 bytes (orders 128, 256, ... 1024, 4096: every BERT factor) a column-major matrix maps
// element i of every column to the same few cache sets, and the solve, which walks along rows,
// evicts its own operands. Measured on this machine's CPU (docs/kfac.md, "Padded storage"): the
// inverse runs about 5% faster at orders 1024 and 2048 with one line of padding, with the same
// bits (the kernels' arithmetic does not depend on the stride). The inversion chain
// (inverse_chain.h) keeps dense storage: padded, its 128-column steps measured no faster (1024,
// 2048) or 8% slower (4096).
#include "kfac/eigen_core.h"

namespace pf::kfac {

// Rows of the storage for an n x n matrix: n rounded up to whole 64-byte lines, plus one line
// when that is a multiple of 512 bytes.
inline Eigen::Index padded_leading_dimension(Eigen::Index n) {
  constexpr Eigen::Index kLine = 16;  // floats per 64-byte cache line
  Eigen::Index rows = (n + kLine - 1) / kLine * kLine;
  if (rows % (8 * kLine) == 0) rows += kLine;
  return rows;
}

// Storage whose top n rows (`square(storage, n)`) are the matrix.
inline Eigen::MatrixXf padded_square_storage(Eigen::Index n) {
  return Eigen::MatrixXf(padded_leading_dimension(n), n);
}
inline auto square(Eigen::MatrixXf& storage, Eigen::Index n) {
  return storage.topRows(n);
}
inline auto square(const Eigen::MatrixXf& storage, Eigen::Index n) {
  return storage.topRows(n);
}

}  // namespace pf::kfac
