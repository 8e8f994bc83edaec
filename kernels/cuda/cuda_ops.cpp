#include "kernels/cuda/cuda_ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "kernels/cuda/cublas_gemm.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops_cuda.h"

namespace pf::kernels::cuda {
namespace {

template <typename A, typename B>
void require_same_shape(const A& a, const B& b, const char* op) {
  require(a.rows == b.rows && a.cols == b.cols, op,
          "shape mismatch " + std::to_string(a.rows) + "x" + std::to_string(a.cols) + " vs " +
              std::to_string(b.rows) + "x" + std::to_string(b.cols));
}

void check_attention(const AttentionShape& shape, std::int64_t qkv_rows, std::int64_t qkv_cols,
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

// The products' shape check, made before bf16 copies are issued (the product checks again).
void require_product_shapes(ConstMatrixView<float> a, Transpose transpose_a,
                            ConstMatrixView<float> b, Transpose transpose_b, MatrixView<float> c,
                            const char* op) {
  const bool ta = transpose_a == Transpose::kYes;
  const bool tb = transpose_b == Transpose::kYes;
  const std::int64_t k = ta ? a.rows : a.cols;
  require(k == (tb ? b.cols : b.rows) && c.rows == (ta ? a.cols : a.rows) &&
              c.cols == (tb ? b.rows : b.cols),
          op, "op(a), op(b) and c disagree");
}

// An operand's bf16 copy: its matrices packed (leading dimension cols) one after another, or one
// matrix when the operand's batch stride is 0 (every product shares it).
struct Bf16Operand {
  MatrixView<__nv_bfloat16> view;
  std::int64_t stride = 0;
};

// `count` matrices of `matrix`, `stride` elements apart, rounded to bf16 in `scratch`, on
// `stream`.
Bf16Operand to_bf16(RetainingScratch& scratch, ConstMatrixView<float> matrix, std::int64_t count,
                    std::int64_t stride, cudaStream_t stream) {
  require(stride >= 0, "cuda::bf16 operands", "negative batch stride");
  // cuBLAS wants a leading dimension >= 1 even for an empty matrix.
  const std::int64_t ld = std::max<std::int64_t>(matrix.cols, 1);
  const std::int64_t copies = stride == 0 ? std::min<std::int64_t>(count, 1) : count;
  const std::int64_t packed_stride = stride == 0 ? 0 : matrix.rows * ld;
  const auto elements = static_cast<std::size_t>(copies * matrix.rows * ld);
  auto* data = static_cast<__nv_bfloat16*>(scratch.ensure(elements * sizeof(__nv_bfloat16)));
  convert_to_bf16(matrix, stride, copies, {data, matrix.rows, matrix.cols, ld}, packed_stride,
                  stream);
  return {{data, matrix.rows, matrix.cols, ld}, packed_stride};
}

constexpr std::size_t kFlagsBytes = 64;
constexpr std::size_t kBadRowOffset = 0;
constexpr std::size_t kNonFiniteOffset = 8;
constexpr std::size_t kResultOffset = 16;

}  // namespace

DeviceScratch::~DeviceScratch() {
  if (data_ != nullptr) {
    cudaStreamSynchronize(stream_);
    backend_->deallocate(data_, bytes_);
  }
}

void* DeviceScratch::ensure(std::size_t bytes) {
  if (bytes <= bytes_ && data_ != nullptr) return data_;
  if (data_ != nullptr) {
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    backend_->deallocate(data_, bytes_);
    data_ = nullptr;
  }
  const std::size_t grown = bytes < 2 * bytes_ ? 2 * bytes_ : bytes;
  data_ = backend_->allocate(grown);
  bytes_ = grown;
  return data_;
}

RetainingScratch::~RetainingScratch() {
  if (blocks_.empty()) return;
  cudaStreamSynchronize(stream_);  // a destructor does not throw: the frees below still run
  for (const Block& block : blocks_) backend_->deallocate(block.data, block.bytes);
}

void* RetainingScratch::ensure(std::size_t bytes) {
  if (!blocks_.empty() && bytes <= blocks_.back().bytes) return blocks_.back().data;
  const std::size_t live = blocks_.empty() ? 0 : blocks_.back().bytes;
  const std::size_t grown = std::max({bytes, 2 * live, std::size_t{256}});
  blocks_.reserve(blocks_.size() + 1);  // a throw from here leaves blocks_ as it was
  blocks_.push_back({backend_->allocate(grown), grown});
  return blocks_.back().data;
}

CudaOps::CudaOps(CudaBackend& backend, tensor::Stream* stream, GemmPrecision precision,
                 AttentionAlgorithm attention)
    : backend_(&backend),
      stream_(stream_of(stream)),
      precision_(precision),
      attention_(attention),
      flags_(backend, stream_),
      pointers_(backend, stream_),
      partials_(backend, stream_),
      reduce_partials_(backend, stream_),
      scatter_(backend, stream_),
      bf16_left_(backend, stream_),
      bf16_right_(backend, stream_),
      bf16_scores_(backend, stream_) {
  cublas_.set_stream(stream_);
  flags_.ensure(kFlagsBytes);
}

CudaOps::~CudaOps() = default;

void CudaOps::synchronize() {
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

// --- products

void CudaOps::gemm(ConstMatrixView<float> a, Transpose transpose_a, ConstMatrixView<float> b,
                   Transpose transpose_b, MatrixView<float> c, float alpha, float beta) {
  if (precision_ == GemmPrecision::kBf16Operands) {
    require_product_shapes(a, transpose_a, b, transpose_b, c, "cuda::gemm");
    if (c.rows == 0 || c.cols == 0) return;
    const Bf16Operand a16 = to_bf16(bf16_left_, a, 1, 0, stream_);
    const Bf16Operand b16 = to_bf16(bf16_right_, b, 1, 0, stream_);
    gemm_bf16_operands(cublas_, a16.view, transpose_a, b16.view, transpose_b, c, alpha, beta);
    return;
  }
  cuda::gemm(cublas_, a, transpose_a, b, transpose_b, c, alpha, beta, precision_);
}

void CudaOps::batched_gemm(std::int64_t count, ConstMatrixView<float> a, std::int64_t stride_a,
                           Transpose transpose_a, ConstMatrixView<float> b, std::int64_t stride_b,
                           Transpose transpose_b, MatrixView<float> c, std::int64_t stride_c,
                           float alpha, float beta) {
  if (precision_ == GemmPrecision::kBf16Operands) {
    require(count >= 0, "cuda::batched_gemm", "negative batch count");
    require_product_shapes(a, transpose_a, b, transpose_b, c, "cuda::batched_gemm");
    if (c.rows == 0 || c.cols == 0 || count == 0) return;
    const Bf16Operand a16 = to_bf16(bf16_left_, a, count, stride_a, stream_);
    const Bf16Operand b16 = to_bf16(bf16_right_, b, count, stride_b, stream_);
    gemm_strided_batched_bf16_operands(cublas_, count, a16.view, a16.stride, transpose_a, b16.view,
                                       b16.stride, transpose_b, c, stride_c, alpha, beta);
    return;
  }
  gemm_strided_batched(cublas_, count, a, stride_a, transpose_a, b, stride_b, transpose_b, c,
                       stride_c, alpha, beta, precision_);
}

void CudaOps::linear_forward(ConstMatrixView<float> x, ConstMatrixView<float> weight,
                             const float* bias, MatrixView<float> y) {
  require(x.cols == weight.cols && y.rows == x.rows && y.cols == weight.rows,
          "cuda::linear_forward", "x, weight and y disagree");
  gemm(x, Transpose::kNo, weight, Transpose::kYes, y, 1.0F, 0.0F);
  if (bias != nullptr) cuda::bias_add(y, bias, stream_);
}

void CudaOps::linear_backward(ConstMatrixView<float> x, ConstMatrixView<float> weight,
                              ConstMatrixView<float> dy, MatrixView<float> dx,
                              MatrixView<float> dweight, float* dbias) {
  require(dy.rows == x.rows && dy.cols == weight.rows && dweight.rows == weight.rows &&
              dweight.cols == weight.cols,
          "cuda::linear_backward", "x, weight, dy and dweight disagree");
  if (dx.data != nullptr) gemm(dy, Transpose::kNo, weight, Transpose::kNo, dx, 1.0F, 0.0F);
  gemm(dy, Transpose::kYes, x, Transpose::kNo, dweight, 1.0F, 1.0F);
  if (dbias != nullptr) bias_backward(dy, dbias);
}

void CudaOps::bias_add(MatrixView<float> y, const float* bias) {
  cuda::bias_add(y, bias, stream_);
}

void CudaOps::bias_backward(ConstMatrixView<float> dy, float* dbias) {
  auto* partials = static_cast<float*>(partials_.ensure(
      2 * sizeof(float) * static_cast<std::size_t>(column_sums_partials(dy.rows, dy.cols))));
  column_sums(dy, nullptr, 0, nullptr, nullptr, dbias, nullptr, partials, stream_);
}

// --- elementwise

void CudaOps::gelu_forward(ConstMatrixView<float> x, MatrixView<float> y) {
  require_same_shape(x, y, "cuda::gelu_forward");
  cuda::gelu_forward(x, y, stream_);
}

void CudaOps::bias_gelu_forward(MatrixView<float> x, const float* bias, MatrixView<float> y) {
  require_same_shape(x, y, "cuda::bias_gelu_forward");
  cuda::bias_gelu_forward(x, bias, y, stream_);
}

void CudaOps::gelu_backward(ConstMatrixView<float> x, ConstMatrixView<float> dy,
                            MatrixView<float> dx) {
  require_same_shape(x, dy, "cuda::gelu_backward");
  require_same_shape(x, dx, "cuda::gelu_backward");
  cuda::gelu_backward(x, dy, dx, stream_);
}

void CudaOps::bias_tanh_forward(MatrixView<float> x, const float* bias, MatrixView<float> y) {
  require_same_shape(x, y, "cuda::bias_tanh_forward");
  cuda::bias_tanh_forward(x, bias, y, stream_);
}

void CudaOps::tanh_backward(ConstMatrixView<float> y, ConstMatrixView<float> dy,
                            MatrixView<float> dx) {
  require_same_shape(y, dy, "cuda::tanh_backward");
  require_same_shape(y, dx, "cuda::tanh_backward");
  cuda::tanh_backward(y, dy, dx, stream_);
}

void CudaOps::dropout_forward(ConstMatrixView<float> x, MatrixView<float> y, float probability,
                              std::uint64_t seed, std::uint64_t index_offset) {
  require_same_shape(x, y, "cuda::dropout_forward");
  require(probability >= 0.0F && probability < 1.0F, "cuda::dropout_forward",
          "probability must lie in [0, 1), got " + std::to_string(probability));
  if (probability == 0.0F && x.data == y.data) return;
  cuda::dropout_forward(x, {}, y, probability, seed, index_offset, stream_);
}

void CudaOps::dropout_backward(ConstMatrixView<float> dy, MatrixView<float> dx, float probability,
                               std::uint64_t seed, std::uint64_t index_offset) {
  dropout_forward(dy, dx, probability, seed, index_offset);
}

void CudaOps::dropout_add_forward(ConstMatrixView<float> x, ConstMatrixView<float> residual,
                                  MatrixView<float> y, float probability, std::uint64_t seed) {
  require_same_shape(x, residual, "cuda::dropout_add_forward");
  require_same_shape(x, y, "cuda::dropout_add_forward");
  require(probability >= 0.0F && probability < 1.0F, "cuda::dropout_add_forward",
          "probability must lie in [0, 1), got " + std::to_string(probability));
  cuda::dropout_forward(x, residual, y, probability, seed, 0, stream_);
}

void CudaOps::add(ConstMatrixView<float> a, ConstMatrixView<float> b, MatrixView<float> y) {
  require_same_shape(a, b, "cuda::add");
  require_same_shape(a, y, "cuda::add");
  cuda::add(a, b, y, stream_);
}

void CudaOps::accumulate(ConstMatrixView<float> x, MatrixView<float> y) {
  require_same_shape(x, y, "cuda::accumulate");
  cuda::add(x, y, y, stream_);
}

// --- rows

void CudaOps::layernorm_forward(ConstMatrixView<float> x, const float* gamma, const float* beta,
                                float eps, MatrixView<float> y, float* mean, float* rstd) {
  require_same_shape(x, y, "cuda::layernorm_forward");
  require(x.cols > 0, "cuda::layernorm_forward", "rows must not be empty");
  cuda::layernorm_forward(x, gamma, beta, eps, y, mean, rstd, stream_);
}

void CudaOps::layernorm_backward(ConstMatrixView<float> x, ConstMatrixView<float> dy,
                                 const float* gamma, const float* mean, const float* rstd,
                                 MatrixView<float> dx, float* dgamma, float* dbeta) {
  require_same_shape(x, dy, "cuda::layernorm_backward");
  require_same_shape(x, dx, "cuda::layernorm_backward");
  // The parameter sums read x and dy before dx is written (dx may alias dy).
  auto* partials = static_cast<float*>(partials_.ensure(
      2 * sizeof(float) * static_cast<std::size_t>(column_sums_partials(x.rows, x.cols))));
  column_sums(dy, x.data, x.ld, mean, rstd, dbeta, dgamma, partials, stream_);
  layernorm_backward_input(x, dy, gamma, mean, rstd, dx, stream_);
}

void CudaOps::masked_softmax_forward(MatrixView<float> scores, float scale,
                                     const std::int64_t* key_mask) {
  cuda::masked_softmax_forward(scores, scale, key_mask, scores.rows, 0.0F, 0, nullptr, stream_);
}

void CudaOps::softmax_backward(ConstMatrixView<float> probabilities,
                               ConstMatrixView<float> dprobabilities, float scale,
                               MatrixView<float> dx) {
  require_same_shape(probabilities, dprobabilities, "cuda::softmax_backward");
  require_same_shape(probabilities, dx, "cuda::softmax_backward");
  cuda::softmax_backward(probabilities, dprobabilities, scale, 0.0F, 0, dx, stream_);
}

// --- attention: the algorithm's choice, then the batched products over (sequence, head) pairs
// through pointer arrays (the heads' columns of the fused QKV are not a constant stride apart),
// the softmax with the mask and the dropout fused. The fused kernels are flash_attention.cu's.

std::int64_t CudaOps::attention_saved_size(const AttentionShape& shape) const {
  return attention_ == AttentionAlgorithm::kFused ? fused_attention_saved_size(shape)
                                                  : kernels::attention_probs_size(shape);
}

std::int64_t CudaOps::attention_workspace_size(const AttentionShape& shape) const {
  return attention_ == AttentionAlgorithm::kFused ? fused_attention_workspace_size(shape)
                                                  : kernels::attention_probs_size(shape);
}

void CudaOps::attention_forward(const AttentionShape& shape, ConstMatrixView<float> qkv,
                                const std::int64_t* attention_mask, float dropout,
                                std::uint64_t seed, float* saved, float* workspace,
                                MatrixView<float> ctx) {
  check_attention(shape, qkv.rows, qkv.cols, ctx.rows, ctx.cols, "cuda::attention_forward");
  require(dropout >= 0.0F && dropout < 1.0F, "cuda::attention_forward",
          "dropout must lie in [0, 1)");
  if (attention_ == AttentionAlgorithm::kFused) {
    // TF32 tensor cores under every precision but fp32 (bf16's products would round further).
    fused_attention_forward(shape, qkv, attention_mask, dropout, seed,
                            precision_ != GemmPrecision::kFp32, saved, ctx, stream_);
    return;
  }
  batched_attention_forward(shape, qkv, attention_mask, dropout, seed, saved, workspace, ctx);
}

void CudaOps::attention_backward(const AttentionShape& shape, ConstMatrixView<float> qkv,
                                 const std::int64_t* attention_mask, ConstMatrixView<float> ctx,
                                 const float* saved, ConstMatrixView<float> dctx, float dropout,
                                 std::uint64_t seed, float* workspace, MatrixView<float> dqkv) {
  check_attention(shape, qkv.rows, qkv.cols, dctx.rows, dctx.cols, "cuda::attention_backward");
  check_attention(shape, dqkv.rows, dqkv.cols, dctx.rows, dctx.cols, "cuda::attention_backward");
  require(dropout >= 0.0F && dropout < 1.0F, "cuda::attention_backward",
          "dropout must lie in [0, 1)");
  if (attention_ == AttentionAlgorithm::kFused) {
    check_attention(shape, qkv.rows, qkv.cols, ctx.rows, ctx.cols, "cuda::attention_backward");
    require(ctx.data != nullptr, "cuda::attention_backward",
            "the fused backward needs the forward's context");
    fused_attention_backward(shape, qkv, attention_mask, ctx, saved, dctx, dropout, seed,
                             precision_ != GemmPrecision::kFp32, workspace, dqkv, stream_);
    return;
  }
  batched_attention_backward(shape, qkv, saved, dctx, dropout, seed, workspace, dqkv);
}

void CudaOps::batched_attention_forward(const AttentionShape& shape, ConstMatrixView<float> qkv,
                                        const std::int64_t* attention_mask, float dropout,
                                        std::uint64_t seed, float* probs, float* workspace,
                                        MatrixView<float> ctx) {
  const std::int64_t seq = shape.seq;
  const std::int64_t d = shape.head_dim;
  const std::int64_t pairs = shape.batch * shape.heads;
  const bool bf16_operands = precision_ == GemmPrecision::kBf16Operands;
  // Five fp32 arrays (a sixth slot unused), then, for bf16 operands, the copies' five.
  const std::size_t slots = bf16_operands ? 11 : 6;
  auto** arrays = static_cast<float**>(
      pointers_.ensure(slots * static_cast<std::size_t>(pairs) * sizeof(float*)));
  const AttentionPointers p{arrays, arrays + pairs, arrays + 2 * pairs, arrays + 3 * pairs,
                            arrays + 4 * pairs};
  fill_attention_pointers(const_cast<float*>(qkv.data), qkv.ld, ctx.data, ctx.ld, probs,
                          shape.batch, shape.heads, seq, d, p, stream_);
  const ConstMatrixView<float> head(nullptr, seq, d, qkv.ld);
  const MatrixView<float> scores(nullptr, seq, seq, seq);
  const float scale = 1.0F / std::sqrt(static_cast<float>(d));
  if (bf16_operands) {
    // QKV rounded once for both products; the probabilities after the softmax, into a copy
    // laid out as probs (scores16[p] = copy + p*seq*seq).
    auto** operand_arrays =
        static_cast<const __nv_bfloat16**>(static_cast<void*>(arrays + 6 * pairs));
    const AttentionOperandPointers p16{operand_arrays, operand_arrays + pairs,
                                       operand_arrays + 2 * pairs, operand_arrays + 3 * pairs,
                                       operand_arrays + 4 * pairs};
    const Bf16Operand qkv16 = to_bf16(bf16_left_, qkv, 1, 0, stream_);
    const std::int64_t probs_rows = pairs * seq;
    auto* scores16 = static_cast<__nv_bfloat16*>(
        bf16_scores_.ensure(static_cast<std::size_t>(probs_rows * seq) * sizeof(__nv_bfloat16)));
    fill_attention_pointers(qkv16.view.data, qkv16.view.ld, nullptr, 0, scores16, shape.batch,
                            shape.heads, seq, d, p16, stream_);
    const ConstMatrixView<__nv_bfloat16> head16(nullptr, seq, d, qkv16.view.ld);
    gemm_pointer_batched_bf16_operands(cublas_, pairs, head16, p16.q, Transpose::kNo, head16, p16.k,
                                       Transpose::kYes, scores, p.scores, 1.0F, 0.0F);
    cuda::masked_softmax_forward({probs, probs_rows, seq}, scale, attention_mask, shape.heads * seq,
                                 dropout, seed, workspace, stream_);
    // The product with V reads the dropped probabilities where there is dropout.
    convert_to_bf16({dropout > 0.0F ? workspace : probs, probs_rows, seq}, 0, 1,
                    {scores16, probs_rows, seq}, 0, stream_);
    gemm_pointer_batched_bf16_operands(
        cublas_, pairs, ConstMatrixView<__nv_bfloat16>(nullptr, seq, seq, seq), p16.scores,
        Transpose::kNo, head16, p16.v, Transpose::kNo, MatrixView<float>(nullptr, seq, d, ctx.ld),
        p.ctx, 1.0F, 0.0F);
    return;
  }
  // scores = Q K^T, then softmax(scores / sqrt(D) + mask) in place (dropped copy in workspace).
  gemm_pointer_batched(cublas_, pairs, head, p.q, Transpose::kNo, head, p.k, Transpose::kYes,
                       scores, p.scores, 1.0F, 0.0F, precision_);
  cuda::masked_softmax_forward({probs, pairs * seq, seq}, scale, attention_mask, shape.heads * seq,
                               dropout, seed, workspace, stream_);
  if (dropout > 0.0F) {
    // The product with V reads the dropped probabilities: point the score array at them.
    fill_attention_pointers(const_cast<float*>(qkv.data), qkv.ld, ctx.data, ctx.ld, workspace,
                            shape.batch, shape.heads, seq, d, p, stream_);
  }
  gemm_pointer_batched(cublas_, pairs, ConstMatrixView<float>(nullptr, seq, seq, seq), p.scores,
                       Transpose::kNo, head, p.v, Transpose::kNo,
                       MatrixView<float>(nullptr, seq, d, ctx.ld), p.ctx, 1.0F, 0.0F, precision_);
}

void CudaOps::batched_attention_backward(const AttentionShape& shape, ConstMatrixView<float> qkv,
                                         const float* probs, ConstMatrixView<float> dctx,
                                         float dropout, std::uint64_t seed, float* workspace,
                                         MatrixView<float> dqkv) {
  const std::int64_t seq = shape.seq;
  const std::int64_t d = shape.head_dim;
  const std::int64_t pairs = shape.batch * shape.heads;
  const bool bf16_operands = precision_ == GemmPrecision::kBf16Operands;
  // Ten fp32 arrays, then, for bf16 operands, the copies' five.
  const std::size_t slots = bf16_operands ? 15 : 10;
  auto** arrays = static_cast<float**>(
      pointers_.ensure(slots * static_cast<std::size_t>(pairs) * sizeof(float*)));
  // Forward operands (q, k, v, dctx as "ctx", probs) and gradient targets (dq, dk, dv, -, work).
  const AttentionPointers in{arrays, arrays + pairs, arrays + 2 * pairs, arrays + 3 * pairs,
                             arrays + 4 * pairs};
  const AttentionPointers out{arrays + 5 * pairs, arrays + 6 * pairs, arrays + 7 * pairs,
                              arrays + 8 * pairs, arrays + 9 * pairs};
  const MatrixView<float> all_probs(const_cast<float*>(probs), pairs * seq, seq);
  const MatrixView<float> work(workspace, pairs * seq, seq);
  // in.scores: the weights that multiplied V in the forward (dropped probs, or probs).
  if (dropout > 0.0F) cuda::dropout_forward(all_probs, {}, work, dropout, seed, 0, stream_);
  fill_attention_pointers(dqkv.data, dqkv.ld, dqkv.data, 0, workspace, shape.batch, shape.heads,
                          seq, d, out, stream_);
  const MatrixView<float> dhead(nullptr, seq, d, dqkv.ld);
  const MatrixView<float> square(nullptr, seq, seq, seq);
  const float scale = 1.0F / std::sqrt(static_cast<float>(d));
  if (bf16_operands) {
    // QKV and dctx rounded once for all four products; the weights, then the score gradient,
    // into one copy laid out as probs (the stream orders the second conversion after dV).
    auto** operand_arrays =
        static_cast<const __nv_bfloat16**>(static_cast<void*>(arrays + 10 * pairs));
    const AttentionOperandPointers in16{operand_arrays, operand_arrays + pairs,
                                        operand_arrays + 2 * pairs, operand_arrays + 3 * pairs,
                                        operand_arrays + 4 * pairs};
    const Bf16Operand qkv16 = to_bf16(bf16_left_, qkv, 1, 0, stream_);
    const Bf16Operand dctx16 = to_bf16(bf16_right_, dctx, 1, 0, stream_);
    const Bf16Operand square16 =
        to_bf16(bf16_scores_, dropout > 0.0F ? work : all_probs, 1, 0, stream_);
    fill_attention_pointers(qkv16.view.data, qkv16.view.ld, dctx16.view.data, dctx16.view.ld,
                            square16.view.data, shape.batch, shape.heads, seq, d, in16, stream_);
    const ConstMatrixView<__nv_bfloat16> head16(nullptr, seq, d, qkv16.view.ld);
    const ConstMatrixView<__nv_bfloat16> dctx_head16(nullptr, seq, d, dctx16.view.ld);
    const ConstMatrixView<__nv_bfloat16> square_shape16(nullptr, seq, seq, seq);
    // dV = weights^T dctx
    gemm_pointer_batched_bf16_operands(cublas_, pairs, square_shape16, in16.scores, Transpose::kYes,
                                       dctx_head16, in16.ctx, Transpose::kNo, dhead, out.v, 1.0F,
                                       0.0F);
    // work = dctx V^T, then softmax'(dropout'(work)) in fp32
    gemm_pointer_batched_bf16_operands(cublas_, pairs, dctx_head16, in16.ctx, Transpose::kNo,
                                       head16, in16.v, Transpose::kYes, square, out.scores, 1.0F,
                                       0.0F);
    cuda::softmax_backward(all_probs, work, scale, dropout, seed, work, stream_);
    convert_to_bf16(work, 0, 1, square16.view, 0, stream_);
    // dQ = dS K, dK = dS^T Q
    gemm_pointer_batched_bf16_operands(cublas_, pairs, square_shape16, in16.scores, Transpose::kNo,
                                       head16, in16.k, Transpose::kNo, dhead, out.q, 1.0F, 0.0F);
    gemm_pointer_batched_bf16_operands(cublas_, pairs, square_shape16, in16.scores, Transpose::kYes,
                                       head16, in16.q, Transpose::kNo, dhead, out.k, 1.0F, 0.0F);
    return;
  }
  fill_attention_pointers(const_cast<float*>(qkv.data), qkv.ld, const_cast<float*>(dctx.data),
                          dctx.ld, dropout > 0.0F ? workspace : const_cast<float*>(probs),
                          shape.batch, shape.heads, seq, d, in, stream_);
  const ConstMatrixView<float> head(nullptr, seq, d, qkv.ld);
  const ConstMatrixView<float> dctx_head(nullptr, seq, d, dctx.ld);
  const auto* dctx_array = in.ctx;
  const auto* weights_array = in.scores;
  // dV = weights^T dctx
  gemm_pointer_batched(cublas_, pairs, square, weights_array, Transpose::kYes, dctx_head,
                       dctx_array, Transpose::kNo, dhead, out.v, 1.0F, 0.0F, precision_);
  // work = dctx V^T (overwrites the dropped probabilities, no longer needed)
  gemm_pointer_batched(cublas_, pairs, dctx_head, dctx_array, Transpose::kNo, head, in.v,
                       Transpose::kYes, square, out.scores, 1.0F, 0.0F, precision_);
  // work = softmax'(dropout'(work))
  cuda::softmax_backward(all_probs, work, scale, dropout, seed, work, stream_);
  const auto* ds_array = out.scores;
  // dQ = dS K, dK = dS^T Q
  gemm_pointer_batched(cublas_, pairs, square, ds_array, Transpose::kNo, head, in.k, Transpose::kNo,
                       dhead, out.q, 1.0F, 0.0F, precision_);
  gemm_pointer_batched(cublas_, pairs, square, ds_array, Transpose::kYes, head, in.q,
                       Transpose::kNo, dhead, out.k, 1.0F, 0.0F, precision_);
}

// --- indexing

void CudaOps::reset_bad_row() {
  auto* base = static_cast<unsigned char*>(flags_.ensure(kFlagsBytes));
  CUDA_CHECK(cudaMemsetAsync(base + kBadRowOffset, 0xFF, sizeof(unsigned long long), stream_));
}

std::int64_t CudaOps::read_bad_row() {
  auto* base = static_cast<unsigned char*>(flags_.ensure(kFlagsBytes));
  unsigned long long bad = 0;
  CUDA_CHECK(
      cudaMemcpyAsync(&bad, base + kBadRowOffset, sizeof(bad), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return bad == std::numeric_limits<unsigned long long>::max() ? -1
                                                               : static_cast<std::int64_t>(bad);
}

void CudaOps::check_indices(const std::int64_t* ids, std::int64_t rows, std::int64_t limit,
                            const char* op, const char* what) {
  if (rows == 0) return;
  reset_bad_row();
  auto* base = static_cast<unsigned char*>(flags_.ensure(kFlagsBytes));
  cuda::check_indices(ids, rows, limit, reinterpret_cast<unsigned long long*>(base + kBadRowOffset),
                      stream_);
  const std::int64_t row = read_bad_row();
  if (row < 0) return;
  std::int64_t value = 0;
  CUDA_CHECK(cudaMemcpy(&value, ids + row, sizeof(value), cudaMemcpyDeviceToHost));
  throw std::invalid_argument(std::string(op) + ": " + what + " value " + std::to_string(value) +
                              " at row " + std::to_string(row) + " is outside [0, " +
                              std::to_string(limit) + ")");
}

void CudaOps::embedding_forward(ConstMatrixView<float> table, const std::int64_t* ids,
                                MatrixView<float> out, const char* what, bool accumulate_output) {
  require(table.cols == out.cols, "cuda::embedding_forward",
          "table width differs from output width");
  check_indices(ids, out.rows, table.rows, "embedding_forward", what);
  cuda::gather_rows(table, ids, out, accumulate_output, stream_);
}

void CudaOps::embedding_backward(ConstMatrixView<float> dout, const std::int64_t* ids,
                                 MatrixView<float> dtable, std::int64_t skip_id) {
  require(dtable.cols == dout.cols, "cuda::embedding_backward",
          "table width differs from grad width");
  check_indices(ids, dout.rows, dtable.rows, "embedding_backward", "id");
  const std::size_t bytes = cuda::scatter_add_rows_workspace(dout.rows, dtable.rows);
  cuda::scatter_add_rows(dout, ids, dtable, skip_id, scatter_.ensure(bytes), bytes, stream_);
}

void CudaOps::gather_rows(ConstMatrixView<float> in, const std::int64_t* index,
                          MatrixView<float> out) {
  embedding_forward(in, index, out, "row index", false);
}

void CudaOps::scatter_add_rows(ConstMatrixView<float> dout, const std::int64_t* index,
                               MatrixView<float> din) {
  embedding_backward(dout, index, din, -1);
}

float CudaOps::cross_entropy_forward(MatrixView<float> logits, const std::int64_t* labels,
                                     const float* weights, const char* what) {
  if (logits.rows == 0) return 0.0F;
  auto* base = static_cast<unsigned char*>(flags_.ensure(kFlagsBytes));
  auto* loss_rows =
      static_cast<float*>(partials_.ensure(static_cast<std::size_t>(logits.rows) * sizeof(float)));
  reset_bad_row();
  cross_entropy_rows(logits, labels, weights, loss_rows,
                     reinterpret_cast<unsigned long long*>(base + kBadRowOffset), stream_);
  auto* result = reinterpret_cast<double*>(base + kResultOffset);
  cross_entropy_total(loss_rows, weights, logits.rows, result, stream_);
  double host[2] = {0.0, 0.0};
  CUDA_CHECK(cudaMemcpyAsync(host, result, sizeof(host), cudaMemcpyDeviceToHost, stream_));
  const std::int64_t row = read_bad_row();  // synchronizes
  if (row >= 0) {
    std::int64_t value = 0;
    CUDA_CHECK(cudaMemcpy(&value, labels + row, sizeof(value), cudaMemcpyDeviceToHost));
    throw std::invalid_argument(std::string("cross_entropy: ") + what + " value " +
                                std::to_string(value) + " at row " + std::to_string(row) +
                                " is outside [0, " + std::to_string(logits.cols) + ")");
  }
  return host[1] == 0.0 ? 0.0F : static_cast<float>(host[0] / host[1]);
}

void CudaOps::cross_entropy_backward(MatrixView<float> probs, const std::int64_t* labels,
                                     const float* weights, float scale) {
  if (probs.rows == 0) return;
  auto* base = static_cast<unsigned char*>(flags_.ensure(kFlagsBytes));
  auto* result = reinterpret_cast<double*>(base + kResultOffset);
  cross_entropy_total(nullptr, weights, probs.rows, result, stream_);
  cuda::cross_entropy_backward(probs, labels, weights, scale, result + 1, stream_);
}

// --- reductions

double CudaOps::reduce(std::span<const std::span<const float>> arrays, bool squares) {
  auto* base = static_cast<unsigned char*>(flags_.ensure(kFlagsBytes));
  auto* result = reinterpret_cast<double*>(base + kResultOffset);
  auto* partials = static_cast<double*>(reduce_partials_.ensure(
      sizeof(double) * static_cast<std::size_t>(cuda::kMaxReductionBlocks)));
  CUDA_CHECK(cudaMemsetAsync(result, 0, sizeof(double), stream_));
  for (const auto array : arrays) {
    cuda::sum(array.data(), static_cast<std::int64_t>(array.size()), squares, result, partials,
              stream_);
  }
  double host = 0.0;
  CUDA_CHECK(cudaMemcpyAsync(&host, result, sizeof(host), cudaMemcpyDeviceToHost, stream_));
  synchronize();
  return host;
}

float CudaOps::sum(const float* x, std::int64_t count) {
  const std::span<const float> array(x, static_cast<std::size_t>(count));
  return static_cast<float>(reduce({&array, 1}, false));
}

float CudaOps::sum_of_squares(const float* x, std::int64_t count) {
  const std::span<const float> array(x, static_cast<std::size_t>(count));
  return static_cast<float>(reduce({&array, 1}, true));
}

double CudaOps::sum_of_squares_total(std::span<const std::span<const float>> arrays) {
  return reduce(arrays, true);
}

bool CudaOps::all_finite(const float* x, std::int64_t count) {
  auto* base = static_cast<unsigned char*>(flags_.ensure(kFlagsBytes));
  auto* flag = reinterpret_cast<unsigned int*>(base + kNonFiniteOffset);
  CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(unsigned int), stream_));
  find_non_finite(x, count, flag, stream_);
  unsigned int host = 0;
  CUDA_CHECK(cudaMemcpyAsync(&host, flag, sizeof(host), cudaMemcpyDeviceToHost, stream_));
  synchronize();
  return host == 0U;
}

}  // namespace pf::kernels::cuda
