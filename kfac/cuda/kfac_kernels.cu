// Small elementwise kernels of the K-FAC factors (column-major d x d).
#include "kernels/cuda/cuda_check.h"
#include "kfac/cuda/kfac_kernels.h"

namespace pf::kfac::cuda {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(std::int64_t count) {
  const std::int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

// Element (i, j) of a column-major matrix is at i + j * d.
__global__ void fill_upper_kernel(float* m, std::int64_t d) {
  for (std::int64_t index = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       index < d * d; index += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i = index % d;
    const std::int64_t j = index / d;
    if (i < j) m[i + j * d] = m[j + i * d];
  }
}

__global__ void symmetrize_kernel(float* m, std::int64_t d) {
  for (std::int64_t index = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       index < d * d; index += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i = index % d;
    const std::int64_t j = index / d;
    if (i < j) {
      const float mean = 0.5F * (m[i + j * d] + m[j + i * d]);
      m[i + j * d] = mean;
      m[j + i * d] = mean;
    }
  }
}

__global__ void diagonal_kernel(float* m, std::int64_t d, float value) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < d) m[i + i * d] += value;
}

__global__ void unit_columns_kernel(float* columns, std::int64_t n, std::int64_t first,
                                    std::int64_t width) {
  for (std::int64_t index = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       index < n * width; index += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i = index % n;
    const std::int64_t j = index / n;
    columns[index] = i == first + j ? 1.0F : 0.0F;
  }
}

__global__ void blend_kernel(float* m, const float* other, std::int64_t count, float alpha,
                             float beta) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    m[i] = alpha * m[i] + beta * other[i];
  }
}

__global__ void trace_kernel(const float* m, std::int64_t d, double* result) {
  __shared__ double shared[kThreads];
  double total = 0.0;
  for (std::int64_t i = threadIdx.x; i < d; i += blockDim.x) total += m[i + i * d];
  shared[threadIdx.x] = total;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (static_cast<int>(threadIdx.x) < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) *result = shared[0];
}

__global__ void scale_columns_kernel(const float* vectors, const float* values, std::int64_t d,
                                     float damping, float* scaled) {
  for (std::int64_t index = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       index < d * d; index += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t j = index / d;
    scaled[index] = vectors[index] / (fmaxf(values[j], 0.0F) + damping);
  }
}

}  // namespace

void fill_upper_from_lower(float* matrix, std::int64_t d, cudaStream_t stream) {
  fill_upper_kernel<<<blocks_for(d * d), kThreads, 0, stream>>>(matrix, d);
  CUDA_CHECK(cudaGetLastError());
}

void symmetrize(float* matrix, std::int64_t d, cudaStream_t stream) {
  symmetrize_kernel<<<blocks_for(d * d), kThreads, 0, stream>>>(matrix, d);
  CUDA_CHECK(cudaGetLastError());
}

void add_to_diagonal(float* matrix, std::int64_t d, float value, cudaStream_t stream) {
  diagonal_kernel<<<blocks_for(d), kThreads, 0, stream>>>(matrix, d, value);
  CUDA_CHECK(cudaGetLastError());
}

void set_unit_columns(float* columns, std::int64_t n, std::int64_t first, std::int64_t width,
                      cudaStream_t stream) {
  unit_columns_kernel<<<blocks_for(n * width), kThreads, 0, stream>>>(columns, n, first, width);
  CUDA_CHECK(cudaGetLastError());
}

void blend(float* matrix, const float* other, std::int64_t count, float alpha, float beta,
           cudaStream_t stream) {
  blend_kernel<<<blocks_for(count), kThreads, 0, stream>>>(matrix, other, count, alpha, beta);
  CUDA_CHECK(cudaGetLastError());
}

void trace(const float* matrix, std::int64_t d, double* result, cudaStream_t stream) {
  trace_kernel<<<1, kThreads, 0, stream>>>(matrix, d, result);
  CUDA_CHECK(cudaGetLastError());
}

void scale_columns(const float* vectors, const float* values, std::int64_t d, float damping,
                   float* scaled, cudaStream_t stream) {
  scale_columns_kernel<<<blocks_for(d * d), kThreads, 0, stream>>>(vectors, values, d, damping,
                                                                   scaled);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace pf::kfac::cuda
