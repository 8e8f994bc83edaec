// Held-out evaluation (runtime/train/evaluation.h): the metrics against a hand computation, the
// forward over pipeline chunks against the whole model and the model's own loss, the copy out of
// a running executor, and pipefisher_train's --eval-data/--eval-every/--target-loss (pausing
// for evaluation does not change the training it interrupts).
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "runtime/device/host_device_runtime.h"
#include "runtime/executor/batch_source.h"
#include "runtime/optim/adamw.h"
#include "runtime/optim/lamb.h"
#include "runtime/train/evaluation.h"
#include "runtime/train/trainer.h"
#include "scheduler/compile.h"
#include "tests/executor/host_device_launch.h"

namespace pf::train {
namespace {

namespace fs = std::filesystem;

TEST(Evaluation, MetricsMatchAHandComputation) {
  // Two sequences, two masked slots each (the second of each is padding), a vocabulary of 3.
  model::Batch batch;
  batch.batch_size = 2;
  batch.seq_len = 4;
  batch.max_predictions = 2;
  batch.masked_lm_ids = {1, 2, 0, 1};
  batch.masked_lm_weights = {1.0F, 0.0F, 1.0F, 0.0F};
  batch.next_sentence_labels = {1, 0};
  const double ln2 = std::log(2.0), ln3 = std::log(3.0);
  // Slot 0: softmax(0, ln 2, 0) = (1/4, 1/2, 1/4), label 1: loss ln 2, argmax 1 (right).
  // Slot 2: uniform, label 0: loss ln 3, argmax 0 (ties go to the lowest index, right).
  // Padding rows hold values that would change every figure were they counted.
  const std::vector<double> mlm = {0, ln2, 0, 50, -50, 9, 1, 1, 1, 7, 0, 0};
  // Sequence 0: softmax(ln 3, 0) = (3/4, 1/4), label 1: loss ln 4, argmax 0 (wrong).
  // Sequence 1: uniform, label 0: loss ln 2, argmax 0 (right).
  const std::vector<double> nsp = {ln3, 0, 0, 0};
  EvalMetrics metrics;
  accumulate_predictions<double>({mlm.data(), 4, 3}, {nsp.data(), 2, 2}, batch, metrics);
  EXPECT_DOUBLE_EQ(metrics.mlm_predictions, 2.0);
  EXPECT_NEAR(metrics.mlm_loss(), (ln2 + ln3) / 2, 1e-12);
  EXPECT_DOUBLE_EQ(metrics.mlm_accuracy(), 1.0);
  EXPECT_NEAR(metrics.nsp_loss(), (std::log(4.0) + ln2) / 2, 1e-12);
  EXPECT_DOUBLE_EQ(metrics.nsp_accuracy(), 0.5);
  EXPECT_NEAR(metrics.loss(), metrics.mlm_loss() + metrics.nsp_loss(), 1e-15);

  const std::vector<double> wrong_nsp = {0, 0, 0};
  EXPECT_THROW(
      accumulate_predictions<double>({mlm.data(), 4, 3}, {wrong_nsp.data(), 1, 3}, batch, metrics),
      std::invalid_argument);
}

model::BertConfig tiny_config() {
  model::BertConfig config;
  config.name = "test";
  config.vocab_size = 31;
  config.hidden_size = 8;
  config.num_layers = 2;
  config.num_heads = 2;
  config.intermediate_size = 12;
  config.max_position_embeddings = 12;
  config.type_vocab_size = 2;
  config.hidden_dropout = 0.1F;
  config.attention_dropout = 0.1F;
  return config;
}

TEST(Evaluation, PipelineChunksEqualTheWholeModelAndItsOwnLoss) {
  const auto config = tiny_config();
  tensor::CpuBackend backend;
  auto whole = model::make_chunks<double>(config, {model::whole_model(config)}, backend, 5);
  auto split =
      model::make_chunks<double>(config, {{0, 1, true, false}, {1, 1, false, true}}, backend, 5);
  exec::SyntheticBatches source(config, 3, 10, 2, 17);
  std::vector<std::shared_ptr<const model::Batch>> batches = {source.batch(0, 0),
                                                              source.batch(0, 1)};
  const auto metrics = evaluate_chunks<double>({whole[0].get()}, batches);
  const auto pipelined = evaluate_chunks<double>({split[0].get(), split[1].get()}, batches);
  EXPECT_NEAR(pipelined.mlm_loss(), metrics.mlm_loss(), 1e-12);
  EXPECT_NEAR(pipelined.nsp_loss(), metrics.nsp_loss(), 1e-12);
  EXPECT_DOUBLE_EQ(pipelined.mlm_accuracy(), metrics.mlm_accuracy());
  EXPECT_DOUBLE_EQ(pipelined.sequences, 6.0);

  // One batch at a time equals the model's own (dropout-free) loss of that batch.
  model::ForwardOptions eval_mode;
  eval_mode.training = false;
  for (const auto& batch : batches) {
    const auto own = whole[0]->forward(0, *batch, {}, eval_mode).losses.value();
    whole[0]->discard(0);
    const auto one = evaluate_chunks<double>({whole[0].get()}, {batch});
    EXPECT_NEAR(one.mlm_loss(), own.mlm, 1e-10);
    EXPECT_NEAR(one.nsp_loss(), own.nsp, 1e-10);
  }
  EXPECT_EQ(whole[0]->in_flight(), 0);
}

TEST(Evaluation, CopiesTheTrainedWeightsOutOfTheExecutor) {
  const auto config = tiny_config();
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = 2;
  params.microbatches = 2;
  params.num_layers = config.num_layers;
  exec::SyntheticBatches train_batches(config, 2, 10, 2, 3);
  exec::RunSetup<float> setup;
  setup.config = config;
  setup.schedule = sched::compile(params);
  setup.options.init_seed = 9;
  setup.options.wait_timeout = std::chrono::seconds(60);
  setup.make_optimizer = [] { return std::make_unique<optim::BasicLamb<float>>(); };
  setup.learning_rate = [](std::int64_t) { return 0.05; };
  setup.batches = &train_batches;
  exec::ThreadedExecutor<float> executor(setup);

  exec::SyntheticBatches eval_source(config, 4, 10, 2, 99);
  std::vector<std::shared_ptr<const model::Batch>> batches = {eval_source.batch(0, 0),
                                                              eval_source.batch(0, 1)};
  Evaluator<float> evaluator(config, batches);
  // Before training: the executor's model is the one its seed initialises.
  tensor::CpuBackend backend;
  auto fresh = model::make_chunks<float>(config, {model::whole_model(config)}, backend, 9);
  const auto initial = evaluator.evaluate(executor);
  EXPECT_NEAR(initial.loss(), evaluate_chunks<float>({fresh[0].get()}, batches).loss(), 1e-5);

  executor.run(0, 3);
  const auto trained = evaluator.evaluate(executor);
  // The executor's own chunks, run in pipeline order (the head keeps its tied decoder copy).
  const auto direct = evaluate_chunks<float>(
      {executor.worker(0).chunks().at(0), executor.worker(1).chunks().at(0)}, batches);
  EXPECT_NEAR(trained.loss(), direct.loss(), 1e-5);
  EXPECT_DOUBLE_EQ(trained.mlm_accuracy(), direct.mlm_accuracy());
  EXPECT_GT(std::abs(trained.loss() - initial.loss()), 1e-4);  // the weights did move
}

// On the executor's device path (device::HostDeviceRuntime: the CPU backend) the evaluator's
// whole-model copy lives on the run's device, the parameters copied there and the logits read
// back through the backend: the metrics equal the CPU path's bit for bit (AdamW trains both
// paths to the same bits).
TEST(Evaluation, OnTheDevicePathEqualsTheCpuPath) {
  const auto config = tiny_config();
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = 2;
  params.microbatches = 2;
  params.num_layers = config.num_layers;
  exec::SyntheticBatches eval_source(config, 4, 10, 2, 99);
  const std::vector<std::shared_ptr<const model::Batch>> batches = {eval_source.batch(0, 0),
                                                                    eval_source.batch(0, 1)};
  const auto trained_metrics = [&](const std::shared_ptr<device::DeviceRuntime>& runtime) {
    exec::SyntheticBatches train_batches(config, 2, 10, 2, 3);
    exec::RunSetup<float> setup;
    setup.config = config;
    setup.schedule = sched::compile(params);
    setup.options.init_seed = 9;
    setup.options.wait_timeout = std::chrono::seconds(60);
    setup.make_optimizer = [] { return std::make_unique<optim::BasicAdamW<float>>(); };
    setup.device = runtime;
    setup.device_optimizer.name = "adamw";
    setup.learning_rate = [](std::int64_t) { return 0.05; };
    setup.batches = &train_batches;
    exec::ThreadedExecutor<float> executor(setup);
    executor.run(0, 3);
    Evaluator<float> evaluator(config, batches, runtime);
    return evaluator.evaluate(executor);
  };
  const auto cpu = trained_metrics(nullptr);
  const auto device = trained_metrics(std::make_shared<device::HostDeviceRuntime>());
  EXPECT_EQ(device.mlm_loss_sum, cpu.mlm_loss_sum);
  EXPECT_EQ(device.mlm_correct, cpu.mlm_correct);
  EXPECT_EQ(device.mlm_predictions, cpu.mlm_predictions);
  EXPECT_EQ(device.nsp_loss_sum, cpu.nsp_loss_sum);
  EXPECT_EQ(device.nsp_correct, cpu.nsp_correct);
  EXPECT_EQ(device.sequences, 8.0);
  EXPECT_GT(device.mlm_predictions, 0.0);
  // A double model has no device evaluation.
  EXPECT_THROW(Evaluator<double>(config, batches, std::make_shared<device::HostDeviceRuntime>()),
               std::invalid_argument);
}

class EvalTrainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("pf_eval_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
    std::ofstream(dir_ / "config.json") << R"({"vocab_size": 64, "hidden_size": 16,
      "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32,
      "max_position_embeddings": 32, "type_vocab_size": 2, "hidden_dropout_prob": 0.1,
      "attention_probs_dropout_prob": 0.1, "model_type": "bert"})";
  }
  void TearDown() override { fs::remove_all(dir_); }

  TrainOptions small_run(const std::string& metrics) const {
    TrainOptions o;
    o.model = (dir_ / "config.json").string();
    o.data = "synthetic";
    o.seq_len = 12;
    o.micro_batch_size = 2;
    o.stages = 2;
    o.microbatches = 4;
    o.steps = 5;
    o.wait_timeout_s = 60;
    o.quiet = true;
    o.metrics = (dir_ / metrics).string();
    return o;
  }

  static std::vector<nlohmann::json> records(const std::string& path, const std::string& kind) {
    std::ifstream in(path);
    std::vector<nlohmann::json> result;
    std::string line;
    while (std::getline(in, line)) {
      auto record = nlohmann::json::parse(line);
      if (record.value("kind", std::string("step")) == kind) result.push_back(record);
    }
    return result;
  }

  fs::path dir_;
};

