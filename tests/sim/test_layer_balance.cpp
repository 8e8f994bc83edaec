// --layers-per-stage auto: the descent over layer moves (sim/layer_balance.h) and the command.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "sim/layer_balance.h"
#include "sim/sim_command.h"
#include "tests/sim/error_message.h"

namespace pf::sim {
namespace {

// A pipeline's step is bounded by its slowest chunk: chunk c costs layers x weight[c].
SplitEvaluation slowest_chunk(const std::vector<int>& layers, const std::vector<double>& weight) {
  SplitEvaluation e;
  for (std::size_t c = 0; c < layers.size(); ++c) {
    e.step_time_s = std::max(e.step_time_s, layers[c] * weight[c]);
  }
  return e;
}

TEST(LayerBalance, MovesLayersOffTheHeavyChunkUntilNoMoveHelps) {
  const std::vector<double> weight = {1.0, 1.0, 1.0, 3.0};  // the last chunk also runs the head
  int calls = 0;
  const LayerBalance balance = balance_layers({2, 2, 2, 2}, [&](const std::vector<int>& layers) {
    ++calls;
    return slowest_chunk(layers, weight);
  });
  EXPECT_EQ(balance.start.layers, (std::vector<int>{2, 2, 2, 2}));
  EXPECT_DOUBLE_EQ(balance.start.step_time_s, 6.0);
  // 8 layers, the last chunk at least one (3): the best possible max is 3.
  EXPECT_DOUBLE_EQ(balance.best.step_time_s, 3.0);
  EXPECT_EQ(balance.best.layers.back(), 1);
  int total = 0;
  for (int l : balance.best.layers) total += l;
  EXPECT_EQ(total, 8);
  // Every split is simulated once, and listed fastest first.
  EXPECT_EQ(calls, static_cast<int>(balance.evaluated.size()));
  EXPECT_TRUE(
      std::is_sorted(balance.evaluated.begin(), balance.evaluated.end(),
                     [](const auto& a, const auto& b) { return a.step_time_s < b.step_time_s; }));
  EXPECT_DOUBLE_EQ(balance.evaluated.front().step_time_s, 3.0);
}

TEST(LayerBalance, KeepsTheStartWhenNothingIsFasterAndSkipsSplitsThatDoNotFit) {
  const LayerBalance even = balance_layers({3, 3}, [](const std::vector<int>& layers) {
    return slowest_chunk(layers, {1.0, 1.0});
  });
  EXPECT_EQ(even.best.layers, (std::vector<int>{3, 3}));
  EXPECT_EQ(even.evaluated.size(), 3U);  // 3,3 and its two neighbours
  // A split whose memory overflows (infinite time) is never chosen, even when it would be fast.
  const LayerBalance fits = balance_layers({2, 2}, [](const std::vector<int>& layers) {
    SplitEvaluation e = slowest_chunk(layers, {1.0, 4.0});
    if (layers[0] == 3) e.step_time_s = std::numeric_limits<double>::infinity();
    return e;
  });
  EXPECT_EQ(fits.best.layers, (std::vector<int>{2, 2}));
  EXPECT_NE(layer_balance_table(fits).find("does not fit"), std::string::npos);
}

TEST(LayerBalance, RefusesAStartWithAnEmptyChunk) {
  const auto evaluate = [](const std::vector<int>& layers) {
    return slowest_chunk(layers, std::vector<double>(layers.size(), 1.0));
  };
  EXPECT_NE(test::error_of([&] { balance_layers({}, evaluate); }).find("no chunk"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] {
              balance_layers({2, 0}, evaluate);
            }).find("2,0"),
            std::string::npos);
}

}  // namespace
}  // namespace pf::sim

