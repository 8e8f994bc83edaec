// pipefisher_train: the training loop's outputs (progress, metrics, summary, trace, profile that
// the simulator replays), --kfac on a self-profile, and the program's refusals (exit status 2).
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "runtime/device/device_runtime.h"
#include "runtime/device/host_device_runtime.h"
#include "runtime/model/bert_config.h"
#include "runtime/optim/lamb.h"
#include "runtime/train/self_profile.h"
#include "runtime/train/train_options.h"
#include "runtime/train/trainer.h"
#include "scheduler/schedule_json.h"
#include "sim/calibration.h"
#include "sim/cli/compile_command.h"
#include "sim/measured_cost_model.h"
#include "sim/simulator.h"
#include "tests/executor/host_device_launch.h"
#include "tests/executor/offload_plan.h"

namespace pf::train {
namespace {

namespace fs = std::filesystem;

class TrainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("pf_train_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
    // A small model keeps the test fast: 2 layers, hidden 16, a vocabulary of 64.
    std::ofstream(dir_ / "config.json") << R"({"vocab_size": 64, "hidden_size": 16,
      "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32,
      "max_position_embeddings": 32, "type_vocab_size": 2, "hidden_dropout_prob": 0.1,
      "attention_probs_dropout_prob": 0.1, "model_type": "bert"})";
  }
  void TearDown() override { fs::remove_all(dir_); }

  TrainOptions small_run() const {
    TrainOptions o;
    o.model = (dir_ / "config.json").string();
    o.data = "synthetic";
    o.seq_len = 12;
    o.micro_batch_size = 2;
    o.stages = 2;
    o.microbatches = 4;
    o.steps = 3;
    o.wait_timeout_s = 60;
    return o;
  }

  fs::path dir_;
};

// run_training(o) throws std::invalid_argument naming `fragment`, before any step.
void expect_refused(const TrainOptions& o, const std::string& fragment) {
  std::ostringstream out;
  try {
    run_training(o, out);
    ADD_FAILURE() << "accepted; expected an error containing '" << fragment << "'";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
  }
  EXPECT_EQ(out.str().find("step "), std::string::npos) << "training started";
}

// The numbers of the summary line that starts with `prefix`, after it, in order ("rank 0 12 B,
// rank 1 34 B" gives 0, 12, 1, 34); empty when no line starts so. (No std::regex: g++ 12 warns
// inside it under the sanitizers' -O1, and warnings are errors.)
std::vector<double> numbers_of_line(const std::string& text, const std::string& prefix) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(prefix, 0) != 0) continue;
    std::vector<double> numbers;
    std::string digits;
    for (const char c : line.substr(prefix.size()) + " ") {
      if (c >= '0' && c <= '9') {
        digits += c;
      } else if (!digits.empty()) {
        numbers.push_back(std::stod(digits));
        digits.clear();
      }
    }
    return numbers;
  }
  return {};
}

std::string read(const fs::path& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The (loss, gradient norm) of each step record of a metrics file, in order.
std::vector<std::pair<double, double>> step_records(const fs::path& metrics) {
  std::vector<std::pair<double, double>> steps;
  std::istringstream text(read(metrics));
  for (std::string line; std::getline(text, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record.value("kind", std::string("step")) != "step") continue;
    steps.emplace_back(record.at("loss").get<double>(), record.at("grad_norm").get<double>());
  }
  return steps;
}

// The two runs --kfac-warmup-steps W stands for: `o` with a refresh every step (not
// pipelined) for W steps, then --resume --kfac-replan with `o`'s flags; the step records of
// both, in order, and the second's output. Checkpoints in dir/ckpt.
std::pair<std::vector<std::pair<double, double>>, std::string> warmup_as_two_runs(
    const TrainOptions& o, std::int64_t warmup, const fs::path& dir) {
  auto first = o;
  first.kfac.refresh_steps = 1;
  first.kfac.pipelined_refresh = "off";
  first.steps = warmup;
  first.lr_decay_steps = o.steps;
  first.checkpoint_dir = (dir / "ckpt").string();
  first.metrics = (dir / "first.jsonl").string();
  std::ostringstream first_out;
  EXPECT_EQ(run_training(first, first_out), 0) << first_out.str();
  auto rest = o;
  rest.resume = true;
  rest.kfac_replan = true;
  rest.checkpoint_dir = first.checkpoint_dir;
  rest.metrics = (dir / "rest.jsonl").string();
  std::ostringstream rest_out;
  EXPECT_EQ(run_training(rest, rest_out), 0) << rest_out.str();
  auto records = step_records(first.metrics);
  const auto after = step_records(rest.metrics);
  records.insert(records.end(), after.begin(), after.end());
  return {std::move(records), rest_out.str()};
}

TEST_F(TrainTest, WritesMetricsTraceProfileAndSummary) {
  auto o = small_run();
  o.metrics = (dir_ / "m.jsonl").string();
  o.trace = (dir_ / "t.json").string();
  o.profile_out = (dir_ / "p.json").string();
  std::ostringstream out;
  ASSERT_EQ(run_training(o, out), 0);
  const std::string text = out.str();
  EXPECT_NE(text.find("step     3/3  loss"), std::string::npos) << text;
  EXPECT_NE(text.find("measured over steps 2-3"), std::string::npos) << text;
  EXPECT_NE(text.find("per rank (compute + K-FAC of the window): 0: "), std::string::npos) << text;
  EXPECT_NE(text.find("simulator replay of these durations"), std::string::npos) << text;

  std::istringstream lines(read(o.metrics));
  std::string line;
  int records = 0;
  while (std::getline(lines, line)) {
    const auto record = nlohmann::json::parse(line);
    EXPECT_EQ(record.at("step").get<int>(), ++records);
    for (const char* key : {"loss", "mlm_loss", "nsp_loss", "lr", "grad_norm", "step_time_s"}) {
      EXPECT_TRUE(record.at(key).is_number()) << key;
    }
    EXPECT_GT(record.at("loss").get<double>(), 0.0);
  }
  EXPECT_EQ(records, 3);

  const auto trace = nlohmann::json::parse(read(o.trace));
  EXPECT_GT(trace.at("traceEvents").size(), 20U);

  // The measured profile replays in the simulator on the same schedule.
  const auto profile = sim::profile_from_json_file(o.profile_out);
  cli::CompileCommandOptions compile;
  compile.schedule = "1f1b";
  compile.stages = 2;
  compile.microbatches = 4;
  compile.layers = 2;
  const auto replay =
      sim::simulate(cli::build_schedule(compile), sim::MeasuredCostModel(profile, "test"));
  EXPECT_GT(replay.step_time_s, 0.0);
  // The summary's memory lines, per rank, are what the replay holds: its static memory the
  // printed static bytes (the profile's static_bytes), its peak those plus the stash peak.
  // "stash arenas: peak rank 0 S0 B, rank 1 S1 B (...)" and "static memory (parameters +
  // gradients + optimizer state): rank 0 T0 B (P + G + O), rank 1 T1 B (P + G + O)".
  const auto stash = numbers_of_line(text, "stash arenas: peak");
  const auto statics =
      numbers_of_line(text, "static memory (parameters + gradients + optimizer state):");
  ASSERT_EQ(stash.size(), 4U) << text;
  ASSERT_EQ(statics.size(), 10U) << text;
  EXPECT_EQ(stash[0], 0.0);
  EXPECT_EQ(stash[2], 1.0);
  EXPECT_EQ(statics[0], 0.0);
  EXPECT_EQ(statics[5], 1.0);
  EXPECT_EQ(text.find("K-FAC state"), std::string::npos) << "no K-FAC in this run";
  for (std::size_t at : {1U, 6U}) {
    // The total is the sum of its parts; LAMB: two fp32 moments per fp32 parameter, and
    // gradients as large as the values.
    EXPECT_EQ(statics[at], statics[at + 1] + statics[at + 2] + statics[at + 3]);
    EXPECT_EQ(statics[at + 1], statics[at + 2]);
    EXPECT_EQ(statics[at + 3], 2.0 * statics[at + 1]);
  }
  for (int r = 0; r < 2; ++r) {
    const double static_bytes = statics[r == 0 ? 1 : 6];
    const double stash_bytes = stash[r == 0 ? 1 : 3];
    EXPECT_GT(static_bytes, 0.0);
    const auto& worker = replay.workers[static_cast<std::size_t>(r)];
    EXPECT_EQ(worker.static_memory_bytes, static_bytes) << "rank " << r;
    EXPECT_EQ(worker.peak_memory_bytes, static_bytes + stash_bytes) << "rank " << r;
  }
}

// --calibration-out: the run's mean durations as calibration records that pipefisher_sim
// calibrate reads: both chunks' forward and backward with their layers, the embeddings on the
// first and the heads on the last, and the optimizer step, tagged with the run.
TEST_F(TrainTest, CalibrationRecordsDescribeTheRunsChunks) {
  auto o = small_run();
  o.calibration_out = (dir_ / "c.json").string();
  std::ostringstream out;
  ASSERT_EQ(run_training(o, out), 0);
  EXPECT_NE(out.str().find("calibration records: " + o.calibration_out), std::string::npos);
  const auto measurements =
      sim::measurements_from_json_file(o.calibration_out, sim::device_preset("h100"));
  ASSERT_EQ(measurements.size(), 5U);
  int chunks = 0;
  for (const auto& m : measurements) {
    EXPECT_GT(m.seconds, 0.0) << m.label;
    EXPECT_EQ(m.record.at("micro_batch_size"), 2) << m.label;
    EXPECT_EQ(m.record.at("seq_len"), 12) << m.label;
    EXPECT_EQ(m.record.at("stages"), 2) << m.label;
    EXPECT_EQ(m.record.at("statistic"), "mean") << m.label;
    // The CPU runs the batched attention: the records leave "attention" at its default (a fused
    // cuda run writes "fused", SimAttention.CalibrationRecordsCarryTheRunsAttention).
    EXPECT_FALSE(m.record.contains("attention")) << m.label;
    if (m.operation.rfind("chunk_", 0) != 0) continue;
    ++chunks;
    const bool first = m.record.at("chunk") == 0;
    EXPECT_EQ(m.record.at("layers"), 1) << m.label;
    EXPECT_EQ(m.record.at("embeddings"), first) << m.label;
    EXPECT_EQ(m.record.at("head"), !first) << m.label;
  }
  EXPECT_EQ(chunks, 4);
  // fp64 runs have no simulator rates: refused before training.
  o.precision = "fp64";
  std::ostringstream ignored;
  try {
    run_training(o, ignored);
    ADD_FAILURE() << "fp64 with --calibration-out ran";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("--calibration-out"), std::string::npos)
        << error.what();
  }
}

