#include "scheduler/pipefisher/kfac_options.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace pf::pipefisher {

std::string_view to_string(PackingPolicy policy) {
  switch (policy) {
    case PackingPolicy::kFirstFit:
      return "first_fit";
    case PackingPolicy::kBestFit:
      return "best_fit";
    case PackingPolicy::kBestOfBoth:
      return "best_of_both";
  }
  return "?";
}

PackingPolicy packing_policy_from_string(std::string_view name) {
  for (PackingPolicy policy :
       {PackingPolicy::kFirstFit, PackingPolicy::kBestFit, PackingPolicy::kBestOfBoth}) {
    if (to_string(policy) == name) return policy;
  }
  throw std::invalid_argument("unknown packing policy '" + std::string(name) +
                              "' (allowed: first_fit, best_fit, best_of_both)");
}

std::string_view to_string(CurvatureSource source) {
  return source == CurvatureSource::kFirstStep ? "first_step" : "every_step";
}

CurvatureSource curvature_source_from_string(std::string_view name) {
  if (name == "first_step") return CurvatureSource::kFirstStep;
  if (name == "every_step") return CurvatureSource::kEveryStep;
  throw std::invalid_argument("unknown curvature source '" + std::string(name) +
                              "' (allowed: first_step, every_step)");
}

std::vector<sched::LinearKind> all_linear_kinds() {
  return {sched::LinearKind::kQuery,        sched::LinearKind::kKey,   sched::LinearKind::kValue,
          sched::LinearKind::kAttentionOut, sched::LinearKind::kFfnIn, sched::LinearKind::kFfnOut};
}

void KfacOptions::validate() const {
  if (!std::isfinite(safety_margin) || safety_margin < 0.0 || safety_margin > 10.0) {
    throw std::invalid_argument("--kfac-margin (safety_margin) must be in [0, 10], got " +
                                std::to_string(safety_margin));
  }
  if (refresh_steps < 0) {
    throw std::invalid_argument(
        "--kfac-refresh (refresh_steps) must be >= 0 (0 = automatic), got " +
        std::to_string(refresh_steps));
  }
  if (!(spill_budget >= 0.0 && spill_budget <= 1.0)) {
    throw std::invalid_argument(
        "--kfac-spill-budget (spill_budget) must be a fraction of a step in [0, 1], got " +
        std::to_string(spill_budget));
  }
  if (free_spill && refresh_steps > 0) {
    throw std::invalid_argument(
        "--kfac-free-spill on (free_spill) chooses the refresh interval: it needs the automatic "
        "one (--kfac-refresh 0), got --kfac-refresh " +
        std::to_string(refresh_steps));
  }
  if (max_refresh_steps < 1) {
    throw std::invalid_argument("--kfac-max-refresh (max_refresh_steps) must be >= 1, got " +
                                std::to_string(max_refresh_steps));
  }
  if (!std::isfinite(min_piece_overheads) || min_piece_overheads < 0.0) {
    throw std::invalid_argument("--kfac-min-piece (min_piece_overheads) must be >= 0, got " +
                                std::to_string(min_piece_overheads));
  }
  if (linears.empty()) {
    throw std::invalid_argument("--kfac-linears (linears) is empty: nothing to precondition");
  }
  if (!std::isfinite(memory_budget_bytes) || memory_budget_bytes < 0.0) {
    throw std::invalid_argument("--kfac-memory-budget must be >= 0, got " +
                                std::to_string(memory_budget_bytes));
  }
  if (!linear_dims.empty() &&
      linear_dims.size() != static_cast<std::size_t>(sched::kNumLinearKinds)) {
    throw std::invalid_argument("KfacOptions::linear_dims holds " +
                                std::to_string(linear_dims.size()) + " entries, expected " +
                                std::to_string(sched::kNumLinearKinds) + " (one per Linear kind)");
  }
  if (pipelined_refresh && curvature != CurvatureSource::kFirstStep) {
    throw std::invalid_argument(
        "--kfac-pipelined-refresh on needs --kfac-curvature first_step (with every_step the "
        "refresh's curvature is the window's last step's)");
  }
  if (pipelined_refresh && (automatic_placement || !(state_placement == kfac::StatePlacement{}))) {
    throw std::invalid_argument(
        "--kfac-pipelined-refresh on needs --kfac-sharding replicate (the inverse and gradient "
        "broadcasts of sharded state are not pipelined)");
  }
  for (int layer : layers) {
    if (layer < 0) {
      throw std::invalid_argument("--kfac-layers (layers) holds a negative layer index " +
                                  std::to_string(layer));
    }
  }
}

std::vector<kfac::LinearDims> encoder_linear_dims(std::int64_t hidden, std::int64_t intermediate) {
  std::vector<kfac::LinearDims> dims;
  for (int kind = 0; kind < sched::kNumLinearKinds; ++kind) {
    const auto linear = static_cast<sched::LinearKind>(kind);
    dims.push_back({linear == sched::LinearKind::kFfnOut ? intermediate : hidden,
                    linear == sched::LinearKind::kFfnIn ? intermediate : hidden});
  }
  return dims;
}

}  // namespace pf::pipefisher
