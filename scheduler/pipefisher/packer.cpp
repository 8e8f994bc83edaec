#include "scheduler/pipefisher/packer.h"

#include "scheduler/instruction.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>

namespace pf::pipefisher {
namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

// Room counted as enough when it falls short by less than this (floating-point slack).
double slack(double need) {
  return 1e-12 + 1e-9 * need;
}

// Max-tree over the free room (end - cursor) of one worker's bubbles: finds the first bubble
// in a range with at least a given room in O(log n).
class RoomTree {
 public:
  explicit RoomTree(const std::vector<double>& room) {
    size_ = 1;
    while (size_ < room.size()) size_ *= 2;
    tree_.assign(2 * size_, -kInfinity);
    for (std::size_t i = 0; i < room.size(); ++i) tree_[size_ + i] = room[i];
    for (std::size_t i = size_ - 1; i >= 1; --i)
      tree_[i] = std::max(tree_[2 * i], tree_[2 * i + 1]);
  }
  void set(std::size_t index, double room) {
    std::size_t i = size_ + index;
    tree_[i] = room;
    for (i /= 2; i >= 1; i /= 2) tree_[i] = std::max(tree_[2 * i], tree_[2 * i + 1]);
  }
  // First index in [lo, hi) whose room >= need, or hi.
  std::size_t first_at_least(std::size_t lo, std::size_t hi, double need) const {
    if (lo >= hi) return hi;
    return descend(1, 0, size_, lo, hi, need);
  }

 private:
  std::size_t descend(std::size_t node, std::size_t node_lo, std::size_t node_hi, std::size_t lo,
                      std::size_t hi, double need) const {
    if (node_hi <= lo || node_lo >= hi || tree_[node] < need) return hi;
    if (node_hi - node_lo == 1) return node_lo;
    const std::size_t mid = (node_lo + node_hi) / 2;
    const std::size_t left = descend(2 * node, node_lo, mid, lo, hi, need);
    if (left != hi) return left;
    return descend(2 * node + 1, mid, node_hi, lo, hi, need);
  }
  std::size_t size_ = 1;
  std::vector<double> tree_;
};

struct Fit {
  std::size_t bubble = 0;
  double start = 0.0;
};

class WorkerBubbles {
 public:
  // `index_rooms`: keep each step's bubbles ordered by free room, for best-fit.
  WorkerBubbles(const std::vector<Bubble>& bubbles, int num_steps, bool index_rooms, int wrap_step)
      : bubbles_(bubbles), cursor_(bubbles.size()), tree_(rooms(bubbles)) {
    for (std::size_t i = 0; i < bubbles.size(); ++i) cursor_[i] = bubbles[i].start;
    step_begin_.resize(static_cast<std::size_t>(num_steps) + 1);
    for (int s = 0; s <= num_steps; ++s) {
      auto it = std::lower_bound(bubbles.begin(), bubbles.end(), s,
                                 [](const Bubble& b, int step) { return b.step < step; });
      step_begin_[static_cast<std::size_t>(s)] = static_cast<std::size_t>(it - bubbles.begin());
    }
    if (index_rooms) {
      by_room_.resize(static_cast<std::size_t>(num_steps));
      for (std::size_t i = 0; i < bubbles.size(); ++i) {
        by_room_[static_cast<std::size_t>(bubbles[i].step)].emplace(room(i), i);
      }
    }
    for (std::size_t i = 0; i < bubbles.size(); ++i) {
      if (bubbles[i].step != wrap_step) continue;
      // A wrap-step bubble without a twin holds nothing (its idle time is not known to be free);
      // with one, no more than the shorter of the two (the start-up step's head, where the
      // schedule runs the wrapped work from cold, may be shorter than the steady one).
      const int twin = bubbles[i].twin;
      const double length = twin < 0 ? 0.0
                                     : bubbles[static_cast<std::size_t>(twin)].end -
                                           bubbles[static_cast<std::size_t>(twin)].start;
      set_cursor(i, std::max(bubbles[i].start, bubbles[i].end - length));
    }
  }

  // Earliest bubble accepting a collective, with `need` room at or after `release`.
  // `wrap_step` >= 0: bubbles of that step only up to those ending by `wrap_deadline`.
  std::optional<Fit> earliest_for_collective(double release, double need, int step_lo, int step_hi,
                                             int wrap_step = -1,
                                             double wrap_deadline = kInfinity) const {
    for (;;) {
      auto fit = earliest(release, need, step_lo, step_hi);
      if (fit && wrap_step >= 0 && bubbles_[fit->bubble].step == wrap_step &&
          bubbles_[fit->bubble].end > wrap_deadline) {
        return std::nullopt;
      }
      if (!fit || bubbles_[fit->bubble].accepts_collective) return fit;
      release = bubbles_[fit->bubble].end;  // skip past it
    }
  }

