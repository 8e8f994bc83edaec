// pipefisher_train's checkpoints: N steps + resume + N steps is bit-identical to 2N steps (fp32,
// fp64, K-FAC with a save in the middle of a refresh, shards and synthetic data), a checkpoint
// moves to other pipeline layouts, bad checkpoints are refused naming file and difference, a
// process killed during a save leaves the last good checkpoint, and the program end to end.
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "runtime/checkpoint/training_checkpoint.h"
#include "runtime/data/shard_format.h"
#include "runtime/optim/lamb.h"
#include "runtime/train/checkpointing.h"
#include "runtime/train/train_options.h"
#include "runtime/train/trainer.h"
#include "scheduler/compile.h"
#include "scheduler/schedule_json.h"
#include "sim/cli/compile_command.h"
#include "tests/executor/device_run.h"
#include "tests/executor/host_device_launch.h"
#include "tests/executor/kfac_test_schedule.h"
#include "tests/executor/offload_plan.h"

namespace pf::train {
namespace {

namespace fs = std::filesystem;

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

fs::path latest(const fs::path& root) {
  auto checkpoint = ckpt::load_latest_checkpoint(root);
  if (!checkpoint) throw std::runtime_error("no checkpoint in " + root.string());
  return checkpoint->directory;
}

// Leaves the checkpoint of `step` the latest of `root` (the later ones removed).
void rewind_to(const fs::path& root, std::int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
  for (const auto& entry : fs::directory_iterator(root)) {
    const auto file = entry.path().filename().string();
    if (file.rfind("step-", 0) == 0 && file > name) fs::remove_all(entry.path());
  }
  std::ofstream(root / "latest") << name << "\n";
}

// Weights, optimizer and K-FAC files of two checkpoints, byte for byte.
void expect_same_files(const fs::path& a, const fs::path& b) {
  EXPECT_EQ(a.filename(), b.filename());
  for (const char* file : {"model.safetensors", "optimizer.safetensors", "kfac.safetensors"}) {
    EXPECT_TRUE(read_file(a / file) == read_file(b / file)) << file << " differs";
  }
}

// run_training on the CPU path (threads) or the device path over host memory.
int run_training_on(const TrainOptions& o, std::ostream& out, bool on_device) {
  testing::HostDeviceLaunch device;
  Launch threads;
  return run_training(o, out, on_device ? static_cast<Launch&>(device) : threads);
}

// Per-step losses of a metrics file (the times differ from run to run, the losses may not).
std::vector<double> losses(const fs::path& metrics) {
  std::vector<double> result;
  std::istringstream lines(read_file(metrics));
  std::string line;
  while (std::getline(lines, line)) {
    const auto record = nlohmann::json::parse(line);
    if (record.contains("kind")) continue;  // evaluation and K-FAC statistics records
    result.push_back(record.at("loss").get<double>());
    result.push_back(record.at("grad_norm").get<double>());
  }
  return result;
}

class CheckpointingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("pf_ckpt_train_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    write_config(dir_ / "config.json", 16, 2);
    write_config(dir_ / "config4.json", 16, 4);
    write_config(dir_ / "wide.json", 32, 2);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static void write_config(const fs::path& path, int hidden, int layers) {
    std::ofstream(path) << R"({"vocab_size": 64, "hidden_size": )" << hidden
                        << R"(, "num_hidden_layers": )" << layers
                        << R"(, "num_attention_heads": 2, "intermediate_size": 32,
      "max_position_embeddings": 32, "type_vocab_size": 2, "hidden_dropout_prob": 0.1,
      "attention_probs_dropout_prob": 0.1, "model_type": "bert"})";
  }

  // Shards as pipefisher_data writes them: 200 small instances over two files.
  fs::path make_shards() const {
    const auto shards = dir_ / "shards";
    fs::create_directories(shards);
    data::ShardInfo info;
    info.vocab_hash = 7;
    info.vocab_size = 64;
    info.max_seq_length = 12;
    info.max_predictions = 2;
    std::size_t id = 0;
    for (int s = 0; s < 2; ++s) {
      std::vector<data::TrainingInstance> instances;
      for (int i = 0; i < 100; ++i, ++id) {
        data::TrainingInstance instance;
        instance.tokens = {2};
        for (std::size_t t = 0; t < 1 + id % 4; ++t)
          instance.tokens.push_back(static_cast<data::TokenId>(5 + (id + t) % 50));
        instance.tokens.push_back(3);
        instance.segment_a_length = static_cast<std::uint32_t>(instance.tokens.size());
        for (std::size_t t = 0; t < 1 + id % 3; ++t)
          instance.tokens.push_back(static_cast<data::TokenId>(5 + (id * 7 + t) % 50));
        instance.tokens.push_back(3);
        instance.is_random_next = id % 2 == 1;
        instance.masked_positions = {1};
        instance.masked_labels = {static_cast<data::TokenId>(5 + id % 50)};
        instances.push_back(std::move(instance));
      }
      data::write_shard((shards / ("part-" + std::to_string(s) + ".pfshard")).string(), info,
                        instances);
    }
    return shards;
  }

  TrainOptions small_run(const std::string& name) const {
    TrainOptions o;
    o.model = (dir_ / "config.json").string();
    o.data = "synthetic";
    o.seq_len = 12;
    o.micro_batch_size = 2;
    o.stages = 2;
    o.microbatches = 4;
    o.steps = 6;
    o.lr_decay_steps = 6;
    o.wait_timeout_s = 60;
    o.quiet = true;
    o.checkpoint_dir = (dir_ / name).string();
    o.metrics = (dir_ / (name + ".jsonl")).string();
    return o;
  }

  // A measured profile of the layout, so that the PipeFisher pass places K-FAC work the same
  // way in every run (a self-profile's timings would vary).
  std::string kfac_profile(TrainOptions o) const {
    const auto path = dir_ / ("profile-" + o.schedule + ".json");
    if (fs::exists(path)) return path.string();
    o.steps = 2;
    o.checkpoint_dir.clear();
    o.checkpoint_every = 0;
    o.metrics.clear();
    o.kfac_profile.clear();  // this run profiles itself, K-FAC kernels included
    o.profile_out = path.string();
    std::ostringstream out;
    run_training(o, out);
    return path.string();
  }

  // First `split` steps, then a resume up to o.steps; and the same run straight through.
  // launch: where the runs execute (default: the CPU path on threads).
  void run_split_and_straight(TrainOptions o, std::int64_t split, Launch* launch = nullptr) const {
    Launch threads;
    Launch& where = launch != nullptr ? *launch : threads;
    auto first = o;
    first.steps = split;
    std::ostringstream out;
    ASSERT_EQ(run_training(first, out, where), 0);
    auto resumed = o;
    resumed.resume = true;
    ASSERT_EQ(run_training(resumed, out, where), 0) << out.str();
    auto straight = o;
    straight.checkpoint_dir += "-straight";
    straight.metrics = straight.checkpoint_dir + ".jsonl";
    ASSERT_EQ(run_training(straight, out, where), 0);
  }

  void expect_identical(const TrainOptions& o, std::int64_t split) const {
    const auto a = latest(o.checkpoint_dir), b = latest(o.checkpoint_dir + "-straight");
    EXPECT_EQ(a.filename(), b.filename());
    for (const char* file : {"model.safetensors", "optimizer.safetensors", "kfac.safetensors"}) {
      ASSERT_EQ(fs::exists(a / file), fs::exists(b / file)) << file;
      if (!fs::exists(a / file)) continue;
      EXPECT_TRUE(read_file(a / file) == read_file(b / file)) << file << " differs";
    }
    const auto state_a = nlohmann::json::parse(read_file(a / "state.json"));
    const auto state_b = nlohmann::json::parse(read_file(b / "state.json"));
    EXPECT_EQ(state_a.at("state").at("loader_positions"),
              state_b.at("state").at("loader_positions"));
    // Losses and gradient norms of every step, bit for bit.
    EXPECT_EQ(losses(o.metrics), losses(o.checkpoint_dir + "-straight.jsonl"));
    EXPECT_EQ(losses(o.metrics).size(), 2U * static_cast<std::size_t>(o.steps));
    (void)split;
  }

  fs::path dir_;
};

TEST_F(CheckpointingTest, ResumeIsBitIdenticalFp32) {
  auto o = small_run("fp32");
  run_split_and_straight(o, 3);
  expect_identical(o, 3);
}

TEST_F(CheckpointingTest, ResumeIsBitIdenticalFp64AdamW) {
  auto o = small_run("fp64");
  o.precision = "fp64";
  o.optimizer = "adamw";
  run_split_and_straight(o, 3);
  expect_identical(o, 3);
}

TEST_F(CheckpointingTest, ResumeIsBitIdenticalWithShardsAndDataParallel) {
  auto o = small_run("shards");
  o.data = make_shards().string();
  o.seq_len = 0;
  o.data_parallel = 2;
  o.optimizer = "sgd";
  run_split_and_straight(o, 3);
  expect_identical(o, 3);
  const auto state = nlohmann::json::parse(read_file(latest(o.checkpoint_dir) / "state.json"));
  EXPECT_EQ(state.at("state").at("loader_positions").size(), 2U);
}

TEST_F(CheckpointingTest, ResumeIsBitIdenticalWithKfacMidRefresh) {
  auto o = small_run("kfac");
  o.kfac.enabled = true;
  o.kfac.refresh_steps = 2;
  o.kfac.curvature = "every_step";
  o.kfac_profile = kfac_profile(o);
  run_split_and_straight(o, 3);  // step 3: one step into a two-step refresh
  const auto state = nlohmann::json::parse(read_file(dir_ / "kfac" / "step-00000003/state.json"));
  EXPECT_EQ(state.at("state").at("kfac").at("round_phase"), 1);
  expect_identical(o, 3);
}

