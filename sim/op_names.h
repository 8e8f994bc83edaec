#pragma once
// Classes of instruction kinds as the simulator uses them, and the wording of error messages.
// Names of kinds and Linear layers are sched::to_string / op_kind_from_string.
#include <optional>
#include <string>
#include <string_view>

#include "scheduler/instruction.h"

namespace pf::sim {

// forward, backward (all three forms), optimizer step and K-FAC compute (not the curvature sync).
bool is_compute_kind(sched::OpKind kind);
bool is_kfac_kind(sched::OpKind kind);

// "worker 3, position 17: forward step 0 pipeline 0 chunk 3 micro-batch 5".
std::string describe(const sched::Instruction& instruction, int worker, int position);

}  // namespace pf::sim
