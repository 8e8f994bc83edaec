#pragma once
// Which Linears' K-FAC state to keep in host memory (ZeRO-Infinity for K-FAC; docs/offload.md).
// `--kfac-offload host` offloads every Linear; `auto` offloads, per worker, the fewest Linears
// that bring the worker's device memory under the budget: the largest first, since each one
// offloaded saves its whole state (factors and inverses) but the largest offloaded one must still
// fit while its refresh holds it on the device.
#include <string>
#include <string_view>
#include <vector>

#include "scheduler/instruction.h"

namespace pf::pipefisher {

enum class OffloadMode : unsigned char {
  kNone,  // every Linear's state on the device (no transfers)
  kHost,  // every Linear's state in host memory
  kAuto   // only what does not fit under the device-memory budget
};
std::string_view to_string(OffloadMode mode);
OffloadMode offload_mode_from_string(std::string_view name);  // throws naming the allowed values

// One preconditioned Linear held by a worker, and the bytes of its K-FAC state (factors and
// inverses, fp32).
struct LinearState {
  int pipeline = 0;
  int layer = 0;
  sched::LinearKind linear = sched::LinearKind::kQuery;
  double bytes = 0.0;
  friend bool operator==(const LinearState&, const LinearState&) = default;
};

struct WorkerOffloadPlan {
  std::vector<LinearState> offloaded;  // largest first
  std::vector<LinearState> kept;       // on the device
  double kept_bytes = 0.0;             // K-FAC state resident all the time
  double offloaded_bytes = 0.0;        // moved to host memory
  // Device bytes K-FAC needs at most: the kept state plus the largest offloaded Linear's state
  // (resident from its factor prefetch to its write-back).
  double device_kfac_bytes = 0.0;
  double other_bytes = 0.0;  // the worker's device memory without K-FAC (its peak)
  bool fits = true;          // other + device K-FAC <= budget (always with no budget)
};

struct OffloadPlan {
  OffloadMode mode = OffloadMode::kNone;
  double budget_bytes = 0.0;  // per device; 0: none
  std::vector<WorkerOffloadPlan> workers;
  std::string warning;  // one line when some worker does not fit even with everything offloaded
  int offloaded_linears() const;
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

}  // namespace pf::pipefisher
