#include "scheduler/pipefisher/timeline.h"

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace pf::pipefisher {

using sched::OpKind;

sched::Schedule repeat_steps(const sched::Schedule& base, int steps) {
  if (base.num_steps != 1) {
    throw std::invalid_argument("repeat_steps: the base schedule must have one step, got " +
                                std::to_string(base.num_steps));
  }
  if (steps < 1) {
    throw std::invalid_argument("repeat_steps: steps must be >= 1, got " + std::to_string(steps));
  }
  std::int64_t max_pair = -1;
  for (const auto& stream : base.streams) {
    for (const auto& in : stream) max_pair = std::max(max_pair, in.pair_id);
  }
  sched::Schedule out;
  out.params = base.params;
  out.placement = base.placement;
  out.num_steps = steps;
  out.streams.resize(base.streams.size());
  for (std::size_t w = 0; w < base.streams.size(); ++w) {
    auto& stream = out.streams[w];
    stream.reserve(base.streams[w].size() * static_cast<std::size_t>(steps));
    for (int step = 0; step < steps; ++step) {
      for (sched::Instruction in : base.streams[w]) {
        in.step = static_cast<std::int16_t>(step);
        if (in.pair_id >= 0) in.pair_id += std::int64_t{step} * (max_pair + 1);
        stream.push_back(in);
      }
    }
  }
  return out;
}

sim::Timing Timeline::at(const BaseRef& ref) const {
  const auto w = static_cast<std::size_t>(ref.worker);
  const auto x = static_cast<std::size_t>(ref.position);
  if (ref.step == 0) return first[w][x];
  const double shift = (ref.step - 1) * period_s;
  const sim::Timing t = steady[w][x];
  return {t.start_s + shift, t.end_s + shift};
}

Timeline measure_timeline(const sched::Schedule& base, const sim::CostModel& costs,
                          const sim::SimOptions& options) {
  sim::SimOptions quiet = options;
  quiet.track_memory = false;
  return timeline_from_two_steps(base, sim::simulate(repeat_steps(base, 2), costs, quiet),
                                 options.overlap_communication, options.shared_processors);
}

Timeline timeline_from_two_steps(const sched::Schedule& base, const sim::SimResult& two,
                                 bool overlap_communication, const sim::SharedProcessors& shared) {
  Timeline timeline;
  timeline.overlap_communication = overlap_communication;
  timeline.processor_of = sim::resolve_processors(shared, base.num_workers());
  timeline.processor_capacity = shared.capacity;
  for (std::size_t w = 0; w < base.streams.size(); ++w) {
    const std::size_t n = base.streams[w].size();
    const auto& times = two.times[w];
    timeline.first.emplace_back(times.begin(), times.begin() + static_cast<std::ptrdiff_t>(n));
    timeline.steady.emplace_back(times.begin() + static_cast<std::ptrdiff_t>(n), times.end());
    for (std::size_t x = 0; x < n; ++x) {
      timeline.first_step_end_s = std::max(timeline.first_step_end_s, times[x].end_s);
    }
  }
  timeline.period_s = two.makespan_s - timeline.first_step_end_s;
  if (!(timeline.period_s > 0.0)) timeline.period_s = timeline.first_step_end_s;
  return timeline;
}

bool occupies_compute_lane(OpKind kind, bool overlap_communication) {
  if (!overlap_communication) return true;
  return !sched::is_point_to_point(kind) && !sched::is_reduction(kind);
}

namespace {

// The compute of every worker on each shared processor over `steps` steps, for the room a
// bubble leaves beside it.
class ProcessorRoom {
 public:
  ProcessorRoom(const sched::Schedule& base, const Timeline& timeline, int steps)
      : timeline_(timeline) {
    if (timeline.processor_of.empty()) return;
    spans_.resize(timeline.processor_of.size());
    for (int w = 0; w < base.num_workers(); ++w) {
      const auto& stream = base.streams[static_cast<std::size_t>(w)];
      auto& spans = spans_[static_cast<std::size_t>(processor(w))];
      for (int step = 0; step < steps; ++step) {
        for (int x = 0; x < static_cast<int>(stream.size()); ++x) {
          if (!occupies_compute_lane(stream[static_cast<std::size_t>(x)].kind, true)) continue;
          const sim::Timing t = timeline.at(BaseRef{w, x, step});
          if (t.end_s > t.start_s) spans.push_back(Span{t.start_s, t.end_s, w});
        }
      }
    }
    for (auto& spans : spans_) {
      std::sort(spans.begin(), spans.end(),
                [](const Span& a, const Span& b) { return a.start < b.start; });
      double longest = 0.0;
      for (const Span& span : spans) longest = std::max(longest, span.end - span.start);
      longest_.push_back(longest);
    }
  }

  bool shared() const { return !spans_.empty(); }

  // Seconds of [from, to) that `worker` may compute in at full speed beside the others.
  double room(int worker, double from, double to) const {
    const auto p = static_cast<std::size_t>(processor(worker));
    const auto& spans = spans_[p];
    std::vector<std::pair<double, int>> edges;
    // Spans that start before `to`, back to the longest span's length before `from`.
    auto it = std::lower_bound(spans.begin(), spans.end(), to,
                               [](const Span& span, double time) { return span.start < time; });
    while (it != spans.begin()) {
      --it;
      if (it->start + longest_[p] <= from) break;
      if (it->worker == worker || it->end <= from) continue;
      edges.emplace_back(std::max(from, it->start), +1);
      edges.emplace_back(std::min(to, it->end), -1);
    }
    std::sort(edges.begin(), edges.end());
    const double capacity = timeline_.processor_capacity;
    const auto free_at = [capacity](int others) { return std::clamp(capacity - others, 0.0, 1.0); };
    double room = 0.0, time = from;
    int others = 0;
    for (const auto& [at, change] : edges) {
      room += (at - time) * free_at(others);
      time = at;
      others += change;
    }
    return room + (to - time) * free_at(others);
  }

 private:
  struct Span {
    double start, end;
    int worker;
  };
  int processor(int worker) const {
    return timeline_.processor_of[static_cast<std::size_t>(worker)];
  }

  const Timeline& timeline_;
  std::vector<std::vector<Span>> spans_;  // per processor, by start
  std::vector<double> longest_;           // per processor
};

}  // namespace

BubbleMap find_bubbles(const sched::Schedule& base, const Timeline& timeline, int steps) {
  if (steps < 1) {
    throw std::invalid_argument("find_bubbles: steps must be >= 1, got " + std::to_string(steps));
  }
  const int workers = base.num_workers();
  const double end_of_schedule = timeline.end_of_steps(steps);
  BubbleMap map;
  map.problem.num_steps = steps;
  map.problem.bubbles.resize(static_cast<std::size_t>(workers));
  map.problem.flush_start.assign(static_cast<std::size_t>(workers),
                                 std::vector<double>(static_cast<std::size_t>(steps), 0.0));
  map.slots.resize(static_cast<std::size_t>(workers));
  map.flush_slot.resize(static_cast<std::size_t>(workers));
  map.capacity_s.assign(static_cast<std::size_t>(workers),
                        std::vector<double>(static_cast<std::size_t>(steps), 0.0));

  const ProcessorRoom processors(base, timeline, steps);
  for (int w = 0; w < workers; ++w) {
    const auto& stream = base.streams[static_cast<std::size_t>(w)];
    const int n = static_cast<int>(stream.size());
    int optimizer_at = n;
    for (int x = 0; x < n; ++x) {
      if (stream[static_cast<std::size_t>(x)].kind == OpKind::kOptimizerStep) {
        optimizer_at = x;
        break;
      }
    }
    auto& bubbles = map.problem.bubbles[static_cast<std::size_t>(w)];
    auto& slots = map.slots[static_cast<std::size_t>(w)];
    auto& flush_start = map.problem.flush_start[static_cast<std::size_t>(w)];
    for (int step = 0; step < steps; ++step) {
      map.flush_slot[static_cast<std::size_t>(w)].push_back(Slot{step, optimizer_at});
      flush_start[static_cast<std::size_t>(step)] = step == 0 ? 0.0 : timeline.end_of_steps(step);
    }

    // Walk the unrolled stream. A bubble is the idle time between two forwards/backwards less
    // the other compute-lane work inside it (the optimizer step, which the bubble's work goes
    // ahead of, shifting it later). It is also cut at each collective, a rendezvous: the worker
    // issues nothing while it waits for its partner, but computes again once the transfer runs.
    double previous_end = 0.0;
    int previous_step = 0;
    double other_busy = 0.0;
    std::optional<Slot> optimizer_slot;
    // The simulator starts preconditioning after the step's reductions that precede it.
    double reductions_end = 0.0;
    double transfer_end = 0.0;  // communication lanes busy with a collective until then
    auto close_gap = [&](double next_start, Slot slot) {
      const double end = next_start - other_busy;
      if (optimizer_slot) slot = *optimizer_slot;
      // Where a collective is still transferring, the bubble is split: no collective before
      // the transfer ends, any after.
      double from = previous_end;
      while (end > from) {
        const bool lanes_busy = transfer_end > from;
        const double to = lanes_busy ? std::min(end, transfer_end) : end;
        const double room = processors.shared() ? processors.room(w, from, to) : to - from;
        if (room > 0.0) {
          bubbles.push_back(Bubble{previous_step, from, from + room, static_cast<int>(slots.size()),
                                   true, reductions_end, !lanes_busy});
          slots.push_back(slot);
          map.capacity_s[static_cast<std::size_t>(w)][static_cast<std::size_t>(previous_step)] +=
              room;
        }
        from = to;
      }
      other_busy = 0.0;
      optimizer_slot.reset();
    };
    for (int step = 0; step < steps; ++step) {
      for (int x = 0; x < n; ++x) {
        const OpKind kind = stream[static_cast<std::size_t>(x)].kind;
        const sim::Timing t = timeline.at(BaseRef{w, x, step});
        if (sched::is_compute(kind)) {
          int position = x;  // ahead of the receives that feed this compute
          while (position > 0 &&
                 sched::is_receive(stream[static_cast<std::size_t>(position - 1)].kind)) {
            --position;
          }
          close_gap(t.start_s, Slot{step, position});
          previous_end = t.end_s;
          if (step != previous_step) reductions_end = 0.0;
          previous_step = step;
          flush_start[static_cast<std::size_t>(step)] = t.end_s;
        } else if (sched::is_receive(kind)) {
          continue;  // waiting for data: that wait is the bubble
        } else if (timeline.overlap_communication && sched::is_reduction(kind)) {
          close_gap(t.start_s, Slot{step, x});
          previous_end = std::max(previous_end, t.start_s);
          reductions_end = std::max(reductions_end, t.end_s);
          transfer_end = std::max(transfer_end, t.end_s);
        } else if (occupies_compute_lane(kind, timeline.overlap_communication)) {
          other_busy += t.end_s - t.start_s;
          if (kind == OpKind::kOptimizerStep && !optimizer_slot) optimizer_slot = Slot{step, x};
        }
      }
    }
    close_gap(end_of_schedule, Slot{steps - 1, n});
  }
  return map;
}

}  // namespace pf::pipefisher
