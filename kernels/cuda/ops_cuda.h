#pragma once
// Launchers of the CUDA kernels behind CudaOps (kernels/cuda/cuda_ops.h), on device memory and
// asynchronous on `stream`; same semantics as the CPU ops of kernels/ops.h (the dropout mask is
// the same counter-based one, bit for bit). Shapes are checked by CudaOps before a launch.
// C++17: this header is compiled by nvcc.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/matrix_view.h"
#include "kernels/ops.h"

namespace pf::kernels::cuda {

// --- elementwise (elementwise.cu)
void gelu_forward(ConstMatrixView<float> x, MatrixView<float> y, cudaStream_t stream);
void bias_gelu_forward(MatrixView<float> x, const float* bias, MatrixView<float> y,
                       cudaStream_t stream);
void gelu_backward(ConstMatrixView<float> x, ConstMatrixView<float> dy, MatrixView<float> dx,
                   cudaStream_t stream);
void bias_tanh_forward(MatrixView<float> x, const float* bias, MatrixView<float> y,
                       cudaStream_t stream);
void tanh_backward(ConstMatrixView<float> y, ConstMatrixView<float> dy, MatrixView<float> dx,
                   cudaStream_t stream);
// residual may be null (plain dropout); probability 0 copies (x may equal y).
void dropout_forward(ConstMatrixView<float> x, ConstMatrixView<float> residual, MatrixView<float> y,
                     float probability, std::uint64_t seed, std::uint64_t index_offset,
                     cudaStream_t stream);
// y = alpha_a * a + b (a may equal y: accumulate is y = x + y).
void add(ConstMatrixView<float> a, ConstMatrixView<float> b, MatrixView<float> y,
         cudaStream_t stream);
void bias_add(MatrixView<float> y, const float* bias, cudaStream_t stream);

// --- rows (rows.cu): one warp per row
void layernorm_forward(ConstMatrixView<float> x, const float* gamma, const float* beta, float eps,
                       MatrixView<float> y, float* mean, float* rstd, cudaStream_t stream);
// dx only; the parameter gradients come from column_sums.
void layernorm_backward_input(ConstMatrixView<float> x, ConstMatrixView<float> dy,
                              const float* gamma, const float* mean, const float* rstd,
                              MatrixView<float> dx, cudaStream_t stream);
// Column sums of dy into sum_dy (+=), and, when x is not null, of dy * (x - mean) * rstd into
// sum_dy_xhat (+=). Deterministic: partial sums per block of rows in `partials` (2 *
// column_sums_partials(rows, cols) floats), then one pass over them.
std::int64_t column_sums_partials(std::int64_t rows, std::int64_t cols);
void column_sums(ConstMatrixView<float> dy, const float* x, std::int64_t ldx, const float* mean,
                 const float* rstd, float* sum_dy, float* sum_dy_xhat, float* partials,
                 cudaStream_t stream);
// Softmax of scale * x + mask over each row of `scores`, in place. Row r uses the key mask at
// key_mask + (r / rows_per_mask) * cols (null: no mask). With dropout > 0 also writes
// dropped[r * cols + c] = dropout(p) with stream index r * cols + c (dropped is contiguous).
void masked_softmax_forward(MatrixView<float> scores, float scale, const std::int64_t* key_mask,
                            std::int64_t rows_per_mask, float dropout, std::uint64_t seed,
                            float* dropped, cudaStream_t stream);
// dx = scale * p * (dp' - sum(dp' p)) with dp' = dropout_backward(dp) when dropout > 0 (stream
// index r * cols + c). dx may alias dp.
void softmax_backward(ConstMatrixView<float> p, ConstMatrixView<float> dp, float scale,
                      float dropout, std::uint64_t seed, MatrixView<float> dx, cudaStream_t stream);
// Per row: probabilities in place, and loss_rows[r] = w_r * CE_r (0 where w_r = 0). Rows with
// w_r != 0 and a label outside [0, cols) set *bad_row = min(*bad_row, r).
void cross_entropy_rows(MatrixView<float> logits, const std::int64_t* labels, const float* weights,
                        float* loss_rows, unsigned long long* bad_row, cudaStream_t stream);
// result[0] = sum loss_rows, result[1] = sum weights (rows when weights is null), in double.
void cross_entropy_total(const float* loss_rows, const float* weights, std::int64_t rows,
                         double* result, cudaStream_t stream);
// probs -> (probs - onehot) * scale * w_r / total_weight (zero rows where w_r = 0 or the total
// is 0); total_weight is result[1] of cross_entropy_total.
void cross_entropy_backward(MatrixView<float> probs, const std::int64_t* labels,
                            const float* weights, float scale, const double* total_weight,
                            cudaStream_t stream);

// --- indexing (indexing.cu)
// *bad_row = min(*bad_row, r) for every r with ids[r] outside [0, limit).
void check_indices(const std::int64_t* ids, std::int64_t rows, std::int64_t limit,
                   unsigned long long* bad_row, cudaStream_t stream);
// out[r] (+)= table[ids[r]] (rows with an invalid id are left alone).
void gather_rows(ConstMatrixView<float> table, const std::int64_t* ids, MatrixView<float> out,
                 bool accumulate_output, cudaStream_t stream);
// dtable[ids[r]] += dout[r] except ids equal to skip_id (and invalid ids), deterministic and
// in the CPU's order: the rows are sorted by id (a stable radix sort, so rows of one id keep
// their order) and each table row adds its rows one after another, as the CPU's serial loop
// does, instead of atomic adds whose order varies run to run. `workspace` holds at least
// scatter_add_rows_workspace(dout.rows, dtable.rows) bytes.
std::size_t scatter_add_rows_workspace(std::int64_t rows, std::int64_t table_rows);
void scatter_add_rows(ConstMatrixView<float> dout, const std::int64_t* ids,
                      MatrixView<float> dtable, std::int64_t skip_id, void* workspace,
                      std::size_t workspace_bytes, cudaStream_t stream);
// Pointer arrays of the per-(sequence, head) matrices of attention, pair p = b * heads + h:
// q/k/v[p] = qkv + b*seq*ld_qkv + {0, hidden, 2 hidden} + h*head_dim, ctx[p] = ctx + b*seq*ld_ctx
// + h*head_dim, scores[p] = scores + p*seq*seq. A null ctx leaves the ctx array unwritten.
template <typename T>
struct AttentionPointersOf {
  T** q;
  T** k;
  T** v;
  T** ctx;
  T** scores;
};
using AttentionPointers = AttentionPointersOf<float>;
// The bf16 copies' arrays (GemmPrecision::kBf16Operands): the products' operands only.
using AttentionOperandPointers = AttentionPointersOf<const __nv_bfloat16>;
void fill_attention_pointers(float* qkv, std::int64_t ld_qkv, float* ctx, std::int64_t ld_ctx,
                             float* scores, std::int64_t batch, std::int64_t heads,
                             std::int64_t seq, std::int64_t head_dim, AttentionPointers pointers,
                             cudaStream_t stream);
void fill_attention_pointers(const __nv_bfloat16* qkv, std::int64_t ld_qkv,
                             const __nv_bfloat16* ctx, std::int64_t ld_ctx,
                             const __nv_bfloat16* scores, std::int64_t batch, std::int64_t heads,
                             std::int64_t seq, std::int64_t head_dim,
                             AttentionOperandPointers pointers, cudaStream_t stream);

// --- fused attention (flash_attention.cu): the attention core of kernels/ops.h without the
// [batch, heads, seq, seq] probabilities, FlashAttention-2's algorithm. tensor_cores: the tile
// products on TF32 tensor cores (WMMA, fp32 accumulation) where head_dim <= 64, else fp32 FMA;
// the softmax, mask and dropout in fp32 either way. Same mask and dropout keep bits as
// masked_softmax_forward on the batched path. head_dim up to kFusedAttentionMaxHeadDim (larger
// throws std::invalid_argument), any seq.
constexpr std::int64_t kFusedAttentionMaxHeadDim = 128;
// Floats the forward saves for the backward: one log-sum-exp per (sequence, head, query) row.
std::int64_t fused_attention_saved_size(const AttentionShape& shape);
// Floats of the backward's workspace: one dO.O per row, and a partial dQ per block of 64 keys.
std::int64_t fused_attention_workspace_size(const AttentionShape& shape);
// ctx = dropout(softmax(Q K^T / sqrt(D) + mask)) V, and log_sum_exp of each row's masked logits.
void fused_attention_forward(const AttentionShape& shape, ConstMatrixView<float> qkv,
                             const std::int64_t* attention_mask, float dropout, std::uint64_t seed,
                             bool tensor_cores, float* log_sum_exp, MatrixView<float> ctx,
                             cudaStream_t stream);
// dqkv (overwritten) from dctx, recomputing the probabilities from qkv, the mask and the
// forward's log_sum_exp; ctx is the forward's output. Deterministic (no atomics).
void fused_attention_backward(const AttentionShape& shape, ConstMatrixView<float> qkv,
                              const std::int64_t* attention_mask, ConstMatrixView<float> ctx,
                              const float* log_sum_exp, ConstMatrixView<float> dctx, float dropout,
                              std::uint64_t seed, bool tensor_cores, float* workspace,
                              MatrixView<float> dqkv, cudaStream_t stream);

// --- bf16 operands (convert.cu)
// The count matrices of src (the i-th at src.data + i * src_stride; rows, cols and leading
// dimension from src) rounded to bf16, to nearest even, into dst's (the i-th at dst.data + i *
// dst_stride, leading dimension dst.ld; dst's rows and cols are src's).
void convert_to_bf16(ConstMatrixView<float> src, std::int64_t src_stride, std::int64_t count,
                     MatrixView<__nv_bfloat16> dst, std::int64_t dst_stride, cudaStream_t stream);

// --- reductions (reduce.cu); results accumulate into *result (zero it first)
// partials: scratch of kMaxReductionBlocks doubles (the blocks' partial sums, added in order).
constexpr int kMaxReductionBlocks = 1024;
void sum(const float* x, std::int64_t count, bool squares, double* result, double* partials,
         cudaStream_t stream);
// *non_finite = 1 if any element is NaN or infinite (zero it first).
void find_non_finite(const float* x, std::int64_t count, unsigned int* non_finite,
                     cudaStream_t stream);

}  // namespace pf::kernels::cuda
