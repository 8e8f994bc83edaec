// Multi-tensor optimizer kernels: block b updates chunk b (at most kChunkElements of one tensor).
#include <cmath>

#include "kernels/cuda/cuda_check.h"
#include "runtime/optim/cuda/fused_kernels.h"

namespace pf::optim::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void adamw_kernel(const TensorEntry* tensors, const Chunk* chunks, AdamWScalars s) {
  const Chunk chunk = chunks[blockIdx.x];
  const TensorEntry t = tensors[chunk.tensor];
  const float decay = t.no_weight_decay ? 1.0F : s.decay_factor;
  for (std::int64_t i = chunk.begin + threadIdx.x; i < chunk.end; i += blockDim.x) {
    const float g = t.grad[i];
    const float m = s.beta1 * t.state0[i] + (1.0F - s.beta1) * g;
    const float v = s.beta2 * t.state1[i] + (1.0F - s.beta2) * g * g;
    t.state0[i] = m;
    t.state1[i] = v;
    t.value[i] = t.value[i] * decay - s.step_size * m / (sqrtf(v) * s.inv_sqrt_bc2 + s.eps);
  }
}

__global__ void sgd_kernel(const TensorEntry* tensors, const Chunk* chunks, SgdScalars s) {
  const Chunk chunk = chunks[blockIdx.x];
  const TensorEntry t = tensors[chunk.tensor];
  const float wd = t.no_weight_decay ? 0.0F : s.weight_decay;
  for (std::int64_t i = chunk.begin + threadIdx.x; i < chunk.end; i += blockDim.x) {
    const float d = t.grad[i] + wd * t.value[i];
    if (s.momentum == 0.0F) {
      t.value[i] -= s.learning_rate * d;
      continue;
    }
    const float b = s.buffer_decay * t.state0[i] + s.grad_keep * d;
    t.state0[i] = b;
    t.value[i] -= s.learning_rate * (s.nesterov ? d + s.momentum * b : b);
  }
}

__device__ double block_sum(double value) {
  __shared__ double shared[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_xor_sync(0xffffffffU, value, offset);
  __syncthreads();
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = value;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < kThreads / 32; ++w) total += shared[w];
  return total;
}

__global__ void square_sum_kernel(const TensorEntry* tensors, const Chunk* chunks,
                                  double* chunk_partials) {
  const Chunk chunk = chunks[blockIdx.x];
  const TensorEntry t = tensors[chunk.tensor];
  double total = 0.0;
  for (std::int64_t i = chunk.begin + threadIdx.x; i < chunk.end; i += blockDim.x) {
    const double g = t.grad[i];
    total += g * g;
  }
  total = block_sum(total);
  if (threadIdx.x == 0) chunk_partials[blockIdx.x] = total;
}

// *result += the partials in order: one block, each thread a fixed stride of them, then the
// threads' totals in thread order.
__global__ void add_partials_kernel(const double* partials, std::int64_t count, double* result) {
  double total = 0.0;
  for (std::int64_t i = threadIdx.x; i < count; i += blockDim.x) total += partials[i];
  total = block_sum(total);
  if (threadIdx.x == 0) *result += total;
}

// sums[2 t + k] += the partials of tensor t's chunks (consecutive), in chunk order: one thread
// per chunk that begins a tensor.
__global__ void add_tensor_partials_kernel(const Chunk* chunks, std::int64_t chunk_count,
                                           const double* chunk_partials, double* sums) {
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (first >= chunk_count) return;
  const int tensor = chunks[first].tensor;
  if (first > 0 && chunks[first - 1].tensor == tensor) return;
  double param_sq = 0.0;
  double update_sq = 0.0;
  for (std::int64_t c = first; c < chunk_count && chunks[c].tensor == tensor; ++c) {
    param_sq += chunk_partials[2 * c];
    update_sq += chunk_partials[2 * c + 1];
  }
  sums[2 * tensor] += param_sq;
  sums[2 * tensor + 1] += update_sq;
}

__device__ float lamb_update(const TensorEntry& t, const LambScalars& s, float wd, std::int64_t i) {
  return (t.state0[i] * s.inv_bc1) / (sqrtf(t.state1[i] * s.inv_bc2) + s.eps) + wd * t.value[i];
}