TEST_F(EvalTrainTest, PausingToEvaluateLeavesTrainingUnchanged) {
  // K-FAC refreshed every 2 steps, evaluated every 3: the pauses fall inside refresh rounds.
  auto plain = small_run("plain.jsonl");
  plain.kfac.enabled = true;
  plain.kfac.refresh_steps = 2;
  std::ostringstream out;
  // Both runs place K-FAC work from one measured profile: a self-profile's timings vary with
  // the machine's load, and so would the pass's placement and the curvature sums' order.
  auto profiling = plain;
  profiling.steps = 2;
  profiling.metrics.clear();
  profiling.profile_out = (dir_ / "profile.json").string();
  ASSERT_EQ(run_training(profiling, out), 0);
  plain.kfac_profile = profiling.profile_out;
  ASSERT_EQ(run_training(plain, out), 0);
  auto evaluated = plain;
  evaluated.metrics = (dir_ / "evaluated.jsonl").string();
  evaluated.eval_data = "synthetic";
  evaluated.eval_every = 3;
  evaluated.eval_batches = 2;
  ASSERT_EQ(run_training(evaluated, out), 0);

  const auto a = records(plain.metrics, "step");
  const auto b = records(evaluated.metrics, "step");
  ASSERT_EQ(a.size(), 5U);
  ASSERT_EQ(b.size(), 5U);
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].at("loss").get<double>(), b[i].at("loss").get<double>()) << "step " << i + 1;
    EXPECT_EQ(a[i].at("grad_norm").get<double>(), b[i].at("grad_norm").get<double>());
    EXPECT_EQ(a[i].at("kfac_refresh").get<bool>(), b[i].at("kfac_refresh").get<bool>());
    EXPECT_GT(b[i].at("train_time_s").get<double>(), 0.0);
  }
  const auto evals = records(evaluated.metrics, "eval");
  ASSERT_EQ(evals.size(), 2U);  // after step 3 and at the end
  EXPECT_EQ(evals[0].at("step").get<int>(), 3);
  EXPECT_EQ(evals[1].at("step").get<int>(), 5);
  EXPECT_EQ(evals[0].at("eval_sequences").get<double>(), 4.0);
  for (const auto& e : evals) {
    EXPECT_GT(e.at("eval_mlm_loss").get<double>(), 0.0);
    EXPECT_GE(e.at("eval_mlm_accuracy").get<double>(), 0.0);
    EXPECT_LE(e.at("eval_nsp_accuracy").get<double>(), 1.0);
  }
  const auto kfac = records(evaluated.metrics, "kfac");
  ASSERT_EQ(kfac.size(), 2U);
  EXPECT_EQ(kfac[1].at("refresh_steps").get<int>(), 2);
  EXPECT_GT(kfac[1].at("layers").get<int>(), 0);
  EXPECT_GE(kfac[1].at("refreshes_min").get<int>(), 1);
  EXPECT_GT(kfac[1].at("pi_median").get<double>(), 0.0);
  EXPECT_EQ(kfac[1].at("cholesky_fallbacks").get<int>(), 0);
}

