// Row-wise CUDA kernels: LayerNorm, softmax (with the attention mask and dropout fused), the
// cross-entropy. One warp per row (a block per row for the wide rows of the cross-entropy).
#include <cmath>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/ops.h"
#include "kernels/rng.h"

namespace pf::kernels::cuda {
namespace {

__device__ inline std::int64_t warp_row() {
  return static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
}

__global__ void layernorm_forward_kernel(const float* x, std::int64_t ldx, const float* gamma,
                                         const float* beta, float eps, float* y, std::int64_t ldy,
                                         float* mean, float* rstd, std::int64_t rows,
                                         std::int64_t cols) {
  const std::int64_t row = warp_row();
  if (row >= rows) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const float* in = x + row * ldx;
  float total = 0.0F;
  for (std::int64_t j = lane; j < cols; j += 32) total += in[j];
  const float mu = warp_sum(total) / static_cast<float>(cols);
  float squares = 0.0F;
  for (std::int64_t j = lane; j < cols; j += 32) {
    const float centred = in[j] - mu;
    squares += centred * centred;
  }
  const float variance = warp_sum(squares) / static_cast<float>(cols);
  const float r = 1.0F / sqrtf(variance + eps);
  if (lane == 0) {
    mean[row] = mu;
    rstd[row] = r;
  }
  float* out = y + row * ldy;
  for (std::int64_t j = lane; j < cols; j += 32) out[j] = (in[j] - mu) * r * gamma[j] + beta[j];
}

__global__ void layernorm_backward_input_kernel(const float* x, std::int64_t ldx, const float* dy,
                                                std::int64_t lddy, const float* gamma,
                                                const float* mean, const float* rstd, float* dx,
                                                std::int64_t lddx, std::int64_t rows,
                                                std::int64_t cols) {
  const std::int64_t row = warp_row();
  if (row >= rows) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const float* in = x + row * ldx;
  const float* d = dy + row * lddy;
  const float mu = mean[row];
  const float r = rstd[row];
  float dg = 0.0F;
  float dg_xhat = 0.0F;
  for (std::int64_t j = lane; j < cols; j += 32) {
    const float value = d[j] * gamma[j];
    dg += value;
    dg_xhat += value * (in[j] - mu);
  }
  const float inv_cols = 1.0F / static_cast<float>(cols);
  const float mean_dg = warp_sum(dg) * inv_cols;
  const float mean_dg_xhat = warp_sum(dg_xhat) * r * inv_cols;
  float* out = dx + row * lddx;
  for (std::int64_t j = lane; j < cols; j += 32) {
    out[j] = r * (d[j] * gamma[j] - mean_dg - (in[j] - mu) * (r * mean_dg_xhat));
  }
}

// Block (32, 8) sums a 32-column strip over a block of kColumnRowsPerBlock rows.
constexpr int kColumnRowsPerBlock = 64;

__global__ void column_partials_kernel(const float* dy, std::int64_t lddy, const float* x,
                                       std::int64_t ldx, const float* mean, const float* rstd,
                                       float* partials, std::int64_t rows, std::int64_t cols) {
  __shared__ float shared_dy[8][33];
  __shared__ float shared_xhat[8][33];
  const std::int64_t column = static_cast<std::int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.y) * kColumnRowsPerBlock;
  float sum_dy = 0.0F;
  float sum_xhat = 0.0F;
  if (column < cols) {
    for (std::int64_t row = first + threadIdx.y; row < rows && row < first + kColumnRowsPerBlock;
         row += 8) {
      const float d = dy[row * lddy + column];
      sum_dy += d;
      if (x != nullptr) sum_xhat += d * (x[row * ldx + column] - mean[row]) * rstd[row];
    }
  }
  shared_dy[threadIdx.y][threadIdx.x] = sum_dy;
  shared_xhat[threadIdx.y][threadIdx.x] = sum_xhat;
  __syncthreads();
  if (threadIdx.y == 0 && column < cols) {
    for (int k = 1; k < 8; ++k) {
      sum_dy += shared_dy[k][threadIdx.x];
      sum_xhat += shared_xhat[k][threadIdx.x];
    }
    partials[blockIdx.y * cols + column] = sum_dy;
    partials[(gridDim.y + blockIdx.y) * cols + column] = sum_xhat;
  }
}

__global__ void column_finish_kernel(const float* partials, std::int64_t blocks, std::int64_t cols,
                                     float* sum_dy, float* sum_dy_xhat) {
  const std::int64_t column = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (column >= cols) return;
  float total_dy = 0.0F;
  float total_xhat = 0.0F;
  for (std::int64_t b = 0; b < blocks; ++b) {
    total_dy += partials[b * cols + column];
    total_xhat += partials[(blocks + b) * cols + column];
  }
  sum_dy[column] += total_dy;
  if (sum_dy_xhat != nullptr) sum_dy_xhat[column] += total_xhat;
}

__global__ void softmax_forward_kernel(float* scores, std::int64_t ld, float scale,
                                       const std::int64_t* key_mask, std::int64_t rows_per_mask,
                                       std::uint64_t key, std::uint32_t threshold,
                                       float dropout_scale, float* dropped, std::int64_t rows,
                                       std::int64_t cols) {
  const std::int64_t row = warp_row();
  if (row >= rows) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  float* s = scores + row * ld;
  const std::int64_t* mask =
      key_mask == nullptr ? nullptr : key_mask + (row / rows_per_mask) * cols;
  const float masked = static_cast<float>(kMaskedLogit);
  float max = -INFINITY;
  for (std::int64_t j = lane; j < cols; j += 32) {
    float value = s[j] * scale;
    if (mask != nullptr && mask[j] == 0) value += masked;
    s[j] = value;
    max = fmaxf(max, value);
  }
  max = warp_max(max);
  float total = 0.0F;
  for (std::int64_t j = lane; j < cols; j += 32) {
    const float e = expf(s[j] - max);
    s[j] = e;
    total += e;
  }
  const float inverse = 1.0F / warp_sum(total);
  for (std::int64_t j = lane; j < cols; j += 32) {
    const float p = s[j] * inverse;
    s[j] = p;
    if (dropped != nullptr) {
      const auto index = static_cast<std::uint64_t>(row * cols + j);
      dropped[row * cols + j] = bits_for_key(key, index) >= threshold ? p * dropout_scale : 0.0F;
    }
  }
}

__global__ void softmax_backward_kernel(const float* p, std::int64_t ldp, const float* dp,
                                        std::int64_t lddp, float scale, std::uint64_t key,
                                        std::uint32_t threshold, float dropout_scale, bool dropout,
                                        float* dx, std::int64_t lddx, std::int64_t rows,
                                        std::int64_t cols) {
  const std::int64_t row = warp_row();
  if (row >= rows) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const float* pr = p + row * ldp;
  const float* dpr = dp + row * lddp;
  float* out = dx + row * lddx;
  float dot = 0.0F;
  for (std::int64_t j = lane; j < cols; j += 32) {
    float g = dpr[j];
    if (dropout) {
      const auto index = static_cast<std::uint64_t>(row * cols + j);
      g = bits_for_key(key, index) >= threshold ? g * dropout_scale : 0.0F;
      out[j] = g;  // dx may alias dp: each lane rewrites only its own elements
    }
    dot += g * pr[j];
  }
  dot = warp_sum(dot);
  for (std::int64_t j = lane; j < cols; j += 32) {
    const float g = dropout ? out[j] : dpr[j];
    out[j] = scale * pr[j] * (g - dot);
  }
}

template <typename T>
__device__ T block_reduce(T value, T* shared, bool is_max) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warp = static_cast<int>(threadIdx.x / 32);
  for (int offset = 16; offset > 0; offset /= 2) {
    const T other = __shfl_xor_sync(0xffffffffU, value, offset);
    value = is_max ? (other > value ? other : value) : value + other;
  }
  __syncthreads();  // `shared` may still be read by a previous reduction
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  value = shared[0];
  for (int w = 1; w < kWarpsPerBlock; ++w) {
    value = is_max ? (shared[w] > value ? shared[w] : value) : value + shared[w];
  }
  return value;
}

