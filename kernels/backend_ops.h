#pragma once
// One operations interface, one implementation per device (as ggml's backends): the model, K-FAC
// and the optimizers hold a BackendOps<T>& and never name a device. CpuOps (kernels/cpu) forwards
// to the Eigen/OpenMP ops of kernels/ops.h; CudaOps (kernels/cuda) runs the same ops with cuBLAS
// and CUDA kernels on one stream. make_ops (kernels/make_ops.h) picks the implementation from a
// backend's device. The contracts are those of kernels/ops.h, with one addition: every pointer,
// index arrays and masks included, lives on the ops' device. Ops that return a value to the host
// (cross_entropy_forward, sum, sum_of_squares, all_finite) wait for the device.
#include <cstdint>
#include <span>
#include <string_view>

#include "kernels/matrix_view.h"
#include "kernels/ops.h"
#include "runtime/tensor/backend.h"

namespace pf::kernels {

// How fp32 matrix products run: exact fp32, TF32 tensor cores, or BF16 tensor cores with fp32
// accumulation. kBf16 hands cuBLAS the fp32 operands with a bf16 compute type (cuBLAS rounds them
// inside the product). kBf16Operands rounds each operand once to bf16 storage (to nearest even)
// and runs cuBLAS on bf16 operands, fp32 outputs and fp32 accumulation: the arithmetic kBf16
// asks for, but the product reads half the bytes and can take cuBLAS's native bf16 kernels; an
// experiment until a GPU measures it against kBf16 (docs/cuda.md). Storage outside the product
// stays fp32 in every mode. The CPU always computes in T.
enum class GemmPrecision : std::uint8_t { kFp32, kTf32, kBf16, kBf16Operands };
std::string_view to_string(GemmPrecision precision);
// "fp32" | "tf32" | "bf16" | "bf16-operands"; throws std::invalid_argument naming the value
// otherwise.
GemmPrecision parse_gemm_precision(std::string_view text);

// How a backend computes the attention core. kBatchedGemm: batched products around a masked
// softmax (+dropout) kernel; the forward saves the probabilities [batch, heads, seq, seq].
// kFused: CUDA's flash-style kernels (kernels/cuda/flash_attention.cu); the forward saves one
// log-sum-exp per query row and the backward recomputes the probabilities. Both give the same
// dropout mask bit for bit. The CPU has kBatchedGemm only; CUDA defaults to it until a GPU has
// measured which is faster (docs/cuda.md, "attention: fused vs batched").
enum class AttentionAlgorithm : std::uint8_t { kBatchedGemm, kFused };
std::string_view to_string(AttentionAlgorithm algorithm);
// "batched" | "fused"; throws std::invalid_argument naming the value otherwise.
AttentionAlgorithm parse_attention_algorithm(std::string_view text);

template <typename T>
class BackendOps {
 public:
  virtual ~BackendOps() = default;
  BackendOps() = default;
  BackendOps(const BackendOps&) = delete;
  BackendOps& operator=(const BackendOps&) = delete;

  virtual tensor::Device device() const = 0;
  // Host waits until every op issued through this object has finished.
  virtual void synchronize() = 0;

  virtual void gemm(ConstMatrixView<T> a, Transpose transpose_a, ConstMatrixView<T> b,
                    Transpose transpose_b, MatrixView<T> c, T alpha = T(1), T beta = T(0)) = 0;
  virtual void batched_gemm(std::int64_t count, ConstMatrixView<T> a, std::int64_t stride_a,
                            Transpose transpose_a, ConstMatrixView<T> b, std::int64_t stride_b,
                            Transpose transpose_b, MatrixView<T> c, std::int64_t stride_c,
                            T alpha = T(1), T beta = T(0)) = 0;
  virtual void linear_forward(ConstMatrixView<T> x, ConstMatrixView<T> weight, const T* bias,
                              MatrixView<T> y) = 0;
  virtual void linear_backward(ConstMatrixView<T> x, ConstMatrixView<T> weight,
                               ConstMatrixView<T> dy, MatrixView<T> dx, MatrixView<T> dweight,
                               T* dbias) = 0;
  virtual void bias_add(MatrixView<T> y, const T* bias) = 0;
  virtual void bias_backward(ConstMatrixView<T> dy, T* dbias) = 0;

  virtual void gelu_forward(ConstMatrixView<T> x, MatrixView<T> y) = 0;
  virtual void bias_gelu_forward(MatrixView<T> x, const T* bias, MatrixView<T> y) = 0;
  virtual void gelu_backward(ConstMatrixView<T> x, ConstMatrixView<T> dy, MatrixView<T> dx) = 0;
  virtual void bias_tanh_forward(MatrixView<T> x, const T* bias, MatrixView<T> y) = 0;
  virtual void tanh_backward(ConstMatrixView<T> y, ConstMatrixView<T> dy, MatrixView<T> dx) = 0;

