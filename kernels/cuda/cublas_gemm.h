#pragma once
// Row-major matrix products with cuBLAS, same contract as kernels::gemm / batched_gemm, on the
// handle's stream. fp32 storage; the precision picks cuBLAS's compute type (fp32, TF32 tensor
// cores, or BF16 tensor cores with fp32 accumulation).
#include "kernels/backend_ops.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/matrix_view.h"
#include "kernels/ops.h"

namespace pf::kernels::cuda {

cublasComputeType_t compute_type(GemmPrecision precision);

// c = alpha op(a) op(b) + beta c on device memory.
void gemm(CublasHandle& handle, ConstMatrixView<float> a, Transpose transpose_a,
          ConstMatrixView<float> b, Transpose transpose_b, MatrixView<float> c, float alpha = 1.0F,
          float beta = 0.0F, GemmPrecision precision = GemmPrecision::kFp32);

// count products, the i-th matrices stride_* elements after the (i-1)-th; a/b/c give the first
// matrix's shape and leading dimension.
void gemm_strided_batched(CublasHandle& handle, std::int64_t count, ConstMatrixView<float> a,
                          std::int64_t stride_a, Transpose transpose_a, ConstMatrixView<float> b,
                          std::int64_t stride_b, Transpose transpose_b, MatrixView<float> c,
                          std::int64_t stride_c, float alpha, float beta, GemmPrecision precision);

// count products on device arrays of pointers (a/b/c give shape and leading dimension; their
// data pointers are ignored).
void gemm_pointer_batched(CublasHandle& handle, std::int64_t count, ConstMatrixView<float> a,
                          const float* const* a_array, Transpose transpose_a,
                          ConstMatrixView<float> b, const float* const* b_array,
                          Transpose transpose_b, MatrixView<float> c, float* const* c_array,
                          float alpha, float beta, GemmPrecision precision);

// BF16 storage (the benchmarks' reference for autocast-style products): c (bf16) = op(a) op(b)
// with bf16 a, b and fp32 accumulation. Pointers are __nv_bfloat16 device arrays.
void gemm_bf16(CublasHandle& handle, const void* a, std::int64_t a_rows, std::int64_t a_cols,
               Transpose transpose_a, const void* b, std::int64_t b_rows, std::int64_t b_cols,
               Transpose transpose_b, void* c, std::int64_t c_rows, std::int64_t c_cols);

}  // namespace pf::kernels::cuda
