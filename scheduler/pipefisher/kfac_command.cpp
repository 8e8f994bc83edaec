#include "scheduler/pipefisher/kfac_command.h"

#include "common/cli_checks.h"
#include "scheduler/pipefisher/defer_weights.h"

#include <CLI/CLI.hpp>
#include <cstdio>
#include <ostream>
#include <sstream>
#include <stdexcept>

namespace pf::pipefisher {
namespace {

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::stringstream stream(text);
  std::string part;
  while (std::getline(stream, part, separator)) parts.push_back(part);
  return parts;
}

int parse_index(const std::string& text, const std::string& flag) {
  std::size_t used = 0;
  int value = -1;
  try {
    value = std::stoi(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (text.empty() || used != text.size() || value < 0) {
    throw std::invalid_argument(flag + ": '" + text + "' is not a layer index");
  }
  return value;
}

std::string format(const char* pattern, double a, double b = 0.0, double c = 0.0, double d = 0.0,
                   double e = 0.0, double f = 0.0, double g = 0.0) {
  char buffer[256];
  std::snprintf(buffer, sizeof buffer, pattern, a, b, c, d, e, f, g);
  return buffer;
}

}  // namespace

void add_kfac_options(CLI::App& app, KfacCommandOptions& options) {
  app.add_flag("--kfac", options.enabled,
               "Run the PipeFisher pass: fill the bubbles with K-FAC curvature, sync, inversion "
               "and preconditioning, and report utilization before/after, the refresh interval "
               "k and the step-time overhead");
  app.add_option("--kfac-policy", options.policy,
                 "Bubble packing: first_fit (PipeFisher), best_fit, best_of_both")
      ->check(CLI::IsMember({"first_fit", "best_fit", "best_of_both"}));
  app.add_option("--kfac-margin", options.safety_margin,
                 "Safety margin: a task fits when duration * (1 + margin) fits")
      ->check(cli_checks::between(0.0, 10.0));
  app.add_option("--kfac-refresh", options.refresh_steps,
                 "Fixed refresh interval k in steps; 0 = as few steps as the bubbles allow")
      ->check(cli_checks::non_negative());
  app.add_option("--kfac-max-refresh", options.max_refresh_steps,
                 "Cap of the automatic refresh interval: beyond it, what does not fit in the "
                 "bubbles runs after the flush (with a warning)")
      ->check(cli_checks::positive());
  app.add_option("--kfac-spill-budget", options.spill_budget,
                 "Automatic refresh interval: take a k that leaves curvature, sync or inversion "
                 "work after the flush when that work costs at most this fraction of a step per "
                 "step on its busiest worker (0: only a k whose bubbles hold all of it)")
      ->check(cli_checks::between(0.0, 1.0));
  app.add_option("--kfac-free-spill", options.free_spill,
                 "Automatic refresh interval: also take a k below the smallest one whose bubbles "
                 "hold all of the curvature, sync and inversion, down to the work/bubble bound, "
                 "where the simulated step with the rest after the flush costs no more (on), or "
                 "only a k that holds all of it (off)")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--kfac-split", options.split,
                 "Cut curvature, curvature sync, inversion and preconditioning into pieces "
                 "that fit the gaps (on), or keep every task whole (off, the indivisible pass)")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--kfac-move-w", options.move_weights,
                 "Zero-bubble schedules: also try every backward-weight (W) deferred 1, 2, 4 "
                 "forwards/backwards or as late as it may go, and keep the best plan (on), or "
                 "leave the Ws where the generator put them (off)")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--kfac-pipelined-refresh", options.pipelined_refresh,
                 "Pipelined refresh (on): the refresh's inversions may also run in the next "
                 "window's first gaps, its inverses serving from that window's first step (one "
                 "step staler than PipeFisher's); kept only where it needs fewer steps or less "
                 "work after the flush. off: PipeFisher's refresh, all of it inside its window")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--kfac-min-piece", options.min_piece_overheads,
                 "Smallest piece, in multiples of the cost model's per-task overhead")
      ->check(cli_checks::non_negative());
  app.add_option("--kfac-curvature", options.curvature,
                 "Curvature from the refresh's first step (first_step, PipeFisher) or from "
                 "every step (every_step)")
      ->check(CLI::IsMember({"first_step", "every_step"}));
  app.add_option("--kfac-linears", options.linears,
                 "Linear layers to precondition: all, or a comma list of query, key, value, "
                 "attention_out, ffn_in, ffn_out");
  app.add_option("--kfac-sharding", options.sharding,
                 "K-FAC state across data-parallel replicas: replicate (every replica holds and "
                 "inverts everything), shard (each Linear's factors, inversion and inverses on "
                 "one owner replica, preconditioned gradients broadcast), partial:G (the same "
                 "within groups of G replicas), factors=P,inverses=P (each component its own, "
                 "e.g. factors=shard,inverses=replicate), or auto (the cost model chooses per "
                 "component)");
  app.add_option("--kfac-memory-budget", options.memory_budget_mib,
                 "With --kfac-sharding auto: K-FAC state per replica at most this many MiB "
                 "(0: no limit)")
      ->check(cli_checks::non_negative());
  app.add_option("--kfac-offload", options.offload,
                 "K-FAC state in host memory (ZeRO-Infinity): none, host (every Linear's factors "
                 "and inverses, prefetched over the host link before use and written back after "
                 "the refresh; on a GPU in pinned host memory, copied on a copy stream), factors "
                 "(every Linear's factors only, moved around its inversions once per refresh; "
                 "the inverses stay on the device), or auto (to fit under "
                 "--device-memory-budget: the factors of the largest Linears first, then the "
                 "largest Linears whole)")
      ->check(CLI::IsMember({"none", "host", "factors", "auto"}));
  app.add_option("--device-memory-budget", options.device_memory_budget_mib,
                 "Device memory per GPU in MiB that --kfac-offload auto must fit under (weights, "
                 "optimizer state, activations and the K-FAC state kept on the device)")
      ->check(cli_checks::non_negative());
  app.add_option("--kfac-offload-copies", options.offload_copies,
                 "How the offload pass places each worker's copies on the host link: best (both "
                 "ways below, each simulated, the better kept), by-deadline (each copy in its "
                 "consumer's order at the latest free stretch), or prefetches-latest-first "
                 "(write-backs first, then prefetches backwards from the last consumer)")
      ->check(CLI::IsMember({"best", "by-deadline", "prefetches-latest-first"}));
  app.add_option("--kfac-layers", options.layers,
                 "Encoder layers to precondition: all, or a comma list of indices and ranges "
                 "(e.g. 0-3,8)");
}

