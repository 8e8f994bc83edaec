#include "scheduler/pipefisher/plan.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kfac/pieces.h"

namespace pf::pipefisher::pass_internal {

using sched::OpKind;

namespace {

// The payload of a curvature-sync piece: its rows of both factors (kfac::piece_items, as the
// executor's sync of a row range), fp32; 0 where the Linears' dimensions are not given.
std::int64_t sync_piece_bytes(const sched::Instruction& in,
                              const std::vector<kfac::LinearDims>& dims) {
  if (dims.empty()) return 0;
  const auto& d = dims[static_cast<std::size_t>(in.linear)];
  const auto rows_a = kfac::piece_items(d.d_in, in.piece_begin, in.piece_end).size();
  const auto rows_b = kfac::piece_items(d.d_out, in.piece_begin, in.piece_end).size();
  return 4 * (rows_a * d.d_in + rows_b * d.d_out);
}

}  // namespace

// Whether a pipelined plan runs part of a collective (a curvature sync) in the next window.
bool wraps_collectives(const Plan& plan) {
  const int wrap = plan.bubbles().problem.wrap_step;
  if (wrap < 0) return false;
  for (std::size_t i = 0; i < plan.order.size(); ++i) {
    const KfacTask& task = plan.work().tasks[static_cast<std::size_t>(plan.order[i])];
    if (!sched::is_kfac_collective(task.kind())) continue;
    const ItemPlacement& placed = plan.packed.placements[i];
    if (placed.step == wrap) return true;
    for (const PiecePlacement& piece : placed.pieces) {
      if (piece.step == wrap) return true;
    }
  }
  return false;
}

// Inserts the planned K-FAC instructions into the base streams repeated k times.
sched::Schedule emit(const sched::Schedule& base, const Plan& plan,
                     const std::vector<kfac::LinearDims>& dims) {
  const sched::Schedule repeated = repeat_steps(base, plan.refresh_steps);
  struct Insert {
    int step;
    int position;
    bool spilled;
    bool own;  // false: a pipelined refresh's work of the previous window (first in its slot)
    double start;
    int item;
    sched::Instruction instruction;
  };
  // A pipelined refresh's wrap step k is the next window's step 0: its work goes to step 0 of
  // the stream, as the previous refresh's (step - k: sched::is_wrapped).
  const int k = plan.refresh_steps;
  const auto insert = [&](Slot slot, bool spilled, double start, int item, sched::Instruction in) {
    const bool wrapped = plan.pipelined && slot.step == k;
    if (wrapped) {
      slot.step = 0;
      in.step = static_cast<std::int16_t>(in.step - k);
    }
    return Insert{slot.step, slot.position, spilled, !wrapped, start, item, in};
  };
  std::vector<std::vector<Insert>> inserts(static_cast<std::size_t>(base.num_workers()));
  for (std::size_t i = 0; i < plan.order.size(); ++i) {
    const KfacTask& task = plan.work().tasks[static_cast<std::size_t>(plan.order[i])];
    const ItemPlacement& placed = plan.packed.placements[i];
    if (!placed.pieces.empty()) {
      // Every member of a divided collective runs each piece (in the same order: the pieces of
      // one sync start at the same planned times on both).
      for (std::size_t r = 0; r < task.workers.size(); ++r) {
        const auto w = static_cast<std::size_t>(task.workers[r]);
        Slot previous{0, 0};
        for (const PiecePlacement& piece : placed.pieces) {
          const int bubble = r == 0 ? piece.bubble : piece.other_bubble;
          const bool spilled = bubble < 0;
          Slot slot =
              spilled
                  ? plan.bubbles().flush_slot[w][static_cast<std::size_t>(piece.step)]
                  : plan.bubbles().slots[w][static_cast<std::size_t>(
                        plan.bubbles().problem.bubbles[w][static_cast<std::size_t>(bubble)].slot)];
          // The chain's order: a rest after the flush never goes ahead of an earlier piece.
          if (std::tie(slot.step, slot.position) < std::tie(previous.step, previous.position)) {
            slot = previous;
          }
          previous = slot;
          sched::Instruction in = task.instructions[r];
          in.piece_begin = static_cast<std::uint16_t>(piece.unit_begin);
          in.piece_end = static_cast<std::uint16_t>(piece.unit_end);
          if (in.kind == OpKind::kCurvatureSync) in.bytes = sync_piece_bytes(in, dims);
          inserts[w].push_back(insert(slot, spilled, piece.start, static_cast<int>(i), in));
        }
      }
      continue;
    }
    for (std::size_t r = 0; r < task.workers.size(); ++r) {
      const auto w = static_cast<std::size_t>(task.workers[r]);
      const Slot slot =
          placed.spilled ? plan.bubbles().flush_slot[w][static_cast<std::size_t>(placed.step)]
                         : plan.bubbles().slots[w][static_cast<std::size_t>(
                               plan.bubbles()
                                   .problem.bubbles[w][static_cast<std::size_t>(placed.bubbles[r])]
                                   .slot)];
      inserts[w].push_back(
          insert(slot, placed.spilled, placed.start, static_cast<int>(i), task.instructions[r]));
    }
  }
  sched::Schedule out;
  out.params = base.params;
  out.placement = base.placement;
  out.num_steps = plan.refresh_steps;
  out.kfac_pipelined_refresh = plan.pipelined;
  out.streams.resize(base.streams.size());
  for (std::size_t w = 0; w < base.streams.size(); ++w) {
    auto& list = inserts[w];
    // In a slot, the previous refresh's work first (it precedes all of the window's work of its
    // Linear), then the planned order; work after a flush after the work in bubbles.
    // Sorted by key with the entries' indices, then gathered: moving the keys only is a third
    // of the bytes of moving the entries (with their instructions).
    struct Key {
      int step;
      int position;
      bool spilled;
      bool own;
      double start;
      int item;
      std::uint32_t index;
    };
    std::vector<Key> keys(list.size());
    for (std::size_t i = 0; i < list.size(); ++i) {
      const Insert& e = list[i];
      keys[i] =
          Key{e.step, e.position, e.spilled, e.own, e.start, e.item, static_cast<std::uint32_t>(i)};
    }
    std::sort(keys.begin(), keys.end(), [](const Key& a, const Key& b) {
      return std::tie(a.step, a.position, a.spilled, a.own, a.start, a.item, a.index) <
             std::tie(b.step, b.position, b.spilled, b.own, b.start, b.item, b.index);
    });
    const int n = static_cast<int>(base.streams[w].size());
    auto& stream = out.streams[w];
    stream.reserve(repeated.streams[w].size() + list.size());
    std::size_t next = 0;
    for (int step = 0; step < plan.refresh_steps; ++step) {
      for (int x = 0; x <= n; ++x) {
        while (next < keys.size() && keys[next].step == step && keys[next].position == x) {
          stream.push_back(list[keys[next++].index].instruction);
        }
        if (x < n) {
          stream.push_back(
              repeated.streams[w][static_cast<std::size_t>(step) * static_cast<std::size_t>(n) +
                                  static_cast<std::size_t>(x)]);
        }
      }
    }
    if (next != keys.size()) {
      throw std::logic_error("PipeFisher pass: K-FAC work of worker " + std::to_string(w) +
                             " was planned outside the schedule");
    }
  }
  return out;
}

}  // namespace pf::pipefisher::pass_internal