TEST_F(TrainTest, KfacRunsOnSelfProfile) {
  auto o = small_run();
  o.kfac.enabled = true;
  o.kfac.refresh_steps = 2;
  o.steps = 4;
  o.metrics = (dir_ / "m.jsonl").string();
  o.profile_out = (dir_ / "p.json").string();
  std::ostringstream out;
  ASSERT_EQ(run_training(o, out), 0);
  EXPECT_NE(out.str().find("PipeFisher: K-FAC refresh every 2 step(s)"), std::string::npos)
      << out.str();
  // The summary measures the refresh the pass planned: the first window, which preconditions
  // nothing before its inverses exist, is left out, and the line says so.
  EXPECT_NE(out.str().find("measured over steps 3-4: "), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("; steps 1-2 left out (the first K-FAC refresh window, before its "
                           "inverses)"),
            std::string::npos)
      << out.str();
  int refreshes = 0;
  std::istringstream lines(read(o.metrics));
  int statistics = 0;
  for (std::string line; std::getline(lines, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record.contains("kind")) {  // the K-FAC statistics at the end of the run
      EXPECT_EQ(record.at("kind"), "kfac");
      EXPECT_GE(record.at("refreshes_min").get<int>(), 1);
      ++statistics;
      continue;
    }
    refreshes += record.at("kfac_refresh").get<bool>() ? 1 : 0;
  }
  EXPECT_EQ(refreshes, 2);  // steps 2 and 4 end a refresh
  EXPECT_EQ(statistics, 1);
  // The K-FAC state per rank is printed, and the profile's K-FAC bytes are its Linears': rank r
  // holds layer r (2 layers on 2 stages).
  const std::string text = out.str();
  // "K-FAC state (each Linear at its largest): rank 0 N0 B, rank 1 N1 B"
  const auto printed = numbers_of_line(text, "K-FAC state (each Linear at its largest):");
  ASSERT_EQ(printed.size(), 4U) << text;
  const auto profile = sim::profile_from_json_file(o.profile_out);
  std::array<double, 2> per_layer{};
  for (const auto& entry : profile.kfac) {
    ASSERT_TRUE(entry.layer == 0 || entry.layer == 1) << entry.layer;
    EXPECT_GT(entry.bytes, 0.0) << entry.layer;
    per_layer[static_cast<std::size_t>(entry.layer)] += entry.bytes;
  }
  EXPECT_EQ(profile.kfac.size(), 12U);
  for (std::size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(per_layer[r], printed[2 * r + 1]) << "rank " << r;
  }
}

TEST_F(TrainTest, DoublePrecisionAndOtherSchedules) {
  for (const char* schedule : {"gpipe", "interleaved", "chimera"}) {
    auto o = small_run();
    o.schedule = schedule;
    o.precision = "fp64";
    o.steps = 2;
    if (o.schedule == "interleaved") {
      o.stages = 1;
      o.chunks = 2;
    }
    std::ostringstream out;
    EXPECT_EQ(run_training(o, out), 0) << schedule;
  }
}

// --shared-processor: off plans a processor per worker, C that capacity (also in the profile the
// pass used); anything else is refused before any work.
TEST_F(TrainTest, SharedProcessorFlagSetsThePassCapacity) {
  auto o = small_run();
  o.kfac.enabled = true;
  o.kfac.refresh_steps = 2;
  o.steps = 2;
  o.kfac_profile_out = (dir_ / "kfac_profile.json").string();
  const auto run = [&](const std::string& shared) {
    o.shared_processor = shared;
    std::ostringstream out;
    EXPECT_EQ(run_training(o, out), 0) << shared;
    return out.str();
  };
  const std::string off = run("off");
  EXPECT_NE(off.find("PipeFisher: K-FAC refresh every"), std::string::npos) << off;
  EXPECT_EQ(off.find("share the cores"), std::string::npos) << off;
  EXPECT_EQ(sim::profile_from_json_file(o.kfac_profile_out).shared_processor_capacity, 0.0);
  const std::string fixed = run("1.5");
  EXPECT_NE(fixed.find("the workers share the cores, capacity 1.50)"), std::string::npos) << fixed;
  EXPECT_EQ(sim::profile_from_json_file(o.kfac_profile_out).shared_processor_capacity, 1.5);
  // Two data-parallel replicas on the same cores: the simulated replica has half of it, in the
  // profile too; measured, between a quarter and a half of the 4 ranks.
  o.data_parallel = 2;
  const std::string replicated = run("1.5");
  EXPECT_NE(replicated.find("capacity 1.50 (0.75 per replica)"), std::string::npos) << replicated;
  EXPECT_EQ(sim::profile_from_json_file(o.kfac_profile_out).shared_processor_capacity, 0.75);
  (void)run("auto");
  const double measured = sim::profile_from_json_file(o.kfac_profile_out).shared_processor_capacity;
  EXPECT_GE(measured, 0.5);
  EXPECT_LE(measured, 2.0);
  // The 4 ranks' kernels are timed from their common start: on fewer cores than ranks they
  // cannot measure more throughput than the cores have (timed from each thread's own start, 4
  // threads on 2 cores gave 3.7), within the noise of a shared machine.
  const double cores = std::min(4.0, static_cast<double>(std::thread::hardware_concurrency()));
  EXPECT_LE(2.0 * measured, 1.25 * cores);
  o.data_parallel = 1;
  for (const std::string bad : {"0.5", "fast", "1.5x", "nan", ""}) {
    o.shared_processor = bad;
    std::ostringstream out;
    try {
      run_training(o, out);
      ADD_FAILURE() << "accepted --shared-processor '" << bad << "'";
    } catch (const std::invalid_argument& error) {
      EXPECT_NE(std::string(error.what()).find("--shared-processor: '" + bad + "'"),
                std::string::npos)
          << error.what();
    }
  }
  EXPECT_EQ(shared_processor_choice("auto").measure, true);
  EXPECT_EQ(shared_processor_choice("2").capacity, 2.0);
}

