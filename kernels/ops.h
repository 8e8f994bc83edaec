#pragma once
// The operations BERT needs, forward and backward. One interface for every backend; this
// declares the CPU implementation (Eigen, OpenMP), instantiated for float (the model) and double
// (the finite-difference references of the tests). Shapes are checked and a mismatch throws
// std::invalid_argument naming the op. Gradients of parameters are accumulated (+=) so that
// micro-batches add up; gradients of activations are overwritten unless stated otherwise.
#include <cstdint>

#include "kernels/matrix_view.h"

namespace pf::kernels {

enum class Transpose : std::uint8_t { kNo, kYes };

// c = alpha * op(a) * op(b) + beta * c   (beta == 0: c is overwritten, NaNs in it ignored).
template <typename T>
void gemm(ConstMatrixView<T> a, Transpose transpose_a, ConstMatrixView<T> b, Transpose transpose_b,
          MatrixView<T> c, T alpha = T(1), T beta = T(0));

// count independent products c_i = alpha op(a_i) op(b_i) + beta c_i, the i-th matrices starting
// stride_* elements after the (i-1)-th. Runs the products in parallel.
template <typename T>
void batched_gemm(std::int64_t count, ConstMatrixView<T> a, std::int64_t stride_a,
                  Transpose transpose_a, ConstMatrixView<T> b, std::int64_t stride_b,
                  Transpose transpose_b, MatrixView<T> c, std::int64_t stride_c, T alpha = T(1),
                  T beta = T(0));

// Linear layer y = x W^T + b with W stored [out, in] (PyTorch / Hugging Face layout).
// bias may be null.
template <typename T>
void linear_forward(ConstMatrixView<T> x, ConstMatrixView<T> weight, const T* bias,
                    MatrixView<T> y);
// dx = dy W (overwritten; skipped when dx.data is null), dW += dy^T x, db += sum_rows dy
// (skipped when null).
template <typename T>
void linear_backward(ConstMatrixView<T> x, ConstMatrixView<T> weight, ConstMatrixView<T> dy,
                     MatrixView<T> dx, MatrixView<T> dweight, T* dbias);

// y += bias (per column); db += column sums of dy.
template <typename T>
void bias_add(MatrixView<T> y, const T* bias);
template <typename T>
void bias_backward(ConstMatrixView<T> dy, T* dbias);

// GELU, erf form: gelu(x) = x/2 (1 + erf(x / sqrt 2)).
template <typename T>
void gelu_forward(ConstMatrixView<T> x, MatrixView<T> y);
// Fused: x += bias in place (x keeps the pre-activation for the backward), y = gelu(x).
template <typename T>
void bias_gelu_forward(MatrixView<T> x, const T* bias, MatrixView<T> y);
template <typename T>
void gelu_backward(ConstMatrixView<T> x, ConstMatrixView<T> dy, MatrixView<T> dx);

// Fused: x += bias in place, y = tanh(x). Backward from the output: dx = dy (1 - y^2).
template <typename T>
void bias_tanh_forward(MatrixView<T> x, const T* bias, MatrixView<T> y);
template <typename T>
void tanh_backward(ConstMatrixView<T> y, ConstMatrixView<T> dy, MatrixView<T> dx);

// Inverted dropout with the counter-based mask of rng.h: element (i, j) of the matrix has index
// index_offset + i * cols + j in the stream `seed`. probability 0 copies.
template <typename T>
void dropout_forward(ConstMatrixView<T> x, MatrixView<T> y, float probability, std::uint64_t seed,
                     std::uint64_t index_offset = 0);
template <typename T>
void dropout_backward(ConstMatrixView<T> dy, MatrixView<T> dx, float probability,
                      std::uint64_t seed, std::uint64_t index_offset = 0);
// Fused residual: y = dropout(x) + residual. (Its backward is dropout_backward for x, and the
// identity for the residual.)
template <typename T>
void dropout_add_forward(ConstMatrixView<T> x, ConstMatrixView<T> residual, MatrixView<T> y,
                         float probability, std::uint64_t seed);

// y = a + b, and accumulate: y += x.
template <typename T>
void add(ConstMatrixView<T> a, ConstMatrixView<T> b, MatrixView<T> y);
template <typename T>
void accumulate(ConstMatrixView<T> x, MatrixView<T> y);

// LayerNorm over each row: y = (x - mean) * rstd * gamma + beta, rstd = 1/sqrt(var + eps)
// (biased variance, as PyTorch). mean and rstd (one per row) are saved for the backward.
template <typename T>
void layernorm_forward(ConstMatrixView<T> x, const T* gamma, const T* beta, T eps, MatrixView<T> y,
                       T* mean, T* rstd);
// dx = rstd (dy gamma - mean(dy gamma) - xhat mean(dy gamma xhat)) (overwritten),
// dgamma += sum_rows dy xhat, dbeta += sum_rows dy.
template <typename T>
void layernorm_backward(ConstMatrixView<T> x, ConstMatrixView<T> dy, const T* gamma, const T* mean,
                        const T* rstd, MatrixView<T> dx, T* dgamma, T* dbeta);

// Row-wise softmax of scale * x + additive key mask, in place: rows of `scores` are queries of
// one (sequence, head); key_mask (length cols, 1 keep / 0 padding) adds kMaskedLogit to padded
// keys, as BERT does (-10000: exp underflows to exactly 0 in fp32, so padded keys get weight 0).
inline constexpr double kMaskedLogit = -10000.0;
template <typename T>
void masked_softmax_forward(MatrixView<T> scores, T scale, const std::int64_t* key_mask);
// Gradient with respect to the pre-softmax input (scaled by `scale` to give d(x)):
// dx = scale * p (dp - sum_j dp_j p_j). dx may alias dp.
template <typename T>
void softmax_backward(ConstMatrixView<T> probabilities, ConstMatrixView<T> dprobabilities, T scale,
                      MatrixView<T> dx);

// Multi-head self-attention core on the fused projection qkv [B*S, 3H] (columns: query, key,
// value; head h uses columns h*D .. h*D+D-1 of each): probs = softmax(Q K^T / sqrt(D) + mask)
// is saved [B, N, S, S], ctx [B*S, H] = dropout(probs) V. Batched GEMMs over (sequence, head).
// workspace: attention_workspace_size elements (used when dropout is on).
struct AttentionShape {
  std::int64_t batch = 0, seq = 0, heads = 0, head_dim = 0;
  std::int64_t hidden() const { return heads * head_dim; }
  std::int64_t tokens() const { return batch * seq; }
};
std::int64_t attention_probs_size(const AttentionShape& shape);
std::int64_t attention_workspace_size(const AttentionShape& shape);
template <typename T>
void attention_forward(const AttentionShape& shape, ConstMatrixView<T> qkv,
                       const std::int64_t* attention_mask, float dropout, std::uint64_t seed,
                       T* probs, T* workspace, MatrixView<T> ctx);
// dqkv (overwritten) from dctx. Needs the forward's probs (left unchanged) and workspace.
template <typename T>
void attention_backward(const AttentionShape& shape, ConstMatrixView<T> qkv, const T* probs,
                        ConstMatrixView<T> dctx, float dropout, std::uint64_t seed, T* workspace,
                        MatrixView<T> dqkv);

// Embedding gather: out[r] = table[ids[r]]; the ids are checked against table.rows and an
// out-of-range id throws naming `what` and the row. Backward scatter-adds rows into dtable,
// except rows whose id equals skip_id (PyTorch's padding_idx; -1: none).
template <typename T>
void embedding_forward(ConstMatrixView<T> table, const std::int64_t* ids, MatrixView<T> out,
                       const char* what, bool accumulate_output = false);
template <typename T>
void embedding_backward(ConstMatrixView<T> dout, const std::int64_t* ids, MatrixView<T> dtable,
                        std::int64_t skip_id = -1);

// Rows out[r] = in[index[r]] and the reverse scatter-add (positions of masked tokens).
template <typename T>
void gather_rows(ConstMatrixView<T> in, const std::int64_t* index, MatrixView<T> out);
template <typename T>
void scatter_add_rows(ConstMatrixView<T> dout, const std::int64_t* index, MatrixView<T> din);

// Softmax cross-entropy of each row of logits against labels, weighted: returns
// sum_r w_r CE_r / sum_r w_r (0 when all weights are 0), w = 1 when weights is null.
// On return logits holds the softmax probabilities (needed by the backward).
template <typename T>
T cross_entropy_forward(MatrixView<T> logits, const std::int64_t* labels, const T* weights,
                        const char* what);
// probs -> d loss / d logits, scaled by `scale` (e.g. 1 / micro-batches), in place.
template <typename T>
void cross_entropy_backward(MatrixView<T> probs, const std::int64_t* labels, const T* weights,
                            T scale);

// Reductions.
template <typename T>
T sum(const T* x, std::int64_t count);
template <typename T>
T sum_of_squares(const T* x, std::int64_t count);
template <typename T>
bool all_finite(const T* x, std::int64_t count);

}  // namespace pf::kernels
