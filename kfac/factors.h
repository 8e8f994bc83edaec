#pragma once
// Kronecker factors of one Linear layer y = W x + b (K-FAC):
//   A = a^T a / T           a: T x d_in inputs of the layer (tokens of a micro-batch, row-major)
//   B = s * g^T g           g: T x d_out gradients of the loss w.r.t. the layer's outputs
// s undoes the loss's mean so that B is the Fisher of one token's loss. For a loss that is the
// mean of N terms, g_t = (1/N) dl/dy_t, and E_t[(N g_t)(N g_t)^T] = (N^2 / T) g^T g, so
// s = N^2 / T (s = T for a mean over all T tokens). If the micro-batch losses are further divided
// by k for gradient accumulation, s gains a factor k^2. See docs/kfac.md.
#include <cstdint>
#include "kfac/eigen_core.h"

namespace pf::kfac {

// sum (d x d, lower triangle) += scale * x^T x, with x rows x d row-major. Only the lower triangle
// is written (SYRK). With several OpenMP threads and enough rows, each thread runs the SYRK of a
// contiguous slice of the rows into its own partial sum (d x d extra memory per extra thread).
// Throws std::invalid_argument on mismatched sizes.
void add_gram_lower(Eigen::Ref<Eigen::MatrixXf> sum, const float* x, std::int64_t rows,
                    std::int64_t cols, float scale);

// Copies the lower triangle onto the upper one (the factor is then exactly symmetric).
void fill_upper_from_lower(Eigen::Ref<Eigen::MatrixXf> matrix);

// (C + C^T) / 2 in place, for a square matrix computed in full.
void symmetrize(Eigen::Ref<Eigen::MatrixXf> matrix);

// s = (N^2 / T) * k^2, the output-gradient scale for a loss averaged over N terms, with T tokens
// in the micro-batch and micro-batch losses divided by k for accumulation (k = 1 when they are
// not). Throws std::invalid_argument unless N, T, k are positive.
float output_grad_scale(std::int64_t loss_terms, std::int64_t tokens,
                        std::int64_t accumulation_divisor = 1);

}  // namespace pf::kfac
