#pragma once
// The CUDA implementation of BackendOps<float>: cuBLAS products (fp32, TF32 or BF16 tensor
// cores) and the kernels of ops_cuda.h, all issued on one stream. One CudaOps per stream: a
// pipeline worker sharing the GPU with others owns its own. Ops that must report bad input
// (an index out of range) or return a value wait for the stream; all others are asynchronous.
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "kernels/backend_ops.h"
#include "kernels/cuda/cuda_backend.h"

namespace pf::kernels::cuda {

// A device allocation that grows on demand and is reused by later calls on the same stream.
class DeviceScratch {
 public:
  DeviceScratch(CudaBackend& backend, cudaStream_t stream) : backend_(&backend), stream_(stream) {}
  ~DeviceScratch();
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  // At least `bytes`; growing waits for the stream (earlier work may still read the old block).
  void* ensure(std::size_t bytes);

 private:
  CudaBackend* backend_;
  cudaStream_t stream_;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// A device allocation for work issued inside a training step (the bf16 copies of product
// operands): grows on demand without waiting for the stream and without cudaFree, which would
// synchronize the whole device mid-step. A block it grows out of stays allocated until the
// destructor (work already issued on the stream may still read it); growth at least doubles, so
// the retired blocks together stay smaller than the live one. Growth happens in the first steps
// only, once the largest operand has been seen.
class RetainingScratch {
 public:
  RetainingScratch(CudaBackend& backend, cudaStream_t stream)
      : backend_(&backend), stream_(stream) {}
  // Waits for the stream, then frees every block.
  ~RetainingScratch();
  RetainingScratch(const RetainingScratch&) = delete;
  RetainingScratch& operator=(const RetainingScratch&) = delete;
  // At least `bytes` (256-byte aligned, as cudaMalloc's blocks are).
  void* ensure(std::size_t bytes);

 private:
  struct Block {
    void* data;
    std::size_t bytes;
  };
  CudaBackend* backend_;
  cudaStream_t stream_;
  std::vector<Block> blocks_;  // back(): the one in use
};

class CudaOps final : public BackendOps<float> {
 public:
  // stream: the CudaStream to issue on (null: the default stream). The backend must outlive this.
  explicit CudaOps(CudaBackend& backend, tensor::Stream* stream = nullptr,
                   GemmPrecision precision = GemmPrecision::kFp32,
                   AttentionAlgorithm attention = AttentionAlgorithm::kBatchedGemm);
  ~CudaOps() override;

  GemmPrecision precision() const { return precision_; }
  void set_precision(GemmPrecision precision) { precision_ = precision; }
  // The attention algorithm (kernels/backend_ops.h): kBatchedGemm's cuBLAS pointer-batched
  // products in the run's GemmPrecision, or kFused's kernels (flash_attention.cu: fp32 FMA under
  // kFp32, TF32 tensor cores under the other precisions where head_dim <= 64; head_dim <= 128).
  // Changing it between an attention forward and its backward is an error the ops cannot see
  // (the saved data differ): set it before the model's first step.
  AttentionAlgorithm attention_algorithm() const { return attention_; }
  void set_attention_algorithm(AttentionAlgorithm algorithm) { attention_ = algorithm; }
  cudaStream_t stream() const { return stream_; }
  CublasHandle& cublas() { return cublas_; }

  tensor::Device device() const override { return backend_->device(); }
  void synchronize() override;

  void gemm(ConstMatrixView<float> a, Transpose transpose_a, ConstMatrixView<float> b,
            Transpose transpose_b, MatrixView<float> c, float alpha, float beta) override;
  void batched_gemm(std::int64_t count, ConstMatrixView<float> a, std::int64_t stride_a,
                    Transpose transpose_a, ConstMatrixView<float> b, std::int64_t stride_b,
                    Transpose transpose_b, MatrixView<float> c, std::int64_t stride_c, float alpha,
                    float beta) override;
  void linear_forward(ConstMatrixView<float> x, ConstMatrixView<float> weight, const float* bias,
                      MatrixView<float> y) override;
  void linear_backward(ConstMatrixView<float> x, ConstMatrixView<float> weight,
                       ConstMatrixView<float> dy, MatrixView<float> dx, MatrixView<float> dweight,
                       float* dbias) override;
  void bias_add(MatrixView<float> y, const float* bias) override;
  void bias_backward(ConstMatrixView<float> dy, float* dbias) override;

  void gelu_forward(ConstMatrixView<float> x, MatrixView<float> y) override;
  void bias_gelu_forward(MatrixView<float> x, const float* bias, MatrixView<float> y) override;
  void gelu_backward(ConstMatrixView<float> x, ConstMatrixView<float> dy,
                     MatrixView<float> dx) override;
  void bias_tanh_forward(MatrixView<float> x, const float* bias, MatrixView<float> y) override;
  void tanh_backward(ConstMatrixView<float> y, ConstMatrixView<float> dy,
                     MatrixView<float> dx) override;