// Ranks on several machines (as MpiLaunch reports them under mpirun): the pass plans a processor
// per machine, each with the simulated replica's share of its cores.
class TwoMachineLaunch final : public Launch {
 public:
  explicit TwoMachineLaunch(std::vector<int> machines) : machines_(std::move(machines)) {}
  std::vector<int> machine_of_rank() const override { return machines_; }

 private:
  std::vector<int> machines_;
};

TEST_F(TrainTest, RanksOnSeveralMachinesShareEachMachinesCores) {
  auto o = small_run();
  o.kfac.enabled = true;
  o.kfac.refresh_steps = 2;
  o.steps = 2;
  o.shared_processor = "1.5";
  const auto run = [&](std::vector<int> machines) {
    TwoMachineLaunch launch(std::move(machines));
    std::ostringstream out;
    EXPECT_EQ(run_training(o, out, launch), 0);
    return out.str();
  };
  // A stage per machine: each worker has its machine's cores alone.
  const std::string stages = run({0, 1});
  EXPECT_NE(stages.find("the ranks span 2 machines, each machine's cores shared by its ranks: "
                        "capacity 1.50 each, a replica's share 1.50, 1.50)"),
            std::string::npos)
      << stages;
  // Two replicas, rank r on machine r % 2: each worker shares its machine with the other
  // replica's rank of the same stage.
  o.data_parallel = 2;
  o.kfac_profile_out = (dir_ / "kfac_profile.json").string();
  const std::string spread = run({0, 1, 0, 1});
  EXPECT_NE(spread.find("capacity 1.50 each, a replica's share 0.75, 0.75)"), std::string::npos)
      << spread;
  // The profile the pass used says so, for pipefisher_sim --profile to simulate the same.
  const auto written = sim::profile_from_json_file(o.kfac_profile_out);
  EXPECT_EQ(written.shared_processor_machines, (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(sim::shared_processors_of(written).processor_capacity,
            (std::vector<double>{0.75, 0.75}));
  o.kfac_profile_out.clear();
  // A replica per machine: replica 0 has machine 0 to itself, one processor for both stages.
  const std::string replicas = run({0, 0, 1, 1});
  EXPECT_NE(replicas.find("capacity 1.50 each, a replica's share 1.50)"), std::string::npos)
      << replicas;
  // --shared-processor off: a processor per worker wherever the ranks are.
  o.shared_processor = "off";
  EXPECT_NE(run({0, 1, 0, 1}).find("the ranks span several machines, no shared processor"),
            std::string::npos);
}

TEST_F(TrainTest, RefusesImpossibleRunsBeforeAnyWork) {
  auto o = small_run();
  o.data = (dir_ / "missing").string();
  expect_refused(o, "not a directory of shards");
  o = small_run();
  o.stages = 4;  // 4 chunks for 2 layers
  expect_refused(o, "layers");
  o = small_run();
  o.precision = "fp64";
  o.kfac.enabled = true;
  expect_refused(o, "fp64");
  o = small_run();
  o.seq_len = 64;  // the model has 32 positions
  expect_refused(o, "max_position_embeddings");
  o = small_run();
  o.schedule_file = (dir_ / "missing.json").string();
  expect_refused(o, "missing.json");
}

int run_program(const std::string& arguments) {
  const int status = std::system(
      (std::string(PF_TRAIN_BINARY) + " " + arguments + " > /dev/null 2> /dev/null").c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// --device and --precision are checked before any work; what a device run cannot do yet is
// refused with a line saying so.
// An output file in a folder that does not exist is refused before any work, not when the run
// writes it at its end.
TEST_F(TrainTest, OutputFilesInMissingFoldersAreRefusedBeforeAnyWork) {
  const std::string missing = (dir_ / "no_such_folder" / "out.json").string();
  const std::vector<std::pair<std::string, std::string TrainOptions::*>> outputs = {
      {"--metrics", &TrainOptions::metrics},
      {"--trace", &TrainOptions::trace},
      {"--profile-out", &TrainOptions::profile_out},
      {"--calibration-out", &TrainOptions::calibration_out},
      {"--kfac-profile-out", &TrainOptions::kfac_profile_out}};
  for (const auto& [flag, field] : outputs) {
    auto o = small_run();
    o.kfac.enabled = flag == "--kfac-profile-out";
    o.*field = missing;
    std::ostringstream out;
    try {
      run_training(o, out);
      ADD_FAILURE() << flag << ": accepted";
    } catch (const std::invalid_argument& error) {
      EXPECT_NE(std::string(error.what()).find(flag + " " + missing + ": the folder"),
                std::string::npos)
          << error.what();
    }
    EXPECT_EQ(out.str().find("step "), std::string::npos) << flag << ": training started";
    EXPECT_EQ(out.str().find("profiling"), std::string::npos) << flag << ": profiling started";
  }
}

TEST_F(TrainTest, DeviceChoicesAreCheckedBeforeAnyWork) {
  auto o = small_run();
  o.device = "gpu";
  expect_refused(o, "--device gpu: expected cpu, cuda or cuda:N");
  o = small_run();
  o.device = "cuda";
  o.precision = "fp64";
  expect_refused(o, "fp64 runs on the CPU only");
  o = small_run();
  o.precision = "bf16";  // on the CPU
  expect_refused(o, "--precision must be fp32 or fp64");
  o.precision = "bf16-operands";  // on the CPU too: the CPU computes in fp32 or fp64 only
  expect_refused(o, "--precision must be fp32 or fp64");
  o = small_run();
  o.device = "cuda";
  o.precision = "bf16_operands";
  expect_refused(o, "must be fp32, tf32, bf16 or bf16-operands");
  // Every product precision passes on a device; the simulator prices bf16-operands as bf16.
  for (const std::string precision : {"fp32", "tf32", "bf16", "bf16-operands"}) {
    o.precision = precision;
    EXPECT_NO_THROW(validate_options(o)) << precision;
    EXPECT_EQ(products_precision(precision), precision == "bf16-operands" ? "bf16" : precision);
  }
  // --attention: batched or fused; fused on a device only.
  o = small_run();
  o.attention = "flash";
  expect_refused(o, "--attention must be batched or fused");
  o.attention = "fused";  // on the CPU
  expect_refused(o, "--attention fused runs on --device cuda only");
  o.device = "cuda";
  EXPECT_NO_THROW(validate_options(o));
  // Checkpoints run on a device (the device path's downloads and uploads): the options pass.
  o = small_run();
  o.device = "cuda:0";
  o.checkpoint_dir = (dir_ / "checkpoints").string();
  o.resume = true;
  EXPECT_NO_THROW(validate_options(o));
  // So does held-out evaluation (on the device's own copy of the model).
  o = small_run();
  o.device = "cuda";
  o.eval_data = "synthetic";
  o.eval_every = 2;
  EXPECT_NO_THROW(validate_options(o));
  // And K-FAC with data parallelism (the curvature sync on the device).
  o = small_run();
  o.device = "cuda";
  o.kfac.enabled = true;
  o.data_parallel = 2;
  EXPECT_NO_THROW(validate_options(o));
  // And K-FAC offload (pinned host memory, copies on a copy stream).
  o = small_run();
  o.device = "cuda";
  o.kfac.enabled = true;
  o.kfac.offload = "host";
  EXPECT_NO_THROW(validate_options(o));
  // The pass's flags that contradict each other: refused before the self-profile.
  o = small_run();
  o.kfac.enabled = true;
  o.kfac.free_spill = "on";
  o.kfac.refresh_steps = 2;
  expect_refused(o, "--kfac-free-spill on (free_spill) chooses the refresh interval");
}

// pipefisher_train --device cuda --kfac --kfac-offload host on the device path over the CPU
// backend (HostDeviceLaunch): the offload pass prices its copies on the device's host link
// (measure_device_host_link), the executor moves the state through pinned host memory, and
// every step's loss equals the CPU path's offload run and the device run without offload.
TEST_F(TrainTest, KfacOffloadOnTheDevicePathEqualsTheCpuPath) {
  auto cpu = small_run();
  cpu.optimizer = "adamw";
  cpu.kfac.enabled = true;
  cpu.kfac.split = "off";  // whole tasks
  cpu.kfac.refresh_steps = 2;
  cpu.steps = 5;
  // Every run below is placed from one profile: a run that self-profiles plans from its own
  // timings, and under a loaded machine the CPU and device runs' plans (where the inversions
  // and copies go, so which inverse a step's preconditioning reads and what is on the device
  // at once) could differ (it failed once under ctest -j2 beside two builds, 2026-11-28).
  cpu.profile_out = (dir_ / "offload-profile.json").string();
  cpu.metrics = (dir_ / "profiling.jsonl").string();
  std::ostringstream profiling;
  ASSERT_EQ(run_training(cpu, profiling), 0) << profiling.str();
  cpu.profile_out.clear();
  cpu.kfac_profile = (dir_ / "offload-profile.json").string();
  cpu.kfac.offload = "host";
  cpu.metrics = (dir_ / "cpu.jsonl").string();
  std::ostringstream out;
  ASSERT_EQ(run_training(cpu, out), 0);
  EXPECT_NE(out.str().find("K-FAC offload (host): "), std::string::npos) << out.str();
  auto on_device = cpu;
  on_device.metrics = (dir_ / "device.jsonl").string();
  testing::HostDeviceLaunch device;
  std::ostringstream device_out;
  ASSERT_EQ(run_training(on_device, device_out, device), 0);
  EXPECT_NE(device_out.str().find("K-FAC offload (host): "), std::string::npos) << device_out.str();
  // What the offload left where, measured, beside the plan; and the device's peak allocation.
  for (const std::string& text : {out.str(), device_out.str()}) {
    const auto at = text.find("K-FAC offload, measured: at most ");
    ASSERT_NE(at, std::string::npos) << text;
    const auto host = text.find(" MiB in host memory (plan: at most ", at);
    ASSERT_NE(host, std::string::npos) << text;
    const auto comma = text.rfind(", ", host);
    EXPECT_GT(std::stod(text.substr(comma + 2, host - comma - 2)), 0.0) << text;
    // The most a rank held at once, within the plan's K-FAC memory at once (its factor sums
    // included).
    const auto number_after = [&](const std::string& label, std::size_t from) {
      const auto found = text.find(label, from);
      EXPECT_NE(found, std::string::npos) << label << "\n" << text;
      return found == std::string::npos ? 0.0 : std::stod(text.substr(found + label.size()));
    };
    const double peak = number_after("K-FAC offload, measured: at most ", at);
    const double plan = number_after(" MiB in host memory (plan: at most ", at);
    const double sums = number_after(" MiB on the device at once, ", at);
    EXPECT_GT(peak, 0.0) << text;
    EXPECT_GT(sums, 0.0) << text;
    EXPECT_LE(sums, plan) << text;
    EXPECT_LE(peak, plan + 0.002) << text;  // printed to 0.001 MiB
  }
  EXPECT_NE(device_out.str().find("device memory: peak "), std::string::npos) << device_out.str();
  EXPECT_EQ(out.str().find("device memory: peak "), std::string::npos) << out.str();
  auto kept = on_device;
  kept.kfac.offload = "none";
  kept.metrics = (dir_ / "kept.jsonl").string();
  ASSERT_EQ(run_training(kept, out, device), 0);
  const auto lines = [](const std::string& path) {
    std::vector<nlohmann::json> result;
    std::istringstream text(read(path));
    std::string line;
    while (std::getline(text, line)) {
      auto record = nlohmann::json::parse(line);
      if (record.value("kind", std::string("step")) == "step") result.push_back(std::move(record));
    }
    return result;
  };
  const auto a = lines(cpu.metrics), b = lines(on_device.metrics), c = lines(kept.metrics);
  ASSERT_EQ(a.size(), 5U);
  ASSERT_EQ(b.size(), a.size());
  ASSERT_EQ(c.size(), a.size());
  int refreshes = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(b[i].at("loss"), a[i].at("loss")) << "step " << i + 1;
    EXPECT_EQ(b[i].at("loss"), c[i].at("loss")) << "step " << i + 1;
    refreshes += b[i].value("kfac_refresh", false) ? 1 : 0;
  }
  EXPECT_GE(refreshes, 1);
}

// The step losses (and refresh marks) of a metrics file.
std::vector<std::pair<double, bool>> step_losses(const std::string& path) {
  std::vector<std::pair<double, bool>> losses;
  std::istringstream text(read(path));
  std::string line;
  while (std::getline(text, line)) {
    const auto record = nlohmann::json::parse(line);
    if (record.value("kind", std::string("step")) != "step") continue;
    losses.emplace_back(record.at("loss").get<double>(), record.value("kfac_refresh", false));
  }
  return losses;
}

// pipefisher_train --kfac-offload host with K-FAC state sharded across data-parallel replicas
// (--kfac-sharding shard over 2, partial:2 over 4): every step's
// loss equals the run without offload on the same plan (a fixed profile, whole tasks), on the
// CPU path and on the device path (HostDeviceLaunch); the offload pass reports its copies.
TEST_F(TrainTest, KfacOffloadWithShardedStateEqualsNoOffload) {
  auto o = small_run();
  o.optimizer = "adamw";
  o.data_parallel = 2;
  o.steps = 5;
  o.kfac.enabled = true;
  o.kfac.split = "off";
  o.kfac.refresh_steps = 2;
  for (const auto& [sharding, replicas] :
       {std::pair<std::string, int>{"shard", 2}, std::pair<std::string, int>{"partial:2", 4}}) {
    SCOPED_TRACE("--kfac-sharding " + sharding);
    o.kfac.sharding = sharding;
    o.data_parallel = replicas;
    o.kfac.offload = "none";
    o.profile_out = (dir_ / "sharded-profile.json").string();
    o.metrics = (dir_ / "profiling.jsonl").string();
    std::ostringstream profiling;
    ASSERT_EQ(run_training(o, profiling), 0) << profiling.str();
    o.profile_out.clear();
    o.kfac_profile = (dir_ / "sharded-profile.json").string();
    for (const bool on_device : {false, true}) {
      SCOPED_TRACE(on_device ? "device path" : "CPU path");
      testing::HostDeviceLaunch device;
      std::vector<std::vector<std::pair<double, bool>>> losses;
      for (const std::string offload : {"none", "host"}) {
        auto run = o;
        run.kfac.offload = offload;
        run.metrics =
            (dir_ / (sharding + "-" + offload + (on_device ? "-device" : "") + ".jsonl")).string();
        std::ostringstream out;
        ASSERT_EQ(on_device ? run_training(run, out, device) : run_training(run, out), 0)
            << out.str();
        if (offload == "host") {
          EXPECT_NE(out.str().find("K-FAC offload (host): "), std::string::npos) << out.str();
          EXPECT_NE(out.str().find("K-FAC state over " + std::to_string(replicas) +
                                   " data-parallel replicas: " + sharding),
                    std::string::npos)
              << out.str();
        }
        losses.push_back(step_losses(run.metrics));
      }
      ASSERT_EQ(losses[0].size(), 5U);
      EXPECT_EQ(losses[1], losses[0]);
      EXPECT_TRUE(std::any_of(losses[1].begin(), losses[1].end(),
                              [](const auto& step) { return step.second; }));
    }
  }
}

// pipefisher_train --schedule-file with a pipelined refresh's schedule (inversions and their
// offload copies run in the next window) from the offload pass: every step's loss equals the
// same schedule without the copies, on the CPU path and on the device path.
TEST_F(TrainTest, KfacOffloadWithAPipelinedRefreshEqualsNoOffload) {
  auto config = model::bert_config_from_hf_json(dir_ / "config.json");
  config.num_layers = 4;  // one per worker of the 4-worker 1F1B
  std::ofstream(dir_ / "config4.json") << model::bert_config_to_hf_json(config).dump();
  const auto plans =
      exec::testing::plan_offload_run(exec::testing::pipelined_chains_case(), config);
  ASSERT_TRUE(plans.with.kfac_pipelined_refresh);
  ASSERT_GT(exec::testing::wrapped_work(plans.with).instructions, 0);
  std::ofstream(dir_ / "kept.json") << sched::to_json(plans.without).dump();
  std::ofstream(dir_ / "offload.json") << sched::to_json(plans.with).dump();
  auto o = small_run();
  o.model = (dir_ / "config4.json").string();
  o.optimizer = "adamw";
  o.steps = 3 * plans.with.num_steps;
  for (const bool on_device : {false, true}) {
    SCOPED_TRACE(on_device ? "device path" : "CPU path");
    testing::HostDeviceLaunch device;
    std::vector<std::vector<std::pair<double, bool>>> losses;
    for (const std::string schedule : {"kept", "offload"}) {
      auto run = o;
      run.schedule_file = (dir_ / (schedule + ".json")).string();
      run.metrics = (dir_ / (schedule + (on_device ? "-device" : "") + ".jsonl")).string();
      std::ostringstream out;
      ASSERT_EQ(on_device ? run_training(run, out, device) : run_training(run, out), 0)
          << out.str();
      losses.push_back(step_losses(run.metrics));
    }
    ASSERT_EQ(losses[0].size(), static_cast<std::size_t>(o.steps));
    EXPECT_EQ(losses[1], losses[0]);
    EXPECT_EQ(std::count_if(losses[1].begin(), losses[1].end(),
                            [](const auto& step) { return step.second; }),
              2);  // the inverses of the first two windows' refreshes serve from the next
  }
}

// The device's host link as the offload pass prices it: pinned <-> device copies on a stream
// (here the CPU backend's memcpy's through HostDeviceRuntime).
// K-FAC training on one plan (a fixed profile) gives every step's loss and gradient norm the same
// bits on 1 and 3 threads per worker: the curvature's token blocks, the inverses' column blocks,
// the products' blocks and the norms' chunks are cut by the shape, never by the thread count.
// The model is wide enough for each of those threaded paths (512 tokens per micro-batch, a
// 321-wide factor, 64k-element tensors).
TEST_F(TrainTest, KfacTrainingIsBitIdenticalForAnyThreadCount) {
  std::ofstream(dir_ / "wide.json") << R"({"vocab_size": 1001, "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 320,
    "max_position_embeddings": 64, "type_vocab_size": 2, "model_type": "bert"})";
  auto o = small_run();
  o.model = (dir_ / "wide.json").string();
  o.seq_len = 64;
  o.micro_batch_size = 8;
  o.steps = 4;
  o.kfac.enabled = true;
  o.kfac.refresh_steps = 2;
  o.profile_out = (dir_ / "profile.json").string();
  o.metrics = (dir_ / "profiling.jsonl").string();
  std::ostringstream profiling;
  ASSERT_EQ(run_training(o, profiling), 0) << profiling.str();
  o.profile_out.clear();
  o.kfac_profile = (dir_ / "profile.json").string();
  std::vector<std::vector<std::pair<double, double>>> runs;
  for (const int threads : {1, 3}) {
    auto run = o;
    run.threads_per_worker = threads;
    run.metrics = (dir_ / ("threads" + std::to_string(threads) + ".jsonl")).string();
    std::ostringstream out;
    ASSERT_EQ(run_training(run, out), 0) << out.str();
    runs.push_back(step_records(run.metrics));
  }
  ASSERT_EQ(runs[0].size(), 4U);
  EXPECT_EQ(runs[1], runs[0]);
}

// --kfac-warmup-steps: K-FAC refreshed every step for the warm-up, then the pass's k-step
// schedule from the warm-up's state, its windows starting where the warm-up ended (3, not a
// multiple of k = 2), in one run: bit for bit the two runs it stands for (k = 1 up to the
// warm-up's end, then --resume --kfac-replan with k = 2), one K-FAC profile for all; and not
// the run without a warm-up. A checkpoint saved inside the warm-up or inside one of the main
// schedule's windows resumes (the same flags and --resume) to the same bits; one saved inside
// the warm-up, resumed without the flag, is refused by name, as are the flag's combinations that
// cannot move state between schedules. With K-FAC offload: the same bits.
TEST_F(TrainTest, KfacWarmupEqualsTheTwoRunsItStandsFor) {
  auto o = small_run();
  o.steps = 6;
  o.kfac.enabled = true;
  o.kfac.refresh_steps = 2;
  o.profile_out = (dir_ / "profile.json").string();
  std::ostringstream profiling;
  ASSERT_EQ(run_training(o, profiling), 0) << profiling.str();
  o.profile_out.clear();
  o.kfac_profile = (dir_ / "profile.json").string();

  auto warm = o;
  warm.kfac_warmup_steps = 3;  // the main windows: steps 3-4, 5-6
  warm.metrics = (dir_ / "warm.jsonl").string();
  warm.checkpoint_dir = (dir_ / "warm-ckpt").string();
  warm.checkpoint_every = 2;  // at 4 (inside a window) and 6
  std::ostringstream out;
  ASSERT_EQ(run_training(warm, out), 0) << out.str();
  EXPECT_NE(out.str().find("K-FAC warm-up: a refresh every step for the first 3 step(s)"),
            std::string::npos)
      << out.str();
  const auto warm_state = [&](const char* name) {
    return nlohmann::json::parse(
        std::ifstream(fs::path(warm.checkpoint_dir) / name / "state.json"))["state"]["kfac"];
  };
  EXPECT_FALSE(warm_state("step-00000004").contains("warmup_end"));
  EXPECT_EQ(warm_state("step-00000004").value("window_origin", -1), 3);
  EXPECT_EQ(warm_state("step-00000004").value("round_phase", -1), 1);

  const auto [two_runs, rest_out] = warmup_as_two_runs(o, 3, dir_);
  EXPECT_NE(rest_out.find("K-FAC refresh every 2 step(s);"), std::string::npos) << rest_out;
  const auto warmed = step_records(warm.metrics);
  ASSERT_EQ(warmed.size(), 6U);
  EXPECT_EQ(warmed, two_runs);

  // Resumed from step 2 (inside the warm-up: both schedules planned again, the main one from
  // step 3) or step 4 (inside the main schedule's window 3-4: its schedule and window origin),
  // with the same flags and --resume, or from step 4 without the warm-up's flag: the same bits
  // as the run that went straight on. From step 2 without it, refused by name.
  // (A checkpoint at step 2, inside the warm-up, from a run of the same flags stopped there:
  // the warm run keeps its last two, 4 and 6.)
  auto stopped = warm;
  stopped.steps = 2;
  stopped.lr_decay_steps = 6;
  stopped.checkpoint_dir = (dir_ / "stopped").string();
  stopped.metrics.clear();
  std::ostringstream stopped_out;
  ASSERT_EQ(run_training(stopped, stopped_out), 0) << stopped_out.str();
  const auto stopped_state = nlohmann::json::parse(
      std::ifstream(dir_ / "stopped" / "step-00000002" / "state.json"))["state"]["kfac"];
  EXPECT_EQ(stopped_state.value("warmup_end", -1), 3);
  EXPECT_EQ(stopped_state.value("refresh_steps", -1), 1);
  const auto resume_from = [&](std::int64_t step, const TrainOptions& flags, const char* name) {
    const auto copy = dir_ / name;
    fs::copy(step < 3 ? stopped.checkpoint_dir : warm.checkpoint_dir, copy,
             fs::copy_options::recursive);
    for (std::int64_t later = step + 1; later <= 6; ++later) {
      char saved[32];
      std::snprintf(saved, sizeof(saved), "step-%08lld", static_cast<long long>(later));
      fs::remove_all(copy / saved);
    }
    char latest[32];
    std::snprintf(latest, sizeof(latest), "step-%08lld\n", static_cast<long long>(step));
    std::ofstream(copy / "latest") << latest;
    auto resumed = flags;
    resumed.resume = true;
    resumed.checkpoint_dir = copy.string();
    resumed.checkpoint_every = 2;
    resumed.metrics = (dir_ / (std::string(name) + ".jsonl")).string();
    return resumed;
  };
  for (const auto& [step, flags] :
       {std::pair<std::int64_t, TrainOptions>{2, warm}, {4, warm}, {4, o}}) {
    const auto resumed = resume_from(step, flags,
                                     (std::string("from") + std::to_string(step) +
                                      (flags.kfac_warmup_steps > 0 ? "_warm" : "_plain"))
                                         .c_str());
    std::ostringstream resumed_out;
    ASSERT_EQ(run_training(resumed, resumed_out), 0) << resumed_out.str();
    const auto tail = step_records(resumed.metrics);
    ASSERT_EQ(tail.size(), static_cast<std::size_t>(6 - step)) << "from step " << step;
    EXPECT_EQ(tail, std::vector(warmed.end() - (6 - step), warmed.end())) << "from step " << step;
  }
  expect_refused(resume_from(2, o, "from2_refused"),
                 "was saved inside a K-FAC warm-up of 3 steps (its schedule refreshes every step): "
                 "resume it with --kfac-warmup-steps 3");

  // With K-FAC state offloaded to host memory (in the warm-up too; the copies are exact): the
  // same bits.
  auto offloaded = warm;
  offloaded.kfac.offload = "host";
  offloaded.checkpoint_dir.clear();
  offloaded.checkpoint_every = 0;
  offloaded.metrics = (dir_ / "offloaded.jsonl").string();
  std::ostringstream offloaded_out;
  ASSERT_EQ(run_training(offloaded, offloaded_out), 0) << offloaded_out.str();
  EXPECT_NE(offloaded_out.str().find("K-FAC offload (host): "), std::string::npos)
      << offloaded_out.str();
  EXPECT_EQ(step_records(offloaded.metrics), warmed);

  auto plain = o;
  plain.metrics = (dir_ / "plain.jsonl").string();
  std::ostringstream plain_out;
  ASSERT_EQ(run_training(plain, plain_out), 0) << plain_out.str();
  EXPECT_NE(step_records(plain.metrics), warmed);

  // A target reached inside the warm-up stops the run there, with its final checkpoint.
  auto early = warm;
  early.eval_data = "synthetic";
  early.eval_every = 1;
  early.target_loss = 1000.0;
  early.checkpoint_dir = (dir_ / "early").string();
  early.metrics.clear();
  std::ostringstream early_out;
  ASSERT_EQ(run_training(early, early_out), 0) << early_out.str();
  EXPECT_TRUE(fs::exists(dir_ / "early" / "step-00000001")) << early_out.str();

  // A warm-up as long as the run is a run with a refresh every step.
  auto whole = warm;
  whole.steps = 3;
  whole.kfac_warmup_steps = 8;
  whole.metrics = (dir_ / "whole.jsonl").string();
  std::ostringstream whole_out;
  ASSERT_EQ(run_training(whole, whole_out), 0) << whole_out.str();
  EXPECT_NE(whole_out.str().find("first 3 step(s)"), std::string::npos) << whole_out.str();
  EXPECT_NE(whole_out.str().find("that is every step of the run"), std::string::npos);
  auto every = o;
  every.steps = 3;
  every.kfac.refresh_steps = 1;
  every.metrics = (dir_ / "every.jsonl").string();
  std::ostringstream every_out;
  ASSERT_EQ(run_training(every, every_out), 0) << every_out.str();
  EXPECT_EQ(step_records(whole.metrics), step_records(every.metrics));

  auto bad = warm;
  bad.kfac.enabled = false;
  bad.kfac_profile.clear();
  expect_refused(bad, "--kfac-warmup-steps needs --kfac");
  bad = warm;
  bad.kfac.refresh_steps = 1;
  expect_refused(bad, "--kfac-warmup-steps with --kfac-refresh 1");
  bad = warm;
  bad.kfac_warmup_steps = -1;
  expect_refused(bad, "--kfac-warmup-steps must be >= 0");
}

// The warm-up with --kfac-pipelined-refresh on (two data-parallel replicas): the warm-up
// refreshes whole within each step (nothing of it runs on into the main schedule), the main
// schedule's windows start at step 3. Bit for bit the two runs it stands for (k = 1 up to step
// 3, then --resume --kfac-replan with the pipelined option). (Whether the pass takes a pipelined
// plan here follows the measured profile; the executor's first window after an origin is
// tested with plans that run on: ExecutorKfac.WindowsFromAnOriginShiftTheRunAndNothingElse.)
// Without the option, with K-FAC state sharded across the replicas: the bits of replicated.
TEST_F(TrainTest, KfacWarmupWithPipelinedRefreshOrShardedStateEqualsItsReference) {
  auto o = small_run();
  o.steps = 7;
  o.data_parallel = 2;
  o.kfac.enabled = true;
  o.kfac.refresh_steps = 2;
  o.kfac.pipelined_refresh = "on";
  o.profile_out = (dir_ / "profile.json").string();
  std::ostringstream profiling;
  ASSERT_EQ(run_training(o, profiling), 0) << profiling.str();
  o.profile_out.clear();
  o.kfac_profile = (dir_ / "profile.json").string();

  auto warm = o;
  warm.kfac_warmup_steps = 3;
  warm.metrics = (dir_ / "warm.jsonl").string();
  std::ostringstream out;
  ASSERT_EQ(run_training(warm, out), 0) << out.str();

  const auto two_runs = warmup_as_two_runs(o, 3, dir_).first;
  const auto saved = dir_ / "ckpt" / "step-00000007";
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(saved / "state.json"))["state"]["kfac"].value(
                "window_origin", -1),
            3);
  const auto warmed = step_records(warm.metrics);
  ASSERT_EQ(warmed.size(), 7U);
  EXPECT_EQ(warmed, two_runs);

  // K-FAC state sharded across the two replicas (the warm-up's pass takes the main one's
  // placement; each rank keeps what it holds at the switch): the bits of replicated state.
  auto replicated = warm;
  replicated.kfac.pipelined_refresh = "off";
  replicated.metrics = (dir_ / "replicated.jsonl").string();
  auto sharded = replicated;
  sharded.kfac.sharding = "shard";
  sharded.metrics = (dir_ / "sharded.jsonl").string();
  for (const auto* run : {&replicated, &sharded}) {
    std::ostringstream run_out;
    ASSERT_EQ(run_training(*run, run_out), 0) << run_out.str();
  }
  ASSERT_EQ(step_records(sharded.metrics).size(), 7U);
  EXPECT_EQ(step_records(sharded.metrics), step_records(replicated.metrics));

  // Sharded state saved inside the warm-up resumes on a warm-up planned again from another
  // profile (--kfac-sharding auto keeps the checkpoint's placement): each rank restores its
  // own Linears, and the run goes on with the straight run's bits, here through two resumes,
  // step 1 -> 2 and 2 -> 7. The checkpoint's plan from K-FAC tasks 100x shorter than measured
  // (all in the bubbles), the resumed one from tasks 100x longer (all after the flush). Whole
  // tasks (--kfac-split off): pieces cut differently by two plans would sum the curvature in
  // another order (bit-identical only for the same split plan; docs/pipefisher.md).
  const auto scaled_profile = [&](double factor, const char* name) {
    auto json = nlohmann::json::parse(std::ifstream(o.kfac_profile));
    for (auto& entry : json.at("kfac")) {
      for (auto& [key, value] : entry.items()) {
        if (key.ends_with("_s") && value.is_number() && value.get<double>() > 0.0)
          value = factor * value.get<double>();
      }
    }
    const auto path = dir_ / name;
    std::ofstream(path) << json.dump();
    return path.string();
  };
  const auto shorter_profile = scaled_profile(0.01, "profile-shorter.json");
  const auto longer_profile = scaled_profile(100.0, "profile-longer.json");
  auto unsplit = sharded;
  unsplit.kfac.split = "off";
  unsplit.metrics = (dir_ / "sharded-unsplit.jsonl").string();
  std::ostringstream unsplit_out;
  ASSERT_EQ(run_training(unsplit, unsplit_out), 0) << unsplit_out.str();
  auto stopped = unsplit;
  stopped.kfac_profile = shorter_profile;
  stopped.steps = 2;
  stopped.lr_decay_steps = 7;
  stopped.checkpoint_dir = (dir_ / "sharded-stopped").string();
  stopped.checkpoint_every = 1;
  stopped.metrics.clear();
  std::ostringstream stopped_out;
  ASSERT_EQ(run_training(stopped, stopped_out), 0) << stopped_out.str();
  fs::remove_all(dir_ / "sharded-stopped" / "step-00000002");
  std::ofstream(dir_ / "sharded-stopped" / "latest") << "step-00000001\n";
  fs::copy(dir_ / "sharded-stopped", dir_ / "sharded-original", fs::copy_options::recursive);
  auto replanned = stopped;
  replanned.resume = true;
  replanned.kfac.sharding = "auto";
  replanned.kfac_profile = longer_profile;
  replanned.quiet = false;
  replanned.metrics = (dir_ / "sharded-replanned.jsonl").string();
  std::ostringstream replanned_out;
  ASSERT_EQ(run_training(replanned, replanned_out), 0) << replanned_out.str();
  EXPECT_NE(replanned_out.str().find("shard (--kfac-sharding auto: the checkpoint's)"),
            std::string::npos)
      << replanned_out.str();
  const auto saved_schedule = [&](const char* run) {
    return read(dir_ / run / "step-00000002" / "schedule.json");
  };
  auto original = stopped;
  original.resume = true;
  original.checkpoint_dir = (dir_ / "sharded-original").string();
  std::ostringstream original_out;
  ASSERT_EQ(run_training(original, original_out), 0) << original_out.str();
  EXPECT_NE(saved_schedule("sharded-stopped"), saved_schedule("sharded-original"))
      << "the two profiles' warm-up plans are the same: nothing tested";
  auto rest = unsplit;
  rest.resume = true;
  rest.checkpoint_dir = stopped.checkpoint_dir;
  rest.metrics = (dir_ / "sharded-rest.jsonl").string();
  std::ostringstream rest_out;
  ASSERT_EQ(run_training(rest, rest_out), 0) << rest_out.str();
  auto resumed = step_records(replanned.metrics);
  const auto after = step_records(rest.metrics);
  resumed.insert(resumed.end(), after.begin(), after.end());
  const auto straight = step_records(unsplit.metrics);
  ASSERT_EQ(resumed.size(), 6U);
  EXPECT_EQ(resumed, std::vector(straight.begin() + 1, straight.end()));
}

