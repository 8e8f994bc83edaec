// Elementwise ops, LayerNorm, softmax and reductions. Rows are split over OpenMP threads; each
// row is processed with vectorised Eigen array expressions.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <omp.h>
#include <unsupported/Eigen/SpecialFunctions>

#include "kernels/cpu/dropout_select.h"
#include "kernels/cpu/eigen_maps.h"
#include "kernels/ops.h"
#include "kernels/rng.h"

namespace pf::kernels {
namespace {

template <typename A, typename B>
void require_same_shape(const A& a, const B& b, const char* op) {
  require(a.rows == b.rows && a.cols == b.cols, op,
          "shape mismatch " + std::to_string(a.rows) + "x" + std::to_string(a.cols) + " vs " +
              std::to_string(b.rows) + "x" + std::to_string(b.cols));
}

constexpr double kInvSqrt2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;

}  // namespace

template <typename T>
void gelu_forward(ConstMatrixView<T> x, MatrixView<T> y) {
  require_same_shape(x, y, "gelu_forward");
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(x.size()))
  for (std::int64_t i = 0; i < x.rows; ++i) {
    auto in = cpu::array(x.row(i), x.cols);
    cpu::array(y.row(i), y.cols) = T(0.5) * in * (T(1) + (in * T(kInvSqrt2)).erf());
  }
}

template <typename T>
void bias_gelu_forward(MatrixView<T> x, const T* bias, MatrixView<T> y) {
  require_same_shape(x, y, "bias_gelu_forward");
  auto b = cpu::array(bias, x.cols);
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(x.size()))
  for (std::int64_t i = 0; i < x.rows; ++i) {
    auto in = cpu::array(x.row(i), x.cols);
    in += b;
    cpu::array(y.row(i), y.cols) = T(0.5) * in * (T(1) + (in * T(kInvSqrt2)).erf());
  }
}

template <typename T>
void gelu_backward(ConstMatrixView<T> x, ConstMatrixView<T> dy, MatrixView<T> dx) {
  require_same_shape(x, dy, "gelu_backward");
  require_same_shape(x, dx, "gelu_backward");
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(x.size()))
  for (std::int64_t i = 0; i < x.rows; ++i) {
    auto in = cpu::array(x.row(i), x.cols);
    auto cdf = T(0.5) * (T(1) + (in * T(kInvSqrt2)).erf());
    auto pdf = T(kInvSqrt2Pi) * (T(-0.5) * in.square()).exp();
    cpu::array(dx.row(i), dx.cols) = cpu::array(dy.row(i), dy.cols) * (cdf + in * pdf);
  }
}

template <typename T>
void bias_tanh_forward(MatrixView<T> x, const T* bias, MatrixView<T> y) {
  require_same_shape(x, y, "bias_tanh_forward");
  auto b = cpu::array(bias, x.cols);
  for (std::int64_t i = 0; i < x.rows; ++i) {
    auto in = cpu::array(x.row(i), x.cols);
    in += b;
    cpu::array(y.row(i), y.cols) = in.tanh();
  }
}

template <typename T>
void tanh_backward(ConstMatrixView<T> y, ConstMatrixView<T> dy, MatrixView<T> dx) {
  require_same_shape(y, dy, "tanh_backward");
  require_same_shape(y, dx, "tanh_backward");
  for (std::int64_t i = 0; i < y.rows; ++i) {
    auto out = cpu::array(y.row(i), y.cols);
    cpu::array(dx.row(i), dx.cols) = cpu::array(dy.row(i), dy.cols) * (T(1) - out.square());
  }
}

template <typename T>
void dropout_forward(ConstMatrixView<T> x, MatrixView<T> y, float probability, std::uint64_t seed,
                     std::uint64_t index_offset) {
  require_same_shape(x, y, "dropout_forward");
  require(probability >= 0.0F && probability < 1.0F, "dropout_forward",
          "probability must lie in [0, 1), got " + std::to_string(probability));
  if (probability == 0.0F) {
    if (x.data != y.data) cpu::map(y) = cpu::map(x);
    return;
  }
  const auto threshold = dropout_threshold(probability);
  const T scale = T(1) / (T(1) - static_cast<T>(probability));
  const std::uint64_t key = stream_key(seed);
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(x.size()))
  for (std::int64_t i = 0; i < x.rows; ++i) {
    const T* in = x.row(i);
    T* out = y.row(i);
    const std::uint64_t base = index_offset + static_cast<std::uint64_t>(i * x.cols);
#pragma omp simd
    for (std::int64_t j = 0; j < x.cols; ++j) {
      const bool keep = bits_for_key(key, base + static_cast<std::uint64_t>(j)) >= threshold;
      out[j] = cpu::keep_or_zero(in[j] * scale, keep);
    }
  }
}

template <typename T>
void dropout_backward(ConstMatrixView<T> dy, MatrixView<T> dx, float probability,
                      std::uint64_t seed, std::uint64_t index_offset) {
  // The mask is regenerated from (seed, index): the backward of y = m x s is dx = m dy s.
  dropout_forward(dy, dx, probability, seed, index_offset);
}

