#include "scheduler/pipefisher/offload_pass.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <utility>

#include <nlohmann/json.hpp>

#include "scheduler/validate.h"

namespace pf::pipefisher {
namespace {

using sched::Instruction;
using sched::OpKind;

// A prefetch should end this much before its consumer's predicted start (durations vary).
constexpr double kTransferMargin = 0.05;

using LinearKey = std::tuple<int, int, int>;  // pipeline, layer, linear

LinearKey key_of(const Instruction& in) {
  return {in.pipeline, in.layer, static_cast<int>(in.linear)};
}

// One stretch of a Linear's inversions that holds its factors on the device: the inversion
// tasks (A, B) whose pieces overlap, first piece to last; with sharded state, to the inverse
// broadcast after them.
struct InversionWindow {
  int first = 0, last = 0;
  int inverses = 0;      // tasks completed in it (0 to 2): the inverses its write-back moves
  bool wrapped = false;  // a pipelined refresh's work of the previous refresh (sched::is_wrapped)
};

// The pieces of one inversion task in one refresh window (a pipelined refresh's task may run
// partly in its own window and end in the next one: two spans).
struct InversionSpan {
  int first = 0, last = 0;
  bool completes = false;  // holds the task's last piece
};

// Where one Linear's K-FAC work sits in a worker's stream.
struct LinearWork {
  // Per (kind (A, B), wrapped): first and last piece, and whether the last piece is there.
  std::map<std::pair<int, bool>, InversionSpan> inversion;
  int inverse_broadcast = -1;            // sharded state: the owner's inverse broadcast
  std::vector<InversionWindow> windows;  // in stream order
  // Per step: the first and last piece of its preconditioning.
  std::map<int, std::pair<int, int>> precondition;

  // Each inversion task gets its own window (its factors are prefetched just before it and
  // written back just after, so that at most about one Linear's factors are on the device at a
  // time) unless its pieces interleave with the other's. The work of two refreshes (a pipelined
  // refresh's wrapped inversions and the window's own) never shares a window: the previous
  // refresh's inverses are written back before the next ones are computed. With sharded state
  // the inverse broadcast reads (owner) or fills (the other inverse holders) both new inverses
  // on the device: one window from the first inversion to the broadcast.
  void make_windows() {
    std::vector<std::tuple<int, int, bool, bool>> tasks;  // first, last, wrapped, completes
    for (const auto& [kind_wrapped, span] : inversion) {
      tasks.emplace_back(span.first, span.last, kind_wrapped.second, span.completes);
    }
    std::sort(tasks.begin(), tasks.end());
    for (const auto& [first, last, wrapped, completes] : tasks) {
      const int done = completes ? 1 : 0;
      if (!windows.empty() && windows.back().wrapped == wrapped &&
          (first <= windows.back().last || inverse_broadcast >= 0)) {
        windows.back().last = std::max(windows.back().last, last);
        windows.back().inverses += done;
      } else {
        windows.push_back({first, last, done, wrapped});
      }
    }
    if (inverse_broadcast >= 0 && !windows.empty()) {
      windows.back().last = std::max(windows.back().last, inverse_broadcast);
    }
  }
};

// One copy to insert: emitted just before original position `position` (the stream's length:
// at its end); equal positions in `order` (a write-back before a prefetch that needs it).
struct Placed {
  int position = 0;
  int order = 0;
  // When its consumer starts (a prefetch) or its data is ready (a write-back), then the order
  // of a Linear's copies: copies at one position reach the link in this order.
  double deadline = 0.0;
  int sequence = 0;
  Instruction instruction;
};

class WorkerPlacer {
 public:
  WorkerPlacer(const sched::Schedule& schedule, int worker, const std::vector<sim::Timing>& times,
               const sim::CostModel& costs)
      : schedule_(schedule), worker_(worker), times_(times), costs_(costs) {}

  // When an instruction inserted before original position q is issued: with the previous
  // instruction of the stream (in-order issue), or at 0 at the stream's start.
  double issue_time(int q) const {
    if (q <= 0) return 0.0;
    return times_[static_cast<std::size_t>(q - 1)].start_s;
  }
  double start_of(int position) const {
    return position < static_cast<int>(times_.size())
               ? times_[static_cast<std::size_t>(position)].start_s
               : (times_.empty() ? 0.0 : times_.back().end_s);
  }

  double duration(const Instruction& in) const { return costs_.duration(schedule_, worker_, in); }

