#include "sim/cli/compile_command.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <ostream>
#include <stdexcept>

#include <CLI/CLI.hpp>

#include "scheduler/compile.h"
#include "scheduler/grid.h"
#include "scheduler/placement.h"
#include "scheduler/schedule_json.h"
#include "scheduler/torch_csv.h"
#include "scheduler/unit_timings.h"
#include "traces/chrome_trace.h"

namespace pf::cli {
namespace {

std::string lowercase_extension(const std::string& path) {
  std::string ext = std::filesystem::path(path).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return ext;
}

std::string percent(double fraction) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.1f%%", 100.0 * fraction);
  return buffer;
}

std::string number(double value) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%g", value);
  return buffer;
}

}  // namespace

void add_compile_options(CLI::App& app, CompileCommandOptions& options) {
  app.add_option_function<std::string>(
         "--schedule",
         [&options](const std::string& value) {
           options.schedule = value;
           options.schedule_given = true;
         },
         "Pipeline schedule to generate: gpipe, 1f1b, interleaved (Megatron, --chunks per "
         "worker), chimera (two bidirectional pipelines), zbh1 / zbh2 (zero-bubble, split "
         "backward; --max-in-flight) or zbv (zero-bubble V: two chunks per worker, chunk i and "
         "2p-1-i on worker i). With a --schedule-file, the kind the file must be: a file whose "
         "placement or shape contradicts it is refused, never reinterpreted ('chimera' reads "
         "CSV stage indices as two pipelines). 'all' (with a cost model: --model, --uniform or "
         "--profile) compares them all in one simulated table")
      ->check(
          CLI::IsMember({"gpipe", "1f1b", "interleaved", "chimera", "zbh1", "zbh2", "zbv", "all"}))
      ->default_str(options.schedule);
  app.add_option("--stages,-p", options.stages, "Pipeline workers p (Chimera: D, even)")
      ->capture_default_str();
  app.add_option("--microbatches,-m", options.microbatches,
                 "Micro-batches per training step (interleaved: a multiple of p; chimera: a "
                 "multiple of D)")
      ->capture_default_str();
  app.add_option_function<int>(
         "--chunks,-v",
         [&options](int value) {
           options.chunks = value;
           options.chunks_given = true;
         },
         "Model chunks per worker (interleaved: any; zbv: 2, its default; others need 1)")
      ->default_str(std::to_string(options.chunks));
  app.add_option("--max-in-flight", options.max_in_flight,
                 "zbh1 / zbh2: micro-batches a worker may hold between forward and "
                 "backward-weight, in [p, 2p-1] (0: p for zbh1, 2p-1 for zbh2)")
      ->capture_default_str();
  app.add_option("--layers", options.layers,
                 "Encoder layers to place over the chunks, balanced (0: one per chunk)")
      ->capture_default_str();
  app.add_option("--layers-per-stage", options.layers_per_stage,
                 "Encoder layers of each chunk of a pipeline, comma-separated in chunk order "
                 "(stages x chunks entries, each >= 1, summing to the layers), e.g. 3,1 to give "
                 "the last stage (which also runs the MLM/NSP heads) fewer; default balanced. "
                 "Chimera: both pipelines use the same counts. 'auto' (with a cost model): the "
                 "split of least simulated step time (with --kfac: after the PipeFisher pass), "
                 "searched from the balanced one a layer at a time");
  app.add_option("--data-parallel", options.data_parallel,
                 "Data-parallel replicas of the pipeline (>1 adds gradient all-reduces)")
      ->capture_default_str();
  app.add_flag("--split-backward", options.split_backward,
               "Split each backward into backward-input and backward-weight (zero-bubble style)");
  app.add_option("--activation-bytes", options.activation_bytes,
                 "Bytes of each activation send/receive (recorded on the instructions)")
      ->capture_default_str();
  app.add_option("--gradient-bytes", options.gradient_bytes, "Bytes of each gradient send/receive")
      ->capture_default_str();
  app.add_option("--schedule-file", options.schedule_file,
                 "Load the schedule instead of generating it: FILE.json (this project's format) "
                 "or FILE.csv (torch.distributed.pipelining actions, compute-only or with "
                 "communication); it is lowered if needed and validated");
  app.add_option("--grid", options.grid,
                 "What to print: timeline (compute in unit time slots), positions (every "
                 "instruction by stream position) or none")
      ->check(CLI::IsMember({"timeline", "positions", "none"}))
      ->capture_default_str();
  app.add_option("--out", options.out_json,
                 "Write the schedule as JSON to FILE.json (with --kfac: the k-step schedule with "
                 "the K-FAC work)");
  app.add_option("--csv", options.out_csv,
                 "Write the schedule in torch.distributed.pipelining's CSV action format; by "
                 "default with communication, the form torch's "
                 "_load_csv(format=\"compute_comms\") reads (SEND/RECV, WAIT_SEND_F/B, "
                 "REDUCE_GRAD + WAIT_REDUCE_GRAD)");
  app.add_flag("--csv-compute-only", options.csv_compute_only,
               "With --csv: write compute actions only (F, B, I, W, OVERLAP_F_B), torch's "
               "\"compute_only\" form, which torchtitan's schedule loader reads");
  app.add_option("--trace", options.out_trace,
                 "Write a Chrome trace (Perfetto / chrome://tracing) of the schedule laid out "
                 "with unit durations (forward 1 us, backward 2 us, communication 0); with a "
                 "cost model (--model, --uniform, --profile), of the simulated run");
}

