// The simulator's command line: flags, --report, the simulated --trace, --schedule all, bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "runtime/model/bert_config.h"
#include "scheduler/schedule_json.h"
#include "sim/bert_costs.h"
#include "sim/calibrate_command.h"
#include "sim/device.h"
#include "sim/measured_cost_model.h"
#include "sim/sim_command.h"
#include "tests/sim/error_message.h"

namespace pf::cli {
namespace {

namespace fs = std::filesystem;

// The message pipefisher_sim gives for these options (no grid printed), "(no error)" for none.
std::string error_of(SimCommandOptions options, CompileCommandOptions compile = {}) {
  compile.grid = "none";
  return sim::test::error_of([&] {
    std::ostringstream out;
    run_sim_command(compile, options, out);
  });
}

fs::path scratch_dir() {
  return fs::temp_directory_path() / ("pf_sim_command_" + std::to_string(::getpid()));
}

fs::path scratch(const std::string& name) {
  fs::create_directories(scratch_dir());
  return scratch_dir() / name;
}

// Removes this process's scratch files after the tests.
class ScratchCleanup : public ::testing::Environment {
 public:
  void TearDown() override { fs::remove_all(scratch_dir()); }
};
[[maybe_unused]] ::testing::Environment* const kCleanup =
    ::testing::AddGlobalTestEnvironment(new ScratchCleanup);

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// Parses a command line with both sets of flags, as pipefisher_sim does (and the --kfac ones
// when `kfac` is given).
void parse(std::vector<std::string> args, CompileCommandOptions& compile,
           SimCommandOptions& options, pipefisher::KfacCommandOptions* kfac = nullptr) {
  CLI::App app;
  add_compile_options(app, compile);
  add_sim_options(app, options);
  if (kfac != nullptr) pipefisher::add_kfac_options(app, *kfac);
  args.insert(args.begin(), "pipefisher_sim");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  app.parse(static_cast<int>(argv.size()), argv.data());
}

TEST(SimCommand, ReportAndTraceOfAUniformRun) {
  CompileCommandOptions compile;
  SimCommandOptions options;
  const fs::path report = scratch("report.json"), trace = scratch("trace.json");
  parse({"--schedule", "1f1b", "-p", "4", "-m", "8", "--uniform", "1,2,0.1", "--grid", "none",
         "--report", report.string(), "--trace", trace.string()},
        compile, options);
  std::ostringstream out;
  ASSERT_EQ(run_sim_command(compile, options, out), 0);
  EXPECT_NE(out.str().find("bubble"), std::string::npos) << out.str();
  const nlohmann::json r = read_json(report);
  EXPECT_GT(r["step_time_s"].get<double>(), 33.0);  // (m + p - 1)(F + B) plus communication
  EXPECT_GT(r["bubble_fraction"].get<double>(), 0.0);
  ASSERT_EQ(r["workers"].size(), 4U);
  for (const auto& w : r["workers"]) {
    EXPECT_NEAR(w["busy_s"].get<double>(), 24.0, 1e-9);
    EXPECT_NEAR(w["busy_s"].get<double>() + w["idle_s"].get<double>(),
                r["step_time_s"].get<double>(), 1e-9);
    EXPECT_GT(w["utilization"].get<double>(), 0.0);
    EXPECT_GE(w["peak_memory_bytes"].get<double>(), 1.0);
  }
  const nlohmann::json t = read_json(trace);
  int counters = 0, flows = 0, spans = 0;
  for (const auto& e : t["traceEvents"]) {
    const std::string ph = e["ph"];
    counters += ph == "C";
    flows += ph == "s";
    spans += ph == "X";
  }
  EXPECT_GT(counters, 0);
  EXPECT_GT(flows, 0);
  EXPECT_GT(spans, 0);
}

TEST(SimCommand, AnalyticRunWithDataParallelism) {
  CompileCommandOptions compile;
  SimCommandOptions options;
  const fs::path report = scratch("dp.json");
  parse({"--schedule", "interleaved", "-p",          "4",        "-v",
         "2",          "-m",          "8",           "--model",  "base",
         "--device",   "a100",        "--precision", "bf16",     "--data-parallel",
         "2",          "--grid",      "none",        "--report", report.string()},
        compile, options);
  std::ostringstream out;
  ASSERT_EQ(run_sim_command(compile, options, out), 0);
  const nlohmann::json r = read_json(report);
  EXPECT_EQ(r["cost_model"], "analytic");
  EXPECT_GT(r["sequences_per_s"].get<double>(), 0.0);
  EXPECT_GT(r["mfu"].get<double>(), 0.0);
  EXPECT_LT(r["mfu"].get<double>(), 1.0);
  EXPECT_EQ(r["schedule"]["data_parallel"], 2);
}

TEST(SimCommand, TensorPipelineDataParallelRun) {
  CompileCommandOptions compile;
  SimCommandOptions options;
  const fs::path report = scratch("ptdp.json");
  parse({"--schedule",
         "1f1b",
         "-p",
         "8",
         "--tensor-parallel",
         "8",
         "--data-parallel",
         "4",
         "--global-batch",
         "128",
         "--micro-batch-size",
         "1",
         "--model",
         "megatron-145.6b",
         "--seq-len",
         "2048",
         "--precision",
         "fp16",
         "--cluster",
         "dgx-a100",
         "--recompute",
         "full",
         "--grid",
         "none",
         "--report",
         report.string()},
        compile, options);
  EXPECT_TRUE(parallel_requested(options));
  std::ostringstream out;
  ASSERT_EQ(run_sim_command(compile, options, out), 0) << out.str();
  EXPECT_NE(out.str().find("tensor-parallel=8"), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("TFLOP/s per GPU"), std::string::npos) << out.str();
  const nlohmann::json r = read_json(report);
  EXPECT_EQ(r["schedule"]["microbatches"], 32);  // 128 / (1 x 4)
  EXPECT_EQ(r["tensor_parallel"], 8);
  EXPECT_TRUE(r["fits"].get<bool>());
  // Achieved FLOP/s per GPU: between a third and two thirds of the A100's 312 TFLOP/s.
  EXPECT_GT(r["achieved_tflops_per_gpu"].get<double>(), 100.0);
  EXPECT_LT(r["achieved_tflops_per_gpu"].get<double>(), 210.0);
  EXPECT_LT(r["mfu"].get<double>(), r["achieved_tflops_per_gpu"].get<double>() / 312.0);
}

// A parallel-model run of `args` with a --report file: the report's `field` (the run must succeed).
double report_field(std::vector<std::string> args, const char* field) {
  const auto report = scratch("field_report.json");
  args.insert(args.end(), {"--grid", "none", "--report", report.string()});
  CompileCommandOptions compile;
  SimCommandOptions options;
  parse(args, compile, options);
  std::ostringstream out;
  EXPECT_EQ(run_sim_command(compile, options, out), 0) << out.str();
  return read_json(report)[field].get<double>();
}

// --device with --cluster replaces the cluster's GPU and, where the device gives it, its memory:
// an H200 in H100 nodes has 141 GB to fit into, not 80.
TEST(SimCommand, DeviceReplacesTheClustersMemory) {
  auto capacity = [](std::vector<std::string> extra) {
    std::vector<std::string> args = {"--schedule",
                                     "1f1b",
                                     "-p",
                                     "2",
                                     "-m",
                                     "4",
                                     "--model",
                                     "gpt3-1.3b",
                                     "--seq-len",
                                     "512",
                                     "--micro-batch-size",
                                     "1",
                                     "--tensor-parallel",
                                     "1"};
    args.insert(args.end(), extra.begin(), extra.end());
    return report_field(args, "gpu_memory_bytes");
  };
  constexpr double kMiB = 1024.0 * 1024.0;
  EXPECT_EQ(capacity({"--cluster", "dgx-h100"}), 80 * 1024 * kMiB);
  EXPECT_EQ(capacity({"--cluster", "dgx-h100", "--device", "h200"}), 143771 * kMiB);
  EXPECT_EQ(capacity({"--device", "h200"}), 143771 * kMiB);
  EXPECT_EQ(capacity({"--cluster", "dgx-b200"}), 183359 * kMiB);
}

TEST(SimCommand, ShardingAndOffloadFlags) {
  auto peak = [](std::vector<std::string> extra) {
    std::vector<std::string> args = {"--schedule",
                                     "1f1b",
                                     "-p",
                                     "2",
                                     "--data-parallel",
                                     "4",
                                     "--global-batch",
                                     "16",
                                     "--micro-batch-size",
                                     "1",
                                     "--model",
                                     "gpt3-1.3b",
                                     "--cluster",
                                     "dgx-h100"};
    args.insert(args.end(), extra.begin(), extra.end());
    return report_field(args, "max_peak_memory_bytes");
  };
  const double replicated = peak({});
  EXPECT_LT(peak({"--shard-optimizer", "0"}), replicated);
  EXPECT_LT(peak({"--shard-parameters", "0", "--shard-gradients", "0", "--shard-optimizer", "0"}),
            peak({"--shard-optimizer", "0"}));
  EXPECT_LT(peak({"--offload-optimizer", "cpu"}), replicated);
  CompileCommandOptions compile;
  SimCommandOptions options;
  parse({"--schedule", "1f1b", "-p", "2", "--data-parallel", "4", "-m", "4", "--model", "gpt3-1.3b",
         "--shard-optimizer", "3", "--grid", "none"},
        compile, options);
  std::ostringstream out;
  EXPECT_THROW(run_sim_command(compile, options, out), std::invalid_argument);
}

// --kfac flags that contradict each other are refused before the schedule's own table is
// printed: the user sees the error alone.
TEST(SimCommand, ContradictoryKfacFlagsAreRefusedBeforeAnyOutput) {
  CompileCommandOptions compile;
  SimCommandOptions options;
  parse({"--schedule", "1f1b", "-p", "4", "-m", "8", "--uniform", "0.001,0.002", "--grid", "none"},
        compile, options);
  pipefisher::KfacCommandOptions kfac;
  kfac.enabled = true;
  kfac.free_spill = "on";
  kfac.refresh_steps = 3;
  std::ostringstream out;
  try {
    run_sim_command(compile, options, out, kfac);
    FAIL() << "accepted --kfac-free-spill on with --kfac-refresh 3";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("--kfac-free-spill"), std::string::npos)
        << error.what();
  }
  EXPECT_EQ(out.str(), "");
  kfac.refresh_steps = 0;
  EXPECT_EQ(run_sim_command(compile, options, out, kfac), 0);
  EXPECT_NE(out.str().find("refresh interval k"), std::string::npos) << out.str();
}

// Numeric flags out of their range name the value and the rule, not CLI11's bound of the
// largest double.
TEST(SimCommand, NumericFlagsOutOfRangeSayWhatIsWrong) {
  const auto error_of = [](const std::vector<std::string>& args) {
    CompileCommandOptions compile;
    SimCommandOptions options;
    pipefisher::KfacCommandOptions kfac;
    try {
      parse(args, compile, options, &kfac);
    } catch (const CLI::ParseError& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--device-memory-budget", "-5"}, "--device-memory-budget: '-5' is negative (must be >= 0)"},
      {{"--kfac-max-refresh", "0"}, "--kfac-max-refresh: '0' is not > 0"},
      {{"--kfac-spill-budget", "2"}, "--kfac-spill-budget: '2' is outside 0 to 1"},
      {{"--kfac-margin", "-0.5"}, "--kfac-margin: '-0.5' is outside 0 to 10"},
      {{"--kfac-refresh", "x"}, "--kfac-refresh: 'x' is not a number"},
      {{"--kfac-memory-budget", "inf"}, "--kfac-memory-budget: 'inf' is not a finite number"},
      {{"--processor-capacity", "-1"}, "--processor-capacity: '-1' is not > 0"},
      {{"--machines", "0,-1"}, "--machines '0,-1': item 2 '-1' is not an integer >= 0"},
      {{"--machines", ","}, "--machines ',': item 1 is empty"},
      {{"--machines", "0,1.5"}, "--machines '0,1.5': item 2 '1.5' is not an integer >= 0"},
      {{"--machines", "99999999999"}, "--machines '99999999999': item 1 '99999999999' exceeds"},
  };
  for (const auto& [args, expected] : cases) {
    const std::string error = error_of(args);
    EXPECT_NE(error.find(expected), std::string::npos) << args[0] << ": " << error;
    EXPECT_EQ(error.find("1797"), std::string::npos) << error;
  }
  EXPECT_EQ(error_of({"--kfac-spill-budget", "0.5", "--device-memory-budget", "0"}), "no error");
  EXPECT_EQ(error_of({"--machines", "3,3,0,2147483647"}), "no error");
}

TEST(SimCommand, AConfigurationThatDoesNotFitIsReportedAsSuch) {
  CompileCommandOptions compile;
  SimCommandOptions options;
  const fs::path report = scratch("nofit.json");
  parse({"--schedule", "gpipe", "-p", "2", "-m", "4", "--tensor-parallel", "2", "--model",
         "gpt3-175b", "--seq-len", "2048", "--cluster", "dgx-a100", "--grid", "none", "--report",
         report.string()},
        compile, options);
  std::ostringstream out;
  EXPECT_EQ(run_sim_command(compile, options, out), 1);
  EXPECT_NE(out.str().find("does not fit: worker "), std::string::npos) << out.str();
  EXPECT_EQ(out.str().find("step time"), std::string::npos) << out.str();
  EXPECT_FALSE(read_json(report)["fits"].get<bool>());
}

TEST(SimCommand, TheBertPathIsUnchangedByTheParallelFlags) {
  CompileCommandOptions compile;
  SimCommandOptions options;
  parse({"--schedule", "1f1b", "-p", "4", "-m", "8", "--model", "large", "--grid", "none"}, compile,
        options);
  EXPECT_FALSE(parallel_requested(options));
  std::ostringstream out;
  ASSERT_EQ(run_sim_command(compile, options, out), 0);
  EXPECT_NE(out.str().find("costs: analytic (BERT large"), std::string::npos) << out.str();
  EXPECT_EQ(out.str().find("TFLOP/s per GPU"), std::string::npos) << out.str();
  // A decoder without --seq-len runs at its maximum sequence (GPT-2: 1024).
  CompileCommandOptions gpt_compile;
  SimCommandOptions gpt;
  parse({"--schedule", "1f1b", "-p", "2", "-m", "4", "--model", "gpt2", "--grid", "none"},
        gpt_compile, gpt);
  std::ostringstream gpt_out;
  ASSERT_EQ(run_sim_command(gpt_compile, gpt, gpt_out), 0);
  EXPECT_NE(gpt_out.str().find("gpt gpt2, S=1024"), std::string::npos) << gpt_out.str();
}

TEST(SimCommand, KfacFillsTheBubblesAndReportsBothRuns) {
  CompileCommandOptions compile;
  SimCommandOptions options;
  pipefisher::KfacCommandOptions kfac;
  const fs::path report = scratch("kfac.json"), trace = scratch("kfac_trace.json");
  const fs::path schedule = scratch("kfac_schedule.json");
  CLI::App app;
  add_compile_options(app, compile);
  add_sim_options(app, options);
  pipefisher::add_kfac_options(app, kfac);
  std::vector<std::string> args = {"pipefisher_sim",
                                   "--schedule",
                                   "1f1b",
                                   "-p",
                                   "4",
                                   "-m",
                                   "8",
                                   "--model",
                                   "base",
                                   "--grid",
                                   "none",
                                   "--kfac",
                                   "--report",
                                   report.string(),
                                   "--trace",
                                   trace.string(),
                                   "--out",
                                   schedule.string()};
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  app.parse(static_cast<int>(argv.size()), argv.data());
  std::ostringstream out;
  ASSERT_EQ(run_sim_command(compile, options, out, kfac), 0);
  const nlohmann::json r = read_json(report);
  ASSERT_TRUE(r.contains("kfac")) << r.dump();
  ASSERT_TRUE(r.contains("with_kfac"));
  EXPECT_GT(r["with_kfac"]["schedule"]["num_steps"].get<int>(), 1);
  EXPECT_LT(r["with_kfac"]["bubble_fraction"].get<double>(), r["bubble_fraction"].get<double>());
  bool kfac_span = false;
  const nlohmann::json events = read_json(trace)["traceEvents"];
  for (const auto& e : events) {
    if (e["ph"] == "X" && e.value("cat", "") == "curvature_a") kfac_span = true;
  }
  EXPECT_TRUE(kfac_span);
  // --out holds the schedule that was simulated last: the k steps with the K-FAC work.
  const sched::Schedule written = sched::load_schedule_json(schedule);
  EXPECT_EQ(written.num_steps, r["with_kfac"]["schedule"]["num_steps"].get<int>());
  int kfac_instructions = 0;
  for (const auto& stream : written.streams) {
    for (const auto& instruction : stream) kfac_instructions += sched::is_kfac(instruction.kind);
  }
  EXPECT_GT(kfac_instructions, 0);
}

TEST(SimCommand, KfacStatePlacementAtScale) {
  // GPT-3 13B, p = 4, d = 8 on A100s of 120 GiB: replicated K-FAC state does not fit (exit 1,
  // said so); sharded over the replicas it does, and the report shows what it saves and moves.
  // (On 80 GB it fit sharded before the simulator counted the factor sums: every replica
  // accumulates all of them, up to the curvature sync.)
  const fs::path cluster = scratch("cluster_a100_120gib.json");
  {
    std::ofstream file(cluster);
    file << R"({"name": "a100-120gib", "device": "a100", "gpu_memory_gb": 128.84901888,
      "gpus_per_node": 8, "num_nodes": 560, "nvlink": {"bandwidth_gbps": 300, "latency_us": 3},
      "network": {"bandwidth_gbps": 25, "latency_us": 6}, "host_bandwidth_gbps": 25,
      "host_memory_gb": 2000, "nvme_bandwidth_gbps": 25})";
  }
  const auto run = [&cluster](const std::string& sharding, std::ostringstream& out,
                              const fs::path& report) {
    CompileCommandOptions compile;
    SimCommandOptions options;
    pipefisher::KfacCommandOptions kfac;
    CLI::App app;
    add_compile_options(app, compile);
    add_sim_options(app, options);
    pipefisher::add_kfac_options(app, kfac);
    std::vector<std::string> args = {"pipefisher_sim",
                                     "--schedule",
                                     "1f1b",
                                     "-p",
                                     "4",
                                     "--data-parallel",
                                     "8",
                                     "--model",
                                     "gpt3-13b",
                                     "--global-batch",
                                     "32",
                                     "--micro-batch-size",
                                     "1",
                                     "--cluster",
                                     cluster.string(),
                                     "--precision",
                                     "fp16",
                                     "--recompute",
                                     "full",
                                     "--grid",
                                     "none",
                                     "--kfac",
                                     "--kfac-sharding",
                                     sharding,
                                     "--report",
                                     report.string()};
    std::vector<const char*> argv;
    for (const auto& a : args) argv.push_back(a.c_str());
    app.parse(static_cast<int>(argv.size()), argv.data());
    return run_sim_command(compile, options, out, kfac);
  };
  const fs::path report = scratch("kfac_scale.json");
  std::ostringstream replicated;
  EXPECT_EQ(run("replicate", replicated, report), 1) << replicated.str();
  EXPECT_NE(replicated.str().find("does not fit with K-FAC"), std::string::npos);
  EXPECT_FALSE(read_json(report)["kfac_state"]["fits"].get<bool>());
  std::ostringstream sharded;
  ASSERT_EQ(run("shard", sharded, report), 0) << sharded.str();
  EXPECT_NE(sharded.str().find("K-FAC state at scale"), std::string::npos) << sharded.str();
  const nlohmann::json state = read_json(report)["kfac_state"];
  EXPECT_TRUE(state["fits"].get<bool>());
  EXPECT_EQ(state["factor_holders"], 1);
  EXPECT_EQ(state["link"], "nvlink");  // 8 replicas 1 rank apart: one node
  EXPECT_LT(state["memory_bytes_per_gpu"].get<double>(),
            state["replicated_memory_bytes_per_gpu"].get<double>() / 4.0);
  EXPECT_GT(state["gradient_bytes_per_step"].get<double>(), 0.0);
  std::ostringstream automatic;
  EXPECT_THROW(run("auto", automatic, report), std::invalid_argument);
}

