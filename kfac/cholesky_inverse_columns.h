#pragma once
// The inverse of L L^T (L lower triangular: a Cholesky factor) by blocks of columns, lower
// triangle only. Column block [f, f + w) of X = L^-T L^-1 below row f needs only L's trailing
// block L[f:, f:]: the identity's columns are zero above row f, so the forward solve starts
// there, and the backward (upper triangular) solve of rows f.. involves no row above f. The
// rows above f of those columns are X's upper triangle, the transpose of earlier blocks' rows:
// fill_upper_from_lower (factors.h) fills them. That is n^3 FLOPs for the whole inverse (with the
// factorization's n^3/3, as LAPACK's potri), against 2 n^3 for solving against every column of I in
// full.
#include "kfac/eigen_core.h"

namespace pf::kfac {

// Rows [first, n) of columns [first, first + width) of (L L^T)^-1 into `inverse` (n x n), from
// the lower triangle of `cholesky` (n x n; its upper triangle is not read). The columns are cut
// into slices by the shape only (a blocked triangular solve rounds a column with its slice's
// width), so the bits do not depend on the thread count; slices run on OpenMP threads.
void cholesky_inverse_columns(const Eigen::Ref<const Eigen::MatrixXf>& cholesky,
                              Eigen::Ref<Eigen::MatrixXf> inverse, Eigen::Index first,
                              Eigen::Index width);

}  // namespace pf::kfac
