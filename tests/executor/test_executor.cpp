// The runtime's proof: pipelined execution of every schedule equals single-worker training.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <ostream>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/comm/in_process.h"
#include "runtime/executor/executor.h"
#include "runtime/executor/measured.h"
#include "runtime/optim/adamw.h"
#include "runtime/optim/lamb.h"
#include "scheduler/compile.h"
#include "scheduler/pipefisher/pass.h"
#include "scheduler/placement.h"
#include "scheduler/torch_csv.h"
#include "scheduler/validate.h"
#include "sim/measured_cost_model.h"
#include "sim/simulator.h"
#include "sim/uniform_cost_model.h"
#include "tests/executor/kfac_test_schedule.h"
#include "tests/executor/offload_plan.h"
#include "tests/executor/reference_trainer.h"

namespace pf::exec {
namespace {

using testing::linear_dims_of;

model::BertConfig test_config(int layers) {
  model::BertConfig config;
  config.name = "test";
  config.vocab_size = 29;
  config.hidden_size = 8;
  config.num_layers = layers;
  config.num_heads = 2;
  config.intermediate_size = 12;
  config.max_position_embeddings = 10;
  config.type_vocab_size = 2;
  config.hidden_dropout = 0.1F;
  config.attention_dropout = 0.1F;
  return config;
}

constexpr std::int64_t kMicroBatchSize = 2, kSeqLen = 6, kPredictions = 2;
constexpr std::uint64_t kInitSeed = 7, kDropoutSeed = 11, kDataSeed = 13;

double learning_rate(std::int64_t step) {
  return 1e-2 * (1.0 + 0.5 * static_cast<double>(step));
}

template <typename T>
RunSetup<T> make_setup(const model::BertConfig& config, sched::Schedule schedule,
                       BatchSource& batches) {
  RunSetup<T> setup;
  setup.config = config;
  setup.schedule = std::move(schedule);
  setup.options.init_seed = kInitSeed;
  setup.options.dropout_seed = kDropoutSeed;
  setup.options.wait_timeout = std::chrono::seconds(60);
  setup.make_optimizer = [] {
    return std::make_unique<optim::BasicLamb<T>>(optim::LambOptions{.max_grad_norm = 0.5});
  };
  setup.learning_rate = learning_rate;
  setup.batches = &batches;
  return setup;
}

// Largest |a - b| / max(max |b| of the tensor, 1e-3) over every parameter of every rank's chunks.
template <typename T>
double max_relative_difference(ThreadedExecutor<T>& executor, model::BertChunk<T>& reference) {
  const auto [word, decoder] = model::tied_parameter_names();
  double worst = 0.0;
  for (int r = 0; r < executor.num_ranks(); ++r) {
    for (auto* chunk : executor.worker(r).chunks()) {
      for (const auto& p : chunk->parameters()) {
        auto expected = reference.parameter(p.name == decoder ? word : p.name);
        EXPECT_TRUE(expected) << p.name;
        if (!expected) continue;
        double scale = 0.0, diff = 0.0;
        for (std::int64_t i = 0; i < p.size; ++i) {
          scale = std::max(scale, std::abs(static_cast<double>(expected->value[i])));
          diff = std::max(diff, std::abs(static_cast<double>(p.value[i] - expected->value[i])));
        }
        // Floor: the key biases get no gradient (softmax ignores a shift of every key) and stay at
        // rounding noise of 1e-18, where a relative difference means nothing.
        worst = std::max(worst, diff / std::max(scale, 1e-3));
      }
    }
  }
  return worst;
}

// Trains the single-worker reference (LAMB, the same seeds and learning rates) for `steps` steps
// of `microbatches_per_step` micro-batches and returns max_relative_difference against it.
template <typename T>
double difference_from_reference(ThreadedExecutor<T>& executor, const model::BertConfig& config,
                                 BatchSource& batches, std::int64_t steps,
                                 int microbatches_per_step) {
  testing::ReferenceTrainer<T> reference(
      config, kInitSeed, kDropoutSeed,
      std::make_unique<optim::BasicLamb<T>>(optim::LambOptions{.max_grad_norm = 0.5}),
      learning_rate);
  for (std::int64_t step = 0; step < steps; ++step) {
    reference.step(step, batches, microbatches_per_step);
  }
  return max_relative_difference(executor, reference.model());
}

// Largest |update - reference update| / max |reference update| of the tensor, where an update
// is the parameter's change since `initial`.
double max_relative_update_difference(ThreadedExecutor<float>& executor,
                                      model::BertChunk<float>& reference,
                                      const std::map<std::string, std::vector<float>>& initial,
                                      double min_update) {
  const auto [word, decoder] = model::tied_parameter_names();
  double worst = 0.0;
  for (int r = 0; r < executor.num_ranks(); ++r) {
    for (auto* chunk : executor.worker(r).chunks()) {
      for (const auto& p : chunk->parameters()) {
        const std::string name = p.name == decoder ? word : p.name;
        auto expected = reference.parameter(name);
        const auto& start = initial.at(name);
        double scale = 0.0, diff = 0.0;
        for (std::int64_t i = 0; i < p.size; ++i) {
          const auto index = static_cast<std::size_t>(i);
          const double reference_update = double{expected->value[i]} - start[index];
          scale = std::max(scale, std::abs(reference_update));
          diff = std::max(diff, std::abs(double{p.value[i]} - start[index] - reference_update));
        }
        // Tensors that barely move are left out: the key biases' gradient is exactly zero (the
        // softmax ignores a shift of every key), so theirs is rounding noise, which K-FAC's
        // inverse and LAMB's normalization turn into steps of random sign.
        if (scale > min_update) worst = std::max(worst, diff / scale);
      }
    }
  }
  return worst;
}

struct Case {
  sched::ScheduleKind kind;
  int workers;
  int chunks_per_worker;
  bool split_backward;
  int data_parallel;
};

std::string name_of(const Case& c) {
  return std::string(sched::to_string(c.kind)) + "_p" + std::to_string(c.workers) + "_v" +
         std::to_string(c.chunks_per_worker) + (c.split_backward ? "_split" : "") + "_dp" +
         std::to_string(c.data_parallel);
}

// Names the case in test listings (the default prints its bytes, padding included).
void PrintTo(const Case& c, std::ostream* os) {
  *os << name_of(c);
}

class PipelinedEqualsSingleWorker : public ::testing::TestWithParam<Case> {};

TEST_P(PipelinedEqualsSingleWorker, InDouble) {
  const Case c = GetParam();
  const int layers = 8;
  const auto config = test_config(layers);
  sched::ScheduleParams params;
  params.kind = c.kind;
  params.workers = c.workers;
  params.microbatches = 4;
  params.chunks_per_worker = c.chunks_per_worker;
  params.num_layers = layers;
  params.data_parallel = c.data_parallel;
  params.split_backward = c.split_backward;
  SyntheticBatches batches(config, kMicroBatchSize, kSeqLen, kPredictions, kDataSeed);
  ThreadedExecutor<double> executor(make_setup<double>(config, sched::compile(params), batches));
  std::vector<StepResult> results;
  executor.run(0, 3, [&](const StepResult& r) { results.push_back(r); });

  EXPECT_LT(difference_from_reference(executor, config, batches, 3,
                                      params.microbatches * params.data_parallel),
            1e-12);
  ASSERT_EQ(results.size(), 3U);
  for (std::size_t i = 0; i < results.size(); ++i) {
    EXPECT_EQ(results[i].step, static_cast<std::int64_t>(i));
    EXPECT_GT(results[i].mlm_loss, 0.0);
    EXPECT_GT(results[i].nsp_loss, 0.0);
    EXPECT_GT(results[i].grad_norm, 0.0);
  }
  // Nothing is left alive after the run: activations, messages, captures.
  for (int r = 0; r < executor.num_ranks(); ++r) {
    EXPECT_EQ(executor.worker(r).transient_memory().total(), 0U) << "rank " << r;
  }
  EXPECT_EQ(executor.pending_messages(), 0U);
}

// Uneven layers per chunk (--layers-per-stage): the pipelined run still equals one worker.
TEST(PipelinedEqualsSingleWorkerUneven, InDouble) {
  const int layers = 8;
  const auto config = test_config(layers);
  struct UnevenCase {
    sched::ScheduleKind kind;
    int workers;
    int chunks_per_worker;
    std::vector<int> counts;
  };
  for (const UnevenCase& c : {UnevenCase{sched::ScheduleKind::kOneFOneB, 2, 1, {7, 1}},
                              UnevenCase{sched::ScheduleKind::kOneFOneB, 2, 1, {1, 7}},
                              UnevenCase{sched::ScheduleKind::kInterleaved, 2, 2, {3, 1, 3, 1}},
                              UnevenCase{sched::ScheduleKind::kChimera, 2, 1, {6, 2}}}) {
    SCOPED_TRACE(std::string(sched::to_string(c.kind)) + " " +
                 sched::format_layer_counts(c.counts));
    sched::ScheduleParams params;
    params.kind = c.kind;
    params.workers = c.workers;
    params.microbatches = 4;
    params.chunks_per_worker = c.chunks_per_worker;
    params.num_layers = layers;
    params.layers_per_chunk = c.counts;
    const sched::Schedule schedule = sched::compile(params);
    ASSERT_EQ(schedule.placement.at(0, 0).num_layers, c.counts.front());
    SyntheticBatches batches(config, kMicroBatchSize, kSeqLen, kPredictions, kDataSeed);
    ThreadedExecutor<double> executor(make_setup<double>(config, schedule, batches));
    executor.run(0, 3, [](const StepResult&) {});
    EXPECT_LT(difference_from_reference(executor, config, batches, 3, params.microbatches), 1e-12);
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, PipelinedEqualsSingleWorker,
                         ::testing::Values(Case{sched::ScheduleKind::kGPipe, 1, 1, false, 1},
                                           Case{sched::ScheduleKind::kGPipe, 2, 1, false, 1},
                                           Case{sched::ScheduleKind::kGPipe, 4, 1, false, 2},
                                           Case{sched::ScheduleKind::kOneFOneB, 1, 1, false, 2},
                                           Case{sched::ScheduleKind::kOneFOneB, 2, 1, false, 1},
                                           Case{sched::ScheduleKind::kOneFOneB, 4, 1, false, 1},
                                           Case{sched::ScheduleKind::kOneFOneB, 2, 1, false, 2},
                                           Case{sched::ScheduleKind::kOneFOneB, 4, 1, true, 1},
                                           Case{sched::ScheduleKind::kOneFOneB, 2, 1, true, 2},
                                           Case{sched::ScheduleKind::kInterleaved, 1, 2, false, 1},
                                           Case{sched::ScheduleKind::kInterleaved, 2, 2, false, 1},
                                           Case{sched::ScheduleKind::kInterleaved, 4, 2, false, 1},
                                           Case{sched::ScheduleKind::kInterleaved, 2, 2, true, 2},
                                           Case{sched::ScheduleKind::kChimera, 2, 1, false, 1},
                                           Case{sched::ScheduleKind::kChimera, 4, 1, false, 1},
                                           Case{sched::ScheduleKind::kChimera, 4, 1, false, 2},
                                           Case{sched::ScheduleKind::kZeroBubbleH1, 4, 1, true, 1},
                                           Case{sched::ScheduleKind::kZeroBubbleH2, 4, 1, true, 1},
                                           Case{sched::ScheduleKind::kZeroBubbleH2, 2, 1, true, 2},
                                           Case{sched::ScheduleKind::kZeroBubbleV, 2, 2, true, 1},
                                           Case{sched::ScheduleKind::kZeroBubbleV, 4, 2, true, 1}),
                         [](const ::testing::TestParamInfo<Case>& case_info) {
                           return name_of(case_info.param);
                         });

TEST(Executor, FloatWithinTolerance) {
  const auto config = test_config(4);
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = 4;
  params.microbatches = 8;
  SyntheticBatches batches(config, kMicroBatchSize, kSeqLen, kPredictions, kDataSeed);
  ThreadedExecutor<float> executor(make_setup<float>(config, sched::compile(params), batches));
  executor.run(0, 4);
  // fp32 sums in another order: a few ulps per step, amplified a little by LAMB's division.
  EXPECT_LT(difference_from_reference(executor, config, batches, 4, 8), 1e-5);
}

TEST(Executor, TorchCsvScheduleRuns) {
  const auto config = test_config(4);
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = 2;
  params.microbatches = 4;
  params.num_layers = 4;
  params.split_backward = true;
  const std::string csv = sched::to_torch_csv(sched::compile(params), false);
  sched::TorchCsvImportOptions import;
  import.num_layers = 4;
  const auto schedule = sched::schedule_from_torch_csv(csv, "test.csv", import);
  SyntheticBatches batches(config, kMicroBatchSize, kSeqLen, kPredictions, kDataSeed);
  ThreadedExecutor<double> executor(make_setup<double>(config, schedule, batches));
  executor.run(0, 2);
  EXPECT_LT(difference_from_reference(executor, config, batches, 2, 4), 1e-12);
}

using testing::kfac_test_costs;

// K-FAC in the bubbles (the PipeFisher pass's k-step schedule) equals the same K-FAC updates
// run in sequence after each step.
// long_tasks: K-FAC tasks longer than the gaps, so that the pass cuts them into pieces (the
// schedule must then hold pieces of curvature, inversion and preconditioning).
// pipelined: --kfac-pipelined-refresh on, with a plan that runs inversions in the next window.
void check_kfac(sched::ScheduleKind kind, int workers, int refresh_steps, int data_parallel,
                int chunks_per_worker = 1, bool long_tasks = false, bool move_weights = false,
                bool pipelined = false) {
  const auto config = test_config(4);
  sched::ScheduleParams params;
  params.kind = kind;
  params.workers = workers;
  params.microbatches = 4;
  params.chunks_per_worker = chunks_per_worker;
  params.num_layers = 4;
  params.data_parallel = data_parallel;
  sim::UniformCosts costs = kfac_test_costs();
  if (long_tasks) {
    costs.curvature_a_s = costs.curvature_b_s = 0.7;
    costs.invert_a_s = costs.invert_b_s = 3.0;
    costs.precondition_s = 1.5;
  }
  const bool chimera = kind == sched::ScheduleKind::kChimera;
  if (pipelined && chimera) {
    // Long curvature syncs: the refresh's late work, run on into the next window (pieces on
    // both replicas at once), the inversions after them: k = 10 against the plain 11.
    costs.curvature_sync_s = 3.0;
    costs.invert_a_s = costs.invert_b_s = 0.1;
  } else if (pipelined) {
    // Longer inversions: the plain refresh needs 3 steps of the 4-worker 1F1B, the pipelined 2,
    // with inversions run whole and as the rest of a chain of pieces in the next window.
    costs.invert_a_s = costs.invert_b_s = 1.0;
  }
  pipefisher::KfacOptions kfac;
  kfac.refresh_steps = refresh_steps;
  kfac.move_weights = move_weights;
  kfac.pipelined_refresh = pipelined;
  const auto pass =
      pipefisher::run_pipefisher(sched::compile(params), sim::UniformCostModel(costs), kfac);
  const int k = pass.schedule.num_steps;
  if (pipelined) {
    ASSERT_TRUE(pass.schedule.kfac_pipelined_refresh);
    int wrapped = 0, continued = 0;  // wrapped work; the pieces that continue a chain
    int syncs = 0;                   // wrapped curvature-sync pieces
    for (const auto& stream : pass.schedule.streams) {
      for (const auto& in : stream) {
        wrapped += sched::is_wrapped(in) ? 1 : 0;
        continued += sched::is_wrapped(in) && in.piece_begin > 0 ? 1 : 0;
        syncs += sched::is_wrapped(in) && in.kind == sched::OpKind::kCurvatureSync ? 1 : 0;
      }
    }
    EXPECT_GT(wrapped, continued);
    EXPECT_GT(continued, 0);
    if (chimera) {
      EXPECT_GT(syncs, 0);
    }
    EXPECT_LT(k, pass.report.plain_refresh_steps);
  }
  if (move_weights) {
    EXPECT_NE(pass.report.weights_deferred, 0);
  }
  if (long_tasks) {
    std::set<sched::OpKind> divided;
    for (const auto& stream : pass.schedule.streams) {
      for (const auto& in : stream) {
        if (sched::is_piece(in)) divided.insert(in.kind);
      }
    }
    EXPECT_TRUE(divided.contains(sched::OpKind::kInvertA) ||
                divided.contains(sched::OpKind::kInvertB));
    EXPECT_TRUE(divided.contains(sched::OpKind::kCurvatureA) ||
                divided.contains(sched::OpKind::kCurvatureB));
    // (The pipelined plan of the test's case leaves every preconditioning whole.)
    if (!pipelined) {
      EXPECT_TRUE(divided.contains(sched::OpKind::kPrecondition));
    }
  }
  SCOPED_TRACE("k = " + std::to_string(k));
  SyntheticBatches batches(config, kMicroBatchSize, kSeqLen, kPredictions, kDataSeed);
  auto setup = make_setup<float>(config, pass.schedule, batches);
  setup.options.kfac.damping = 1e-2F;
  // A small learning rate keeps the runs from amplifying fp32 rounding (the factors are summed
  // in another order), so that the updates themselves can be compared.
  const LearningRate small_lr = [](std::int64_t) { return 1e-4; };
  setup.learning_rate = small_lr;
  ThreadedExecutor<float> executor(setup);
  const std::int64_t steps = 2 * k + 1;  // two whole refreshes and a partial one
  int refreshes = 0;
  executor.run(0, steps, [&](const StepResult& r) { refreshes += r.kfac_refresh ? 1 : 0; });
  EXPECT_EQ(refreshes, steps / k);  // complete refreshes
  testing::ReferenceKfac reference_kfac{k, setup.options.kfac, pipelined};
  testing::ReferenceTrainer<float> reference(
      config, kInitSeed, kDropoutSeed,
      std::make_unique<optim::BasicLamb<float>>(optim::LambOptions{.max_grad_norm = 0.5}), small_lr,
      reference_kfac);
  std::map<std::string, std::vector<float>> initial;
  for (const auto& p : reference.model().parameters()) {
    initial[p.name].assign(p.value, p.value + p.size);
  }
  for (std::int64_t step = 0; step < steps; ++step) {
    reference.step(step, batches, params.microbatches * data_parallel);
  }
  EXPECT_LT(max_relative_update_difference(executor, reference.model(), initial, 1e-3 * 1e-4),
            1e-3);
  // Stopped inside a refresh, a worker keeps only the captures that the refresh's remaining
  // curvature tasks need (a checkpoint saves them); at the refresh's end nothing is left.
  for (int r = 0; r < executor.num_ranks(); ++r) {
    const auto memory = executor.worker(r).transient_memory();
    EXPECT_EQ(memory.activation_stash + memory.message_buffers, 0U) << "rank " << r;
  }
  executor.run(steps, (steps / k + 1) * k);
  for (int r = 0; r < executor.num_ranks(); ++r) {
    EXPECT_EQ(executor.worker(r).transient_memory().total(), 0U) << "rank " << r;
  }
}

TEST(ExecutorKfac, OneFOneBAutomaticRefresh) {
  check_kfac(sched::ScheduleKind::kOneFOneB, 2, 0, 1);
}
// Divided K-FAC tasks (curvature by token rows, inversion as a chain of pieces, preconditioning
// by gradient rows) run at their positions and train as the sequential K-FAC does.
TEST(ExecutorKfac, DividedTasksEqualSequential) {
  check_kfac(sched::ScheduleKind::kOneFOneB, 2, 0, 1, 1, true);
}
TEST(ExecutorKfac, GPipeFixedRefresh) {
  check_kfac(sched::ScheduleKind::kGPipe, 2, 3, 1);
}
TEST(ExecutorKfac, OneFOneBDataParallel) {
  check_kfac(sched::ScheduleKind::kOneFOneB, 2, 2, 2);
}
TEST(ExecutorKfac, ChimeraRefreshEveryStep) {
  check_kfac(sched::ScheduleKind::kChimera, 2, 1, 1);
}
TEST(ExecutorKfac, ChimeraWithDataParallel) {
  check_kfac(sched::ScheduleKind::kChimera, 2, 2, 2);
}
// A pipelined refresh (--kfac-pipelined-refresh on): inversions of a refresh run in the next
// window (whole and as the rest of a chain of pieces), the first window skips them, and the
// run trains as the sequential K-FAC whose inverses serve from the next window's first step.
TEST(ExecutorKfac, PipelinedRefreshEqualsSequential) {
  check_kfac(sched::ScheduleKind::kOneFOneB, 4, 0, 1, 1, false, false, true);
}
// Chimera with a pipelined refresh: the previous refresh's curvature syncs (pieces, on both
// replicas in the same order) and inversions run in the next window on the set-aside sums.
TEST(ExecutorKfac, PipelinedRefreshWithSyncsInTheNextWindowEqualsSequential) {
  check_kfac(sched::ScheduleKind::kChimera, 4, 0, 1, 1, false, false, true);
}

// A BatchSource whose step s is the inner source's step s - shift.
class ShiftedBatches final : public BatchSource {
 public:
  ShiftedBatches(BatchSource& inner, std::int64_t shift) : inner_(inner), shift_(shift) {}
  std::shared_ptr<const model::Batch> batch(std::int64_t step, int index) override {
    return inner_.batch(step - shift_, index);
  }
  void release_before(std::int64_t step) override { inner_.release_before(step - shift_); }

 private:
  BatchSource& inner_;
  std::int64_t shift_;
};

// ExecutorOptions::window_origin: a schedule whose refresh windows start at step 3 (not a
// multiple of k) trains step for step as the same schedule from step 0, bit for bit, when the
// data and the learning rate follow the shift (no dropout: its streams are keyed by the global
// step). Its first window skips the work a refresh before it would run there, the later ones
// run it: pipelined refreshes whose inversions (1F1B) and curvature syncs (Chimera) run on into
// the next window. A run from before the origin is refused.
TEST(ExecutorKfac, WindowsFromAnOriginShiftTheRunAndNothingElse) {
  for (const auto kind : {sched::ScheduleKind::kOneFOneB, sched::ScheduleKind::kChimera}) {
    SCOPED_TRACE(std::string(sched::to_string(kind)));
    auto config = test_config(4);
    config.hidden_dropout = config.attention_dropout = 0.0F;
    sched::ScheduleParams params;
    params.kind = kind;
    params.workers = 4;
    params.microbatches = 4;
    params.num_layers = 4;
    sim::UniformCosts costs = kfac_test_costs();
    if (kind == sched::ScheduleKind::kChimera) {
      costs.curvature_sync_s = 3.0;  // as PipelinedRefreshWithSyncsInTheNextWindowEqualsSequential
      costs.invert_a_s = costs.invert_b_s = 0.1;
    } else {
      costs.invert_a_s = costs.invert_b_s = 1.0;  // as PipelinedRefreshEqualsSequential
    }
    pipefisher::KfacOptions kfac;
    kfac.pipelined_refresh = true;
    const auto schedule =
        pipefisher::run_pipefisher(sched::compile(params), sim::UniformCostModel(costs), kfac)
            .schedule;
    ASSERT_TRUE(schedule.kfac_pipelined_refresh);
    int wrapped = 0, wrapped_syncs = 0;
    for (const auto& stream : schedule.streams) {
      for (const auto& in : stream) {
        wrapped += sched::is_wrapped(in) ? 1 : 0;
        wrapped_syncs += sched::is_wrapped(in) && in.kind == sched::OpKind::kCurvatureSync;
      }
    }
    EXPECT_GT(wrapped, 0);
    if (kind == sched::ScheduleKind::kChimera) {
      EXPECT_GT(wrapped_syncs, 0);
    }
    const std::int64_t steps = 3 * schedule.num_steps;
    using StepRecord = std::tuple<double, double, double, bool>;
    const auto run = [&](std::int64_t origin) {
      SyntheticBatches data(config, kMicroBatchSize, kSeqLen, kPredictions, kDataSeed);
      ShiftedBatches batches(data, origin);
      auto setup = make_setup<float>(config, schedule, batches);
      setup.options.kfac.damping = 1e-2F;
      setup.options.window_origin = origin;
      setup.learning_rate = [origin](std::int64_t step) { return learning_rate(step - origin); };
      ThreadedExecutor<float> executor(setup);
      std::pair<std::vector<StepRecord>, std::vector<float>> out;
      executor.run(origin, origin + steps, [&](const StepResult& r) {
        out.first.emplace_back(r.mlm_loss, r.nsp_loss, r.grad_norm, r.kfac_refresh);
      });
      for (int r = 0; r < executor.num_ranks(); ++r) {
        for (auto* chunk : executor.worker(r).chunks()) {
          for (const auto& p : chunk->parameters()) {
            out.second.insert(out.second.end(), p.value, p.value + p.size);
          }
        }
      }
      if (origin > 0) {
        try {
          executor.run(origin - 1, origin + steps);
          ADD_FAILURE() << "ran from before the windows' origin";
        } catch (const std::exception& error) {
          EXPECT_NE(
              std::string(error.what()).find("the schedule's refresh windows start at step 3"),
              std::string::npos)
              << error.what();
        }
      }
      return out;
    };
    const auto from_zero = run(0);
    const auto shifted = run(3);
    ASSERT_EQ(from_zero.first.size(), static_cast<std::size_t>(steps));
    EXPECT_GT(std::count_if(from_zero.first.begin(), from_zero.first.end(),
                            [](const StepRecord& r) { return std::get<3>(r); }),
              0);
    EXPECT_EQ(shifted.first, from_zero.first);
    EXPECT_EQ(shifted.second, from_zero.second);
  }
}

// K-FAC state placed across data-parallel replicas (kfac/state_placement.h): every placement
// trains to the parameters replication gives, bit for bit (the owner's inversion and
// preconditioning are the same arithmetic on the same all-reduced data, and the broadcasts copy
// bits), and each rank holds exactly the K-FAC state the cost model says.

struct PlacedRun {
  std::vector<std::vector<float>> parameters;  // every rank's, in order
  std::vector<std::int64_t> kfac_bytes;        // per rank, after whole refreshes
  sched::Schedule schedule;
};

PlacedRun run_placed(const kfac::StatePlacement& placement, int data_parallel) {
  const auto config = test_config(4);
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = 2;
  params.microbatches = 4;
  params.num_layers = 4;
  params.data_parallel = data_parallel;
  sim::UniformCosts costs = kfac_test_costs();
  pipefisher::KfacOptions kfac;
  kfac.refresh_steps = 2;
  // Whole tasks: the broadcasts take bubble time, so the pass may cut pieces elsewhere than for
  // replication, and a curvature piece's partial sums round differently from the whole task's.
  kfac.split = false;
  kfac.state_placement = placement;
  kfac.linear_dims = linear_dims_of(config);
  PlacedRun out;
  out.schedule =
      pipefisher::run_pipefisher(sched::compile(params), sim::UniformCostModel(costs), kfac)
          .schedule;
  SyntheticBatches batches(config, kMicroBatchSize, kSeqLen, kPredictions, kDataSeed);
  auto setup = make_setup<float>(config, out.schedule, batches);
  setup.options.kfac.damping = 1e-2F;
  setup.options.kfac.placement = placement;
  ThreadedExecutor<float> executor(setup);
  executor.run(0, 3 * out.schedule.num_steps);  // three whole refreshes
  for (int r = 0; r < executor.num_ranks(); ++r) {
    std::vector<float> values;
    for (auto* chunk : executor.worker(r).chunks()) {
      for (const auto& p : chunk->parameters())
        values.insert(values.end(), p.value, p.value + p.size);
    }
    out.parameters.push_back(std::move(values));
    out.kfac_bytes.push_back(executor.worker(r).kfac_state_bytes());
  }
  return out;
}

std::size_t count_kind(const sched::Schedule& schedule, sched::OpKind kind) {
  std::size_t n = 0;
  for (const auto& stream : schedule.streams) {
    n += static_cast<std::size_t>(std::count_if(stream.begin(), stream.end(),
                                                [&](const auto& in) { return in.kind == kind; }));
  }
  return n;
}

void check_placements(int data_parallel, const std::vector<kfac::StatePlacement>& placements) {
  const auto replicated = run_placed({}, data_parallel);
  EXPECT_EQ(count_kind(replicated.schedule, sched::OpKind::kBroadcastGradient), 0U);
  const auto config = test_config(4);
  const auto dims = linear_dims_of(config);
  for (const auto& placement : placements) {
    SCOPED_TRACE(kfac::to_string(placement));
    const auto placed = run_placed(placement, data_parallel);
    EXPECT_GT(count_kind(placed.schedule, sched::OpKind::kBroadcastInverses) +
                  count_kind(placed.schedule, sched::OpKind::kBroadcastGradient),
              0U);
    ASSERT_EQ(placed.parameters.size(), replicated.parameters.size());
    for (std::size_t r = 0; r < placed.parameters.size(); ++r) {
      ASSERT_EQ(placed.parameters[r].size(), replicated.parameters[r].size());
      EXPECT_EQ(std::memcmp(placed.parameters[r].data(), replicated.parameters[r].data(),
                            placed.parameters[r].size() * sizeof(float)),
                0)
          << "rank " << r;
    }
    // Measured K-FAC state per rank against the model; worker w holds layers 2w, 2w + 1.
    std::int64_t measured_max = 0, replicated_max = 0;
    for (int w = 0; w < 2; ++w) {
      std::vector<kfac::LinearDims> held;
      for (int layer = 0; layer < 2; ++layer) held.insert(held.end(), dims.begin(), dims.end());
      const auto cost = kfac::state_cost(kfac::plan_state(held, data_parallel, placement), held, 2);
      for (int replica = 0; replica < data_parallel; ++replica) {
        const auto r = static_cast<std::size_t>(replica * 2 + w);
        EXPECT_EQ(placed.kfac_bytes[r], cost.memory_bytes[static_cast<std::size_t>(replica)])
            << "worker " << w << " replica " << replica;
        measured_max = std::max(measured_max, placed.kfac_bytes[r]);
        replicated_max = std::max(replicated_max, replicated.kfac_bytes[r]);
      }
    }
    EXPECT_LT(measured_max, replicated_max);
  }
}

// The chunked curvature sync: Chimera's sync, longer than the gaps, cut by the pass into
// row-range pieces that both replicas run, trains to the same bits as the same schedule with
// every sync whole at its last piece's place (the all-reduces add element by element in rank
// order, so a range sums as the whole does); with data parallelism the sync's group spans both
// replicas' data-parallel groups.
sched::Schedule with_whole_syncs(sched::Schedule schedule) {
  for (auto& stream : schedule.streams) {
    std::erase_if(stream, [](const sched::Instruction& in) {
      return in.kind == sched::OpKind::kCurvatureSync && in.piece_end != sched::kPieceUnits;
    });
    for (auto& in : stream) {
      if (in.kind == sched::OpKind::kCurvatureSync) {
        in.piece_begin = 0;
        in.bytes = 0;
      }
    }
  }
  return schedule;
}

std::vector<std::vector<float>> trained_parameters(const sched::Schedule& schedule,
                                                   std::int64_t steps) {
  const auto config = test_config(4);
  SyntheticBatches batches(config, kMicroBatchSize, kSeqLen, kPredictions, kDataSeed);
  auto setup = make_setup<float>(config, schedule, batches);
  setup.options.kfac.damping = 1e-2F;
  setup.learning_rate = [](std::int64_t) { return 1e-4; };
  ThreadedExecutor<float> executor(setup);
  executor.run(0, steps);
  std::vector<std::vector<float>> parameters;
  for (int r = 0; r < executor.num_ranks(); ++r) {
    std::vector<float> values;
    for (auto* chunk : executor.worker(r).chunks()) {
      for (const auto& p : chunk->parameters())
        values.insert(values.end(), p.value, p.value + p.size);
    }
    parameters.push_back(std::move(values));
  }
  return parameters;
}

void check_divided_sync(int data_parallel, bool pipelined = false) {
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kChimera;
  params.workers = 4;
  params.microbatches = 4;
  params.num_layers = 4;
  params.data_parallel = data_parallel;
  sim::UniformCosts costs = kfac_test_costs();
  costs.curvature_sync_s = 1.5;  // longer than most common gaps
  if (pipelined) {
    // Longer still, the inversions short: the syncs' last pieces run in the next window.
    costs.curvature_sync_s = 3.0;
    costs.invert_a_s = costs.invert_b_s = 0.1;
  }
  pipefisher::KfacOptions kfac;
  kfac.linear_dims = linear_dims_of(test_config(4));
  kfac.pipelined_refresh = pipelined;
  const auto pass =
      pipefisher::run_pipefisher(sched::compile(params), sim::UniformCostModel(costs), kfac);
  const auto& divided = pass.schedule;
  if (pipelined) {
    // Pieces of a sync on both sides of the window's end: the rest runs in the next window on
    // the sums set aside at its start.
    ASSERT_TRUE(divided.kfac_pipelined_refresh);
    std::size_t wrapped_pieces = 0;
    for (const auto& stream : divided.streams) {
      for (const auto& in : stream) {
        wrapped_pieces +=
            in.kind == sched::OpKind::kCurvatureSync && sched::is_wrapped(in) && sched::is_piece(in)
                ? 1
                : 0;
      }
    }
    EXPECT_GT(wrapped_pieces, 0U);
  }
  // Per worker, the pieces' payloads add up to both factors' (rows of a narrow piece may be none).
  std::size_t sync_pieces = 0;
  const auto dims = linear_dims_of(test_config(4));
  for (const auto& stream : divided.streams) {
    std::map<std::tuple<int, int, int>, std::int64_t> payload;
    for (const auto& in : stream) {
      if (in.kind != sched::OpKind::kCurvatureSync || !sched::is_piece(in)) continue;
      ++sync_pieces;
      // A piece run in the next window (pipelined) names its step there less k.
      const int step = sched::is_wrapped(in) ? in.step + divided.num_steps : in.step;
      payload[{step, in.layer, static_cast<int>(in.linear)}] += in.bytes;
    }
    for (const auto& [task, bytes] : payload) {
      const auto& d = dims[static_cast<std::size_t>(std::get<2>(task))];
      EXPECT_EQ(bytes, 4 * (d.d_in * d.d_in + d.d_out * d.d_out));
    }
  }
  ASSERT_GT(sync_pieces, 0U);
  SCOPED_TRACE("k = " + std::to_string(divided.num_steps));
  // Kept whole, the syncs fit the common gaps only at a larger k (12 against 7 without data
  // parallelism).
  kfac.split = false;
  if (!pipelined) {
    EXPECT_LT(pass.report.refresh_steps,
              pipefisher::run_pipefisher(sched::compile(params), sim::UniformCostModel(costs), kfac)
                  .report.refresh_steps);
  }
  const auto whole = with_whole_syncs(divided);
  ASSERT_NO_THROW(sched::validate(whole));
  EXPECT_LT(count_kind(whole, sched::OpKind::kCurvatureSync),
            count_kind(divided, sched::OpKind::kCurvatureSync));
  // Two whole refreshes (pipelined: and the second's work in the next window).
  const std::int64_t steps = 2 * divided.num_steps + (pipelined ? 1 : 0);
  const auto with_pieces = trained_parameters(divided, steps);
  const auto reference = trained_parameters(whole, steps);
  ASSERT_EQ(with_pieces.size(), reference.size());
  for (std::size_t r = 0; r < reference.size(); ++r) {
    ASSERT_EQ(with_pieces[r].size(), reference[r].size());
    EXPECT_EQ(std::memcmp(with_pieces[r].data(), reference[r].data(),
                          reference[r].size() * sizeof(float)),
              0)
        << "rank " << r;
  }
}

TEST(ExecutorKfac, DividedCurvatureSyncEqualsWholeSyncBitForBit) {
  check_divided_sync(1);
}
TEST(ExecutorKfac, DividedCurvatureSyncWithDataParallelEqualsWholeSyncBitForBit) {
  check_divided_sync(2);
}
TEST(ExecutorKfac, DividedCurvatureSyncInTheNextWindowEqualsWholeSyncBitForBit) {
  check_divided_sync(1, true);
}

TEST(ExecutorKfacPlacement, ShardEqualsReplicateAtTwoReplicas) {
  check_placements(2, {kfac::uniform_placement({kfac::Placement::kShard, 0}),
                       {{kfac::Placement::kShard, 0}, {kfac::Placement::kReplicate, 0}}});
}

TEST(ExecutorKfacPlacement, PartialAndShardEqualReplicateAtFourReplicas) {
  check_placements(4, {kfac::uniform_placement({kfac::Placement::kShard, 0}),
                       kfac::uniform_placement({kfac::Placement::kPartial, 2}),
                       {{kfac::Placement::kShard, 0}, {kfac::Placement::kPartial, 2}}});
}

TEST(ExecutorKfacPlacement, ScheduleAndPlacementMustAgree) {
  const auto config = test_config(4);
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = 2;
  params.microbatches = 4;
  params.num_layers = 4;
  params.data_parallel = 2;
  sim::UniformCosts costs{.forward_s = 1.0, .backward_s = 2.0, .communication_s = 0.05};
  costs.curvature_a_s = costs.curvature_b_s = costs.invert_a_s = costs.invert_b_s = 0.05;
  pipefisher::KfacOptions kfac;
  kfac.refresh_steps = 1;
  const auto replicated =
      pipefisher::run_pipefisher(sched::compile(params), sim::UniformCostModel(costs), kfac);
  SyntheticBatches batches(config, kMicroBatchSize, kSeqLen, kPredictions, kDataSeed);
  auto setup = make_setup<float>(config, replicated.schedule, batches);
  setup.options.kfac.placement = kfac::uniform_placement({kfac::Placement::kShard, 0});
  try {
    ThreadedExecutor<float> executor(setup);
    executor.run(0, 1);
    ADD_FAILURE() << "a schedule without broadcasts ran with sharded state";
  } catch (const std::exception& error) {
    EXPECT_NE(std::string(error.what()).find("same --kfac-sharding"), std::string::npos)
        << error.what();
  }
  // The pass refuses sharding without the Linears' sizes, and on Chimera.
  kfac.state_placement = kfac::uniform_placement({kfac::Placement::kShard, 0});
  EXPECT_THROW(
      pipefisher::run_pipefisher(sched::compile(params), sim::UniformCostModel(costs), kfac),
      std::invalid_argument);
  kfac.linear_dims = linear_dims_of(config);
  params.kind = sched::ScheduleKind::kChimera;
  EXPECT_THROW(
      pipefisher::run_pipefisher(sched::compile(params), sim::UniformCostModel(costs), kfac),
      std::invalid_argument);
}

// Zero-bubble schedules: K-FAC in what bubbles they leave, curvature B after backward-input,
// preconditioning after the last backward-weight.
TEST(ExecutorKfac, ZeroBubbleH1AutomaticRefresh) {
  check_kfac(sched::ScheduleKind::kZeroBubbleH1, 2, 0, 1);
}
// The pass may defer backward-weight work to open bubbles (--kfac-move-w): the moved stream
// trains as the sequential K-FAC does.
TEST(ExecutorKfac, ZeroBubbleH1WithMovedWeights) {
  check_kfac(sched::ScheduleKind::kZeroBubbleH1, 4, 0, 1, 1, false, true);
}
TEST(ExecutorKfac, ZeroBubbleVFixedRefresh) {
  check_kfac(sched::ScheduleKind::kZeroBubbleV, 2, 2, 1, 2);
}

// Schedules written by PyTorch's own ZBV and DualPipeV classes (V-shaped placement; DualPipeV
// with composite OVERLAP_F_B actions) train exactly as single-worker training does.
TEST(Executor, TorchWrittenVShapeSchedulesRun) {
  for (const char* name : {"zbv_p4_m8", "dualpipev_p4_m8"}) {
    SCOPED_TRACE(name);
    const int layers = 8;
    const auto config = test_config(layers);
    sched::TorchCsvImportOptions import;
    import.num_layers = layers;
    const auto schedule = sched::load_torch_csv(
        std::string("tests/fixtures/torch_schedules/") + name + ".compute_comms.csv", import);
    ASSERT_TRUE(schedule.params.v_shape);
    SyntheticBatches batches(config, kMicroBatchSize, kSeqLen, kPredictions, kDataSeed);
    ThreadedExecutor<double> executor(make_setup<double>(config, schedule, batches));
    executor.run(0, 2);
    EXPECT_LT(difference_from_reference(executor, config, batches, 2, schedule.params.microbatches),
              1e-12);
  }
}

TEST(Executor, BrokenScheduleIsRefusedBeforeRunning) {
  const auto config = test_config(4);
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = 2;
  params.microbatches = 2;
  params.num_layers = 4;
  auto schedule = sched::compile(params);
  // Drop worker 1's first receive: its forward would wait forever.
  auto& stream = schedule.streams[1];
  stream.erase(std::find_if(stream.begin(), stream.end(), [](const sched::Instruction& in) {
    return in.kind == sched::OpKind::kRecvActivation;
  }));
  SyntheticBatches batches(config, kMicroBatchSize, kSeqLen, kPredictions, kDataSeed);
  EXPECT_THROW(ThreadedExecutor<double>(make_setup<double>(config, schedule, batches)),
               std::invalid_argument);
  // A model of another depth.
  EXPECT_THROW(
      ThreadedExecutor<double>(make_setup<double>(test_config(6), sched::compile(params), batches)),
      std::invalid_argument);
}

// A failing worker stops every worker; the error names it, its position and instruction.
class FailingBatches final : public BatchSource {
 public:
  explicit FailingBatches(BatchSource& inner) : inner_(&inner) {}
  std::shared_ptr<const model::Batch> batch(std::int64_t step, int index) override {
    if (step == 1 && index == 2) throw std::runtime_error("corrupt record in shard 3");
    return inner_->batch(step, index);
  }

 private:
  BatchSource* inner_;
};

TEST(Executor, OneFailureStopsEveryWorkerWithContext) {
  const auto config = test_config(4);
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = 4;
  params.microbatches = 4;
  params.num_layers = 4;
  SyntheticBatches inner(config, kMicroBatchSize, kSeqLen, kPredictions, kDataSeed);
  FailingBatches batches(inner);
  ThreadedExecutor<double> executor(make_setup<double>(config, sched::compile(params), batches));
  try {
    executor.run(0, 3);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("corrupt record in shard 3"), std::string::npos) << message;
    EXPECT_NE(message.find("step 1"), std::string::npos) << message;
    EXPECT_NE(message.find("stream position"), std::string::npos) << message;
    EXPECT_NE(message.find("recent instructions of every worker"), std::string::npos) << message;
    EXPECT_NE(message.find("rank 3"), std::string::npos) << message;
  }
}

// A peer that never arrives: the wait ends at its deadline with what was awaited.
TEST(Executor, WaitsHaveDeadlines) {
  const auto config = test_config(4);
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = 2;
  params.microbatches = 2;
  params.num_layers = 4;
  SyntheticBatches batches(config, kMicroBatchSize, kSeqLen, kPredictions, kDataSeed);
  auto setup = make_setup<double>(config, sched::compile(params), batches);
  setup.options.wait_timeout = std::chrono::milliseconds(200);
  comm::InProcessWorld world(2);
  Worker<double> last_stage(setup, world.rank(1));  // worker 0 never runs
  const auto start = comm::Clock::now();
  try {
    last_stage.run(0, 1, {});
    FAIL() << "expected a timeout";
  } catch (const WorkerError& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("worker 1"), std::string::npos) << message;
    EXPECT_NE(message.find("the activation from worker 0"), std::string::npos) << message;
    EXPECT_GE(error.position(), 0);
  }
  EXPECT_LT(comm::Clock::now() - start, std::chrono::seconds(10));
  EXPECT_NE(last_stage.history().find("waiting"), std::string::npos);
}

// The workers of one process share one clock. Each is built in turn, and clocks started at each
// one's construction put a later rank's events earlier than they were (on a GPU, by seconds with
// BERT-Large's chunks: the run summary read 0% busy for ranks 2 and 3).
TEST(Executor, WorkersShareOneClockSoTheirEventsLineUp) {
  const auto config = test_config(4);
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = 4;
  params.microbatches = 4;
  SyntheticBatches batches(config, kMicroBatchSize, kSeqLen, kPredictions, kDataSeed);
  auto setup = make_setup<float>(config, sched::compile(params), batches);
  setup.options.record_events = true;
  const auto before = comm::Clock::now();
  ThreadedExecutor<float> executor(setup);
  for (int r = 0; r < executor.num_ranks(); ++r) {
    EXPECT_EQ(executor.worker(r).clock_origin(), executor.worker(0).clock_origin()) << r;
  }
  EXPECT_GE(executor.worker(0).clock_origin(), before);
  // Every rank's events lie after the shared origin, and every rank ran. (A forward may start
  // before its input arrives: the receive is posted and the forward waits for it, so the ranks'
  // first forwards need not be in pipeline order.)
  executor.run(0, 1);
  std::set<int> ranks;
  for (const auto& e : executor.take_events()) {
    EXPECT_GE(e.start_s, 0.0);
    EXPECT_LE(e.start_s, e.end_s);
    ranks.insert(e.rank);
  }
  EXPECT_EQ(ranks.size(), 4U);
}

}  // namespace
}  // namespace pf::exec