__global__ void cross_entropy_rows_kernel(float* logits, std::int64_t ld,
                                          const std::int64_t* labels, const float* weights,
                                          float* loss_rows, unsigned long long* bad_row,
                                          std::int64_t cols) {
  __shared__ float shared[kWarpsPerBlock];
  const std::int64_t row = blockIdx.x;
  float* x = logits + row * ld;
  float max = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) max = fmaxf(max, x[j]);
  max = block_reduce(max, shared, true);
  float total = 0.0F;
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) total += expf(x[j] - max);
  total = block_reduce(total, shared, false);
  const float w = weights == nullptr ? 1.0F : weights[row];
  const std::int64_t label = labels[row];
  const bool valid = label >= 0 && label < cols;
  if (threadIdx.x == 0) {
    float loss = 0.0F;
    if (w != 0.0F) {
      if (valid) {
        loss = w * (logf(total) - (x[label] - max));
      } else {
        atomicMin(bad_row, static_cast<unsigned long long>(row));
      }
    }
    loss_rows[row] = loss;
  }
  __syncthreads();  // x[label] is read before it is overwritten
  const float inverse = 1.0F / total;
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) x[j] = expf(x[j] - max) * inverse;
}

__global__ void cross_entropy_total_kernel(const float* loss_rows, const float* weights,
                                           std::int64_t rows, double* result) {
  __shared__ double shared[kWarpsPerBlock];
  double loss = 0.0;
  double weight = 0.0;
  for (std::int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    if (loss_rows != nullptr) loss += loss_rows[r];
    weight += weights == nullptr ? 1.0 : static_cast<double>(weights[r]);
  }
  loss = block_reduce(loss, shared, false);
  weight = block_reduce(weight, shared, false);
  if (threadIdx.x == 0) {
    result[0] = loss;
    result[1] = weight;
  }
}