  // The earliest time from `t` on at which the link is free for `length` seconds.
  // busy_ holds disjoint intervals by start (every copy is placed where the link is free), so
  // one sweep from the interval around t finds the gap (a scan of every interval until nothing
  // moved took 88 s for the 24 182 copies of GPT-3 175B at p = 8).
  double link_free_at(double t, double length) const {
    auto it = busy_.upper_bound(t);
    if (it != busy_.begin() && std::prev(it)->second > t) --it;
    for (; it != busy_.end() && it->first < t + length; ++it) {
      if (t < it->second) t = it->second;
    }
    return t;
  }

  // A copy inserted before original position q waits for its data (`ready`) and the link; it
  // must start before the instruction after it would (in-order issue: a copy waiting holds up
  // the stream behind it, on every lane: a write-back placed right after its inversion held up
  // a curvature sync that ran beside the inversion on the collective lane). The time it starts,
  // or a negative value when it cannot.
  double start_without_delay(int q, double ready, double seconds) const {
    const double t = link_free_at(std::max(issue_time(q), ready), seconds);
    return t <= start_of(q) + 1e-12 ? t : -1.0;
  }

  // A prefetch: the latest position in [earliest, consumer] where the copy gets the link
  // without holding up the stream and ends before the consumer starts; otherwise the earliest
  // such position (late: the consumer waits for it), otherwise `earliest`.
  int place_prefetch(int earliest, int consumer, double seconds, bool& late) {
    const double deadline = start_of(consumer);
    for (int q = consumer; q >= earliest; --q) {
      const double t = start_without_delay(q, 0.0, seconds);
      if (t >= 0.0 && t + seconds * (1.0 + kTransferMargin) <= deadline) {
        late = false;
        return occupy(q, t, seconds);
      }
    }
    late = true;
    for (int q = earliest; q <= consumer; ++q) {
      const double t = start_without_delay(q, 0.0, seconds);
      if (t >= 0.0) return occupy(q, t, seconds);
    }
    return occupy(earliest, link_free_at(issue_time(earliest), seconds), seconds);
  }

  // A write-back: the earliest position in [earliest, latest] where it gets the link without
  // holding up the stream once its data is ready (`ready`: the end of its inversion).
  int place_write_back(int earliest, int latest, double seconds, double ready) {
    for (int q = earliest; q <= latest; ++q) {
      const double t = start_without_delay(q, ready, seconds);
      if (t >= 0.0) return occupy(q, t, seconds);
    }
    return occupy(earliest, link_free_at(std::max(issue_time(earliest), ready), seconds), seconds);
  }

 private:
  int occupy(int q, double start, double seconds) {
    busy_.emplace(start, start + seconds);
    return q;
  }

  const sched::Schedule& schedule_;
  int worker_;
  const std::vector<sim::Timing>& times_;
  const sim::CostModel& costs_;
  std::multimap<double, double> busy_;  // start -> end of the copies placed so far
};

Instruction transfer(OpKind kind, const Instruction& like, int step, double bytes) {
  Instruction in;
  in.kind = kind;
  in.pipeline = like.pipeline;
  in.step = static_cast<std::int16_t>(step);
  in.chunk = like.chunk;
  in.layer = like.layer;
  in.linear = like.linear;
  in.bytes = static_cast<std::int64_t>(bytes);
  return in;
}

std::string mib(double bytes) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.1f MiB", bytes / (1024.0 * 1024.0));
  return buffer;
}

}  // namespace