TEST(SimCommand, KfacOffloadAtScale) {
  // GPT-3 6.7B, p = 4, d = 8 on GPUs of 64 GiB: the replicated K-FAC state does not fit on the
  // device; --kfac-offload auto (its budget the cluster's GPU memory) moves the largest Linears'
  // state to host memory until the simulated peak fits, and says what it saved and cost.
  const fs::path cluster = scratch("cluster_64gib.json");
  {
    std::ofstream file(cluster);
    file << R"({"name": "a100-64gib", "device": "a100", "gpu_memory_gb": 68.719476736,
      "gpus_per_node": 8, "num_nodes": 64, "nvlink": {"bandwidth_gbps": 300, "latency_us": 3},
      "network": {"bandwidth_gbps": 25, "latency_us": 6}, "host_bandwidth_gbps": 25,
      "host_memory_gb": 2000, "nvme_bandwidth_gbps": 25})";
  }
  const auto run = [&](const std::string& offload, std::ostringstream& out,
                       const fs::path& report) {
    CompileCommandOptions compile;
    SimCommandOptions options;
    pipefisher::KfacCommandOptions kfac;
    CLI::App app;
    add_compile_options(app, compile);
    add_sim_options(app, options);
    pipefisher::add_kfac_options(app, kfac);
    std::vector<std::string> args = {"pipefisher_sim",
                                     "--schedule",
                                     "1f1b",
                                     "-p",
                                     "4",
                                     "--data-parallel",
                                     "8",
                                     "--model",
                                     "gpt3-6.7b",
                                     "--global-batch",
                                     "32",
                                     "--micro-batch-size",
                                     "1",
                                     "--cluster",
                                     cluster.string(),
                                     "--precision",
                                     "fp16",
                                     "--recompute",
                                     "full",
                                     "--grid",
                                     "none",
                                     "--kfac",
                                     "--kfac-offload",
                                     offload,
                                     "--report",
                                     report.string()};
    std::vector<const char*> argv;
    for (const auto& a : args) argv.push_back(a.c_str());
    app.parse(static_cast<int>(argv.size()), argv.data());
    return run_sim_command(compile, options, out, kfac);
  };
  const fs::path report = scratch("kfac_offload_scale.json");
  std::ostringstream on_device;
  EXPECT_EQ(run("none", on_device, report), 1) << on_device.str();
  std::ostringstream offloaded;
  ASSERT_EQ(run("auto", offloaded, report), 0) << offloaded.str();
  EXPECT_NE(offloaded.str().find("K-FAC offload at scale"), std::string::npos) << offloaded.str();
  const nlohmann::json r = read_json(report);
  EXPECT_TRUE(r["kfac_state"]["fits"].get<bool>());
  EXPECT_LE(r["kfac_state"]["peak_memory_bytes"].get<double>(), 64.0 * 1024 * 1024 * 1024);
  ASSERT_TRUE(r.contains("kfac_offload"));
  EXPECT_GT(r["kfac_offload"]["offloaded_linears"].get<int>(), 0);
  EXPECT_GT(r["kfac_offload"]["max_peak_memory_before_bytes"].get<double>(),
            64.0 * 1024 * 1024 * 1024);
}