TEST(DeviceHostLink, IsMeasuredThroughPinnedMemory) {
  device::HostDeviceRuntime runtime;
  const auto link = measure_device_host_link(runtime, std::size_t{1} << 20);
  EXPECT_GT(link.bandwidth, 0.0);
  EXPECT_GE(link.latency_s, 0.0);
  const auto through_train =
      measure_host_copy(std::size_t{1} << 20, std::make_shared<device::HostDeviceRuntime>());
  EXPECT_GT(through_train.bandwidth, 0.0);
}

// pipefisher_train --device cuda --kfac --data-parallel 2, on the device path over the CPU
// backend (HostDeviceLaunch): the curvature sync all-reduces the device layers' sums, and every
// step's loss equals the CPU path's (the gradient norm within its rounding).
TEST_F(TrainTest, KfacWithDataParallelOnTheDevicePathEqualsTheCpuPath) {
  auto cpu = small_run();
  cpu.optimizer = "adamw";
  cpu.kfac.enabled = true;
  cpu.kfac.split = "off";  // whole tasks: each run self-profiles, and its plan may divide some
  cpu.kfac.refresh_steps = 2;
  cpu.data_parallel = 2;
  cpu.steps = 5;
  cpu.metrics = (dir_ / "cpu.jsonl").string();
  std::ostringstream out;
  ASSERT_EQ(run_training(cpu, out), 0);
  auto on_device = cpu;
  on_device.metrics = (dir_ / "device.jsonl").string();
  testing::HostDeviceLaunch device;
  std::ostringstream device_out;
  ASSERT_EQ(run_training(on_device, device_out, device), 0);
  // On a device, where each step's end goes, per rank (the optimizer's measured time is its
  // update alone): "step end, host ms per step (...): rank 0 sends S, ..., device sync Y; ...".
  const std::string summary = device_out.str();
  const auto step_end = summary.find("step end, host ms per step (steps after the first): rank 0 ");
  ASSERT_NE(step_end, std::string::npos) << summary;
  const auto line_end = summary.find('\n', step_end);
  for (int rank = 1; rank < 4; ++rank) {
    EXPECT_NE(summary.substr(step_end, line_end - step_end).find("; rank " + std::to_string(rank)),
              std::string::npos)
        << summary;
  }
  EXPECT_EQ(out.str().find("step end, host ms"), std::string::npos) << out.str();  // CPU path
  const auto lines = [](const std::string& path) {
    std::vector<nlohmann::json> result;
    std::istringstream text(read(path));
    std::string line;
    while (std::getline(text, line)) {
      auto record = nlohmann::json::parse(line);
      if (record.value("kind", std::string("step")) == "step") result.push_back(std::move(record));
    }
    return result;
  };
  const auto a = lines(cpu.metrics), b = lines(on_device.metrics);
  ASSERT_EQ(a.size(), 5U);
  ASSERT_EQ(b.size(), a.size());
  int refreshes = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].at("loss"), b[i].at("loss")) << "step " << i + 1;
    // The norm is summed per tensor in float on a device, in double on the CPU.
    const double norm = a[i].at("grad_norm").get<double>();
    EXPECT_NEAR(b[i].at("grad_norm").get<double>(), norm, 1e-6 * norm) << "step " << i + 1;
    refreshes += b[i].value("kfac_refresh", false) ? 1 : 0;
  }
  EXPECT_GE(refreshes, 1);
}

