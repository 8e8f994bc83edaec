// Reductions over a contiguous array: sum and sum of squares accumulated in double (one atomic
// add per block), and the non-finite check.
#include <cmath>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops_cuda.h"

namespace pf::kernels::cuda {
namespace {

__global__ void sum_kernel(const float* x, std::int64_t count, bool squares, double* result) {
  __shared__ double shared[kWarpsPerBlock];
  double total = 0.0;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const double value = x[i];
    total += squares ? value * value : value;
  }
  total = warp_sum(total);
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = total;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarpsPerBlock; ++w) total += shared[w];
    atomicAdd(result, total);
  }
}

__global__ void non_finite_kernel(const float* x, std::int64_t count, unsigned int* non_finite) {
  bool bad = false;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    bad = bad || !isfinite(x[i]);
  }
  if (__any_sync(0xffffffffU, bad) && threadIdx.x % 32 == 0) *non_finite = 1U;
}

unsigned reduction_grid(std::int64_t count) {
  const unsigned blocks = grid_for(count);
  return blocks < 1024U ? blocks : 1024U;  // few atomics; each thread loops
}

}  // namespace

void sum(const float* x, std::int64_t count, bool squares, double* result, cudaStream_t stream) {
  if (count == 0) return;
  sum_kernel<<<reduction_grid(count), kThreads, 0, stream>>>(x, count, squares, result);
  CUDA_CHECK(cudaGetLastError());
}

void find_non_finite(const float* x, std::int64_t count, unsigned int* non_finite,
                     cudaStream_t stream) {
  if (count == 0) return;
  non_finite_kernel<<<reduction_grid(count), kThreads, 0, stream>>>(x, count, non_finite);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace pf::kernels::cuda
