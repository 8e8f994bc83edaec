// The BERT model: gradients against finite differences (double), chunked = unchunked, K-FAC
// capture, the allocation-free steady state, and bad input.
#include <omp.h>

#include <cmath>
#include <random>

#include <gtest/gtest.h>

#include "runtime/model/bert_chunk.h"
#include "runtime/tensor/cpu_backend.h"
#include "tests/model/model_test_util.h"

namespace pf::model {
namespace {

using testing::ChunkedModel;
using testing::tiny_test_config;

std::vector<ChunkSpec> split(const BertConfig& config, const std::vector<int>& layers_per_chunk) {
  std::vector<ChunkSpec> specs;
  int next = 0;
  for (std::size_t i = 0; i < layers_per_chunk.size(); ++i) {
    specs.push_back({next, layers_per_chunk[i], i == 0, i + 1 == layers_per_chunk.size()});
    next += layers_per_chunk[i];
  }
  EXPECT_EQ(next, config.num_layers);
  return specs;
}

TEST(BertModel, ParameterGradientsMatchFiniteDifferences) {
  auto config = tiny_test_config();
  config.num_layers = 2;
  config.initializer_range = 0.3F;  // larger weights: a less linear, more telling model
  tensor::CpuBackend backend;
  ChunkedModel<double> model(config, {whole_model(config)}, backend, 5);
  auto& chunk = *model.chunks.front();
  // Non-trivial LayerNorm and bias values, so their gradients are exercised off the init.
  std::mt19937_64 rng(3);
  std::normal_distribution<double> noise(0.0, 0.1);
  for (auto& p : chunk.parameters()) {
    if (p.is_bias_or_layernorm) {
      for (std::int64_t i = 0; i < p.size; ++i) p.value[i] += noise(rng);
    }
  }
  const Batch batch = make_random_batch(config, 3, 6, 3, 11);
  ForwardOptions options;
  options.seed = 99;  // dropout on: the mask is a fixed function of the seed
  chunk.zero_grad();
  model.step(0, batch, options);
  auto loss = [&] {
    const auto losses = model.forward(1, batch, options);
    chunk.discard(1);
    return losses.total();
  };
  int checked = 0;
  for (auto& p : chunk.parameters()) {
    std::uniform_int_distribution<std::int64_t> pick(0, p.size - 1);
    for (int sample = 0; sample < 3; ++sample) {
      // The padding row of the word embeddings gets no gradient (PyTorch padding_idx) from the
      // lookup; sample ordinary rows.
      const std::int64_t i = pick(rng);
      const double saved = p.value[i];
      const double h = 1e-6;
      p.value[i] = saved + h;
      const double plus = loss();
      p.value[i] = saved - h;
      const double minus = loss();
      p.value[i] = saved;
      const double numeric = (plus - minus) / (2 * h);
      if (p.name == "bert.embeddings.word_embeddings.weight" && i / config.hidden_size == 0) {
        continue;  // row 0: padding_idx semantics differ from the true derivative by design
      }
      EXPECT_NEAR(p.grad[i], numeric, 1e-6 * std::max(1.0, std::abs(numeric)))
          << p.name << " element " << i;
      ++checked;
    }
  }
  EXPECT_GT(checked, 100);
}

TEST(BertModel, ChunkedEqualsUnchunked) {
  const auto config = tiny_test_config();  // 4 layers
  tensor::CpuBackend backend;
  const Batch batch0 = make_random_batch(config, 3, 7, 3, 1);
  const Batch batch1 = make_random_batch(config, 3, 7, 3, 2);
  ForwardOptions options0, options1;
  options0.seed = 10;
  options1.seed = 11;
  auto run = [&](const std::vector<int>& layers) {
    auto model = std::make_unique<ChunkedModel<float>>(config, split(config, layers), backend, 7);
    // Two micro-batches in flight (1F1B order), gradients accumulated with loss scale 1/2.
    const auto l0 = model->forward(0, batch0, options0);
    const auto l1 = model->forward(1, batch1, options1);
    model->backward(0, batch0, 0.5F);
    model->backward(1, batch1, 0.5F);
    for (auto& chunk : model->chunks) EXPECT_EQ(chunk->in_flight(), 0);
    return std::make_pair(std::move(model), l0.total() + l1.total());
  };
  auto [reference, reference_loss] = run({4});
  for (const auto& layers :
       std::vector<std::vector<int>>{{2, 2}, {1, 2, 1}, {1, 1, 1, 1}, {3, 0, 1, 0}}) {
    auto [model, loss] = run(layers);
    EXPECT_NEAR(loss, reference_loss, 1e-6 * std::abs(reference_loss))
        << layers.size() << " chunks";
    for (const auto& p : reference->chunks.front()->parameters()) {
      const auto expected = reference->gradient(p.name);
      const auto actual = model->gradient(p.name);
      ASSERT_EQ(actual.size(), expected.size()) << p.name;
      for (std::size_t i = 0; i < actual.size(); ++i) {
        ASSERT_NEAR(actual[i], expected[i], 1e-6F + 1e-5F * std::abs(expected[i]))
            << p.name << " element " << i << " with " << layers.size() << " chunks";
      }
    }
  }
}

TEST(BertModel, StepIsBitIdenticalForAnyThreadCount) {
  // Large enough for every threaded path of the CPU ops (row-parallel elementwise ops and
  // LayerNorm, products cut into blocks, attention over (sequence, head) pairs, the MLM
  // cross-entropy): the losses and every gradient are the same bits on 1, 2 and 3 threads.
  auto config = tiny_test_config();
  config.vocab_size = 1001;
  config.hidden_size = 64;
  config.num_layers = 2;
  config.num_heads = 4;
  config.intermediate_size = 160;
  config.max_position_embeddings = 64;
  tensor::CpuBackend backend;
  const Batch batch = make_random_batch(config, 9, 64, 7, 3);
  ForwardOptions options;
  options.seed = 5;
  const int saved = omp_get_max_threads();
  std::vector<double> losses;
  std::vector<std::vector<float>> grads;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    ChunkedModel<float> model(config, split(config, {2}), backend, 4);
    losses.push_back(model.step(0, batch, options).total());
    const auto flat = model.chunks.front()->flat_grads();
    grads.emplace_back(flat.begin(), flat.end());
  }
  omp_set_num_threads(saved);
  for (std::size_t t = 1; t < losses.size(); ++t) {
    EXPECT_EQ(losses[t], losses[0]) << t + 1 << " threads";
    ASSERT_EQ(grads[t].size(), grads[0].size());
    for (std::size_t i = 0; i < grads[0].size(); ++i) {
      ASSERT_EQ(grads[t][i], grads[0][i]) << "element " << i << ", " << t + 1 << " threads";
    }
  }
}

TEST(BertModel, InitialisationDoesNotDependOnChunking) {
  const auto config = tiny_test_config();
  tensor::CpuBackend backend;
  ChunkedModel<float> whole(config, split(config, {4}), backend, 3);
  ChunkedModel<float> parts(config, split(config, {1, 3}), backend, 3);
  for (const auto& p : whole.chunks.front()->parameters()) {
    bool found = false;
    for (auto& chunk : parts.chunks) {
      if (auto q = chunk->parameter(p.name)) {
        found = true;
        for (std::int64_t i = 0; i < p.size; ++i) ASSERT_EQ(p.value[i], q->value[i]) << p.name;
      }
    }
    EXPECT_TRUE(found) << p.name;
  }
  auto decoder = parts.chunks.back()->parameter(tied_parameter_names().second);
  auto word = parts.chunks.front()->parameter(tied_parameter_names().first);
  ASSERT_TRUE(decoder && word);
  for (std::int64_t i = 0; i < word->size; ++i) ASSERT_EQ(decoder->value[i], word->value[i]);
  // LayerNorm 1/0, zero biases, std ~ initializer_range, padding row zero.
  auto ln = whole.chunks.front()->parameter("bert.encoder.layer.1.output.LayerNorm.weight");
  EXPECT_EQ(ln->value[0], 1.0F);
  EXPECT_TRUE(ln->is_bias_or_layernorm);
  EXPECT_EQ(whole.chunks.front()->parameter("cls.predictions.bias")->value[3], 0.0F);
  EXPECT_EQ(word->value[1], 0.0F);  // row 0 (pad) is zero
  auto q = whole.chunks.front()->parameter("bert.encoder.layer.0.attention.self.query.weight");
  EXPECT_EQ(q->shape, (std::vector<std::int64_t>{8, 8}));
  EXPECT_FALSE(q->is_bias_or_layernorm);
}

TEST(BertModel, KfacCaptureReproducesWeightGradients) {
  const auto config = tiny_test_config();
  tensor::CpuBackend backend;
  BertChunk<double> chunk(config, whole_model(config), backend);
  chunk.init_weights(4);
  const Batch batch = make_random_batch(config, 2, 6, 2, 3);
  KfacCaptureStore<double> store;
  ForwardOptions options;
  options.seed = 5;
  chunk.forward(7, batch, {}, options, &store);
  chunk.backward(7, {}, {}, 1.0, &store);
  EXPECT_EQ(store.inputs().size(), 4U * 6U);
  EXPECT_EQ(store.output_grads().size(), 4U * 6U);
  const char* names[] = {"attention.self.query",   "attention.self.key", "attention.self.value",
                         "attention.output.dense", "intermediate.dense", "output.dense"};
  for (int layer = 0; layer < config.num_layers; ++layer) {
    for (int kind = 0; kind < sched::kNumLinearKinds; ++kind) {
      const auto linear = static_cast<LinearKind>(kind);
      const auto& a = store.inputs().at({layer, linear, 7});
      const auto& g = store.output_grads().at({layer, linear, 7});
      ASSERT_EQ(a.rows(), batch.tokens());
      ASSERT_EQ(g.rows(), batch.tokens());
      const auto p = chunk.parameter("bert.encoder.layer." + std::to_string(layer) + "." +
                                     names[kind] + ".weight");
      ASSERT_TRUE(p);
      ASSERT_EQ(g.cols(), p->shape[0]);
      ASSERT_EQ(a.cols(), p->shape[1]);
      // dW = g^T a for a Linear layer: the captured factors carry the whole weight gradient.
      const Eigen::MatrixXd expected = g.transpose() * a;
      for (std::int64_t i = 0; i < p->shape[0]; ++i) {
        for (std::int64_t j = 0; j < p->shape[1]; ++j) {
          ASSERT_NEAR(p->grad[i * p->shape[1] + j], expected(i, j), 1e-12) << names[kind];
        }
      }
    }
  }
}

// The zero-bubble split: backward-input of several micro-batches, then their backward-weights
// later, gives the gradients of the fused backward bit for bit, and the same K-FAC g.
TEST(BertModel, SplitBackwardEqualsFusedBitForBit) {
  auto config = tiny_test_config();
  config.num_layers = 2;
  tensor::CpuBackend backend;
  const std::vector<ChunkSpec> specs = {
      {0, 0, true, false}, {0, 1, false, false}, {1, 1, false, true}};
  ChunkedModel<float> fused(config, specs, backend, 8);
  ChunkedModel<float> split_model(config, specs, backend, 8);
  const Batch b0 = make_random_batch(config, 2, 6, 2, 21);
  const Batch b1 = make_random_batch(config, 2, 6, 2, 22);
  ForwardOptions options;
  options.seed = 17;
  fused.step(0, b0, options, 0.5F);
  fused.step(1, b1, options, 0.5F);

  KfacCaptureStore<float> store;
  const std::int64_t rows = b0.tokens(), hidden = config.hidden_size;
  std::vector<std::vector<float>> acts(2);
  // Forward both micro-batches through the three chunks.
  std::vector<std::vector<std::vector<float>>> inputs(2, std::vector<std::vector<float>>(3));
  for (int mb = 0; mb < 2; ++mb) {
    const Batch& batch = mb == 0 ? b0 : b1;
    kernels::ConstMatrixView<float> x;
    for (std::size_t c = 0; c < 3; ++c) {
      auto result = split_model.chunks[c]->forward(mb, batch, x, options, &store);
      if (c < 2) {
        inputs[mb][c + 1].assign(result.output.data, result.output.data + rows * hidden);
        x = {inputs[mb][c + 1].data(), rows, hidden};
      }
    }
  }
  // Backward-input of both micro-batches through all chunks, then the weights in reverse order.
  std::vector<float> grad(static_cast<std::size_t>(rows * hidden));
  std::vector<float> grad_in(grad.size());
  for (int mb = 0; mb < 2; ++mb) {
    kernels::ConstMatrixView<float> dy;
    for (std::size_t c = 3; c-- > 0;) {
      kernels::MatrixView<float> dx =
          c == 0 ? kernels::MatrixView<float>()
                 : kernels::MatrixView<float>(grad_in.data(), rows, hidden);
      split_model.chunks[c]->backward_input(mb, dy, dx, 0.5F, &store);
      if (c > 0) {
        grad = grad_in;
        dy = {grad.data(), rows, hidden};
      }
    }
  }
  EXPECT_GT(split_model.chunks[1]->stash_bytes(), 0U);
  EXPECT_THROW(split_model.chunks[1]->backward_input(0, {grad.data(), rows, hidden},
                                                     {grad_in.data(), rows, hidden}),
               std::invalid_argument);
  // Micro-batches in the order of the fused run (a parameter's gradient sums its micro-batches
  // in backward order), chunks in any order.
  for (int mb = 0; mb < 2; ++mb) {
    for (auto& chunk : split_model.chunks) chunk->backward_weight(mb);
  }
  for (std::size_t c = 0; c < 3; ++c) {
    EXPECT_EQ(split_model.chunks[c]->in_flight(), 0);
    EXPECT_EQ(split_model.chunks[c]->stash_bytes(), 0U);
    const auto expected = fused.chunks[c]->flat_grads();
    const auto actual = split_model.chunks[c]->flat_grads();
    ASSERT_EQ(expected.size(), actual.size());
    for (std::size_t i = 0; i < expected.size(); ++i) {
      ASSERT_EQ(expected[i], actual[i]) << "chunk " << c << " element " << i;
    }
  }
  EXPECT_EQ(store.output_grads().size(), 2U * 2U * 6U);
  EXPECT_THROW(split_model.chunks[0]->backward_weight(0), std::invalid_argument);  // freed
}

// The data-parallel hook (gradients_ready.h): during backward each chunk reports ranges of its
// flat gradients, adjacent and descending, covering all of them once, each already holding its
// final value when reported (nothing adds to it afterwards).
class RecordingHook final : public GradientsReady {
 public:
  explicit RecordingHook(BertChunk<float>& chunk) : chunk_(&chunk) {}
  void on_gradients_ready(std::int64_t begin, std::int64_t end) override {
    ranges.emplace_back(begin, end);
    const auto grads = chunk_->flat_grads();
    snapshots.emplace_back(grads.begin() + begin, grads.begin() + end);
  }
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
  std::vector<std::vector<float>> snapshots;