KfacOptions to_kfac_options(const KfacCommandOptions& command) {
  KfacOptions options;
  options.policy = packing_policy_from_string(command.policy);
  options.safety_margin = command.safety_margin;
  options.refresh_steps = command.refresh_steps;
  options.curvature = curvature_source_from_string(command.curvature);
  if (command.split != "on" && command.split != "off") {
    throw std::invalid_argument("--kfac-split: '" + command.split + "' (allowed: on, off)");
  }
  options.split = command.split == "on";
  if (command.move_weights != "on" && command.move_weights != "off") {
    throw std::invalid_argument("--kfac-move-w: '" + command.move_weights + "' (allowed: on, off)");
  }
  options.move_weights = command.move_weights == "on";
  if (command.pipelined_refresh != "on" && command.pipelined_refresh != "off") {
    throw std::invalid_argument("--kfac-pipelined-refresh: '" + command.pipelined_refresh +
                                "' (allowed: on, off)");
  }
  options.pipelined_refresh = command.pipelined_refresh == "on";
  options.max_refresh_steps = command.max_refresh_steps;
  options.spill_budget = command.spill_budget;
  if (command.free_spill != "on" && command.free_spill != "off") {
    throw std::invalid_argument("--kfac-free-spill: '" + command.free_spill +
                                "' (allowed: on, off)");
  }
  options.free_spill = command.free_spill == "on";
  options.min_piece_overheads = command.min_piece_overheads;
  if (command.linears != "all") {
    options.linears.clear();
    for (const auto& name : split(command.linears, ',')) {
      const auto linear = sched::linear_kind_from_string(name);
      if (!linear) {
        throw std::invalid_argument("--kfac-linears: unknown Linear '" + name +
                                    "' (allowed: query, key, value, attention_out, ffn_in, "
                                    "ffn_out, or all)");
      }
      options.linears.push_back(*linear);
    }
  }
  if (command.layers != "all") {
    for (const auto& item : split(command.layers, ',')) {
      const auto dash = item.find('-');
      if (dash == std::string::npos) {
        options.layers.push_back(parse_index(item, "--kfac-layers"));
        continue;
      }
      const int first = parse_index(item.substr(0, dash), "--kfac-layers");
      const int last = parse_index(item.substr(dash + 1), "--kfac-layers");
      if (last < first) {
        throw std::invalid_argument("--kfac-layers: range '" + item + "' is empty");
      }
      for (int layer = first; layer <= last; ++layer) options.layers.push_back(layer);
    }
  }
  const auto sharding = kfac::parse_kfac_sharding(command.sharding);
  options.automatic_placement = sharding.automatic;
  options.state_placement = sharding.placement;
  options.memory_budget_bytes = command.memory_budget_mib * 1024.0 * 1024.0;
  options.linear_dims = command.linear_dims;
  options.validate();
  (void)to_offload_options(command);  // a bad offload flag fails before the pass runs
  return options;
}

