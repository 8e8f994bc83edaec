#pragma once
// Launch geometry and warp reductions shared by the CUDA kernels (included by .cu files only).
#include <cstdint>

namespace pf::kernels::cuda {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

// Enough blocks to cover `count` threads, capped (the kernels loop with a grid stride).
inline unsigned grid_for(std::int64_t count) {
  const std::int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

// Blocks for one warp per row.
inline unsigned warp_rows_grid(std::int64_t rows) {
  return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

template <typename T>
__device__ inline T warp_sum(T value) {
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_xor_sync(0xffffffffU, value, offset);
  return value;
}

__device__ inline float warp_max(float value) {
  for (int offset = 16; offset > 0; offset /= 2) {
    value = fmaxf(value, __shfl_xor_sync(0xffffffffU, value, offset));
  }
  return value;
}

}  // namespace pf::kernels::cuda
