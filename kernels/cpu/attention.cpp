// Multi-head self-attention core as batched GEMMs over (sequence, head) pairs, parallel over the
// pairs; each pair's small GEMMs run single-threaded inside the parallel region.
#include <array>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/cpu/dropout_select.h"
#include "kernels/cpu/eigen_maps.h"
#include "kernels/ops.h"
#include "kernels/rng.h"

namespace pf::kernels {
namespace {

void check(const AttentionShape& shape, std::int64_t qkv_rows, std::int64_t qkv_cols,
           std::int64_t ctx_rows, std::int64_t ctx_cols, const char* op) {
  require(shape.batch > 0 && shape.seq > 0 && shape.heads > 0 && shape.head_dim > 0, op,
          "empty attention shape");
  require(qkv_rows == shape.tokens() && qkv_cols == 3 * shape.hidden(), op,
          "qkv must be [batch*seq, 3*hidden] = [" + std::to_string(shape.tokens()) + ", " +
              std::to_string(3 * shape.hidden()) + "], got [" + std::to_string(qkv_rows) + ", " +
              std::to_string(qkv_cols) + "]");
  require(ctx_rows == shape.tokens() && ctx_cols == shape.hidden(), op,
          "context must be [batch*seq, hidden]");
}

// The query, key and value columns of head h of sequence b in a [batch*seq, 3*hidden] matrix.
template <typename T>
std::array<MatrixView<T>, 3> head_qkv(MatrixView<T> qkv, const AttentionShape& shape,
                                      std::int64_t b, std::int64_t h) {
  const auto rows = qkv.block_rows(b * shape.seq, shape.seq);
  const std::int64_t hidden = shape.hidden();
  const std::int64_t d = shape.head_dim;
  return {rows.block_cols(h * d, d), rows.block_cols(hidden + h * d, d),
          rows.block_cols(2 * hidden + h * d, d)};
}

}  // namespace

std::int64_t attention_probs_size(const AttentionShape& shape) {
  return shape.batch * shape.heads * shape.seq * shape.seq;
}
std::int64_t attention_workspace_size(const AttentionShape& shape) {
  return attention_probs_size(shape);
}

template <typename T>
void attention_forward(const AttentionShape& shape, ConstMatrixView<T> qkv,
                       const std::int64_t* attention_mask, float dropout, std::uint64_t seed,
                       T* probs, T* workspace, MatrixView<T> ctx) {
  check(shape, qkv.rows, qkv.cols, ctx.rows, ctx.cols, "attention_forward");
  const std::int64_t seq = shape.seq;
  const std::int64_t head_dim = shape.head_dim;
  const T scale = T(1) / std::sqrt(static_cast<T>(head_dim));
  const std::int64_t pairs = shape.batch * shape.heads;
#pragma omp parallel for schedule(static)
  for (std::int64_t pair = 0; pair < pairs; ++pair) {
    const std::int64_t b = pair / shape.heads;
    const std::int64_t h = pair % shape.heads;
    const auto [q, k, v] = head_qkv(qkv, shape, b, h);
    MatrixView<T> p(probs + pair * seq * seq, seq, seq);
    gemm<T>(q, Transpose::kNo, k, Transpose::kYes, p);
    masked_softmax_forward<T>(p, scale,
                              attention_mask == nullptr ? nullptr : attention_mask + b * seq);
    auto out = ctx.block_rows(b * seq, seq).block_cols(h * head_dim, head_dim);
    if (dropout > 0.0F) {
      MatrixView<T> dropped(workspace + pair * seq * seq, seq, seq);
      dropout_forward<T>(p, dropped, dropout, seed, static_cast<std::uint64_t>(pair * seq * seq));
      gemm<T>(dropped, Transpose::kNo, v, Transpose::kNo, out);
    } else {
      gemm<T>(p, Transpose::kNo, v, Transpose::kNo, out);
    }
  }
}

template <typename T>
void attention_backward(const AttentionShape& shape, ConstMatrixView<T> qkv, const T* probs,
                        ConstMatrixView<T> dctx, float dropout, std::uint64_t seed, T* workspace,
                        MatrixView<T> dqkv) {
  check(shape, qkv.rows, qkv.cols, dctx.rows, dctx.cols, "attention_backward");
  check(shape, dqkv.rows, dqkv.cols, dctx.rows, dctx.cols, "attention_backward");
  require(dropout >= 0.0F && dropout < 1.0F, "attention_backward",
          "dropout must lie in [0, 1), got " + std::to_string(dropout));
  const std::int64_t seq = shape.seq;
  const std::int64_t head_dim = shape.head_dim;
  const std::int64_t square = seq * seq;
  const T scale = T(1) / std::sqrt(static_cast<T>(head_dim));
  const std::int64_t pairs = shape.batch * shape.heads;
  const std::uint32_t threshold = dropout > 0.0F ? dropout_threshold(dropout) : 0U;
  const T keep_scale = T(1) / (T(1) - static_cast<T>(dropout));
  const std::uint64_t key = stream_key(seed);
#pragma omp parallel
  {
    // The pair's dropout bits, drawn once and applied twice (to the probabilities for dV and to
    // dP): the same values as two calls of dropout_forward, half the hashing.
    std::vector<std::uint32_t> bits(dropout > 0.0F ? static_cast<std::size_t>(square) : 0);
#pragma omp for schedule(static)
    for (std::int64_t pair = 0; pair < pairs; ++pair) {
      const std::int64_t b = pair / shape.heads;
      const std::int64_t h = pair % shape.heads;
      const auto [q, k, v] = head_qkv(qkv, shape, b, h);
      const auto [dq, dk, dv] = head_qkv(dqkv, shape, b, h);
      auto dout = dctx.block_rows(b * seq, seq).block_cols(h * head_dim, head_dim);
      const T* p_data = probs + pair * square;
      ConstMatrixView<T> p(p_data, seq, seq);
      T* w_data = workspace + pair * square;
      MatrixView<T> w(w_data, seq, seq);
      if (dropout > 0.0F) {
        std::uint32_t* draw = bits.data();
        const auto offset = static_cast<std::uint64_t>(pair * square);
#pragma omp simd
        for (std::int64_t i = 0; i < square; ++i) {
          draw[i] = bits_for_key(key, offset + static_cast<std::uint64_t>(i));
        }
#pragma omp simd
        for (std::int64_t i = 0; i < square; ++i) {
          w_data[i] = cpu::keep_or_zero(p_data[i] * keep_scale, draw[i] >= threshold);
        }
        gemm<T>(w, Transpose::kYes, dout, Transpose::kNo, dv);
        gemm<T>(dout, Transpose::kNo, v, Transpose::kYes, w);
#pragma omp simd
        for (std::int64_t i = 0; i < square; ++i) {
          w_data[i] = cpu::keep_or_zero(w_data[i] * keep_scale, draw[i] >= threshold);
        }
      } else {
        gemm<T>(p, Transpose::kYes, dout, Transpose::kNo, dv);
        gemm<T>(dout, Transpose::kNo, v, Transpose::kYes, w);
      }
      softmax_backward<T>(p, w, scale, w);
      gemm<T>(w, Transpose::kNo, k, Transpose::kNo, dq);
      gemm<T>(w, Transpose::kYes, q, Transpose::kNo, dk);
    }
  }
}

#define PF_INSTANTIATE(T)                                                                  \
  template void attention_forward<T>(const AttentionShape&, ConstMatrixView<T>,            \
                                     const std::int64_t*, float, std::uint64_t, T*, T*,    \
                                     MatrixView<T>);                                       \
  template void attention_backward<T>(const AttentionShape&, ConstMatrixView<T>, const T*, \
                                      ConstMatrixView<T>, float, std::uint64_t, T*,        \
                                      MatrixView<T>);
PF_INSTANTIATE(float)
PF_INSTANTIATE(double)
#undef PF_INSTANTIATE

}  // namespace pf::kernels
