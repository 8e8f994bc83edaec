#include "sim/calibrate_command.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <ostream>
#include <stdexcept>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "common/cli_checks.h"
#include "sim/calibration.h"
#include "sim/cpu_device.h"

namespace pf::cli {
namespace {

struct ErrorSummary {
  std::vector<double> errors;  // |relative error|
  double median() const {
    auto sorted = errors;
    std::sort(sorted.begin(), sorted.end());
    const std::size_t n = sorted.size();
    return n % 2 == 1 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
  }
  double worst() const { return *std::max_element(errors.begin(), errors.end()); }
};

std::string format(const char* pattern, double a) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, pattern, a);
  return buffer;
}

}  // namespace

CLI::App* add_calibrate_command(CLI::App& app, CalibrateOptions& options) {
  CLI::App* command = app.add_subcommand(
      "calibrate",
      "Fit a device's per-class efficiencies, latencies and launch overheads to measured "
      "durations (docs/simulator.md, 'Calibration') and write a device JSON for --device; "
      "with --no-fit, report a device's error against the measurements");
  command->add_option("--measurements", options.measurements, "Measured durations (JSON)")
      ->required();
  command->add_option(
      "--device", options.device,
      "Device to start from (or to evaluate with --no-fit): preset, this-cpu (one core "
      "of this machine, its peaks measured) or JSON file");
  command->add_option("--out", options.out, "Write the fitted device to FILE.json");
  command->add_option("--name", options.name, "Name of the fitted device");
  command->add_option("--report", options.report, "Write every record's residual to FILE.json");
  command->add_option("--hold-out", options.hold_outs,
                      "FIELD=VALUE: leave records with that field out of the fit (still "
                      "reported); repeatable");
  command->add_option("--keep", options.keep,
                      "PARAMETER: keep the start device's value instead of fitting it (a name "
                      "the fit prints, e.g. classes.memory.latency_s; a trailing * matches a "
                      "prefix, e.g. 'classes.memory.*'); repeatable");
  command->add_flag("--no-fit", options.no_fit, "Only report the device's error");
  command
      ->add_option("--max-spread", options.max_spread,
                   "Leave out records whose samples' spread ('spread': interquartile range / "
                   "median, bench_sim_calibrate) exceeds this")
      ->check(cli_checks::positive());
  return command;
}

