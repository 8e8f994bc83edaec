#pragma once
// The simulator part of pipefisher_sim: cost-model flags, simulating the compiled (or loaded)
// schedule, the summary table, --report, the simulated --trace and the --schedule all
// comparison. Builds on the compiler's flags (sim/cli/compile_command.h).
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "scheduler/pipefisher/kfac_command.h"
#include "sim/cli/compile_command.h"
#include "sim/cost_model.h"
#include "sim/report.h"

namespace CLI {
class App;
}  // namespace CLI

namespace pf::sim {
class ParallelCostModel;
}  // namespace pf::sim

namespace pf::cli {

struct SimCommandOptions {
  std::string model;  // BERT preset or config.json: enables the analytic model
  int seq_len = 128;
  bool seq_len_given = false;  // --seq-len appeared (GPT / Llama default to their maximum)
  int micro_batch_size = 32;
  std::string precision = "bf16";  // fp32, tf32, bf16, fp16
  // Activations and gradients stored in (BERT analytic model); empty: `precision`.
  std::string storage_precision;
  std::string attention = "batched";  // the attention core: batched or fused (analytic models)
  // Whose activation stash the BERT analytic model counts: runtime or eager; empty: runtime.
  std::string stash;
  std::string device = "h100";  // preset or device JSON
  bool device_given = false;    // --device appeared (overrides the cluster's GPU)
  // Parallel runs (PTD-P): any of these, or a GPT / Llama model, selects the parallel model.
  int tensor_parallel = 1;
  std::string cluster;             // dgx-a100, dgx-h100, dgx-b200 or a cluster JSON
  std::string recompute = "none";  // none, selective, full
  int global_batch = 0;            // sequences per step over all replicas; 0: -m decides
  // AMSP / ZeRO state sharding (ranks of the data-parallel group; 0: all) and ZeRO-Infinity
  // offload of the optimizer state (none, cpu, nvme).
  int shard_parameters = 1;
  int shard_gradients = 1;
  int shard_optimizer = 1;
  std::string offload_optimizer = "none";
  std::string rank_order = "megatron";
  std::string uniform;  // "F,B[,COMM]" seconds
  std::string profile;  // measured profile JSON
  bool no_overlap = false;
  // Workers sharing a processor (sim::SharedProcessors): 0 and 0.0 are unset (a --profile with
  // "shared_processor" puts every worker on one of its capacity; otherwise one each).
  int workers_per_processor = 0;
  double processor_capacity = 0.0;
  // Every rank's machine (rank = replica x workers + worker, over --data-parallel replicas): a
  // processor per machine of --processor-capacity (or a profile's) shared by its ranks.
  std::vector<int> machines;
  std::string report;  // --report FILE.json
};

// Registers the simulator flags (call with add_compile_options on the same app).
void add_sim_options(CLI::App& app, SimCommandOptions& options);

// Whether the flags ask for a simulation (a cost model: --model, --uniform or --profile).
bool simulation_requested(const SimCommandOptions& options);

// The cost model the flags choose: --profile, else --uniform (memory from --model when given),
// else the analytic model of --model on --device. Throws std::invalid_argument on bad input.
struct CostSetup {
  std::shared_ptr<const sim::CostModel> costs;
  sim::RunDescription run;
  int model_layers = 0;           // encoder layers of --model (0 without one)
  double gpu_memory_bytes = 0.0;  // parallel model: the capacity peaks are checked against
  std::string cluster_name;
  // (d_in, d_out) per Linear kind of --model (empty without one): K-FAC state placement.
  std::vector<kfac::LinearDims> linear_dims;
  // Which workers share a processor: --workers-per-processor and --processor-capacity, or a
  // profile's "shared_processor"; off (a processor each) otherwise.
  sim::SharedProcessors shared_processors;
  // The parallel model when it was chosen (costs points to it too), else null.
  std::shared_ptr<const sim::ParallelCostModel> parallel;
};

// Whether the flags select the parallel (PTD-P) cost model: --tensor-parallel, --cluster,
// --recompute or --global-batch, or a --model that is not a BERT.
bool parallel_requested(const SimCommandOptions& options);
// With --kfac (kfac.enabled), the parallel model places the K-FAC state as --kfac-sharding
// says and prices the pass's K-FAC work on one tensor-parallel rank's shard of each Linear.
// `data_parallel`: the simulated run's replicas, which share a --profile's shared processor.
CostSetup make_cost_setup(const SimCommandOptions& options,
                          const pipefisher::KfacCommandOptions& kfac = {}, int data_parallel = 1);

// Everything pipefisher_sim does: without a cost model, the compiler's command unchanged; with
// one, compile (or load) and simulate the schedule, print the summary table, and write --out,
// --csv, --report and --trace (the simulated run); with --schedule all, compare GPipe, 1F1B,
// interleaved and Chimera in one table. With --kfac (kfac.enabled) the PipeFisher pass then fills
// the bubbles: its table follows the summary, --trace shows the augmented k-step schedule and
// --report gains "kfac" (the pass's report) and "with_kfac" (the augmented run's figures).
// Returns the exit code.
int run_sim_command(const CompileCommandOptions& compile, const SimCommandOptions& options,
                    std::ostream& out, const pipefisher::KfacCommandOptions& kfac = {});

}  // namespace pf::cli
