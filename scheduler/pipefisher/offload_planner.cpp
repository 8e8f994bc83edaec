#include "scheduler/pipefisher/offload_planner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace pf::pipefisher {
namespace {

void check_bytes(double bytes, const std::string& what) {
  if (!std::isfinite(bytes) || bytes < 0.0) {
    throw std::invalid_argument("K-FAC offload planner: " + what + " = " + std::to_string(bytes) +
                                " (must be finite and >= 0)");
  }
}

std::string mib(double bytes) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.1f MiB", bytes / (1024.0 * 1024.0));
  return buffer;
}

// Largest first; equal sizes in (pipeline, layer, linear) order, so that plans are reproducible.
bool larger_first(const LinearState& x, const LinearState& y) {
  if (x.bytes != y.bytes) return x.bytes > y.bytes;
  if (x.pipeline != y.pipeline) return x.pipeline < y.pipeline;
  if (x.layer != y.layer) return x.layer < y.layer;
  return x.linear < y.linear;
}

double sum_bytes(const std::vector<LinearState>& states) {
  double bytes = 0.0;  // summed again after each move: no rounding residue
  for (const auto& state : states) bytes += state.bytes;
  return bytes;
}

double device_need(const WorkerOffloadPlan& plan) {
  double transient = plan.offloaded.empty() ? 0.0 : plan.offloaded.front().bytes;
  if (!plan.factors_only.empty()) {
    transient = std::max(transient, plan.factors_only.front().bytes / 2.0);
  }
  return resident_bytes(plan) + factor_sum_bytes(plan) + transient;
}

// Moves the largest Linear of `from` to `to` (both kept largest first) and recounts the plan.
bool move_largest(WorkerOffloadPlan& worker, std::vector<LinearState>& from,
                  std::vector<LinearState>& to) {
  if (from.empty()) return false;
  std::sort(from.begin(), from.end(), larger_first);
  to.push_back(from.front());
  from.erase(from.begin());
  std::sort(to.begin(), to.end(), larger_first);
  worker.kept_bytes = sum_bytes(worker.kept);
  worker.offloaded_bytes = sum_bytes(worker.offloaded);
  worker.factors_only_bytes = sum_bytes(worker.factors_only);
  worker.device_kfac_bytes = device_need(worker);
  return true;
}

}  // namespace

double resident_bytes(const WorkerOffloadPlan& worker) {
  return worker.kept_bytes + worker.factors_only_bytes / 2.0;
}

double factor_sum_bytes(const WorkerOffloadPlan& worker) {
  double bytes = 0.0;
  for (const auto* states : {&worker.kept, &worker.offloaded, &worker.factors_only}) {
    for (const auto& state : *states) bytes += state.sum_bytes;
  }
  return bytes;
}

bool offload_largest_kept(WorkerOffloadPlan& worker) {
  return move_largest(worker, worker.kept, worker.offloaded);
}

bool offload_next(WorkerOffloadPlan& worker) {
  return move_largest(worker, worker.kept, worker.factors_only) ||
         move_largest(worker, worker.factors_only, worker.offloaded);
}

std::string_view to_string(OffloadMode mode) {
  switch (mode) {
    case OffloadMode::kNone:
      return "none";
    case OffloadMode::kHost:
      return "host";
    case OffloadMode::kAuto:
      return "auto";
    case OffloadMode::kFactors:
      return "factors";
  }
  return "none";
}

OffloadMode offload_mode_from_string(std::string_view name) {
  if (name == "none") return OffloadMode::kNone;
  if (name == "host") return OffloadMode::kHost;
  if (name == "auto") return OffloadMode::kAuto;
  if (name == "factors") return OffloadMode::kFactors;
  throw std::invalid_argument("--kfac-offload: '" + std::string(name) +
                              "' (allowed: none, host, factors, auto)");
}

int OffloadPlan::offloaded_linears() const {
  int count = 0;
  for (const auto& worker : workers) {
    count += static_cast<int>(worker.offloaded.size() + worker.factors_only.size());
  }
  return count;
}

int OffloadPlan::factors_only_linears() const {
  int count = 0;
  for (const auto& worker : workers) count += static_cast<int>(worker.factors_only.size());
  return count;
}

OffloadPlan plan_offload(OffloadMode mode, const std::vector<std::vector<LinearState>>& linears,
                         const std::vector<double>& other_bytes, double budget_bytes) {
  if (linears.size() != other_bytes.size()) {
    throw std::invalid_argument("K-FAC offload planner: " + std::to_string(linears.size()) +
                                " workers of Linears but " + std::to_string(other_bytes.size()) +
                                " of other memory");
  }
  check_bytes(budget_bytes, "--device-memory-budget");
  if (mode == OffloadMode::kAuto && budget_bytes <= 0.0) {
    throw std::invalid_argument(
        "--kfac-offload auto needs --device-memory-budget (MiB per device, > 0)");
  }
  OffloadPlan plan;
  plan.mode = mode;
  plan.budget_bytes = budget_bytes;
  std::string overflowing;
  for (std::size_t w = 0; w < linears.size(); ++w) {
    WorkerOffloadPlan worker;
    worker.other_bytes = other_bytes[w];
    check_bytes(worker.other_bytes, "worker " + std::to_string(w) + " memory");
    worker.kept = linears[w];
    for (const auto& state : worker.kept) {
      check_bytes(state.bytes, "worker " + std::to_string(w) + " layer " +
                                   std::to_string(state.layer) + " K-FAC bytes");
      check_bytes(state.sum_bytes, "worker " + std::to_string(w) + " layer " +
                                       std::to_string(state.layer) + " factor sum bytes");
    }
    std::sort(worker.kept.begin(), worker.kept.end(), larger_first);
    for (const auto& state : worker.kept) worker.kept_bytes += state.bytes;
    worker.device_kfac_bytes = device_need(worker);
    auto fits = [&] {
      return budget_bytes <= 0.0 || worker.other_bytes + device_need(worker) <= budget_bytes;
    };
    if (mode == OffloadMode::kHost) {
      while (offload_largest_kept(worker)) {
      }
    } else if (mode == OffloadMode::kFactors) {
      while (move_largest(worker, worker.kept, worker.factors_only)) {
      }
    } else if (mode == OffloadMode::kAuto) {
      while (!fits() && offload_next(worker)) {
      }
    }
    worker.fits = fits();
    if (!worker.fits) {
      overflowing += (overflowing.empty() ? "" : ", ") + std::string("worker ") +
                     std::to_string(w) + " needs " +
                     mib(worker.other_bytes + worker.device_kfac_bytes);
    }
    plan.workers.push_back(std::move(worker));
  }
  if (!overflowing.empty()) {
    plan.warning = "K-FAC offload: the device-memory budget of " + mib(budget_bytes) +
                   " is not met even with the K-FAC state offloaded as planned (" + overflowing +
                   ")";
  }
  return plan;
}

}  // namespace pf::pipefisher