__global__ void cross_entropy_backward_kernel(float* probs, std::int64_t ld,
                                              const std::int64_t* labels, const float* weights,
                                              float scale, const double* total_weight,
                                              std::int64_t cols) {
  const std::int64_t row = blockIdx.x;
  float* x = probs + row * ld;
  const float w = weights == nullptr ? 1.0F : weights[row];
  const auto total = static_cast<float>(*total_weight);
  if (w == 0.0F || total == 0.0F) {
    for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) x[j] = 0.0F;
    return;
  }
  const float factor = scale * w / total;
  const std::int64_t label = labels[row];
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    x[j] = (j == label ? x[j] - 1.0F : x[j]) * factor;
  }
}

}  // namespace

void layernorm_forward(ConstMatrixView<float> x, const float* gamma, const float* beta, float eps,
                       MatrixView<float> y, float* mean, float* rstd, cudaStream_t stream) {
  if (x.rows == 0) return;
  layernorm_forward_kernel<<<warp_rows_grid(x.rows), kThreads, 0, stream>>>(
      x.data, x.ld, gamma, beta, eps, y.data, y.ld, mean, rstd, x.rows, x.cols);
  CUDA_CHECK(cudaGetLastError());
}

void layernorm_backward_input(ConstMatrixView<float> x, ConstMatrixView<float> dy,
                              const float* gamma, const float* mean, const float* rstd,
                              MatrixView<float> dx, cudaStream_t stream) {
  if (x.rows == 0) return;
  layernorm_backward_input_kernel<<<warp_rows_grid(x.rows), kThreads, 0, stream>>>(
      x.data, x.ld, dy.data, dy.ld, gamma, mean, rstd, dx.data, dx.ld, x.rows, x.cols);
  CUDA_CHECK(cudaGetLastError());
}

