#pragma once
// Moving backward-weight (W) work for the PipeFisher pass on split-backward (zero-bubble)
// schedules. A W (weight gradient) is waited for only by its worker's gradient reduction and
// optimizer step, unlike the I (input gradient) that the previous stage waits for; so a W may
// run later than the generator put it. Deferring it opens its slot earlier in the step, next to
// the curvature B its I has just released, and runs the W later, where it may fill an idle gap
// that K-FAC work could not use.
#include "scheduler/schedule.h"

namespace pf::pipefisher {

// `base` (a one-step schedule) with every W moved up to `distance` forwards/backwards later on
// its worker's stream, keeping the Ws' own order, never past a gradient reduction or the
// optimizer step (which consume the weight gradient), and placed after the sends that follow
// the compute it moves past (a send right after its I keeps feeding the previous stage at once).
// distance 0 returns `base`. Throws std::invalid_argument for distance < 0 or a schedule of
// more than one step.
sched::Schedule defer_backward_weights(const sched::Schedule& base, int distance);
inline constexpr int kDeferAllTheWay = 1 << 20;  // a distance past any stream's end

// Whether the schedule splits the backward (holds a W).
bool has_backward_weights(const sched::Schedule& schedule);

}  // namespace pf::pipefisher