 private:
  BertChunk<float>* chunk_;
};

TEST(BertModel, BackwardReportsEachFinishedGradientRangeOnce) {
  const auto config = tiny_test_config();
  tensor::CpuBackend backend;
  for (const auto& specs : {std::vector<ChunkSpec>{whole_model(config)}, split(config, {1, 2, 1}),
                            split(config, {0, 4, 0})}) {
    for (const bool split_backward : {false, true}) {
      auto chunks = make_chunks<float>(config, specs, backend, 3);
      const Batch batch = make_random_batch(config, 2, 6, 2, 9);
      ForwardOptions options;
      options.seed = 5;
      const std::int64_t rows = batch.tokens(), hidden = config.hidden_size;
      std::vector<std::vector<float>> inputs(chunks.size());
      kernels::ConstMatrixView<float> x;
      for (std::size_t c = 0; c < chunks.size(); ++c) {
        auto result = chunks[c]->forward(0, batch, x, options);
        if (c + 1 < chunks.size()) {
          inputs[c + 1].assign(result.output.data, result.output.data + rows * hidden);
          x = {inputs[c + 1].data(), rows, hidden};
        }
      }
      std::vector<float> grad(static_cast<std::size_t>(rows * hidden));
      std::vector<float> grad_in(grad.size());
      kernels::ConstMatrixView<float> dy;
      for (std::size_t c = chunks.size(); c-- > 0;) {
        SCOPED_TRACE("chunk " + std::to_string(c) + (split_backward ? " split" : " fused"));
        auto& chunk = *chunks[c];
        RecordingHook hook(chunk);
        kernels::MatrixView<float> dx =
            c == 0 ? kernels::MatrixView<float>()
                   : kernels::MatrixView<float>(grad_in.data(), rows, hidden);
        if (split_backward) {
          chunk.backward_input(0, dy, dx, 0.5F);
          EXPECT_TRUE(hook.ranges.empty());
          chunk.backward_weight(0, &hook);
        } else {
          chunk.backward(0, dy, dx, 0.5F, nullptr, &hook);
        }
        const auto final_grads = chunk.flat_grads();
        auto expected_end = static_cast<std::int64_t>(final_grads.size());
        for (std::size_t r = 0; r < hook.ranges.size(); ++r) {
          const auto [begin, end] = hook.ranges[r];
          EXPECT_EQ(end, expected_end) << "range " << r;
          EXPECT_LT(begin, end) << "range " << r;
          expected_end = begin;
          EXPECT_TRUE(std::equal(hook.snapshots[r].begin(), hook.snapshots[r].end(),
                                 final_grads.begin() + begin))
              << "range " << r << " changed after it was reported";
        }
        EXPECT_EQ(expected_end, 0);
        EXPECT_EQ(hook.ranges.size(), static_cast<std::size_t>(specs[c].num_layers) +
                                          (specs[c].has_head ? 1U : 0U) +
                                          (specs[c].has_embeddings ? 1U : 0U));
        if (c > 0) {
          grad = grad_in;
          dy = {grad.data(), rows, hidden};
        }
      }
    }
  }
}

// Activations and gradients handed over as strided views (columns of a wider buffer, as a
// receive buffer may be) give what contiguous ones give, bit for bit, through a chunk with layers
// and through one without (which passes the gradient through).
TEST(BertModel, StridedInputsAndGradientBuffersAreCopiedRowByRow) {
  auto config = tiny_test_config();
  config.num_layers = 1;
  tensor::CpuBackend backend;
  const Batch batch = make_random_batch(config, 2, 6, 2, 5);
  const std::int64_t rows = batch.tokens(), hidden = config.hidden_size, wide = hidden + 3;
  std::vector<float> input(static_cast<std::size_t>(rows * hidden));
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  for (auto& v : input) v = normal(rng);
  std::vector<float> input_wide(static_cast<std::size_t>(rows * wide), -7.0F);
  for (std::int64_t r = 0; r < rows; ++r) {
    std::copy_n(input.data() + r * hidden, hidden, input_wide.data() + r * wide + 2);
  }
  const kernels::ConstMatrixView<float> contiguous(input.data(), rows, hidden);
  const kernels::ConstMatrixView<float> strided(input_wide.data() + 2, rows, hidden, wide);
  for (const int layers : {1, 0}) {
    const ChunkSpec spec{0, layers, false, false};
    BertChunk<float> a(config, spec, backend), b(config, spec, backend);
    a.init_weights(4);
    b.init_weights(4);
    ForwardOptions options;
    options.seed = 9;
    const auto out_a = a.forward(0, batch, contiguous, options).output;
    const auto out_b = b.forward(0, batch, strided, options).output;
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = 0; c < hidden; ++c) ASSERT_EQ(out_a.row(r)[c], out_b.row(r)[c]);
    }
    std::vector<float> dx_a(input.size()), dx_wide(input_wide.size(), -7.0F);
    a.backward(0, contiguous, {dx_a.data(), rows, hidden});
    b.backward(0, strided, {dx_wide.data() + 2, rows, hidden, wide});
    for (std::int64_t r = 0; r < rows; ++r) {
      EXPECT_EQ(dx_wide[static_cast<std::size_t>(r * wide)], -7.0F);  // outside the view
      for (std::int64_t c = 0; c < hidden; ++c) {
        ASSERT_EQ(dx_a[static_cast<std::size_t>(r * hidden + c)],
                  dx_wide[static_cast<std::size_t>(r * wide + 2 + c)])
            << layers << " layers, row " << r;
      }
    }
    const auto ga = a.flat_grads(), gb = b.flat_grads();
    for (std::size_t i = 0; i < ga.size(); ++i) ASSERT_EQ(ga[i], gb[i]);
  }
}

