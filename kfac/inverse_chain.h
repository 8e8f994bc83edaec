#pragma once
// The damped inverse (F + d I)^-1 as a chain of steps that can run in separate bubbles:
//   1. blocked Cholesky F + d I = L L^T, one step per block column: factor the diagonal block,
//      solve the panel below it, update the trailing matrix (SYRK);
//   2. one step per block of columns c of the inverse: X[:, c] = L^-T (L^-1 I[:, c]) on the
//      rows from the block's first down (cholesky_inverse_columns.h: both solves need only L's
//      trailing block); the last step copies that lower triangle onto the upper one.
// The steps are strictly ordered (each needs the previous one's L); a piece of the task runs the
// steps whose cumulative FLOPs start inside its share [unit_begin, unit_end) (pieces.h).
// Same factor, damping and pieces => bit-identical result; against damped_inverse (Eigen's
// unblocked-interface LLT) the result differs only by fp32 rounding. If a diagonal block is not
// positive definite the step that finds it computes the eigen inverse (as damped_inverse does)
// and the remaining steps do nothing.
#include <cstdint>
#include <vector>
#include "kfac/eigen_core.h"

#include "kfac/inverse.h"
#include "kfac/pieces.h"

namespace pf::kfac {

// Block width of both stages: wide enough for GEMM-speed panel updates, narrow enough that one
// step of a 4096-wide factor is ~3% of the task.
inline constexpr Eigen::Index kInverseChainBlock = 128;

struct InverseChainStep {
  enum class Kind : std::uint8_t { kCholeskyColumn, kSolveColumns };
  Kind kind = Kind::kCholeskyColumn;
  Eigen::Index first = 0;  // first column of the block
  Eigen::Index width = 0;
  double flops = 0.0;
};

// The chain's steps for an n x n factor, in order. Throws std::invalid_argument unless n > 0
// and block > 0.
std::vector<InverseChainStep> inverse_chain_steps(Eigen::Index n,
                                                  Eigen::Index block = kInverseChainBlock);
double inverse_chain_flops(Eigen::Index n, Eigen::Index block = kInverseChainBlock);

// The steps [first, last) that the piece [unit_begin, unit_end) runs.
struct StepRange {
  std::size_t first = 0;
  std::size_t last = 0;
};
StepRange inverse_chain_piece(const std::vector<InverseChainStep>& steps, int unit_begin,
                              int unit_end);

class InverseChain {
 public:
  // Copies the factor. Throws as damped_inverse does for a bad factor or damping.
  InverseChain(const Eigen::Ref<const Eigen::MatrixXf>& factor, float damping,
               Eigen::Index block = kInverseChainBlock);

  // Runs the piece [unit_begin, unit_end); pieces must come in order, each starting where the
  // previous ended (the first at 0). Throws std::logic_error otherwise.
  void run(int unit_begin, int unit_end);
  bool finished() const { return next_unit_ == kPieceUnits; }
  int next_unit() const { return next_unit_; }
  float damping() const { return damping_; }
  // The factor the chain was built from (a checkpoint between two pieces saves it, with
  // next_unit() and damping(): a new chain on them, run up to next_unit(), is this one bit for
  // bit, since a piece runs whole steps).
  const Eigen::MatrixXf& factor() const { return factor_; }
  // The inverse, once finished (std::logic_error before). Leaves the chain empty.
  InverseResult take();
  // Bytes held by the chain between pieces (the factor copy, L and the inverse).
  std::int64_t bytes() const;

 private:
  void run_step(const InverseChainStep& step);

  Eigen::MatrixXf factor_;  // kept for the eigen fallback
  float damping_ = 0.0F;
  std::vector<InverseChainStep> steps_;
  Eigen::MatrixXf cholesky_;  // lower triangle becomes L
  Eigen::MatrixXf inverse_;
  bool fell_back_ = false;
  int next_unit_ = 0;
};

}  // namespace pf::kfac