// The self-profile's K-FAC kernel times over its rounds: each field the median of the rounds',
// so that one round the machine slowed (here every kernel of round 1, 10x) moves none of them.
TEST(SelfProfile, KernelTimesAreTheMediansOfTheRounds) {
  std::vector<sim::KfacProfile> rounds(3);
  const double base[] = {1.0, 2.0, 3.0};
  for (int r = 0; r < 3; ++r) {
    const double scale = r == 1 ? 10.0 : 1.0 + 0.01 * r;
    auto& round = rounds[static_cast<std::size_t>(r)];
    round.linear = sched::LinearKind::kFfnIn;
    round.bytes = 64.0;
    round.curvature_a_s = scale * base[0];
    round.curvature_b_s = scale * base[1];
    round.invert_a_s = scale * base[2];
    round.invert_b_s = scale * 4.0;
    round.precondition_s = scale * 5.0;
  }
  const auto median = median_of_rounds(rounds);
  EXPECT_DOUBLE_EQ(median.curvature_a_s, 1.02);
  EXPECT_DOUBLE_EQ(median.curvature_b_s, 2.04);
  EXPECT_DOUBLE_EQ(median.invert_a_s, 3.06);
  EXPECT_DOUBLE_EQ(median.invert_b_s, 4.08);
  EXPECT_DOUBLE_EQ(median.precondition_s, 5.1);
  EXPECT_EQ(median.linear, sched::LinearKind::kFfnIn);
  EXPECT_DOUBLE_EQ(median.bytes, 64.0);
  EXPECT_DOUBLE_EQ(median_of_rounds({rounds[1]}).invert_a_s, 30.0);
  EXPECT_THROW(median_of_rounds({}), std::invalid_argument);
}

