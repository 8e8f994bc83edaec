#pragma once
// Lowering: turns a compute-only schedule (generated or imported) into one that a distributed
// runtime can execute with blocking point-to-point communication.
#include <cstdint>

#include "scheduler/schedule.h"

namespace pf::sched {

struct LoweringOptions {
  std::int64_t activation_bytes = 0;  // payload of each activation send/receive
  std::int64_t gradient_bytes = 0;    // payload of each (activation-)gradient send/receive
  bool optimizer_step = true;         // append kOptimizerStep at the end of each step
  // Payload of gradient reductions: this many bytes per encoder layer of the reduced chunk.
  std::int64_t reduction_bytes_per_layer = 0;
};

// Inserts, in a deadlock-free order:
// - a send right after each compute whose output goes to a chunk on another worker, and the
//   matching receive into the consumer's stream at the same logical moment (the streams are
//   replayed round-robin, one instruction per worker per round; a compute is issued once its
//   inputs exist), with a fresh pair id per pair;
// - kReduceGradDataParallel (when data_parallel > 1) right after the last backward of each
//   chunk in each step;
// - at the end of each step on each worker: kReduceGradPipelines between the two workers that
//   hold replicas of a stage (two pipelines, i.e. Chimera), issued in ascending stage order once
//   both workers have finished the step's compute, then kOptimizerStep.
// The input may hold K-FAC instructions (kept in place, in order); it must not already hold
// communication, reductions or optimizer steps. Throws std::invalid_argument when the input is
// malformed or its compute order can never finish (names the stuck workers).
Schedule lower(Schedule compute_only, const LoweringOptions& options = {});

// Whether the schedule already carries point-to-point communication.
bool has_communication(const Schedule& schedule);

}  // namespace pf::sched