sched::Schedule build_schedule(const CompileCommandOptions& options) {
  sched::LoweringOptions lowering;
  lowering.activation_bytes = options.activation_bytes;
  lowering.gradient_bytes = options.gradient_bytes;
  if (options.activation_bytes < 0 || options.gradient_bytes < 0) {
    throw std::invalid_argument("byte counts must be >= 0");
  }
  if (!options.schedule_file.empty()) {
    if (!options.layers_per_stage.empty()) {
      throw std::invalid_argument("--layers-per-stage " + options.layers_per_stage +
                                  " cannot be combined with --schedule-file " +
                                  options.schedule_file +
                                  " (the file carries its own placement; compile it with "
                                  "--layers-per-stage instead)");
    }
    const std::string ext = lowercase_extension(options.schedule_file);
    if (!std::filesystem::exists(options.schedule_file)) {
      throw std::invalid_argument("schedule file " + options.schedule_file + " does not exist");
    }
    if (ext == ".json") return sched::load_schedule_json(options.schedule_file);
    if (ext == ".csv") {
      sched::TorchCsvImportOptions csv;
      if (options.schedule_given) csv.kind = sched::schedule_kind_from_string(options.schedule);
      csv.num_layers = options.layers;
      csv.data_parallel = options.data_parallel;
      csv.lowering = lowering;
      return sched::load_torch_csv(options.schedule_file, csv);
    }
    throw std::invalid_argument("schedule file " + options.schedule_file + ": unknown extension '" +
                                ext + "' (use .json or .csv)");
  }
  sched::ScheduleParams params;
  params.kind = sched::schedule_kind_from_string(options.schedule);
  params.workers = options.stages;
  params.microbatches = options.microbatches;
  params.chunks_per_worker = options.chunks;
  if (params.kind == sched::ScheduleKind::kZeroBubbleV && !options.chunks_given) {
    params.chunks_per_worker = 2;
  }
  params.max_in_flight = options.max_in_flight;
  params.num_layers = options.layers;
  if (!options.layers_per_stage.empty()) {
    params.layers_per_chunk = sched::parse_layer_counts(options.layers_per_stage);
  }
  params.data_parallel = options.data_parallel;
  params.split_backward = options.split_backward;
  return sched::compile(params, lowering);
}