namespace {

// The Linears of each worker and where their K-FAC work sits.
struct ScheduleWork {
  std::vector<std::map<LinearKey, LinearWork>> work;
  std::vector<std::map<LinearKey, const Instruction*>> sample;  // one instruction of each
};

ScheduleWork find_work(const PassResult& pipefisher, const sim::CostModel& costs) {
  const sched::Schedule& schedule = pipefisher.schedule;
  const int workers = schedule.num_workers();
  ScheduleWork found;
  found.work.resize(static_cast<std::size_t>(workers));
  found.sample.resize(static_cast<std::size_t>(workers));
  for (int w = 0; w < workers; ++w) {
    const auto& stream = schedule.streams[static_cast<std::size_t>(w)];
    for (std::size_t i = 0; i < stream.size(); ++i) {
      const Instruction& in = stream[i];
      if (sched::is_kfac_transfer(in.kind)) {
        throw std::invalid_argument("K-FAC offload: the schedule has offload copies already");
      }
      const int position = static_cast<int>(i);
      if (in.kind == OpKind::kBroadcastInverses) {
        auto& linear = found.work[static_cast<std::size_t>(w)][key_of(in)];
        linear.inverse_broadcast = std::max(linear.inverse_broadcast, position);
        continue;
      }
      if (!sched::is_kfac(in.kind) || sched::is_kfac_collective(in.kind)) continue;
      auto& linear = found.work[static_cast<std::size_t>(w)][key_of(in)];
      found.sample[static_cast<std::size_t>(w)].emplace(key_of(in), &in);
      if (in.kind == OpKind::kInvertA || in.kind == OpKind::kInvertB) {
        const bool completes = in.piece_end == sched::kPieceUnits;
        auto [it, added] =
            linear.inversion.try_emplace({static_cast<int>(in.kind), sched::is_wrapped(in)},
                                         InversionSpan{position, position, completes});
        if (!added) {
          it->second.last = position;
          it->second.completes = it->second.completes || completes;
        }
      }
      if (in.kind == OpKind::kPrecondition) {
        auto [it, added] = linear.precondition.try_emplace(in.step, position, position);
        if (!added) it->second.second = position;
      }
    }
  }
  for (int w = 0; w < workers; ++w) {
    const auto& times = pipefisher.after.times[static_cast<std::size_t>(w)];
    for (auto& [key, linear] : found.work[static_cast<std::size_t>(w)]) {
      linear.make_windows();
      // Windows closer than a write-back and a prefetch take become one: the factors stay
      // (never a pipelined refresh's wrapped window with the window's own).
      const Instruction& like = *found.sample[static_cast<std::size_t>(w)].at(key);
      const double bytes = costs.kfac_bytes(schedule, like.layer, like.linear);
      const double round_trip =
          costs.duration(schedule, w, transfer(OpKind::kWriteBackState, like, 0, bytes)) +
          costs.duration(schedule, w, transfer(OpKind::kPrefetchFactors, like, 0, bytes / 2.0));
      std::vector<InversionWindow> merged;
      for (const auto& window : linear.windows) {
        if (!merged.empty() && merged.back().wrapped == window.wrapped &&
            times[static_cast<std::size_t>(window.first)].start_s -
                    times[static_cast<std::size_t>(merged.back().last)].end_s <
                round_trip) {
          merged.back().last = window.last;
          merged.back().inverses += window.inverses;
        } else {
          merged.push_back(window);
        }
      }
      linear.windows = std::move(merged);
    }
  }
  return found;
}

// Worker w's stream with the copies of its offloaded Linears, placed in the PipeFisher
// timeline; fills the report's counts.
std::vector<Instruction> insert_copies(
    const PassResult& pipefisher, const ScheduleWork& found, const WorkerOffloadPlan& plan, int w,
    CopyOrder order, const sim::CostModel& costs,
    const std::function<HeldKfacState(int, int, sched::LinearKind)>& held_state,
    WorkerOffloadReport& worker_report) {
  const sched::Schedule& schedule = pipefisher.schedule;
  const auto& stream = schedule.streams[static_cast<std::size_t>(w)];
  if (plan.offloaded.empty() && plan.factors_only.empty()) return stream;
  const int n = static_cast<int>(stream.size());
  const auto& timeline = pipefisher.after.times[static_cast<std::size_t>(w)];
  WorkerPlacer placer(schedule, w, timeline, costs);
  const auto& work = found.work[static_cast<std::size_t>(w)];
  // Requests in the order their consumers need them (write-backs by their producer's end).
  struct Request {
    double deadline;
    // A Linear's copies in the order they depend on each other: factor prefetch and write-back
    // of window x at 2x and 2x + 1, inverse prefetches after them (equal deadlines arise from
    // zero-length inversions).
    int sequence;
    LinearKey key;
    int order;  // 0 write-back, 1 factor prefetch, 2 inverse prefetch
    int index;  // the window (write-back, factor prefetch) or the step (inverse prefetch)
    bool factors_only = false;  // the Linear's inverses stay on the device
  };
  std::vector<Request> requests;
  std::vector<std::pair<LinearState, bool>> chosen;  // the Linear, factors only
  for (const auto& state : plan.offloaded) chosen.emplace_back(state, false);
  for (const auto& state : plan.factors_only) chosen.emplace_back(state, true);
  for (const auto& [state, factors_only] : chosen) {
    const LinearKey key{state.pipeline, state.layer, static_cast<int>(state.linear)};
    const LinearWork& lw = work.at(key);
    for (std::size_t x = 0; x < lw.windows.size(); ++x) {
      const auto& window = lw.windows[x];
      const int sequence = 2 * static_cast<int>(x);
      requests.push_back(
          {placer.start_of(window.first), sequence, key, 1, static_cast<int>(x), factors_only});
      requests.push_back({timeline[static_cast<std::size_t>(window.last)].end_s, sequence + 1, key,
                          0, static_cast<int>(x), factors_only});
    }
    if (factors_only) continue;  // its inverses stay on the device: no inverse prefetches
    const int after_windows = 2 * static_cast<int>(lw.windows.size());
    for (const auto& [step, positions] : lw.precondition) {
      requests.push_back({placer.start_of(positions.first), after_windows + step, key, 2, step});
    }
  }
  // The order the copies are placed in (each takes the link where the ones placed before it
  // left room): see CopyOrder.
  if (order == CopyOrder::kByDeadline) {
    std::sort(requests.begin(), requests.end(), [](const Request& x, const Request& y) {
      return std::tie(x.deadline, x.sequence, x.key) < std::tie(y.deadline, y.sequence, y.key);
    });
  } else {
    std::sort(requests.begin(), requests.end(), [](const Request& x, const Request& y) {
      const bool x_prefetch = x.order != 0, y_prefetch = y.order != 0;
      if (x_prefetch != y_prefetch) return y_prefetch;
      if (!x_prefetch) {
        return std::tie(x.deadline, x.sequence, x.key) < std::tie(y.deadline, y.sequence, y.key);
      }
      return std::tie(y.deadline, y.sequence, y.key) < std::tie(x.deadline, x.sequence, x.key);
    });
  }
  std::vector<Placed> placed;
  // Per Linear and window: where its write-back went (the next window's factor prefetch, and the
  // inverse prefetches that read the new inverses, come after it).
  std::map<std::pair<LinearKey, int>, int> write_back_at;
  const int last_step = schedule.num_steps - 1;
  const bool pipelined = schedule.kfac_pipelined_refresh;
  for (const Request& request : requests) {
    const LinearWork& lw = work.at(request.key);
    const Instruction& like = *found.sample[static_cast<std::size_t>(w)].at(request.key);
    // What the worker's busiest replica holds of the Linear moves (with sharded state the others
    // move what they hold: the executor): half of the state is its factors (a factor prefetch),
    // half its inverses (an inverse prefetch; a quarter per inversion task written back).
    const HeldKfacState held = held_state(w, like.layer, like.linear);
    const double bytes = held.factors && held.inverses ? held.bytes : 2.0 * held.bytes;
    const double factor_bytes = held.factors ? bytes / 2.0 : 0.0;
    const double inverse_bytes = held.inverses ? bytes / 2.0 : 0.0;
    bool late = false;
    Placed copy;
    // At one position: prefetches first (their consumers are next), then write-backs (they
    // wait for their inversion), then a prefetch of the same Linear that must follow its
    // write-back.
    copy.order = 0;
    // The windows whose new inverses an inverse prefetch reads, written back before it: the
    // refresh's (the last window) for the refresh's last step; with a pipelined refresh, for
    // every step, the previous refresh's run in this window (the last wrapped window).
    int read_window = -1;
    if (pipelined) {
      for (std::size_t x = 0; x < lw.windows.size(); ++x) {
        if (lw.windows[x].wrapped) read_window = static_cast<int>(x);
      }
    } else if (request.index == last_step) {
      read_window = static_cast<int>(lw.windows.size()) - 1;
    }
    // The write-back this copy follows: the previous window's (a factor prefetch), the one
    // whose inverses it reads (an inverse prefetch).
    const int before = request.order == 1 ? request.index - 1 : read_window;
    const auto previous_write_back = write_back_at.find({request.key, before});
    if (request.order == 1) {  // factors, before the window's first inversion
      const auto& window = lw.windows[static_cast<std::size_t>(request.index)];
      const int step = stream[static_cast<std::size_t>(window.first)].step;
      copy.instruction = transfer(OpKind::kPrefetchFactors, like, step, factor_bytes);
      if (request.factors_only) copy.instruction.microbatch = sched::kFactorsOnlyCopy;
      const int earliest =
          previous_write_back == write_back_at.end() ? 0 : previous_write_back->second;
      copy.position =
          placer.place_prefetch(earliest, window.first, placer.duration(copy.instruction), late);
      if (previous_write_back != write_back_at.end() && copy.position == earliest) copy.order = 2;
    } else if (request.order == 0) {  // factors and new inverses, after the window
      const auto& window = lw.windows[static_cast<std::size_t>(request.index)];
      const int step = stream[static_cast<std::size_t>(window.last)].step;
      // Factors only: the new inverses stay on the device.
      copy.instruction = transfer(
          OpKind::kWriteBackState, like, step,
          factor_bytes + (request.factors_only ? 0.0 : window.inverses * inverse_bytes / 2.0));
      if (request.factors_only) copy.instruction.microbatch = sched::kFactorsOnlyCopy;
      int latest = n;
      if (static_cast<std::size_t>(request.index) + 1 < lw.windows.size()) {
        latest = lw.windows[static_cast<std::size_t>(request.index) + 1].first;
      }
      // Before the first preconditioning that reads its inverses: the refresh's last step's; a
      // pipelined refresh's wrapped window, every step's of the window it runs in.
      for (const auto& [step_of, positions] : lw.precondition) {
        if (request.factors_only) break;  // the preconditionings read the device's inverses
        if (pipelined ? window.wrapped : step_of == last_step) {
          latest = std::min(latest, positions.first);
        }
      }
      copy.position = placer.place_write_back(
          window.last + 1, std::max(window.last + 1, latest), placer.duration(copy.instruction),
          timeline[static_cast<std::size_t>(window.last)].end_s);
      copy.order = 1;
      write_back_at[{request.key, request.index}] = copy.position;
    } else {  // one step's inverses, before its preconditioning
      copy.instruction = transfer(OpKind::kPrefetchInverses, like, request.index, inverse_bytes);
      int earliest = 0;
      // After the previous step's preconditioning released its copy.
      auto it = lw.precondition.find(request.index);
      if (it != lw.precondition.begin()) earliest = std::prev(it)->second.second + 1;
      // After the write-back of the inverses it reads.
      bool after_write_back = false;
      if (previous_write_back != write_back_at.end() && previous_write_back->second >= earliest) {
        earliest = previous_write_back->second;
        after_write_back = true;
      }
      copy.position = placer.place_prefetch(earliest, it->second.first,
                                            placer.duration(copy.instruction), late);
      if (after_write_back && copy.position == earliest) copy.order = 2;
    }
    copy.deadline = request.deadline;
    copy.sequence = request.sequence;
    worker_report.late_prefetches += late ? 1 : 0;
    ++worker_report.transfers;
    worker_report.transfer_bytes += static_cast<double>(copy.instruction.bytes);
    worker_report.transfer_s += placer.duration(copy.instruction);
    placed.push_back(copy);
  }
  // Copies issued at one position queue for the link in stream order: the earliest consumer's
  // first (the placer, going backwards, gave the later consumers' copies their stretches of the
  // link first).
  std::stable_sort(placed.begin(), placed.end(), [](const Placed& x, const Placed& y) {
    return std::tie(x.position, x.order, x.deadline, x.sequence) <
           std::tie(y.position, y.order, y.deadline, y.sequence);
  });
  std::vector<Instruction> out;
  out.reserve(stream.size() + placed.size());
  std::size_t next = 0;
  for (int i = 0; i <= n; ++i) {
    while (next < placed.size() && placed[next].position == i) {
      out.push_back(placed[next++].instruction);
    }
    if (i < n) out.push_back(stream[static_cast<std::size_t>(i)]);
  }
  return out;
}

}  // namespace