namespace pf::exec {
namespace {

InstructionEvent timed(int rank, std::int64_t step, sched::OpKind kind, double start, double end) {
  InstructionEvent event;
  event.rank = rank;
  event.global_step = step;
  event.instruction.kind = kind;
  event.lane = Lane::kCompute;
  event.start_s = start;
  event.end_s = end;
  event.busy_s = end - start;
  return event;
}

// The summary's window runs from the end of the warm-up step to the last optimizer step, and
// leaves out time when no rank ran anything (a checkpoint written between run segments).
TEST(RunSummary, WindowLeavesOutTimeOutsideTheExecutor) {
  using sched::OpKind;
  std::vector<InstructionEvent> events;
  for (int step = 0; step < 3; ++step) {
    // Steps take 1 s each; after step 1 the run paused for 5 s (a save).
    const double start = step * 1.0 + (step >= 2 ? 5.0 : 0.0);
    for (int rank = 0; rank < 2; ++rank) {
      events.push_back(timed(rank, step, OpKind::kForward, start, start + 0.499));
      events.push_back(timed(rank, step, OpKind::kOptimizerStep, start + 0.5, start + 1.0));
    }
  }
  const auto summary = summarize_run(events, 2, 1);
  EXPECT_EQ(summary.first_step, 1);
  EXPECT_EQ(summary.last_step, 3);
  EXPECT_NEAR(summary.window_s, 2.0, 1e-9);
  EXPECT_NEAR(summary.step_time_s, 1.0, 1e-9);
  EXPECT_NEAR(summary.compute_utilization(), 0.999, 1e-9);  // 1 ms between the two events
}

// The measured-memory tests' model and pipeline: BERT chunks wide enough that a micro-batch's
// stash arena exceeds the 1 MiB smallest block, on 1F1B with 2 stages and 4 micro-batches.
model::BertConfig memory_test_config() {
  model::BertConfig config = test_config(4);
  config.hidden_size = 64;
  config.num_heads = 4;
  config.intermediate_size = 256;
  config.max_position_embeddings = 32;
  return config;
}
sched::Schedule memory_test_schedule() {
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = 2;
  params.microbatches = 4;
  params.num_layers = 4;
  return sched::compile(params);
}

// End to end: a pipeline of real BERT chunks (1F1B, 2 stages, 4 micro-batches, fp32 on CPU
// threads) writes its measured profile, the simulator replays it, and the replay's peak
// activation memory per worker is what the runtime's stash arenas really held at their peak:
// exactly, since after the warm-up step every micro-batch's pooled arena is one block of the
// cycle's bytes, and the simulator holds a micro-batch's activation_bytes from its forward to
// its (weight) backward as the chunk holds the arena. The model is large enough that an arena
// exceeds the 1 MiB smallest block, so that the figure is the chunk's own accounting.
TEST(MeasuredProfile, ReplayedPeakActivationMemoryIsTheRuntimeStash) {
  const model::BertConfig config = memory_test_config();
  const auto schedule = memory_test_schedule();
  SyntheticBatches batches(config, 4, 32, 4, kDataSeed);
  auto setup = make_setup<float>(config, schedule, batches);
  setup.options.record_events = true;
  ThreadedExecutor<float> executor(setup);
  executor.run(0, 1);  // warm-up: the arenas grow to one block of the cycle
  for (int r = 0; r < executor.num_ranks(); ++r) executor.worker(r).reset_peak_stash_bytes();
  executor.run(1, 3);
  const auto events = executor.take_events();
  const auto profile = measured_profile(schedule, events, 1, "stash test");
  const std::int64_t message = 4 * 32 * 64 * 4;  // b S H e: the boundary activation
  EXPECT_DOUBLE_EQ(profile.communication.message_bytes, static_cast<double>(message));
  ASSERT_EQ(profile.chunks.size(), 2U);
  for (const auto& chunk : profile.chunks) {
    EXPECT_GT(chunk.activation_bytes, 1024.0 * 1024.0) << "chunk " << chunk.chunk;
  }
  // Through the file format, as pipefisher_sim --profile reads it.
  const sim::MeasuredCostModel costs(
      sim::profile_from_json(sim::profile_to_json(profile), "stash test"), "stash test");
  const auto result = sim::simulate(schedule, costs);
  ASSERT_EQ(result.workers.size(), 2U);
  for (int r = 0; r < 2; ++r) {
    const auto peak = executor.worker(r).peak_stash_bytes();
    EXPECT_GT(peak, 0) << "rank " << r;
    EXPECT_EQ(result.workers[static_cast<std::size_t>(r)].peak_activation_bytes,
              static_cast<double>(peak))
        << "rank " << r;
    // 1F1B: worker r stashes p - r micro-batches, each the whole arena.
    EXPECT_EQ(result.workers[static_cast<std::size_t>(r)].peak_stashed_microbatches, 2 - r);
  }
}

// End to end, the whole footprint: the same pipeline of real BERT chunks, with and without
// K-FAC (the PipeFisher pass's schedule), writes its profile with the workers' measured memory
// (exec::add_measured_memory: static_bytes per chunk, K-FAC bytes per Linear), and the replay's
// peak per worker is the runtime's own figures summed, to the byte: its parameters, gradients and
// LAMB moments (Worker::memory, from the allocated buffers), each Linear's K-FAC state at its
// largest, and the stash arenas' peak. The simulator holds the static bytes throughout and a
// Linear's K-FAC bytes from its first K-FAC task on; the stash peak recurs in every step, so
// with a round of several steps it meets all of them.
void expect_replayed_peak_is_runtime_memory(bool with_kfac) {
  const model::BertConfig config = memory_test_config();
  auto schedule = memory_test_schedule();
  if (with_kfac) {
    sim::UniformCosts costs;
    costs.forward_s = 1.0;
    costs.backward_s = 2.0;
    pipefisher::KfacOptions kfac;
    kfac.refresh_steps = 2;
    schedule = pipefisher::run_pipefisher(schedule, sim::UniformCostModel(costs), kfac).schedule;
  }
  const int k = schedule.num_steps;
  SyntheticBatches batches(config, 4, 32, 4, kDataSeed);
  auto setup = make_setup<float>(config, schedule, batches);
  setup.options.record_events = true;
  ThreadedExecutor<float> executor(setup);
  executor.run(0, 1);  // warm-up: the arenas grow to one block of the cycle
  for (int r = 0; r < executor.num_ranks(); ++r) executor.worker(r).reset_peak_stash_bytes();
  executor.run(1, 2 * k + 1);
  auto profile = measured_profile(schedule, executor.take_events(), 1, "memory test");
  std::vector<WorkerMemory> memory;
  for (int r = 0; r < executor.num_ranks(); ++r) memory.push_back(executor.worker(r).memory());
  // As pipefisher_train gathers it from the ranks' processes: through its JSON.
  memory = memory_from_json(nlohmann::json::parse(memory_to_json(memory).dump()));
  add_measured_memory(profile, memory);
  ASSERT_EQ(profile.chunks.size(), 2U);
  EXPECT_EQ(profile.kfac.empty(), !with_kfac);
  const sim::MeasuredCostModel costs(
      sim::profile_from_json(sim::profile_to_json(profile), "memory test"), "memory test");
  const auto result = sim::simulate(schedule, costs);
  ASSERT_EQ(result.workers.size(), 2U);
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r) + (with_kfac ? ", K-FAC" : ""));
    const auto& mine = memory[static_cast<std::size_t>(r)];
    ASSERT_EQ(mine.chunks.size(), 1U);
    const auto& chunk = mine.chunks.front();
    // Counted from the buffers: fp32 values and gradients of the chunk's parameters, and LAMB's
    // two moments of each (allocated by its first step).
    std::int64_t elements = 0;
    for (const auto& p : executor.worker(r).chunk(0, r)->parameters()) elements += p.size;
    EXPECT_EQ(chunk.parameter_bytes, 4 * elements);
    EXPECT_EQ(chunk.gradient_bytes, 4 * elements);
    EXPECT_EQ(chunk.optimizer_bytes, 2 * 4 * elements);
    if (with_kfac) {
      // Each of the worker's 2 layers x 6 Linears, holding at least the factors' values and
      // inverses (fp32, d_in^2 + d_out^2 each).
      ASSERT_EQ(mine.kfac.size(), 12U);
      for (const auto& linear : mine.kfac) {
        const std::int64_t d_in = linear.linear == sched::LinearKind::kFfnOut ? 256 : 64;
        const std::int64_t d_out = linear.linear == sched::LinearKind::kFfnIn ? 256 : 64;
        EXPECT_GE(linear.peak_bytes, 2 * 4 * (d_in * d_in + d_out * d_out))
            << "layer " << linear.layer << " " << sched::to_string(linear.linear);
      }
    } else {
      EXPECT_TRUE(mine.kfac.empty());
    }
    const std::int64_t stash = executor.worker(r).peak_stash_bytes();
    EXPECT_GT(stash, 0);
    const auto& replayed = result.workers[static_cast<std::size_t>(r)];
    EXPECT_EQ(replayed.static_memory_bytes, static_cast<double>(mine.static_bytes()));
    EXPECT_EQ(replayed.peak_activation_bytes, static_cast<double>(stash));
    EXPECT_EQ(replayed.peak_memory_bytes,
              static_cast<double>(mine.static_bytes() + mine.kfac_bytes() + stash));
  }
}