TEST_F(CheckpointingTest, ResumeIsBitIdenticalWithKfacOnChimeraAndShards) {
  auto o = small_run("kfac-chimera");
  o.model = (dir_ / "config4.json").string();
  o.schedule = "chimera";
  o.data = make_shards().string();
  o.seq_len = 0;
  o.kfac.enabled = true;
  o.kfac.refresh_steps = 2;
  o.kfac_profile = kfac_profile(o);
  o.checkpoint_every = 3;
  run_split_and_straight(o, 3);
  expect_identical(o, 3);
}

// K-FAC with a save one step into a refresh: on the device path the resumed run equals the
// straight one bit for bit, and both equal the CPU path's run (AdamW: no gradient norm in the
// update; a device sums it per tensor in float, so only the reported norm differs).
TEST_F(CheckpointingTest, ResumeIsBitIdenticalWithKfacMidRefreshOnTheDevicePath) {
  auto o = small_run("kfac-device");
  o.optimizer = "adamw";
  o.kfac.enabled = true;
  o.kfac.refresh_steps = 2;
  // One measured profile for every run, so that they all run the same plan (divided tasks
  // included: chains of pieces on both paths).
  o.kfac_profile = kfac_profile(o);
  testing::HostDeviceLaunch device;  // the device path on the CPU backend
  run_split_and_straight(o, 3, &device);
  const auto state =
      nlohmann::json::parse(read_file(dir_ / "kfac-device" / "step-00000003/state.json"));
  EXPECT_EQ(state.at("state").at("kfac").at("round_phase"), 1);
  expect_identical(o, 3);

  auto cpu = o;
  cpu.checkpoint_dir += "-cpu";
  cpu.metrics = cpu.checkpoint_dir + ".jsonl";
  std::ostringstream out;
  ASSERT_EQ(run_training(cpu, out), 0);
  const auto a = latest(o.checkpoint_dir), b = latest(cpu.checkpoint_dir);
  EXPECT_EQ(a.filename(), b.filename());
  for (const char* file : {"model.safetensors", "optimizer.safetensors", "kfac.safetensors"}) {
    EXPECT_TRUE(read_file(a / file) == read_file(b / file)) << file << " differs from the CPU's";
  }
  // Losses bit for bit; the gradient norms (reported, not used by AdamW) to the rounding of the
  // device's float sums per tensor.
  const auto device_steps = losses(o.metrics), cpu_steps = losses(cpu.metrics);
  ASSERT_EQ(device_steps.size(), cpu_steps.size());
  for (std::size_t i = 0; i < cpu_steps.size(); i += 2) {
    EXPECT_EQ(device_steps[i], cpu_steps[i]) << "loss of step " << i / 2 + 1;
    EXPECT_NEAR(device_steps[i + 1], cpu_steps[i + 1], 1e-5 * cpu_steps[i + 1]);
  }
}

// LAMB (its global norm summed on the device) and two data-parallel replicas (reductions staged
// through host memory): the device path's resume is bit-identical to its straight run.
TEST_F(CheckpointingTest, ResumeIsBitIdenticalWithLambAndDataParallelOnTheDevicePath) {
  auto o = small_run("lamb-device");
  o.data_parallel = 2;
  testing::HostDeviceLaunch device;  // the device path on the CPU backend
  run_split_and_straight(o, 3, &device);
  expect_identical(o, 3);
}

// A pipelined K-FAC refresh on the device path, saved after each step of three windows and
// resumed in a fresh executor: every resumed run ends with the straight run's weights,
// optimizer and K-FAC state, bit for bit, and the straight run's weights track the CPU path's.
TEST_F(CheckpointingTest, PipelinedKfacRefreshResumesAfterAnyStepOnTheDevicePath) {
  const auto config = exec::testing::device_test_config(4);
  // Divided tasks: inversions wrapped whole and as the rest of a chain begun in the refresh's
  // own window (saved between its pieces: the device layer's chain in progress).
  const auto schedule = exec::testing::device_test_pipelined_schedule(4, true);
  ASSERT_TRUE(schedule.kfac_pipelined_refresh);
  const std::int64_t steps = 3 * schedule.num_steps;
  const nlohmann::json identity = {{"test", "pipelined refresh on the device path"}};
  int saves_inside_a_chain = 0;  // saves holding a divided inversion between two of its pieces
  const auto run = [&](bool on_device, std::int64_t split) {
    auto batches = exec::testing::device_test_batches(config);
    const auto runtime = on_device ? std::make_shared<device::HostDeviceRuntime>() : nullptr;
    auto setup =
        exec::testing::device_test_setup(runtime, config, schedule, "adamw", batches, false);
    auto executor = std::make_unique<exec::ThreadedExecutor<float>>(setup);
    if (split > 0) {
      executor->run(0, split);
      const auto saved = collect_checkpoint(*executor, split, identity, nullptr);
      saves_inside_a_chain += std::any_of(saved.kfac.begin(), saved.kfac.end(), [](const auto& r) {
        return r.name.ends_with("_chain_factor");
      });
      auto fresh_batches = exec::testing::device_test_batches(config);
      setup.batches = &fresh_batches;
      setup.device = std::make_shared<device::HostDeviceRuntime>();
      executor = std::make_unique<exec::ThreadedExecutor<float>>(setup);
      restore_checkpoint(*executor, saved);
      executor->run(split, steps);
      return collect_checkpoint(*executor, steps, identity, nullptr);
    }
    executor->run(0, steps);
    return collect_checkpoint(*executor, steps, identity, nullptr);
  };
  const auto same = [](const std::vector<ckpt::TensorRecord>& a,
                       const std::vector<ckpt::TensorRecord>& b, const std::string& what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    for (std::size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].name, b[i].name) << what;
      EXPECT_TRUE(a[i].data == b[i].data) << what << ": " << a[i].name << " differs";
    }
  };
  const auto cpu = run(false, 0);
  const auto straight = run(true, 0);
  // Against the CPU path: the same chains of pieces, so the same weights bit for bit.
  same(straight.weights, cpu.weights, "device vs the CPU path");
  for (std::int64_t split = 1; split < steps; ++split) {
    SCOPED_TRACE("saved after step " + std::to_string(split));
    const auto resumed = run(true, split);
    same(resumed.weights, straight.weights, "weights");
    same(resumed.optimizer, straight.optimizer, "optimizer state");
    same(resumed.kfac, straight.kfac, "K-FAC state");
  }
  EXPECT_GT(saves_inside_a_chain, 0);
  // This plan's wrapped inversions run in each window's first step, before its optimizer step:
  // no save between two steps holds set-aside sums (their records round-trip in
  // HostDevicePath.SetAsideSumsRoundTripThroughTheExtras); the saves at window boundaries
  // restore sums that the resumed window's start sets aside.
}

// pipefisher_train --kfac-offload host|factors --checkpoint-dir: saved one step into a refresh
// and resumed (the checkpoint's schedule, with its offload copies), bit-identical to the
// straight run, on the CPU path and on the device path (HostDeviceLaunch: pinned host memory).
TEST_F(CheckpointingTest, ResumeIsBitIdenticalWithKfacOffloadMidRefresh) {
  for (const std::string mode : {"host", "factors"}) {
    for (const bool on_device : {false, true}) {
      SCOPED_TRACE(mode + (on_device ? ", device path" : ", CPU path"));
      auto o = small_run(mode + (on_device ? "-offload-device" : "-offload"));
      o.optimizer = "adamw";
      o.kfac.enabled = true;
      o.kfac.refresh_steps = 2;
      o.kfac.offload = mode;
      o.kfac_profile = kfac_profile(o);
      testing::HostDeviceLaunch device;
      run_split_and_straight(o, 3, on_device ? &device : nullptr);
      const auto state = nlohmann::json::parse(
          read_file(fs::path(o.checkpoint_dir) / "step-00000003" / "state.json"));
      EXPECT_EQ(state.at("state").at("kfac").at("round_phase"), 1);
      const auto kfac =
          ckpt::load_safetensors(fs::path(o.checkpoint_dir) / "step-00000003" / "kfac.safetensors");
      bool offload_records = false;
      for (const auto& [name, record] : kfac.tensors) {
        offload_records |= name.find(".offload.A_value") != std::string::npos;
      }
      EXPECT_TRUE(offload_records) << "no host copies in the checkpoint";
      expect_identical(o, 3);
    }
  }
}

// A divided inversion (a Cholesky chain, kfac/inverse_chain.h) whose pieces straddle the
// checkpoint: under this measured profile the pass runs worker 1's query A inversion in pieces
// over both steps of a 2-step refresh, and a checkpoint after step 3 falls between them. The
// chain (its factor, damping and progress) is saved and rebuilt, so the resumed run ends with
// the straight run's bits; with and without offload. (It failed with "inversion piece ...
// without the chain's first piece" before the chain was saved.)
TEST_F(CheckpointingTest, ResumeInsideADividedInversionIsBitIdentical) {
  for (const std::string offload : {"none", "host"}) {
    SCOPED_TRACE("--kfac-offload " + offload);
    auto o = small_run("chain-" + offload);
    o.optimizer = "adamw";
    o.kfac.enabled = true;
    o.kfac.refresh_steps = 2;
    o.kfac.offload = offload;
    o.kfac_profile = "tests/fixtures/profile_inversion_across_steps.json";
    run_split_and_straight(o, 3);
    const auto kfac =
        ckpt::load_safetensors(fs::path(o.checkpoint_dir) / "step-00000003" / "kfac.safetensors");
    int chains = 0;
    for (const auto& [name, record] : kfac.tensors) chains += name.ends_with("_chain") ? 1 : 0;
    EXPECT_GE(chains, 1) << "no inversion in progress at the checkpoint: the profile no longer "
                            "makes the pass divide an inversion across the window's steps";
    expect_identical(o, 3);
  }
}

// K-FAC offload (--kfac-offload): checkpoints hold the whole K-FAC state (each offloaded
// Linear's matrices from host memory where the live state has none) and, as progress records,
// where it was (host copies, written-back flags, the matrices on the device). Saved after every
// step of three refreshes and resumed in a fresh executor, on the CPU path and on the device path
// (HostDeviceRuntime, pinned host memory): every resumed run ends with the straight run's
// weights, optimizer and K-FAC state, bit for bit; the straight run's whole K-FAC state is the
// state of the same run without offload; and at a refresh boundary the state moves between runs
// with and without offload.
class OffloadCheckpoints : public ::testing::TestWithParam<exec::testing::OffloadCase> {};

