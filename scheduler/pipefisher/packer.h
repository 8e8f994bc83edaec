#pragma once
// Packing K-FAC tasks into per-worker idle intervals ("bubbles"). Abstract: knows nothing about
// schedules, only intervals, durations, release times and dependencies, so that it can be tested
// on synthetic intervals and reused on measured ones.
#include <vector>

#include "scheduler/pipefisher/kfac_options.h"
#include "scheduler/small_vector.h"

namespace pf::pipefisher {

struct Bubble {
  int step = 0;        // the training step whose work precedes the bubble
  double start = 0.0;  // usable window [start, end), seconds
  double end = 0.0;
  int slot = -1;                   // caller's tag (e.g. where in the stream its tasks go)
  bool accepts_bound = true;       // may hold items bound to `step` (false: after its deadline)
  double bound_not_before = 0.0;   // items bound to `step` start no earlier than this here
  bool accepts_collective = true;  // false where the communication lanes are already busy
  // A pipelined refresh (PackProblem::wrap_step): the index of the same worker's bubble that is
  // the same idle time (a wrap-step bubble and the step-0 bubble of its slot); a reservation in
  // one takes its room from both. -1: none (a wrap-step bubble without one holds nothing).
  int twin = -1;
};

struct PackItem {
  SmallVector<int, 2> workers;  // one, or several that must run it at the same time (a collective)
  double duration = 0.0;
  double release = 0.0;       // earliest start (from the pipeline work it depends on)
  SmallVector<int, 2> preds;  // indices of earlier items that must end first
  int step_bound = -1;        // >= 0: only bubbles of this step; spills to this step's flush
  // A divisible item may be cut into pieces that fill the gaps in hand (a collective's: the
  // windows all its workers have free at once, each piece run by all of them): a piece of
  // `units` of kPieceUnits costs units / kPieceUnits * (duration - overhead) + overhead (the
  // cost models' kfac_piece_seconds), and no piece costs less than min_piece (the last one
  // excepted: it is whatever remains).
  bool divisible = false;
  double overhead = 0.0;
  double min_piece = 0.0;
  // Fits no bubble whatever the number of steps (an indivisible task, e.g. a collective, longer
  // than every gap): it runs after the flush of the first step that ends after its release, so
  // that what depends on it can still fill the bubbles of the later steps.
  bool spill_early = false;
  // A pipelined refresh: the item may run in the wrap step (the next window's first gaps), in
  // bubbles that end by wrap_deadline (the next window's preconditioning of its Linear); a
  // collective (a curvature sync) in windows all its workers have free there.
  bool wrappable = false;
  double wrap_deadline = 0.0;
  // Items sharing K-FAC state (one Linear on one worker; -1: none): with a wrap step, the
  // wrapped ones run before the others in step 0's stream (the twin bubbles' order): the next
  // window's work of a Linear must not start before the previous refresh's of it ends.
  int state_key = -1;
};

// One piece of a divided item, in time order.
struct PiecePlacement {
  int bubble = -1;  // index into the worker's bubbles; -1: after the flush of the item's step
  int step = 0;
  double start = 0.0;
  double end = 0.0;
  int unit_begin = 0;
  int unit_end = 0;
  int other_bubble = -1;  // a two-worker collective: the second worker's bubble (-1: flush)
};

struct ItemPlacement {
  bool spilled = false;  // runs after the flush of `step` (extends that step)
  int step = 0;
  double start = 0.0;
  double end = 0.0;             // start + duration
  SmallVector<int, 2> bubbles;  // per participant: index into that worker's bubbles; -1 if spilled
  // Divided items only (two or more pieces, or part spilled): the pieces, whose first start and
  // last end are start and end above; spilled then means the last piece runs after the flush.
  std::vector<PiecePlacement> pieces;
  double spilled_s = 0.0;  // the part of the duration that runs after the flush
};

struct PackProblem {
  int num_steps = 1;
  std::vector<std::vector<Bubble>> bubbles;      // per worker, in time order, disjoint
  std::vector<std::vector<double>> flush_start;  // [worker][step]: when spilled work may start
  // >= 0 (a pipelined refresh): the last step, whose bubbles are the next window's first step's
  // (each the twin of a step-0 bubble): only wrappable items go there, and nothing spills to
  // its flush (the wrap step is not a step of the window).
  int wrap_step = -1;
};

struct PackResult {
  std::vector<ItemPlacement> placements;  // parallel to the items
  int spilled_items = 0;                  // items without a step bound that spilled
  int spilled_bound_items = 0;            // items with a step bound (preconditions) that spilled
  double reserved_s = 0.0;                // bubble time reserved (durations * (1 + margin))
  int divided_items = 0;                  // items placed as two or more pieces
  int pieces = 0;                         // pieces of those items
};

// Places the items in the given order (it must be topological). kFirstFit: the earliest bubble
// (in time) where duration * (1 + margin) fits after the item's release. kBestFit: the earliest
// step where it fits, and within that step the fitting bubble that leaves the least room.
// Collectives use the earliest common window under both policies. A divisible item that does not
// fit whole (first-fit: in the earliest bubble it could start in; best-fit: anywhere) is cut:
// pieces fill the bubbles (a collective's: the common windows) from its release on, each as
// large as the room left, none smaller than min_piece, and what is left at the end of its steps
// runs after the flush. An item that
// fits nowhere spills to the flush of its bound step or of the last step (spill_early: of the
// first step ending after its release); an item whose predecessor spilled goes into the bubbles
// of the steps after that flush, or spills too.
// `wrap_hold` (a pipelined refresh, PackProblem::wrap_step; empty: none): per worker, seconds
// of step-0 room held back from the window's own items for the previous refresh's wrapped work.
// Step-0 items come first in the order (curvature before inversions) and would otherwise fill
// the step-0 bubbles whose wrap-step twins the wrappable items need. The hold takes the head
// (earliest part, where the wrapped work runs in the stream) of the step-0 bubbles whose twin
// ends by the worker's latest wrap deadline, in time order, from the earliest release of the
// worker's other items on (the room before it is theirs anyway), no more per bubble than its
// twin holds; a wrap-step item uses the held room of its twin first.
// Throws std::invalid_argument on malformed input (unsorted or overlapping bubbles, bad worker
// or predecessor indices, negative durations, a hold per worker of another size or negative);
// kBestOfBoth is not accepted here.
PackResult pack(const PackProblem& problem, const std::vector<PackItem>& items,
                PackingPolicy policy, double safety_margin,
                const std::vector<double>& wrap_hold = {});

// Items placed in the wrap step (the next window) with a dependent that is not, e.g. one that
// found no room after it there and spilled after the window's last flush: the stream runs the
// wrap step's work after the whole window, so that dependent would run before it (a
// data-parallel curvature sync in the next window, its inversions finalizing the unsynced sums
// in this one). Indices into `items`; empty without a wrap step.
std::vector<std::size_t> wrapped_before_dependents(const std::vector<PackItem>& items,
                                                   const PackResult& packed, int wrap_step);

// pack(), repaired where wrapped_before_dependents finds items: they lose the wrap step (stay in
// their own window) and the items pack again, until none is found.
PackResult pack_keeping_wrapped_dependents(const PackProblem& problem,
                                           const std::vector<PackItem>& items, PackingPolicy policy,
                                           double safety_margin,
                                           const std::vector<double>& wrap_hold = {});

}  // namespace pf::pipefisher