namespace {

double max_peak(const sim::SimResult& simulated) {
  double peak = 0.0;
  for (const auto& worker : simulated.workers) peak = std::max(peak, worker.peak_memory_bytes);
  return peak;
}

// A lower peak over the workers, or the same peak in a shorter step.
bool lower_peak(const sim::SimResult& a, const sim::SimResult& b) {
  const double peak_a = max_peak(a);
  const double peak_b = max_peak(b);
  return peak_a < peak_b || (peak_a == peak_b && a.step_time_s < b.step_time_s);
}

// Of two placements of the same plan: the one within the budget (when one is set), else the
// shorter step, else the lower peak.
bool better_placement(const sim::SimResult& a, const sim::SimResult& b, double budget) {
  if (budget > 0.0 && (max_peak(a) <= budget) != (max_peak(b) <= budget)) {
    return max_peak(a) <= budget;
  }
  const double tolerance = 1e-9 * std::max(a.step_time_s, b.step_time_s);
  if (std::abs(a.step_time_s - b.step_time_s) > tolerance) return a.step_time_s < b.step_time_s;
  return max_peak(a) < max_peak(b);
}

}  // namespace

std::string_view to_string(CopyOrder order) {
  return order == CopyOrder::kByDeadline ? "by-deadline" : "prefetches-latest-first";
}