// One pass: y = (keep ? x * scale : 0) + residual, the bits of dropout_forward followed by
// accumulate (the product is rounded before the sum: the bitwise select between them keeps the
// compiler from contracting the two into one FMA). y may alias x or residual.
template <typename T>
void dropout_add_forward(ConstMatrixView<T> x, ConstMatrixView<T> residual, MatrixView<T> y,
                         float probability, std::uint64_t seed) {
  require_same_shape(x, residual, "dropout_add_forward");
  require_same_shape(x, y, "dropout_add_forward");
  require(probability >= 0.0F && probability < 1.0F, "dropout_add_forward",
          "probability must lie in [0, 1), got " + std::to_string(probability));
  if (probability == 0.0F) {
    add(x, residual, y);
    return;
  }
  const auto threshold = dropout_threshold(probability);
  const T scale = T(1) / (T(1) - static_cast<T>(probability));
  const std::uint64_t key = stream_key(seed);
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(x.size()))
  for (std::int64_t i = 0; i < x.rows; ++i) {
    const T* in = x.row(i);
    const T* res = residual.row(i);
    T* out = y.row(i);
    const auto base = static_cast<std::uint64_t>(i * x.cols);
#pragma omp simd
    for (std::int64_t j = 0; j < x.cols; ++j) {
      const bool keep = bits_for_key(key, base + static_cast<std::uint64_t>(j)) >= threshold;
      out[j] = cpu::keep_or_zero(in[j] * scale, keep) + res[j];
    }
  }
}

// Row-parallel (a plain Eigen expression runs on one thread): each element's sum is the same
// for any thread count.
template <typename T>
void add(ConstMatrixView<T> a, ConstMatrixView<T> b, MatrixView<T> y) {
  require_same_shape(a, b, "add");
  require_same_shape(a, y, "add");
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(a.size()) && !omp_in_parallel())
  for (std::int64_t i = 0; i < a.rows; ++i) {
    const T* left = a.row(i);
    const T* right = b.row(i);
    T* out = y.row(i);
#pragma omp simd
    for (std::int64_t j = 0; j < a.cols; ++j) out[j] = left[j] + right[j];
  }
}

template <typename T>
void accumulate(ConstMatrixView<T> x, MatrixView<T> y) {
  require_same_shape(x, y, "accumulate");
  add(ConstMatrixView<T>(y), x, y);
}

template <typename T>
void layernorm_forward(ConstMatrixView<T> x, const T* gamma, const T* beta, T eps, MatrixView<T> y,
                       T* mean, T* rstd) {
  require_same_shape(x, y, "layernorm_forward");
  require(x.cols > 0, "layernorm_forward", "rows must not be empty");
  auto g = cpu::array(gamma, x.cols);
  auto b = cpu::array(beta, x.cols);
  const T inv_cols = T(1) / static_cast<T>(x.cols);
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(x.size()))
  for (std::int64_t i = 0; i < x.rows; ++i) {
    auto in = cpu::array(x.row(i), x.cols);
    const T mu = in.sum() * inv_cols;
    const T variance = (in - mu).square().sum() * inv_cols;
    const T r = T(1) / std::sqrt(variance + eps);
    mean[i] = mu;
    rstd[i] = r;
    cpu::array(y.row(i), y.cols) = (in - mu) * r * g + b;
  }
}

// Rows are taken in fixed chunks of kLayerNormChunkRows; each chunk sums its rows' dgamma and
// dbeta terms into its own partial, and the partials are added to dgamma and dbeta in chunk order
// afterwards: the same sums for any thread count (a per-thread partial would make the parameter
// gradients depend on how the rows were shared out). Per row, two passes: the two means, then
// dx and the partial sums.
constexpr std::int64_t kLayerNormChunkRows = 64;

template <typename T>
void layernorm_backward(ConstMatrixView<T> x, ConstMatrixView<T> dy, const T* gamma, const T* mean,
                        const T* rstd, MatrixView<T> dx, T* dgamma, T* dbeta) {
  require_same_shape(x, dy, "layernorm_backward");
  require_same_shape(x, dx, "layernorm_backward");
  const std::int64_t cols = x.cols;
  const T inv_cols = T(1) / static_cast<T>(cols);
  const std::int64_t chunks = (x.rows + kLayerNormChunkRows - 1) / kLayerNormChunkRows;
  std::vector<T> partial(static_cast<std::size_t>(2 * chunks * cols));
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(x.size()) && !omp_in_parallel())
  for (std::int64_t chunk = 0; chunk < chunks; ++chunk) {
    T* pg = partial.data() + 2 * chunk * cols;
    T* pb = pg + cols;
    std::fill(pg, pg + 2 * cols, T(0));
    const std::int64_t last = std::min(x.rows, (chunk + 1) * kLayerNormChunkRows);
    for (std::int64_t i = chunk * kLayerNormChunkRows; i < last; ++i) {
      const T* in = x.row(i);
      const T* d = dy.row(i);
      T* out = dx.row(i);
      const T mu = mean[i];
      const T r = rstd[i];
      T sum_dg = T(0), sum_dg_xhat = T(0);
#pragma omp simd reduction(+ : sum_dg, sum_dg_xhat)
      for (std::int64_t j = 0; j < cols; ++j) {
        const T dg = d[j] * gamma[j];
        sum_dg += dg;
        sum_dg_xhat += dg * ((in[j] - mu) * r);
      }
      const T mean_dg = sum_dg * inv_cols;
      const T mean_dg_xhat = sum_dg_xhat * inv_cols;
#pragma omp simd
      for (std::int64_t j = 0; j < cols; ++j) {
        const T dj = d[j];  // read before out[j] is written: dx may alias dy
        const T xhat = (in[j] - mu) * r;
        out[j] = r * (dj * gamma[j] - mean_dg - xhat * mean_dg_xhat);
        pg[j] += dj * xhat;
        pb[j] += dj;
      }
    }
  }
  for (std::int64_t chunk = 0; chunk < chunks; ++chunk) {
    const T* pg = partial.data() + 2 * chunk * cols;
    const T* pb = pg + cols;
#pragma omp simd
    for (std::int64_t j = 0; j < cols; ++j) {
      dgamma[j] += pg[j];
      dbeta[j] += pb[j];
    }
  }
}