  // Earliest bubble of steps [step_lo, step_hi] with `need` room at or after `release`.
  std::optional<Fit> earliest(double release, double need, int step_lo, int step_hi) const {
    return earliest_in(release, need, begin_of(step_lo), begin_of(step_hi + 1));
  }
  // The same among the bubbles of index [lo_step, hi).
  std::optional<Fit> earliest_in(double release, double need, std::size_t lo_step,
                                 std::size_t hi) const {
    // First bubble ending after the release.
    auto it = std::upper_bound(bubbles_.begin(), bubbles_.end(), release,
                               [](double t, const Bubble& b) { return t < b.end; });
    std::size_t lo = std::max(lo_step, static_cast<std::size_t>(it - bubbles_.begin()));
    if (lo >= hi) return std::nullopt;
    const double first_start = std::max(cursor_[lo], release);
    if (bubbles_[lo].end - first_start + slack(need) >= need) return Fit{lo, first_start};
    const std::size_t next = tree_.first_at_least(lo + 1, hi, need - slack(need));
    if (next >= hi) return std::nullopt;
    return Fit{next, std::max(cursor_[next], release)};
  }

  // Among the bubbles of `fit`'s step from fit.bubble on, the one that fits with least room left
  // (the earliest of equals). `fit` is earliest()'s: every later bubble starts after the release,
  // so its room is end - cursor, and the step's room index gives the tightest in O(log n) per
  // distinct room value tried (values held only by bubbles up to fit.bubble are jumped over).
  Fit tightest_in_step(const Fit& fit, double release, double need) const {
    const double best_left = bubbles_[fit.bubble].end - fit.start - need;
    const auto& rooms = by_room_[static_cast<std::size_t>(bubbles_[fit.bubble].step)];
    constexpr auto kLastIndex = std::numeric_limits<std::size_t>::max();
    // Below need - 2 slack no room passes the fit test: start there.
    auto it = rooms.lower_bound({need - 2.0 * slack(need), std::size_t{0}});
    std::optional<std::size_t> tightest;
    double tightest_left = kInfinity;
    while (it != rooms.end()) {
      const double room = it->first;
      const double left = room - need;
      if (tightest && left != tightest_left) break;  // rooms ascend: no equal left beyond
      if (left + slack(need) >= 0.0) {
        // The earliest bubble after fit.bubble with exactly this room, if any.
        const auto after = rooms.lower_bound({room, fit.bubble + 1});
        if (after != rooms.end() && after->first == room) {
          if (!tightest || after->second < *tightest) tightest = after->second;
          tightest_left = left;
        }
      }
      it = rooms.upper_bound({room, kLastIndex});  // the next distinct room
    }
    if (tightest && tightest_left < best_left) {
      return Fit{*tightest, std::max(cursor_[*tightest], release)};
    }
    return fit;
  }

  // For an item bound to `step`: the first (or, best-fit, the tightest) bubble of that step that
  // accepts bound items and has `need` room after `release`.
  std::optional<Fit> in_step(int step, double release, double need, bool tightest,
                             std::size_t lo = 0) const {
    std::optional<Fit> best;
    double best_left = kInfinity;
    for (std::size_t i = std::max(lo, step_begin_[static_cast<std::size_t>(step)]);
         i < step_begin_[static_cast<std::size_t>(step) + 1]; ++i) {
      const double not_before = std::max(release, bubbles_[i].bound_not_before);
      if (!bubbles_[i].accepts_bound || bubbles_[i].end <= not_before) continue;
      const double start = std::max(cursor_[i], not_before);
      const double left = bubbles_[i].end - start - need;
      if (left + slack(need) < 0.0 || left >= best_left) continue;
      best = Fit{i, start};
      best_left = left;
      if (!tightest) break;
    }
    return best;
  }

  void reserve(std::size_t bubble, double start, double need) {
    set_cursor(bubble, start + need);
    // Its twin is the same idle time in the other window: it loses as much room, less what was
    // held back in it for this work (a step-0 twin's held head, hold_heads).
    const int twin = bubbles_[bubble].twin;
    if (twin >= 0) {
      const auto t = static_cast<std::size_t>(twin);
      double taken = need;
      if (!held_.empty()) {
        const double from_hold = std::min(taken, held_[t]);
        held_[t] -= from_hold;
        taken -= from_hold;
      }
      if (taken > 0.0) set_cursor(t, std::min(bubbles_[t].end, cursor_[t] + taken));
    }
  }

