#pragma once
// The multi-tensor kernels of the fused optimizers (fused_kernels.cu). Tensor entries and chunks
// live in device memory, built by MultiTensorTable.
#include <cuda_runtime.h>

#include <cstdint>

namespace pf::optim::cuda {

struct TensorEntry {
  float* value;
  const float* grad;
  float* state0;  // exp_avg, or the momentum buffer
  float* state1;  // exp_avg_sq (null for SGD)
  std::int64_t size;
  int no_weight_decay;
};

struct Chunk {
  int tensor;
  std::int64_t begin;
  std::int64_t end;
};

inline constexpr std::int64_t kChunkElements = 16384;

struct AdamWScalars {
  float beta1, beta2, eps, step_size, inv_sqrt_bc2, decay_factor;  // decay_factor = 1 - lr * wd
};
void adamw_step(const TensorEntry* tensors, const Chunk* chunks, std::int64_t chunk_count,
                AdamWScalars scalars, cudaStream_t stream);

struct SgdScalars {
  float learning_rate, momentum, buffer_decay, grad_keep, weight_decay;
  bool nesterov;
};
void sgd_step(const TensorEntry* tensors, const Chunk* chunks, std::int64_t chunk_count,
              SgdScalars scalars, cudaStream_t stream);

// The norms are deterministic: each chunk's partial sum goes to `chunk_partials` (scratch of
// the given size) and the partials are added in chunk order, so a run repeats bit for bit (no
// atomic adds, whose order varies).
// *result += sum of squares of every gradient (double); chunk_partials: chunk_count doubles.
void grad_square_sum(const TensorEntry* tensors, const Chunk* chunks, std::int64_t chunk_count,
                     double* result, double* chunk_partials, cudaStream_t stream);

struct LambScalars {
  float beta1, beta2, eps, inv_bc1, inv_bc2, grad_scale, weight_decay;
  double learning_rate;
  bool trust_ratio_without_decay;
};
// Moments, then sums[2 t] += ||p_t||^2, sums[2 t + 1] += ||u_t||^2 (a tensor's chunks are
// consecutive); chunk_partials: 2 chunk_count doubles.
void lamb_moments(const TensorEntry* tensors, const Chunk* chunks, std::int64_t chunk_count,
                  LambScalars scalars, double* sums, double* chunk_partials, cudaStream_t stream);
// p -= lr * ratio_t * u.
void lamb_apply(const TensorEntry* tensors, const Chunk* chunks, std::int64_t chunk_count,
                LambScalars scalars, const double* sums, cudaStream_t stream);

}  // namespace pf::optim::cuda