template <typename T>
void masked_softmax_forward(MatrixView<T> scores, T scale, const std::int64_t* key_mask) {
  for (std::int64_t i = 0; i < scores.rows; ++i) {
    auto row = cpu::array(scores.row(i), scores.cols);
    row *= scale;
    if (key_mask != nullptr) {
      for (std::int64_t j = 0; j < scores.cols; ++j) {
        if (key_mask[j] == 0) row[j] += T(kMaskedLogit);
      }
    }
    const T max = row.maxCoeff();
    row = (row - max).exp();
    row *= T(1) / row.sum();
  }
}

template <typename T>
void softmax_backward(ConstMatrixView<T> probabilities, ConstMatrixView<T> dprobabilities, T scale,
                      MatrixView<T> dx) {
  require_same_shape(probabilities, dprobabilities, "softmax_backward");
  require_same_shape(probabilities, dx, "softmax_backward");
  for (std::int64_t i = 0; i < probabilities.rows; ++i) {
    auto p = cpu::array(probabilities.row(i), probabilities.cols);
    auto dp = cpu::array(dprobabilities.row(i), probabilities.cols);
    const T dot = (p * dp).sum();
    cpu::array(dx.row(i), dx.cols) = scale * p * (dp - dot);
  }
}

template <typename T>
T sum(const T* x, std::int64_t count) {
  return cpu::array(x, count).sum();
}

template <typename T>
T sum_of_squares(const T* x, std::int64_t count) {
  return cpu::array(x, count).square().sum();
}

template <typename T>
bool all_finite(const T* x, std::int64_t count) {
  return cpu::array(x, count).isFinite().all();
}

#define PF_INSTANTIATE(T)                                                                          \
  template void gelu_forward<T>(ConstMatrixView<T>, MatrixView<T>);                                \
  template void bias_gelu_forward<T>(MatrixView<T>, const T*, MatrixView<T>);                      \
  template void gelu_backward<T>(ConstMatrixView<T>, ConstMatrixView<T>, MatrixView<T>);           \
  template void bias_tanh_forward<T>(MatrixView<T>, const T*, MatrixView<T>);                      \
  template void tanh_backward<T>(ConstMatrixView<T>, ConstMatrixView<T>, MatrixView<T>);           \
  template void dropout_forward<T>(ConstMatrixView<T>, MatrixView<T>, float, std::uint64_t,        \
                                   std::uint64_t);                                                 \
  template void dropout_backward<T>(ConstMatrixView<T>, MatrixView<T>, float, std::uint64_t,       \
                                    std::uint64_t);                                                \
  template void dropout_add_forward<T>(ConstMatrixView<T>, ConstMatrixView<T>, MatrixView<T>,      \
                                       float, std::uint64_t);                                      \
  template void add<T>(ConstMatrixView<T>, ConstMatrixView<T>, MatrixView<T>);                     \
  template void accumulate<T>(ConstMatrixView<T>, MatrixView<T>);                                  \
  template void layernorm_forward<T>(ConstMatrixView<T>, const T*, const T*, T, MatrixView<T>, T*, \
                                     T*);                                                          \
  template void layernorm_backward<T>(ConstMatrixView<T>, ConstMatrixView<T>, const T*, const T*,  \
                                      const T*, MatrixView<T>, T*, T*);                            \
  template void masked_softmax_forward<T>(MatrixView<T>, T, const std::int64_t*);                  \
  template void softmax_backward<T>(ConstMatrixView<T>, ConstMatrixView<T>, T, MatrixView<T>);     \
  template T sum<T>(const T*, std::int64_t);                                                       \
  template T sum_of_squares<T>(const T*, std::int64_t);                                            \
  template bool all_finite<T>(const T*, std::int64_t);
PF_INSTANTIATE(float)
PF_INSTANTIATE(double)
#undef PF_INSTANTIATE

}  // namespace pf::kernels
