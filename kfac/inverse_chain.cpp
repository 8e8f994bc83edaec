#include "kfac/inverse_chain.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kfac/cholesky_inverse_columns.h"
#include "kfac/factors.h"
#include "kfac/lower_blas.h"

namespace pf::kfac {

std::vector<InverseChainStep> inverse_chain_steps(Eigen::Index n, Eigen::Index block) {
  if (n <= 0 || block <= 0) {
    throw std::invalid_argument("inverse_chain_steps: size " + std::to_string(n) + " and block " +
                                std::to_string(block) + " must be positive");
  }
  std::vector<InverseChainStep> steps;
  for (Eigen::Index first = 0; first < n; first += block) {
    const Eigen::Index width = std::min(block, n - first);
    const double b = static_cast<double>(width);
    const double trailing = static_cast<double>(n - first - width);
    // Diagonal LLT b^3/3, panel TRSM t b^2, trailing SYRK t^2 b.
    const double flops = b * b * b / 3.0 + trailing * b * b + trailing * trailing * b;
    steps.push_back({InverseChainStep::Kind::kCholeskyColumn, first, width, flops});
  }
  for (Eigen::Index first = 0; first < n; first += block) {
    const Eigen::Index width = std::min(block, n - first);
    const double below = static_cast<double>(n - first);
    // Forward and backward solve, both on the rows from `first` down.
    const double flops = 2.0 * below * below * static_cast<double>(width);
    steps.push_back({InverseChainStep::Kind::kSolveColumns, first, width, flops});
  }
  return steps;
}

double inverse_chain_flops(Eigen::Index n, Eigen::Index block) {
  double total = 0.0;
  for (const auto& step : inverse_chain_steps(n, block)) total += step.flops;
  return total;
}

StepRange inverse_chain_piece(const std::vector<InverseChainStep>& steps, int unit_begin,
                              int unit_end) {
  check_piece_units(unit_begin, unit_end, "inverse_chain_piece");
  double total = 0.0;
  for (const auto& step : steps) total += step.flops;
  // Step s belongs to the piece whose share holds the step's starting FLOP: compare
  // start * U against unit * total so that adjacent pieces agree exactly on their boundary.
  const auto first_step_at = [&](int unit) {
    if (unit == 0) return std::size_t{0};
    if (unit == kPieceUnits) return steps.size();
    double start = 0.0;
    std::size_t s = 0;
    while (s < steps.size() && start * kPieceUnits < static_cast<double>(unit) * total) {
      start += steps[s].flops;
      ++s;
    }
    return s;
  };
  return {first_step_at(unit_begin), first_step_at(unit_end)};
}

InverseChain::InverseChain(const Eigen::Ref<const Eigen::MatrixXf>& factor, float damping,
                           Eigen::Index block)
    : factor_(factor), damping_(damping) {
  if (factor_.rows() == 0 || factor_.rows() != factor_.cols()) {
    throw std::invalid_argument("InverseChain: factor is " + std::to_string(factor_.rows()) +
                                " x " + std::to_string(factor_.cols()) +
                                ", expected square, non-empty");
  }
  if (!(damping >= 0.0F)) {
    throw std::invalid_argument("InverseChain: damping must be >= 0, got " +
                                std::to_string(damping));
  }
  if (!factor_.allFinite()) {
    throw std::runtime_error("InverseChain: the factor has non-finite entries (NaN or inf)");
  }
  steps_ = inverse_chain_steps(factor_.rows(), block);
  cholesky_ = factor_;
  cholesky_.diagonal().array() += damping;
  inverse_.resize(factor_.rows(), factor_.cols());
}

void InverseChain::run(int unit_begin, int unit_end) {
  check_piece_units(unit_begin, unit_end, "InverseChain::run");
  if (unit_begin != next_unit_) {
    throw std::logic_error("InverseChain::run: piece [" + std::to_string(unit_begin) + ", " +
                           std::to_string(unit_end) + ") out of order: the chain is at unit " +
                           std::to_string(next_unit_));
  }
  const auto range = inverse_chain_piece(steps_, unit_begin, unit_end);
  for (std::size_t s = range.first; s < range.last; ++s) {
    if (!fell_back_) run_step(steps_[s]);
  }
  next_unit_ = unit_end;
}

void InverseChain::run_step(const InverseChainStep& step) {
  const Eigen::Index n = cholesky_.rows();
  const Eigen::Index first = step.first;
  const Eigen::Index width = step.width;
  const Eigen::Index rest = n - first - width;
  if (step.kind == InverseChainStep::Kind::kCholeskyColumn) {
    auto diagonal = cholesky_.block(first, first, width, width);
    if (!cholesky_lower(diagonal)) {
      // Not positive definite in fp32: the eigen path, as damped_inverse falls back to.
      inverse_ = damped_inverse(factor_, damping_, InverseMethod::kEigen).inverse;
      fell_back_ = true;
      return;
    }
    if (rest == 0) return;
    auto panel = cholesky_.block(first + width, first, rest, width);
    solve_lower_transposed_on_the_right(diagonal, panel);  // L21 = A21 L11^-T
    auto trailing = cholesky_.block(first + width, first + width, rest, rest);
    syrk_lower(trailing, panel, -1.0F);
    return;
  }
  // Columns [first, first + width) of X = L^-T L^-1, rows from `first` down (the lower
  // triangle); the last step mirrors it onto the upper one.
  cholesky_inverse_columns(cholesky_, inverse_, first, width);
  if (first + width == n) fill_upper_from_lower(inverse_);
}

InverseResult InverseChain::take() {
  if (!finished()) {
    throw std::logic_error("InverseChain::take: the chain is at unit " +
                           std::to_string(next_unit_) + " of " + std::to_string(kPieceUnits));
  }
  InverseResult result{std::move(inverse_), fell_back_};
  factor_ = Eigen::MatrixXf();
  cholesky_ = Eigen::MatrixXf();
  inverse_ = Eigen::MatrixXf();
  return result;
}

std::int64_t InverseChain::bytes() const {
  return static_cast<std::int64_t>(sizeof(float)) *
         (factor_.size() + cholesky_.size() + inverse_.size());
}

}  // namespace pf::kfac
