// Matrix products through Eigen. Large products are split by rows of the result over the
// OpenMP threads, each block a single-threaded Eigen GEMM (Eigen runs sequentially inside a
// parallel region). Eigen's own parallel GEMM synchronises its threads by spinning on shared
// flags, which collapses when the machine is oversubscribed (one descheduled thread stalls the
// others for whole time slices); a block split needs one barrier per product.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "kernels/cpu/eigen_maps.h"
#include "kernels/ops.h"

namespace pf::kernels {
namespace {

std::string dims(std::int64_t rows, std::int64_t cols) {
  return std::to_string(rows) + "x" + std::to_string(cols);
}

template <typename T, typename A, typename B>
void product(const A& a, const B& b, MatrixView<T> c, T alpha, T beta) {
  auto out = cpu::map(c);
  if (beta == T(0)) {
    if (alpha == T(1)) {
      out.noalias() = a * b;
    } else {
      out.noalias() = alpha * (a * b);
    }
  } else {
    if (beta != T(1)) out *= beta;
    if (alpha == T(1)) {
      out.noalias() += a * b;
    } else {
      out.noalias() += alpha * (a * b);
    }
  }
}

}  // namespace

template <typename T>
void gemm(ConstMatrixView<T> a, Transpose transpose_a, ConstMatrixView<T> b, Transpose transpose_b,
          MatrixView<T> c, T alpha, T beta) {
  const bool ta = transpose_a == Transpose::kYes;
  const bool tb = transpose_b == Transpose::kYes;
  const auto m = ta ? a.cols : a.rows;
  const auto k = ta ? a.rows : a.cols;
  const auto k2 = tb ? b.cols : b.rows;
  const auto n = tb ? b.rows : b.cols;
  require(
      k == k2 && c.rows == m && c.cols == n, "gemm",
      "op(a) " + dims(m, k) + " times op(b) " + dims(k2, n) + " into c " + dims(c.rows, c.cols));
  if (c.rows == 0 || c.cols == 0) return;
  if (k == 0) {
    if (beta == T(0)) {
      cpu::map(c).setZero();
    } else {
      cpu::map(c) *= beta;
    }
    return;
  }
  constexpr std::int64_t kParallelWork = std::int64_t{1} << 18;  // multiply-adds
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  if (threads > 1 && m >= 2 * threads && m * n * k >= kParallelWork) {
    const std::int64_t block = (m + threads - 1) / threads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < threads; ++t) {
      const std::int64_t first = t * block;
      const std::int64_t rows = std::min(block, m - first);
      if (rows <= 0) continue;
      // Rows [first, first + rows) of op(a): rows of a, or columns of a when transposed.
      ConstMatrixView<T> a_block = ta ? a.block_cols(first, rows) : a.block_rows(first, rows);
      gemm(a_block, transpose_a, b, transpose_b, c.block_rows(first, rows), alpha, beta);
    }
    return;
  }
  auto ma = cpu::map(a);
  auto mb = cpu::map(b);
  if (!ta && !tb) product(ma, mb, c, alpha, beta);
  if (!ta && tb) product(ma, mb.transpose(), c, alpha, beta);
  if (ta && !tb) product(ma.transpose(), mb, c, alpha, beta);
  if (ta && tb) product(ma.transpose(), mb.transpose(), c, alpha, beta);
}

template <typename T>
void batched_gemm(std::int64_t count, ConstMatrixView<T> a, std::int64_t stride_a,
                  Transpose transpose_a, ConstMatrixView<T> b, std::int64_t stride_b,
                  Transpose transpose_b, MatrixView<T> c, std::int64_t stride_c, T alpha, T beta) {
  require(count >= 0, "batched_gemm", "negative batch count");
#pragma omp parallel for schedule(static) if (count > 1)
  for (std::int64_t i = 0; i < count; ++i) {
    ConstMatrixView<T> ai(a.data + i * stride_a, a.rows, a.cols, a.ld);
    ConstMatrixView<T> bi(b.data + i * stride_b, b.rows, b.cols, b.ld);
    MatrixView<T> ci(c.data + i * stride_c, c.rows, c.cols, c.ld);
    gemm(ai, transpose_a, bi, transpose_b, ci, alpha, beta);
  }
}

