#pragma once
// Row-major matrix products with cuBLAS, same contract as kernels::gemm / batched_gemm, on the
// handle's stream. fp32 storage; the precision picks cuBLAS's compute type (fp32, TF32 tensor
// cores, or BF16 tensor cores with fp32 accumulation). The *_bf16_operands products take bf16
// operands (GemmPrecision::kBf16Operands: CudaOps rounds its fp32 operands into them first).
#include <cuda_bf16.h>

#include "kernels/backend_ops.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/matrix_view.h"
#include "kernels/ops.h"

namespace pf::kernels::cuda {

// kBf16Operands maps to CUBLAS_COMPUTE_32F: its operands are bf16 already, accumulation is fp32.
cublasComputeType_t compute_type(GemmPrecision precision);

// c = alpha op(a) op(b) + beta c on device memory. The fp32-operand products refuse
// kBf16Operands (std::invalid_argument): its operands must be converted first (CudaOps does).
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

// c (fp32) = alpha op(a) op(b) + beta c with bf16 a and b, fp32 accumulation (cuBLAS's bf16
// tensor-core kernels read the operands as they are stored).
void gemm_bf16_operands(CublasHandle& handle, ConstMatrixView<__nv_bfloat16> a,
                        Transpose transpose_a, ConstMatrixView<__nv_bfloat16> b,
                        Transpose transpose_b, MatrixView<float> c, float alpha, float beta);
void gemm_strided_batched_bf16_operands(CublasHandle& handle, std::int64_t count,
                                        ConstMatrixView<__nv_bfloat16> a, std::int64_t stride_a,
                                        Transpose transpose_a, ConstMatrixView<__nv_bfloat16> b,
                                        std::int64_t stride_b, Transpose transpose_b,
                                        MatrixView<float> c, std::int64_t stride_c, float alpha,
                                        float beta);
// a/b/c give shape and leading dimension; their data pointers are ignored.
void gemm_pointer_batched_bf16_operands(CublasHandle& handle, std::int64_t count,
                                        ConstMatrixView<__nv_bfloat16> a,
                                        const __nv_bfloat16* const* a_array, Transpose transpose_a,
                                        ConstMatrixView<__nv_bfloat16> b,
                                        const __nv_bfloat16* const* b_array, Transpose transpose_b,
                                        MatrixView<float> c, float* const* c_array, float alpha,
                                        float beta);

// BF16 storage (the benchmarks' reference for autocast-style products): c (bf16) = op(a) op(b)
// with bf16 a, b and fp32 accumulation. Pointers are __nv_bfloat16 device arrays.
void gemm_bf16(CublasHandle& handle, const void* a, std::int64_t a_rows, std::int64_t a_cols,
               Transpose transpose_a, const void* b, std::int64_t b_rows, std::int64_t b_cols,
               Transpose transpose_b, void* c, std::int64_t c_rows, std::int64_t c_cols);

}  // namespace pf::kernels::cuda