TEST(SimCommand, ScheduleAllComparesAndSkipsWithAReason) {
  CompileCommandOptions compile;
  SimCommandOptions options;
  compile.schedule = "all";
  compile.stages = 3;
  compile.microbatches = 6;
  options.model = "medium";
  std::ostringstream out;
  ASSERT_EQ(run_sim_command(compile, options, out), 0);
  const std::string table = out.str();
  for (const char* name : {"gpipe", "1f1b", "interleaved", "chimera"}) {
    EXPECT_NE(table.find(name), std::string::npos) << table;
  }
  EXPECT_NE(table.find("skipped"), std::string::npos) << table;  // Chimera needs an even D
}

TEST(SimCommand, ScheduleAllWithKfacComparesThePipeFisherEffect) {
  CompileCommandOptions compile;
  SimCommandOptions options;
  pipefisher::KfacCommandOptions kfac;
  kfac.enabled = true;
  // A fixed k: on Chimera (4 workers, 4 micro-batches) workers 1 and 2 have one bubble per step
  // long enough for a 3072 x 3072 inversion (1.45 ms on an H100), and the step's preconditioning,
  // packed first, always takes part of it; no automatic k holds all the work, and the rest runs
  // after the flush.
  kfac.refresh_steps = 8;
  compile.schedule = "all";
  compile.stages = 4;
  compile.microbatches = 4;
  options.model = "base";
  options.report = scratch("all_kfac.json").string();
  std::ostringstream out;
  ASSERT_EQ(run_sim_command(compile, options, out, kfac), 0);
  EXPECT_NE(out.str().find("PipeFisher"), std::string::npos) << out.str();
  const nlohmann::json kfac_reports = read_json(options.report)["kfac"];
  for (const char* name : {"gpipe", "1f1b", "interleaved", "chimera"}) {
    ASSERT_TRUE(kfac_reports.contains(name)) << kfac_reports.dump();
    EXPECT_GT(kfac_reports[name]["utilization_after"].get<double>(),
              kfac_reports[name]["utilization_before"].get<double>())
        << name;
    EXPECT_GE(kfac_reports[name]["refresh_steps"].get<int>(), 1) << name;
  }
}

