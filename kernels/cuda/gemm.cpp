// Row-major products with cuBLAS (column-major): C = op(A) op(B) is computed as
// C^T = op(B)^T op(A)^T, where a row-major matrix is its column-major transpose.
#include <string>

#include "kernels/cuda/cublas_gemm.h"
#include "kernels/cuda/cuda_check.h"

namespace pf::kernels::cuda {
namespace {

struct Dims {
  int m = 0, n = 0, k = 0;
};

std::string dims(std::int64_t rows, std::int64_t cols) {
  return std::to_string(rows) + "x" + std::to_string(cols);
}

template <typename A, typename B, typename C>
Dims check(const A& a, bool ta, const B& b, bool tb, const C& c, const char* op) {
  const auto m = ta ? a.cols : a.rows;
  const auto k = ta ? a.rows : a.cols;
  const auto k2 = tb ? b.cols : b.rows;
  const auto n = tb ? b.rows : b.cols;
  require(
      k == k2 && c.rows == m && c.cols == n, op,
      "op(a) " + dims(m, k) + " times op(b) " + dims(k2, n) + " into c " + dims(c.rows, c.cols));
  return {static_cast<int>(m), static_cast<int>(n), static_cast<int>(k)};
}

cublasOperation_t op(bool transpose) {
  return transpose ? CUBLAS_OP_T : CUBLAS_OP_N;
}

void require_fp32_operand_precision(GemmPrecision precision, const char* name) {
  require(precision != GemmPrecision::kBf16Operands, name,
          "bf16-operands needs bf16 operands: convert them and call the *_bf16_operands product "
          "(CudaOps does both)");
}

}  // namespace

cublasComputeType_t compute_type(GemmPrecision precision) {
  switch (precision) {
    case GemmPrecision::kTf32:
      return CUBLAS_COMPUTE_32F_FAST_TF32;
    case GemmPrecision::kBf16:
      return CUBLAS_COMPUTE_32F_FAST_16BF;
    case GemmPrecision::kFp32:
    case GemmPrecision::kBf16Operands:
      break;
  }
  return CUBLAS_COMPUTE_32F;
}

void gemm(CublasHandle& handle, ConstMatrixView<float> a, Transpose transpose_a,
          ConstMatrixView<float> b, Transpose transpose_b, MatrixView<float> c, float alpha,
          float beta, GemmPrecision precision) {
  const bool ta = transpose_a == Transpose::kYes;
  const bool tb = transpose_b == Transpose::kYes;
  require_fp32_operand_precision(precision, "cuda::gemm");
  const Dims d = check(a, ta, b, tb, c, "cuda::gemm");
  if (d.m == 0 || d.n == 0) return;
  CUBLAS_CHECK(cublasGemmEx(handle.get(), op(tb), op(ta), d.n, d.m, d.k, &alpha, b.data, CUDA_R_32F,
                            static_cast<int>(b.ld), a.data, CUDA_R_32F, static_cast<int>(a.ld),
                            &beta, c.data, CUDA_R_32F, static_cast<int>(c.ld),
                            compute_type(precision), CUBLAS_GEMM_DEFAULT));
}

void gemm_strided_batched(CublasHandle& handle, std::int64_t count, ConstMatrixView<float> a,
                          std::int64_t stride_a, Transpose transpose_a, ConstMatrixView<float> b,
                          std::int64_t stride_b, Transpose transpose_b, MatrixView<float> c,
                          std::int64_t stride_c, float alpha, float beta, GemmPrecision precision) {
  require(count >= 0, "cuda::batched_gemm", "negative batch count");
  require_fp32_operand_precision(precision, "cuda::batched_gemm");
  const bool ta = transpose_a == Transpose::kYes;
  const bool tb = transpose_b == Transpose::kYes;
  const Dims d = check(a, ta, b, tb, c, "cuda::batched_gemm");
  if (d.m == 0 || d.n == 0 || count == 0) return;
  CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      handle.get(), op(tb), op(ta), d.n, d.m, d.k, &alpha, b.data, CUDA_R_32F,
      static_cast<int>(b.ld), stride_b, a.data, CUDA_R_32F, static_cast<int>(a.ld), stride_a, &beta,
      c.data, CUDA_R_32F, static_cast<int>(c.ld), stride_c, static_cast<int>(count),
      compute_type(precision), CUBLAS_GEMM_DEFAULT));
}

void gemm_pointer_batched(CublasHandle& handle, std::int64_t count, ConstMatrixView<float> a,
                          const float* const* a_array, Transpose transpose_a,
                          ConstMatrixView<float> b, const float* const* b_array,
                          Transpose transpose_b, MatrixView<float> c, float* const* c_array,
                          float alpha, float beta, GemmPrecision precision) {
  const bool ta = transpose_a == Transpose::kYes;
  const bool tb = transpose_b == Transpose::kYes;
  require_fp32_operand_precision(precision, "cuda::gemm_pointer_batched");
  const Dims d = check(a, ta, b, tb, c, "cuda::gemm_pointer_batched");
  if (d.m == 0 || d.n == 0 || count == 0) return;
  CUBLAS_CHECK(cublasGemmBatchedEx(
      handle.get(), op(tb), op(ta), d.n, d.m, d.k, &alpha,
      reinterpret_cast<const void* const*>(b_array), CUDA_R_32F, static_cast<int>(b.ld),
      reinterpret_cast<const void* const*>(a_array), CUDA_R_32F, static_cast<int>(a.ld), &beta,
      reinterpret_cast<void* const*>(c_array), CUDA_R_32F, static_cast<int>(c.ld),
      static_cast<int>(count), compute_type(precision), CUBLAS_GEMM_DEFAULT));
}

