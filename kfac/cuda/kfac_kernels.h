#pragma once
// Launchers of the small K-FAC kernels on d x d column-major matrices (kfac_kernels.cu).
#include <cuda_runtime.h>

#include <cstdint>

namespace pf::kfac::cuda {

void fill_upper_from_lower(float* matrix, std::int64_t d, cudaStream_t stream);
void symmetrize(float* matrix, std::int64_t d, cudaStream_t stream);
void add_to_diagonal(float* matrix, std::int64_t d, float value, cudaStream_t stream);
// columns (n x width, column-major, leading dimension n) = the identity's columns first ..
// first + width - 1: zero but for a 1 in row first + j of column j.
void set_unit_columns(float* columns, std::int64_t n, std::int64_t first, std::int64_t width,
                      cudaStream_t stream);
// matrix = alpha * matrix + beta * other
void blend(float* matrix, const float* other, std::int64_t count, float alpha, float beta,
           cudaStream_t stream);
// *trace = sum of the diagonal, in double.
void trace(const float* matrix, std::int64_t d, double* result, cudaStream_t stream);
// scaled[:, j] = vectors[:, j] / (max(values[j], 0) + damping)
void scale_columns(const float* vectors, const float* values, std::int64_t d, float damping,
                   float* scaled, cudaStream_t stream);

}  // namespace pf::kfac::cuda
