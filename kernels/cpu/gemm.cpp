// Matrix products on the CPU. A product goes to a CBLAS GEMM on the calling thread (Debian's
// OpenBLAS, found by CMake: PF_HAVE_CBLAS; 1.3-1.4x Eigen's GEMM on an AVX2 Zen core,
// docs/benchmarks.md, "CPU matrix products") or, without one or where OpenBLAS runs kernels
// narrower than Eigen's (kernels/cpu/dense_library.h), to Eigen's, single-threaded. Large products
// are cut into blocks of rows (or of columns, when the result is wide and short) and the blocks
// spread over the OpenMP threads. The cut depends on the shape only, never on the thread count:
// OpenBLAS rounds a row differently depending on where a block boundary falls, so a cut by thread
// count would make the result depend on it. One barrier per product: Eigen's own parallel GEMM
// synchronises its threads by spinning on shared flags, which collapses when the machine is
// oversubscribed (one descheduled thread stalls the others for whole time slices).
#include <omp.h>

#include <algorithm>
#include <mutex>
#include <type_traits>
#include <vector>

#if PF_HAVE_CBLAS
#include <cblas.h>
#endif

#include "kernels/cpu/blas_threads.h"
#include "kernels/cpu/dense_library.h"
#include "kernels/cpu/eigen_maps.h"
#include "kernels/ops.h"

