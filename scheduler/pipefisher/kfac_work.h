#pragma once
// The K-FAC work model: which curvature, sync, inversion and precondition tasks one refresh of
// k steps needs on each worker, and what each depends on. Derived from a one-step schedule's
// placement and streams (every forward / backward of a chunk yields curvature for its layers).
#include <functional>
#include <vector>

#include "scheduler/pipefisher/kfac_options.h"
#include "scheduler/schedule.h"
#include "scheduler/small_vector.h"

namespace pf::pipefisher {

// One instruction of the base (one-step) schedule, repeated in step `step` of the refresh.
struct BaseRef {
  int worker = 0;
  int position = 0;  // index into the base stream of `worker`
  int step = 0;
};

struct KfacTask {
  // One entry per participating worker: a single worker, or the replicas of a curvature sync.
  // Inline vectors: nearly every task has one worker, one instruction and one dependency.
  SmallVector<int, 2> workers;
  SmallVector<sched::Instruction, 1> instructions;  // parallel to workers
  double duration_s = 0.0;                          // the longest of the participants'
  SmallVector<BaseRef, 1> base_deps;                // must have ended before the task starts
  SmallVector<int, 2> task_deps;                    // indices of earlier tasks
  int step_bound = -1;  // precondition: must run in this step (before its optimizer step)

  sched::OpKind kind() const { return instructions.front().kind; }
};

struct KfacWork {
  int refresh_steps = 1;
  std::vector<KfacTask> tasks;  // topological order: every dependency precedes its task
};

// Tasks bound to one step (they run every step): preconditioning and its broadcast.
inline bool is_per_step(sched::OpKind kind) {
  return kind == sched::OpKind::kPrecondition || kind == sched::OpKind::kBroadcastGradient;
}

// What options.state_placement adds over `replicas` data-parallel replicas: the inverses'
// broadcast to holders without factors, and the preconditioned gradient's to replicas without
// inverses. Throws std::invalid_argument (naming --kfac-sharding) for a placement the replicas
// cannot hold, or a sharded one on a schedule with two pipelines (Chimera).
struct StateBroadcasts {
  int inverse_receivers = 0;   // per layer
  int gradient_receivers = 0;  // per layer and step
};
StateBroadcasts state_broadcasts(const sched::Schedule& base, const KfacOptions& options);

// Seconds `instruction` takes on `worker` (normally sim::CostModel::duration).
using DurationFn = std::function<double(int worker, const sched::Instruction& instruction)>;

// The tasks of one refresh spanning `refresh_steps` steps of `base` (a one-step schedule).
// Order: curvature A, curvature B, sync, inversion, inverse broadcast, then preconditions (each
// followed by its gradient broadcast) step by step. Throws
// std::invalid_argument when `base` is not a one-step schedule or a layer option is out of range.
KfacWork build_kfac_work(const sched::Schedule& base, const KfacOptions& options, int refresh_steps,
                         const DurationFn& duration);

// The (layer, linear) pairs preconditioned on each worker.
struct HeldLinear {
  int layer = 0;
  sched::LinearKind linear = sched::LinearKind::kQuery;
};
std::vector<std::vector<HeldLinear>> preconditioned_linears(const sched::Schedule& base,
                                                            const KfacOptions& options);

}  // namespace pf::pipefisher
