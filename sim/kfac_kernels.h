#pragma once
// The kernels of K-FAC's work on one Linear d_in -> d_out (fp32 factors), by operation class:
// - curvature of a factor of order d from T rows (activations a: T x d_in for A, output
//   gradients g: T x d_out for B): the product a^T a (2 T d^2 FLOPs, gemm) and its scaling into
//   the running factor (memory; running_average = false: the product is the factor, as when
//   PipeFisher's asdl computes one micro-batch's factors); the host spends the device's
//   curvature_host_overhead_s on the factor before issuing the product;
// - inversion, Cholesky (PipeFisher / asdl, and kfac/inverse.h): damping added to the
//   diagonal, potrf (d^3 / 3 FLOPs, factorization; the host waits for its info flag), then the
//   inverse solved against the identity (two triangular solves with d right-hand sides, 2 d^3
//   FLOPs, triangular_solve); eigen: syevd (about 9 d^3 FLOPs, eigendecomposition) and
//   Q diag Q^T (2 d^3, gemm);
// - precondition: B^-1 G A^-1 (2 d_out d_in (d_in + d_out) FLOPs, gemm), the bias' B^-1 g_b and
//   the copy into the gradient (memory).
// Products run at `product_precision` (tf32 where the device has tensor cores and the run is not
// strict fp32, DeviceSpec::kfac_matmul_peak); factorizations at the fp32 peak.
#include "sim/kernel_costs.h"

namespace pf::sim {

enum class KfacInversion { kCholesky, kEigen };

Kernels curvature_kernels(Precision product_precision, double rows, double order,
                          double input_element_bytes, bool running_average = true);
Kernels inversion_kernels(double order, KfacInversion method = KfacInversion::kCholesky);
Kernels precondition_kernels(Precision product_precision, double d_in, double d_out);

// The precision of K-FAC's fp32 products on `device` for a run at `precision`.
Precision kfac_product_precision(const DeviceSpec& device, Precision precision);

}  // namespace pf::sim