  // Holds back the head of the step-0 bubbles whose wrap-step twin ends by `deadline` from the
  // window's own items (their cursor moves past it), up to `amount` seconds from `from` on, in
  // time order, no more per bubble than its twin can hold: the wrap-step items placed in the
  // twins later take that room first (reserve). Before any reservation.
  void hold_heads(double amount, double deadline, double from) {
    for (std::size_t i = 0; i < bubbles_.size() && amount > 0.0; ++i) {
      const Bubble& b = bubbles_[i];
      if (b.step != 0 || b.twin < 0 || b.end <= from) continue;
      const auto t = static_cast<std::size_t>(b.twin);
      if (bubbles_[t].end > deadline) continue;
      const double shared = std::min(b.end - b.start, bubbles_[t].end - cursor_[t]);
      const double begin = std::max(b.start, from) - b.start;  // free of the others before it
      const double head = std::min(amount, shared - begin);
      if (head <= 0.0) continue;
      if (held_.empty()) held_.assign(bubbles_.size(), 0.0);
      held_[i] = begin + head;
      amount -= head;
      set_cursor(i, b.start + held_[i]);
    }
  }

  int step_of(std::size_t bubble) const { return bubbles_[bubble].step; }
  double end_of(std::size_t bubble) const { return bubbles_[bubble].end; }
  int twin_of(std::size_t bubble) const { return bubbles_[bubble].twin; }
  std::size_t begin_of(int step) const { return step_begin_[static_cast<std::size_t>(step)]; }
  std::size_t size() const { return bubbles_.size(); }

 private:
  static std::vector<double> rooms(const std::vector<Bubble>& bubbles) {
    std::vector<double> room;
    room.reserve(bubbles.size());
    for (const auto& b : bubbles) room.push_back(b.end - b.start);
    return room;
  }
  double room(std::size_t bubble) const { return bubbles_[bubble].end - cursor_[bubble]; }
  void set_cursor(std::size_t bubble, double cursor) {
    if (!by_room_.empty()) {
      auto& rooms = by_room_[static_cast<std::size_t>(bubbles_[bubble].step)];
      rooms.erase({room(bubble), bubble});
      cursor_[bubble] = cursor;
      rooms.emplace(room(bubble), bubble);
    } else {
      cursor_[bubble] = cursor;
    }
    tree_.set(bubble, room(bubble));
  }

