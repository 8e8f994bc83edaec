#pragma once
// The CPU implementation of BackendOps: every call forwards to the Eigen/OpenMP op of
// kernels/ops.h and has finished when it returns.
#include "kernels/backend_ops.h"

namespace pf::kernels {

template <typename T>
class CpuOps final : public BackendOps<T> {
 public:
  tensor::Device device() const override { return {tensor::DeviceKind::kCpu, 0}; }
  void synchronize() override {}

  void gemm(ConstMatrixView<T> a, Transpose transpose_a, ConstMatrixView<T> b,
            Transpose transpose_b, MatrixView<T> c, T alpha, T beta) override {
    kernels::gemm<T>(a, transpose_a, b, transpose_b, c, alpha, beta);
  }
  void batched_gemm(std::int64_t count, ConstMatrixView<T> a, std::int64_t stride_a,
                    Transpose transpose_a, ConstMatrixView<T> b, std::int64_t stride_b,
                    Transpose transpose_b, MatrixView<T> c, std::int64_t stride_c, T alpha,
                    T beta) override {
    kernels::batched_gemm<T>(count, a, stride_a, transpose_a, b, stride_b, transpose_b, c, stride_c,
                             alpha, beta);
  }
  void linear_forward(ConstMatrixView<T> x, ConstMatrixView<T> weight, const T* bias,
                      MatrixView<T> y) override {
    kernels::linear_forward<T>(x, weight, bias, y);
  }
  void linear_backward(ConstMatrixView<T> x, ConstMatrixView<T> weight, ConstMatrixView<T> dy,
                       MatrixView<T> dx, MatrixView<T> dweight, T* dbias) override {
    kernels::linear_backward<T>(x, weight, dy, dx, dweight, dbias);
  }
  void bias_add(MatrixView<T> y, const T* bias) override { kernels::bias_add<T>(y, bias); }
  void bias_backward(ConstMatrixView<T> dy, T* dbias) override {
    kernels::bias_backward<T>(dy, dbias);
  }
  void gelu_forward(ConstMatrixView<T> x, MatrixView<T> y) override {
    kernels::gelu_forward<T>(x, y);
  }
  void bias_gelu_forward(MatrixView<T> x, const T* bias, MatrixView<T> y) override {
    kernels::bias_gelu_forward<T>(x, bias, y);
  }
  void gelu_backward(ConstMatrixView<T> x, ConstMatrixView<T> dy, MatrixView<T> dx) override {
    kernels::gelu_backward<T>(x, dy, dx);
  }
  void bias_tanh_forward(MatrixView<T> x, const T* bias, MatrixView<T> y) override {
    kernels::bias_tanh_forward<T>(x, bias, y);
  }
  void tanh_backward(ConstMatrixView<T> y, ConstMatrixView<T> dy, MatrixView<T> dx) override {
    kernels::tanh_backward<T>(y, dy, dx);
  }
  void dropout_forward(ConstMatrixView<T> x, MatrixView<T> y, float probability, std::uint64_t seed,
                       std::uint64_t index_offset) override {
    kernels::dropout_forward<T>(x, y, probability, seed, index_offset);
  }
  void dropout_backward(ConstMatrixView<T> dy, MatrixView<T> dx, float probability,
                        std::uint64_t seed, std::uint64_t index_offset) override {
    kernels::dropout_backward<T>(dy, dx, probability, seed, index_offset);
  }
  void dropout_add_forward(ConstMatrixView<T> x, ConstMatrixView<T> residual, MatrixView<T> y,
                           float probability, std::uint64_t seed) override {
    kernels::dropout_add_forward<T>(x, residual, y, probability, seed);
  }
  void add(ConstMatrixView<T> a, ConstMatrixView<T> b, MatrixView<T> y) override {
    kernels::add<T>(a, b, y);
  }
  void accumulate(ConstMatrixView<T> x, MatrixView<T> y) override { kernels::accumulate<T>(x, y); }
  void layernorm_forward(ConstMatrixView<T> x, const T* gamma, const T* beta, T eps,
                         MatrixView<T> y, T* mean, T* rstd) override {
    kernels::layernorm_forward<T>(x, gamma, beta, eps, y, mean, rstd);
  }
  void layernorm_backward(ConstMatrixView<T> x, ConstMatrixView<T> dy, const T* gamma,
                          const T* mean, const T* rstd, MatrixView<T> dx, T* dgamma,
                          T* dbeta) override {
    kernels::layernorm_backward<T>(x, dy, gamma, mean, rstd, dx, dgamma, dbeta);
  }
  void masked_softmax_forward(MatrixView<T> scores, T scale,
                              const std::int64_t* key_mask) override {
    kernels::masked_softmax_forward<T>(scores, scale, key_mask);
  }
  void softmax_backward(ConstMatrixView<T> probabilities, ConstMatrixView<T> dprobabilities,
                        T scale, MatrixView<T> dx) override {
    kernels::softmax_backward<T>(probabilities, dprobabilities, scale, dx);
  }
  // The CPU saves the probabilities: its backward needs neither the mask nor ctx.
  std::int64_t attention_saved_size(const AttentionShape& shape) const override {
    return kernels::attention_probs_size(shape);
  }
  std::int64_t attention_workspace_size(const AttentionShape& shape) const override {
    return kernels::attention_workspace_size(shape);
  }
  void attention_forward(const AttentionShape& shape, ConstMatrixView<T> qkv,
                         const std::int64_t* attention_mask, float dropout, std::uint64_t seed,
                         T* saved, T* workspace, MatrixView<T> ctx) override {
    kernels::attention_forward<T>(shape, qkv, attention_mask, dropout, seed, saved, workspace, ctx);
  }
  void attention_backward(const AttentionShape& shape, ConstMatrixView<T> qkv,
                          const std::int64_t* /*attention_mask*/, ConstMatrixView<T> /*ctx*/,
                          const T* saved, ConstMatrixView<T> dctx, float dropout,
                          std::uint64_t seed, T* workspace, MatrixView<T> dqkv) override {
    kernels::attention_backward<T>(shape, qkv, saved, dctx, dropout, seed, workspace, dqkv);
  }
  void embedding_forward(ConstMatrixView<T> table, const std::int64_t* ids, MatrixView<T> out,
                         const char* what, bool accumulate_output) override {
    kernels::embedding_forward<T>(table, ids, out, what, accumulate_output);
  }
  void embedding_backward(ConstMatrixView<T> dout, const std::int64_t* ids, MatrixView<T> dtable,
                          std::int64_t skip_id) override {
    kernels::embedding_backward<T>(dout, ids, dtable, skip_id);
  }
  void gather_rows(ConstMatrixView<T> in, const std::int64_t* index, MatrixView<T> out) override {
    kernels::gather_rows<T>(in, index, out);
  }
  void scatter_add_rows(ConstMatrixView<T> dout, const std::int64_t* index,
                        MatrixView<T> din) override {
    kernels::scatter_add_rows<T>(dout, index, din);
  }
  T cross_entropy_forward(MatrixView<T> logits, const std::int64_t* labels, const T* weights,
                          const char* what) override {
    return kernels::cross_entropy_forward<T>(logits, labels, weights, what);
  }
  void cross_entropy_backward(MatrixView<T> probs, const std::int64_t* labels, const T* weights,
                              T scale) override {
    kernels::cross_entropy_backward<T>(probs, labels, weights, scale);
  }
  T sum(const T* x, std::int64_t count) override { return kernels::sum<T>(x, count); }
  T sum_of_squares(const T* x, std::int64_t count) override {
    return kernels::sum_of_squares<T>(x, count);
  }
  double sum_of_squares_total(std::span<const std::span<const T>> arrays) override {
    double total = 0.0;  // element by element, in order: the executor's CPU path's sum
    for (const auto array : arrays) {
      for (const T value : array) total += static_cast<double>(value) * static_cast<double>(value);
    }
    return total;
  }
  bool all_finite(const T* x, std::int64_t count) override {
    return kernels::all_finite<T>(x, count);
  }
};

extern template class CpuOps<float>;
extern template class CpuOps<double>;

}  // namespace pf::kernels