// calibrate on the shipped V100 measurements: the fitted device (BERT-Large records) predicts the
// held-out BERT-Base forward within 20%, is written for --device, and beats the preset.
TEST(SimCommand, CalibrateFitsWritesADeviceAndReports) {
  CalibrateOptions options;
  options.measurements = "sim/calibration/pipefisher_bert_layer_v100.json";
  options.device = "v100";
  options.hold_outs = {"model=base"};
  options.out = scratch("v100_fit.json").string();
  options.report = scratch("v100_fit_report.json").string();
  options.name = "v100-test";
  std::ostringstream out;
  ASSERT_EQ(run_calibrate_command(options, out), 0);
  EXPECT_NE(out.str().find("median |error|"), std::string::npos) << out.str();
  const sim::DeviceSpec fitted = sim::device_from_json_file(options.out);
  EXPECT_EQ(fitted.name, "v100-test");
  EXPECT_GT(fitted.launch_overhead_s, 0.0);
  auto worst_held_out = [](const nlohmann::json& report, const std::string& operation) {
    double worst = 0.0;
    for (const auto& r : report["residuals"]) {
      if (r["held_out"].get<bool>() && r["operation"] == operation) {
        worst = std::max(worst, std::abs(r["relative_error"].get<double>()));
      }
    }
    return worst;
  };
  const nlohmann::json report = read_json(options.report);
  EXPECT_LT(worst_held_out(report, "layer_forward"), 0.2);
  EXPECT_LT(worst_held_out(report, "layer_inversion"), 0.2);
  // The preset, reported without a fit, misses the inversion by more than half.
  CalibrateOptions preset = options;
  preset.no_fit = true;
  preset.out.clear();
  preset.report = scratch("v100_preset_report.json").string();
  std::ostringstream preset_out;
  ASSERT_EQ(run_calibrate_command(preset, preset_out), 0);
  EXPECT_GT(worst_held_out(read_json(preset.report), "layer_inversion"), 0.5);
  // A start whose peaks are below what the records ran at holds every efficiency at its bound
  // of 1, the fitted records still predicted slow: the command says so (a good start does not).
  EXPECT_EQ(out.str().find("warning: fitted records"), std::string::npos) << out.str();
  nlohmann::json slow = sim::device_to_json(sim::device_preset("v100"));
  slow["peak_flops"]["fp32"] = slow["peak_flops"]["fp32"].get<double>() * 0.1;
  slow["memory_bandwidth"] = slow["memory_bandwidth"].get<double>() * 0.1;
  CalibrateOptions capped = options;
  capped.device = scratch("v100_slow.json").string();
  std::ofstream(capped.device) << slow.dump();
  capped.out.clear();
  capped.report.clear();
  std::ostringstream capped_out;
  ASSERT_EQ(run_calibrate_command(capped, capped_out), 0);
  EXPECT_NE(capped_out.str().find("warning: fitted records are predicted slow (median: layer_"),
            std::string::npos)
      << capped_out.str();
  EXPECT_NE(capped_out.str().find("(--device this-cpu measures this CPU's)"), std::string::npos);
  // Bad input: a missing file, a malformed hold-out.
  CalibrateOptions bad = options;
  bad.measurements = "no_such_file.json";
  EXPECT_THROW(run_calibrate_command(bad, out), std::invalid_argument);
  bad = options;
  bad.hold_outs = {"model"};
  EXPECT_THROW(run_calibrate_command(bad, out), std::invalid_argument);
}