void gemm_bf16_operands(CublasHandle& handle, ConstMatrixView<__nv_bfloat16> a,
                        Transpose transpose_a, ConstMatrixView<__nv_bfloat16> b,
                        Transpose transpose_b, MatrixView<float> c, float alpha, float beta) {
  const bool ta = transpose_a == Transpose::kYes;
  const bool tb = transpose_b == Transpose::kYes;
  const Dims d = check(a, ta, b, tb, c, "cuda::gemm_bf16_operands");
  if (d.m == 0 || d.n == 0) return;
  CUBLAS_CHECK(cublasGemmEx(handle.get(), op(tb), op(ta), d.n, d.m, d.k, &alpha, b.data,
                            CUDA_R_16BF, static_cast<int>(b.ld), a.data, CUDA_R_16BF,
                            static_cast<int>(a.ld), &beta, c.data, CUDA_R_32F,
                            static_cast<int>(c.ld), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void gemm_strided_batched_bf16_operands(CublasHandle& handle, std::int64_t count,
                                        ConstMatrixView<__nv_bfloat16> a, std::int64_t stride_a,
                                        Transpose transpose_a, ConstMatrixView<__nv_bfloat16> b,
                                        std::int64_t stride_b, Transpose transpose_b,
                                        MatrixView<float> c, std::int64_t stride_c, float alpha,
                                        float beta) {
  require(count >= 0, "cuda::batched_gemm_bf16_operands", "negative batch count");
  const bool ta = transpose_a == Transpose::kYes;
  const bool tb = transpose_b == Transpose::kYes;
  const Dims d = check(a, ta, b, tb, c, "cuda::batched_gemm_bf16_operands");
  if (d.m == 0 || d.n == 0 || count == 0) return;
  CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      handle.get(), op(tb), op(ta), d.n, d.m, d.k, &alpha, b.data, CUDA_R_16BF,
      static_cast<int>(b.ld), stride_b, a.data, CUDA_R_16BF, static_cast<int>(a.ld), stride_a,
      &beta, c.data, CUDA_R_32F, static_cast<int>(c.ld), stride_c, static_cast<int>(count),
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void gemm_pointer_batched_bf16_operands(CublasHandle& handle, std::int64_t count,
                                        ConstMatrixView<__nv_bfloat16> a,
                                        const __nv_bfloat16* const* a_array, Transpose transpose_a,
                                        ConstMatrixView<__nv_bfloat16> b,
                                        const __nv_bfloat16* const* b_array, Transpose transpose_b,
                                        MatrixView<float> c, float* const* c_array, float alpha,
                                        float beta) {
  const bool ta = transpose_a == Transpose::kYes;
  const bool tb = transpose_b == Transpose::kYes;
  const Dims d = check(a, ta, b, tb, c, "cuda::gemm_pointer_batched_bf16_operands");
  if (d.m == 0 || d.n == 0 || count == 0) return;
  CUBLAS_CHECK(cublasGemmBatchedEx(
      handle.get(), op(tb), op(ta), d.n, d.m, d.k, &alpha,
      reinterpret_cast<const void* const*>(b_array), CUDA_R_16BF, static_cast<int>(b.ld),
      reinterpret_cast<const void* const*>(a_array), CUDA_R_16BF, static_cast<int>(a.ld), &beta,
      reinterpret_cast<void* const*>(c_array), CUDA_R_32F, static_cast<int>(c.ld),
      static_cast<int>(count), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void gemm_bf16(CublasHandle& handle, const void* a, std::int64_t a_rows, std::int64_t a_cols,
               Transpose transpose_a, const void* b, std::int64_t b_rows, std::int64_t b_cols,
               Transpose transpose_b, void* c, std::int64_t c_rows, std::int64_t c_cols) {
  const bool ta = transpose_a == Transpose::kYes;
  const bool tb = transpose_b == Transpose::kYes;
  const ConstMatrixView<float> shape_a(nullptr, a_rows, a_cols);
  const ConstMatrixView<float> shape_b(nullptr, b_rows, b_cols);
  const MatrixView<float> shape_c(nullptr, c_rows, c_cols);
  const Dims d = check(shape_a, ta, shape_b, tb, shape_c, "cuda::gemm_bf16");
  if (d.m == 0 || d.n == 0) return;
  const float alpha = 1.0F;
  const float beta = 0.0F;
  CUBLAS_CHECK(cublasGemmEx(handle.get(), op(tb), op(ta), d.n, d.m, d.k, &alpha, b, CUDA_R_16BF,
                            static_cast<int>(b_cols), a, CUDA_R_16BF, static_cast<int>(a_cols),
                            &beta, c, CUDA_R_16BF, static_cast<int>(c_cols), CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
}

}  // namespace pf::kernels::cuda