// The self-profiles' schedule: 1F1B over two stages, four micro-batches.
sched::Schedule two_stage_1f1b(const model::BertConfig& config) {
  cli::CompileCommandOptions compile;
  compile.schedule = "1f1b";
  compile.stages = 2;
  compile.microbatches = 4;
  compile.layers = config.num_layers;
  return cli::build_schedule(compile);
}

// The self-profile on a device path: the schedule's chunks timed by stream marks, the K-FAC
// kernels through the device's K-FAC layers (here the device path on the CPU backend; on a GPU
// the same code times the GPU, which is what --device cuda --kfac uses).
TEST_F(TrainTest, SelfProfileRunsOnTheDevicePath) {
  const auto config = model::resolve_bert_config((dir_ / "config.json").string());
  const auto schedule = two_stage_1f1b(config);
  exec::ExecutorOptions options;
  options.kfac.damping = 1e-3F;
  const auto cpu = profile_schedule(config, schedule, {2, 12, 2}, options, 2);
  const auto device = profile_schedule(config, schedule, {2, 12, 2}, options, 2,
                                       std::make_shared<device::HostDeviceRuntime>());
  ASSERT_EQ(device.chunks.size(), cpu.chunks.size());
  for (const auto& chunk : device.chunks) {
    EXPECT_GT(chunk.forward_s, 0.0);
    EXPECT_GT(chunk.backward_s, 0.0);
  }
  ASSERT_EQ(device.kfac.size(), cpu.kfac.size());
  for (const auto& entry : device.kfac) {
    EXPECT_GT(entry.curvature_a_s, 0.0);
    EXPECT_GT(entry.invert_b_s, 0.0);
    EXPECT_GT(entry.precondition_s, 0.0);
  }
  // Both workers on the one device: its capacity, timed on one stream per worker at once.
  EXPECT_GE(device.shared_processor_capacity, 1.0);
  EXPECT_LE(device.shared_processor_capacity, 2.0);
}