std::optional<CopyOrder> copy_order_from_string(std::string_view name) {
  if (name == "best") return std::nullopt;
  if (name == "by-deadline") return CopyOrder::kByDeadline;
  if (name == "prefetches-latest-first") return CopyOrder::kPrefetchesLatestFirst;
  throw std::invalid_argument("--kfac-offload-copies: '" + std::string(name) +
                              "' (allowed: best, by-deadline, prefetches-latest-first)");
}

OffloadResult run_offload_pass(const PassResult& pipefisher, const sim::CostModel& costs,
                               const OffloadOptions& options, const sim::SimOptions& sim_options) {
  const sched::Schedule& schedule = pipefisher.schedule;
  const int workers = schedule.num_workers();
  if (static_cast<int>(pipefisher.after.times.size()) != workers ||
      static_cast<int>(pipefisher.before.workers.size()) != workers) {
    throw std::invalid_argument("K-FAC offload: the PipeFisher result has no simulated timeline");
  }
  const ScheduleWork found = find_work(pipefisher, costs);
  // What each Linear's state is on the worker's busiest replica (the PipeFisher pass counts it;
  // with sharded state a replica may hold the inverses alone, or nothing of a Linear): the
  // copies move that, and the planner counts it.
  std::function<HeldKfacState(int, int, sched::LinearKind)> held_state =
      pipefisher.busiest_replica_holds;
  if (!held_state) {
    held_state = [&costs, &schedule](int, int layer, sched::LinearKind linear) {
      return HeldKfacState{true, true, costs.kfac_bytes(schedule, layer, linear)};
    };
  }
  // Simulated as the pass simulated its schedule (the simulator counts every factor sum while
  // it exists: a kept Linear's, an offloaded one's up to its write-back, a pipelined refresh's
  // set-aside ones).
  sim::SimOptions simulation = sim_options;
  if (!simulation.kfac_state_bytes) {
    // Without the factor sums counted (the old model, count_factor_sums false) a pipelined
    // refresh's second accumulator is half the state again, as the PipeFisher pass simulated it.
    const double accumulators =
        schedule.kfac_pipelined_refresh && !simulation.count_factor_sums ? 1.5 : 1.0;
    simulation.kfac_state_bytes = [held_state, accumulators](int worker, int layer,
                                                             sched::LinearKind linear) {
      return accumulators * held_state(worker, layer, linear).bytes;
    };
  }
  if (!simulation.kfac_sum_bytes) simulation.kfac_sum_bytes = pipefisher.factor_sum_bytes;
  if (!simulation.kfac_holds_factors) {
    simulation.kfac_holds_factors = [held_state](int worker, int layer, sched::LinearKind linear) {
      return held_state(worker, layer, linear).factors;
    };
  }
  std::vector<std::vector<LinearState>> linears(static_cast<std::size_t>(workers));
  std::vector<double> other(static_cast<std::size_t>(workers));
  // The factor sums as the simulator counts them: every replica accumulates both of each Linear
  // it holds layers of (the others drop theirs at the curvature sync); a pipelined refresh's
  // set-aside ones too.
  const double set_aside = schedule.kfac_pipelined_refresh ? 2.0 : 1.0;
  const auto factor_sums = [&](int layer, sched::LinearKind linear) {
    if (!simulation.count_factor_sums) return 0.0;
    return set_aside * (sim::factor_sum_bytes(schedule, costs, simulation, layer, linear, true) +
                        sim::factor_sum_bytes(schedule, costs, simulation, layer, linear, false));
  };
  for (int w = 0; w < workers; ++w) {
    for (const auto& [key, in] : found.sample[static_cast<std::size_t>(w)]) {
      linears[static_cast<std::size_t>(w)].push_back(
          {std::get<0>(key), std::get<1>(key), static_cast<sched::LinearKind>(std::get<2>(key)),
           held_state(w, in->layer, in->linear).bytes, factor_sums(in->layer, in->linear)});
    }
    other[static_cast<std::size_t>(w)] = pipefisher.before.workers[w].peak_memory_bytes;
  }
  const double budget = options.device_memory_budget_bytes;
  OffloadResult result;
  // auto: from nothing offloaded, each worker still over the budget in the simulation offloads
  // its largest kept Linears, as many as cover its excess, until every worker fits or has
  // nothing left to offload. When the budget is never met, the plan tried with the lowest
  // simulated peak (the highest worker's; then the shorter step) is kept, nothing offloaded
  // included: where the host link is the bottleneck, offloading can raise a peak (write-backs
  // queue behind prefetches while the factors' windows stay open).
  result.plan = plan_offload(options.mode == OffloadMode::kAuto ? OffloadMode::kNone : options.mode,
                             linears, other, budget);
  result.plan.mode = options.mode;
  if (options.mode == OffloadMode::kAuto && budget <= 0.0) {
    throw std::invalid_argument(
        "--kfac-offload auto needs --device-memory-budget (MiB per device, > 0)");
  }
  OffloadReport& report = result.report;
  std::optional<OffloadResult> lowest_peak;  // auto: the plan tried with the lowest peak
  for (;;) {
    // The copies placed each way asked for, each simulated; the better kept.
    std::vector<CopyOrder> orders{CopyOrder::kByDeadline, CopyOrder::kPrefetchesLatestFirst};
    if (options.copy_order) orders = {*options.copy_order};
    for (const CopyOrder order : orders) {
      OffloadReport tried;
      tried.workers.resize(static_cast<std::size_t>(workers));
      tried.copy_order = std::string(to_string(order));
      sched::Schedule placed = schedule;
      for (int w = 0; w < workers; ++w) {
        placed.streams[static_cast<std::size_t>(w)] =
            insert_copies(pipefisher, found, result.plan.workers[static_cast<std::size_t>(w)], w,
                          order, costs, held_state, tried.workers[static_cast<std::size_t>(w)]);
      }
      sched::validate(placed);
      sim::SimResult simulated = sim::simulate(placed, costs, simulation);
      if (order == orders.front() || better_placement(simulated, result.after, budget)) {
        result.schedule = std::move(placed);
        result.after = std::move(simulated);
        report = std::move(tried);
      }
    }
    if (options.mode != OffloadMode::kAuto) break;
    if (!lowest_peak || lower_peak(result.after, lowest_peak->after)) lowest_peak = result;
    bool more = false;
    for (int w = 0; w < workers; ++w) {
      // The largest kept Linears until their state covers the excess (one per simulation took
      // 62 s for the 517 Linears GPT-3 175B offloads at p = 8); the next simulation checks.
      const double excess = result.after.workers[w].peak_memory_bytes - budget;
      auto& plan = result.plan.workers[static_cast<std::size_t>(w)];
      // The factors of every Linear first (half its state, moved once per refresh), then whole
      // Linears (the other half, moved every step). The plan with every Linear's factors
      // offloaded and none whole is simulated before any goes whole.
      for (double freed = 0.0; freed < excess;) {
        const double resident = resident_bytes(plan);
        const bool kept_any = !plan.kept.empty();
        if (!offload_next(plan)) break;
        more = true;
        freed += resident - resident_bytes(plan);
        if (kept_any && plan.kept.empty()) break;
      }
    }
    if (!more) break;
  }
  if (lowest_peak && max_peak(result.after) > budget) result = std::move(*lowest_peak);
  report.mode = std::string(to_string(options.mode));
  report.budget_bytes = budget;
  std::string overflowing;
  for (int w = 0; w < workers; ++w) {
    auto& plan = result.plan.workers[static_cast<std::size_t>(w)];
    auto& worker_report = report.workers[static_cast<std::size_t>(w)];
    plan.fits = budget <= 0.0 || result.after.workers[w].peak_memory_bytes <= budget;
    if (!plan.fits) {
      overflowing += (overflowing.empty() ? "" : ", ") + std::string("worker ") +
                     std::to_string(w) + " needs " + mib(result.after.workers[w].peak_memory_bytes);
    }
    worker_report.offloaded_linears =
        static_cast<int>(plan.offloaded.size() + plan.factors_only.size());
    worker_report.factors_only_linears = static_cast<int>(plan.factors_only.size());
    worker_report.kept_linears = static_cast<int>(plan.kept.size());
    worker_report.factor_sum_bytes = factor_sum_bytes(plan);
    worker_report.kfac_device_bytes_before = plan.kept_bytes + plan.offloaded_bytes +
                                             plan.factors_only_bytes +
                                             worker_report.factor_sum_bytes;
    worker_report.kfac_device_bytes_after = plan.device_kfac_bytes;
    worker_report.offloaded_bytes = plan.offloaded_bytes + plan.factors_only_bytes / 2.0;
    worker_report.peak_memory_before = pipefisher.after.workers[w].peak_memory_bytes;
    worker_report.peak_memory_after = result.after.workers[w].peak_memory_bytes;
    report.max_peak_memory_before =
        std::max(report.max_peak_memory_before, worker_report.peak_memory_before);
    report.max_peak_memory_after =
        std::max(report.max_peak_memory_after, worker_report.peak_memory_after);
    report.transfers += worker_report.transfers;
  }
  result.plan.warning =
      overflowing.empty()
          ? std::string()
          : "K-FAC offload: the device-memory budget of " + mib(budget) +
                " is not met in the simulation (" + overflowing + ")" +
                (options.mode == OffloadMode::kAuto
                     ? "; kept the plan with the lowest peak of those tried (" +
                           std::to_string(result.plan.offloaded_linears()) + " Linears offloaded)"
                     : std::string());
  report.warning = result.plan.warning;
  report.fits = overflowing.empty();
  report.offloaded_linears = result.plan.offloaded_linears();
  report.factors_only_linears = result.plan.factors_only_linears();
  report.step_time_before_s = pipefisher.after.step_time_s;
  report.step_time_after_s = result.after.step_time_s;
  report.step_time_overhead = report.step_time_before_s > 0.0
                                  ? report.step_time_after_s / report.step_time_before_s - 1.0
                                  : 0.0;
  return result;
}