std::string summarize(const sched::Schedule& schedule) {
  const sched::ScheduleParams& p = schedule.params;
  const sched::Placement& placement = schedule.placement;
  std::string out;
  out += "schedule " + std::string(sched::to_string(p.kind)) + ": " + std::to_string(p.workers) +
         " workers, " + std::to_string(p.microbatches) + " micro-batches, " +
         std::to_string(p.chunks_per_worker) + " chunk(s) per worker, " +
         std::to_string(placement.num_pipelines) + " pipeline(s), " +
         std::to_string(placement.num_layers) + " layers, data-parallel " +
         std::to_string(p.data_parallel) + (p.split_backward ? ", split backward" : "") + "\n";
  out += "placement:\n";
  const auto owned = sched::chunks_by_worker(placement, schedule.num_workers());
  for (int w = 0; w < schedule.num_workers(); ++w) {
    out += "  w" + std::to_string(w) + ":";
    for (const sched::ChunkRef& ref : owned[static_cast<std::size_t>(w)]) {
      const sched::ChunkPlacement& cp = placement.at(ref.pipeline, ref.chunk);
      out += " " + std::string(ref.pipeline == 1 ? "u" : "") + "c" + std::to_string(ref.chunk) +
             "[layers " + std::to_string(cp.first_layer) + ".." +
             std::to_string(cp.first_layer + cp.num_layers - 1) +
             (cp.has_embeddings ? ", embeddings" : "") + (cp.has_head ? ", head" : "") + "]";
    }
    out += "\n";
  }
  std::array<std::size_t, sched::kNumOpKinds> counts{};
  for (const auto& stream : schedule.streams) {
    for (const sched::Instruction& in : stream) ++counts[static_cast<std::size_t>(in.kind)];
  }
  out += "instructions: " + std::to_string(schedule.num_instructions()) + " (";
  bool first = true;
  for (int k = 0; k < sched::kNumOpKinds; ++k) {
    if (counts[static_cast<std::size_t>(k)] == 0) continue;
    out += std::string(first ? "" : ", ") +
           std::string(sched::to_string(static_cast<sched::OpKind>(k))) + " " +
           std::to_string(counts[static_cast<std::size_t>(k)]);
    first = false;
  }
  out += ")\n";
  // Unit-time layout: forward 1, backward 2 (1 + 1 when split), communication 0.
  const sched::UnitDurations durations;
  const auto timings = sched::unit_timings(schedule, durations);
  double makespan = 0;
  double busy = 0;
  std::string peaks;
  for (std::size_t w = 0; w < schedule.streams.size(); ++w) {
    int in_flight = 0;
    int peak = 0;
    for (std::size_t i = 0; i < schedule.streams[w].size(); ++i) {
      const sched::Instruction& in = schedule.streams[w][i];
      makespan = std::max(makespan, timings[w][i].start_us + timings[w][i].duration_us);
      if (sched::is_compute(in.kind)) busy += timings[w][i].duration_us;
      if (in.kind == sched::OpKind::kForward) peak = std::max(peak, ++in_flight);
      if (in.kind == sched::OpKind::kBackward || in.kind == sched::OpKind::kBackwardWeight) {
        --in_flight;
      }
    }
    peaks += " " + std::to_string(peak);
  }
  const double capacity = makespan * static_cast<double>(schedule.num_workers());
  out += "unit-time layout (forward 1, backward 2, communication 0): makespan " + number(makespan) +
         ", bubble " + percent(capacity > 0 ? 1.0 - busy / capacity : 0.0) + "\n";
  out += "peak stashed micro-batches per worker:" + peaks + "\n";
  return out;
}

void write_outputs(const sched::Schedule& schedule, const CompileCommandOptions& options,
                   std::ostream& log) {
  if (!options.out_json.empty()) {
    sched::save_schedule_json(options.out_json, schedule);
    log << "wrote " << options.out_json << "\n";
  }
  if (!options.out_csv.empty()) {
    sched::save_torch_csv(options.out_csv, schedule, !options.csv_compute_only);
    log << "wrote " << options.out_csv << "\n";
  }
  if (!options.out_trace.empty()) {
    const auto timings = sched::unit_timings(schedule, sched::UnitDurations{});
    traces::write_json_file(options.out_trace, traces::make_chrome_trace(schedule, timings));
    log << "wrote " << options.out_trace << "\n";
  }
}

int run_compile_command(const CompileCommandOptions& options, std::ostream& out) {
  const sched::Schedule schedule = build_schedule(options);
  if (options.grid == "timeline") {
    out << sched::render_timeline(schedule, 120) << "\n";
  } else if (options.grid == "positions") {
    out << sched::render_grid(schedule) << "\n";
  }
  out << summarize(schedule);
  write_outputs(schedule, options, out);
  return 0;
}

}  // namespace pf::cli
