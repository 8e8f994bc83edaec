#pragma once
// Row-major matrix products with cuBLAS, same contract as kernels::gemm.
#include "kernels/cuda/cuda_backend.h"
#include "kernels/matrix_view.h"
#include "kernels/ops.h"

namespace pf::kernels::cuda {

// c = alpha op(a) op(b) + beta c on device memory, on the handle's stream.
void gemm(CublasHandle& handle, ConstMatrixView<float> a, Transpose transpose_a,
          ConstMatrixView<float> b, Transpose transpose_b, MatrixView<float> c, float alpha = 1.0F,
          float beta = 0.0F);

}  // namespace pf::kernels::cuda
