#include "sim/sim_command.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <limits>
#include <optional>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <vector>

#include <CLI/CLI.hpp>

#include "common/cli_checks.h"
#include "common/comma_list.h"
#include "runtime/model/bert_config.h"
#include "scheduler/compile.h"
#include "scheduler/grid.h"
#include "scheduler/pipefisher/report_json.h"
#include "scheduler/placement.h"
#include "sim/analytic_cost_model.h"
#include "sim/attention_kernels.h"
#include "sim/config_search.h"
#include "sim/layer_balance.h"
#include "sim/machine_processors.h"
#include "sim/measured_cost_model.h"
#include "sim/parallel_cost_model.h"
#include "sim/simulator.h"
#include "sim/transformer_spec.h"
#include "sim/uniform_cost_model.h"
#include "traces/chrome_trace.h"

namespace pf::cli {
namespace {

sim::Workload workload_of(const SimCommandOptions& options) {
  sim::Workload workload;
  workload.config = model::resolve_bert_config(options.model);
  workload.seq_len = options.seq_len;
  workload.micro_batch_size = options.micro_batch_size;
  workload.precision = sim::precision_from_string(options.precision);
  if (!options.storage_precision.empty()) {
    workload.storage_precision = sim::precision_from_string(options.storage_precision);
  }
  workload.attention = sim::attention_from_string(options.attention);
  if (!options.stash.empty()) workload.stash = sim::activation_stash_from_string(options.stash);
  workload.validate();
  return workload;
}

std::string workload_details(const sim::Workload& w, const sim::DeviceSpec& device) {
  return "BERT " + w.config.name + ", S=" + std::to_string(w.seq_len) +
         ", b=" + std::to_string(w.micro_batch_size) + ", " +
         std::string(sim::to_string(w.precision)) +
         (w.storage_precision
              ? " (stored " + std::string(sim::to_string(*w.storage_precision)) + ")"
              : "") +
         (w.attention == sim::AttentionAlgorithm::kFused ? ", fused attention" : "") +
         (w.stash == sim::ActivationStash::kEager ? ", eager stash" : "") + " on " + device.name;
}

sim::SimOptions sim_options(const SimCommandOptions& options, const CostSetup& setup) {
  sim::SimOptions out;
  out.overlap_communication = !options.no_overlap;
  out.shared_processors = setup.shared_processors;
  return out;
}

// The layers to place: the model's, unless --layers says otherwise (then they must agree).
CompileCommandOptions with_model_layers(CompileCommandOptions compile, const CostSetup& setup) {
  if (setup.model_layers > 0) {
    if (compile.layers != 0 && compile.layers != setup.model_layers) {
      throw std::invalid_argument("--layers " + std::to_string(compile.layers) +
                                  " disagrees with --model (" + std::to_string(setup.model_layers) +
                                  " encoder layers)");
    }
    compile.layers = setup.model_layers;
  }
  return compile;
}

// --global-batch B: m = B / (b x d) micro-batches per replica.
CompileCommandOptions with_global_batch(CompileCommandOptions compile,
                                        const SimCommandOptions& options) {
  if (options.global_batch == 0) return compile;
  const long per_microbatch =
      static_cast<long>(options.micro_batch_size) * std::max(1, compile.data_parallel);
  if (options.global_batch < 0 || per_microbatch <= 0 ||
      options.global_batch % per_microbatch != 0) {
    throw std::invalid_argument("--global-batch " + std::to_string(options.global_batch) +
                                " must be a positive multiple of --micro-batch-size x "
                                "--data-parallel = " +
                                std::to_string(per_microbatch));
  }
  compile.microbatches = static_cast<int>(options.global_batch / per_microbatch);
  return compile;
}

std::string gib(double bytes) {
  std::ostringstream text;
  text << std::fixed << std::setprecision(1) << bytes / (1024.0 * 1024.0 * 1024.0) << " GiB";
  return text.str();
}

// Why the run does not fit in the GPUs' memory, or "" when it does (or no capacity is known).
std::string memory_overflow(const sim::SimResult& result, const CostSetup& setup) {
  if (setup.gpu_memory_bytes <= 0.0) return "";
  std::size_t worst = 0;
  for (std::size_t w = 0; w < result.workers.size(); ++w) {
    if (result.workers[w].peak_memory_bytes > result.workers[worst].peak_memory_bytes) worst = w;
  }
  if (result.workers.empty() || result.workers[worst].peak_memory_bytes <= setup.gpu_memory_bytes) {
    return "";
  }
  const auto& r = result.workers[worst];
  return "worker " + std::to_string(worst) + " needs " + gib(r.peak_memory_bytes) +
         " per GPU (weights, gradients and optimizer state " + gib(r.static_memory_bytes) +
         ", activations " + gib(r.peak_activation_bytes) + ") but a GPU of " + setup.cluster_name +
         " has " + gib(setup.gpu_memory_bytes);
}

// The parallel model's K-FAC state after the pass: what its placement holds and moves per
// replica of the busiest worker, and whether the peak with K-FAC fits the GPU.
struct KfacStateAtScale {
  std::string text;
  nlohmann::json json;
  bool fits = true;
};
KfacStateAtScale kfac_state_at_scale(const sched::Schedule& schedule,
                                     const pipefisher::PassResult& pass, const CostSetup& setup,
                                     const pipefisher::KfacOptions& kfac) {
  const sim::ParallelCostModel& model = *setup.parallel;
  const auto holders = model.kfac_holders(schedule);
  sim::ParallelCostModel::KfacStateCost worst;
  for (int w = 0; w < schedule.num_workers(); ++w) {
    const auto cost = model.kfac_state_cost(schedule, w, kfac.linears, kfac.layers);
    if (cost.replicated_bytes > worst.replicated_bytes) worst = cost;
  }
  double peak = 0.0, busiest_state = 0.0;
  for (const auto& worker : pass.after.workers) peak = std::max(peak, worker.peak_memory_bytes);
  for (const auto& worker : pass.report.workers) {
    busiest_state = std::max(busiest_state, worker.kfac_memory_bytes);
  }
  const auto& cluster = model.cluster();
  const auto link = cluster.link_for(holders.replicas, model.data_stride(schedule));
  const std::string link_name =
      holders.replicas <= 1 ? "none"
      : link.bandwidth == cluster.nvlink.bandwidth && link.latency_s == cluster.nvlink.latency_s
          ? "nvlink"
          : "network";
  KfacStateAtScale out;
  out.fits = setup.gpu_memory_bytes <= 0.0 || peak <= setup.gpu_memory_bytes;
  const double mib = 1024.0 * 1024.0, gib_ = mib * 1024.0;
  char line[640];
  std::snprintf(line, sizeof line,
                "K-FAC state at scale (ring collectives, docs/scale.md): %s over %d "
                "data-parallel replica(s) (factors on %d, inverses on %d), %s link\n"
                "  per GPU (busiest replica of the largest worker) %.2f GiB held, replicated %.2f "
                "GiB (saves %.2f GiB)\n"
                "  one replica per refresh: factor sync %.1f MiB (%.3f s), inverse all-gather "
                "%.1f MiB (%.3f s); per step: preconditioned-gradient all-gather %.1f MiB "
                "(%.3f s)\n"
                "  peak with K-FAC %.2f GiB of %.2f GiB: %s\n",
                pass.report.state_placement.c_str(), holders.replicas, holders.factors,
                holders.inverses, link_name.c_str(), busiest_state / gib_,
                worst.replicated_bytes / gib_, (worst.replicated_bytes - busiest_state) / gib_,
                worst.factor_bytes_per_refresh / mib, worst.factor_seconds_per_refresh,
                worst.inverse_bytes_per_refresh / mib, worst.inverse_seconds_per_refresh,
                worst.gradient_bytes_per_step / mib, worst.gradient_seconds_per_step, peak / gib_,
                setup.gpu_memory_bytes / gib_, out.fits ? "fits" : "does not fit");
  out.text = line;
  out.json = {{"placement", pass.report.state_placement},
              {"data_parallel", holders.replicas},
              {"factor_holders", holders.factors},
              {"inverse_holders", holders.inverses},
              {"link", link_name},
              {"memory_bytes_per_gpu", busiest_state},
              {"replicated_memory_bytes_per_gpu", worst.replicated_bytes},
              {"factor_bytes_per_refresh", worst.factor_bytes_per_refresh},
              {"factor_seconds_per_refresh", worst.factor_seconds_per_refresh},
              {"inverse_bytes_per_refresh", worst.inverse_bytes_per_refresh},
              {"inverse_seconds_per_refresh", worst.inverse_seconds_per_refresh},
              {"gradient_bytes_per_step", worst.gradient_bytes_per_step},
              {"gradient_seconds_per_step", worst.gradient_seconds_per_step},
              {"peak_memory_bytes", peak},
              {"fits", out.fits}};
  return out;
}

void check_layers(const sched::Schedule& schedule, const CostSetup& setup) {
  if (setup.model_layers > 0 && schedule.placement.num_layers != setup.model_layers) {
    throw std::invalid_argument(
        "the schedule places " + std::to_string(schedule.placement.num_layers) +
        " encoder layers but --model has " + std::to_string(setup.model_layers));
  }
}

// One schedule's PipeFisher effect in the --schedule all --kfac table.
struct KfacComparisonRow {
  std::string name;
  pipefisher::KfacReport report;
};

std::string kfac_comparison_table(const std::vector<KfacComparisonRow>& rows) {
  std::ostringstream table;
  table << "PipeFisher (K-FAC in the bubbles)\n"
        << std::setw(11) << "schedule" << std::setw(14) << "util before" << std::setw(13)
        << "util after" << std::setw(5) << "k" << std::setw(11) << "overhead"
        << "\n";
  table << std::fixed;
  for (const auto& row : rows) {
    table << std::setw(11) << row.name << std::setprecision(1) << std::setw(13)
          << 100.0 * row.report.utilization_before << "%" << std::setw(12)
          << 100.0 * row.report.utilization_after << "%" << std::setw(5) << row.report.refresh_steps
          << std::setw(10) << std::showpos << 100.0 * row.report.step_time_overhead
          << std::noshowpos << "%\n";
  }
  return table.str();
}

int run_comparison(const CompileCommandOptions& compile, const SimCommandOptions& options,
                   const CostSetup& setup, const pipefisher::KfacCommandOptions& kfac,
                   std::ostream& out) {
  // Parse the K-FAC flags before any work, so a bad value fails fast.
  pipefisher::KfacCommandOptions with_dims = kfac;
  with_dims.linear_dims = setup.linear_dims;
  const auto kfac_options =
      kfac.enabled ? std::optional(pipefisher::to_kfac_options(with_dims)) : std::nullopt;
  std::vector<KfacComparisonRow> kfac_rows;
  if (kfac.offload != "none") {
    throw std::invalid_argument(
        "--schedule all does not compare K-FAC offload; pick one schedule for --kfac-offload");
  }
  if (!compile.schedule_file.empty()) {
    throw std::invalid_argument(
        "--schedule all compares generated schedules; it cannot be combined with "
        "--schedule-file");
  }
  if (!compile.out_trace.empty() || !compile.out_json.empty() || !compile.out_csv.empty()) {
    throw std::invalid_argument(
        "--schedule all writes no schedule or trace files (--out, --csv, --trace); pick one "
        "schedule for those");
  }
  std::vector<sim::ComparisonRow> rows;
  for (const char* name : {"gpipe", "1f1b", "interleaved", "chimera", "zbh1", "zbh2", "zbv"}) {
    sched::ScheduleParams params;
    params.kind = sched::schedule_kind_from_string(name);
    params.workers = compile.stages;
    params.microbatches = compile.microbatches;
    // Interleaved needs v >= 2 to differ from 1F1B; zbv holds exactly two chunks per worker;
    // the others one.
    params.chunks_per_worker = params.kind == sched::ScheduleKind::kInterleaved
                                   ? std::max(2, compile.chunks)
                               : params.kind == sched::ScheduleKind::kZeroBubbleV ? 2
                                                                                  : 1;
    const bool zero_bubble_h = params.kind == sched::ScheduleKind::kZeroBubbleH1 ||
                               params.kind == sched::ScheduleKind::kZeroBubbleH2;
    if (zero_bubble_h) params.max_in_flight = compile.max_in_flight;
    params.num_layers = compile.layers;
    params.data_parallel = compile.data_parallel;
    params.split_backward = compile.split_backward;
    sim::ComparisonRow row;
    row.name = name;
    row.workers = params.workers;
    row.microbatches = params.microbatches;
    row.chunks_per_worker = params.chunks_per_worker;
    sched::Schedule schedule;
    try {
      sched::LoweringOptions lowering;
      lowering.activation_bytes = compile.activation_bytes;
      lowering.gradient_bytes = compile.gradient_bytes;
      schedule = sched::compile(params, lowering);
    } catch (const std::invalid_argument& error) {
      row.skipped_reason = error.what();
      rows.push_back(row);
      continue;
    }
    const sim::SimResult result =
        sim::simulate(schedule, *setup.costs, sim_options(options, setup));
    const std::string overflow = memory_overflow(result, setup);
    if (!overflow.empty()) {
      row.skipped_reason = "does not fit: " + overflow;
      rows.push_back(row);
      continue;
    }
    row.figures = sim::headline(schedule, result, setup.run);
    rows.push_back(row);
    if (kfac_options) {
      kfac_rows.push_back({name, pipefisher::run_pipefisher(schedule, *setup.costs, *kfac_options,
                                                            sim_options(options, setup))
                                     .report});
    }
  }
  out << "costs: " << setup.run.cost_model
      << (setup.run.details.empty() ? "" : " (" + setup.run.details + ")") << "\n"
      << sim::comparison_table(rows);
  if (kfac_options) out << kfac_comparison_table(kfac_rows);
  if (!options.report.empty()) {
    nlohmann::json report = sim::comparison_json(rows, setup.run);
    if (kfac_options) {
      nlohmann::json kfac_reports = nlohmann::json::object();
      for (const auto& row : kfac_rows) kfac_reports[row.name] = pipefisher::to_json(row.report);
      report["kfac"] = std::move(kfac_reports);
    }
    traces::write_json_file(options.report, report);
    out << "wrote " << options.report << "\n";
  }
  return 0;
}

// build_schedule, with errors about a schedule file always naming the file.
sched::Schedule load_or_compile(const CompileCommandOptions& compile) {
  try {
    return build_schedule(compile);
  } catch (const std::invalid_argument& error) {
    const std::string& file = compile.schedule_file;
    if (file.empty() || std::string(error.what()).find(file) != std::string::npos) throw;
    throw std::invalid_argument(file + ": " + error.what());
  }
}

}  // namespace

void add_sim_options(CLI::App& app, SimCommandOptions& options) {
  app.add_option("--model", options.model,
                 "Simulate with the analytic cost model of this BERT: preset (tiny, mini, small, "
                 "medium, base, large) or a Hugging Face config.json");
  app.add_option_function<int>(
         "--seq-len",
         [&options](int value) {
           options.seq_len = value;
           options.seq_len_given = true;
         },
         "Sequence length (analytic model; GPT / Llama default: the model's maximum, at most "
         "2048)")
      ->default_str(std::to_string(options.seq_len));
  app.add_option("--micro-batch-size", options.micro_batch_size,
                 "Sequences per micro-batch (analytic model; throughput)")
      ->capture_default_str();
  app.add_option("--precision", options.precision,
                 "Training precision (analytic model): fp32, tf32, bf16, fp16; K-FAC runs in fp32")
      ->check(CLI::IsMember({"fp32", "tf32", "bf16", "fp16"}))
      ->capture_default_str();
  app.add_option("--storage-precision", options.storage_precision,
                 "What activations, gradients and messages are stored in (BERT analytic model), "
                 "when not --precision: pipefisher_train stores fp32 with bf16 products")
      ->check(CLI::IsMember({"fp32", "tf32", "bf16", "fp16"}));
  app.add_option("--attention", options.attention,
                 "Attention core (analytic models): batched (products with the scores in memory, "
                 "the runtime's default) or fused (pipefisher_train --attention fused's "
                 "flash-style kernel: no S x S tensor stored, scores recomputed in the backward)")
      ->check(CLI::IsMember({"batched", "fused"}))
      ->capture_default_str();
  app.add_option("--stash", options.stash,
                 "Activation stash the BERT analytic model counts: runtime (the tensors "
                 "pipefisher_train keeps between forward and backward, the default) or eager "
                 "(Korthikanti et al.'s count for an eager framework, as Megatron-LM and "
                 "PipeFisher's PyTorch code keep: softmax output, dropout masks; for published "
                 "figures)")
      ->check(CLI::IsMember({"runtime", "eager"}));
  app.add_option_function<std::string>(
         "--device",
         [&options](const std::string& value) {
           options.device = value;
           options.device_given = true;
         },
         "Accelerator (analytic model): h100, h200, b200, a100, v100, p100, this-cpu (one core "
         "of this machine, its peaks measured) or a device JSON file (with --cluster: replaces "
         "the cluster's GPU, and its memory where the device gives it)")
      ->default_str(options.device);
  app.add_option("--tensor-parallel", options.tensor_parallel,
                 "Tensor-parallel ranks t per pipeline stage (Megatron's intra-layer split; "
                 "parallel model, ranks inside a node first)")
      ->capture_default_str();
  app.add_option("--cluster", options.cluster,
                 "Cluster (parallel model): dgx-a100, dgx-h100, dgx-b200 or a cluster JSON file "
                 "(docs/scale.md); default: nodes of 8 --device GPUs on the device's link");
  app.add_option("--recompute", options.recompute,
                 "Activation recomputation (parallel model): none, selective (attention core), "
                 "full (every layer)")
      ->check(CLI::IsMember({"none", "selective", "full"}))
      ->capture_default_str();
  app.add_option("--shard-parameters", options.shard_parameters,
                 "Split the weights over this many data-parallel ranks (AMSP / ZeRO-3; 0: all "
                 "replicas): all-gathered before each forward and backward")
      ->capture_default_str();
  app.add_option("--shard-gradients", options.shard_gradients,
                 "Split the gradients over this many data-parallel ranks (ZeRO-2; 0: all): "
                 "reduce-scatter then all-reduce across groups")
      ->capture_default_str();
  app.add_option("--shard-optimizer", options.shard_optimizer,
                 "Split the optimizer state over this many data-parallel ranks (ZeRO-1; 0: all): "
                 "each updates its part, the weights are all-gathered")
      ->capture_default_str();
  app.add_option("--offload-optimizer", options.offload_optimizer,
                 "Optimizer state in GPU memory (none), host memory (cpu) or NVMe (nvme), "
                 "ZeRO-Infinity style: moved over PCIe every step")
      ->check(CLI::IsMember({"none", "cpu", "nvme"}))
      ->capture_default_str();
  app.add_option("--rank-order", options.rank_order,
                 "Which groups share a node (consecutive ranks fill one): megatron (tensor, "
                 "then data-parallel, then pipeline) or pipeline-inner (tensor, then pipeline, "
                 "then data-parallel: pipefisher_train's rank = replica x p + worker)")
      ->check(CLI::IsMember({"megatron", "pipeline-inner"}))
      ->capture_default_str();
  app.add_option("--global-batch", options.global_batch,
                 "Sequences per step over all data-parallel replicas: sets -m to B / (b x d)");
  app.add_option("--uniform", options.uniform,
                 "Simulate with uniform costs F,B[,COMM] in seconds: forward and backward of one "
                 "micro-batch on one worker (a chunk takes F/v), and each hop's transfer");
  app.add_option("--profile", options.profile,
                 "Simulate with measured costs from a profile JSON (format_version 1, see "
                 "docs/simulator.md)");
  app.add_flag("--no-overlap", options.no_overlap,
               "Communication occupies the compute lane (no compute/communication overlap)");
  app.add_option("--workers-per-processor", options.workers_per_processor,
                 "Consecutive groups of N workers share one processor (threads on one CPU, ranks "
                 "on one GPU): compute running at once divides its throughput (docs/simulator.md "
                 "\"Shared processors\"); 1: a processor each")
      ->check(cli_checks::positive());
  app.add_option("--processor-capacity", options.processor_capacity,
                 "Instructions a shared processor runs at full speed at once (default 1; "
                 "with --workers-per-processor or a profile's shared_processor)")
      ->check(cli_checks::positive());
  app.add_option_function<std::string>(
      "--machines",
      [&options](const std::string& value) {
        try {
          options.machines = parse_non_negative_int_list(value, "--machines");
        } catch (const std::invalid_argument& error) {
          throw CLI::ValidationError(error.what());
        }
      },
      "Every rank's machine, comma-separated (rank = replica x workers + worker, over the "
      "--data-parallel replicas; as mpirun places them): each machine's cores shared by its "
      "ranks, a processor of --processor-capacity (or a profile's) per machine "
      "(docs/simulator.md \"Shared processors\")");
  app.add_option("--report", options.report,
                 "Write the simulation's figures (step time, bubble, per-worker utilization and "
                 "memory) to FILE.json");
}

bool parallel_requested(const SimCommandOptions& options) {
  if (options.tensor_parallel != 1 || !options.cluster.empty() || options.recompute != "none" ||
      options.global_batch != 0 || options.shard_parameters != 1 || options.shard_gradients != 1 ||
      options.shard_optimizer != 1 || options.offload_optimizer != "none") {
    return true;
  }
  if (options.model.empty()) return false;
  return sim::resolve_transformer(options.model).family != sim::ModelFamily::kBert;
}

bool simulation_requested(const SimCommandOptions& options) {
  return !options.model.empty() || !options.uniform.empty() || !options.profile.empty();
}

namespace {

// The parallel (PTD-P) model of --model on --cluster with --tensor-parallel and --recompute.
CostSetup make_parallel_setup(const SimCommandOptions& options,
                              const pipefisher::KfacCommandOptions& kfac) {
  if (options.model.empty()) {
    throw std::invalid_argument(
        "--tensor-parallel, --cluster, --recompute and --global-batch price a model: give "
        "--model");
  }
  if (!options.uniform.empty() || !options.profile.empty()) {
    throw std::invalid_argument(
        "--tensor-parallel, --cluster, --recompute and --global-batch use the parallel analytic "
        "model; they cannot be combined with --uniform or --profile");
  }
  if (!options.storage_precision.empty()) {
    throw std::invalid_argument(
        "--storage-precision applies to the BERT analytic model; the parallel analytic model "
        "stores activations in --precision");
  }
  if (!options.stash.empty()) {
    throw std::invalid_argument(
        "--stash applies to the BERT analytic model; the parallel analytic model counts "
        "Korthikanti et al.'s stash (Megatron-LM's)");
  }
  if (options.tensor_parallel <= 0) {
    throw std::invalid_argument("--tensor-parallel must be positive, got " +
                                std::to_string(options.tensor_parallel));
  }
  sim::ParallelWorkload workload;
  workload.model = sim::resolve_transformer(options.model);
  workload.seq_len = options.seq_len;
  if (!options.seq_len_given && workload.model.family != sim::ModelFamily::kBert) {
    workload.seq_len = std::min(2048, workload.model.max_position_embeddings);
  }
  workload.micro_batch_size = options.micro_batch_size;
  workload.precision = sim::precision_from_string(options.precision);
  workload.tensor_parallel = options.tensor_parallel;
  workload.recompute = sim::recompute_from_string(options.recompute);
  workload.sharding = {options.shard_parameters, options.shard_gradients, options.shard_optimizer};
  workload.optimizer_offload = sim::offload_from_string(options.offload_optimizer);
  workload.rank_order = sim::rank_order_from_string(options.rank_order);
  workload.attention = sim::attention_from_string(options.attention);
  if (kfac.enabled) {
    const auto choice = kfac::parse_kfac_sharding(kfac.sharding);
    if (choice.automatic) {
      throw std::invalid_argument(
          "--kfac-sharding auto: the parallel model takes a placement (replicate, shard, "
          "partial:G); `pipefisher_sim search --kfac` compares them");
    }
    workload.kfac_state = sim::kfac_state_holders(choice.placement);
  }
  workload.validate();
  sim::ClusterSpec cluster = options.cluster.empty()
                                 ? sim::cluster_of_device(sim::resolve_device(options.device))
                                 : sim::resolve_cluster(options.cluster);
  if (options.device_given && !options.cluster.empty()) {
    cluster.device = sim::resolve_device(options.device);
    // Its memory too, where the device knows it (an H200 in H100 nodes has 141 GB, not 80).
    if (cluster.device.memory_bytes > 0.0) cluster.gpu_memory_bytes = cluster.device.memory_bytes;
    cluster.name += " with " + cluster.device.name;
  }
  auto model = std::make_shared<sim::ParallelCostModel>(workload, cluster);
  CostSetup setup;
  setup.costs = model;
  setup.parallel = model;
  setup.linear_dims = sim::kfac_linear_dims(*model);
  setup.model_layers = workload.model.num_layers;
  setup.gpu_memory_bytes = cluster.gpu_memory_bytes;
  setup.cluster_name = cluster.name;
  setup.run.cost_model = "parallel";
  setup.run.micro_batch_size = workload.micro_batch_size;
  setup.run.model_flops_per_sequence = sim::transformer_model_flops_per_sequence(
      workload.model, workload.seq_len, workload.scored_positions());
  setup.run.hardware_flops_per_sequence = sim::transformer_hardware_flops_per_sequence(workload);
  setup.run.peak_flops_per_worker = cluster.device.peak_flops(workload.precision);
  setup.run.tensor_parallel = workload.tensor_parallel;
  setup.run.details =
      std::string(sim::to_string(workload.model.family)) + " " + workload.model.name +
      ", S=" + std::to_string(workload.seq_len) +
      ", b=" + std::to_string(workload.micro_batch_size) + ", " +
      std::string(sim::to_string(workload.precision)) +
      ", t=" + std::to_string(workload.tensor_parallel) + ", recompute " + options.recompute +
      (workload.attention == sim::AttentionAlgorithm::kFused ? ", fused attention" : "") + " on " +
      cluster.name + " (" + cluster.device.name + ")";
  const auto& shard = workload.sharding;
  if (shard.parameters != 1 || shard.gradients != 1 || shard.optimizer != 1) {
    setup.run.details += ", sharded p/g/o " + std::to_string(shard.parameters) + "/" +
                         std::to_string(shard.gradients) + "/" + std::to_string(shard.optimizer);
  }
  if (workload.optimizer_offload != sim::Offload::kNone) {
    setup.run.details +=
        ", optimizer offloaded to " + std::string(sim::to_string(workload.optimizer_offload));
  }
  return setup;
}

}  // namespace

namespace {

constexpr int kAllWorkers = std::numeric_limits<int>::max();

// --workers-per-processor and --processor-capacity over a --profile's "shared_processor" (all
// workers on one processor of one of `data_parallel` replicas' share of it). One worker per
// processor at a capacity of 1 or more is a processor each: off, the engine's plain path.
sim::SharedProcessors shared_processors_of(const SimCommandOptions& options, const CostSetup& setup,
                                           int data_parallel) {
  const auto* measured = dynamic_cast<const sim::MeasuredCostModel*>(setup.costs.get());
  sim::SharedProcessors shared = measured
                                     ? sim::shared_processors_of(measured->profile(), data_parallel)
                                     : sim::SharedProcessors{};
  if (!options.machines.empty()) {
    // A machine map of this run's ranks: each machine's capacity from the flag, else the
    // profile's (one replica's share of it, times its replicas).
    if (options.workers_per_processor > 0) {
      throw std::invalid_argument(
          "--machines and --workers-per-processor both place workers on processors: give one");
    }
    double machine_capacity = options.processor_capacity;
    if (!(machine_capacity > 0.0) && measured &&
        measured->profile().shared_processor_capacity > 0.0) {
      machine_capacity = measured->profile().shared_processor_capacity *
                         std::max(1, measured->profile().shared_processor_replicas);
    }
    if (!(machine_capacity > 0.0)) {
      throw std::invalid_argument(
          "--machines shares each machine's cores: give --processor-capacity C (a machine's "
          "capacity), or a --profile with \"shared_processor\"");
    }
    const int replicas = std::max(1, data_parallel);
    const auto ranks = static_cast<int>(options.machines.size());
    if (ranks % replicas != 0) {
      throw std::invalid_argument("--machines lists " + std::to_string(ranks) +
                                  " ranks, not a whole number of the " + std::to_string(replicas) +
                                  " data-parallel replicas' ranks");
    }
    return sim::processors_by_machine(options.machines, ranks / replicas, machine_capacity);
  }
  // The flags replace a profile's processors: groups instead of its machines, one capacity for
  // every processor instead of each machine's share.
  if (options.workers_per_processor > 0) {
    shared.workers_per_processor = options.workers_per_processor;
    shared.processor_of_worker.clear();
    shared.processor_capacity.clear();
  }
  if (options.processor_capacity > 0.0) {
    if (!shared.enabled()) {
      throw std::invalid_argument(
          "--processor-capacity sizes a shared processor: give --workers-per-processor (or a "
          "--profile with \"shared_processor\")");
    }
    shared.capacity = options.processor_capacity;
    shared.processor_capacity.clear();
  }
  if (shared.workers_per_processor == 1 && shared.capacity >= 1.0) return {};
  return shared;
}

}  // namespace

CostSetup make_cost_setup(const SimCommandOptions& options,
                          const pipefisher::KfacCommandOptions& kfac, int data_parallel) {
  if (sim::attention_from_string(options.attention) != sim::AttentionAlgorithm::kBatched &&
      options.model.empty()) {
    throw std::invalid_argument("--attention fused prices a model's attention: give --model");
  }
  if (!options.stash.empty() && options.model.empty()) {
    throw std::invalid_argument("--stash counts a model's activations: give --model");
  }
  if (parallel_requested(options)) {
    if (options.workers_per_processor > 0 || options.processor_capacity > 0.0 ||
        !options.machines.empty()) {
      throw std::invalid_argument(
          "--workers-per-processor, --processor-capacity and --machines share a processor among "
          "pipeline workers; the parallel model (--tensor-parallel, --cluster, ...) gives every "
          "rank a GPU of its own");
    }
    return make_parallel_setup(options, kfac);
  }
  CostSetup setup;
  std::shared_ptr<const sim::AnalyticCostModel> analytic;
  if (!options.model.empty()) {
    const sim::Workload workload = workload_of(options);
    analytic =
        std::make_shared<sim::AnalyticCostModel>(workload, sim::resolve_device(options.device));
    setup.model_layers = workload.config.num_layers;
    for (int kind = 0; kind < sched::kNumLinearKinds; ++kind) {
      const auto dims = sim::linear_dims(workload.config, static_cast<sched::LinearKind>(kind));
      setup.linear_dims.push_back({dims.in, dims.out});
    }
    setup.run.model_flops_per_sequence = sim::model_flops_per_sequence(workload);
    setup.run.peak_flops_per_worker = analytic->device().peak_flops(workload.precision);
    setup.run.details = workload_details(workload, analytic->device());
  }
  if (options.micro_batch_size <= 0) {
    throw std::invalid_argument("--micro-batch-size must be positive, got " +
                                std::to_string(options.micro_batch_size));
  }
  setup.run.micro_batch_size = options.micro_batch_size;
  if (!options.profile.empty()) {
    if (sim::attention_from_string(options.attention) != sim::AttentionAlgorithm::kBatched) {
      throw std::invalid_argument(
          "--attention fused prices the analytic model's attention; a measured --profile "
          "already times the attention its run used");
    }
    if (!options.stash.empty()) {
      throw std::invalid_argument(
          "--stash counts the analytic model's activations; a measured --profile carries its "
          "own activation_bytes");
    }
    setup.costs = std::make_shared<sim::MeasuredCostModel>(
        sim::profile_from_json_file(options.profile), options.profile);
    setup.run.cost_model = "measured";
    setup.run.details =
        options.profile + (setup.run.details.empty() ? "" : "; " + setup.run.details);
  } else if (!options.uniform.empty()) {
    const sim::UniformCosts costs = sim::parse_uniform_costs(options.uniform);
    setup.costs = std::make_shared<sim::UniformCostModel>(costs, analytic);
    setup.run.cost_model = "uniform";
    setup.run.details = "F,B,COMM = " + options.uniform + " s" +
                        (analytic ? "; memory of " + setup.run.details : "");
    // Uniform times carry no model FLOPs: no MFU.
    setup.run.model_flops_per_sequence = 0.0;
  } else if (analytic) {
    setup.costs = analytic;
    setup.run.cost_model = "analytic";
  } else {
    throw std::invalid_argument("simulating needs a cost model: --model, --uniform or --profile");
  }
  setup.shared_processors = shared_processors_of(options, setup, data_parallel);
  if (setup.shared_processors.enabled()) {
    const auto& shared = setup.shared_processors;
    std::ostringstream line;
    if (shared.workers_per_processor == 0) {  // a profile's machines
      line << "; a processor per machine, workers on processors";
      for (std::size_t w = 0; w < shared.processor_of_worker.size(); ++w)
        line << (w == 0 ? " " : ",") << shared.processor_of_worker[w];
      line << " of capacity";
      if (shared.processor_capacity.empty()) line << " " << shared.capacity;
      for (std::size_t p = 0; p < shared.processor_capacity.size(); ++p)
        line << (p == 0 ? " " : ", ") << shared.processor_capacity[p];
    } else {
      line << "; "
           << (shared.workers_per_processor >= kAllWorkers
                   ? std::string("all workers")
                   : std::to_string(shared.workers_per_processor) + " workers")
           << " per processor of capacity " << shared.capacity;
    }
    setup.run.details += line.str();
  }
  return setup;
}

// --layers-per-stage auto: the split of least predicted step time (with --kfac, after the
// PipeFisher pass), searched from the balanced one (sim/layer_balance.h); prints the table of
// the splits tried and returns the compile options with the chosen split.
CompileCommandOptions with_balanced_layers(CompileCommandOptions placed,
                                           const SimCommandOptions& options, const CostSetup& setup,
                                           const pipefisher::KfacCommandOptions& kfac,
                                           std::ostream& out) {
  std::optional<pipefisher::KfacOptions> kfac_options;
  if (kfac.enabled) {
    pipefisher::KfacCommandOptions with_dims = kfac;
    with_dims.linear_dims = setup.linear_dims;
    kfac_options = pipefisher::to_kfac_options(with_dims);
  }
  const auto evaluate = [&](const std::vector<int>& layers) {
    CompileCommandOptions split = placed;
    split.layers_per_stage = sched::format_layer_counts(layers);
    const sched::Schedule schedule = build_schedule(split);
    check_layers(schedule, setup);
    sim::SplitEvaluation e;
    const sim::SimResult result =
        sim::simulate(schedule, *setup.costs, sim_options(options, setup));
    if (!memory_overflow(result, setup).empty()) {
      e.step_time_s = std::numeric_limits<double>::infinity();
      return e;
    }
    e.step_time_s = result.step_time_s;
    if (kfac_options) {
      const pipefisher::PassResult pass = pipefisher::run_pipefisher(
          schedule, *setup.costs, *kfac_options, sim_options(options, setup));
      e.step_time_s = pass.after.step_time_s;
      e.refresh_steps = pass.report.refresh_steps;
    }
    return e;
  };
  CompileCommandOptions balanced = placed;
  balanced.layers_per_stage.clear();
  const sched::Schedule start = build_schedule(balanced);
  std::vector<int> start_layers;
  for (int c = 0; c < start.placement.chunks_per_pipeline; ++c) {
    start_layers.push_back(start.placement.at(0, c).num_layers);
  }
  const sim::LayerBalance balance = sim::balance_layers(start_layers, evaluate);
  out << sim::layer_balance_table(balance) << "\n";
  if (!std::isfinite(balance.best.step_time_s)) {
    throw std::invalid_argument("--layers-per-stage auto: no split of the " +
                                std::to_string(start.placement.num_layers) +
                                " layers tried fits in memory");
  }
  placed.layers_per_stage = sched::format_layer_counts(balance.best.layers);
  return placed;
}

int run_sim_command(const CompileCommandOptions& compile, const SimCommandOptions& options,
                    std::ostream& out, const pipefisher::KfacCommandOptions& kfac) {
  const bool auto_layers = compile.layers_per_stage == "auto";
  // The pass's --kfac flags that contradict each other are refused before anything is simulated
  // or printed (the pass would refuse them only after the schedule's own table). Not the
  // offload's: its device budget may come from --cluster, known only below.
  if (kfac.enabled) {
    pipefisher::KfacCommandOptions pass_flags = kfac;
    pass_flags.offload = "none";
    (void)pipefisher::to_kfac_options(pass_flags);
  }
  if (!simulation_requested(options)) {
    if (auto_layers) {
      throw std::invalid_argument(
          "--layers-per-stage auto picks the split by simulating it: give --model (or --uniform "
          "/ --profile)");
    }
    if (kfac.enabled) {
      throw std::invalid_argument(
          "--kfac sizes K-FAC work with a cost model: give --model (or --uniform / --profile)");
    }
    if (sim::attention_from_string(options.attention) != sim::AttentionAlgorithm::kBatched) {
      throw std::invalid_argument("--attention fused prices a model's attention: give --model");
    }
    if (!options.stash.empty()) {
      throw std::invalid_argument("--stash counts a model's activations: give --model");
    }
    if (!options.report.empty() || options.no_overlap) {
      throw std::invalid_argument(
          "--report and --no-overlap need a simulation: give --model, --uniform or --profile");
    }
    if (options.workers_per_processor > 0 || options.processor_capacity > 0.0 ||
        !options.machines.empty()) {
      throw std::invalid_argument(
          "--workers-per-processor, --processor-capacity and --machines need a simulation: give "
          "--model, --uniform or --profile");
    }
    if (compile.schedule == "all") {
      throw std::invalid_argument(
          "--schedule all compares simulated schedules: give --model, --uniform or --profile");
    }
    if (parallel_requested(options)) {
      throw std::invalid_argument(
          "--tensor-parallel, --cluster, --recompute and --global-batch price a model: give "
          "--model");
    }
    return run_compile_command(compile, out);
  }
  const CostSetup setup = make_cost_setup(options, kfac, std::max(1, compile.data_parallel));
  CompileCommandOptions placed = with_global_batch(with_model_layers(compile, setup), options);
  if (auto_layers) {
    if (placed.schedule == "all") {
      throw std::invalid_argument(
          "--layers-per-stage auto balances one schedule: pick one instead of --schedule all");
    }
    if (!placed.schedule_file.empty()) {
      throw std::invalid_argument(
          "--layers-per-stage auto cannot be combined with --schedule-file " +
          placed.schedule_file + " (the file carries its own placement)");
    }
    placed = with_balanced_layers(std::move(placed), options, setup, kfac, out);
  }
  if (placed.schedule == "all") {
    return run_comparison(placed, options, setup, kfac, out);
  }

  const sched::Schedule schedule = load_or_compile(placed);
  check_layers(schedule, setup);
  const sim::SimResult result = sim::simulate(schedule, *setup.costs, sim_options(options, setup));
  // A configuration that does not fit is reported as such, with no step time.
  const std::string overflow = memory_overflow(result, setup);
  if (!overflow.empty()) {
    out << "does not fit: " << overflow << "\n";
    if (!options.report.empty()) {
      traces::write_json_file(options.report,
                              {{"fits", false},
                               {"reason", overflow},
                               {"gpu_memory_bytes", setup.gpu_memory_bytes},
                               {"max_peak_memory_bytes",
                                sim::headline(schedule, result, setup.run).max_peak_memory_bytes}});
      out << "wrote " << options.report << "\n";
    }
    return 1;
  }
  if (placed.grid == "timeline") {
    out << sched::render_timeline(schedule, 120) << "\n";
  } else if (placed.grid == "positions") {
    out << sched::render_grid(schedule) << "\n";
  }
  out << sim::summary_table(schedule, result, setup.run);
  nlohmann::json report = sim::report_json(schedule, result, setup.run);
  if (setup.gpu_memory_bytes > 0.0) {
    report["fits"] = true;
    report["gpu_memory_bytes"] = setup.gpu_memory_bytes;
  }
  std::optional<pipefisher::PassResult> pass;
  bool kfac_fits = true;  // the parallel model's peak with K-FAC within the GPU
  if (kfac.enabled) {
    pipefisher::KfacCommandOptions with_dims = kfac;
    with_dims.linear_dims = setup.linear_dims;
    // The parallel model knows the GPU: --kfac-offload auto fits under it unless told otherwise.
    if (setup.parallel && with_dims.device_memory_budget_mib <= 0.0) {
      with_dims.device_memory_budget_mib = setup.gpu_memory_bytes / (1024.0 * 1024.0);
    }
    pass.emplace(pipefisher::run_kfac_command(schedule, *setup.costs, with_dims, out,
                                              sim_options(options, setup)));
    report["kfac"] = pipefisher::to_json(pass->report);
    report["with_kfac"] = sim::report_json(pass->schedule, pass->after, setup.run);
    if (setup.parallel) {
      const auto state =
          kfac_state_at_scale(schedule, *pass, setup, pipefisher::to_kfac_options(with_dims));
      out << state.text;
      report["kfac_state"] = state.json;
      kfac_fits = state.fits;
    }
    // --kfac-offload: the copies join the schedule; what follows writes and traces that one.
    if (auto offload = pipefisher::run_offload_command(*pass, *setup.costs, with_dims, out,
                                                       sim_options(options, setup))) {
      report["kfac_offload"] = pipefisher::offload_report_json(offload->report);
      report["with_kfac_offload"] = sim::report_json(offload->schedule, offload->after, setup.run);
      if (setup.parallel) {
        // The state in host memory: what fits is the peak with the copies.
        kfac_fits = offload->report.max_peak_memory_after <= setup.gpu_memory_bytes;
        char line[256];
        std::snprintf(line, sizeof line,
                      "K-FAC offload at scale: peak per GPU %.2f GiB -> %.2f GiB of %.2f GiB "
                      "(%s); step %.3f s -> %.3f s\n",
                      offload->report.max_peak_memory_before / (1024.0 * 1024 * 1024),
                      offload->report.max_peak_memory_after / (1024.0 * 1024 * 1024),
                      setup.gpu_memory_bytes / (1024.0 * 1024 * 1024),
                      kfac_fits ? "fits" : "does not fit", offload->report.step_time_before_s,
                      offload->report.step_time_after_s);
        out << line;
        report["kfac_state"]["fits"] = kfac_fits;
        report["kfac_state"]["peak_memory_bytes"] = offload->report.max_peak_memory_after;
      }
      pass->schedule = std::move(offload->schedule);
      pass->after = std::move(offload->after);
    }
  } else if (kfac.offload != "none") {
    throw std::invalid_argument("--kfac-offload offloads K-FAC state: it needs --kfac");
  }
  // --out writes what was simulated last: with --kfac the k-step schedule with the K-FAC work.
  // torch's CSV has no K-FAC actions, so --csv keeps the base schedule.
  CompileCommandOptions files = placed;
  files.out_trace.clear();  // the trace of a simulation shows the simulated times
  files.out_csv.clear();
  write_outputs(pass ? pass->schedule : schedule, files, out);
  if (!placed.out_csv.empty()) {
    CompileCommandOptions csv_only;
    csv_only.out_csv = placed.out_csv;
    csv_only.csv_compute_only = placed.csv_compute_only;
    write_outputs(schedule, csv_only, out);
  }
  if (!placed.out_trace.empty()) {
    traces::write_json_file(placed.out_trace,
                            pass ? sim::simulated_trace(pass->schedule, pass->after)
                                 : sim::simulated_trace(schedule, result));
    out << "wrote " << placed.out_trace << "\n";
  }
  if (!options.report.empty()) {
    traces::write_json_file(options.report, report);
    out << "wrote " << options.report << "\n";
  }
  if (!kfac_fits) {
    out << "does not fit with K-FAC: place its state with --kfac-sharding or --kfac-offload\n";
    return 1;
  }
  return 0;
}

}  // namespace pf::cli
