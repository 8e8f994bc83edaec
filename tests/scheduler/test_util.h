#pragma once
// Helpers shared by the scheduler tests.
#include <string>
#include <vector>

#include "scheduler/schedule.h"

namespace pf::sched::testing {

// Parameters of a generated schedule: kind, p workers, m micro-batches, v chunks per worker.
inline ScheduleParams make(ScheduleKind kind, int p, int m, int v = 1) {
  ScheduleParams params;
  params.kind = kind;
  params.workers = p;
  params.microbatches = m;
  params.chunks_per_worker = v;
  return params;
}

// Labels of one stream, space-separated (short_label of each instruction).
inline std::string labels(const std::vector<Instruction>& stream, bool compute_only = false) {
  std::string out;
  for (const Instruction& in : stream) {
    if (compute_only && !is_compute(in.kind)) continue;
    if (!out.empty()) out += ' ';
    out += short_label(in);
  }
  return out;
}

// "F0 F1 B0" for one chunk per worker: labels without the ".cN" suffix, checking the chunk.
inline std::string microbatch_labels(const std::vector<Instruction>& stream, int chunk) {
  std::string out;
  for (const Instruction& in : stream) {
    if (!is_compute(in.kind)) continue;
    if (in.chunk != chunk) return "wrong chunk " + std::to_string(in.chunk);
    std::string label = short_label(in);
    label = label.substr(0, label.find('.'));
    if (!out.empty()) out += ' ';
    out += label;
  }
  return out;
}

}  // namespace pf::sched::testing
