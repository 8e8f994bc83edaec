#pragma once
// Per-kind K-FAC task overheads: the seconds every K-FAC task of a kind pays whatever its size
// (kernel launches, synchronization), included in its modeled duration, which each piece of a
// divided task pays again (sim/cost_model.h, kfac_piece_seconds). One value for every kind,
// which each kind may replace with its own: measured on an H200 a piece costs 10 us beyond its
// share for the inversion chain, 22-40 us for curvature and 26-30 us for preconditioning
// (docs/pipefisher.md, "Measured on an H200").
#include <array>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "scheduler/instruction.h"

namespace pf::sim {

// The default per-task overhead of the analytic and measured models: a few kernel launches and a
// stream synchronization on a GPU.
inline constexpr double kDefaultKfacTaskOverheadS = 10e-6;

// The K-FAC kinds with an overhead of their own, in this order (also the JSON keys of the device
// and profile formats' "kfac_task_overheads" object).
inline constexpr int kNumKfacOverheadKinds = 6;
inline constexpr std::array<std::string_view, kNumKfacOverheadKinds> kKfacOverheadFields = {
    "curvature_a_s", "curvature_b_s", "curvature_sync_s",
    "invert_a_s",    "invert_b_s",    "precondition_s"};

// The kind's index among them; -1 for the other kinds.
constexpr int kfac_overhead_index(sched::OpKind kind) {
  switch (kind) {
    case sched::OpKind::kCurvatureA:
      return 0;
    case sched::OpKind::kCurvatureB:
      return 1;
    case sched::OpKind::kCurvatureSync:
      return 2;
    case sched::OpKind::kInvertA:
      return 3;
    case sched::OpKind::kInvertB:
      return 4;
    case sched::OpKind::kPrecondition:
      return 5;
    default:
      return -1;
  }
}

// Each kind's own overhead where given (empty: the common value).
using KfacKindOverheads = std::array<std::optional<double>, kNumKfacOverheadKinds>;

// The overhead of a task of `kind`: its own where given, else `all_s` (also for the kinds without
// an entry, which are never divided).
inline double kfac_overhead_of(sched::OpKind kind, double all_s, const KfacKindOverheads& by_kind) {
  const int index = kfac_overhead_index(kind);
  if (index < 0) return all_s;
  const auto& own = by_kind[static_cast<std::size_t>(index)];
  return own ? *own : all_s;
}

// Throws std::invalid_argument naming `source` and the field ("kfac_task_overhead_s",
// "kfac_task_overheads.invert_a_s") unless every value is finite and >= 0.
inline void check_kfac_overheads(double all_s, const KfacKindOverheads& by_kind,
                                 std::string_view source) {
  auto check = [&](double value, const std::string& field) {
    if (!std::isfinite(value) || value < 0.0) {
      throw std::invalid_argument(std::string(source) + ": field '" + field +
                                  "' = " + std::to_string(value) + " (must be finite and >= 0)");
    }
  };
  check(all_s, "kfac_task_overhead_s");
  for (std::size_t i = 0; i < by_kind.size(); ++i) {
    if (by_kind[i])
      check(*by_kind[i], "kfac_task_overheads." + std::string(kKfacOverheadFields[i]));
  }
}

}  // namespace pf::sim