template <typename T>
void linear_forward(ConstMatrixView<T> x, ConstMatrixView<T> weight, const T* bias,
                    MatrixView<T> y) {
  require(x.cols == weight.cols && y.rows == x.rows && y.cols == weight.rows, "linear_forward",
          "x " + dims(x.rows, x.cols) + ", weight " + dims(weight.rows, weight.cols) + ", y " +
              dims(y.rows, y.cols));
  if (bias != nullptr) {
    auto out = cpu::map(y);
    Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>> b(bias, y.cols);
    out.rowwise() = b;
    gemm(x, Transpose::kNo, weight, Transpose::kYes, y, T(1), T(1));
  } else {
    gemm(x, Transpose::kNo, weight, Transpose::kYes, y);
  }
}

template <typename T>
void linear_backward(ConstMatrixView<T> x, ConstMatrixView<T> weight, ConstMatrixView<T> dy,
                     MatrixView<T> dx, MatrixView<T> dweight, T* dbias) {
  require(dy.rows == x.rows && dy.cols == weight.rows && dweight.rows == weight.rows &&
              dweight.cols == weight.cols,
          "linear_backward",
          "x " + dims(x.rows, x.cols) + ", weight " + dims(weight.rows, weight.cols) + ", dy " +
              dims(dy.rows, dy.cols));
  if (dx.data != nullptr) gemm(dy, Transpose::kNo, weight, Transpose::kNo, dx);
  gemm(dy, Transpose::kYes, x, Transpose::kNo, dweight, T(1), T(1));
  if (dbias != nullptr) bias_backward(dy, dbias);
}

template <typename T>
void bias_add(MatrixView<T> y, const T* bias) {
  Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>> b(bias, y.cols);
  cpu::map(y).rowwise() += b;
}

// Column sums of dy, added to dbias. Rows are added one after another (contiguous, vectorised)
// into a partial sum per chunk of kChunkRows rows, and each chunk's partial sum is added to
// dbias. Eigen's colwise().sum() on a row-major matrix walks the rows once per column packet,
// 9x slower on a 4096x1024 dy (bench_model's bias_backward). Each thread takes a contiguous
// range of columns; the split does not change any column's order of additions, so the result is
// the same for any number of threads.
template <typename T>
void bias_backward(ConstMatrixView<T> dy, T* dbias) {
  constexpr std::int64_t kChunkRows = 256;
  if (dy.rows == 0 || dy.cols == 0) return;
  const int threads =
      cpu::worth_parallel(dy.size()) && !omp_in_parallel() ? omp_get_max_threads() : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const std::int64_t parts = omp_get_num_threads();
    const std::int64_t per = ((dy.cols + parts - 1) / parts + 15) / 16 * 16;
    const std::int64_t first = omp_get_thread_num() * per;
    const std::int64_t cols = std::min(per, dy.cols - first);
    if (cols > 0) {
      std::vector<T> storage(static_cast<std::size_t>(cols));
      auto partial = cpu::array(storage.data(), cols);
      auto db = cpu::array(dbias + first, cols);
      for (std::int64_t start = 0; start < dy.rows; start += kChunkRows) {
        const std::int64_t end = std::min(dy.rows, start + kChunkRows);
        partial = cpu::array(dy.row(start) + first, cols);
        for (std::int64_t i = start + 1; i < end; ++i) {
          partial += cpu::array(dy.row(i) + first, cols);
        }
        db += partial;
      }
    }
  }
}

#define PF_INSTANTIATE(T)                                                                      \
  template void gemm<T>(ConstMatrixView<T>, Transpose, ConstMatrixView<T>, Transpose,          \
                        MatrixView<T>, T, T);                                                  \
  template void batched_gemm<T>(std::int64_t, ConstMatrixView<T>, std::int64_t, Transpose,     \
                                ConstMatrixView<T>, std::int64_t, Transpose, MatrixView<T>,    \
                                std::int64_t, T, T);                                           \
  template void linear_forward<T>(ConstMatrixView<T>, ConstMatrixView<T>, const T*,            \
                                  MatrixView<T>);                                              \
  template void linear_backward<T>(ConstMatrixView<T>, ConstMatrixView<T>, ConstMatrixView<T>, \
                                   MatrixView<T>, MatrixView<T>, T*);                          \
  template void bias_add<T>(MatrixView<T>, const T*);                                          \
  template void bias_backward<T>(ConstMatrixView<T>, T*);
PF_INSTANTIATE(float)
PF_INSTANTIATE(double)
#undef PF_INSTANTIATE

}  // namespace pf::kernels