TEST(MeasuredProfile, ReplayedPeakMemoryIsTheRuntimeStaticAndStash) {
  expect_replayed_peak_is_runtime_memory(false);
}

TEST(MeasuredProfile, ReplayedPeakMemoryIsTheRuntimeStaticKfacAndStash) {
  expect_replayed_peak_is_runtime_memory(true);
}

// A run as long as its refresh interval runs curvature and inversions only in its warm-up step:
// the profile prices them from there instead of as free (which would tell the PipeFisher pass
// that K-FAC costs nothing), and keeps later samples where there are some.
TEST(MeasuredProfile, KfacTasksOnlyInTheWarmUpStepAreNotFree) {
  using sched::OpKind;
  std::vector<InstructionEvent> events;
  const auto kfac_event = [](std::int64_t step, OpKind kind, double busy) {
    auto event = timed(0, step, kind, 0.0, busy);
    event.lane = Lane::kKfac;
    event.instruction.layer = 1;
    event.instruction.linear = sched::LinearKind::kFfnIn;
    return event;
  };
  for (int step = 0; step < 3; ++step) {
    events.push_back(timed(0, step, OpKind::kForward, 0.0, 0.5));
    events.push_back(timed(0, step, OpKind::kBackward, 0.5, 1.5));
    events.push_back(kfac_event(step, OpKind::kPrecondition, step == 0 ? 9.0 : 0.25));
  }
  events.push_back(kfac_event(0, OpKind::kCurvatureA, 0.125));
  events.push_back(kfac_event(0, OpKind::kInvertB, 2.0));
  sched::Schedule schedule;
  const auto profile = measured_profile(schedule, events, 1, "test");
  ASSERT_EQ(profile.kfac.size(), 1U);
  const auto& entry = profile.kfac.front();
  EXPECT_EQ(entry.layer, 1);
  EXPECT_EQ(entry.linear, sched::LinearKind::kFfnIn);
  EXPECT_DOUBLE_EQ(entry.curvature_a_s, 0.125);  // warm-up only
  EXPECT_DOUBLE_EQ(entry.invert_b_s, 2.0);
  EXPECT_DOUBLE_EQ(entry.precondition_s, 0.25);  // later steps win over the warm-up's 9 s
  EXPECT_DOUBLE_EQ(entry.curvature_b_s, 0.0);    // never ran at all
}

