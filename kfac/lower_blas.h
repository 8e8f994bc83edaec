#pragma once
// The dense kernels of K-FAC's curvature and inversion on lower triangles, each on the calling
// thread: OpenBLAS (CBLAS and its LAPACK potrf) where CMake found it (PF_HAVE_CBLAS) and the
// process chose it (kernels/cpu/dense_library.h), Eigen otherwise. One thread per call, as the
// matrix products (kernels/cpu/gemm.cpp): the callers cut the work by shape and spread it over
// OpenMP threads, so the bits do not depend on the thread count. OpenBLAS's kernels were 1.4-2x
// Eigen's on an AVX2 Zen (docs/benchmarks.md).
#include "kfac/eigen_core.h"

namespace pf::kfac {

// sum's lower triangle += alpha * slice slice^T (SYRK); the upper triangle is not touched.
void syrk_lower(Eigen::Ref<Eigen::MatrixXf> sum, const Eigen::Ref<const Eigen::MatrixXf>& slice,
                float alpha);

// rhs := L^-1 rhs, or L^-T rhs with `transposed`; L the lower triangle of `lower` (TRSM, left).
void solve_lower(const Eigen::Ref<const Eigen::MatrixXf>& lower, Eigen::Ref<Eigen::MatrixXf> rhs,
                 bool transposed);

// rhs := rhs L^-T; L the lower triangle of `lower` (TRSM, right: a Cholesky panel).
void solve_lower_transposed_on_the_right(const Eigen::Ref<const Eigen::MatrixXf>& lower,
                                         Eigen::Ref<Eigen::MatrixXf> rhs);

// The lower triangle of the square `matrix` becomes L with L L^T = matrix (its lower triangle
// read; the upper triangle not touched). False when the matrix is not positive definite in fp32
// (the lower triangle is then partly overwritten).
bool cholesky_lower(Eigen::Ref<Eigen::MatrixXf> matrix);

}  // namespace pf::kfac
