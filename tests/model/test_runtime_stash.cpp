// The simulator's activation memory for the BERT analytic model is what pipefisher_train keeps:
// for chunks of a small BERT on the CPU, BertChunk::stash_bytes() after the forwards and after the
// backward_inputs, and reserved_stash_bytes() (the pooled arenas) once the backwards are done,
// equal the simulator's runtime_chunk_stash, chunk_activation_bytes and
// AnalyticCostModel::activation_bytes exactly: per layer, per chunk of a compiled schedule and
// per micro-batch in flight, at shapes whose buffers are and are not multiples of the arena's
// 64-byte alignment, and arenas under its 1 MiB block (sim/runtime_stash.h). The fused attention's
// stash is checked on a GPU by test_model_cuda (BertCudaTest.StashBytesAreTheSimulators).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "runtime/model/bert_chunk.h"
#include "runtime/tensor/cpu_backend.h"
#include "scheduler/compile.h"
#include "sim/analytic_cost_model.h"
#include "sim/bert_costs.h"
#include "sim/device.h"
#include "sim/runtime_stash.h"

namespace pf::model {
namespace {

struct Shape {
  BertConfig config;
  std::int64_t batch = 0, seq = 0, predictions = 0;
};

BertConfig config_of(int hidden, int heads, int intermediate, int vocab, int layers) {
  BertConfig config;
  config.name = "stash-test";
  config.vocab_size = vocab;
  config.hidden_size = hidden;
  config.num_layers = layers;
  config.num_heads = heads;
  config.intermediate_size = intermediate;
  config.max_position_embeddings = 40;
  config.type_vocab_size = 2;
  config.hidden_dropout = 0.1F;
  config.attention_dropout = 0.1F;
  return config;
}

// Odd sizes (buffers padded to 64 bytes: T = 14 tokens, R = 6 predictions; every arena under
// 1 MiB), and larger ones (arenas of several blocks, merged into one of the cycle's size).
std::vector<Shape> shapes() {
  return {{config_of(8, 2, 12, 23, 4), 2, 7, 3},
          {config_of(64, 4, 160, 211, 4), 3, 37, 5},
          {config_of(128, 4, 320, 100, 4), 4, 40, 6}};
}

sim::Workload workload_of(const Shape& s) {
  sim::Workload w;
  w.config = s.config;
  w.seq_len = static_cast<int>(s.seq);
  w.micro_batch_size = static_cast<int>(s.batch);
  w.max_predictions = static_cast<int>(s.predictions);
  w.precision = sim::Precision::kFp32;  // BertChunk<float>: 4-byte elements
  w.validate();
  return w;
}

// What a fresh chunk of `spec` holds with `microbatches` micro-batches in flight: its stash after
// their forwards, after their backward_inputs, and the arenas it keeps once their
// backward_weights are done.
struct Held {
  std::size_t forward = 0, backward_input = 0, reserved = 0;
};
Held run(const Shape& s, const ChunkSpec& spec, int microbatches = 1) {
  tensor::CpuBackend backend;
  BertChunk<float> chunk(s.config, spec, backend);
  chunk.init_weights(5);
  const Batch batch = make_random_batch(s.config, s.batch, s.seq, s.predictions, 3);
  const std::int64_t rows = batch.tokens(), H = s.config.hidden_size;
  std::vector<float> input(static_cast<std::size_t>(rows * H)), grad(input.size()),
      grad_input(input.size());
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  for (float& x : input) x = normal(rng);
  for (float& x : grad) x = normal(rng);
  ForwardOptions options;
  options.seed = 11;
  Held held;
  for (int m = 0; m < microbatches; ++m) {
    (void)chunk.forward(m, batch,
                        spec.has_embeddings
                            ? kernels::ConstMatrixView<float>()
                            : kernels::ConstMatrixView<float>(input.data(), rows, H),
                        options);
  }
  held.forward = chunk.stash_bytes();
  for (int m = 0; m < microbatches; ++m) {
    chunk.backward_input(m, {grad.data(), rows, H},
                         spec.has_embeddings
                             ? kernels::MatrixView<float>()
                             : kernels::MatrixView<float>(grad_input.data(), rows, H),
                         0.5F);
  }
  held.backward_input = chunk.stash_bytes();
  for (int m = 0; m < microbatches; ++m) chunk.backward_weight(m);
  EXPECT_EQ(chunk.stash_bytes(), 0U);
  held.reserved = chunk.reserved_stash_bytes();
  return held;
}

std::string name_of(const Shape& s, const ChunkSpec& spec) {
  return "H " + std::to_string(s.config.hidden_size) + ", b x S " + std::to_string(s.batch) +
         " x " + std::to_string(s.seq) + ", chunk layers " + std::to_string(spec.first_layer) +
         "+" + std::to_string(spec.num_layers) + (spec.has_embeddings ? " + embeddings" : "") +
         (spec.has_head ? " + head" : "");
}

TEST(RuntimeStash, EveryChunkKeepsWhatTheSimulatorCounts) {
  const std::vector<ChunkSpec> specs = {
      {0, 0, true, false}, {0, 1, true, false}, {1, 1, false, false}, {1, 2, false, false},
      {3, 1, false, true}, {3, 0, false, true}, {0, 4, true, true}};
  for (const Shape& s : shapes()) {
    const sim::Workload w = workload_of(s);
    for (const ChunkSpec& spec : specs) {
      const auto expected =
          sim::runtime_chunk_stash(w, spec.num_layers, spec.has_embeddings, spec.has_head);
      for (const int microbatches : {1, 2}) {
        const Held held = run(s, spec, microbatches);
        const std::string what =
            name_of(s, spec) + ", " + std::to_string(microbatches) + " in flight";
        EXPECT_EQ(static_cast<double>(held.forward), microbatches * expected.forward) << what;
        EXPECT_EQ(static_cast<double>(held.backward_input), microbatches * expected.total())
            << what;
        // The pooled arenas: what the analytic model counts per stashed micro-batch.
        EXPECT_EQ(static_cast<double>(held.reserved),
                  microbatches * sim::chunk_activation_bytes(w, spec.num_layers,
                                                             spec.has_embeddings, spec.has_head))
            << what;
      }
    }
    // One encoder layer: the difference of two chunks that differ by one layer.
    const Held one = run(s, {1, 1, false, false});
    const Held two = run(s, {1, 2, false, false});
    const auto layer = sim::runtime_layer_stash(w);
    EXPECT_EQ(static_cast<double>(two.forward - one.forward), layer.forward);
    EXPECT_EQ(static_cast<double>(two.backward_input - one.backward_input), layer.total());
    EXPECT_EQ(layer.total(), sim::encoder_layer_activation_bytes(w));
  }
}

TEST(RuntimeStash, AnalyticModelPricesTheChunksOfACompiledSchedule) {
  const Shape s = shapes()[1];
  const sim::Workload w = workload_of(s);
  const sim::AnalyticCostModel costs(w, sim::device_preset("h100"));
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kInterleaved;
  params.workers = 2;
  params.chunks_per_worker = 2;
  params.microbatches = 4;
  params.num_layers = s.config.num_layers;
  const auto schedule = sched::compile(params);
  const auto& placement = schedule.placement;
  ASSERT_EQ(placement.chunks_per_pipeline, 4);
  for (int c = 0; c < placement.chunks_per_pipeline; ++c) {
    const ChunkSpec spec = chunk_spec(placement.at(0, c));
    EXPECT_EQ(static_cast<double>(run(s, spec, 2).reserved),
              2 * costs.activation_bytes(schedule, 0, c))
        << name_of(s, spec);
  }
}

TEST(RuntimeStash, TheEagerCountIsAnOption) {
  // Korthikanti et al.'s count stays available (--stash eager) for published figures; it has
  // dropout masks and the probabilities' dropout output, which this runtime regenerates, and no
  // kept gradients, which it has.
  sim::Workload w;
  w.config = bert_preset("large");
  w.seq_len = 128;
  w.micro_batch_size = 32;
  w.precision = sim::Precision::kBf16;
  w.storage_precision = sim::Precision::kFp32;
  const double runtime = sim::encoder_layer_activation_bytes(w);
  w.stash = sim::ActivationStash::kEager;
  const double eager = sim::encoder_layer_activation_bytes(w);
  const double T = 32.0 * 128, H = 1024, I = 4096, scores = 32.0 * 16 * 128 * 128;
  // Forward 8TH + 2TI + 4T + the probabilities, the backward's kept gradients 5TH + TI.
  EXPECT_DOUBLE_EQ(runtime, 4.0 * (8 * T * H + 2 * T * I + 4 * T + scores + 5 * T * H + T * I));
  EXPECT_DOUBLE_EQ(eager, 2.0 * (T * (18 * H + 4 * I) + 5 * scores));
  EXPECT_NE(runtime, eager);
  EXPECT_EQ(sim::activation_stash_from_string("eager"), sim::ActivationStash::kEager);
  EXPECT_EQ(sim::to_string(sim::ActivationStash::kRuntime), "runtime");
  EXPECT_THROW((void)sim::activation_stash_from_string("megatron"), std::invalid_argument);
}

}  // namespace
}  // namespace pf::model
