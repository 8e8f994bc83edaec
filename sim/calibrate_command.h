#pragma once
// `pipefisher_sim calibrate`: fits a device's per-class rates and launch overheads to measured
// durations (sim/calibration.h) and writes a device JSON that --device reads; or, with --no-fit,
// reports a device's error against the measurements. Prints every record's measured and
// predicted time and the median / worst |error| per operation, fitted and held-out records apart.
#include <iosfwd>
#include <string>
#include <vector>

namespace CLI {
class App;
}  // namespace CLI

namespace pf::cli {

struct CalibrateOptions {
  std::string measurements;            // --measurements FILE.json
  std::string device = "h100";         // --device: starting point (preset or file)
  std::string out;                     // --out FILE.json: the fitted device
  std::string name;                    // --name of the fitted device
  std::string report;                  // --report FILE.json: residuals
  std::vector<std::string> hold_outs;  // --hold-out FIELD=VALUE
  std::vector<std::string> keep;       // --keep PARAMETER[*]: not fitted (the start's value)
  bool no_fit = false;
  // --max-spread F: records whose samples' spread ("spread", bench_sim_calibrate) exceeds F are
  // left out of the fit and the report (listed).
  double max_spread = 0.0;  // 0: keep all
};

// Adds the `calibrate` subcommand to `app` and returns it.
CLI::App* add_calibrate_command(CLI::App& app, CalibrateOptions& options);

// Runs it; throws std::invalid_argument on bad input. Returns the exit code.
int run_calibrate_command(const CalibrateOptions& options, std::ostream& out);

}  // namespace pf::cli
