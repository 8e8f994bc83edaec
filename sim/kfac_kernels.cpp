#include "sim/kfac_kernels.h"

#include <algorithm>

namespace pf::sim {
namespace {

Kernel matrix_function(OpClass op_class, double flops, double order, double bytes) {
  Kernel kernel;
  kernel.op_class = op_class;
  kernel.flops = flops;
  kernel.size = order;
  kernel.bytes = bytes;
  return kernel;
}

}  // namespace

Kernels curvature_kernels(Precision product_precision, double rows, double order,
                          double input_element_bytes, bool running_average) {
  Kernel product;
  product.op_class = OpClass::kGemm;
  product.precision = product_precision;
  product.flops = 2.0 * rows * order * order;
  product.bytes = 2.0 * input_element_bytes * rows * order + 4.0 * order * order;
  product.size = std::min(rows, order);
  product.curvature_host = true;
  if (!running_average) return {product};
  // factor = scale * product (+ running average): read both, write one, fp32.
  return {product,
          elementwise_kernel(3.0 * 4.0 * order * order, per_element(order * order, {.flops = 3}))};
}

Kernels inversion_kernels(double order, KfacInversion method) {
  const double d = order, matrix = 4.0 * d * d;
  if (method == KfacInversion::kEigen) {
    Kernel rebuild = gemm_kernel(Precision::kFp32, d, d, d, 4.0);
    return {matrix_function(OpClass::kEigendecomposition, 9.0 * d * d * d, d, 2.0 * matrix),
            memory_kernel(2.0 * matrix), rebuild};
  }
  Kernel factorization = matrix_function(OpClass::kFactorization, d * d * d / 3.0, d, 2.0 * matrix);
  factorization.host_sync = true;
  // 2 d^3 against every column of I; the device's inverse_solve may price a third of it (the
  // lower triangle from L's trailing blocks; its copy onto the upper triangle moves the bytes
  // the identity's set-up does).
  Kernel solve = matrix_function(OpClass::kTriangularSolve, 2.0 * d * d * d, d, 3.0 * matrix);
  solve.inverse_solve = true;
  return {
      elementwise_kernel(2.0 * 4.0 * d, per_element(d, {.flops = 1})),  // damping onto the diagonal
      factorization,
      memory_kernel(matrix),  // the identity to solve against
      solve};
}

Kernels precondition_kernels(Precision product_precision, double d_in, double d_out) {
  Kernel left = gemm_kernel(product_precision, d_out, d_in, d_out, 4.0);
  Kernel right = gemm_kernel(product_precision, d_out, d_in, d_in, 4.0);
  return {left, right,
          elementwise_kernel(4.0 * d_out * d_out,
                             per_element(d_out * d_out, {.flops = 2})),  // B^-1 g_b
          memory_kernel(2.0 * 4.0 * d_out * d_in)};                      // into the gradient
}

Precision kfac_product_precision(const DeviceSpec& device, Precision precision) {
  return precision != Precision::kFp32 && device.peak_tf32_flops > 0.0 ? Precision::kTf32
                                                                       : Precision::kFp32;
}

}  // namespace pf::sim