std::string format_offload_report(const OffloadReport& report) {
  char line[256];
  std::string text = "K-FAC offload (" + report.mode;
  if (report.budget_bytes > 0.0) text += ", device budget " + mib(report.budget_bytes);
  text += ")\n";
  text +=
      "worker  offloaded (whole+factors)  K-FAC on device before -> after  peak memory before "
      "-> after  host link/refresh\n";
  for (std::size_t w = 0; w < report.workers.size(); ++w) {
    const auto& r = report.workers[w];
    std::snprintf(
        line, sizeof line,
        "%6zu  %4d of %2d (%3d+%-3d)      %12s -> %-12s  %11s -> %-11s  %8.3f ms%s\n", w,
        r.offloaded_linears, r.offloaded_linears + r.kept_linears,
        r.offloaded_linears - r.factors_only_linears, r.factors_only_linears,
        mib(r.kfac_device_bytes_before).c_str(), mib(r.kfac_device_bytes_after).c_str(),
        mib(r.peak_memory_before).c_str(), mib(r.peak_memory_after).c_str(), 1e3 * r.transfer_s,
        r.late_prefetches > 0
            ? (" (" + std::to_string(r.late_prefetches) + " prefetches without an idle stretch)")
                  .c_str()
            : "");
    text += line;
  }
  std::snprintf(line, sizeof line,
                "%d Linears offloaded (%d whole, %d factors only), %d copies per refresh; step "
                "time %.3f ms -> %.3f ms (%+.2f%%); peak device memory %s -> %s%s%s\n",
                report.offloaded_linears, report.offloaded_linears - report.factors_only_linears,
                report.factors_only_linears, report.transfers, 1e3 * report.step_time_before_s,
                1e3 * report.step_time_after_s, 100 * report.step_time_overhead,
                mib(report.max_peak_memory_before).c_str(),
                mib(report.max_peak_memory_after).c_str(),
                report.transfers > 0 ? "; copies placed " : "",
                report.transfers > 0 ? report.copy_order.c_str() : "");
  text += line;
  if (!report.warning.empty()) text += report.warning + "\n";
  return text;
}