__global__ void lamb_moments_kernel(const TensorEntry* tensors, const Chunk* chunks, LambScalars s,
                                    double* chunk_partials) {
  const Chunk chunk = chunks[blockIdx.x];
  const TensorEntry t = tensors[chunk.tensor];
  const float wd = t.no_weight_decay ? 0.0F : s.weight_decay;
  double param_sq = 0.0;
  double update_sq = 0.0;
  for (std::int64_t i = chunk.begin + threadIdx.x; i < chunk.end; i += blockDim.x) {
    const float g = t.grad[i] * s.grad_scale;
    t.state0[i] = s.beta1 * t.state0[i] + (1.0F - s.beta1) * g;
    t.state1[i] = s.beta2 * t.state1[i] + (1.0F - s.beta2) * g * g;
    const double u = lamb_update(t, s, wd, i);
    const double p = t.value[i];
    param_sq += p * p;
    update_sq += u * u;
  }
  param_sq = block_sum(param_sq);
  update_sq = block_sum(update_sq);
  if (threadIdx.x == 0) {
    chunk_partials[2 * blockIdx.x] = param_sq;
    chunk_partials[2 * blockIdx.x + 1] = update_sq;
  }
}

__global__ void lamb_apply_kernel(const TensorEntry* tensors, const Chunk* chunks, LambScalars s,
                                  const double* sums) {
  const Chunk chunk = chunks[blockIdx.x];
  const TensorEntry t = tensors[chunk.tensor];
  const float wd = t.no_weight_decay ? 0.0F : s.weight_decay;
  const double param_sq = sums[2 * chunk.tensor];
  const double update_sq = sums[2 * chunk.tensor + 1];
  double ratio = 1.0;
  if ((wd != 0.0F || s.trust_ratio_without_decay) && param_sq > 0 && update_sq > 0) {
    ratio = sqrt(param_sq) / sqrt(update_sq);
  }
  const auto scaled_lr = static_cast<float>(s.learning_rate * ratio);
  for (std::int64_t i = chunk.begin + threadIdx.x; i < chunk.end; i += blockDim.x) {
    t.value[i] -= scaled_lr * lamb_update(t, s, wd, i);
  }
}

unsigned grid(std::int64_t chunk_count) {
  return static_cast<unsigned>(chunk_count);
}

}  // namespace

void adamw_step(const TensorEntry* tensors, const Chunk* chunks, std::int64_t chunk_count,
                AdamWScalars scalars, cudaStream_t stream) {
  if (chunk_count == 0) return;
  adamw_kernel<<<grid(chunk_count), kThreads, 0, stream>>>(tensors, chunks, scalars);
  CUDA_CHECK(cudaGetLastError());
}

void sgd_step(const TensorEntry* tensors, const Chunk* chunks, std::int64_t chunk_count,
              SgdScalars scalars, cudaStream_t stream) {
  if (chunk_count == 0) return;
  sgd_kernel<<<grid(chunk_count), kThreads, 0, stream>>>(tensors, chunks, scalars);
  CUDA_CHECK(cudaGetLastError());
}

void grad_square_sum(const TensorEntry* tensors, const Chunk* chunks, std::int64_t chunk_count,
                     double* result, double* chunk_partials, cudaStream_t stream) {
  if (chunk_count == 0) return;
  square_sum_kernel<<<grid(chunk_count), kThreads, 0, stream>>>(tensors, chunks, chunk_partials);
  CUDA_CHECK(cudaGetLastError());
  add_partials_kernel<<<1, kThreads, 0, stream>>>(chunk_partials, chunk_count, result);
  CUDA_CHECK(cudaGetLastError());
}

void lamb_moments(const TensorEntry* tensors, const Chunk* chunks, std::int64_t chunk_count,
                  LambScalars scalars, double* sums, double* chunk_partials, cudaStream_t stream) {
  if (chunk_count == 0) return;
  lamb_moments_kernel<<<grid(chunk_count), kThreads, 0, stream>>>(tensors, chunks, scalars,
                                                                  chunk_partials);
  CUDA_CHECK(cudaGetLastError());
  const auto blocks = static_cast<unsigned>((chunk_count + kThreads - 1) / kThreads);
  add_tensor_partials_kernel<<<blocks, kThreads, 0, stream>>>(chunks, chunk_count, chunk_partials,
                                                              sums);
  CUDA_CHECK(cudaGetLastError());
}

void lamb_apply(const TensorEntry* tensors, const Chunk* chunks, std::int64_t chunk_count,
                LambScalars scalars, const double* sums, cudaStream_t stream) {
  if (chunk_count == 0) return;
  lamb_apply_kernel<<<grid(chunk_count), kThreads, 0, stream>>>(tensors, chunks, scalars, sums);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace pf::optim::cuda
