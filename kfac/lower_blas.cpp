#include "kfac/lower_blas.h"

#include <Eigen/Cholesky>
#include <algorithm>
#include <stdexcept>
#include <string>

#if PF_HAVE_CBLAS
#include <cblas.h>
// LAPACK's Cholesky from OpenBLAS (which exports it; Debian's build has no LAPACK header).
extern "C" void spotrf_(const char* uplo, const blasint* n, float* a, const blasint* lda,
                        blasint* info);
#endif

#include "kernels/cpu/blas_threads.h"
#include "kernels/cpu/dense_library.h"

namespace pf::kfac {

namespace {

#if PF_HAVE_CBLAS
template <typename Matrix>
blasint leading(const Matrix& m) {
  return static_cast<blasint>(std::max<Eigen::Index>(m.outerStride(), 1));
}
#endif

}  // namespace

void syrk_lower(Eigen::Ref<Eigen::MatrixXf> sum, const Eigen::Ref<const Eigen::MatrixXf>& slice,
                float alpha) {
#if PF_HAVE_CBLAS
  if (kernels::cpu::use_openblas()) {
    kernels::cpu::use_one_blas_thread_per_call();
    cblas_ssyrk(CblasColMajor, CblasLower, CblasNoTrans, static_cast<blasint>(slice.rows()),
                static_cast<blasint>(slice.cols()), alpha, slice.data(), leading(slice), 1.0F,
                sum.data(), leading(sum));
    return;
  }
#endif
  sum.selfadjointView<Eigen::Lower>().rankUpdate(slice, alpha);
}

void solve_lower(const Eigen::Ref<const Eigen::MatrixXf>& lower, Eigen::Ref<Eigen::MatrixXf> rhs,
                 bool transposed) {
#if PF_HAVE_CBLAS
  if (kernels::cpu::use_openblas()) {
    kernels::cpu::use_one_blas_thread_per_call();
    cblas_strsm(CblasColMajor, CblasLeft, CblasLower, transposed ? CblasTrans : CblasNoTrans,
                CblasNonUnit, static_cast<blasint>(rhs.rows()), static_cast<blasint>(rhs.cols()),
                1.0F, lower.data(), leading(lower), rhs.data(), leading(rhs));
    return;
  }
#endif
  if (transposed) {
    lower.triangularView<Eigen::Lower>().transpose().solveInPlace(rhs);
  } else {
    lower.triangularView<Eigen::Lower>().solveInPlace(rhs);
  }
}

void solve_lower_transposed_on_the_right(const Eigen::Ref<const Eigen::MatrixXf>& lower,
                                         Eigen::Ref<Eigen::MatrixXf> rhs) {
#if PF_HAVE_CBLAS
  if (kernels::cpu::use_openblas()) {
    kernels::cpu::use_one_blas_thread_per_call();
    cblas_strsm(CblasColMajor, CblasRight, CblasLower, CblasTrans, CblasNonUnit,
                static_cast<blasint>(rhs.rows()), static_cast<blasint>(rhs.cols()), 1.0F,
                lower.data(), leading(lower), rhs.data(), leading(rhs));
    return;
  }
#endif
  lower.triangularView<Eigen::Lower>().transpose().solveInPlace<Eigen::OnTheRight>(rhs);
}

bool cholesky_lower(Eigen::Ref<Eigen::MatrixXf> matrix) {
  if (matrix.rows() != matrix.cols()) {
    throw std::invalid_argument("cholesky_lower: matrix is " + std::to_string(matrix.rows()) +
                                " x " + std::to_string(matrix.cols()) + ", expected square");
  }
  if (matrix.rows() == 0) return true;
#if PF_HAVE_CBLAS
  if (kernels::cpu::use_openblas()) {
    kernels::cpu::use_one_blas_thread_per_call();
    const char lower = 'L';
    const auto n = static_cast<blasint>(matrix.rows());
    const blasint lda = leading(matrix);
    blasint info = 0;
    spotrf_(&lower, &n, matrix.data(), &lda, &info);
    if (info < 0) {
      throw std::logic_error("cholesky_lower: spotrf rejected argument " + std::to_string(-info));
    }
    return info == 0;
  }
#endif
  const Eigen::LLT<Eigen::Ref<Eigen::MatrixXf>, Eigen::Lower> llt(matrix);  // in place
  return llt.info() == Eigen::Success;
}

}  // namespace pf::kfac
