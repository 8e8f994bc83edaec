#pragma once
// Which Linears' K-FAC state to keep in host memory (ZeRO-Infinity for K-FAC; docs/offload.md).
// Two granularities: a Linear offloaded whole keeps its factors and inverses in host memory (the
// inverses come back before every step's preconditioning); one offloaded factors only keeps its
// factors there and its inverses on the device (its factors move only around its inversions:
// half the state saved at 1/k of the traffic). `--kfac-offload host` offloads every Linear
// whole, `factors` every Linear factors only; `auto` offloads, per worker, the fewest Linears
// that bring the worker's device memory under the budget, the cheap granularity first: the
// factors of the largest Linears, and only once every Linear's factors are offloaded, the
// largest Linears whole.
#include <string>
#include <string_view>
#include <vector>

#include "scheduler/instruction.h"

namespace pf::pipefisher {

enum class OffloadMode : unsigned char {
  kNone,     // every Linear's state on the device (no transfers)
  kHost,     // every Linear's state in host memory
  kAuto,     // only what does not fit under the device-memory budget (factors first)
  kFactors,  // every Linear's factors in host memory, its inverses on the device
};
std::string_view to_string(OffloadMode mode);
OffloadMode offload_mode_from_string(std::string_view name);  // throws naming the allowed values

// One preconditioned Linear held by a worker: the bytes of its K-FAC state (factors and
// inverses, fp32) and of its factor sums (one of each factor, as large as the factors; twice
// that with a pipelined refresh, whose next window accumulates beside the sums waiting for
// their inversion). A refresh accumulates the sums on the device of every replica, offloaded or
// not, whatever the sharding (kfac/state_placement.h: a replica without the factors drops its
// sums at the curvature sync, the holders at the inversion), and the curvature of every Linear
// runs before the first inversion, so all of them are there at once.
struct LinearState {
  int pipeline = 0;
  int layer = 0;
  sched::LinearKind linear = sched::LinearKind::kQuery;
  double bytes = 0.0;
  double sum_bytes = 0.0;
  friend bool operator==(const LinearState&, const LinearState&) = default;
};

struct WorkerOffloadPlan {
  std::vector<LinearState> offloaded;     // whole (factors and inverses), largest first
  std::vector<LinearState> factors_only;  // factors in host memory, inverses on the device
  std::vector<LinearState> kept;          // on the device
  double kept_bytes = 0.0;                // K-FAC state resident all the time
  double offloaded_bytes = 0.0;           // state of the Linears offloaded whole
  double factors_only_bytes = 0.0;        // whole state of the factors-only Linears (half moves)
  // Device bytes K-FAC needs at most: the kept state, the factors-only Linears' inverses, every
  // Linear's factor sums (factor_sum_bytes), plus the largest transient: an offloaded Linear's
  // state, or a factors-only Linear's factors (resident from its factor prefetch to its
  // write-back).
  double device_kfac_bytes = 0.0;
  double other_bytes = 0.0;  // the worker's device memory without K-FAC (its peak)
  bool fits = true;          // other + device K-FAC <= budget (always with no budget)
};

struct OffloadPlan {
  OffloadMode mode = OffloadMode::kNone;
  double budget_bytes = 0.0;  // per device; 0: none
  std::vector<WorkerOffloadPlan> workers;
  std::string warning;  // one line when some worker does not fit even with everything offloaded
  int offloaded_linears() const;     // whole and factors only
  int factors_only_linears() const;  // factors only
};

// linears[w]: the Linears worker w holds; other_bytes[w]: its device memory peak without K-FAC
// state. kAuto (an estimate: the offload pass refines it with the simulator, offload_pass.h)
// needs budget_bytes > 0. Throws std::invalid_argument on mismatched sizes, a
// negative or non-finite size or budget, or kAuto without a budget.
OffloadPlan plan_offload(OffloadMode mode, const std::vector<std::vector<LinearState>>& linears,
                         const std::vector<double>& other_bytes, double budget_bytes);

// Moves the worker's largest kept Linear to the offloaded ones (false when none is kept), and
// updates its byte counts (fits and the plan's warning are the caller's).
bool offload_largest_kept(WorkerOffloadPlan& worker);
// auto's next step: the largest kept Linear's factors (to factors_only); once none is kept, the
// largest factors-only Linear whole (to offloaded). False when everything is offloaded whole.
bool offload_next(WorkerOffloadPlan& worker);
// K-FAC bytes resident on the device between refreshes: the kept state and the factors-only
// Linears' inverses (half their state).
double resident_bytes(const WorkerOffloadPlan& worker);
// The factor sums of every Linear the worker holds, kept or offloaded (LinearState::sum_bytes),
// on the device while a refresh accumulates them (WorkerOffloadPlan::device_kfac_bytes).
double factor_sum_bytes(const WorkerOffloadPlan& worker);

}  // namespace pf::pipefisher