// Factors-only offload (--kfac-offload factors) copies only around inversions: a run as long as
// its refresh interval may copy only in its warm-up step. The profile then prices the host link
// from there (it had no host link, and replaying the schedule's copies threw); later samples
// win where there are some.
TEST(MeasuredProfile, HostCopiesOnlyInTheWarmUpStepGiveTheHostLink) {
  using sched::OpKind;
  const auto copy = [](std::int64_t step, double busy) {
    auto event = timed(0, step, OpKind::kWriteBackState, 0.0, busy);
    event.lane = Lane::kHostLink;
    event.bytes = 1000;
    return event;
  };
  std::vector<InstructionEvent> events;
  for (int step = 0; step < 2; ++step) {
    events.push_back(timed(0, step, OpKind::kForward, 0.0, 0.5));
    events.push_back(timed(0, step, OpKind::kBackward, 0.5, 1.5));
  }
  events.push_back(copy(0, 0.5));
  sched::Schedule schedule;
  EXPECT_DOUBLE_EQ(measured_profile(schedule, events, 1, "test").host_link.bandwidth, 2000.0);
  events.push_back(copy(1, 0.25));
  EXPECT_DOUBLE_EQ(measured_profile(schedule, events, 1, "test").host_link.bandwidth, 4000.0);
}

}  // namespace
}  // namespace pf::exec
