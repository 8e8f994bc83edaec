// Reductions over a contiguous array: sum and sum of squares accumulated in double, and the
// non-finite check. The sums are deterministic: each block's partial goes to scratch and one
// block adds them in a fixed order (atomic adds would vary run to run in the last bits, and so
// would a training run's gradient clipping).
#include <cmath>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops_cuda.h"

namespace pf::kernels::cuda {
namespace {

// The block's threads' values added in a fixed order (warps, then the warps in order); the
// total is thread 0's.
__device__ double block_total(double value) {
  __shared__ double shared[kWarpsPerBlock];
  value = warp_sum(value);
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = value;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarpsPerBlock; ++w) value += shared[w];
  }
  return value;
}

__global__ void sum_kernel(const float* x, std::int64_t count, bool squares, double* partials) {
  double total = 0.0;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const double value = x[i];
    total += squares ? value * value : value;
  }
  total = block_total(total);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// *result += partials[0..count) in a fixed order (one block).
__global__ void add_partials_kernel(const double* partials, unsigned count, double* result) {
  double total = 0.0;
  for (unsigned i = threadIdx.x; i < count; i += blockDim.x) total += partials[i];
  total = block_total(total);
  if (threadIdx.x == 0) *result += total;
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
  const auto most = static_cast<unsigned>(kMaxReductionBlocks);
  return blocks < most ? blocks : most;  // each thread loops
}

}  // namespace

void sum(const float* x, std::int64_t count, bool squares, double* result, double* partials,
         cudaStream_t stream) {
  if (count == 0) return;
  const unsigned blocks = reduction_grid(count);
  sum_kernel<<<blocks, kThreads, 0, stream>>>(x, count, squares, partials);
  CUDA_CHECK(cudaGetLastError());
  add_partials_kernel<<<1, kThreads, 0, stream>>>(partials, blocks, result);
  CUDA_CHECK(cudaGetLastError());
}

void find_non_finite(const float* x, std::int64_t count, unsigned int* non_finite,
                     cudaStream_t stream) {
  if (count == 0) return;
  non_finite_kernel<<<reduction_grid(count), kThreads, 0, stream>>>(x, count, non_finite);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace pf::kernels::cuda