// pipefisher_train's held-out evaluation on the device path (what --device cuda runs; here on
// the CPU backend through HostDeviceRuntime): every evaluation record and every step's loss
// equal the CPU path's run bit for bit (AdamW), K-FAC in the bubbles and pauses inside refresh
// rounds included.
TEST_F(EvalTrainTest, OnTheDevicePathEqualsTheCpuPath) {
  auto cpu = small_run("cpu.jsonl");
  cpu.optimizer = "adamw";
  cpu.kfac.enabled = true;
  cpu.kfac.refresh_steps = 2;
  cpu.eval_data = "synthetic";
  cpu.eval_every = 3;
  cpu.eval_batches = 2;
  // Whole K-FAC tasks: each run self-profiles, so one run's plan could divide an inversion the
  // other's keeps whole (a chain and a whole inversion agree only to rounding).
  cpu.kfac.split = "off";
  std::ostringstream out;
  auto profiling = cpu;
  profiling.steps = 2;
  profiling.metrics.clear();
  profiling.eval_data.clear();
  profiling.eval_every = 0;
  profiling.profile_out = (dir_ / "profile.json").string();
  ASSERT_EQ(run_training(profiling, out), 0);
  cpu.kfac_profile = profiling.profile_out;
  ASSERT_EQ(run_training(cpu, out), 0);
  auto on_device = cpu;
  on_device.metrics = (dir_ / "device.jsonl").string();
  testing::HostDeviceLaunch device;
  ASSERT_EQ(run_training(on_device, out, device), 0);

  const auto a = records(cpu.metrics, "eval");
  const auto b = records(on_device.metrics, "eval");
  ASSERT_EQ(a.size(), 2U);
  ASSERT_EQ(b.size(), 2U);
  for (std::size_t i = 0; i < a.size(); ++i) {
    for (const char* field : {"step", "eval_loss", "eval_mlm_loss", "eval_mlm_accuracy",
                              "eval_nsp_loss", "eval_nsp_accuracy", "eval_sequences"}) {
      EXPECT_EQ(a[i].at(field), b[i].at(field)) << field << " of evaluation " << i;
    }
  }
  const auto steps_a = records(cpu.metrics, "step");
  const auto steps_b = records(on_device.metrics, "step");
  ASSERT_EQ(steps_a.size(), steps_b.size());
  for (std::size_t i = 0; i < steps_a.size(); ++i) {
    EXPECT_EQ(steps_a[i].at("loss"), steps_b[i].at("loss")) << "step " << i + 1;
  }
}