// --storage-precision: pipefisher_train's bf16 runs keep 4-byte activations; the H200 device
// fitted to this runtime (sim/calibration/h200_pipefisher_runtime.json) prices its own records.
TEST(SimCommand, StoragePrecisionAndTheShippedRuntimeDevice) {
  const auto step = [](const std::vector<std::string>& extra) {
    CompileCommandOptions compile;
    SimCommandOptions options;
    const fs::path report = scratch("storage.json");
    std::vector<std::string> args = {"--schedule",
                                     "gpipe",
                                     "-p",
                                     "1",
                                     "-m",
                                     "4",
                                     "--model",
                                     "large",
                                     "--device",
                                     "h200",
                                     "--precision",
                                     "bf16",
                                     "--micro-batch-size",
                                     "8",
                                     "--grid",
                                     "none",
                                     "--report",
                                     report.string()};
    args.insert(args.end(), extra.begin(), extra.end());
    parse(args, compile, options);
    std::ostringstream out;
    EXPECT_EQ(run_sim_command(compile, options, out), 0);
    return std::make_pair(read_json(report)["step_time_s"].get<double>(), out.str());
  };
  const auto [in_bf16, text_bf16] = step({});
  const auto [in_fp32, text_fp32] = step({"--storage-precision", "fp32"});
  EXPECT_GT(in_fp32, in_bf16 * 1.05);  // the element-wise kernels move twice the bytes
  EXPECT_NE(text_fp32.find("bf16 (stored fp32)"), std::string::npos) << text_fp32;
  EXPECT_EQ(text_bf16.find("stored"), std::string::npos);
  {
    CompileCommandOptions compile;
    SimCommandOptions options;
    parse({"--schedule", "1f1b", "-p", "2", "-m", "4", "--model", "large", "--tensor-parallel", "2",
           "--storage-precision", "fp32"},
          compile, options);
    std::ostringstream out;
    EXPECT_THROW(run_sim_command(compile, options, out), std::invalid_argument);
  }
  CalibrateOptions check;
  check.measurements = "sim/calibration/h200_runtime_2026-11-27.json";
  check.device = "sim/calibration/h200_pipefisher_runtime.json";
  check.hold_outs = {"stale=true"};
  check.no_fit = true;
  check.report = scratch("h200_report.json").string();
  std::ostringstream out;
  ASSERT_EQ(run_calibrate_command(check, out), 0);
  int fitted = 0;
  const nlohmann::json report = read_json(check.report);
  for (const auto& r : report["residuals"]) {
    if (r["held_out"].get<bool>()) continue;
    ++fitted;
    EXPECT_LT(std::abs(r["relative_error"].get<double>()), 0.05) << r.dump();
  }
  EXPECT_EQ(fitted, 11);
}

