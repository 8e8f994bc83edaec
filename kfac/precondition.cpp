#include "kfac/precondition.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/ordered_sum.h"
#include "kernels/ops.h"
#include "kfac/pieces.h"

namespace pf::kfac {

namespace {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using kernels::ConstMatrixView;
using kernels::MatrixView;
using kernels::Transpose;

// A column-major inverse read as a row-major matrix is its transpose: multiply by it with
// Transpose::kYes. The products go through kernels::gemm (OpenBLAS where CMake found it, its
// blocks cut by shape only, so the bits do not depend on the thread count).
ConstMatrixView<float> transposed_view(const Eigen::Ref<const Eigen::MatrixXf>& matrix) {
  return {matrix.data(), matrix.cols(), matrix.rows(), matrix.outerStride()};
}

void check_sizes(Eigen::Index a_rows, Eigen::Index a_cols, Eigen::Index b_rows, Eigen::Index b_cols,
                 std::int64_t d_out, std::int64_t d_in, const float* grad_w, const float* out_w,
                 const float* grad_b, const float* out_b) {
  if (a_rows != d_in || a_cols != d_in || b_rows != d_out || b_cols != d_out) {
    throw std::invalid_argument(
        "precondition: gradient is " + std::to_string(d_out) + " x " + std::to_string(d_in) +
        " but A's inverse is " + std::to_string(a_rows) + " x " + std::to_string(a_cols) +
        " and B's is " + std::to_string(b_rows) + " x " + std::to_string(b_cols));
  }
  if (d_out > 0 && d_in > 0 && (grad_w == nullptr || out_w == nullptr)) {
    throw std::invalid_argument("precondition: null weight gradient or output");
  }
  if ((grad_b == nullptr) != (out_b == nullptr)) {
    throw std::invalid_argument("precondition: bias gradient and bias output must both be given");
  }
}

}  // namespace

void precondition(const Eigen::Ref<const Eigen::MatrixXf>& a_inv,
                  const Eigen::Ref<const Eigen::MatrixXf>& b_inv, const float* grad_w,
                  const float* grad_b, std::int64_t d_out, std::int64_t d_in, float* out_w,
                  float* out_b) {
  check_sizes(a_inv.rows(), a_inv.cols(), b_inv.rows(), b_inv.cols(), d_out, d_in, grad_w, out_w,
              grad_b, out_b);
  if (d_out > 0 && d_in > 0) {
    // G A_inv first, into a temporary that lets out alias grad.
    RowMatrix right(d_out, d_in);
    kernels::gemm<float>({grad_w, d_out, d_in}, Transpose::kNo, transposed_view(a_inv),
                         Transpose::kYes, {right.data(), d_out, d_in});
    kernels::gemm<float>(transposed_view(b_inv), Transpose::kYes, {right.data(), d_out, d_in},
                         Transpose::kNo, {out_w, d_out, d_in});
  }
  if (grad_b != nullptr) {
    const Eigen::VectorXf bias = Eigen::Map<const Eigen::VectorXf>(grad_b, d_out);
    Eigen::Map<Eigen::VectorXf>(out_b, d_out).noalias() = b_inv * bias;
  }
}

void precondition_rows(const Eigen::Ref<const Eigen::MatrixXf>& a_inv,
                       const Eigen::Ref<const Eigen::MatrixXf>& b_inv, const float* grad_w,
                       const float* grad_b, std::int64_t d_out, std::int64_t d_in, int unit_begin,
                       int unit_end, float* out_w, float* out_b) {
  check_sizes(a_inv.rows(), a_inv.cols(), b_inv.rows(), b_inv.cols(), d_out, d_in, grad_w, out_w,
              grad_b, out_b);
  if ((d_out > 0 && d_in > 0 && out_w == grad_w) || (grad_b != nullptr && out_b == grad_b)) {
    throw std::invalid_argument(
        "precondition_rows: the output aliases the gradient (each piece reads all of it)");
  }
  const ItemRange rows = piece_items(d_out, unit_begin, unit_end);
  if (rows.size() == 0 || d_in == 0) return;
  // B_inv's rows of the piece (columns of its transpose) times G, then times A_inv.
  RowMatrix left(rows.size(), d_in);
  kernels::gemm<float>(transposed_view(b_inv).block_cols(rows.begin, rows.size()), Transpose::kYes,
                       {grad_w, d_out, d_in}, Transpose::kNo, {left.data(), rows.size(), d_in});
  kernels::gemm<float>({left.data(), rows.size(), d_in}, Transpose::kNo, transposed_view(a_inv),
                       Transpose::kYes, {out_w + rows.begin * d_in, rows.size(), d_in});
  if (grad_b != nullptr) {
    const Eigen::Map<const Eigen::VectorXf> bias(grad_b, d_out);
    Eigen::Map<Eigen::VectorXf>(out_b + rows.begin, rows.size()).noalias() =
        b_inv.middleRows(rows.begin, rows.size()) * bias;
  }
}

void precondition_eigen_exact(const EigenFactor& a, const EigenFactor& b, float lambda,
                              const float* grad_w, const float* grad_b, std::int64_t d_out,
                              std::int64_t d_in, float* out_w, float* out_b) {
  check_sizes(a.vectors.rows(), a.vectors.cols(), b.vectors.rows(), b.vectors.cols(), d_out, d_in,
              grad_w, out_w, grad_b, out_b);
  if (a.values.size() != d_in || b.values.size() != d_out) {
    throw std::invalid_argument("precondition_eigen_exact: eigenvalue counts do not match");
  }
  if (!(lambda >= 0.0F)) throw std::invalid_argument("precondition_eigen_exact: lambda < 0");
  const Eigen::ArrayXXf denominator = (b.values * a.values.transpose()).array() + lambda;
  if ((denominator <= 0.0F).any()) {
    throw std::invalid_argument("precondition_eigen_exact: singular factors need lambda > 0");
  }
  // The four products through kernels::gemm, as precondition()'s (bits independent of the
  // thread count); transposed_view(Q) reads a column-major Q as Q^T.
  RowMatrix right(d_out, d_in), rotated(d_out, d_in);
  if (d_out > 0 && d_in > 0) {
    kernels::gemm<float>({grad_w, d_out, d_in}, Transpose::kNo, transposed_view(a.vectors),
                         Transpose::kYes, {right.data(), d_out, d_in});  // G Q_A
    kernels::gemm<float>(transposed_view(b.vectors), Transpose::kNo, {right.data(), d_out, d_in},
                         Transpose::kNo, {rotated.data(), d_out, d_in});  // Q_B^T G Q_A
    rotated.array() /= denominator;
    kernels::gemm<float>({rotated.data(), d_out, d_in}, Transpose::kNo, transposed_view(a.vectors),
                         Transpose::kNo, {right.data(), d_out, d_in});  // (...) Q_A^T
    kernels::gemm<float>(transposed_view(b.vectors), Transpose::kYes, {right.data(), d_out, d_in},
                         Transpose::kNo, {out_w, d_out, d_in});  // Q_B (...)
  }
  if (grad_b != nullptr) {
    Eigen::VectorXf bias = b.vectors.transpose() * Eigen::Map<const Eigen::VectorXf>(grad_b, d_out);
    bias.array() /= b.values.array() + lambda;
    Eigen::Map<Eigen::VectorXf>(out_b, d_out).noalias() = b.vectors * bias;
  }
}

double kl_clip_dot(const float* preconditioned, const float* grad, std::size_t size) {
  // Fixed chunks added in chunk order: the same bits on any number of threads (the dot scales
  // every update).
  constexpr std::size_t kChunk = std::size_t{1} << 15;
  return kernels::cpu::ordered_chunk_sum<double>(size, kChunk, 0,
                                                 [=](std::size_t begin, std::size_t end) {
                                                   double partial = 0.0;
                                                   for (std::size_t i = begin; i < end; ++i)
                                                     partial += double{preconditioned[i]} * grad[i];
                                                   return partial;
                                                 });
}

float kl_clip_scale(double total_dot, float learning_rate, float kappa) {
  if (!(kappa > 0.0F)) {
    throw std::invalid_argument("kl_clip_scale: kappa must be > 0, got " + std::to_string(kappa));
  }
  const double denominator = std::abs(total_dot) * double{learning_rate} * learning_rate;
  if (denominator == 0.0) return 1.0F;
  return static_cast<float>(std::min(1.0, std::sqrt(double{kappa} / denominator)));
}

double precondition_flops(std::int64_t d_out, std::int64_t d_in) {
  return 2.0 * static_cast<double>(d_out) * static_cast<double>(d_in) *
         static_cast<double>(d_in + d_out);
}

}  // namespace pf::kfac
