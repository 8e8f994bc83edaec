#pragma once
// The kernels of K-FAC's work on one Linear d_in -> d_out (fp32 factors), by operation class:
// - curvature of a factor of order d from T rows (activations a: T x d_in for A, output
//   gradients g: T x d_out for B): the product a^T a (2 T d^2 FLOPs, gemm) and its scaling into
//   the running factor (memory);
// - inversion, Cholesky (PipeFisher / asdl, and kfac/inverse.h): damping added to the
//   diagonal, potrf (d^3 / 3 FLOPs, factorization; the host waits for its info flag), then the
//   inverse solved against the identity (two triangular solves with d right-hand sides, 2 d^3
//   FLOPs, triangular_solve); eigen: syevd (about 9 d^3 FLOPs, eigendecomposition) and
//   Q diag Q^T (2 d^3, gemm);
// - precondition: B^-1 G A^-1 (2 d_out d_in (d_in + d_out) FLOPs, gemm), the bias' B^-1 g_b and
//   the copy into the gradient (memory).
// Products run at `product_precision` (tf32 where the device has tensor cores and the run is not
// strict fp32, DeviceSpec::kfac_matmul_peak); factorizations at the fp32 peak.
#include "sim/device.h"
#include "sim/kernel_costs.h"

namespace pf::sim {

enum class KfacInversion { kCholesky, kEigen };

Kernels curvature_kernels(Precision product_precision, double rows, double order,
                          double input_element_bytes);
// block_size > 0 (the device's classes.factorization.block_size): a Cholesky inverse priced by
// its blocked structure, blocked_cholesky_inverse_kernels.
Kernels inversion_kernels(double order, KfacInversion method = KfacInversion::kCholesky,
                          double block_size = 0.0);
// The inversion on `device` (its factorization block size).
Kernels inversion_kernels(const DeviceSpec& device, double order,
                          KfacInversion method = KfacInversion::kCholesky);
// A Cholesky inverse as a blocked LAPACK-style implementation (Eigen's LLT, kfac/inverse.cpp)
// runs it, for a d x d factor:
// - damping onto the diagonal (memory);
// - the factorization, right-looking in panels of p columns (Eigen's choice: d / 8 rounded down
//   to a multiple of 16, at least 8, at most block_size): per panel of w columns with r rows
//   below it, the panel's diagonal block factorized (w^3 / 3 FLOPs, factorization, size w), the
//   rows below solved against it (r w^2, triangular_solve, size w) and the trailing matrix
//   updated (r^2 w FLOPs: the lower half of an r x r x w product, gemm at that product's shape);
//   the host waits for the last panel (the info flag);
// - the identity, then the two triangular solves against it (L Y = I, L^T X = Y; d right-hand
//   sides), each in blocks of b = block_size rows: the block's w x w triangle solved (w^2 d,
//   triangular_solve, size w), then the rows after it updated (an r x d x w product, gemm);
// - the symmetrization (memory).
// The d^3 / 3 + 2 d^3 FLOPs are the unblocked model's; most of them now run at the gemm curve's
// efficiency for their shapes, and the triangular blocks at the solve class's rate.
Kernels blocked_cholesky_inverse_kernels(double order, double block_size);
Kernels precondition_kernels(Precision product_precision, double d_in, double d_out);

// The precision of K-FAC's fp32 products on `device` for a run at `precision`.
Precision kfac_product_precision(const DeviceSpec& device, Precision precision);

}  // namespace pf::sim