std::int64_t column_sums_partials(std::int64_t rows, std::int64_t cols) {
  return ((rows + kColumnRowsPerBlock - 1) / kColumnRowsPerBlock) * cols;
}

void column_sums(ConstMatrixView<float> dy, const float* x, std::int64_t ldx, const float* mean,
                 const float* rstd, float* sum_dy, float* sum_dy_xhat, float* partials,
                 cudaStream_t stream) {
  if (dy.rows == 0 || dy.cols == 0) return;
  const std::int64_t blocks = (dy.rows + kColumnRowsPerBlock - 1) / kColumnRowsPerBlock;
  const dim3 grid(static_cast<unsigned>((dy.cols + 31) / 32), static_cast<unsigned>(blocks));
  column_partials_kernel<<<grid, dim3(32, 8), 0, stream>>>(dy.data, dy.ld, x, ldx, mean, rstd,
                                                           partials, dy.rows, dy.cols);
  CUDA_CHECK(cudaGetLastError());
  column_finish_kernel<<<static_cast<unsigned>((dy.cols + kThreads - 1) / kThreads), kThreads, 0,
                         stream>>>(partials, blocks, dy.cols, sum_dy, sum_dy_xhat);
  CUDA_CHECK(cudaGetLastError());
}

void masked_softmax_forward(MatrixView<float> scores, float scale, const std::int64_t* key_mask,
                            std::int64_t rows_per_mask, float dropout, std::uint64_t seed,
                            float* dropped, cudaStream_t stream) {
  if (scores.rows == 0) return;
  const bool active = dropout > 0.0F;
  softmax_forward_kernel<<<warp_rows_grid(scores.rows), kThreads, 0, stream>>>(
      scores.data, scores.ld, scale, key_mask, rows_per_mask > 0 ? rows_per_mask : 1,
      stream_key(seed), active ? dropout_threshold(dropout) : 0U,
      active ? 1.0F / (1.0F - dropout) : 1.0F, active ? dropped : nullptr, scores.rows,
      scores.cols);
  CUDA_CHECK(cudaGetLastError());
}

void softmax_backward(ConstMatrixView<float> p, ConstMatrixView<float> dp, float scale,
                      float dropout, std::uint64_t seed, MatrixView<float> dx,
                      cudaStream_t stream) {
  if (p.rows == 0) return;
  const bool active = dropout > 0.0F;
  softmax_backward_kernel<<<warp_rows_grid(p.rows), kThreads, 0, stream>>>(
      p.data, p.ld, dp.data, dp.ld, scale, stream_key(seed),
      active ? dropout_threshold(dropout) : 0U, active ? 1.0F / (1.0F - dropout) : 1.0F, active,
      dx.data, dx.ld, p.rows, p.cols);
  CUDA_CHECK(cudaGetLastError());
}

void cross_entropy_rows(MatrixView<float> logits, const std::int64_t* labels, const float* weights,
                        float* loss_rows, unsigned long long* bad_row, cudaStream_t stream) {
  if (logits.rows == 0) return;
  cross_entropy_rows_kernel<<<static_cast<unsigned>(logits.rows), kThreads, 0, stream>>>(
      logits.data, logits.ld, labels, weights, loss_rows, bad_row, logits.cols);
  CUDA_CHECK(cudaGetLastError());
}

void cross_entropy_total(const float* loss_rows, const float* weights, std::int64_t rows,
                         double* result, cudaStream_t stream) {
  cross_entropy_total_kernel<<<1, kThreads, 0, stream>>>(loss_rows, weights, rows, result);
  CUDA_CHECK(cudaGetLastError());
}

void cross_entropy_backward(MatrixView<float> probs, const std::int64_t* labels,
                            const float* weights, float scale, const double* total_weight,
                            cudaStream_t stream) {
  if (probs.rows == 0) return;
  cross_entropy_backward_kernel<<<static_cast<unsigned>(probs.rows), kThreads, 0, stream>>>(
      probs.data, probs.ld, labels, weights, scale, total_weight, probs.cols);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace pf::kernels::cuda