std::string format_kfac_report(const KfacReport& report) {
  std::string text = "K-FAC bubble filling (" + report.policy + ", curvature " + report.curvature +
                     ", margin " + format("%.0f%%", 100 * report.safety_margin) + ")\n";
  text +=
      "worker  util before  util after  K-FAC/step  spilled/step  sync/step  K-FAC memory  "
      "+ factor sums\n";
  for (std::size_t w = 0; w < report.workers.size(); ++w) {
    const auto& worker = report.workers[w];
    text +=
        format("%6.0f  %10.1f%%  %9.1f%%  %7.3f ms  %9.3f ms  %6.3f ms  %8.1f MiB",
               static_cast<double>(w), 100 * worker.utilization_before,
               100 * worker.utilization_after, 1e3 * worker.kfac_compute_s, 1e3 * worker.spilled_s,
               1e3 * worker.kfac_sync_s, worker.kfac_memory_bytes / (1024.0 * 1024.0));
    text += format("  %9.1f MiB\n", worker.factor_sum_bytes / (1024.0 * 1024.0));
  }
  text += format("refresh interval k = %.0f steps", report.refresh_steps);
  if (report.refresh_bound > 0) {
    text += format(" (work/bubble bound %.0f", report.refresh_bound);
    if (report.release_bound > 0) {
      text += format(", with release times %.0f", report.release_bound);
    }
    if (report.usable_bound > 0) {
      text += format(", in usable gaps %.0f", report.usable_bound);
    }
    text += ")";
  } else {
    text += " (no k holds all the work)";
  }
  if (report.weights_deferred > 0) {
    text += report.weights_deferred >= kDeferAllTheWay
                ? std::string(" (Ws deferred as late as they go)")
                : format(" (Ws deferred by %.0f)", report.weights_deferred);
  }
  if (report.first_fit_refresh_steps >= 0 && report.best_fit_refresh_steps >= 0) {
    text += format(" (first-fit %.0f, best-fit %.0f", report.first_fit_refresh_steps,
                   report.best_fit_refresh_steps);
    text += report.refined ? "; a packing with the longest work first)" : ")";
  }
  text += report.fixed_interval ? " [fixed]\n" : "\n";
  text += format("utilization %.1f%% -> %.1f%%; step time %.3f ms -> %.3f ms (overhead %+.2f%%)\n",
                 100 * report.utilization_before, 100 * report.utilization_after,
                 1e3 * report.step_time_before_s, 1e3 * report.step_time_after_s,
                 100 * report.step_time_overhead);
  text += format(
      "K-FAC tasks per refresh %.0f; spilled after a flush %.0f; preconditioning in "
      "bubbles %.0f, after the flush %.0f; pass %.3f s\n",
      report.tasks, report.spilled_tasks, report.preconditions_in_bubbles,
      report.preconditions_after_flush, report.pass_seconds);
  text += format("idle time filled %.1f%%; ", 100 * report.idle_filled);
  if (report.split) {
    text += format(
        "%.0f tasks cut into %.0f pieces (%.2f per cut task); ", report.divided_tasks,
        report.pieces,
        report.divided_tasks > 0 ? static_cast<double>(report.pieces) / report.divided_tasks : 0.0);
  } else {
    text += "tasks kept whole (--kfac-split off); ";
  }
  text += format("after the flush %.0f tasks, %.3f ms per refresh\n", report.after_flush_tasks,
                 1e3 * report.after_flush_s);
  if (report.spill_budget > 0.0) {
    text += format(
        "spill budget (--kfac-spill-budget) %.2f%% of a step: curvature, sync and inversion "
        "that some k could hold run after the flush, %.2f%% of a step per step on the busiest "
        "worker\n",
        100 * report.spill_budget, 100 * report.budget_spill);
  }
  if (report.free_spill && report.refresh_steps < report.holding_refresh_steps) {
    text += format(
        "free spill (--kfac-free-spill on): k %.0f, below the %.0f whose bubbles hold all of the "
        "curvature, sync and inversion; what runs after the flush instead costs no step time "
        "(within 0.1 point)\n",
        static_cast<double>(report.refresh_steps),
        static_cast<double>(report.holding_refresh_steps));
  }
  if (report.pipelined_refresh) {
    text += format(
        "pipelined refresh (--kfac-pipelined-refresh on): %.0f tasks run in part or whole in the "
        "next window's first gaps; its inverses serve from that window's first step (k %.0f, "
        "the plain refresh's %.0f)\n",
        report.wrapped_tasks, report.refresh_steps, report.plain_refresh_steps);
  }
  if (report.kfac_sent_bytes_per_refresh > 0.0 || report.state_placement != "replicate") {
    text += format("K-FAC state over %.0f data-parallel replica(s): ",
                   static_cast<double>(report.data_parallel)) +
            report.state_placement + (report.automatic_placement ? " (auto)" : "") +
            format("; per replica at most %.2f MiB held, %.3f MiB sent per refresh\n",
                   report.kfac_memory_bytes / (1024.0 * 1024.0),
                   report.kfac_sent_bytes_per_refresh / (1024.0 * 1024.0));
  }
  if (!report.warning.empty()) text += report.warning + "\n";
  return text;
}

