#pragma once
// `pipefisher_sim search`: the configuration search (sim/config_search.h) from the command line:
// prints the top configurations as a table and writes them as JSON (--out).
#include <iosfwd>
#include <string>

namespace CLI {
class App;
}  // namespace CLI

namespace pf::cli {

struct SearchCommandOptions {
  std::string model;     // preset or config.json
  int gpus = 0;          // N
  int global_batch = 0;  // B sequences per step
  std::string cluster = "dgx-a100";
  std::string device;  // replaces the cluster's GPU when given
  int seq_len = 0;     // 0: the model's maximum (at most 2048)
  std::string precision = "bf16";
  std::string attention = "batched";  // the attention core: batched or fused
  bool kfac = false;
  std::string kfac_sharding;
  std::string kfac_offload = "none";  // --kfac-offload none|host|auto  // --kfac-sharding list
                                      // (empty: default_kfac_placements)
  std::string out;                    // --out FILE.json
  int top = 10;
  int simulate_top = 24;
  int kfac_top = 6;
  std::string tensor_parallel;  // comma-separated degrees; empty: powers of two
  std::string stages;           // comma-separated p; empty: every divisor
  std::string micro_batch_sizes = "1,2,4,8";
  std::string schedules = "gpipe,1f1b,interleaved,chimera";
  std::string recompute = "none,selective,full";
  std::string zero_stages = "0,1,2,3";
  std::string optimizer_offload;  // comma-separated; empty: none,cpu (none without a host link)
};

// Adds the `search` subcommand to `app` and returns it.
CLI::App* add_search_command(CLI::App& app, SearchCommandOptions& options);

// Runs it; throws std::invalid_argument on bad input. Returns the exit code (1 when nothing fits).
int run_search_command(const SearchCommandOptions& options, std::ostream& out);

}  // namespace pf::cli
