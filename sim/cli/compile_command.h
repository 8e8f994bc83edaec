#pragma once
// The schedule-compiler part of pipefisher_sim: flags, building or loading the schedule, the
// printed grid and summary, and the output files. Kept as a small library so that other
// commands (the simulator, the PipeFisher pass) can add their own flags to the same program.
#include <cstdint>
#include <iosfwd>
#include <string>

#include "scheduler/schedule.h"

namespace CLI {
class App;  // CLI11; only the .cpp files include it (see CMakeLists.txt)
}  // namespace CLI

namespace pf::cli {

struct CompileCommandOptions {
  std::string schedule = "1f1b";  // gpipe, 1f1b, interleaved, chimera, zbh1, zbh2, zbv
  bool schedule_given = false;    // --schedule appeared on the command line
  int stages = 4;
  int microbatches = 8;
  int chunks = 1;
  bool chunks_given = false;  // --chunks appeared (zbv defaults to 2)
  int max_in_flight = 0;      // zbh1 / zbh2 memory limit; 0 = the kind's own
  int layers = 0;
  std::string layers_per_stage;  // "3,1": encoder layers per chunk, in chunk order; empty: balanced
  int data_parallel = 1;
  bool split_backward = false;
  std::int64_t activation_bytes = 0;
  std::int64_t gradient_bytes = 0;
  std::string schedule_file;      // .json (ours) or .csv (torch.distributed.pipelining)
  std::string grid = "timeline";  // timeline, positions, none
  std::string out_json;
  std::string out_csv;
  bool csv_compute_only = false;
  std::string out_trace;
};

// Registers the flags on app (call before app.parse). Their help text documents each one.
void add_compile_options(CLI::App& app, CompileCommandOptions& options);

// Compiles from the flags, or loads --schedule-file (validated either way).
sched::Schedule build_schedule(const CompileCommandOptions& options);

// Human-readable summary: parameters, placement, instruction counts, unit-time makespan and
// bubble, peak stashed micro-batches per worker.
std::string summarize(const sched::Schedule& schedule);

// Writes --out, --csv and --trace (when given), reporting each file on `log`.
void write_outputs(const sched::Schedule& schedule, const CompileCommandOptions& options,
                   std::ostream& log);

// build_schedule, then the grid (per --grid), the summary and the files. Returns the exit code.
int run_compile_command(const CompileCommandOptions& options, std::ostream& out);

}  // namespace pf::cli