OffloadOptions to_offload_options(const KfacCommandOptions& command) {
  OffloadOptions options;
  options.mode = offload_mode_from_string(command.offload);
  if (!(command.device_memory_budget_mib >= 0.0)) {
    throw std::invalid_argument("--device-memory-budget: must be >= 0 MiB");
  }
  options.device_memory_budget_bytes = command.device_memory_budget_mib * 1024.0 * 1024.0;
  options.copy_order = copy_order_from_string(command.offload_copies);
  if (options.mode == OffloadMode::kAuto && options.device_memory_budget_bytes <= 0.0) {
    throw std::invalid_argument(
        "--kfac-offload auto needs --device-memory-budget (MiB per device, > 0)");
  }
  return options;
}

std::optional<OffloadResult> run_offload_command(const PassResult& pass,
                                                 const sim::CostModel& costs,
                                                 const KfacCommandOptions& options,
                                                 std::ostream& out,
                                                 const sim::SimOptions& sim_options) {
  const OffloadOptions offload = to_offload_options(options);
  if (offload.mode == OffloadMode::kNone) return std::nullopt;
  OffloadResult result = run_offload_pass(pass, costs, offload, sim_options);
  out << format_offload_report(result.report);
  return result;
}

PassResult run_kfac_command(const sched::Schedule& compiled, const sim::CostModel& costs,
                            const KfacCommandOptions& options, std::ostream& out,
                            const sim::SimOptions& sim_options) {
  PassResult result = run_pipefisher(compiled, costs, to_kfac_options(options), sim_options);
  out << format_kfac_report(result.report);
  return result;
}

}  // namespace pf::pipefisher