  const std::vector<Bubble>& bubbles_;
  std::vector<double> cursor_;
  std::vector<double> held_;  // per step-0 bubble: its head still held (hold_heads); or empty
  RoomTree tree_;
  std::vector<std::size_t> step_begin_;  // first bubble index of each step (and num_steps)
  // Per step: (free room, bubble index) of its bubbles, in that order (best-fit only).
  std::vector<std::set<std::pair<double, std::size_t>>> by_room_;
};

void check_problem(const PackProblem& problem, const std::vector<PackItem>& items) {
  if (problem.num_steps < 1) {
    throw std::invalid_argument("pack: num_steps must be >= 1, got " +
                                std::to_string(problem.num_steps));
  }
  const std::size_t workers = problem.bubbles.size();
  if (problem.wrap_step != -1 &&
      (problem.wrap_step < 1 || problem.wrap_step != problem.num_steps - 1)) {
    throw std::invalid_argument("pack: wrap_step must be -1 or the last step (>= 1), got " +
                                std::to_string(problem.wrap_step) + " of " +
                                std::to_string(problem.num_steps) + " steps");
  }
  if (problem.flush_start.size() != workers) {
    throw std::invalid_argument("pack: flush_start has " +
                                std::to_string(problem.flush_start.size()) +
                                " workers, bubbles has " + std::to_string(workers));
  }
  for (std::size_t w = 0; w < workers; ++w) {
    if (problem.flush_start[w].size() != static_cast<std::size_t>(problem.num_steps)) {
      throw std::invalid_argument("pack: flush_start[" + std::to_string(w) + "] has " +
                                  std::to_string(problem.flush_start[w].size()) +
                                  " steps, expected " + std::to_string(problem.num_steps));
    }
    const auto& bubbles = problem.bubbles[w];
    for (std::size_t i = 0; i < bubbles.size(); ++i) {
      const auto& b = bubbles[i];
      // Built only for a message: ~1M items and bubbles at p = 64, m = 1024.
      const auto where = [&] {
        return "pack: worker " + std::to_string(w) + ", bubble " + std::to_string(i);
      };
      if (!(b.end >= b.start) || !std::isfinite(b.start) || !std::isfinite(b.end)) {
        throw std::invalid_argument(where() + " has end " + std::to_string(b.end) +
                                    " before start " + std::to_string(b.start));
      }
      if (b.step < 0 || b.step >= problem.num_steps) {
        throw std::invalid_argument(where() + " has step " + std::to_string(b.step) +
                                    " outside [0, " + std::to_string(problem.num_steps) + ")");
      }
      if (i > 0 && (b.start < bubbles[i - 1].end || b.step < bubbles[i - 1].step)) {
        throw std::invalid_argument(where() + " overlaps or precedes the bubble before it");
      }
      const auto pairs_steps = [&] {
        const int other = bubbles[static_cast<std::size_t>(b.twin)].step;
        return (b.step == problem.wrap_step && other == 0) ||
               (b.step == 0 && other == problem.wrap_step);
      };
      if (b.twin >= 0 && (problem.wrap_step < 1 ||
                          static_cast<std::size_t>(b.twin) >= bubbles.size() || !pairs_steps())) {
        throw std::invalid_argument(where() + " has twin " + std::to_string(b.twin) +
                                    ": twins pair a wrap-step bubble with a step-0 bubble");
      }
    }
  }
  for (std::size_t i = 0; i < items.size(); ++i) {
    const auto& item = items[i];
    const auto where = [i] { return "pack: item " + std::to_string(i); };
    if (item.workers.empty()) throw std::invalid_argument(where() + " has no worker");
    for (int w : item.workers) {
      if (w < 0 || static_cast<std::size_t>(w) >= workers) {
        throw std::invalid_argument(where() + " names worker " + std::to_string(w));
      }
    }
    if (!(item.duration >= 0.0) || !std::isfinite(item.duration) || !std::isfinite(item.release)) {
      throw std::invalid_argument(where() + " has duration " + std::to_string(item.duration) +
                                  " and release " + std::to_string(item.release));
    }
    for (int p : item.preds) {
      if (p < 0 || static_cast<std::size_t>(p) >= i) {
        throw std::invalid_argument(where() + " depends on item " + std::to_string(p) +
                                    ", which does not precede it");
      }
    }
    if (item.divisible &&
        (!(item.overhead >= 0.0) || !(item.min_piece >= 0.0) || item.overhead > item.duration)) {
      throw std::invalid_argument(where() + " is divisible with overhead " +
                                  std::to_string(item.overhead) + " and min_piece " +
                                  std::to_string(item.min_piece) + " for a duration of " +
                                  std::to_string(item.duration));
    }
    if (item.step_bound >= problem.num_steps ||
        (problem.wrap_step >= 0 && item.step_bound >= problem.wrap_step)) {
      throw std::invalid_argument(where() + " is bound to step " + std::to_string(item.step_bound) +
                                  " of " + std::to_string(problem.num_steps));
    }
  }
}

// Cuts a divisible item into the bubbles of one worker from `release` on (bound: only the bubbles
// of `step_lo` that accept bound items), each piece as large as the room in hand. Returns the
// pieces; `next_unit` is where the rest (if any) begins.
// `bound_step` >= 0: an item bound to that step (in_step, from bubble `lo` on); else the bubbles
// of index [lo, hi).
std::vector<PiecePlacement> cut_into_bubbles(WorkerBubbles& bubbles, const PackItem& item,
                                             double release, double margin, int bound_step,
                                             std::size_t lo, std::size_t hi, int& next_unit,
                                             double& reserved) {
  std::vector<PiecePlacement> pieces;
  const double work = std::max(0.0, item.duration - item.overhead);
  const auto cost = [&](int units) {
    return static_cast<double>(units) / sched::kPieceUnits * work + item.overhead;
  };
  const double min_need = std::max(item.min_piece, cost(1)) * (1.0 + margin);
  next_unit = 0;
  while (next_unit < sched::kPieceUnits) {
    const double rest_need = cost(sched::kPieceUnits - next_unit) * (1.0 + margin);
    const double need = std::min(rest_need, min_need);
    const auto fit = bound_step >= 0 ? bubbles.in_step(bound_step, release, need, false, lo)
                                     : bubbles.earliest_in(release, need, lo, hi);
    if (!fit) break;
    const double room = bubbles.end_of(fit->bubble) - fit->start;
    int units = sched::kPieceUnits - next_unit;
    if (room + slack(rest_need) < rest_need) {
      const double fraction = work > 0.0 ? (room / (1.0 + margin) - item.overhead) / work : 0.0;
      units = std::min(units - 1, static_cast<int>(std::floor(fraction * sched::kPieceUnits)));
      if (units < 1 || cost(units) * (1.0 + margin) + slack(min_need) < min_need) {
        release = bubbles.end_of(fit->bubble);  // too small after rounding: the next bubble
        continue;
      }
    }
    const double duration = cost(units);
    bubbles.reserve(fit->bubble, fit->start, duration * (1.0 + margin));
    reserved += duration * (1.0 + margin);
    pieces.push_back(PiecePlacement{static_cast<int>(fit->bubble), bubbles.step_of(fit->bubble),
                                    fit->start, fit->start + duration, next_unit,
                                    next_unit + units});
    release = fit->start + duration;
    next_unit += units;
  }
  return pieces;
}

// The earliest window of steps [step_lo, step_hi] from `release` on in which every worker of
// `members` has `need` room at once (each in a bubble accepting collectives): the common start
// and each member's bubble.
struct CommonFit {
  double start = 0.0;
  SmallVector<Fit, 2> fits;
};
std::optional<CommonFit> common_window(const std::vector<WorkerBubbles>& workers,
                                       const SmallVector<int, 2>& members, double release,
                                       double need, int step_lo, int step_hi, int wrap_step,
                                       double wrap_deadline) {
  double t = release;
  for (int round = 0; round < 1000000; ++round) {
    CommonFit common;
    double latest = t;
    for (int w : members) {
      auto fit = workers[static_cast<std::size_t>(w)].earliest_for_collective(
          t, need, step_lo, step_hi, wrap_step, wrap_deadline);
      if (!fit) return std::nullopt;
      common.fits.push_back(*fit);
      latest = std::max(latest, fit->start);
    }
    if (std::all_of(common.fits.begin(), common.fits.end(),
                    [&](const Fit& f) { return f.start >= latest - slack(need); })) {
      common.start = 0.0;
      for (const auto& f : common.fits) common.start = std::max(common.start, f.start);
      return common;
    }
    t = latest;
  }
  return std::nullopt;
}

// Cuts a divisible collective (a curvature sync of two replicas) into the windows its workers
// have free at once, from `release` on: each piece as large as the common room in hand, run by
// every member at the same time. Returns the pieces; `next_unit` is where the rest begins.
std::vector<PiecePlacement> cut_into_common_windows(std::vector<WorkerBubbles>& workers,
                                                    const PackItem& item, double release,
                                                    double margin, int step_lo, int step_hi,
                                                    int wrap_step, int& next_unit,
                                                    double& reserved) {
  std::vector<PiecePlacement> pieces;
  const double work = std::max(0.0, item.duration - item.overhead);
  const auto cost = [&](int units) {
    return static_cast<double>(units) / sched::kPieceUnits * work + item.overhead;
  };
  const double min_need = std::max(item.min_piece, cost(1)) * (1.0 + margin);
  next_unit = 0;
  while (next_unit < sched::kPieceUnits) {
    const double rest_need = cost(sched::kPieceUnits - next_unit) * (1.0 + margin);
    const double need = std::min(rest_need, min_need);
    const auto common = common_window(workers, item.workers, release, need, step_lo, step_hi,
                                      wrap_step, item.wrap_deadline);
    if (!common) break;
    double room = kInfinity;
    double first_end = kInfinity;
    for (std::size_t m = 0; m < item.workers.size(); ++m) {
      const double end =
          workers[static_cast<std::size_t>(item.workers[m])].end_of(common->fits[m].bubble);
      room = std::min(room, end - common->start);
      first_end = std::min(first_end, end);
    }
    int units = sched::kPieceUnits - next_unit;
    if (room + slack(rest_need) < rest_need) {
      const double fraction = work > 0.0 ? (room / (1.0 + margin) - item.overhead) / work : 0.0;
      units = std::min(units - 1, static_cast<int>(std::floor(fraction * sched::kPieceUnits)));
      if (units < 1 || cost(units) * (1.0 + margin) + slack(min_need) < min_need) {
        release = first_end;  // too small after rounding: past the window's first end
        continue;
      }
    }
    const double duration = cost(units);
    for (std::size_t m = 0; m < item.workers.size(); ++m) {
      workers[static_cast<std::size_t>(item.workers[m])].reserve(
          common->fits[m].bubble, common->start, duration * (1.0 + margin));
      reserved += duration * (1.0 + margin);
    }
    const auto& first = workers[static_cast<std::size_t>(item.workers[0])];
    pieces.push_back(PiecePlacement{
        static_cast<int>(common->fits[0].bubble), first.step_of(common->fits[0].bubble),
        common->start, common->start + duration, next_unit, next_unit + units,
        item.workers.size() > 1 ? static_cast<int>(common->fits[1].bubble) : -1});
    release = common->start + duration;
    next_unit += units;
  }
  return pieces;
}

}  // namespace

