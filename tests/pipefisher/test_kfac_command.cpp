// The --kfac flags: parsing into KfacOptions, and the printed report.
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <sstream>

#include "scheduler/compile.h"
#include "scheduler/pipefisher/kfac_command.h"
#include "scheduler/pipefisher/report_json.h"
#include "sim/uniform_cost_model.h"

namespace pf::pipefisher {
namespace {

KfacCommandOptions parse(std::vector<std::string> args) {
  CLI::App app;
  KfacCommandOptions options;
  add_kfac_options(app, options);
  std::vector<const char*> argv = {"pipefisher_sim"};
  for (const auto& arg : args) argv.push_back(arg.c_str());
  app.parse(static_cast<int>(argv.size()), argv.data());
  return options;
}

TEST(KfacCommand, FlagsBecomeOptions) {
  const auto command =
      parse({"--kfac", "--kfac-policy", "first_fit", "--kfac-margin", "0.1", "--kfac-refresh", "3",
             "--kfac-curvature", "every_step", "--kfac-linears", "query,ffn_out", "--kfac-layers",
             "0-2,5", "--kfac-move-w", "on"});
  EXPECT_TRUE(command.enabled);
  const auto options = to_kfac_options(command);
  EXPECT_EQ(options.policy, PackingPolicy::kFirstFit);
  EXPECT_DOUBLE_EQ(options.safety_margin, 0.1);
  EXPECT_EQ(options.refresh_steps, 3);
  EXPECT_EQ(options.curvature, CurvatureSource::kEveryStep);
  EXPECT_EQ(options.linears, (std::vector<sched::LinearKind>{sched::LinearKind::kQuery,
                                                             sched::LinearKind::kFfnOut}));
  EXPECT_EQ(options.layers, (std::vector<int>{0, 1, 2, 5}));
  EXPECT_TRUE(options.move_weights);
  EXPECT_TRUE(to_kfac_options(parse({"--kfac-pipelined-refresh", "on"})).pipelined_refresh);
  EXPECT_DOUBLE_EQ(to_kfac_options(parse({"--kfac-spill-budget", "0.02"})).spill_budget, 0.02);
  const auto defaults = to_kfac_options(parse({}));
  EXPECT_EQ(defaults.spill_budget, 0.0);
  EXPECT_FALSE(defaults.move_weights);
  EXPECT_FALSE(defaults.pipelined_refresh);
  EXPECT_DOUBLE_EQ(defaults.min_piece_overheads, 2.0);
  EXPECT_EQ(defaults.policy, PackingPolicy::kBestOfBoth);
  EXPECT_EQ(defaults.linears.size(), 6u);
  EXPECT_TRUE(defaults.layers.empty());
}

TEST(KfacCommand, BadValuesAreNamed) {
  EXPECT_THROW(parse({"--kfac-policy", "worst_fit"}), CLI::ValidationError);
  EXPECT_THROW(parse({"--kfac-refresh", "-1"}), CLI::ValidationError);
  EXPECT_THROW(parse({"--kfac-move-w", "maybe"}), CLI::ValidationError);
  EXPECT_THROW(parse({"--kfac-pipelined-refresh", "yes"}), CLI::ValidationError);
  EXPECT_THROW(parse({"--kfac-spill-budget", "2"}), CLI::ValidationError);
  // The refresh's curvature must come from its first step.
  EXPECT_THROW(
      to_kfac_options(parse({"--kfac-pipelined-refresh", "on", "--kfac-curvature", "every_step"})),
      std::invalid_argument);
  KfacCommandOptions command;
  command.linears = "query,mlp";
  try {
    to_kfac_options(command);
    FAIL() << "no error";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("--kfac-linears: unknown Linear 'mlp'"),
              std::string::npos);
  }
  command = {};
  command.layers = "3-1";
  EXPECT_THROW(to_kfac_options(command), std::invalid_argument);
  command.layers = "x";
  EXPECT_THROW(to_kfac_options(command), std::invalid_argument);
  command.layers = "1,,2";
  EXPECT_THROW(to_kfac_options(command), std::invalid_argument);
}

TEST(KfacCommand, RunsThePassAndPrintsTheTable) {
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = 4;
  params.microbatches = 8;
  sim::UniformCosts costs;
  costs.curvature_a_s = costs.curvature_b_s = 0.01;
  costs.invert_a_s = costs.invert_b_s = 0.05;
  costs.precondition_s = 0.02;
  const sim::UniformCostModel model(costs);
  std::ostringstream out;
  const auto result = run_kfac_command(sched::compile(params), model, parse({"--kfac"}), out);
  const std::string text = out.str();
  EXPECT_NE(text.find("refresh interval k = " + std::to_string(result.report.refresh_steps)),
            std::string::npos);
  EXPECT_NE(text.find("utilization"), std::string::npos);
  EXPECT_EQ(to_json(result.report)["refresh_steps"], result.report.refresh_steps);
}

}  // namespace
}  // namespace pf::pipefisher
