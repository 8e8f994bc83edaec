#pragma once
// Text pictures of a schedule for the terminal: one row per worker.
#include <string>

#include "scheduler/schedule.h"

namespace pf::sched {

struct GridOptions {
  int first_worker = 0;
  int num_workers = -1;  // -1: all from first_worker
  int first_position = 0;
  int num_positions = -1;  // -1: all from first_position
  int marked_worker = -1;  // this cell is drawn as [label]
  int marked_position = -1;
  bool compute_only = false;  // hide communication, reductions and the optimizer step
};

// The streams by position: column j of row w is the j-th instruction of worker w. Rows and
// columns outside the streams are left blank; cut-off streams end in "...".
std::string render_grid(const Schedule& schedule, const GridOptions& options = {});

// The grid around one cell (radius columns either side, a few workers above and below), with
// that cell marked. Used by validation errors.
std::string render_grid_around(const Schedule& schedule, int worker, int position, int radius = 4);

// The compute instructions laid out in time (unit durations, every compute one slot, blocking
// communication of zero duration): the classic pipeline picture, '.' marking idle slots.
// At most max_slots columns (the rest is cut with "...").
std::string render_timeline(const Schedule& schedule, int max_slots = 200);

}  // namespace pf::sched
