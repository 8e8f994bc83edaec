// pipefisher_sim: compile (or load), validate, picture and export pipeline schedules, and
// simulate them with a cost model (--model, --uniform or --profile).
// Errors print one line on stderr; exit status 2 for bad input or usage, 1 for an internal
// failure (common/exit_codes.h).
#include <exception>
#include <iostream>

#include <CLI/CLI.hpp>

#include "common/exit_codes.h"
#include "sim/calibrate_command.h"
#include "sim/cli/compile_command.h"
#include "sim/search_command.h"
#include "sim/sim_command.h"

int main(int argc, char** argv) {
  CLI::App app{
      "pipefisher_sim: compiles a pipeline schedule (GPipe, 1F1B, interleaved 1F1B, Chimera) "
      "or loads one (JSON, torch CSV), validates it, prints its grid and a summary, and writes "
      "JSON, CSV and Chrome-trace files. With a cost model (--model, --uniform or --profile) it "
      "simulates the schedule: step time, bubble, utilization, exposed communication and peak "
      "memory per worker, throughput; --schedule all compares the schedules; --kfac fills the "
      "bubbles with K-FAC work (the PipeFisher pass). 'calibrate' fits a device to measurements; "
      "'search' finds the fastest tensor x pipeline x data-parallel configuration.",
      "pipefisher_sim"};
  pf::cli::CompileCommandOptions options;
  pf::cli::add_compile_options(app, options);
  pf::cli::SimCommandOptions sim_options;
  pf::cli::add_sim_options(app, sim_options);
  pf::pipefisher::KfacCommandOptions kfac_options;
  pf::pipefisher::add_kfac_options(app, kfac_options);
  pf::cli::CalibrateOptions calibrate_options;
  CLI::App* calibrate = pf::cli::add_calibrate_command(app, calibrate_options);
  pf::cli::SearchCommandOptions search_options;
  CLI::App* search = pf::cli::add_search_command(app, search_options);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    if (error.get_exit_code() == 0) return app.exit(error);  // --help
    std::cerr << "pipefisher_sim: error: " << error.what() << " (see --help)\n";
    return pf::kExitBadInput;
  }
  try {
    if (*calibrate) return pf::cli::run_calibrate_command(calibrate_options, std::cout);
    if (*search) return pf::cli::run_search_command(search_options, std::cout);
    return pf::cli::run_sim_command(options, sim_options, std::cout, kfac_options);
  } catch (const std::exception& error) {
    std::cerr << "pipefisher_sim: error: " << error.what() << "\n";
    return pf::exit_code_for(error);
  }
}