PackResult pack(const PackProblem& problem, const std::vector<PackItem>& items,
                PackingPolicy policy, double safety_margin, const std::vector<double>& wrap_hold) {
  if (policy == PackingPolicy::kBestOfBoth) {
    throw std::invalid_argument("pack: choose first_fit or best_fit (best_of_both runs both)");
  }
  if (!(safety_margin >= 0.0)) {
    throw std::invalid_argument("pack: safety margin must be >= 0, got " +
                                std::to_string(safety_margin));
  }
  check_problem(problem, items);
  if (!wrap_hold.empty() && wrap_hold.size() != problem.bubbles.size()) {
    throw std::invalid_argument("pack: wrap_hold has " + std::to_string(wrap_hold.size()) +
                                " workers, bubbles has " + std::to_string(problem.bubbles.size()));
  }
  for (std::size_t w = 0; w < wrap_hold.size(); ++w) {
    if (!(wrap_hold[w] >= 0.0) || !std::isfinite(wrap_hold[w])) {
      throw std::invalid_argument("pack: wrap_hold of worker " + std::to_string(w) + " is " +
                                  std::to_string(wrap_hold[w]) + " (seconds >= 0)");
    }
  }
  const int wrap = problem.wrap_step;
  // The window's last step: spilled work goes to its flush at the latest (the wrap step is the
  // next window's).
  const int last_step = wrap >= 0 ? wrap - 1 : problem.num_steps - 1;
  std::vector<WorkerBubbles> workers;
  workers.reserve(problem.bubbles.size());
  for (const auto& bubbles : problem.bubbles) {
    workers.emplace_back(bubbles, problem.num_steps, policy == PackingPolicy::kBestFit, wrap);
  }
  if (wrap >= 0 && !wrap_hold.empty()) {
    // Per worker: the latest deadline of its wrappable items (no twin ending later can hold
    // any), and the earliest release of its other items (the room before it is not theirs).
    std::vector<double> deadline(workers.size(), -kInfinity);
    std::vector<double> from(workers.size(), kInfinity);
    for (const PackItem& item : items) {
      for (int w : item.workers) {
        const auto v = static_cast<std::size_t>(w);
        if (item.wrappable) {
          deadline[v] = std::max(deadline[v], item.wrap_deadline);
        } else {
          from[v] = std::min(from[v], item.release);
        }
      }
    }
    for (std::size_t w = 0; w < workers.size(); ++w) {
      if (wrap_hold[w] > 0.0 && deadline[w] > -kInfinity && from[w] < kInfinity) {
        workers[w].hold_heads(wrap_hold[w], deadline[w], from[w]);
      }
    }
  }
  std::vector<std::vector<double>> flush = problem.flush_start;
  // Per state key (one Linear on one worker): the first step-0 bubble its window's work uses,
  // and the step-0 twin of the last wrap-step bubble its previous refresh's work uses.
  constexpr auto kNoBubble = std::numeric_limits<std::size_t>::max();
  struct StateOrder {
    std::size_t first_own = kNoBubble;
    std::size_t wrapped_twin = 0;
  };
  std::map<int, StateOrder> state_order;
  auto note_placement = [&](const PackItem& item, std::size_t bubble) {
    if (wrap < 0 || item.state_key < 0) return;
    auto& order = state_order[item.state_key];
    const auto& bubbles = workers[static_cast<std::size_t>(item.workers[0])];
    if (bubbles.step_of(bubble) == 0) order.first_own = std::min(order.first_own, bubble);
    if (bubbles.step_of(bubble) == wrap && bubbles.twin_of(bubble) >= 0) {
      order.wrapped_twin =
          std::max(order.wrapped_twin, static_cast<std::size_t>(bubbles.twin_of(bubble)));
    }
  };

  PackResult result;
  result.placements.resize(items.size());
  for (std::size_t i = 0; i < items.size(); ++i) {
    const PackItem& item = items[i];
    ItemPlacement& placed = result.placements[i];
    const double need = item.duration * (1.0 + safety_margin);
    double release = item.release;
    int spill_step = item.step_bound >= 0 ? item.step_bound : last_step;
    bool spill = false;
    int step_lo = item.step_bound >= 0 ? item.step_bound : 0;
    const bool wrappable = wrap >= 0 && item.wrappable;
    const int step_hi = item.step_bound >= 0 ? item.step_bound : wrappable ? wrap : last_step;
    for (int p : item.preds) {
      const auto& pred = result.placements[static_cast<std::size_t>(p)];
      release = std::max(release, pred.end);
      if (pred.spilled) {
        // Work after a flush comes in the stream after that step's bubbles: only later steps'.
        step_lo = std::max(step_lo, pred.step + 1);
        spill_step = std::max(spill_step, pred.step);
      }
    }
    if (step_lo > step_hi) spill = true;
    if (item.spill_early && !spill) {
      spill = true;
      // The first flush at or after the release on every participant (the last step's if none).
      // After every predecessor's step: a bubble of step s may sit in the stream after the
      // flush of step s (before the receives of step s + 1).
      spill_step = step_lo;
      for (int p : item.preds) {
        spill_step = std::max(spill_step, result.placements[static_cast<std::size_t>(p)].step + 1);
      }
      spill_step = std::min(spill_step, last_step);
      while (spill_step < last_step &&
             std::any_of(item.workers.begin(), item.workers.end(), [&](int w) {
               return problem.flush_start[static_cast<std::size_t>(w)]
                                         [static_cast<std::size_t>(spill_step)] < release;
             })) {
        ++spill_step;
      }
    }
    spill_step = std::min(spill_step, last_step);

    // A single worker's bubble range [lo, hi): the item's steps; with a wrap step, step 0 only
    // after the previous refresh's work of its Linear, and the wrap step only up to the bubbles
    // that end by its deadline and come before its Linear's first work in step 0.
    std::size_t lo = 0, hi = 0;
    if (item.workers.size() == 1 && !spill) {
      const auto& bubbles = workers[static_cast<std::size_t>(item.workers[0])];
      lo = bubbles.begin_of(step_lo);
      hi = bubbles.begin_of(step_hi + 1);
      if (wrap >= 0 && (item.state_key >= 0 || wrappable)) {
        // (A wrappable item without a state key, a data-parallel sync, has no order in step 0.)
        const auto order =
            item.state_key >= 0 ? state_order.find(item.state_key) : state_order.end();
        if (order != state_order.end()) lo = std::max(lo, order->second.wrapped_twin);
        if (wrappable) {
          const std::size_t first_own =
              order != state_order.end() ? order->second.first_own : kNoBubble;
          std::size_t limit = bubbles.begin_of(wrap);
          while (limit < hi && bubbles.end_of(limit) <= item.wrap_deadline &&
                 bubbles.twin_of(limit) >= 0 &&
                 static_cast<std::size_t>(bubbles.twin_of(limit)) <= first_own) {
            ++limit;
          }
          hi = limit;
        }
      }
      if (lo >= hi && item.step_bound < 0) spill = true;
    }

    std::vector<Fit> fits;
    const bool divisible = item.divisible && !spill;
    if (divisible && policy == PackingPolicy::kFirstFit) {
      // First-fit cuts straight away: a piece in the first gap beats the whole in a later one.
    } else if (!spill && item.workers.size() == 1 && item.step_bound >= 0) {
      auto fit = workers[static_cast<std::size_t>(item.workers[0])].in_step(
          item.step_bound, release, need, policy == PackingPolicy::kBestFit, lo);
      if (fit) fits.push_back(*fit);
    } else if (!spill && item.workers.size() == 1) {
      auto& bubbles = workers[static_cast<std::size_t>(item.workers[0])];
      auto fit = bubbles.earliest_in(release, need, lo, hi);
      // Best-fit's tightest bubble of the step: not in the wrap step (its range is cut short).
      if (fit && policy == PackingPolicy::kBestFit && bubbles.step_of(fit->bubble) != wrap) {
        fit = bubbles.tightest_in_step(*fit, release, need);
      }
      if (fit) fits.push_back(*fit);
    } else if (!spill) {
      // A collective: the earliest time at which every participant has the room.
      if (auto common = common_window(workers, item.workers, release, need, step_lo, step_hi,
                                      wrappable ? wrap : -1, item.wrap_deadline)) {
        fits.assign(common->fits.begin(), common->fits.end());
      }
    }

    if (!fits.empty()) {
      double start = 0.0;
      for (const auto& f : fits) start = std::max(start, f.start);
      placed.start = start;
      placed.end = start + item.duration;
      placed.step = workers[static_cast<std::size_t>(item.workers[0])].step_of(fits[0].bubble);
      for (std::size_t k = 0; k < fits.size(); ++k) {
        workers[static_cast<std::size_t>(item.workers[k])].reserve(fits[k].bubble, start, need);
        placed.bubbles.push_back(static_cast<int>(fits[k].bubble));
      }
      if (fits.size() == 1) note_placement(item, fits[0].bubble);
      result.reserved_s += need * static_cast<double>(fits.size());
      continue;
    }
    if (divisible) {
      const bool collective = item.workers.size() > 1;
      int next_unit = 0;
      placed.pieces =
          collective
              ? cut_into_common_windows(workers, item, release, safety_margin, step_lo, step_hi,
                                        wrappable ? wrap : -1, next_unit, result.reserved_s)
              : cut_into_bubbles(workers[static_cast<std::size_t>(item.workers[0])], item, release,
                                 safety_margin, item.step_bound, lo, hi, next_unit,
                                 result.reserved_s);
      if (!collective) {
        for (const auto& piece : placed.pieces) {
          note_placement(item, static_cast<std::size_t>(piece.bubble));
        }
      }
      const bool whole = next_unit == sched::kPieceUnits && placed.pieces.size() == 1;
      if (whole) {
        const PiecePlacement piece = placed.pieces.front();
        placed.pieces.clear();
        placed.start = piece.start;
        placed.end = piece.end;
        placed.step = piece.step;
        placed.bubbles.push_back(piece.bubble);
        if (collective) placed.bubbles.push_back(piece.other_bubble);
        continue;
      }
      if (!placed.pieces.empty()) {
        if (next_unit < sched::kPieceUnits) {
          // The rest runs after the flush (on every member), once the last piece has ended.
          const auto units = sched::kPieceUnits - next_unit;
          const double duration = static_cast<double>(units) / sched::kPieceUnits *
                                      std::max(0.0, item.duration - item.overhead) +
                                  item.overhead;
          double start = placed.pieces.back().end;
          for (int w : item.workers) {
            start = std::max(
                start, flush[static_cast<std::size_t>(w)][static_cast<std::size_t>(spill_step)]);
          }
          // Pieces in the wrap step (the next window) come after that flush: the rest runs
          // before them, and the units follow the order in which the pieces run.
          const auto wrapped_from = std::find_if(
              placed.pieces.begin(), placed.pieces.end(),
              [&](const PiecePlacement& piece) { return wrap >= 0 && piece.step == wrap; });
          placed.pieces.insert(wrapped_from, PiecePlacement{-1, spill_step, start, start + duration,
                                                            next_unit, sched::kPieceUnits, -1});
          int unit = 0;
          for (auto& piece : placed.pieces) {
            const int size = piece.unit_end - piece.unit_begin;
            piece.unit_begin = unit;
            piece.unit_end = unit + size;
            unit += size;
          }
          for (int w : item.workers) {
            flush[static_cast<std::size_t>(w)][static_cast<std::size_t>(spill_step)] =
                start + duration;
          }
          placed.spilled = true;
          placed.spilled_s = duration;
          if (item.step_bound >= 0) {
            ++result.spilled_bound_items;
          } else {
            ++result.spilled_items;
          }
        }
        placed.start = placed.pieces.front().start;
        placed.end = placed.pieces.back().end;
        placed.step = placed.pieces.back().step;
        placed.bubbles.push_back(placed.pieces.front().bubble);
        if (collective) placed.bubbles.push_back(placed.pieces.front().other_bubble);
        ++result.divided_items;
        result.pieces += static_cast<int>(placed.pieces.size());
        continue;
      }
      // No room for any piece: the whole item spills below.
    }
    // Spill after the flush of spill_step.
    placed.spilled = true;
    placed.step = spill_step;
    double start = release;
    for (int w : item.workers) {
      start =
          std::max(start, flush[static_cast<std::size_t>(w)][static_cast<std::size_t>(spill_step)]);
    }
    placed.start = start;
    placed.end = start + item.duration;
    placed.spilled_s = item.duration;
    for (int w : item.workers) {
      flush[static_cast<std::size_t>(w)][static_cast<std::size_t>(spill_step)] = placed.end;
      placed.bubbles.push_back(-1);
    }
    if (item.step_bound >= 0) {
      ++result.spilled_bound_items;
    } else {
      ++result.spilled_items;
    }
  }
  return result;
}