namespace pf::cli {
namespace {

namespace fs = std::filesystem;

struct SimRun {
  int code = 0;
  std::string text;
  nlohmann::json report;
};

// pipefisher_sim with these flags (and --grid none --report FILE).
SimRun run(std::vector<std::string> args) {
  CompileCommandOptions compile;
  SimCommandOptions options;
  pipefisher::KfacCommandOptions kfac;
  CLI::App app;
  add_compile_options(app, compile);
  add_sim_options(app, options);
  pipefisher::add_kfac_options(app, kfac);
  const fs::path report =
      fs::temp_directory_path() / ("pf_layer_balance_" + std::to_string(::getpid()) + ".json");
  args.insert(args.begin(), "pipefisher_sim");
  for (const char* a : {"--grid", "none", "--report"}) args.emplace_back(a);
  args.push_back(report.string());
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  app.parse(static_cast<int>(argv.size()), argv.data());
  SimRun r;
  std::ostringstream out;
  r.code = run_sim_command(compile, options, out, kfac);
  r.text = out.str();
  std::ifstream in(report);
  r.report = nlohmann::json::parse(in);
  fs::remove(report);
  return r;
}

const std::vector<std::string> kMini = {"--schedule", "1f1b", "-p",      "2",
                                        "-m",         "8",    "--model", "mini"};

std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

// BERT-mini's last stage also runs the 30 522-wide decoder: auto moves a layer off it, and the
// run it simulates is the chosen split's, faster than the balanced one.
TEST(LayerBalanceCommand, AutoSimulatesTheFastestSplitItFound) {
  const SimRun automatic = run(with(kMini, {"--layers-per-stage", "auto"}));
  const SimRun balanced = run(with(kMini, {"--layers-per-stage", "2,2"}));
  const SimRun moved = run(with(kMini, {"--layers-per-stage", "3,1"}));
  ASSERT_EQ(automatic.code, 0);
  EXPECT_NE(automatic.text.find("--layers-per-stage auto: 3 splits tried from the balanced 2,2"),
            std::string::npos)
      << automatic.text;
  EXPECT_NE(automatic.text.find("3,1"), std::string::npos);
  EXPECT_NE(automatic.text.find("<- chosen"), std::string::npos);
  const double step = automatic.report["step_time_s"].get<double>();
  EXPECT_DOUBLE_EQ(step, moved.report["step_time_s"].get<double>());
  EXPECT_LT(step, balanced.report["step_time_s"].get<double>());
}

// With --kfac the objective is the step after the PipeFisher pass, and the table shows the
// refresh interval of each split.
TEST(LayerBalanceCommand, WithKfacTheStepAfterThePassDecides) {
  const SimRun automatic = run(with(kMini, {"--layers-per-stage", "auto", "--kfac"}));
  ASSERT_EQ(automatic.code, 0);
  EXPECT_NE(automatic.text.find("K-FAC refresh"), std::string::npos) << automatic.text;
  double best_after = std::numeric_limits<double>::infinity();
  for (const char* split : {"2,2", "3,1", "1,3"}) {
    const SimRun r = run(with(kMini, {"--layers-per-stage", split, "--kfac"}));
    best_after = std::min(best_after, r.report["with_kfac"]["step_time_s"].get<double>());
  }
  EXPECT_DOUBLE_EQ(automatic.report["with_kfac"]["step_time_s"].get<double>(), best_after);
}

TEST(LayerBalanceCommand, AutoNeedsACostModelAndOneSchedule) {
  const auto error = [](std::vector<std::string> args) {
    return sim::test::error_of([&] { run(std::move(args)); });
  };
  EXPECT_NE(error({"--schedule", "1f1b", "-p", "2", "--layers-per-stage", "auto"})
                .find("--layers-per-stage auto picks the split by simulating it: give --model"),
            std::string::npos);
  EXPECT_NE(error({"--schedule", "all", "-p", "2", "--model", "mini", "--layers-per-stage", "auto"})
                .find("pick one instead of --schedule all"),
            std::string::npos);
}

}  // namespace
}  // namespace pf::cli