TEST_P(OffloadCheckpoints, ResumeAfterAnyStepEqualsTheStraightRun) {
  const auto c = GetParam();
  const auto config = exec::testing::device_test_config(4);
  const auto plans = exec::testing::plan_offload_run(c, config);
  ASSERT_GT(plans.plan.offloaded_linears(), 0);
  const std::int64_t k = plans.with.num_steps;
  const std::int64_t steps = 3 * k;
  const nlohmann::json identity = {{"test", "K-FAC offload checkpoints"}};
  for (const bool on_device : {false, true}) {
    SCOPED_TRACE(on_device ? "device path" : "CPU path");
    const auto make_runtime = [&]() -> std::shared_ptr<device::DeviceRuntime> {
      if (!on_device) return nullptr;
      return std::make_shared<device::HostDeviceRuntime>();
    };
    // First `split` steps of `first`, saved, then restored into a fresh executor of `second`.
    const auto run = [&](const sched::Schedule& first, const sched::Schedule& second,
                         std::int64_t split) {
      auto batches = exec::testing::device_test_batches(config);
      auto setup =
          exec::testing::device_test_setup(make_runtime(), config, first, "adamw", batches, false);
      setup.options.kfac.running_average = c.running_average;
      setup.options.kfac.placement = c.placement;
      auto executor = std::make_unique<exec::ThreadedExecutor<float>>(setup);
      if (split > 0) {
        executor->run(0, split);
        const auto saved = collect_checkpoint(*executor, split, identity, nullptr);
        auto fresh_batches = exec::testing::device_test_batches(config);
        setup.batches = &fresh_batches;
        setup.schedule = second;
        setup.device = make_runtime();
        executor = std::make_unique<exec::ThreadedExecutor<float>>(setup);
        restore_checkpoint(*executor, saved);
        executor->run(split, steps);
        return collect_checkpoint(*executor, steps, identity, nullptr);
      }
      executor->run(0, steps);
      return collect_checkpoint(*executor, steps, identity, nullptr);
    };
    const auto same = [](const std::vector<ckpt::TensorRecord>& a,
                         const std::vector<ckpt::TensorRecord>& b, const std::string& what,
                         bool whole_state_only) {
      std::vector<const ckpt::TensorRecord*> x, y;
      for (const auto* records : {&a, &b}) {
        for (const auto& record : *records) {
          // The progress records say where the state is (offload copies): not the state.
          if (whole_state_only && record.name.find(".progress.") != std::string::npos) continue;
          (records == &a ? x : y).push_back(&record);
        }
      }
      ASSERT_EQ(x.size(), y.size()) << what;
      for (std::size_t i = 0; i < x.size(); ++i) {
        EXPECT_EQ(x[i]->name, y[i]->name) << what;
        EXPECT_TRUE(x[i]->data == y[i]->data) << what << ": " << x[i]->name << " differs";
      }
    };
    const auto straight = run(plans.with, plans.with, 0);
    const auto without = run(plans.without, plans.without, 0);
    same(straight.weights, without.weights, "weights with and without offload", false);
    same(straight.kfac, without.kfac, "K-FAC state with and without offload", true);
    // Whole Linears leave the inverses a refresh replaced on the host, factors-only ones their
    // factors' values (their inverses stay on the device: none on the host).
    const bool factors_only = plans.plan.factors_only_linears() > 0;
    bool offload_records = false, host_inverses = false;
    for (const auto& record : straight.kfac) {
      offload_records |=
          record.name.find(factors_only ? ".offload.A_value" : ".offload.A_prev_inv") !=
          std::string::npos;
      host_inverses |= record.name.find(".offload.A_inv") != std::string::npos;
    }
    if (c.mode == pipefisher::OffloadMode::kFactors) {
      EXPECT_FALSE(host_inverses);
    }
    EXPECT_TRUE(offload_records) << "no host copies in the checkpoint";
    for (std::int64_t split = 1; split < steps; ++split) {
      SCOPED_TRACE("saved after step " + std::to_string(split));
      const auto resumed = run(plans.with, plans.with, split);
      same(resumed.weights, straight.weights, "weights", false);
      same(resumed.optimizer, straight.optimizer, "optimizer state", false);
      same(resumed.kfac, straight.kfac, "K-FAC state", false);
    }
    // At a refresh boundary the state moves to a run without offload, and back. (Not sharded
    // state: it resumes only on the schedule that saved it, and the trainer refuses another,
    // check_kfac_resumable; nor a pipelined refresh whose chains of pieces run on into the next
    // window: a layout change drops the progress records that hold them.)
    if (!(c.placement == kfac::StatePlacement{}) ||
        exec::testing::wrapped_work(plans.with).continued > 0) {
      continue;
    }
    const auto to_kept = run(plans.with, plans.without, k);
    same(to_kept.weights, without.weights, "offload -> kept: weights", false);
    same(to_kept.kfac, without.kfac, "offload -> kept: K-FAC state", false);
    const auto to_offload = run(plans.without, plans.with, k);
    same(to_offload.weights, straight.weights, "kept -> offload: weights", false);
    same(to_offload.kfac, straight.kfac, "kept -> offload: K-FAC state", true);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, OffloadCheckpoints,
    ::testing::Values(
        exec::testing::OffloadCase{"OneFOneBRunningAverage", sched::ScheduleKind::kOneFOneB, 2, 1,
                                   2, false, pipefisher::OffloadMode::kHost, 0.5F},
        exec::testing::OffloadCase{"ChimeraHost", sched::ScheduleKind::kChimera, 2, 1, 1, false,
                                   pipefisher::OffloadMode::kHost},
        // Factors only: the inverses stay on the device.
        exec::testing::OffloadCase{"OneFOneBFactors", sched::ScheduleKind::kOneFOneB, 2, 1, 2,
                                   false, pipefisher::OffloadMode::kFactors, 0.5F},
        exec::testing::OffloadCase{"ChimeraDataParallelFactors", sched::ScheduleKind::kChimera, 2,
                                   2, 2, false, pipefisher::OffloadMode::kFactors, 0.5F},
        exec::testing::OffloadCase{"OneFOneBPipelinedWholeInversionsFactors",
                                   sched::ScheduleKind::kOneFOneB,
                                   4,
                                   1,
                                   2,
                                   false,
                                   pipefisher::OffloadMode::kFactors,
                                   0.5F,
                                   {},
                                   exec::testing::Refresh::kPipelinedWhole},
        exec::testing::OffloadCase{"GPipeDataParallelAuto", sched::ScheduleKind::kGPipe, 2, 2, 3,
                                   false, pipefisher::OffloadMode::kAuto},
        // Sharded K-FAC state: the owner's and the other replicas' records.
        exec::testing::OffloadCase{"OneFOneBShardTwoReplicas", sched::ScheduleKind::kOneFOneB, 2, 2,
                                   2, false, pipefisher::OffloadMode::kHost, 0.5F,
                                   kfac::uniform_placement({kfac::Placement::kShard, 0})},
        exec::testing::OffloadCase{
            "GPipeFactorsShardedInversesReplicated", sched::ScheduleKind::kGPipe, 2, 2, 2, false,
            pipefisher::OffloadMode::kHost, 0.0F,
            kfac::StatePlacement{{kfac::Placement::kShard, 0}, {kfac::Placement::kReplicate, 0}}},
        // A pipelined refresh: saved between a window's wrapped inversions of the
        // previous refresh and their write-back, inside chains of pieces.
        exec::testing::OffloadCase{"OneFOneBPipelinedWholeInversions",
                                   sched::ScheduleKind::kOneFOneB,
                                   4,
                                   1,
                                   2,
                                   false,
                                   pipefisher::OffloadMode::kHost,
                                   0.5F,
                                   {},
                                   exec::testing::Refresh::kPipelinedWhole},
        exec::testing::OffloadCase{"OneFOneBPipelinedChainsOfPieces",
                                   sched::ScheduleKind::kOneFOneB,
                                   4,
                                   1,
                                   0,
                                   false,
                                   pipefisher::OffloadMode::kHost,
                                   0.9F,
                                   {},
                                   exec::testing::Refresh::kPipelinedChains}),
    [](const ::testing::TestParamInfo<exec::testing::OffloadCase>& param_info) {
      return param_info.param.name;
    });

// Where a resumed run's refresh windows start: the checkpoint's own origin on its own schedule
// (mid-window too); the checkpoint's step on another schedule, which drops the refresh in
// progress inside one of the checkpoint's windows (counted from its origin, 0 when state.json
// has none; refused until 2026-11-30); a malformed origin is named.
TEST(KfacResume, AnotherScheduleStartsItsWindowsAtTheCheckpoint) {
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = 2;
  params.microbatches = 4;
  params.num_layers = 4;
  const auto base = sched::compile(params);
  const auto k2 = exec::testing::with_kfac_in_bubbles(base, 2);
  const auto k3 = exec::testing::with_kfac_in_bubbles(base, 3);
  ckpt::TrainingCheckpoint checkpoint;
  checkpoint.directory = "ckpt/step-00000005";
  checkpoint.schedule = sched::to_json(k2);
  checkpoint.kfac.push_back(
      ckpt::make_i64_record("kfac.layer.0.query.counters", {1}, std::vector<std::int64_t>{0}));
  const auto saved = [&](std::int64_t step, const nlohmann::json& origin) {
    checkpoint.step = step;
    checkpoint.state = {{"kfac", {{"refresh_steps", 2}}}};
    if (!origin.is_null()) checkpoint.state["kfac"]["window_origin"] = origin;
  };
  const auto refusal = [&](const sched::Schedule& schedule) {
    try {
      (void)check_kfac_resumable(checkpoint, schedule, {});
    } catch (const std::invalid_argument& error) {
      return std::string(error.what());
    }
    return std::string("resumed");
  };
  saved(5, 3);  // windows 3-4, 5-6: step 5 starts one
  EXPECT_EQ(check_kfac_resumable(checkpoint, k2, {}), 3);
  EXPECT_EQ(check_kfac_resumable(checkpoint, k3, {}), 5);
  EXPECT_EQ(check_kfac_resumable(checkpoint, base, {}), 5);
  EXPECT_FALSE(inside_refresh_window(checkpoint));
  EXPECT_FALSE(drops_refresh_in_progress(checkpoint, k3, {}));
  saved(6, 3);  // inside the window 5-6: another schedule drops the refresh in progress
  EXPECT_EQ(check_kfac_resumable(checkpoint, k2, {}), 3);
  EXPECT_EQ(check_kfac_resumable(checkpoint, k3, {}), 6);
  EXPECT_TRUE(inside_refresh_window(checkpoint));
  EXPECT_TRUE(drops_refresh_in_progress(checkpoint, k3, {}));
  EXPECT_FALSE(drops_refresh_in_progress(checkpoint, k2, {}));  // its own: continued
  saved(6, nullptr);  // saved before window origins: windows from step 0
  EXPECT_EQ(check_kfac_resumable(checkpoint, k3, {}), 6);
  EXPECT_FALSE(drops_refresh_in_progress(checkpoint, k3, {}));
  saved(5, nullptr);
  EXPECT_EQ(check_kfac_resumable(checkpoint, k3, {}), 5);
  EXPECT_TRUE(drops_refresh_in_progress(checkpoint, k3, {}));
  for (const nlohmann::json& bad : {nlohmann::json(7), nlohmann::json(-1), nlohmann::json("3")}) {
    saved(5, bad);
    EXPECT_NE(refusal(k2).find("state.json: kfac.window_origin should be a step from 0 to the "
                               "checkpoint's step 5, it is " +
                               bad.dump()),
              std::string::npos)
        << refusal(k2);
  }
}

// A pipelined refresh whose chains of inversion pieces run on into the next window (progress
// records, not the layer-keyed state), or whose whole inversions do (their sums unfinalized at
// the boundary), moves to another schedule at a window's end only after its own schedule has
// finished that work (needs_refresh_finished; until 2026-11-29 whole inversions were let
// through and the run failed at its next window, "the factor sums of two earlier refreshes are
// both unfinalized"; until 2026-11-30 the move was refused): here from the schedule without the
// offload copies to the one with them. From the one with the copies it is refused after step 0
// (not finished with offload); the checkpoint's own schedule continues it as it was.
TEST(PipelinedCheckpoints, WorkAcrossWindowsIsFinishedBeforeAnotherScheduleTakesOver) {
  const auto config = exec::testing::device_test_config(4);
  auto whole = exec::testing::pipelined_chains_case();
  whole.refresh = exec::testing::Refresh::kPipelinedWhole;
  whole.refresh_steps = 2;
  for (const auto& run : {exec::testing::pipelined_chains_case(), whole}) {
    SCOPED_TRACE(run.refresh == exec::testing::Refresh::kPipelinedWhole ? "whole inversions"
                                                                        : "chains of pieces");
    const auto plans = exec::testing::plan_offload_run(run, config);
    const auto wrapped = exec::testing::wrapped_work(plans.without);
    if (run.refresh == exec::testing::Refresh::kPipelinedWhole) {
      ASSERT_GT(wrapped.instructions, 0);
      ASSERT_EQ(wrapped.continued + wrapped.syncs, 0);
    } else {
      ASSERT_GT(exec::testing::wrapped_work(plans.with).continued, 0);
    }
    ckpt::TrainingCheckpoint checkpoint;
    checkpoint.step = plans.with.num_steps;  // a window boundary
    checkpoint.state = {{"kfac", {{"refresh_steps", plans.with.num_steps}}}};
    checkpoint.kfac.push_back(
        ckpt::make_i64_record("kfac.layer.0.query.counters", {1}, std::vector<std::int64_t>{0}));
    for (const auto* saved : {&plans.with, &plans.without}) {
      checkpoint.schedule = sched::to_json(*saved);
      const auto* other = saved == &plans.with ? &plans.without : &plans.with;
      EXPECT_NO_THROW(check_kfac_resumable(checkpoint, *saved, {}));
      EXPECT_FALSE(needs_refresh_finished(checkpoint, *saved, {}));
      if (saved == &plans.without) {
        EXPECT_EQ(check_kfac_resumable(checkpoint, *other, {}), checkpoint.step);
        EXPECT_TRUE(needs_refresh_finished(checkpoint, *other, {}));
        continue;
      }
      try {
        check_kfac_resumable(checkpoint, *other, {});
        ADD_FAILURE() << "resumed on another schedule with the offload copies";
      } catch (const std::invalid_argument& error) {
        EXPECT_NE(std::string(error.what()).find("with K-FAC state offloaded to host memory"),
                  std::string::npos)
            << error.what();
      }
    }
    // Inside one of its windows the previous refresh's work is done (it precedes the window's
    // first preconditioning): the refresh in progress is dropped. Sums still set aside for it
    // in the records (not from this build's runs) are refused.
    checkpoint.schedule = sched::to_json(plans.without);
    checkpoint.step = plans.with.num_steps + 1;
    EXPECT_EQ(check_kfac_resumable(checkpoint, plans.with, {}), checkpoint.step);
    EXPECT_TRUE(drops_refresh_in_progress(checkpoint, plans.with, {}));
    EXPECT_FALSE(needs_refresh_finished(checkpoint, plans.with, {}));
    auto pending = checkpoint;
    pending.kfac.push_back(ckpt::make_i64_record("kfac.rank0.progress.slot.0.0.query.prev_counts",
                                                 {2}, std::vector<std::int64_t>{1, 1}));
    try {
      check_kfac_resumable(pending, plans.with, {});
      ADD_FAILURE() << "moved with the previous refresh's sums set aside";
    } catch (const std::invalid_argument& error) {
      EXPECT_NE(std::string(error.what()).find("runs work of the previous refresh in this window"),
                std::string::npos)
          << error.what();
    }
    checkpoint.step = 0;
    EXPECT_NO_THROW(check_kfac_resumable(checkpoint, plans.without, {}));
    EXPECT_FALSE(needs_refresh_finished(checkpoint, plans.with, {}));  // no refresh before it
  }
}

// Executor::finish_refresh runs a pipelined refresh's work placed in the next window and
// nothing else: restored from a window's end and finished, every rank's K-FAC values and
// inverses are those of the straight run after the next window's first step (where that work
// runs, before the window's first preconditioning), bit for bit, on the CPU path and the device
// path, for whole inversions, chains of pieces and curvature syncs (Chimera) in the next window.
// Where the straight run has begun the next refresh in that step already, the inverse it
// replaced (kept for the window's preconditioning) is compared; each case compares factors
// the call changed.
TEST(PipelinedCheckpoints, FinishRefreshRunsTheNextWindowsWorkOfTheRefresh) {
  const auto config = exec::testing::device_test_config(4);
  auto whole = exec::testing::pipelined_chains_case();
  whole.refresh = exec::testing::Refresh::kPipelinedWhole;
  whole.refresh_steps = 2;
  auto syncs = exec::testing::pipelined_chains_case();
  syncs.kind = sched::ScheduleKind::kChimera;
  syncs.refresh = exec::testing::Refresh::kPipelinedSyncs;
  const nlohmann::json identity = {{"test", "finish refresh"}};
  for (const auto& run : {exec::testing::pipelined_chains_case(), whole, syncs}) {
    SCOPED_TRACE(run.refresh == exec::testing::Refresh::kPipelinedWhole    ? "whole inversions"
                 : run.refresh == exec::testing::Refresh::kPipelinedChains ? "chains of pieces"
                                                                           : "curvature syncs");
    const auto schedule = exec::testing::plan_offload_run(run, config).without;
    const auto wrapped = exec::testing::wrapped_work(schedule);
    ASSERT_GT(wrapped.instructions, 0);
    if (run.refresh == exec::testing::Refresh::kPipelinedSyncs) {
      ASSERT_GT(wrapped.syncs, 0);
    }
    const std::int64_t k = schedule.num_steps;
    auto batches = exec::testing::device_test_batches(config);
    auto setup =
        exec::testing::device_test_setup(nullptr, config, schedule, "adamw", batches, false);
    exec::ThreadedExecutor<float> straight(setup);
    straight.run(0, k);
    const auto saved = collect_checkpoint(straight, k, identity, nullptr);
    straight.run(k, k + 1);
    for (const bool on_device : {false, true}) {
      SCOPED_TRACE(on_device ? "device path" : "CPU path");
      const auto restored = [&](exec::SyntheticBatches& fresh_batches) {
        auto fresh_setup = setup;
        fresh_setup.batches = &fresh_batches;
        if (on_device) fresh_setup.device = std::make_shared<device::HostDeviceRuntime>();
        auto executor = std::make_unique<exec::ThreadedExecutor<float>>(fresh_setup);
        restore_checkpoint(*executor, saved);
        return executor;
      };
      auto before_batches = exec::testing::device_test_batches(config);
      auto finished_batches = exec::testing::device_test_batches(config);
      auto before = restored(before_batches);
      auto finished = restored(finished_batches);
      finished->finish_refresh(k);
      // Eigen's == reads past the smaller of two matrices of other sizes.
      const auto equal_matrices = [](const Eigen::MatrixXf& u, const Eigen::MatrixXf& v) {
        return u.rows() == v.rows() && u.cols() == v.cols() && (u.size() == 0 || u == v);
      };
      int compared = 0, changed_and_compared = 0;
      for (int rank = 0; rank < straight.num_ranks(); ++rank) {
        for (int p = 0; p < schedule.placement.num_pipelines; ++p) {
          const auto want = straight.worker(rank).kfac_state(p).layers();
          const auto got = finished->worker(rank).kfac_state(p).layers();
          const auto old = before->worker(rank).kfac_state(p).layers();
          ASSERT_EQ(want.size(), got.size());
          for (const auto& [key, layer] : want) {
            for (const bool a : {true, false}) {
              const auto& x = a ? layer.a : layer.b;
              const auto& y = a ? got.at(key).a : got.at(key).b;
              const auto& z = a ? old.at(key).a : old.at(key).b;
              EXPECT_EQ(y.sum.size(), 0) << "a sum left unfinalized";
              EXPECT_GE(x.refreshes, y.refreshes);
              if (x.refreshes != y.refreshes) {
                // The next refresh's inversion ran in that step too: the inverse it replaced
                // (kept for the window's preconditioning) is the one the call computed.
                ASSERT_EQ(x.refreshes, y.refreshes + 1);
                const auto name = "p.slot." + std::to_string(p) + "." + std::to_string(key.layer) +
                                  "." + std::string(kfac::linear_name(key.linear)) +
                                  (a ? ".A_prev_inv" : ".B_prev_inv");
                const std::vector<std::int64_t> shape = {y.inverse.rows(), y.inverse.cols()};
                const auto records =
                    ckpt::to_safetensors_file(straight.worker(rank).kfac_progress_records("p"));
                if (records.tensors.count(name) == 0) continue;  // not replaced yet
                const auto replaced = ckpt::read_f32(records, name, shape);
                const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> mine =
                    y.inverse;
                EXPECT_TRUE(replaced.size() == static_cast<std::size_t>(mine.size()) &&
                            std::equal(replaced.begin(), replaced.end(), mine.data()))
                    << "replaced inverse, rank " << rank << " layer " << key.layer << " "
                    << kfac::linear_name(key.linear) << (a ? " A" : " B");
                ++compared;
                changed_and_compared += equal_matrices(y.inverse, z.inverse) ? 0 : 1;
                continue;
              }
              EXPECT_TRUE(equal_matrices(x.value, y.value) && equal_matrices(x.inverse, y.inverse))
                  << "rank " << rank << " pipeline " << p << " layer " << key.layer << " "
                  << kfac::linear_name(key.linear) << (a ? " A" : " B");
              ++compared;
              changed_and_compared +=
                  equal_matrices(y.value, z.value) && equal_matrices(y.inverse, z.inverse) ? 0 : 1;
            }
          }
        }
      }
      EXPECT_GT(changed_and_compared, 0) << "of " << compared << " factors compared";
    }
  }
}

// A checkpoint of offloaded state that does not fit the run: the record of where an offloaded
// Linear's state was missing, its flags out of range, a host copy of the wrong shape, a new
// inverse lost. Each is refused naming the record, before anything runs.
TEST(OffloadCheckpointErrors, BadOffloadRecordsAreRefusedNamingTheRecord) {
  const auto config = exec::testing::device_test_config(4);
  const auto plans =
      exec::testing::plan_offload_run({"OneFOneBHost", sched::ScheduleKind::kOneFOneB, 2, 1, 2,
                                       false, pipefisher::OffloadMode::kHost},
                                      config);
  const nlohmann::json identity = {{"test", "bad offload records"}};
  for (const bool on_device : {false, true}) {
    SCOPED_TRACE(on_device ? "device path" : "CPU path");
    const auto runtime = [&]() -> std::shared_ptr<device::DeviceRuntime> {
      if (!on_device) return nullptr;
      return std::make_shared<device::HostDeviceRuntime>();
    };
    auto batches = exec::testing::device_test_batches(config);
    auto setup =
        exec::testing::device_test_setup(runtime(), config, plans.with, "adamw", batches, false);
    exec::ThreadedExecutor<float> executor(setup);
    executor.run(0, plans.with.num_steps + 1);  // a refresh done, one step into the next
    const auto saved = collect_checkpoint(executor, plans.with.num_steps + 1, identity, nullptr);
    std::string flags_name;
    for (const auto& record : saved.kfac) {
      const auto at = record.name.rfind(".offload");
      if (at != std::string::npos && at + 8 == record.name.size()) {
        flags_name = record.name;
        break;
      }
    }
    ASSERT_FALSE(flags_name.empty());
    const auto expect_refused = [&](const ckpt::TrainingCheckpoint& bad, const std::string& name,
                                    const std::string& fragment) {
      auto fresh_batches = exec::testing::device_test_batches(config);
      auto fresh_setup = setup;
      fresh_setup.batches = &fresh_batches;
      fresh_setup.device = runtime();
      exec::ThreadedExecutor<float> fresh(fresh_setup);
      try {
        restore_checkpoint(fresh, bad);
        ADD_FAILURE() << "accepted a checkpoint with a bad " << name;
      } catch (const std::runtime_error& error) {
        const std::string text = error.what();
        EXPECT_NE(text.find(name), std::string::npos) << text;
        EXPECT_NE(text.find(fragment), std::string::npos) << text;
      }
    };
    {
      auto bad = saved;
      std::erase_if(bad.kfac, [&](const auto& record) { return record.name == flags_name; });
      expect_refused(bad, flags_name, "holds no record of where its state was");
    }
    {
      auto bad = saved;
      for (auto& record : bad.kfac) {
        if (record.name != flags_name) continue;
        const std::int64_t flags[] = {1, 1, 2, 0, 0, 0};
        record = ckpt::make_i64_record(flags_name, {6}, flags);
      }
      expect_refused(bad, flags_name, "where a flag (0 or 1) belongs");
    }
    {
      auto bad = saved;
      const std::string value = flags_name + ".A_value";
      bool found = false;
      for (auto& record : bad.kfac) {
        if (record.name != value) continue;
        found = true;
        const std::vector<float> small(4, 1.0F);
        record = ckpt::make_f32_record(value, {2, 2}, small);
      }
      ASSERT_TRUE(found) << value;
      expect_refused(bad, value, "");
    }
    {
      // A live matrix flagged present but missing from the file.
      auto bad = saved;
      for (auto& record : bad.kfac) {
        if (record.name != flags_name) continue;
        const std::int64_t flags[] = {1, 1, 1, 1, 0, 0};
        record = ckpt::make_i64_record(flags_name, {6}, flags);
      }
      std::erase_if(bad.kfac, [&](const auto& record) {
        return record.name == flags_name + ".A_live_value";
      });
      expect_refused(bad, flags_name + ".A_live_value", "missing");
    }
  }
}

// K-FAC state sharded across two data-parallel replicas: each rank saves the state it owns and
// restores it on the same layout, bit for bit, in the middle of a refresh. On another layout
// (one stage) there the refresh in progress is dropped (refused until 2026-11-30): the run goes
// on as the same move from replicated state does, bit for bit, sharded or replicated, and as
// the same move on the device path.
TEST_F(CheckpointingTest, ShardedKfacResumesMidRefreshOnItsOwnLayoutAndMovesDroppingIt) {
  auto o = small_run("kfac-sharded");
  o.data_parallel = 2;
  o.kfac.enabled = true;
  o.kfac.refresh_steps = 2;
  o.kfac.split = "off";  // whole tasks: the moved runs' plans sum in one order
  o.kfac.sharding = "shard";
  o.kfac_profile = kfac_profile(o);
  run_split_and_straight(o, 3);
  expect_identical(o, 3);
  const auto step3 =
      nlohmann::json::parse(read_file(dir_ / "kfac-sharded" / "step-00000006" / "state.json"));
  EXPECT_EQ(step3.at("state").at("kfac").at("placement"), "shard");

  auto replicated = o;
  replicated.kfac.sharding = "replicate";
  replicated.steps = 3;
  replicated.checkpoint_dir += "-replicated";
  replicated.metrics.clear();
  std::ostringstream out;
  ASSERT_EQ(run_training(replicated, out), 0) << out.str();
  for (const std::string sharding : {"shard", "replicate"}) {
    std::vector<std::vector<double>> moved;
    // From sharded and replicated state on the CPU path, and from sharded state on the device
    // path (its K-FAC layers loaded without the sums).
    for (const auto* from : {&o, &replicated, &o}) {
      const bool on_device = moved.size() == 2;
      auto other = o;
      other.stages = 1;
      other.kfac.sharding = sharding;
      other.resume = true;
      other.quiet = false;
      other.checkpoint_dir =
          from->checkpoint_dir + "-moved-" + sharding + (on_device ? "-device" : "");
      other.metrics = other.checkpoint_dir + ".jsonl";
      fs::copy(from->checkpoint_dir, other.checkpoint_dir, fs::copy_options::recursive);
      rewind_to(other.checkpoint_dir, 3);
      std::ostringstream moved_out;
      ASSERT_EQ(run_training_on(other, moved_out, on_device), 0) << moved_out.str();
      EXPECT_NE(moved_out.str().find("drops that refresh's curvature so far"), std::string::npos)
          << moved_out.str();
      moved.push_back(losses(other.metrics));
    }
    EXPECT_EQ(moved[0].size(), 6U);  // steps 4-6
    EXPECT_EQ(moved[0], moved[1]) << "moved to one stage, " << sharding;
    EXPECT_EQ(moved[0], moved[2]) << "moved to one stage on the device path, " << sharding;
  }
}

// The same on the device path (HostDeviceLaunch): sharded device K-FAC layers saved in the middle
// of a refresh resume bit for bit, and save what the CPU path saves.
TEST_F(CheckpointingTest, ShardedKfacResumesOnItsOwnLayoutOnTheDevicePath) {
  auto o = small_run("kfac-sharded-device");
  o.optimizer = "adamw";
  o.data_parallel = 2;
  o.kfac.enabled = true;
  o.kfac.refresh_steps = 2;
  o.kfac.sharding = "shard";
  o.kfac_profile = kfac_profile(o);
  testing::HostDeviceLaunch device;
  run_split_and_straight(o, 3, &device);
  expect_identical(o, 3);
  auto cpu = o;
  cpu.checkpoint_dir += "-cpu";
  cpu.metrics = cpu.checkpoint_dir + ".jsonl";
  std::ostringstream out;
  ASSERT_EQ(run_training(cpu, out), 0);
  const auto a = latest(o.checkpoint_dir), b = latest(cpu.checkpoint_dir);
  EXPECT_TRUE(read_file(a / "kfac.safetensors") == read_file(b / "kfac.safetensors"))
      << "the device path's K-FAC state differs from the CPU path's";
  EXPECT_TRUE(read_file(a / "model.safetensors") == read_file(b / "model.safetensors"));
}

// Weights and optimizer state of two runs on other layouts: equal up to the summation order of
// micro-batch gradients, which differs between schedules. The attention key bias is left out:
// its gradient is zero in exact arithmetic (softmax ignores a shift of each query's scores), so
// it only ever sees rounding noise, which Adam-type optimizers scale up to learning-rate-sized
// steps. (A layout with one chunk has no separate decoder copy: those records are skipped too.)
double max_relative_difference(const fs::path& a, const fs::path& b, const std::string& file,
                               const std::string& prefix) {
  const auto x = ckpt::load_safetensors(a / file), y = ckpt::load_safetensors(b / file);
  double worst = 0.0;
  for (const auto& [name, record] : x.tensors) {
    if (name.rfind(prefix, 0) != 0 || record.dtype == ckpt::DType::kI64) continue;
    if (name.find("attention.self.key.bias") != std::string::npos) continue;
    if (y.tensors.count(name) == 0) continue;
    const auto u = ckpt::read_f64(x, name, record.shape);
    const auto v = ckpt::read_f64(y, name, record.shape);
    double scale = 0.0, diff = 0.0;
    for (std::size_t i = 0; i < u.size(); ++i) {
      scale = std::max(scale, std::abs(u[i]));
      diff = std::max(diff, std::abs(u[i] - v[i]));
    }
    if (scale > 0) worst = std::max(worst, diff / scale);
  }
  return worst;
}

TEST_F(CheckpointingTest, ResumesOnOtherLayouts) {
  struct Layout {
    std::string schedule;
    int stages, chunks;
  };
  auto base = small_run("layout");
  base.model = (dir_ / "config4.json").string();
  base.precision = "fp64";
  base.schedule = "1f1b";
  auto first = base;
  first.steps = 3;
  std::ostringstream out;
  ASSERT_EQ(run_training(first, out), 0);
  auto straight = base;
  straight.checkpoint_dir += "-straight";
  straight.metrics.clear();
  ASSERT_EQ(run_training(straight, out), 0);
  for (const auto& layout : {Layout{"gpipe", 4, 1}, Layout{"interleaved", 2, 2},
                             Layout{"chimera", 2, 1}, Layout{"1f1b", 1, 1}}) {
    SCOPED_TRACE(layout.schedule + " p=" + std::to_string(layout.stages));
    const auto copy = dir_ / ("layout-" + layout.schedule + std::to_string(layout.stages));
    fs::copy(base.checkpoint_dir, copy, fs::copy_options::recursive);
    auto resumed = base;
    resumed.checkpoint_dir = copy.string();
    resumed.metrics.clear();
    resumed.schedule = layout.schedule;
    resumed.stages = layout.stages;
    resumed.chunks = layout.chunks;
    resumed.resume = true;
    ASSERT_EQ(run_training(resumed, out), 0);
    const auto a = latest(copy), b = latest(straight.checkpoint_dir);
    EXPECT_EQ(a.filename(), b.filename());
    const double weights = max_relative_difference(a, b, "optimizer.safetensors", "master.");
    const double state = max_relative_difference(a, b, "optimizer.safetensors", "optimizer.");
    std::cout << layout.schedule << " p=" << layout.stages << " v=" << layout.chunks
              << ": max relative difference to the straight run: weights " << weights
              << ", optimizer state " << state << "\n";
    EXPECT_LT(weights, 1e-12);
    EXPECT_LT(state, 1e-9);
  }
}

// K-FAC state moves to another layout at a refresh boundary (the straight run's weights to the
// summation order) and inside a refresh (that refresh dropped, the first window's curvature
// another: within 10%).
TEST_F(CheckpointingTest, KfacResumesOnOtherLayoutAtAndInsideARefresh) {
  auto base = small_run("kfac-layout");
  base.model = (dir_ / "config4.json").string();
  base.kfac.enabled = true;
  base.kfac.refresh_steps = 2;
  base.kfac_profile = kfac_profile(base);
  base.checkpoint_every = 2;
  auto first = base;
  first.steps = 3;  // checkpoints at 2 (refresh boundary) and 3 (inside a refresh)
  std::ostringstream out;
  ASSERT_EQ(run_training(first, out), 0);
  auto straight = base;
  straight.checkpoint_dir += "-straight";
  straight.metrics.clear();
  ASSERT_EQ(run_training(straight, out), 0);

  auto other = base;
  other.schedule = "gpipe";
  other.stages = 4;
  other.kfac_profile = kfac_profile(other);
  other.resume = true;
  other.metrics.clear();
  {
    // From the step-3 checkpoint (inside a refresh, dropped) it continues, near the straight run.
    auto inside = other;
    inside.checkpoint_dir += "-inside";
    fs::copy(base.checkpoint_dir, inside.checkpoint_dir, fs::copy_options::recursive);
    ASSERT_EQ(run_training(inside, out), 0) << out.str();
    const auto a = latest(inside.checkpoint_dir), b = latest(straight.checkpoint_dir);
    EXPECT_EQ(a.filename(), "step-00000006");
    const double difference = max_relative_difference(a, b, "model.safetensors", "");
    std::cout << "K-FAC, 1f1b p=2 -> gpipe p=4 at step 3 (inside a refresh): max relative weight "
                 "difference "
              << difference << "\n";
    EXPECT_LT(difference, 0.1);  // 0.051 measured: another refresh's curvature, 3 steps on
  }
  // From the step-2 checkpoint (a refresh boundary) it continues, close to the straight run.
  fs::remove_all(fs::path(base.checkpoint_dir) / "step-00000003");
  std::ofstream(fs::path(base.checkpoint_dir) / "latest") << "step-00000002\n";
  ASSERT_EQ(run_training(other, out), 0);
  const auto a = latest(base.checkpoint_dir), b = latest(straight.checkpoint_dir);
  EXPECT_EQ(a.filename(), "step-00000006");
  EXPECT_EQ(b.filename(), "step-00000006");
  const double difference = max_relative_difference(a, b, "model.safetensors", "");
  std::cout << "K-FAC, 1f1b p=2 -> gpipe p=4 at step 2: max relative weight difference "
            << difference << "\n";
  EXPECT_LT(difference, 1e-4);
}

void expect_refused(const TrainOptions& o, const std::vector<std::string>& needles) {
  std::ostringstream out;
  try {
    run_training(o, out);
    ADD_FAILURE() << "not refused";
  } catch (const std::invalid_argument& error) {
    for (const auto& needle : needles) {
      EXPECT_NE(std::string(error.what()).find(needle), std::string::npos)
          << "'" << needle << "' not in: " << error.what();
    }
  }
}

// K-FAC state offloaded with its factors only: the copies sit around the inversions, so a run
// resumed inside a long refresh window may run none of them. It trains on bit for bit, and its
// summary's replay prices the copies it never timed as free (until 2026-11-29 the run ended
// with "K-FAC offload transfers need the host link's bandwidth: set the profile's host_link
// (this run)", exit 2, once its steps had run).
TEST_F(CheckpointingTest, OffloadedKfacResumedPastItsCopiesEndsWithItsSummary) {
  auto o = small_run("offload-factors-resumed");
  o.model = (dir_ / "config4.json").string();
  o.schedule = "interleaved";
  o.chunks = 2;
  o.steps = 7;
  o.lr_decay_steps = 7;
  o.kfac.enabled = true;
  o.kfac.refresh_steps = 16;
  o.kfac.offload = "factors";
  o.kfac_profile = kfac_profile(o);
  o.quiet = false;
  run_split_and_straight(o, 4);
  expect_identical(o, 4);
}

// Each component placed its own way (what --kfac-sharding auto chooses on a slow link, and
// writes to state.json): a resume in the middle of a refresh reads the placement back and
// continues bit for bit. (Until 2026-11-29 state.json's "factors=shard,inverses=replicate" was
// refused on resume: "kfac.placement: ... is not one of auto, replicate, shard, partial:G".)
TEST_F(CheckpointingTest, KfacPlacedPerComponentResumesBitIdentically) {
  auto o = small_run("kfac-per-component");
  o.data_parallel = 2;
  o.kfac.enabled = true;
  o.kfac.refresh_steps = 2;
  o.kfac.sharding = "factors=shard,inverses=replicate";
  o.kfac_profile = kfac_profile(o);
  run_split_and_straight(o, 3);
  expect_identical(o, 3);
  const auto state = nlohmann::json::parse(read_file(latest(o.checkpoint_dir) / "state.json"));
  EXPECT_EQ(state.at("state").at("kfac").at("placement"), "factors=shard,inverses=replicate");
}

// At the end of one of its refresh windows, sharded K-FAC state resumes on another plan of the
// same layout and placement (--kfac-replan with another refresh interval; --kfac-sharding auto
// keeps the checkpoint's placement): each rank restores the Linears it saved, and the run has
// the bits of the same resume from replicated state (sharded trains as replicated, bit for bit),
// and of the same plan with the state replicated (the owners' state gathered).
TEST_F(CheckpointingTest, ShardedKfacTakesAnotherRefreshIntervalAtAWindowEnd) {
  auto base = small_run("kfac-shard-replan");
  base.data_parallel = 2;
  base.kfac.enabled = true;
  base.kfac.refresh_steps = 2;
  base.kfac.split = "off";  // whole tasks: the two placements' plans sum in one order
  base.kfac_profile = kfac_profile(base);
  base.checkpoint_every = 2;
  std::map<std::string, std::vector<double>> resumed;
  for (const std::string sharding : {"replicate", "shard"}) {
    auto first = base;
    first.kfac.sharding = sharding;
    first.steps = 4;  // checkpoints at 2 and 4, each the end of a window
    first.checkpoint_dir += "-" + sharding;
    first.metrics.clear();
    std::ostringstream out;
    ASSERT_EQ(run_training(first, out), 0) << out.str();
    auto rest = base;
    rest.kfac.sharding = sharding == "shard" ? "auto" : sharding;
    rest.kfac.refresh_steps = 3;
    rest.kfac_replan = true;
    rest.resume = true;
    rest.quiet = false;
    rest.checkpoint_dir = first.checkpoint_dir;
    rest.metrics = (dir_ / ("replan-" + sharding + ".jsonl")).string();
    if (sharding == "shard") {  // the other placement, from a copy of the checkpoints
      auto other = rest;
      other.kfac.sharding = "replicate";
      other.checkpoint_dir += "-replicated";
      fs::copy(rest.checkpoint_dir, other.checkpoint_dir, fs::copy_options::recursive);
      other.metrics = (dir_ / "replan-shard-to-replicate.jsonl").string();
      ASSERT_EQ(run_training(other, out), 0) << out.str();
      resumed["shard to replicate"] = losses(other.metrics);
    }
    ASSERT_EQ(run_training(rest, out), 0) << out.str();
    EXPECT_NE(out.str().find("K-FAC refresh every 3 step(s)"), std::string::npos) << out.str();
    if (sharding == "shard") {
      EXPECT_NE(out.str().find("shard (--kfac-sharding auto: the checkpoint's)"), std::string::npos)
          << out.str();
    }
    resumed[sharding] = losses(rest.metrics);
  }
  EXPECT_EQ(resumed["shard"].size(), 4U);  // steps 5 and 6: loss and gradient norm each
  EXPECT_EQ(resumed["shard"], resumed["replicate"]);
  EXPECT_EQ(resumed["shard to replicate"], resumed["replicate"]);
}

// Sharded K-FAC state moves to another placement or layout at the end of a refresh window: each
// Linear's factors and inverses come from the replicas that owned them, and each rank keeps what
// its new placement gives it. Saved at step 4 with the state replicated and sharded, resumed
// with another placement (--kfac-replan: the same plan as a run of that placement from step 0)
// the run is the straight run of that placement, bit for bit: losses, weights, optimizer and
// K-FAC records (a replica holding no factors or inverses of a Linear saves none, as there).
// On another layout (one stage) the resumes from the two checkpoints have the same bits.
TEST_F(CheckpointingTest, ShardedKfacMovesToAnotherPlacementOrLayoutAtAWindowEnd) {
  auto base = small_run("kfac-reshard");
  base.model = (dir_ / "config4.json").string();  // 12 Linears per worker, owners on both replicas
  base.data_parallel = 2;
  base.kfac.enabled = true;
  base.kfac.refresh_steps = 2;
  base.kfac.split = "off";  // whole tasks: every placement's plan sums in one order
  base.kfac_profile = kfac_profile(base);
  base.checkpoint_every = 2;
  const std::vector<std::string> placements = {"replicate", "shard",
                                               "factors=shard,inverses=replicate"};
  const auto with = [&](const std::string& sharding, const std::string& name) {
    auto o = base;
    o.kfac.sharding = sharding;
    o.checkpoint_dir = (dir_ / name).string();
    o.metrics = (dir_ / (name + ".jsonl")).string();
    return o;
  };
  std::ostringstream out;
  for (std::size_t i = 0; i < placements.size(); ++i) {
    auto straight = with(placements[i], "straight-" + std::to_string(i));
    ASSERT_EQ(run_training(straight, out), 0) << out.str();
    if (i == 2) continue;  // saved from replicated and sharded state
    auto first = with(placements[i], "first-" + std::to_string(i));
    first.steps = 4;
    ASSERT_EQ(run_training(first, out), 0) << out.str();
  }
  const auto straight_losses = [&](std::size_t i) {
    auto all = losses(dir_ / ("straight-" + std::to_string(i) + ".jsonl"));
    return std::vector<double>(all.begin() + 8, all.end());  // steps 5 and 6
  };
  for (std::size_t from = 0; from < 2; ++from) {
    for (std::size_t to = 0; to < placements.size(); ++to) {
      if (to == from) continue;
      const std::string name = "resumed-" + std::to_string(from) + "-" + std::to_string(to);
      auto resumed = with(placements[to], name);
      fs::copy(dir_ / ("first-" + std::to_string(from)), resumed.checkpoint_dir,
               fs::copy_options::recursive);
      resumed.resume = true;
      resumed.kfac_replan = true;
      ASSERT_EQ(run_training(resumed, out), 0) << name << ": " << out.str();
      SCOPED_TRACE(placements[from] + " -> " + placements[to]);
      EXPECT_EQ(losses(resumed.metrics), straight_losses(to));
      expect_same_files(latest(resumed.checkpoint_dir),
                        latest(dir_ / ("straight-" + std::to_string(to))));
    }
  }
  // On the device path (its K-FAC layers loaded from the gathered records): sharded state
  // moved to replicated trains on as the CPU path's straight replicated run.
  {
    auto resumed = with("replicate", "device-resumed");
    fs::copy(dir_ / "first-1", resumed.checkpoint_dir, fs::copy_options::recursive);
    resumed.resume = true;
    resumed.kfac_replan = true;
    testing::HostDeviceLaunch device;
    ASSERT_EQ(run_training(resumed, out, device), 0) << out.str();
    EXPECT_EQ(losses(resumed.metrics), straight_losses(0)) << "device path, shard -> replicate";
  }
  std::vector<double> one_stage_sharded;
  // Another layout: one stage of 4 layers, each placement from either checkpoint (sharded, also
  // with the state offloaded to host memory: each rank moves what it holds there).
  for (std::size_t to = 0; to < 3; ++to) {
    std::vector<std::vector<double>> from_each;
    for (std::size_t from = 0; from < 2; ++from) {
      const std::string name = "one-stage-" + std::to_string(from) + "-" + std::to_string(to);
      auto resumed = with(placements[std::min<std::size_t>(to, 1)], name);
      resumed.stages = 1;
      if (to == 2) resumed.kfac.offload = "host";
      fs::copy(dir_ / ("first-" + std::to_string(from)), resumed.checkpoint_dir,
               fs::copy_options::recursive);
      resumed.resume = true;
      ASSERT_EQ(run_training(resumed, out), 0) << name << ": " << out.str();
      from_each.push_back(losses(resumed.metrics));
    }
    EXPECT_EQ(from_each[0].size(), 4U);
    EXPECT_EQ(from_each[0], from_each[1]) << "one stage, target " << to;
    if (to == 2) {
      EXPECT_EQ(from_each[0], one_stage_sharded) << "offloaded";
    }
    if (to == 1) one_stage_sharded = from_each[0];
  }
}

// The same over four replicas, between partial:2 (each Linear's factors on a group of two
// replicas, one of which is the owner) and shard: the resumed run is the straight run of its
// placement, byte for byte.
TEST_F(CheckpointingTest, PartiallyShardedKfacMovesToShardedAtAWindowEnd) {
  auto base = small_run("kfac-partial");
  base.stages = 1;
  base.data_parallel = 4;
  base.steps = 4;
  base.lr_decay_steps = 4;
  base.kfac.enabled = true;
  base.kfac.refresh_steps = 2;
  base.kfac.split = "off";
  base.kfac_profile = kfac_profile(base);
  base.checkpoint_every = 2;
  const std::vector<std::string> placements = {"partial:2", "shard"};
  std::ostringstream out;
  for (const auto& placement : placements) {
    auto straight = base;
    straight.kfac.sharding = placement;
    straight.checkpoint_dir = (dir_ / ("straight-" + placement)).string();
    straight.metrics = straight.checkpoint_dir + ".jsonl";
    ASSERT_EQ(run_training(straight, out), 0) << out.str();
  }
  for (std::size_t from = 0; from < 2; ++from) {
    const auto& to = placements[1 - from];
    auto resumed = base;
    resumed.kfac.sharding = to;
    resumed.checkpoint_dir = (dir_ / ("resumed-" + to)).string();
    resumed.metrics = resumed.checkpoint_dir + ".jsonl";
    fs::copy(dir_ / ("straight-" + placements[from]), resumed.checkpoint_dir,
             fs::copy_options::recursive);
    rewind_to(resumed.checkpoint_dir, 2);
    resumed.resume = true;
    resumed.kfac_replan = true;
    ASSERT_EQ(run_training(resumed, out), 0) << out.str();
    SCOPED_TRACE(placements[from] + " -> " + to);
    auto straight = losses(dir_ / ("straight-" + to + ".jsonl"));
    EXPECT_EQ(losses(resumed.metrics), std::vector<double>(straight.begin() + 4, straight.end()));
    expect_same_files(latest(resumed.checkpoint_dir), latest(dir_ / ("straight-" + to)));
  }
}

// pipefisher_train: a pipelined refresh whose inversions run in the next window, saved at a
// window's end, resumes on another schedule (--kfac-replan --kfac-refresh 3): the checkpoint's
// schedule finishes its refresh first (the summary says so; until 2026-11-30 this was refused)
// and the run trains on, on the CPU path and the device path alike, bit for bit. Saved inside
// a window, it moves dropping the refresh in progress, likewise.
TEST_F(CheckpointingTest, PipelinedRefreshRunningOnIsFinishedBeforeAnotherScheduleTakesOver) {
  auto o = small_run("pipelined-moves");
  o.model = (dir_ / "config4.json").string();
  o.steps = 4;
  o.lr_decay_steps = 8;
  o.kfac.enabled = true;
  o.kfac.refresh_steps = 2;
  o.kfac.pipelined_refresh = "on";
  o.kfac.split = "off";
  o.checkpoint_every = 1;  // steps 3 (inside a window) and 4 (its end) kept
  // The measured profile's layout with fixed times and sizes (a self-profile's, even its
  // K-FAC tasks seen at all, vary from run to run): inversions too long for their own window's
  // bubbles.
  auto profile = nlohmann::json::parse(read_file(kfac_profile(o)));
  for (auto& chunk : profile.at("chunks")) {
    chunk["forward_s"] = 1e-4;
    chunk["backward_s"] = 2e-4;
  }
  profile["communication"]["bandwidth"] = profile["reduction"]["bandwidth"] = 1e8;
  profile["optimizer_step_s"] = 7e-5;
  for (auto& entry : profile.at("kfac")) {
    entry["curvature_a_s"] = entry["curvature_b_s"] = 3e-6;
    entry["precondition_s"] = 1e-6;
    entry["invert_a_s"] = entry["invert_b_s"] = 3e-5;
    entry["bytes"] = 4096.0;
  }
  o.kfac_profile = (dir_ / "profile-long-inversions.json").string();
  std::ofstream(o.kfac_profile) << profile.dump();
  std::ostringstream out;
  ASSERT_EQ(run_training(o, out), 0) << out.str();
  const auto saved = latest(o.checkpoint_dir);
  ASSERT_EQ(saved.filename(), "step-00000004");
  const auto schedule = sched::schedule_from_json(
      nlohmann::json::parse(read_file(saved / "schedule.json")), "schedule.json");
  int wrapped = 0;
  for (const auto& stream : schedule.streams) {
    for (const auto& in : stream) wrapped += sched::is_wrapped(in) ? 1 : 0;
  }
  ASSERT_GT(wrapped, 0) << "no inversion placed in the next window: the test needs one";
  // Resumed from the checkpoint of `step` with --kfac-replan --kfac-refresh 3 to step 8 (into
  // the new schedule's second window, from step 7 for step 4): its summary and losses.
  const auto resume_from = [&](std::int64_t step, bool on_device) {
    auto resumed = o;
    resumed.steps = 8;
    resumed.kfac.refresh_steps = 3;
    resumed.kfac_replan = true;
    resumed.resume = true;
    resumed.quiet = false;
    resumed.checkpoint_dir += "-" + std::to_string(step) + (on_device ? "-device" : "-cpu");
    resumed.metrics = resumed.checkpoint_dir + ".jsonl";
    fs::copy(o.checkpoint_dir, resumed.checkpoint_dir, fs::copy_options::recursive);
    rewind_to(resumed.checkpoint_dir, step);
    std::ostringstream resumed_out;
    EXPECT_EQ(run_training_on(resumed, resumed_out, on_device), 0) << resumed_out.str();
    // No trace of the finishing checkpoint beside the run's.
    EXPECT_FALSE(fs::exists(fs::path(resumed.checkpoint_dir) / ".refresh-finished"));
    const auto steps = losses(resumed.metrics);
    for (const double value : steps) EXPECT_TRUE(std::isfinite(value));
    return std::pair{resumed_out.str(), steps};
  };
  std::vector<std::vector<double>> resumed_losses;
  for (const bool on_device : {false, true}) {
    const auto [summary, steps] = resume_from(4, on_device);
    EXPECT_NE(summary.find("the checkpoint's schedule finishes its refresh"), std::string::npos)
        << summary;
    EXPECT_NE(summary.find("K-FAC refresh every 3 step(s)"), std::string::npos);
    EXPECT_EQ(steps.size(), 8U);  // steps 5-8
    resumed_losses.push_back(steps);
  }
  EXPECT_EQ(resumed_losses[0], resumed_losses[1]) << "the device path differs from the CPU path";

  // From step 3, inside a window: the previous refresh's work in it is done (before the
  // window's first preconditioning), and the refresh in progress is dropped.
  std::vector<std::vector<double>> inside_losses;
  for (const bool on_device : {false, true}) {
    const auto [summary, steps] = resume_from(3, on_device);
    EXPECT_NE(summary.find("drops that refresh's curvature so far"), std::string::npos) << summary;
    EXPECT_EQ(summary.find("finishes its refresh"), std::string::npos);
    EXPECT_EQ(steps.size(), 10U);  // steps 4-8
    inside_losses.push_back(steps);
  }
  EXPECT_EQ(inside_losses[0], inside_losses[1]) << "inside a window: the device path differs";
}

TEST_F(CheckpointingTest, RefusesMismatchedCorruptAndTruncatedCheckpoints) {
  auto o = small_run("refuse");
  o.steps = 2;
  std::ostringstream out;
  ASSERT_EQ(run_training(o, out), 0);
  auto resumed = o;
  resumed.steps = 4;
  resumed.resume = true;

  auto other = resumed;
  other.model = (dir_ / "wide.json").string();
  expect_refused(other, {"state.json", "hidden_size", "16", "32"});
  other = resumed;
  other.micro_batch_size = 3;
  expect_refused(other, {"state.json", "global_batch", "micro_batch_size"});
  other = resumed;
  other.data_parallel = 2;
  expect_refused(other, {"global_batch", "data_parallel"});
  other = resumed;
  other.steps = 2;
  expect_refused(other, {"at step 2 already"});
  other = resumed;
  other.checkpoint_dir = (dir_ / "empty").string();
  expect_refused(other, {"no checkpoint in"});

  const auto step_dir = latest(o.checkpoint_dir);
  const auto model = step_dir / "model.safetensors";
  const std::string good = read_file(model);
  std::string bad = good;
  bad[bad.size() / 2] = static_cast<char>(bad[bad.size() / 2] ^ 0x40);
  std::ofstream(model, std::ios::binary | std::ios::trunc) << bad;
  expect_refused(resumed, {"model.safetensors"});
  std::ofstream(model, std::ios::binary | std::ios::trunc) << good;
  const auto optimizer = step_dir / "optimizer.safetensors";
  fs::resize_file(optimizer, fs::file_size(optimizer) / 2);
  expect_refused(resumed, {"optimizer.safetensors"});
}

// A process killed in the middle of a save (after the new step directory is renamed into
// place, before `latest` names it) leaves the previous checkpoint, and resuming from it gives
// the same result as a run never interrupted.
TEST_F(CheckpointingTest, KilledDuringSaveResumesFromLastGood) {
  auto o = small_run("killed");
  o.checkpoint_every = 2;
  o.metrics.clear();
  const auto config = model::resolve_bert_config(o.model);
  cli::CompileCommandOptions compile;
  compile.schedule = o.schedule;
  compile.stages = o.stages;
  compile.microbatches = o.microbatches;
  compile.layers = config.num_layers;
  compile.activation_bytes = compile.gradient_bytes = 1024;
  const auto identity = run_identity(o, config, o.seq_len, 2, o.microbatches, 1, {});
  const auto make_setup = [&](exec::BatchSource& batches) {
    exec::RunSetup<float> setup;
    setup.config = config;
    setup.schedule = cli::build_schedule(compile);
    setup.options.init_seed = 5;
    setup.options.dropout_seed = 6;
    setup.make_optimizer = [] { return std::make_unique<optim::BasicLamb<float>>(); };
    setup.learning_rate = [](std::int64_t step) { return 1e-3 * static_cast<double>(step + 1); };
    setup.batches = &batches;
    return setup;
  };

  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    exec::SyntheticBatches batches(config, o.micro_batch_size, o.seq_len, 2, 9);
    exec::ThreadedExecutor<float> executor(make_setup(batches));
    ckpt::SaveOptions save;
    save.after_phase = [](ckpt::SavePhase phase, const fs::path& path) {
      if (phase == ckpt::SavePhase::kRenamed && path.filename() == "step-00000004") ::_exit(0);
    };
    run_with_checkpoints(executor, o, 0, identity, nullptr, {}, save);
    ::_exit(3);  // not killed: the test fails below
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0);
  EXPECT_TRUE(fs::exists(fs::path(o.checkpoint_dir) / "step-00000004"));  // never committed

  const auto checkpoint = load_resume_checkpoint(o.checkpoint_dir, identity);
  EXPECT_EQ(checkpoint.step, 2);
  {
    exec::SyntheticBatches batches(config, o.micro_batch_size, o.seq_len, 2, 9);
    exec::ThreadedExecutor<float> executor(make_setup(batches));
    restore_checkpoint(executor, checkpoint);
    run_with_checkpoints(executor, o, checkpoint.step, identity, nullptr, {});
  }
  auto straight = o;
  straight.checkpoint_dir += "-straight";
  {
    exec::SyntheticBatches batches(config, o.micro_batch_size, o.seq_len, 2, 9);
    exec::ThreadedExecutor<float> executor(make_setup(batches));
    run_with_checkpoints(executor, straight, 0, identity, nullptr, {});
  }
  const auto a = latest(o.checkpoint_dir), b = latest(straight.checkpoint_dir);
  EXPECT_EQ(a.filename(), "step-00000006");
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    EXPECT_TRUE(read_file(a / file) == read_file(b / file)) << file;
  }
}

