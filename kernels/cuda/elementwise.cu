// Elementwise CUDA kernels: one thread per element of a row-major (strided) matrix.
#include <cmath>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/rng.h"

namespace pf::kernels::cuda {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(std::int64_t count) {
  return static_cast<unsigned>((count + kThreads - 1) / kThreads);
}

__global__ void bias_gelu_kernel(float* x, std::int64_t ldx, const float* bias, float* y,
                                 std::int64_t ldy, std::int64_t rows, std::int64_t cols) {
  const std::int64_t index = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= rows * cols) return;
  const std::int64_t i = index / cols;
  const std::int64_t j = index % cols;
  const float value = x[i * ldx + j] + bias[j];
  x[i * ldx + j] = value;
  y[i * ldy + j] = 0.5F * value * (1.0F + erff(value * 0.70710678118654752440F));
}

__global__ void gelu_backward_kernel(const float* x, std::int64_t ldx, const float* dy,
                                     std::int64_t lddy, float* dx, std::int64_t lddx,
                                     std::int64_t rows, std::int64_t cols) {
  const std::int64_t index = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= rows * cols) return;
  const std::int64_t i = index / cols;
  const std::int64_t j = index % cols;
  const float value = x[i * ldx + j];
  const float cdf = 0.5F * (1.0F + erff(value * 0.70710678118654752440F));
  const float pdf = 0.39894228040143267794F * expf(-0.5F * value * value);
  dx[i * lddx + j] = dy[i * lddy + j] * (cdf + value * pdf);
}

__global__ void dropout_kernel(const float* x, std::int64_t ldx, float* y, std::int64_t ldy,
                               std::int64_t rows, std::int64_t cols, std::uint32_t threshold,
                               float scale, std::uint64_t seed, std::uint64_t offset) {
  const std::int64_t index = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= rows * cols) return;
  const std::int64_t i = index / cols;
  const std::int64_t j = index % cols;
  const bool keep = dropout_keep(seed, offset + static_cast<std::uint64_t>(index), threshold);
  y[i * ldy + j] = keep ? x[i * ldx + j] * scale : 0.0F;
}

void require_same(std::int64_t rows_a, std::int64_t cols_a, std::int64_t rows_b,
                  std::int64_t cols_b, const char* op) {
  require(rows_a == rows_b && cols_a == cols_b, op, "shape mismatch");
}

}  // namespace

void bias_gelu_forward(MatrixView<float> x, const float* bias, MatrixView<float> y,
                       cudaStream_t stream) {
  require_same(x.rows, x.cols, y.rows, y.cols, "cuda::bias_gelu_forward");
  if (x.size() == 0) return;
  bias_gelu_kernel<<<blocks_for(x.size()), kThreads, 0, stream>>>(x.data, x.ld, bias, y.data, y.ld,
                                                                  x.rows, x.cols);
  CUDA_CHECK(cudaGetLastError());
}

void gelu_backward(ConstMatrixView<float> x, ConstMatrixView<float> dy, MatrixView<float> dx,
                   cudaStream_t stream) {
  require_same(x.rows, x.cols, dy.rows, dy.cols, "cuda::gelu_backward");
  require_same(x.rows, x.cols, dx.rows, dx.cols, "cuda::gelu_backward");
  if (x.size() == 0) return;
  gelu_backward_kernel<<<blocks_for(x.size()), kThreads, 0, stream>>>(
      x.data, x.ld, dy.data, dy.ld, dx.data, dx.ld, x.rows, x.cols);
  CUDA_CHECK(cudaGetLastError());
}

void dropout_forward(ConstMatrixView<float> x, MatrixView<float> y, float probability,
                     std::uint64_t seed, std::uint64_t index_offset, cudaStream_t stream) {
  require_same(x.rows, x.cols, y.rows, y.cols, "cuda::dropout_forward");
  require(probability >= 0.0F && probability < 1.0F, "cuda::dropout_forward",
          "probability must lie in [0, 1)");
  if (x.size() == 0) return;
  // The same scale as the CPU op: 1 / (1 - p) rounded to float.
  const float scale = 1.0F / (1.0F - probability);
  dropout_kernel<<<blocks_for(x.size()), kThreads, 0, stream>>>(
      x.data, x.ld, y.data, y.ld, x.rows, x.cols,
      probability == 0.0F ? 0U : dropout_threshold(probability), probability == 0.0F ? 1.0F : scale,
      seed, index_offset);
  CUDA_CHECK(cudaGetLastError());
}

void dropout_backward(ConstMatrixView<float> dy, MatrixView<float> dx, float probability,
                      std::uint64_t seed, std::uint64_t index_offset, cudaStream_t stream) {
  dropout_forward(dy, dx, probability, seed, index_offset, stream);
}

}  // namespace pf::kernels::cuda
