#pragma once
// The --kfac part of pipefisher_sim: its flags, and running the PipeFisher pass on a compiled
// schedule with a cost model, printing a per-worker table and returning the pass's result (its
// report's to_json, report_json.h, is the `kfac` object of --report).
#include <iosfwd>
#include <string>
#include <vector>

#include <optional>

#include "scheduler/pipefisher/offload_pass.h"
#include "scheduler/pipefisher/pass.h"

namespace CLI {
class App;  // CLI11; only the .cpp includes it
}  // namespace CLI

namespace pf::pipefisher {

struct KfacCommandOptions {
  bool enabled = false;                   // --kfac
  std::string policy = "best_of_both";    // --kfac-policy
  double safety_margin = 0.05;            // --kfac-margin
  int refresh_steps = 0;                  // --kfac-refresh (0: automatic)
  std::string curvature = "first_step";   // --kfac-curvature
  std::string linears = "all";            // --kfac-linears: all, or e.g. query,key,ffn_in
  std::string layers = "all";             // --kfac-layers: all, or e.g. 0-3,8
  std::string split = "on";               // --kfac-split on|off
  std::string move_weights = "off";       // --kfac-move-w on|off
  std::string pipelined_refresh = "off";  // --kfac-pipelined-refresh on|off
  int max_refresh_steps = 64;             // --kfac-max-refresh
  double spill_budget = 0.0;              // --kfac-spill-budget
  std::string free_spill = "off";         // --kfac-free-spill on|off
  double min_piece_overheads = 2.0;       // --kfac-min-piece
  std::string sharding = "replicate";     // --kfac-sharding auto|replicate|shard|partial:G
  double memory_budget_mib = 0.0;         // --kfac-memory-budget (0: no limit)
  std::string offload = "none";           // --kfac-offload none|host|auto
  double device_memory_budget_mib = 0.0;  // --device-memory-budget (for --kfac-offload auto)
  std::string offload_copies = "best";    // --kfac-offload-copies best|by-deadline|...
  // (d_in, d_out) per Linear kind, from the model (set by the caller; empty without one).
  std::vector<kfac::LinearDims> linear_dims;
};

// Registers --kfac and its options on app.
void add_kfac_options(CLI::App& app, KfacCommandOptions& options);

// Parses the flag values; throws std::invalid_argument naming the flag and the bad value.
KfacOptions to_kfac_options(const KfacCommandOptions& options);

// Runs the pass on `compiled` (one step, with communication) and writes a table of per-worker
// utilization before/after, K-FAC time, memory, then the totals, to `out`.
PassResult run_kfac_command(const sched::Schedule& compiled, const sim::CostModel& costs,
                            const KfacCommandOptions& options, std::ostream& out,
                            const sim::SimOptions& sim_options = {});

// Parses --kfac-offload and --device-memory-budget; throws std::invalid_argument naming the flag.
OffloadOptions to_offload_options(const KfacCommandOptions& options);

// With --kfac-offload host or auto: runs the offload pass on the PipeFisher pass's result and
// writes its table to `out`; with none, nothing (std::nullopt).
std::optional<OffloadResult> run_offload_command(const PassResult& pass,
                                                 const sim::CostModel& costs,
                                                 const KfacCommandOptions& options,
                                                 std::ostream& out,
                                                 const sim::SimOptions& sim_options = {});

// The table printed by run_kfac_command.
std::string format_kfac_report(const KfacReport& report);

}  // namespace pf::pipefisher