TEST(BertModel, SteadyStateStepAllocatesNothing) {
  const auto config = tiny_test_config();
  tensor::CpuBackend backend;
  ChunkedModel<float> model(config, split(config, {2, 2}), backend, 1);
  const Batch batch = make_random_batch(config, 4, 8, 3, 1);
  ForwardOptions options;
  auto step = [&] {
    for (auto& chunk : model.chunks) chunk->zero_grad();
    model.forward(0, batch, options);
    model.forward(1, batch, options);
    model.backward(0, batch, 0.5F);
    model.backward(1, batch, 0.5F);
  };
  step();
  step();
  const auto warm = backend.stats().allocations;
  step();
  step();
  EXPECT_EQ(backend.stats().allocations, warm);
}

TEST(BertModel, EvaluationIgnoresTheDropoutSeed) {
  const auto config = tiny_test_config();
  tensor::CpuBackend backend;
  BertChunk<float> chunk(config, whole_model(config), backend);
  chunk.init_weights(1);
  const Batch batch = make_random_batch(config, 2, 6, 2, 3);
  ForwardOptions eval;
  eval.training = false;
  eval.seed = 1;
  const double a = chunk.forward(0, batch, {}, eval).losses->total();
  eval.seed = 2;
  const double b = chunk.forward(1, batch, {}, eval).losses->total();
  EXPECT_EQ(a, b);
  // Initial loss of an untrained model is near ln(vocab) + ln(2).
  EXPECT_NEAR(a, std::log(23.0) + std::log(2.0), 0.5);
  ForwardOptions train;
  train.seed = 1;
  const double c = chunk.forward(2, batch, {}, train).losses->total();
  EXPECT_NE(a, c);
  EXPECT_EQ(chunk.in_flight(), 3);
  for (int mb : {0, 1, 2}) chunk.discard(mb);
}

