#include "sim/layer_balance.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <stdexcept>

#include "scheduler/placement.h"

namespace pf::sim {

LayerBalance balance_layers(const std::vector<int>& start,
                            const std::function<SplitEvaluation(const std::vector<int>&)>& evaluate,
                            double min_gain) {
  if (start.empty()) throw std::invalid_argument("layer balance: no chunk to balance");
  for (int count : start) {
    if (count < 1) {
      throw std::invalid_argument("layer balance: the start split " +
                                  sched::format_layer_counts(start) + " has a chunk with no layer");
    }
  }
  std::map<std::vector<int>, SplitEvaluation> seen;
  const auto evaluated = [&](const std::vector<int>& layers) -> const SplitEvaluation& {
    auto it = seen.find(layers);
    if (it == seen.end()) {
      SplitEvaluation e = evaluate(layers);
      e.layers = layers;
      it = seen.emplace(layers, std::move(e)).first;
    }
    return it->second;
  };
  LayerBalance balance;
  balance.start = evaluated(start);
  SplitEvaluation current = balance.start;
  for (;;) {
    const SplitEvaluation* next = nullptr;
    for (std::size_t from = 0; from < current.layers.size(); ++from) {
      if (current.layers[from] < 2) continue;
      for (const int step : {-1, 1}) {
        const auto to = static_cast<std::ptrdiff_t>(from) + step;
        if (to < 0 || to >= static_cast<std::ptrdiff_t>(current.layers.size())) continue;
        std::vector<int> moved = current.layers;
        --moved[from];
        ++moved[static_cast<std::size_t>(to)];
        const SplitEvaluation& candidate = evaluated(moved);
        if (next == nullptr || candidate.step_time_s < next->step_time_s) next = &candidate;
      }
    }
    if (next == nullptr || !(next->step_time_s < current.step_time_s * (1.0 - min_gain))) break;
    current = *next;
  }
  balance.best = current;
  for (const auto& [layers, e] : seen) balance.evaluated.push_back(e);
  std::stable_sort(balance.evaluated.begin(), balance.evaluated.end(),
                   [](const SplitEvaluation& a, const SplitEvaluation& b) {
                     return a.step_time_s < b.step_time_s;
                   });
  return balance;
}

std::string layer_balance_table(const LayerBalance& balance, int rows) {
  const bool kfac = balance.start.refresh_steps > 0;
  std::string out = "--layers-per-stage auto: " + std::to_string(balance.evaluated.size()) +
                    " splits tried from the balanced " +
                    sched::format_layer_counts(balance.start.layers) +
                    " (one layer moved between neighbouring chunks at a time)\n";
  out += std::string("  layers per chunk        step time") + (kfac ? "   K-FAC refresh" : "") +
         "   vs balanced\n";
  const auto line = [&](const SplitEvaluation& e, const char* mark) {
    char text[200];
    if (!std::isfinite(e.step_time_s)) {
      std::snprintf(text, sizeof text, "  %-20s %12s\n",
                    sched::format_layer_counts(e.layers).c_str(), "does not fit");
      return std::string(text);
    }
    char refresh[32] = "";
    if (kfac) std::snprintf(refresh, sizeof refresh, "   every %3d steps", e.refresh_steps);
    std::snprintf(text, sizeof text, "  %-20s %9.3f ms%s   %+6.1f%%%s\n",
                  sched::format_layer_counts(e.layers).c_str(), e.step_time_s * 1e3, refresh,
                  100.0 * (e.step_time_s / balance.start.step_time_s - 1.0), mark);
    return std::string(text);
  };
  const int shown = std::min<int>(rows, static_cast<int>(balance.evaluated.size()));
  bool start_shown = false;
  for (int i = 0; i < shown; ++i) {
    const SplitEvaluation& e = balance.evaluated[static_cast<std::size_t>(i)];
    const bool is_best = e.layers == balance.best.layers;
    const bool is_start = e.layers == balance.start.layers;
    start_shown = start_shown || is_start;
    out += line(e, is_best ? "   <- chosen" : is_start ? "   (balanced)" : "");
  }
  if (!start_shown) out += "  ...\n" + line(balance.start, "   (balanced)");
  return out;
}

}  // namespace pf::sim
