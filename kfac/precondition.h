#pragma once
// Preconditioning of one Linear layer's gradient with its damped Kronecker inverses:
//   dW = B_inv G A_inv     G: d_out x d_in, row-major as Hugging Face stores Linear weights
//   db = B_inv g_b         the bias uses B's inverse only (PipeFisher / asdl): its Fisher block
//                          is E[delta delta^T] = B, the "A" of a constant input 1 being 1.
// With row-major vec (vec(G)[o * d_in + i] = G[o][i]) the weight's Fisher block is B kron A, so
// dW = ((B + d_B I) kron (A + d_A I))^-1 vec(G).
#include <cstddef>
#include <cstdint>
#include "kfac/eigen_core.h"

#include "kfac/inverse.h"

namespace pf::kfac {

// out_w (d_out x d_in) = b_inv * grad_w * a_inv; out_b (d_out) = b_inv * grad_b. The outputs may
// alias the inputs (in-place). grad_b and out_b may both be null (no bias). Throws
// std::invalid_argument for inverses of the wrong size.
void precondition(const Eigen::Ref<const Eigen::MatrixXf>& a_inv,
                  const Eigen::Ref<const Eigen::MatrixXf>& b_inv, const float* grad_w,
                  const float* grad_b, std::int64_t d_out, std::int64_t d_in, float* out_w,
                  float* out_b);

// One piece of the preconditioning, the gradient rows [r0, r1) of the piece's share
// [unit_begin, unit_end) of d_out rows (pieces.h):
//   out_w[r0:r1] = (b_inv[r0:r1, :] grad_w) a_inv,   out_b[r0:r1] = b_inv[r0:r1, :] grad_b.
// Every piece reads the whole gradient, so out_w / out_b must not alias grad_w / grad_b (keep a
// copy of the gradient while the pieces run); the FLOPs of all pieces add up to those of
// precondition(). Same pieces => bit-identical; against precondition() fp32 rounding only (the
// products associate differently). Throws std::invalid_argument for aliasing or bad sizes.
void precondition_rows(const Eigen::Ref<const Eigen::MatrixXf>& a_inv,
                       const Eigen::Ref<const Eigen::MatrixXf>& b_inv, const float* grad_w,
                       const float* grad_b, std::int64_t d_out, std::int64_t d_in, int unit_begin,
                       int unit_end, float* out_w, float* out_b);

// kfac-pytorch's eigenvalue-product damping: (B kron A + lambda I)^-1 vec(G) exactly,
//   dW = Q_B [(Q_B^T G Q_A) / (e_B e_A^T + lambda)] Q_A^T,   db = Q_B [(Q_B^T g_b) / (e_B +
//   lambda)]
// (the bias block B is damped by lambda too). lambda must be > 0 where an eigenvalue is 0.
void precondition_eigen_exact(const EigenFactor& a, const EigenFactor& b, float lambda,
                              const float* grad_w, const float* grad_b, std::int64_t d_out,
                              std::int64_t d_in, float* out_w, float* out_b);

// KL clipping (kfac-pytorch): every preconditioned gradient of every layer is multiplied by
//   nu = min(1, sqrt(kappa / |sum over layers of sum(dW * G) * lr^2|)).
// kl_clip_dot returns sum(precond * grad) in double; sum it over all layers (weights and biases)
// and pass the total to kl_clip_scale. A total of 0 gives nu = 1.
double kl_clip_dot(const float* preconditioned, const float* grad, std::size_t size);
float kl_clip_scale(double total_dot, float learning_rate, float kappa);

// FLOP model of one call (or of all its row pieces), for benchmarks and the cost model.
double precondition_flops(std::int64_t d_out, std::int64_t d_in);

}  // namespace pf::kfac