TEST(BertModel, BadInputIsReported) {
  auto config = tiny_test_config();
  tensor::CpuBackend backend;
  BertChunk<float> chunk(config, whole_model(config), backend);
  chunk.init_weights(1);
  Batch batch = make_random_batch(config, 2, 6, 2, 3);
  batch.input_ids[7] = 23;
  try {
    chunk.forward(0, batch, {}, {});
    FAIL() << "expected an exception";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("input_ids[1][1] = 23"), std::string::npos)
        << error.what();
  }
  batch = make_random_batch(config, 2, 12, 2, 3);  // longer than the position table
  EXPECT_THROW(chunk.forward(0, batch, {}, {}), std::invalid_argument);
  EXPECT_EQ(chunk.in_flight(), 0);  // nothing left behind by the failed forwards
  BertChunk<float> middle(config, {1, 2, false, false}, backend);
  batch = make_random_batch(config, 2, 6, 2, 3);
  std::vector<float> wrong(static_cast<std::size_t>(batch.tokens() * (config.hidden_size + 1)));
  EXPECT_THROW(middle.forward(0, batch, {wrong.data(), batch.tokens(), config.hidden_size + 1}, {}),
               std::invalid_argument);
  EXPECT_THROW(middle.forward(0, batch, {}, {}), std::invalid_argument);  // no input given
  EXPECT_THROW(chunk.backward(5, {}, {}), std::invalid_argument);         // never forwarded
  config.hidden_size = 9;
  EXPECT_THROW(BertChunk<float>(config, whole_model(config), backend), std::invalid_argument);
  // Chunk lists must cover the model in order.
  const auto good = tiny_test_config();
  EXPECT_THROW(validate_chunk_specs(good, {{0, 2, true, false}, {3, 1, false, true}}),
               std::invalid_argument);
  EXPECT_THROW(validate_chunk_specs(good, {{0, 4, false, true}}), std::invalid_argument);
}

TEST(BertModel, NonFiniteGradientsNameTheTensor) {
  const auto config = tiny_test_config();
  tensor::CpuBackend backend;
  BertChunk<float> chunk(config, whole_model(config), backend);
  chunk.init_weights(1);
  chunk.zero_grad();
  const Batch batch = make_random_batch(config, 2, 6, 2, 3);
  chunk.forward(0, batch, {}, {});
  chunk.backward(0, {}, {});
  EXPECT_NO_THROW(chunk.check_finite_gradients(3));
  EXPECT_NO_THROW(check_finite_loss({2.0, 0.7}, 3));
  EXPECT_THROW(check_finite_loss({NAN, 0.7}, 3), std::runtime_error);
  chunk.parameter("bert.encoder.layer.2.intermediate.dense.bias")->grad[4] = NAN;
  try {
    chunk.check_finite_gradients(3);
    FAIL() << "expected an exception";
  } catch (const std::runtime_error& error) {
    const std::string what = error.what();
    EXPECT_NE(what.find("step 3"), std::string::npos) << what;
    EXPECT_NE(what.find("bert.encoder.layer.2.intermediate.dense.bias"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace pf::model