std::vector<std::size_t> wrapped_before_dependents(const std::vector<PackItem>& items,
                                                   const PackResult& packed, int wrap) {
  std::vector<std::size_t> found;
  if (wrap < 0) return found;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const ItemPlacement& item = packed.placements[i];
    const bool item_wrapped = !item.spilled && item.step == wrap;
    for (int p : items[i].preds) {
      const ItemPlacement& pred = packed.placements[static_cast<std::size_t>(p)];
      if (!pred.spilled && pred.step == wrap && !item_wrapped) {
        found.push_back(static_cast<std::size_t>(p));
      }
    }
  }
  return found;
}

PackResult pack_keeping_wrapped_dependents(const PackProblem& problem,
                                           const std::vector<PackItem>& items, PackingPolicy policy,
                                           double safety_margin,
                                           const std::vector<double>& wrap_hold) {
  PackResult packed = pack(problem, items, policy, safety_margin, wrap_hold);
  auto offenders = wrapped_before_dependents(items, packed, problem.wrap_step);
  if (offenders.empty()) return packed;
  // Each round takes the wrap step from at least one item (only wrappable items go there), so
  // this ends.
  std::vector<PackItem> kept = items;
  while (!offenders.empty()) {
    for (const std::size_t p : offenders) kept[p].wrappable = false;
    packed = pack(problem, kept, policy, safety_margin, wrap_hold);
    offenders = wrapped_before_dependents(kept, packed, problem.wrap_step);
  }
  return packed;
}

}  // namespace pf::pipefisher