  virtual void dropout_forward(ConstMatrixView<T> x, MatrixView<T> y, float probability,
                               std::uint64_t seed, std::uint64_t index_offset = 0) = 0;
  virtual void dropout_backward(ConstMatrixView<T> dy, MatrixView<T> dx, float probability,
                                std::uint64_t seed, std::uint64_t index_offset = 0) = 0;
  virtual void dropout_add_forward(ConstMatrixView<T> x, ConstMatrixView<T> residual,
                                   MatrixView<T> y, float probability, std::uint64_t seed) = 0;
  virtual void add(ConstMatrixView<T> a, ConstMatrixView<T> b, MatrixView<T> y) = 0;
  virtual void accumulate(ConstMatrixView<T> x, MatrixView<T> y) = 0;

  virtual void layernorm_forward(ConstMatrixView<T> x, const T* gamma, const T* beta, T eps,
                                 MatrixView<T> y, T* mean, T* rstd) = 0;
  virtual void layernorm_backward(ConstMatrixView<T> x, ConstMatrixView<T> dy, const T* gamma,
                                  const T* mean, const T* rstd, MatrixView<T> dx, T* dgamma,
                                  T* dbeta) = 0;
  virtual void masked_softmax_forward(MatrixView<T> scores, T scale,
                                      const std::int64_t* key_mask) = 0;
  virtual void softmax_backward(ConstMatrixView<T> probabilities, ConstMatrixView<T> dprobabilities,
                                T scale, MatrixView<T> dx) = 0;

  // Elements of T the attention forward saves for its backward in `saved`: the probabilities
  // [batch, heads, seq, seq] (attention_probs_size) where the backward multiplies by them, one
  // log-sum-exp per (sequence, head, query) row where a fused backward recomputes them (CUDA's
  // AttentionAlgorithm::kFused). The backward reads `saved` unchanged.
  virtual std::int64_t attention_saved_size(const AttentionShape& shape) const = 0;
  // Elements of T the backend's attention needs as workspace (it may differ per backend).
  virtual std::int64_t attention_workspace_size(const AttentionShape& shape) const = 0;
  virtual void attention_forward(const AttentionShape& shape, ConstMatrixView<T> qkv,
                                 const std::int64_t* attention_mask, float dropout,
                                 std::uint64_t seed, T* saved, T* workspace, MatrixView<T> ctx) = 0;
  // attention_mask and ctx are the forward's mask and output (a fused backward recomputes the
  // probabilities from qkv, the mask and `saved`, and needs rowsum(dctx * ctx)).
  virtual void attention_backward(const AttentionShape& shape, ConstMatrixView<T> qkv,
                                  const std::int64_t* attention_mask, ConstMatrixView<T> ctx,
                                  const T* saved, ConstMatrixView<T> dctx, float dropout,
                                  std::uint64_t seed, T* workspace, MatrixView<T> dqkv) = 0;

  virtual void embedding_forward(ConstMatrixView<T> table, const std::int64_t* ids,
                                 MatrixView<T> out, const char* what,
                                 bool accumulate_output = false) = 0;
  virtual void embedding_backward(ConstMatrixView<T> dout, const std::int64_t* ids,
                                  MatrixView<T> dtable, std::int64_t skip_id = -1) = 0;
  virtual void gather_rows(ConstMatrixView<T> in, const std::int64_t* index, MatrixView<T> out) = 0;
  virtual void scatter_add_rows(ConstMatrixView<T> dout, const std::int64_t* index,
                                MatrixView<T> din) = 0;
  virtual T cross_entropy_forward(MatrixView<T> logits, const std::int64_t* labels,
                                  const T* weights, const char* what) = 0;
  virtual void cross_entropy_backward(MatrixView<T> probs, const std::int64_t* labels,
                                      const T* weights, T scale) = 0;

  virtual T sum(const T* x, std::int64_t count) = 0;
  virtual T sum_of_squares(const T* x, std::int64_t count) = 0;
  // The sum of squares of every element of every array, accumulated in double in array order
  // (a training step's global gradient norm): one wait for the device for all of them, where
  // sum_of_squares per array waits once each (hundreds of tensors in a BERT).
  virtual double sum_of_squares_total(std::span<const std::span<const T>> arrays) = 0;
  virtual bool all_finite(const T* x, std::int64_t count) = 0;
};

}  // namespace pf::kernels
