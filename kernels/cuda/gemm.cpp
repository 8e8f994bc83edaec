// Row-major products with cuBLAS (column-major): C = op(A) op(B) is computed as
// C^T = op(B)^T op(A)^T, where a row-major matrix is its column-major transpose.
#include "kernels/cuda/cublas_gemm.h"
#include "kernels/cuda/cuda_check.h"

namespace pf::kernels::cuda {

void gemm(CublasHandle& handle, ConstMatrixView<float> a, Transpose transpose_a,
          ConstMatrixView<float> b, Transpose transpose_b, MatrixView<float> c, float alpha,
          float beta) {
  const bool ta = transpose_a == Transpose::kYes;
  const bool tb = transpose_b == Transpose::kYes;
  const auto m = ta ? a.cols : a.rows;
  const auto k = ta ? a.rows : a.cols;
  const auto n = tb ? b.rows : b.cols;
  require((tb ? b.cols : b.rows) == k && c.rows == m && c.cols == n, "cuda::gemm",
          "shape mismatch");
  if (m == 0 || n == 0) return;
  CUBLAS_CHECK(cublasSgemm(handle.get(), tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                           ta ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                           static_cast<int>(k), &alpha, b.data, static_cast<int>(b.ld), a.data,
                           static_cast<int>(a.ld), &beta, c.data, static_cast<int>(c.ld)));
}

}  // namespace pf::kernels::cuda