// The self-profile steps the run's optimizer (its step is part of the step time the pass plans
// around: LAMB's costs about 8x SGD's), one per worker, and times the K-FAC kernels on as many
// threads at once as the schedule has ranks.
TEST_F(TrainTest, SelfProfileStepsTheRunsOptimizer) {
  const auto config = model::resolve_bert_config((dir_ / "config.json").string());
  const auto schedule = two_stage_1f1b(config);
  exec::ExecutorOptions options;
  options.kfac.damping = 1e-3F;
  std::atomic<int> made{0};
  ProfileOptimizer optimizer;
  optimizer.make = [&made] {
    ++made;
    return std::make_unique<optim::Lamb>();
  };
  const auto profile =
      profile_schedule(config, schedule, {2, 12, 2}, options, 2, nullptr, optimizer);
  EXPECT_EQ(made.load(), 2);
  EXPECT_GT(profile.optimizer_step_s, 0.0);
  // Two worker threads on this machine's cores: between one core's worth and one each.
  EXPECT_GE(profile.shared_processor_capacity, 1.0);
  EXPECT_LE(profile.shared_processor_capacity, 2.0);
  ASSERT_EQ(profile.kfac.size(), static_cast<std::size_t>(sched::kNumLinearKinds));
  for (const auto& entry : profile.kfac) {
    EXPECT_GT(entry.curvature_a_s, 0.0);
    EXPECT_GT(entry.curvature_b_s, 0.0);
    EXPECT_GT(entry.invert_a_s, 0.0);
    EXPECT_GT(entry.invert_b_s, 0.0);
    EXPECT_GT(entry.precondition_s, 0.0);
  }
}

