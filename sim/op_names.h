#pragma once
// Names and classes of instruction kinds as the simulator uses them: the keys of the measured
// profile format (docs/simulator.md) and the wording of error messages.
#include <optional>
#include <string>
#include <string_view>

#include "scheduler/instruction.h"

namespace pf::sim {

// snake_case name of a kind, e.g. "forward", "recv_gradient", "curvature_a".
std::string_view kind_name(sched::OpKind kind);
std::optional<sched::OpKind> kind_from_name(std::string_view name);

// forward, backward (all three forms), optimizer step and K-FAC compute (not the curvature sync).
bool is_compute_kind(sched::OpKind kind);
bool is_kfac_kind(sched::OpKind kind);

std::string_view linear_name(sched::LinearKind kind);  // "query", ..., "ffn_out"
std::optional<sched::LinearKind> linear_from_name(std::string_view name);

// "worker 3, position 17: forward step 0 pipeline 0 chunk 3 micro-batch 5".
std::string describe(const sched::Instruction& instruction, int worker, int position);

}  // namespace pf::sim
