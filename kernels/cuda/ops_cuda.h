#pragma once
// CUDA implementations of some ops of kernels/ops.h, on device memory, asynchronous on `stream`.
// Same semantics as the CPU ops (the dropout mask is the same counter-based one, bit for bit).
// C++17 (this header is compiled by nvcc).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/matrix_view.h"
#include "kernels/ops.h"

namespace pf::kernels::cuda {

void bias_gelu_forward(MatrixView<float> x, const float* bias, MatrixView<float> y,
                       cudaStream_t stream);
void gelu_backward(ConstMatrixView<float> x, ConstMatrixView<float> dy, MatrixView<float> dx,
                   cudaStream_t stream);
void dropout_forward(ConstMatrixView<float> x, MatrixView<float> y, float probability,
                     std::uint64_t seed, std::uint64_t index_offset, cudaStream_t stream);
void dropout_backward(ConstMatrixView<float> dy, MatrixView<float> dx, float probability,
                      std::uint64_t seed, std::uint64_t index_offset, cudaStream_t stream);
}  // namespace pf::kernels::cuda