int run_program(const std::string& arguments) {
  const int status = std::system(
      (std::string(PF_TRAIN_BINARY) + " " + arguments + " > /dev/null 2> /dev/null").c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST_F(CheckpointingTest, ProgramResumesToTheSameWeights) {
  const std::string common = "--model " + (dir_ / "config.json").string() +
                             " --data synthetic --seq-len 12 --lr-decay-steps 8 --quiet"
                             " --checkpoint-dir ";
  const auto a = dir_ / "cli", b = dir_ / "cli-straight";
  ASSERT_EQ(run_program(common + a.string() + " --micro-batch-size 2 --steps 4"), 0);
  ASSERT_EQ(run_program(common + a.string() + " --micro-batch-size 2 --steps 8 --resume"), 0);
  ASSERT_EQ(run_program(common + b.string() + " --micro-batch-size 2 --steps 8"), 0);
  EXPECT_EQ(latest(a).filename(), "step-00000008");
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    EXPECT_TRUE(read_file(latest(a) / file) == read_file(latest(b) / file)) << file;
  }
  // A mismatched resume (another global batch) is bad input: exit status 2, nothing written.
  EXPECT_EQ(run_program(common + a.string() + " --micro-batch-size 3 --steps 12 --resume"), 2);
  EXPECT_EQ(latest(a).filename(), "step-00000008");
}

}  // namespace
}  // namespace pf::train