// --max-spread leaves out the records whose samples scattered (bench_sim_calibrate's "spread")
// and lists them; the report shows every record's spread.
TEST(SimCommand, CalibrateLeavesOutNoisyRecords) {
  nlohmann::json records = nlohmann::json::array();
  for (int i = 0; i < 6; ++i) {
    const double n = 128.0 * (i + 1);
    records.push_back({{"operation", "gemm"},
                       {"m", n},
                       {"n", n},
                       {"k", n},
                       {"seconds", 2.0 * n * n * n / 3e10},
                       {"spread", i == 4 ? 0.6 : 0.05}});
  }
  const fs::path file = scratch("noisy_measurements.json");
  {
    std::ofstream f(file);
    f << nlohmann::json{{"format_version", 1}, {"measurements", records}}.dump();
  }
  CalibrateOptions options;
  options.measurements = file.string();
  options.device = "v100";
  options.max_spread = 0.3;
  std::ostringstream out;
  ASSERT_EQ(run_calibrate_command(options, out), 0);
  EXPECT_NE(out.str().find("left out (spread 0.60): gemm 640x640x640"), std::string::npos)
      << out.str();
  EXPECT_NE(out.str().find("to 5 records"), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("spread 0.05"), std::string::npos) << out.str();
  options.max_spread = 0.01;
  const std::string error = [&] {
    try {
      run_calibrate_command(options, out);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  }();
  EXPECT_NE(error.find("every record"), std::string::npos) << error;
}

// --attention fused prices pipefisher_train's fused attention: a smaller stash (no S x S
// scores), another step time, named in the summary; other values are refused.
TEST(SimCommand, AttentionFlag) {
  const auto run = [](const std::string& attention, const std::string& device) {
    CompileCommandOptions compile;
    SimCommandOptions options;
    const fs::path report = scratch("attention_" + attention + ".json");
    parse({"--schedule",
           "gpipe",
           "-p",
           "1",
           "-m",
           "2",
           "--model",
           "large",
           "--device",
           device,
           "--precision",
           "bf16",
           "--storage-precision",
           "fp32",
           "--seq-len",
           "512",
           "--micro-batch-size",
           "8",
           "--attention",
           attention,
           "--grid",
           "none",
           "--report",
           report.string()},
          compile, options);
    EXPECT_EQ(options.attention, attention);
    std::ostringstream out;
    EXPECT_EQ(run_sim_command(compile, options, out), 0);
    return std::make_pair(read_json(report), out.str());
  };
  const auto [batched, batched_text] = run("batched", "h100");
  const auto [fused, fused_text] = run("fused", "h100");
  EXPECT_NE(fused_text.find("fused attention"), std::string::npos) << fused_text;
  EXPECT_EQ(batched_text.find("fused attention"), std::string::npos) << batched_text;
  // 2 stashed micro-batches x 24 layers x (the fp32 probabilities, 4 a b S^2 bytes, less the
  // 4 a b S of log-sum-exps): pipefisher_train's stash.
  const double a = 16, b = 8, S = 512;
  const double saved = batched["workers"][0]["peak_memory_bytes"].get<double>() -
                       fused["workers"][0]["peak_memory_bytes"].get<double>();
  EXPECT_NEAR(saved, 2 * 24 * (4 * a * b * S * S - 4 * a * b * S), 1e-9 * saved);
  EXPECT_NE(batched["step_time_s"].get<double>(), fused["step_time_s"].get<double>());
  {
    CompileCommandOptions compile;
    SimCommandOptions options;
    EXPECT_THROW(parse({"--model", "large", "--attention", "flash"}, compile, options),
                 CLI::ValidationError);
  }
  SimCommandOptions o;
  o.model = "large";
  o.attention = "flash";
  EXPECT_NE(error_of(o).find("--attention 'flash' is not one of batched, fused"), std::string::npos)
      << error_of(o);
  o = {};
  o.attention = "fused";  // the plain compiler prices nothing
  EXPECT_NE(error_of(o).find("give --model"), std::string::npos) << error_of(o);
  o.uniform = "1,2";
  EXPECT_NE(error_of(o).find("give --model"), std::string::npos) << error_of(o);
  o = {};
  o.attention = "fused";
  o.model = "large";
  o.profile = "profile.json";  // a measured profile times the attention its run used
  EXPECT_NE(error_of(o).find("measured --profile"), std::string::npos) << error_of(o);
}

// --stash: pipefisher_train's stash by default, Korthikanti et al.'s eager count on request (other
// memory, the same time); only where the BERT analytic model counts activations.
TEST(SimCommand, StashFlag) {
  const auto run = [](const std::vector<std::string>& extra) {
    CompileCommandOptions compile;
    SimCommandOptions options;
    const fs::path report = scratch("stash_" + std::to_string(extra.size()) + ".json");
    std::vector<std::string> args = {"--schedule",
                                     "gpipe",
                                     "-p",
                                     "1",
                                     "-m",
                                     "2",
                                     "--model",
                                     "large",
                                     "--precision",
                                     "bf16",
                                     "--storage-precision",
                                     "fp32",
                                     "--grid",
                                     "none",
                                     "--report",
                                     report.string()};
    args.insert(args.end(), extra.begin(), extra.end());
    parse(args, compile, options);
    std::ostringstream out;
    EXPECT_EQ(run_sim_command(compile, options, out), 0);
    return std::make_pair(read_json(report), out.str());
  };
  const auto [runtime, runtime_text] = run({});
  const auto [eager, eager_text] = run({"--stash", "eager"});
  EXPECT_NE(eager_text.find("eager stash"), std::string::npos) << eager_text;
  EXPECT_EQ(runtime_text.find("eager stash"), std::string::npos) << runtime_text;
  // GPipe on one worker stashes both micro-batches of its one chunk (embeddings, 24 layers, head).
  sim::Workload w;
  w.config = model::bert_preset("large");
  w.precision = sim::Precision::kBf16;
  w.storage_precision = sim::Precision::kFp32;
  const double runtime_chunk = sim::chunk_activation_bytes(w, 24, true, true);
  w.stash = sim::ActivationStash::kEager;
  const double eager_chunk = sim::chunk_activation_bytes(w, 24, true, true);
  const double runtime_peak = runtime["workers"][0]["peak_memory_bytes"].get<double>();
  const double eager_peak = eager["workers"][0]["peak_memory_bytes"].get<double>();
  EXPECT_NEAR(eager_peak - runtime_peak, 2 * (eager_chunk - runtime_chunk), 1e-9 * runtime_peak);
  EXPECT_NE(eager_peak, runtime_peak);
  EXPECT_EQ(runtime["step_time_s"].get<double>(), eager["step_time_s"].get<double>());
  {
    CompileCommandOptions compile;
    SimCommandOptions options;
    EXPECT_THROW(parse({"--model", "large", "--stash", "megatron"}, compile, options),
                 CLI::ValidationError);
  }
  SimCommandOptions o;
  o.model = "large";
  o.stash = "megatron";
  EXPECT_NE(error_of(o).find("--stash 'megatron' is not one of runtime, eager"), std::string::npos)
      << error_of(o);
  o = {};
  o.stash = "eager";
  EXPECT_NE(error_of(o).find("give --model"), std::string::npos) << error_of(o);
  o.model = "large";
  o.tensor_parallel = 2;  // the parallel model counts Korthikanti's
  EXPECT_NE(error_of(o).find("--stash applies to the BERT analytic model"), std::string::npos)
      << error_of(o);
  o.tensor_parallel = 1;
  o.profile = "profile.json";
  EXPECT_NE(error_of(o).find("measured --profile"), std::string::npos) << error_of(o);
}

TEST(SimCommand, WorkersSharingAProcessor) {
  const auto step_time = [](std::vector<std::string> extra) {
    CompileCommandOptions compile;
    SimCommandOptions options;
    const fs::path report = scratch("shared_report.json");
    std::vector<std::string> args = {"--schedule", "1f1b",   "-p",   "4",        "-m",
                                     "8",          "--grid", "none", "--report", report.string()};
    args.insert(args.end(), extra.begin(), extra.end());
    parse(args, compile, options);
    std::ostringstream out;
    EXPECT_EQ(run_sim_command(compile, options, out), 0);
    return read_json(report)["step_time_s"].get<double>();
  };
  const double own = step_time({"--uniform", "1,2"});
  // One processor with one instruction's worth for all four: at least their 96 s of work.
  const double one = step_time({"--uniform", "1,2", "--workers-per-processor", "4"});
  EXPECT_GE(one, 96.0 - 1e-9);
  EXPECT_GT(one, own);
  // Two processors of two workers, each with room for both: the own-processor figure.
  EXPECT_NEAR(
      step_time({"--uniform", "1,2", "--workers-per-processor", "2", "--processor-capacity", "2"}),
      own, 1e-9);
  // A profile that says its workers shared one processor is simulated so.
  const fs::path profile = scratch("shared_profile.json");
  sim::Profile measured;
  for (int chunk = 0; chunk < 4; ++chunk) {
    sim::ChunkProfile entry;
    entry.chunk = chunk;
    entry.forward_s = 1.0;
    entry.backward_s = 2.0;
    measured.chunks.push_back(entry);
  }
  measured.communication.bandwidth = 1e12;
  measured.reduction.bandwidth = 1e12;
  measured.shared_processor_capacity = 1.0;
  std::ofstream(profile) << sim::profile_to_json(measured).dump();
  EXPECT_NEAR(step_time({"--profile", profile.string()}), one, 1e-9);
  EXPECT_NEAR(step_time({"--profile", profile.string(), "--workers-per-processor", "1"}), own,
              1e-9);
  // Taken from a run of two data-parallel replicas, the capacity is one replica's share: a run
  // of two replicas simulates it as it is, a run of one gets the whole (twice the share).
  measured.shared_processor_capacity = 0.5;
  measured.shared_processor_replicas = 2;
  std::ofstream(profile) << sim::profile_to_json(measured).dump();
  EXPECT_NEAR(step_time({"--profile", profile.string()}), one, 1e-9);
  EXPECT_DOUBLE_EQ(sim::shared_processors_of(measured).capacity, 0.5);  // the profile's run
  EXPECT_DOUBLE_EQ(sim::shared_processors_of(measured, 1).capacity, 1.0);
  EXPECT_DOUBLE_EQ(sim::shared_processors_of(measured, 2).capacity, 0.5);
  EXPECT_DOUBLE_EQ(sim::shared_processors_of(measured, 4).capacity, 0.25);
  // The fields round-trip, and a bad one names itself.
  const auto again = sim::profile_from_json(sim::profile_to_json(measured), "x");
  EXPECT_DOUBLE_EQ(again.shared_processor_capacity, 0.5);
  EXPECT_EQ(again.shared_processor_replicas, 2);
  auto bad = sim::profile_to_json(measured);
  bad["shared_processor"]["capacity"] = 0.0;
  EXPECT_NE(sim::test::error_of([&] {
              sim::profile_from_json(bad, "bad.json");
            }).find("shared_processor.capacity"),
            std::string::npos);
  bad = sim::profile_to_json(measured);
  bad["shared_processor"]["replicas"] = 0;
  EXPECT_NE(sim::test::error_of([&] {
              sim::profile_from_json(bad, "bad.json");
            }).find("shared_processor.replicas"),
            std::string::npos);
  bad["shared_processor"].erase("replicas");  // optional: one replica
  EXPECT_EQ(sim::profile_from_json(bad, "old.json").shared_processor_replicas, 1);
  // A run whose ranks spanned machines: a processor per machine. A machine per worker, each of
  // the whole capacity 1: the own-processor figure; two workers a machine: between.
  measured.shared_processor_capacity = 1.0;
  measured.shared_processor_replicas = 1;
  measured.shared_processor_machines = {0, 1, 2, 3};
  std::ofstream(profile) << sim::profile_to_json(measured).dump();
  EXPECT_NEAR(step_time({"--profile", profile.string()}), own, 1e-9);
  measured.shared_processor_machines = {0, 0, 1, 1};
  std::ofstream(profile) << sim::profile_to_json(measured).dump();
  const double pairs = step_time({"--profile", profile.string()});
  EXPECT_GT(pairs, own + 1e-6);
  EXPECT_LT(pairs, one - 1e-6);
  // The flags replace the machines: groups of all four, or one capacity for every processor
  // (2 on each machine's pair: the own-processor figure).
  EXPECT_NEAR(step_time({"--profile", profile.string(), "--workers-per-processor", "4"}), one,
              1e-9);
  EXPECT_NEAR(step_time({"--profile", profile.string(), "--processor-capacity", "2"}), own, 1e-9);
  EXPECT_EQ(sim::shared_processors_of(measured).processor_of_worker,
            (std::vector<int>{0, 0, 1, 1}));
  // Two replicas, ranks spread over two machines: each machine's half for replica 0's workers;
  // another replica count has other ranks, and gets the one processor.
  measured.shared_processor_capacity = 0.5;
  measured.shared_processor_replicas = 2;
  measured.shared_processor_machines = {0, 0, 1, 1, 0, 0, 1, 1};
  EXPECT_EQ(sim::shared_processors_of(measured, 2).processor_capacity,
            (std::vector<double>{0.5, 0.5}));
  EXPECT_TRUE(sim::shared_processors_of(measured, 1).processor_of_worker.empty());
  EXPECT_DOUBLE_EQ(sim::shared_processors_of(measured, 1).capacity, 1.0);
  EXPECT_EQ(sim::profile_from_json(sim::profile_to_json(measured), "x").shared_processor_machines,
            measured.shared_processor_machines);
  for (const auto& [machines, field] : std::vector<std::pair<nlohmann::json, std::string>>{
           {nlohmann::json(3), "shared_processor.machines"},
           {nlohmann::json::array(), "shared_processor.machines"},
           {nlohmann::json{0, 1, 0}, "shared_processor.machines"},  // not 2 replicas' ranks
           {nlohmann::json{0, -1}, "shared_processor.machines[1]"},
           {nlohmann::json{0, 2}, "shared_processor.machines[1]"},
           {nlohmann::json{0, 0.5}, "shared_processor.machines[1]"}}) {
    bad = sim::profile_to_json(measured);
    bad["shared_processor"]["machines"] = machines;
    EXPECT_NE(sim::test::error_of([&] { sim::profile_from_json(bad, "bad.json"); }).find(field),
              std::string::npos)
        << machines.dump();
  }
  // The same machine maps by flag (--machines, each machine's capacity by --processor-capacity
  // or the profile's): a machine per worker, pairs, all on one.
  EXPECT_NEAR(step_time({"--uniform", "1,2", "--machines", "0,1,2,3", "--processor-capacity", "1"}),
              own, 1e-9);
  EXPECT_NEAR(step_time({"--uniform", "1,2", "--machines", "0,0,1,1", "--processor-capacity", "1"}),
              pairs, 1e-9);
  EXPECT_NEAR(step_time({"--uniform", "1,2", "--machines", "5,5,5,5", "--processor-capacity", "1"}),
              one, 1e-9);
  measured.shared_processor_capacity = 1.0;
  measured.shared_processor_replicas = 1;
  measured.shared_processor_machines.clear();
  std::ofstream(profile) << sim::profile_to_json(measured).dump();
  EXPECT_NEAR(step_time({"--profile", profile.string(), "--machines", "0,0,1,1"}), pairs, 1e-9);
  // Two replicas on two machines, a pair of each replica's stages per machine (mpirun by node):
  // each machine's capacity 2 is shared by four ranks, replica 0's pair gets 1: the pairs figure.
  EXPECT_NEAR(step_time({"--uniform", "1,2", "--data-parallel", "2", "--machines",
                         "0,0,1,1,0,0,1,1", "--processor-capacity", "2"}),
              pairs, 1e-9);
  SimCommandOptions o;
  o.uniform = "1,2";
  o.processor_capacity = 2.0;
  EXPECT_NE(error_of(o).find("--processor-capacity sizes a shared processor"), std::string::npos);
  o = {};
  o.workers_per_processor = 2;
  EXPECT_NE(error_of(o).find("need a simulation"), std::string::npos);
  o = {};
  o.machines = {0, 0, 1, 1};
  EXPECT_NE(error_of(o).find("need a simulation"), std::string::npos);
  o.uniform = "1,2";
  EXPECT_NE(error_of(o).find("--machines shares each machine's cores: give --processor-capacity"),
            std::string::npos);
  o.processor_capacity = 1.0;
  o.workers_per_processor = 2;
  EXPECT_NE(error_of(o).find("--machines and --workers-per-processor"), std::string::npos);
  o.workers_per_processor = 0;
  o.machines = {0, 0, 1};
  EXPECT_NE(error_of(o).find("3 workers mapped, the schedule has 4"), std::string::npos);
  o.machines = {0, 0, 1, 1, 0};
  CompileCommandOptions two_replicas;
  two_replicas.data_parallel = 2;
  EXPECT_NE(error_of(o, two_replicas).find("--machines lists 5 ranks, not a whole number of the 2"),
            std::string::npos);
}

TEST(SimCommand, BadInputGivesClearErrors) {
  SimCommandOptions o;
  o.model = "gigantic";
  EXPECT_NE(error_of(o).find("gigantic"), std::string::npos);
  o = {};
  o.model = "tiny";
  o.device = "tpu9";
  EXPECT_NE(error_of(o).find("tpu9"), std::string::npos);
  o = {};
  o.profile = "/nonexistent/profile.json";
  EXPECT_NE(error_of(o).find("/nonexistent/profile.json"), std::string::npos);
  o = {};
  o.uniform = "1,two";
  EXPECT_NE(error_of(o).find("two"), std::string::npos);
  o = {};
  o.model = "gpt2";
  o.seq_len = 1024;
  o.global_batch = 30;
  o.micro_batch_size = 4;
  EXPECT_NE(error_of(o).find("--global-batch 30 must be a positive multiple of "
                             "--micro-batch-size x --data-parallel = 4"),
            std::string::npos);
  o.global_batch = 0;
  o.cluster = "dgx-z9";
  EXPECT_NE(error_of(o).find("unknown cluster 'dgx-z9'"), std::string::npos);
  o.cluster = "dgx-a100";
  o.tensor_parallel = 5;
  EXPECT_NE(error_of(o).find("--tensor-parallel 5"), std::string::npos);
  o.tensor_parallel = 2;
  o.uniform = "1,2";
  EXPECT_NE(error_of(o).find("cannot be combined with --uniform"), std::string::npos);
  o = {};
  o.tensor_parallel = 8;
  EXPECT_NE(error_of(o).find("price a model: give --model"), std::string::npos);
  o = {};
  o.report = "x.json";
  EXPECT_NE(error_of(o).find("--model, --uniform or --profile"), std::string::npos);
  // A schedule file that fails validation: the compiler's error names the file.
  const fs::path bad = scratch("bad.csv");
  std::ofstream(bad) << "0F0,0B0\n1B0,1F0\n";
  CompileCommandOptions compile;
  compile.schedule_file = bad.string();
  o = {};
  o.uniform = "1,2";
  EXPECT_NE(error_of(o, compile).find("bad.csv"), std::string::npos) << error_of(o, compile);
}

}  // namespace
}  // namespace pf::cli