  void dropout_forward(ConstMatrixView<float> x, MatrixView<float> y, float probability,
                       std::uint64_t seed, std::uint64_t index_offset) override;
  void dropout_backward(ConstMatrixView<float> dy, MatrixView<float> dx, float probability,
                        std::uint64_t seed, std::uint64_t index_offset) override;
  void dropout_add_forward(ConstMatrixView<float> x, ConstMatrixView<float> residual,
                           MatrixView<float> y, float probability, std::uint64_t seed) override;
  void add(ConstMatrixView<float> a, ConstMatrixView<float> b, MatrixView<float> y) override;
  void accumulate(ConstMatrixView<float> x, MatrixView<float> y) override;

  void layernorm_forward(ConstMatrixView<float> x, const float* gamma, const float* beta, float eps,
                         MatrixView<float> y, float* mean, float* rstd) override;
  void layernorm_backward(ConstMatrixView<float> x, ConstMatrixView<float> dy, const float* gamma,
                          const float* mean, const float* rstd, MatrixView<float> dx, float* dgamma,
                          float* dbeta) override;
  void masked_softmax_forward(MatrixView<float> scores, float scale,
                              const std::int64_t* key_mask) override;
  void softmax_backward(ConstMatrixView<float> probabilities, ConstMatrixView<float> dprobabilities,
                        float scale, MatrixView<float> dx) override;

  std::int64_t attention_saved_size(const AttentionShape& shape) const override;
  std::int64_t attention_workspace_size(const AttentionShape& shape) const override;
  void attention_forward(const AttentionShape& shape, ConstMatrixView<float> qkv,
                         const std::int64_t* attention_mask, float dropout, std::uint64_t seed,
                         float* saved, float* workspace, MatrixView<float> ctx) override;
  void attention_backward(const AttentionShape& shape, ConstMatrixView<float> qkv,
                          const std::int64_t* attention_mask, ConstMatrixView<float> ctx,
                          const float* saved, ConstMatrixView<float> dctx, float dropout,
                          std::uint64_t seed, float* workspace, MatrixView<float> dqkv) override;

  void embedding_forward(ConstMatrixView<float> table, const std::int64_t* ids,
                         MatrixView<float> out, const char* what, bool accumulate_output) override;
  void embedding_backward(ConstMatrixView<float> dout, const std::int64_t* ids,
                          MatrixView<float> dtable, std::int64_t skip_id) override;
  void gather_rows(ConstMatrixView<float> in, const std::int64_t* index,
                   MatrixView<float> out) override;
  void scatter_add_rows(ConstMatrixView<float> dout, const std::int64_t* index,
                        MatrixView<float> din) override;
  float cross_entropy_forward(MatrixView<float> logits, const std::int64_t* labels,
                              const float* weights, const char* what) override;
  void cross_entropy_backward(MatrixView<float> probs, const std::int64_t* labels,
                              const float* weights, float scale) override;

  float sum(const float* x, std::int64_t count) override;
  float sum_of_squares(const float* x, std::int64_t count) override;
  double sum_of_squares_total(std::span<const std::span<const float>> arrays) override;
  bool all_finite(const float* x, std::int64_t count) override;

 private:
  // Throws like the CPU op when an index of ids[0, rows) lies outside [0, limit) (waits for the
  // stream).
  void check_indices(const std::int64_t* ids, std::int64_t rows, std::int64_t limit, const char* op,
                     const char* what);
  // Row of the first bad index recorded in the flag since it was reset, or -1 (waits).
  std::int64_t read_bad_row();
  void reset_bad_row();
  // Every array's sum (of squares) into one double on the stream, in order, then one wait.
  double reduce(std::span<const std::span<const float>> arrays, bool squares);
  // The batched-GEMM attention (AttentionAlgorithm::kBatchedGemm); probs: the saved
  // probabilities.
  void batched_attention_forward(const AttentionShape& shape, ConstMatrixView<float> qkv,
                                 const std::int64_t* attention_mask, float dropout,
                                 std::uint64_t seed, float* probs, float* workspace,
                                 MatrixView<float> ctx);
  void batched_attention_backward(const AttentionShape& shape, ConstMatrixView<float> qkv,
                                  const float* probs, ConstMatrixView<float> dctx, float dropout,
                                  std::uint64_t seed, float* workspace, MatrixView<float> dqkv);

  CudaBackend* backend_;
  cudaStream_t stream_;
  GemmPrecision precision_;
  AttentionAlgorithm attention_;
  CublasHandle cublas_;
  // Small fixed block: [0] bad-row flag (u64), [8] non-finite flag (u32), [16] two doubles.
  DeviceScratch flags_;
  DeviceScratch pointers_;         // attention pointer arrays
  DeviceScratch partials_;         // column-sum partials, cross-entropy rows
  DeviceScratch reduce_partials_;  // the blocks' partial sums of reduce()
  DeviceScratch scatter_;          // embedding backward's sort by id
  // The bf16 copies of product operands under GemmPrecision::kBf16Operands, reused from product
  // to product (the stream orders a copy's rewrite after the product that read it): a product's
  // first and second operands; attention's QKV (left), its context gradient (right) and its
  // probabilities or their gradient (scores).
  RetainingScratch bf16_left_;
  RetainingScratch bf16_right_;
  RetainingScratch bf16_scores_;
};

}  // namespace pf::kernels::cuda