nlohmann::json offload_report_json(const OffloadReport& report) {
  nlohmann::json workers = nlohmann::json::array();
  for (const auto& r : report.workers) {
    workers.push_back({{"offloaded_linears", r.offloaded_linears},
                       {"whole_linears", r.offloaded_linears - r.factors_only_linears},
                       {"factors_only_linears", r.factors_only_linears},
                       {"kept_linears", r.kept_linears},
                       {"kfac_device_bytes_before", r.kfac_device_bytes_before},
                       {"kfac_device_bytes_after", r.kfac_device_bytes_after},
                       {"factor_sum_bytes", r.factor_sum_bytes},
                       {"offloaded_bytes", r.offloaded_bytes},
                       {"peak_memory_before_bytes", r.peak_memory_before},
                       {"peak_memory_after_bytes", r.peak_memory_after},
                       {"transfers_per_refresh", r.transfers},
                       {"transfer_bytes_per_refresh", r.transfer_bytes},
                       {"transfer_s_per_refresh", r.transfer_s},
                       {"late_prefetches", r.late_prefetches}});
  }
  return {{"mode", report.mode},
          {"device_memory_budget_bytes", report.budget_bytes},
          {"fits", report.fits},
          {"warning", report.warning},
          {"offloaded_linears", report.offloaded_linears},
          {"whole_linears", report.offloaded_linears - report.factors_only_linears},
          {"factors_only_linears", report.factors_only_linears},
          {"transfers_per_refresh", report.transfers},
          {"step_time_before_s", report.step_time_before_s},
          {"step_time_after_s", report.step_time_after_s},
          {"step_time_overhead", report.step_time_overhead},
          {"copy_order", report.copy_order},
          {"max_peak_memory_before_bytes", report.max_peak_memory_before},
          {"max_peak_memory_after_bytes", report.max_peak_memory_after},
          {"workers", workers}};
}

}  // namespace pf::pipefisher
