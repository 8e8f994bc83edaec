// pipefisher_sim: the compile command's library functions, and the program's exit codes and
// error lines (run as a subprocess).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "scheduler/schedule_json.h"
#include "scheduler/torch_csv.h"
#include "sim/cli/compile_command.h"
#include "traces/chrome_trace.h"

namespace pf::cli {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir() {
  const fs::path dir = fs::temp_directory_path() / ("pf_cli_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir;
}

std::string read(const fs::path& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(CompileCommand, WritesJsonCsvAndTrace) {
  const fs::path dir = temp_dir();
  CompileCommandOptions options;
  options.schedule = "interleaved";
  options.stages = 2;
  options.microbatches = 4;
  options.chunks = 2;
  options.out_json = (dir / "s.json").string();
  options.out_csv = (dir / "s.csv").string();
  options.out_trace = (dir / "t.json").string();
  std::ostringstream out;
  EXPECT_EQ(run_compile_command(options, out), 0);
  EXPECT_NE(out.str().find("schedule interleaved: 2 workers, 4 micro-batches"), std::string::npos)
      << out.str();
  EXPECT_NE(out.str().find("w0    | F0.c0"), std::string::npos) << out.str();
  const sched::Schedule s = sched::load_schedule_json(options.out_json);
  EXPECT_EQ(s.params.chunks_per_worker, 2);
  EXPECT_EQ(sched::to_torch_csv(s), read(options.out_csv));
  EXPECT_EQ(traces::read_chrome_trace(options.out_trace).size(), s.num_instructions());

  // Loading the CSV back gives the same compute streams.
  CompileCommandOptions load;
  load.schedule_file = options.out_csv;
  load.grid = "none";
  EXPECT_EQ(sched::to_torch_csv(build_schedule(load)), read(options.out_csv));
  fs::remove_all(dir);
}

TEST(CompileCommand, SummaryCountsAndBubble) {
  CompileCommandOptions options;
  options.schedule = "gpipe";
  options.stages = 4;
  options.microbatches = 4;
  const std::string summary = summarize(build_schedule(options));
  // (m + p - 1)(t_f + t_b) = 7 * 3 = 21; busy 4 * 4 * 3 = 48 of 84.
  EXPECT_NE(summary.find("makespan 21, bubble 42.9%"), std::string::npos) << summary;
  EXPECT_NE(summary.find("forward 16, backward 16"), std::string::npos) << summary;
  EXPECT_NE(summary.find("peak stashed micro-batches per worker: 4 4 4 4"), std::string::npos);
}

struct RunResult {
  int status = -1;
  std::string out;
  std::string err;
};

RunResult run(const std::string& arguments) {
  const fs::path dir = temp_dir();
  const fs::path out = dir / "out.txt";
  const fs::path err = dir / "err.txt";
  const std::string command =
      std::string(PF_SIM_BINARY) + " " + arguments + " > " + out.string() + " 2> " + err.string();
  const int raw = std::system(command.c_str());
  RunResult result;
  result.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  result.out = read(out);
  result.err = read(err);
  fs::remove_all(dir);
  return result;
}

TEST(CompileCommand, LayersPerStageSetsThePlacement) {
  CompileCommandOptions options;
  options.schedule = "1f1b";
  options.stages = 2;
  options.microbatches = 4;
  options.layers = 4;
  options.layers_per_stage = "3,1";
  const sched::Schedule schedule = build_schedule(options);
  EXPECT_EQ(schedule.params.layers_per_chunk, (std::vector<int>{3, 1}));
  EXPECT_EQ(schedule.placement.at(0, 0).num_layers, 3);
  EXPECT_EQ(schedule.placement.at(0, 1).first_layer, 3);
  EXPECT_NE(summarize(schedule).find("w1: c1[layers 3..3, head]"), std::string::npos)
      << summarize(schedule);
  options.schedule_file = "unused.json";
  EXPECT_THROW(build_schedule(options), std::invalid_argument);
}

TEST(Program, HelpDocumentsEveryFlag) {
  const RunResult r = run("--help");
  EXPECT_EQ(r.status, 0);
  for (const char* flag : {"--schedule", "--stages", "--microbatches", "--chunks", "--layers",
                           "--data-parallel", "--split-backward", "--schedule-file", "--out",
                           "--csv", "--trace", "--grid", "--layers-per-stage"}) {
    EXPECT_NE(r.out.find(flag), std::string::npos) << flag;
  }
}

TEST(Program, BadInputIsOneErrorLineAndExitCodeTwo) {
  for (const char* arguments :
       {"--schedule interleaved --stages 4 --microbatches 6 --chunks 2",
        "--schedule chimera --stages 3 --microbatches 6", "--schedule nope", "--stages abc",
        "--schedule 1f1b --stages 0", "--schedule-file /nonexistent.json",
        "--schedule gpipe --stages 4 --layers 2", "--unknown-flag",
        // Zero-bubble options (issue #16: every option's refusal is exit 2, one line).
        "--schedule zbh1 --stages 4 --microbatches 8 --max-in-flight 99",
        "--schedule zbh2 --stages 4 --microbatches 8 --max-in-flight -1",
        "--schedule zbv --stages 4 --microbatches 8 --chunks 3",
        "--schedule 1f1b --stages 4 --microbatches 8 --max-in-flight 4",
        "--schedule zbh1 --max-in-flight 99999999999",
        // Uneven layers per stage: wrong count, a zero, a wrong sum, not a number.
        "--stages 2 --layers 4 --layers-per-stage 1,1,2",
        "--stages 2 --layers 4 --layers-per-stage 4,0",
        "--stages 2 --layers 4 --layers-per-stage 2,1", "--stages 2 --layers-per-stage 3,x"}) {
    const RunResult r = run(arguments);
    EXPECT_EQ(r.status, 2) << arguments;
    EXPECT_EQ(r.err.rfind("pipefisher_sim: error: ", 0), 0u) << arguments << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << arguments << ": " << r.err;
  }
}

TEST(Program, BadListsNameTheFlagTheItemAndItsPosition) {
  // One comma-list parser (common/comma_list.h) behind --layers-per-stage and search's lists.
  for (const auto& [arguments, message] : std::vector<std::pair<std::string, std::string>>{
           {"--stages 2 --layers-per-stage 3,x",
            "--layers-per-stage '3,x': item 2 'x' is not a positive integer"},
           {"--stages 2 --layers 4 --layers-per-stage 4,0",
            "--layers-per-stage '4,0': item 2 '0' is not a positive integer"},
           {"search --model base --gpus 8 --global-batch 8 --micro-batch-sizes 1,,4",
            "--micro-batch-sizes '1,,4': item 2 is empty"},
           {"search --model base --gpus 8 --global-batch 8 --stages 2,-4",
            "--stages '2,-4': item 2 '-4' is not a positive integer"},
           {"search --model base --gpus 8 --global-batch 8 --tensor-parallel 99999999999",
            "--tensor-parallel '99999999999': item 1 '99999999999' exceeds 2147483647"}}) {
    const RunResult r = run(arguments);
    EXPECT_EQ(r.status, 2) << arguments;
    EXPECT_EQ(r.err, "pipefisher_sim: error: " + message + "\n") << arguments;
  }
}

TEST(Program, HostileFilesAreOneErrorLineAndExitCodeTwo) {
  // Not temp_dir(): run() removes that one after each run.
  const fs::path dir =
      fs::temp_directory_path() / ("pf_cli_hostile_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  // 100000 nested arrays overflowed the stack when the error quoted the value (exit 139).
  const fs::path device = dir / "deep-device.json";
  std::ofstream(device) << R"({"name": "deep", "peak_flops": )" << std::string(100000, '[')
                        << std::string(100000, ']') << "}";
  const fs::path measurements = dir / "many-inversions.json";
  std::ofstream(measurements) << R"({"format_version": 1, "measurements": [{"operation": )"
                              << R"("cholesky_inverse", "order": 64, "count": 1048576, )"
                              << R"("seconds": 1}]})";
  for (const std::string& arguments :
       {"--schedule 1f1b --stages 2 --microbatches 2 --model base --device " + device.string(),
        "calibrate --measurements " + measurements.string() + " --device h100 --no-fit"}) {
    const RunResult r = run(arguments);
    EXPECT_EQ(r.status, 2) << arguments << ": " << r.err;
    EXPECT_EQ(r.err.rfind("pipefisher_sim: error: ", 0), 0u) << arguments << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << arguments << ": " << r.err;
  }
  fs::remove_all(dir);
}

// K-FAC offload (docs/offload.md): its flags' refusals, and a run that reports and traces it.
TEST(Program, KfacOffloadRefusalsAndReport) {
  for (const char* arguments :
       {"--schedule 1f1b --stages 2 --microbatches 4 --model base --kfac --kfac-offload disk",
        "--schedule 1f1b --stages 2 --microbatches 4 --model base --kfac --kfac-offload auto",
        "--schedule 1f1b --stages 2 --microbatches 4 --model base --kfac-offload host",
        "--schedule 1f1b --stages 2 --microbatches 4 --model base --kfac --kfac-offload host "
        "--device-memory-budget -1",
        "--schedule 1f1b --stages 2 --microbatches 4 --model base --kfac --kfac-offload host "
        "--kfac-offload-copies sideways"}) {
    const RunResult r = run(arguments);
    EXPECT_EQ(r.status, 2) << arguments;
    EXPECT_EQ(r.err.rfind("pipefisher_sim: error: ", 0), 0u) << arguments << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << arguments << ": " << r.err;
  }
  const fs::path dir =
      fs::temp_directory_path() / ("pf_cli_offload_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const RunResult r =
      run("--schedule 1f1b --stages 4 --microbatches 16 --model large --kfac "
          "--grid none --kfac-offload host --trace " +
          (dir / "t.json").string() + " --out " + (dir / "s.json").string());
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("K-FAC offload (host)"), std::string::npos) << r.out;
  const sched::Schedule s = sched::load_schedule_json((dir / "s.json").string());
  std::size_t copies = 0;
  for (const auto& stream : s.streams) {
    for (const auto& in : stream) copies += sched::is_kfac_transfer(in.kind) ? 1 : 0;
  }
  EXPECT_GT(copies, 0U);
  EXPECT_NE(read(dir / "t.json").find("host link"), std::string::npos);
  fs::remove_all(dir);
}

// The BERT-Large micro-batch-8 node case (below): before factors-only offload, no whole-Linear
// plan met a budget of 2900 MiB there (offloading raised the peak: write-backs queued behind the
// next steps' inverse prefetches while the factors' windows stayed open), and auto kept the
// plan with the lowest peak, nothing offloaded.
double offload_peak_after(const std::string& out) {
  const auto at = out.find("peak device memory ");
  const auto arrow = out.find("-> ", at);
  return at == std::string::npos || arrow == std::string::npos ? -1.0
                                                               : std::stod(out.substr(arrow + 3));
}
double offload_peak_before(const std::string& out) {
  const auto at = out.find("peak device memory ");
  return at == std::string::npos ? -1.0 : std::stod(out.substr(at + 19));
}
double offload_step_after(const std::string& out) {
  const auto at = out.find("copies per refresh; step time ");
  const auto arrow = out.find("-> ", at);
  return at == std::string::npos || arrow == std::string::npos ? -1.0
                                                               : std::stod(out.substr(arrow + 3));
}
const char* const kMicroBatch8Node =
    "--model large --seq-len 128 --micro-batch-size 8 --precision bf16 --cluster dgx-h100 "
    "--schedule 1f1b -p 8 -m 8 --grid none --kfac ";

// BERT-Large at micro-batch 8 on a DGX H100 node (docs/offload.md, "Predicted at 8 and 64
// GPUs"): every step's inverse prefetches saturate the host link, so offloading whole Linears
// (host) costs step time and raises the peak; offloading their factors only (moved once per
// refresh, the inverses on the device) costs about nothing and lowers the peak, and auto, which
// offloads factors first, meets a budget of 3400 MiB that no whole-Linear plan met.
TEST(Program, KfacOffloadFactorsOnlyOnTheMicroBatch8Node) {
  const std::string config = kMicroBatch8Node;
  const RunResult host = run(config + "--kfac-offload host");
  ASSERT_EQ(host.status, 0) << host.err;
  const RunResult factors = run(config + "--kfac-offload factors");
  ASSERT_EQ(factors.status, 0) << factors.err;
  EXPECT_NE(factors.out.find("144 Linears offloaded (0 whole, 144 factors only)"),
            std::string::npos)
      << factors.out;
  const double step_before = [&] {
    const auto at = factors.out.find("copies per refresh; step time ");
    return std::stod(factors.out.substr(at + 30));
  }();
  EXPECT_GT(offload_step_after(host.out), 1.5 * step_before) << host.out;
  EXPECT_LT(offload_step_after(factors.out), 1.01 * step_before) << factors.out;
  EXPECT_LT(offload_step_after(factors.out), 0.7 * offload_step_after(host.out));
  EXPECT_GT(offload_peak_after(host.out), offload_peak_before(host.out)) << host.out;
  EXPECT_LT(offload_peak_after(factors.out), offload_peak_before(factors.out) - 200.0)
      << factors.out;
  const RunResult automatic = run(config + "--kfac-offload auto --device-memory-budget 3400");
  ASSERT_EQ(automatic.status, 0) << automatic.err;
  EXPECT_LE(offload_peak_after(automatic.out), 3400.0) << automatic.out;
  EXPECT_EQ((automatic.out + automatic.err).find("not met"), std::string::npos) << automatic.out;
  EXPECT_NE(automatic.out.find("(0 whole, "), std::string::npos) << automatic.out;
  EXPECT_LT(offload_step_after(automatic.out), 1.01 * step_before) << automatic.out;
}

// A write-back waits for its inversion; inserted right after it, it held up the instruction
// behind it in the stream, even one on another lane that ran beside the inversion (a curvature
// sync on the collective lane): 64 GPUs in Megatron's order cost +7.6% with factors only. A
// write-back now goes where the instruction behind it starts after its data is ready.
TEST(Program, KfacOffloadWriteBacksDoNotHoldUpWorkBesideTheirInversion) {
  const RunResult factors = run(std::string(kMicroBatch8Node) +
                                "--data-parallel 8 --rank-order megatron --kfac-offload factors");
  ASSERT_EQ(factors.status, 0) << factors.err;
  const auto at = factors.out.find("copies per refresh; step time ");
  ASSERT_NE(at, std::string::npos) << factors.out;
  const double step_before = std::stod(factors.out.substr(at + 30));
  EXPECT_LT(offload_step_after(factors.out), 1.001 * step_before) << factors.out;
}

// A budget no plan meets: auto keeps the plan it tried with the lowest simulated peak (it tries
// every Linear's factors offloaded before any whole Linear, so that plan's peak at most), and
// warns.
TEST(Program, KfacOffloadAutoKeepsTheLowestPeakWhenTheBudgetIsNeverMet) {
  const std::string config = std::string(kMicroBatch8Node) + "--kfac-offload ";
  const RunResult factors = run(config + "factors");
  ASSERT_EQ(factors.status, 0) << factors.err;
  const RunResult automatic = run(config + "auto --device-memory-budget 2000");
  ASSERT_EQ(automatic.status, 0) << automatic.err;
  EXPECT_LE(offload_peak_after(automatic.out), offload_peak_after(factors.out)) << automatic.out;
  EXPECT_LT(offload_peak_after(automatic.out), offload_peak_before(automatic.out)) << automatic.out;
  const std::string both = automatic.out + automatic.err;
  EXPECT_NE(both.find("is not met in the simulation"), std::string::npos) << both;
  EXPECT_NE(both.find("kept the plan with the lowest peak of those tried"), std::string::npos)
      << both;
}

// The offload pass places the copies two ways and keeps the better (docs/offload.md, "Placing
// the copies"): BERT-Large at micro-batch 8 on an H100 node, where the host link sets the step,
// the prefetches placed backwards from their consumers give the shorter step; best keeps it.
TEST(Program, KfacOffloadCopiesArePlacedBothWaysAndTheBetterKept) {
  const std::string config =
      "--model large --seq-len 128 --micro-batch-size 8 --precision bf16 --cluster dgx-h100 "
      "--schedule 1f1b -p 8 -m 8 --grid none --kfac --kfac-offload host --kfac-offload-copies ";
  const auto step_after = [](const std::string& out) {
    const auto at = out.find("copies per refresh; step time ");
    const auto arrow = out.find("-> ", at);
    return at == std::string::npos || arrow == std::string::npos ? -1.0
                                                                 : std::stod(out.substr(arrow + 3));
  };
  std::map<std::string, double> step;
  for (const char* order : {"by-deadline", "prefetches-latest-first", "best"}) {
    const RunResult r = run(config + order);
    ASSERT_EQ(r.status, 0) << order << ": " << r.err;
    step[order] = step_after(r.out);
    ASSERT_GT(step[order], 0.0) << r.out;
    const std::string placed = std::string("copies placed ") +
                               (std::string(order) == "best" ? "prefetches-latest-first" : order);
    EXPECT_NE(r.out.find(placed), std::string::npos) << order << ": " << r.out;
  }
  EXPECT_LT(step["prefetches-latest-first"], 0.8 * step["by-deadline"]);
  EXPECT_EQ(step["best"], step["prefetches-latest-first"]);
}

// K-FAC offload together with K-FAC state sharded across data-parallel replicas, and with a
// pipelined refresh (which runs inversions, and their offload copies, in the next window).
TEST(Program, KfacOffloadWithShardingAndAPipelinedRefresh) {
  const fs::path dir =
      fs::temp_directory_path() / ("pf_cli_offload_combined_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const auto count = [](const sched::Schedule& s, auto&& match) {
    std::size_t n = 0;
    for (const auto& stream : s.streams) {
      for (const auto& in : stream) n += match(in) ? 1 : 0;
    }
    return n;
  };
  {
    const RunResult r =
        run("--schedule 1f1b --stages 2 --microbatches 4 --model base --kfac "
            "--data-parallel 2 --kfac-sharding shard --kfac-offload host "
            "--grid none --out " +
            (dir / "sharded.json").string());
    EXPECT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("K-FAC offload (host)"), std::string::npos) << r.out;
    const auto s = sched::load_schedule_json((dir / "sharded.json").string());
    EXPECT_GT(count(s, [](const auto& in) { return sched::is_kfac_transfer(in.kind); }), 0U);
    EXPECT_GT(count(s, [](const auto& in) { return in.kind == sched::OpKind::kBroadcastGradient; }),
              0U);
  }
  {
    const RunResult r =
        run("--schedule chimera --stages 4 --microbatches 4 --model mini "
            "--device p100 --precision fp32 --kfac --kfac-pipelined-refresh on "
            "--kfac-offload host --grid none --out " +
            (dir / "pipelined.json").string());
    EXPECT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("K-FAC offload (host)"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("pipelined refresh"), std::string::npos) << r.out;
    const auto s = sched::load_schedule_json((dir / "pipelined.json").string());
    EXPECT_TRUE(s.kfac_pipelined_refresh);
    EXPECT_GT(count(s,
                    [](const auto& in) {
                      return sched::is_kfac_transfer(in.kind) && sched::is_wrapped(in);
                    }),
              0U);
  }
  fs::remove_all(dir);
}

TEST(Program, CompilesAndPrints) {
  const RunResult r = run("--schedule chimera --stages 4 --microbatches 4");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("2 pipeline(s)"), std::string::npos);
  EXPECT_TRUE(r.err.empty()) << r.err;
}

}  // namespace
}  // namespace pf::cli