bool cuda_device_present() {
  try {
    return device::open_device_runtime({tensor::DeviceKind::kCuda, 0}) != nullptr;
  } catch (const device::DeviceUnavailableError&) {
    return false;
  }
}

TEST_F(TrainTest, CudaWithoutADeviceIsOneErrorLineAndExitTwo) {
  if (cuda_device_present()) GTEST_SKIP() << "a CUDA device is present";
  const auto err = dir_ / "stderr.txt";
  const int status = std::system(
      (std::string(PF_TRAIN_BINARY) +
       " --data synthetic --device cuda --steps 1 --quiet > /dev/null 2> " + err.string())
          .c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 2);
  const std::string text = read(err);
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 1) << text;
  EXPECT_EQ(text.rfind("pipefisher_train: error: --device cuda:0: ", 0), 0U) << text;
  EXPECT_TRUE(
      text.find(device::cuda_runtime_compiled() ? "no CUDA device" : "this build has no CUDA") !=
      std::string::npos)
      << text;
}

TEST_F(TrainTest, ProgramExitStatus) {
  EXPECT_EQ(run_program("--help"), 0);
  EXPECT_EQ(run_program("--data synthetic --stages 0"), 2);
  EXPECT_EQ(run_program("--data synthetic --optimizer adam"), 2);
  EXPECT_EQ(run_program("--no-such-flag"), 2);
  EXPECT_EQ(run_program("--data synthetic --dp-bucket-mb -1"), 2);
  EXPECT_EQ(run_program("--data synthetic --dp-bucket-mb nan"), 2);
  // A corrupt shard is bad input (pf::InputError from the shard reader), not a training failure.
  fs::create_directories(dir_ / "bad_shards");
  std::ofstream(dir_ / "bad_shards" / "part-0.pfshard") << "not a shard";
  EXPECT_EQ(run_program("--model " + (dir_ / "config.json").string() + " --data " +
                        (dir_ / "bad_shards").string() + " --seq-len 12 --steps 1 --quiet"),
            2);
  EXPECT_EQ(run_program("--model " + (dir_ / "config.json").string() +
                        " --data synthetic --seq-len 12 --micro-batch-size 2 --steps 1 --quiet"),
            0);
}

}  // namespace
}  // namespace pf::train