namespace pf::kernels {

namespace cpu {
void use_one_blas_thread_per_call() {
#if PF_HAVE_CBLAS
  // The threaded OpenBLAS build, because its serial one is not safe to call from several threads
  // at once (attention's per-head products came out wrong with it).
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
#endif
}
}  // namespace cpu

namespace {

std::string dims(std::int64_t rows, std::int64_t cols) {
  return std::to_string(rows) + "x" + std::to_string(cols);
}

#if PF_HAVE_CBLAS
CBLAS_TRANSPOSE cblas_transpose(bool transpose) {
  return transpose ? CblasTrans : CblasNoTrans;
}

template <typename T>
void blas_product(bool ta, bool tb, std::int64_t k, ConstMatrixView<T> a, ConstMatrixView<T> b,
                  MatrixView<T> c, T alpha, T beta) {
  cpu::use_one_blas_thread_per_call();
  const auto ld = [](std::int64_t value) {
    return static_cast<int>(std::max<std::int64_t>(value, 1));
  };
  const auto m = static_cast<int>(c.rows), n = static_cast<int>(c.cols),
             depth = static_cast<int>(k);
  if constexpr (std::is_same_v<T, float>) {
    cblas_sgemm(CblasRowMajor, cblas_transpose(ta), cblas_transpose(tb), m, n, depth, alpha, a.data,
                ld(a.ld), b.data, ld(b.ld), beta, c.data, ld(c.ld));
  } else {
    cblas_dgemm(CblasRowMajor, cblas_transpose(ta), cblas_transpose(tb), m, n, depth, alpha, a.data,
                ld(a.ld), b.data, ld(b.ld), beta, c.data, ld(c.ld));
  }
}
#endif

template <typename T, typename A, typename B>
void eigen_product(const A& a, const B& b, MatrixView<T> c, T alpha, T beta) {
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

// One block of the result, on the calling thread (Eigen's GEMM is called inside an OpenMP team,
// see gemm(), so that it does not start threads of its own).
template <typename T>
void block_product(ConstMatrixView<T> a, bool ta, ConstMatrixView<T> b, bool tb, std::int64_t k,
                   MatrixView<T> c, T alpha, T beta, bool openblas) {
#if PF_HAVE_CBLAS
  if (openblas) {
    blas_product<T>(ta, tb, k, a, b, c, alpha, beta);
    return;
  }
#endif
  (void)k;
  (void)openblas;  // always false without CBLAS
  auto ma = cpu::map(a);
  auto mb = cpu::map(b);
  if (!ta && !tb) eigen_product(ma, mb, c, alpha, beta);
  if (!ta && tb) eigen_product(ma, mb.transpose(), c, alpha, beta);
  if (ta && !tb) eigen_product(ma.transpose(), mb, c, alpha, beta);
  if (ta && tb) eigen_product(ma.transpose(), mb.transpose(), c, alpha, beta);
}

// The cut of an m x n result into blocks: along its longer side, into at most kMaxBlocks blocks
// of at least kMinBlock rows or columns (a multiple of 32), one block for small products. The
// number of blocks is even (when there are several), so that two or four threads get equal
// shares: the MLM head's 640-row products were cut into 5 blocks of 128, 3 on one thread and 2
// on the other. Blocks of 128-256 rows run as fast as the whole product in OpenBLAS
// (docs/benchmarks.md).
struct ProductCut {
  bool by_rows = true;
  std::int64_t block = 0;  // rows or columns per block
  std::int64_t count = 1;
};

ProductCut cut_product(std::int64_t m, std::int64_t n, std::int64_t k) {
  constexpr std::int64_t kParallelWork = std::int64_t{1} << 18;  // multiply-adds
  constexpr std::int64_t kMaxBlocks = 16;
  constexpr std::int64_t kMinBlock = 128;
  ProductCut cut;
  cut.by_rows = m >= n;
  const std::int64_t length = cut.by_rows ? m : n;
  cut.block = length;
  if (m * n * k < kParallelWork || length < 2 * kMinBlock) return cut;
  // The most blocks (even, at least 2) whose 32-rounded size still gives an even count; two
  // blocks always do.
  for (std::int64_t blocks = std::min(kMaxBlocks, length / kMinBlock) / 2 * 2; blocks >= 2;
       blocks -= 2) {
    cut.block = ((length + blocks - 1) / blocks + 31) / 32 * 32;
    cut.count = (length + cut.block - 1) / cut.block;
    if (cut.count % 2 == 0) break;
  }
  return cut;
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
  // The library, once per product and before any OpenMP region (the first call may throw).
  const bool openblas = cpu::use_openblas();
  const ProductCut cut = cut_product(m, n, k);
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  // Eigen's GEMM threads itself outside an OpenMP team, with blocks sized by its thread count
  // (so the bits would follow the thread count): one product alone still runs in a team then.
  if (cut.count == 1 && (threads == 1 || openblas)) {
    block_product(a, ta, b, tb, k, c, alpha, beta, openblas);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (std::int64_t i = 0; i < cut.count; ++i) {
    const std::int64_t first = i * cut.block;
    const std::int64_t length = std::min(cut.block, (cut.by_rows ? m : n) - first);
    if (cut.by_rows) {
      // Rows [first, first + length) of op(a): rows of a, or columns of a when transposed.
      const ConstMatrixView<T> a_block =
          ta ? a.block_cols(first, length) : a.block_rows(first, length);
      block_product(a_block, ta, b, tb, k, c.block_rows(first, length), alpha, beta, openblas);
    } else {
      // Columns [first, first + length) of op(b): columns of b, or rows of b when transposed.
      const ConstMatrixView<T> b_block =
          tb ? b.block_rows(first, length) : b.block_cols(first, length);
      block_product(a, ta, b_block, tb, k, c.block_cols(first, length), alpha, beta, openblas);
    }
  }
}

template <typename T>
void batched_gemm(std::int64_t count, ConstMatrixView<T> a, std::int64_t stride_a,
                  Transpose transpose_a, ConstMatrixView<T> b, std::int64_t stride_b,
                  Transpose transpose_b, MatrixView<T> c, std::int64_t stride_c, T alpha, T beta) {
  require(count >= 0, "batched_gemm", "negative batch count");
  (void)cpu::dense_library();  // chosen before the OpenMP region: it may throw
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
    // The bias in every row (a copy, in parallel: the MLM decoder's is 640 x 30522), then the
    // product adds to it.
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(y.size()) && !omp_in_parallel())
    for (std::int64_t i = 0; i < y.rows; ++i) {
      std::copy(bias, bias + y.cols, y.row(i));
    }
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
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(y.size()) && !omp_in_parallel())
  for (std::int64_t i = 0; i < y.rows; ++i) {
    T* row = y.row(i);
#pragma omp simd
    for (std::int64_t j = 0; j < y.cols; ++j) row[j] += bias[j];
  }
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
