#pragma once
// One processor that the compute of several workers shares (SimOptions::shared_processors):
// egalitarian processor sharing with a capacity. While n jobs run, each progresses at
// min(1, capacity / n) of its own speed, so a job's end moves whenever another starts or ends
// beside it. The engine asks for the next end, and takes the jobs done when that time comes.
//
// Bookkeeping in virtual time: every running job has received the same service since it
// started, so one clock V (service per job so far) serves all of them; a job of `work` seconds
// added at V0 is done when V reaches V0 + work. A min-heap of those targets gives the next end
// in O(log n).
#include <cstdint>
#include <functional>
#include <limits>
#include <queue>
#include <utility>
#include <vector>

namespace pf::sim {

class ProcessorShare {
 public:
  // capacity: how many jobs the processor runs at full speed at once (> 0, finite).
  explicit ProcessorShare(double capacity);

  // Starts `job` at `now` (not before the last add or take) with `work` seconds of its own.
  void add(std::int64_t job, double work, double now);

  // When the next running job ends if none is added before; +infinity when none runs.
  double next_end() const;

  // The jobs done at `now`, the time next_end() gave: the earliest one and any that end with it.
  // They leave the processor, so the others speed up.
  void take_done(double now, std::vector<std::int64_t>& done);

  int running() const { return static_cast<int>(targets_.size()); }
  // Each running job's speed: min(1, capacity / running).
  double rate() const;

 private:
  void advance(double now);

  double capacity_;
  double time_ = 0.0;     // real time of the last advance
  double service_ = 0.0;  // V: the service each running job has had since the processor's start
  std::priority_queue<std::pair<double, std::int64_t>, std::vector<std::pair<double, std::int64_t>>,
                      std::greater<>>
      targets_;  // (V at which the job is done, job)
};

}  // namespace pf::sim
