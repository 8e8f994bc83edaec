// Elementwise CUDA kernels over row-major (strided) matrices: one thread per element, a
// grid-stride loop, the operation a small functor.
#include <cmath>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/rng.h"

namespace pf::kernels::cuda {
namespace {

constexpr float kInvSqrt2 = 0.70710678118654752440F;
constexpr float kInvSqrt2Pi = 0.39894228040143267794F;

__device__ float gelu(float x) {
  return 0.5F * x * (1.0F + erff(x * kInvSqrt2));
}

template <typename Op>
__global__ void map2d_kernel(std::int64_t rows, std::int64_t cols, Op op) {
  const std::int64_t count = rows * cols;
  for (std::int64_t index = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       index < count; index += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    op(index / cols, index % cols, index);
  }
}

template <typename Op>
void map2d(std::int64_t rows, std::int64_t cols, cudaStream_t stream, Op op) {
  if (rows * cols == 0) return;
  map2d_kernel<<<grid_for(rows * cols), kThreads, 0, stream>>>(rows, cols, op);
  CUDA_CHECK(cudaGetLastError());
}

struct Gelu {
  const float* x;
  std::int64_t ldx;
  float* y;
  std::int64_t ldy;
  __device__ void operator()(std::int64_t i, std::int64_t j, std::int64_t) const {
    y[i * ldy + j] = gelu(x[i * ldx + j]);
  }
};

struct BiasGelu {
  float* x;
  std::int64_t ldx;
  const float* bias;
  float* y;
  std::int64_t ldy;
  __device__ void operator()(std::int64_t i, std::int64_t j, std::int64_t) const {
    const float value = x[i * ldx + j] + bias[j];
    x[i * ldx + j] = value;
    y[i * ldy + j] = gelu(value);
  }
};

struct GeluBackward {
  const float* x;
  std::int64_t ldx;
  const float* dy;
  std::int64_t lddy;
  float* dx;
  std::int64_t lddx;
  __device__ void operator()(std::int64_t i, std::int64_t j, std::int64_t) const {
    const float value = x[i * ldx + j];
    const float cdf = 0.5F * (1.0F + erff(value * kInvSqrt2));
    const float pdf = kInvSqrt2Pi * expf(-0.5F * value * value);
    dx[i * lddx + j] = dy[i * lddy + j] * (cdf + value * pdf);
  }
};

struct BiasTanh {
  float* x;
  std::int64_t ldx;
  const float* bias;
  float* y;
  std::int64_t ldy;
  __device__ void operator()(std::int64_t i, std::int64_t j, std::int64_t) const {
    const float value = x[i * ldx + j] + bias[j];
    x[i * ldx + j] = value;
    y[i * ldy + j] = tanhf(value);
  }
};

struct TanhBackward {
  const float* y;
  std::int64_t ldy;
  const float* dy;
  std::int64_t lddy;
  float* dx;
  std::int64_t lddx;
  __device__ void operator()(std::int64_t i, std::int64_t j, std::int64_t) const {
    const float out = y[i * ldy + j];
    dx[i * lddx + j] = dy[i * lddy + j] * (1.0F - out * out);
  }
};

struct Dropout {
  const float* x;
  std::int64_t ldx;
  const float* residual;  // may be null
  std::int64_t ldr;
  float* y;
  std::int64_t ldy;
  std::uint64_t key;
  std::uint64_t offset;
  std::uint32_t threshold;
  float scale;
  bool active;
  __device__ void operator()(std::int64_t i, std::int64_t j, std::int64_t index) const {
    float value = x[i * ldx + j];
    if (active) {
      const bool keep = bits_for_key(key, offset + static_cast<std::uint64_t>(index)) >= threshold;
      value = keep ? value * scale : 0.0F;
    }
    if (residual != nullptr) value += residual[i * ldr + j];
    y[i * ldy + j] = value;
  }
};

struct Add {
  const float* a;
  std::int64_t lda;
  const float* b;
  std::int64_t ldb;
  float* y;
  std::int64_t ldy;
  __device__ void operator()(std::int64_t i, std::int64_t j, std::int64_t) const {
    y[i * ldy + j] = a[i * lda + j] + b[i * ldb + j];
  }
};

struct BiasAdd {
  float* y;
  std::int64_t ldy;
  const float* bias;
  __device__ void operator()(std::int64_t i, std::int64_t j, std::int64_t) const {
    y[i * ldy + j] += bias[j];
  }
};

}  // namespace

void gelu_forward(ConstMatrixView<float> x, MatrixView<float> y, cudaStream_t stream) {
  map2d(x.rows, x.cols, stream, Gelu{x.data, x.ld, y.data, y.ld});
}

void bias_gelu_forward(MatrixView<float> x, const float* bias, MatrixView<float> y,
                       cudaStream_t stream) {
  map2d(x.rows, x.cols, stream, BiasGelu{x.data, x.ld, bias, y.data, y.ld});
}

void gelu_backward(ConstMatrixView<float> x, ConstMatrixView<float> dy, MatrixView<float> dx,
                   cudaStream_t stream) {
  map2d(x.rows, x.cols, stream, GeluBackward{x.data, x.ld, dy.data, dy.ld, dx.data, dx.ld});
}

void bias_tanh_forward(MatrixView<float> x, const float* bias, MatrixView<float> y,
                       cudaStream_t stream) {
  map2d(x.rows, x.cols, stream, BiasTanh{x.data, x.ld, bias, y.data, y.ld});
}

void tanh_backward(ConstMatrixView<float> y, ConstMatrixView<float> dy, MatrixView<float> dx,
                   cudaStream_t stream) {
  map2d(y.rows, y.cols, stream, TanhBackward{y.data, y.ld, dy.data, dy.ld, dx.data, dx.ld});
}

void dropout_forward(ConstMatrixView<float> x, ConstMatrixView<float> residual, MatrixView<float> y,
                     float probability, std::uint64_t seed, std::uint64_t index_offset,
                     cudaStream_t stream) {
  const bool active = probability > 0.0F;
  // The same scale as the CPU op: 1 / (1 - p) rounded to float.
  const float scale = active ? 1.0F / (1.0F - probability) : 1.0F;
  map2d(x.rows, x.cols, stream,
        Dropout{x.data, x.ld, residual.data, residual.ld, y.data, y.ld, stream_key(seed),
                index_offset, active ? dropout_threshold(probability) : 0U, scale, active});
}

void add(ConstMatrixView<float> a, ConstMatrixView<float> b, MatrixView<float> y,
         cudaStream_t stream) {
  map2d(a.rows, a.cols, stream, Add{a.data, a.ld, b.data, b.ld, y.data, y.ld});
}

void bias_add(MatrixView<float> y, const float* bias, cudaStream_t stream) {
  map2d(y.rows, y.cols, stream, BiasAdd{y.data, y.ld, bias});
}

}  // namespace pf::kernels::cuda