TEST_F(EvalTrainTest, StopsAtTheTargetLoss) {
  auto o = small_run("target.jsonl");
  o.steps = 6;
  o.eval_data = "synthetic";
  o.eval_every = 2;
  o.eval_batches = 1;
  o.target_loss = 1000.0;  // any held-out loss reaches it: stop at the first evaluation
  std::ostringstream out;
  ASSERT_EQ(run_training(o, out), 0);
  EXPECT_NE(out.str().find("target loss 1000.0000 reached at step 2"), std::string::npos)
      << out.str();
  EXPECT_EQ(records(o.metrics, "step").size(), 2U);
  EXPECT_EQ(records(o.metrics, "eval").size(), 1U);
}

TEST_F(EvalTrainTest, RefusesIncompleteEvaluationOptions) {
  auto o = small_run("refused.jsonl");
  o.target_loss = 5.0;
  std::ostringstream out;
  EXPECT_THROW(run_training(o, out), std::invalid_argument);  // no held-out set
  o.target_loss = 0.0;
  o.eval_every = 2;
  EXPECT_THROW(run_training(o, out), std::invalid_argument);  // --eval-every without data
  o.eval_data = (dir_ / "missing").string();
  EXPECT_THROW(run_training(o, out), std::invalid_argument);
  EXPECT_FALSE(fs::exists(o.metrics));
}

}  // namespace
}  // namespace pf::train