int run_calibrate_command(const CalibrateOptions& options, std::ostream& out) {
  const sim::DeviceSpec start = sim::resolve_device(options.device);
  auto measurements = sim::measurements_from_json_file(options.measurements, start);
  if (options.max_spread > 0.0) {
    std::vector<sim::Measurement> kept;
    for (auto& m : measurements) {
      const auto spread = m.record.find("spread");
      if (spread != m.record.end() && spread->is_number() &&
          spread->get<double>() > options.max_spread) {
        out << "left out (spread " << format("%.2f", spread->get<double>()) << "): " << m.label
            << "\n";
      } else {
        kept.push_back(std::move(m));
      }
    }
    if (kept.empty()) {
      throw std::invalid_argument("--max-spread " + format("%g", options.max_spread) +
                                  ": every record of " + options.measurements + " is left out");
    }
    measurements = std::move(kept);
  }
  for (const auto& rule : options.hold_outs) sim::hold_out(measurements, rule);
  sim::DeviceSpec device = start;
  std::vector<std::string> at_bound;  // fitted efficiencies that stopped at 1
  if (!options.no_fit) {
    sim::FitOptions fit_options;
    fit_options.keep = options.keep;
    const sim::FitResult fit = sim::fit_device(start, measurements, fit_options);
    device = fit.device;
    if (!options.name.empty()) device.name = options.name;
    out << "fitted " << fit.parameters.size() << " parameters to "
        << std::count_if(measurements.begin(), measurements.end(),
                         [](const sim::Measurement& m) { return !m.held_out; })
        << " records (" << fit.evaluations << " evaluations, rms log error "
        << format("%.4f", fit.rms_log_error) << "):\n";
    for (const auto& p : fit.parameters) {
      out << "  " << p.name() << " = " << format("%.6g", p.get(device)) << "\n";
    }
    for (const auto& p : fit.kept) {
      out << "  " << p.name() << " = " << format("%.6g", p.get(device)) << " (kept)\n";
    }
    for (const auto& rule : fit.unmatched_keep) {
      out << "  --keep " << rule << ": no such parameter in these records (ignored)\n";
    }
    for (const auto& p : fit.parameters) {
      if (p.is_efficiency() && p.get(device) >= 0.999) at_bound.push_back(p.name());
    }
  }
  const auto rows = sim::residuals(device, measurements);
  out << "\ndevice '" << device.name << "' against " << options.measurements << "\n";
  out << "record                                   measured ms  predicted ms   error\n";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    // The samples' spread where the record gives it (bench_sim_calibrate): a noisy record.
    const auto spread = measurements[i].record.find("spread");
    const std::string noise = spread != measurements[i].record.end() && spread->is_number()
                                  ? format("  spread %.2f", spread->get<double>())
                                  : "";
    char line[240];
    std::snprintf(line, sizeof line, "%-40s %11.4f %13.4f %+7.1f%%%s%s\n", r.label.c_str(),
                  r.measured_s * 1e3, r.predicted_s * 1e3, 100.0 * r.relative_error,
                  r.held_out ? "  (held out)" : "", noise.c_str());
    out << line;
  }
  // An efficiency is a fraction of the start device's peak and stops at 1. With the fitted
  // records of an operation still predicted slow, that bound held the fit back: the start's peaks
  // are below what the records ran at (the AVX2 cpu_start.json against an AVX-512 Xeon: training
  // steps +14% to +20%, GEMMs alone +40%).
  std::map<std::string, std::vector<double>> fitted_errors;  // signed, by operation
  for (const auto& r : rows) {
    if (!r.held_out) fitted_errors[r.operation].push_back(r.relative_error);
  }
  std::string slow;
  for (auto& [operation, errors] : fitted_errors) {
    std::sort(errors.begin(), errors.end());
    const double median_error = errors[errors.size() / 2];
    // 10%: above the scatter of a noisy machine's rounds (a fit from this CPU's own peaks left
    // the Xeon's training chunks +6% to +8%), below a start that is too slow (+17% and more).
    if (median_error > 0.10) {
      slow +=
          (slow.empty() ? "" : ", ") + operation + " " + format("%+.1f%%", 100.0 * median_error);
    }
  }
  if (!at_bound.empty() && !slow.empty()) {
    out << "\nwarning: fitted records are predicted slow (median: " << slow << ") with";
    for (const auto& name : at_bound) out << " " << name;
    out << " at the bound of 1: the start device's peaks (fp32 "
        << format("%.3g", start.peak_flops(sim::Precision::kFp32) * 1e-9) << " GFLOP/s, memory "
        << format("%.3g", start.memory_bandwidth * 1e-9)
        << " GB/s) are below what these records ran at; start from this machine's (--device "
        << sim::kThisCpuDevice << " measures this CPU's)\n";
  }
  std::map<std::pair<std::string, bool>, ErrorSummary> summaries;
  for (const auto& r : rows) {
    summaries[{r.operation, r.held_out}].errors.push_back(std::abs(r.relative_error));
  }
  out << "\noperation               records  median |error|  worst |error|\n";
  for (const auto& [key, summary] : summaries) {
    char line[160];
    std::snprintf(line, sizeof line, "%-20s%-4s %7zu %14.1f%% %13.1f%%\n", key.first.c_str(),
                  key.second ? " (h)" : "", summary.errors.size(), 100.0 * summary.median(),
                  100.0 * summary.worst());
    out << line;
  }
  if (!options.out.empty()) {
    std::ofstream file(options.out);
    if (!file) throw std::invalid_argument("cannot write " + options.out);
    file << sim::device_to_json(device).dump(2) << "\n";
    out << "\nwrote " << options.out << "\n";
  }
  if (!options.report.empty()) {
    nlohmann::json json = nlohmann::json::array();
    for (const auto& r : rows) {
      json.push_back({{"record", r.label},
                      {"operation", r.operation},
                      {"measured_s", r.measured_s},
                      {"predicted_s", r.predicted_s},
                      {"relative_error", r.relative_error},
                      {"held_out", r.held_out}});
    }
    std::ofstream file(options.report);
    if (!file) throw std::invalid_argument("cannot write " + options.report);
    file << nlohmann::json{{"device", sim::device_to_json(device)}, {"residuals", json}}.dump(2)
         << "\n";
  }
  return 0;
}

}  // namespace pf::cli
