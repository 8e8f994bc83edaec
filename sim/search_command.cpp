#include "sim/search_command.h"

#include <algorithm>
#include <ostream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "common/comma_list.h"
#include "sim/config_search.h"
#include "traces/chrome_trace.h"

namespace pf::cli {
namespace {

// The named items of a list flag (--schedules, --recompute, ...), as strings.
std::vector<std::string> split(const std::string& list, std::string_view flag) {
  const std::vector<std::string_view> items = split_comma_list(list, flag);
  return {items.begin(), items.end()};
}

}  // namespace

CLI::App* add_search_command(CLI::App& app, SearchCommandOptions& options) {
  CLI::App* command = app.add_subcommand(
      "search",
      "Enumerate tensor, pipeline and data parallelism, schedule, micro-batch size, "
      "recomputation, ZeRO-style state sharding and optimizer offload for a model on N GPUs of a "
      "cluster; prune what does not fit in memory; rank by predicted time per step "
      "(docs/scale.md)");
  command->add_option("--model", options.model, "Model preset or Hugging Face config.json")
      ->required();
  command->add_option("--gpus", options.gpus, "GPUs N = t x p x d")->required();
  command->add_option("--global-batch", options.global_batch, "Sequences per step B")->required();
  command
      ->add_option("--cluster", options.cluster, "dgx-a100, dgx-h100, dgx-b200 or a cluster JSON")
      ->capture_default_str();
  command->add_option(
      "--device", options.device,
      "Replace the cluster's GPU (preset or file; its memory too where the device gives it)");
  command->add_option("--seq-len", options.seq_len,
                      "Sequence length (default: the model's maximum, at most 2048)");
  command->add_option("--precision", options.precision, "bf16, fp16, tf32 or fp32")
      ->check(CLI::IsMember({"fp32", "tf32", "bf16", "fp16"}))
      ->capture_default_str();
  command
      ->add_option("--attention", options.attention,
                   "Attention core of every candidate: batched (products with the scores in "
                   "memory) or fused (pipefisher_train --attention fused's flash-style kernel: no "
                   "S x S tensor stashed, scores recomputed in the backward)")
      ->check(CLI::IsMember({"batched", "fused"}))
      ->capture_default_str();
  command->add_flag("--kfac", options.kfac,
                    "Run the PipeFisher pass on the best simulated configurations and rank them "
                    "by time per step with K-FAC in the bubbles");
  command->add_option(
      "--kfac-sharding", options.kfac_sharding,
      "With --kfac: the K-FAC state placements to try over the data-parallel group, a comma "
      "list of replicate, shard, partial:G and factors=X,inverses=Y pairs (default: replicate; "
      "factors=shard,inverses=replicate; partial:2, 4, ... up to 64 dividing d; shard)");
  command
      ->add_option("--kfac-offload", options.kfac_offload,
                   "With --kfac: K-FAC state in host memory, replicated or sharded (none, host: "
                   "every Linear whole, factors: every Linear's factors only, its inverses on the "
                   "device, auto: what does not fit the GPU, factors first), its copies on each "
                   "GPU's host link")
      ->check(CLI::IsMember({"none", "host", "factors", "auto"}))
      ->capture_default_str();
  command->add_option("--out", options.out, "Write the top configurations as JSON");
  command->add_option("--top", options.top, "Configurations to print and write")
      ->capture_default_str();
  command
      ->add_option("--simulate-top", options.simulate_top,
                   "Best closed-form estimates replayed by the event engine")
      ->capture_default_str();
  command
      ->add_option("--kfac-top", options.kfac_top,
                   "Best simulated configurations the PipeFisher pass runs on (--kfac)")
      ->capture_default_str();
  command->add_option("--tensor-parallel", options.tensor_parallel,
                      "Tensor-parallel degrees to try, comma-separated (default: 1, 2, 4, ... "
                      "up to two nodes)");
  command->add_option("--stages", options.stages,
                      "Pipeline stages to try, comma-separated (default: every p dividing N / t)");
  command
      ->add_option("--micro-batch-sizes", options.micro_batch_sizes,
                   "Micro-batch sizes to try, comma-separated")
      ->capture_default_str();
  command
      ->add_option("--schedules", options.schedules,
                   "Schedules to try: gpipe, 1f1b, interleaved (v = 2 and 4), chimera")
      ->capture_default_str();
  command
      ->add_option("--recompute", options.recompute, "Recomputation to try: none, selective, full")
      ->capture_default_str();
  command
      ->add_option("--zero-stages", options.zero_stages,
                   "Model state over the data-parallel group to try: 0 (replicated), 1 (optimizer "
                   "state sharded), 2 (and gradients), 3 (and parameters); stages above 0 only "
                   "where d > 1")
      ->capture_default_str();
  command->add_option("--optimizer-offload", options.optimizer_offload,
                      "Where the optimizer state may live: none (GPU memory), cpu (host memory), "
                      "nvme (default: none,cpu; none where the cluster has no host link)");
  return command;
}

int run_search_command(const SearchCommandOptions& options, std::ostream& out) {
  sim::SearchOptions search;
  search.model = sim::resolve_transformer(options.model);
  search.cluster = sim::resolve_cluster(options.cluster);
  if (!options.device.empty()) {
    search.cluster.device = sim::resolve_device(options.device);
    // Its memory too, where the device knows it.
    if (search.cluster.device.memory_bytes > 0.0) {
      search.cluster.gpu_memory_bytes = search.cluster.device.memory_bytes;
    }
  }
  search.gpus = options.gpus;
  search.global_batch = options.global_batch;
  search.seq_len =
      options.seq_len > 0 ? options.seq_len : std::min(2048, search.model.max_position_embeddings);
  search.precision = sim::precision_from_string(options.precision);
  search.attention = sim::attention_from_string(options.attention);
  if (!options.tensor_parallel.empty()) {
    search.tensor_parallel = parse_positive_int_list(options.tensor_parallel, "--tensor-parallel");
  }
  if (!options.stages.empty()) {
    search.pipeline_stages = parse_positive_int_list(options.stages, "--stages");
  }
  search.micro_batch_sizes =
      parse_positive_int_list(options.micro_batch_sizes, "--micro-batch-sizes");
  search.kinds.clear();
  for (const std::string& name : split(options.schedules, "--schedules")) {
    if (name != "gpipe" && name != "1f1b" && name != "interleaved" && name != "chimera") {
      throw std::invalid_argument("--schedules: '" + name +
                                  "' is not one of gpipe, 1f1b, interleaved, chimera");
    }
    const auto kind = sched::schedule_kind_from_string(name);
    search.kinds.push_back(kind);
  }
  search.recompute.clear();
  for (const std::string& name : split(options.recompute, "--recompute")) {
    search.recompute.push_back(sim::recompute_from_string(name));
  }
  search.zero_stages.clear();
  for (const std::string& name : split(options.zero_stages, "--zero-stages")) {
    if (name.size() != 1 || name[0] < '0' || name[0] > '3') {
      throw std::invalid_argument("--zero-stages: '" + name + "' is not one of 0, 1, 2, 3");
    }
    search.zero_stages.push_back(name[0] - '0');
  }
  search.optimizer_offload.clear();
  if (options.optimizer_offload.empty()) {
    search.optimizer_offload.push_back(sim::Offload::kNone);
    if (search.cluster.host_bandwidth > 0.0)
      search.optimizer_offload.push_back(sim::Offload::kHost);
  } else {
    for (const std::string& name : split(options.optimizer_offload, "--optimizer-offload")) {
      if (name != "none" && name != "cpu" && name != "nvme") {
        throw std::invalid_argument("--optimizer-offload: '" + name +
                                    "' is not one of none, cpu, nvme");
      }
      search.optimizer_offload.push_back(sim::offload_from_string(name));
    }
  }
  if (options.top <= 0) throw std::invalid_argument("--top must be positive");
  search.simulate_top = options.simulate_top;
  search.kfac_top = options.kfac_top;
  if (options.kfac) search.kfac = pipefisher::KfacOptions{};
  if (!options.kfac_sharding.empty()) {
    if (!options.kfac)
      throw std::invalid_argument("--kfac-sharding places K-FAC state: add --kfac");
    search.kfac_placements = sim::parse_kfac_placements(options.kfac_sharding);
  }
  search.kfac_offload = pipefisher::offload_mode_from_string(options.kfac_offload);
  if (search.kfac_offload != pipefisher::OffloadMode::kNone && !options.kfac) {
    throw std::invalid_argument("--kfac-offload offloads K-FAC state: add --kfac");
  }
  const sim::SearchResult result = sim::search_configurations(search);
  out << sim::search_table(search, result, options.top);
  if (!options.out.empty()) {
    traces::write_json_file(options.out, sim::search_json(search, result, options.top));
    out << "wrote " << options.out << "\n";
  }
  if (result.ranked.empty()) {
    out << "no configuration fits: more GPUs, a smaller micro-batch or recomputation\n";
    return 1;
  }
  return 0;
}

}  // namespace pf::cli
