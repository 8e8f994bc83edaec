// BERT on a GPU: BertChunk on the CUDA backend (its ops are CudaOps) against the same chunks on
// the CPU. Initial weights bit for bit; with dropout on and two micro-batches in flight, the
// losses and every parameter gradient of the whole model and of a three-chunk split (activations
// handed over in device memory) in fp32, TF32 and BF16 products; the zero-bubble split backward
// against the fused one; a non-finite gradient named; K-FAC factors computed on the device from
// the chunk's capture views (read in place, q/k/v strided) against the CPU's from its captures.
// The stash against the simulator's count, both attentions. Skipped without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cuda/cuda_backend.h"
#include "kfac/cuda/layer_state_cuda.h"
#include "kfac/layer_state.h"
#include "runtime/model/bert_chunk.h"
#include "runtime/tensor/cpu_backend.h"
#include "runtime/tensor/tensor.h"
#include "sim/bert_costs.h"
#include "sim/runtime_stash.h"
#include "tests/kernels/cuda_test_util.h"

namespace pf::model {
namespace {

using kernels::GemmPrecision;
using pf::testing::expect_close;
using pf::testing::nmse;
using Chunks = std::vector<std::unique_ptr<BertChunk<float>>>;

// Small, but with several heads, odd vocabulary and sequence sizes and every part of the model.
BertConfig small_config() {
  BertConfig config;
  config.name = "cuda-test";
  config.vocab_size = 211;
  config.hidden_size = 64;
  config.num_layers = 3;
  config.num_heads = 4;
  config.intermediate_size = 160;
  config.max_position_embeddings = 40;
  config.type_vocab_size = 2;
  config.hidden_dropout = 0.1F;
  config.attention_dropout = 0.1F;
  return config;
}

std::vector<ChunkSpec> three_chunks() {
  return {{0, 1, true, false}, {1, 1, false, false}, {2, 1, false, true}};
}

std::vector<float> to_host(tensor::Backend& backend, const float* data, std::int64_t count) {
  backend.synchronize();
  std::vector<float> host(static_cast<std::size_t>(count));
  backend.copy(host.data(), data, host.size() * sizeof(float), tensor::CopyKind::kDeviceToHost);
  backend.synchronize();
  return host;
}

// Forwards every micro-batch through the chunks, then backwards them in the same order (1F1B's
// shape with all forwards first), on whatever device the chunks live; the gradients between
// chunks are device buffers of `backend`. Split: backward_input of all micro-batches, then their
// backward_weight. Returns the sum of the micro-batches' losses.
double run_step(Chunks& chunks, tensor::Backend& backend, const std::vector<Batch>& batches,
                bool split_backward = false) {
  const float loss_scale = 1.0F / static_cast<float>(batches.size());
  const std::int64_t hidden = chunks.front()->config().hidden_size;
  double loss = 0.0;
  for (std::size_t m = 0; m < batches.size(); ++m) {
    kernels::ConstMatrixView<float> activation;
    ForwardOptions options;
    options.seed = 100 + m;
    for (auto& chunk : chunks) {
      const auto result = chunk->forward(static_cast<int>(m), batches[m], activation, options);
      if (result.losses) loss += result.losses->total();
      activation = result.output;  // forward copies its input: this is the hand-over
    }
  }
  for (std::size_t m = 0; m < batches.size(); ++m) {
    const std::int64_t rows = batches[m].tokens();
    tensor::Tensor grad_output;  // the head chunk's is ignored
    for (std::size_t c = chunks.size(); c-- > 0;) {
      tensor::Tensor grad_input;
      kernels::MatrixView<float> grad_input_view;
      if (c > 0) {
        grad_input = tensor::Tensor::empty(backend, {rows, hidden}, tensor::DType::kF32);
        grad_input_view = {grad_input.data<float>(), rows, hidden};
      }
      const kernels::ConstMatrixView<float> grad_output_view(
          grad_output.numel() > 0 ? grad_output.data<float>() : nullptr, rows, hidden);
      if (split_backward) {
        chunks[c]->backward_input(static_cast<int>(m), grad_output_view, grad_input_view,
                                  loss_scale);
      } else {
        chunks[c]->backward(static_cast<int>(m), grad_output_view, grad_input_view, loss_scale);
      }
      grad_output = grad_input;
    }
  }
  if (split_backward) {
    for (std::size_t m = 0; m < batches.size(); ++m) {
      for (auto& chunk : chunks) chunk->backward_weight(static_cast<int>(m));
    }
  }
  return loss;
}

class BertCudaTest : public pf::testing::CudaTest {
 protected:
  BertConfig config_ = small_config();
  std::vector<Batch> batches_ = {make_random_batch(config_, 3, 37, 5, 1),
                                 make_random_batch(config_, 3, 37, 5, 2)};
  tensor::CpuBackend cpu_;

  Chunks cpu_chunks(const std::vector<ChunkSpec>& specs) {
    return make_chunks<float>(config_, specs, cpu_, 9);
  }
  Chunks gpu_chunks(
      const std::vector<ChunkSpec>& specs, GemmPrecision precision,
      kernels::AttentionAlgorithm attention = kernels::AttentionAlgorithm::kBatchedGemm) {
    return make_chunks<float>(config_, specs, *backend_, 9, nullptr, precision, attention);
  }
  // Every parameter's gradient (the tied copies kept apart: both chunkings are the same).
  std::vector<std::pair<std::string, std::vector<float>>> gradients(Chunks& chunks,
                                                                    tensor::Backend& backend) {
    std::vector<std::pair<std::string, std::vector<float>>> all;
    for (auto& chunk : chunks) {
      for (const auto& p : chunk->parameters()) {
        all.emplace_back(p.name, to_host(backend, p.grad, p.size));
      }
    }
    return all;
  }
};

TEST_F(BertCudaTest, InitialWeightsAreTheCpuWeightsBitForBit) {
  auto cpu = cpu_chunks(three_chunks());
  auto gpu = gpu_chunks(three_chunks(), GemmPrecision::kFp32);
  for (std::size_t c = 0; c < cpu.size(); ++c) {
    EXPECT_EQ(gpu[c]->device().kind, tensor::DeviceKind::kCuda);
    const auto expected = cpu[c]->flat_values();
    const auto actual = to_host(*backend_, gpu[c]->flat_values().data(),
                                static_cast<std::int64_t>(gpu[c]->flat_values().size()));
    ASSERT_EQ(actual.size(), expected.size());
    for (std::size_t i = 0; i < actual.size(); ++i) ASSERT_EQ(actual[i], expected[i]) << i;
  }
}

TEST_F(BertCudaTest, LossesAndGradientsMatchTheCpu) {
  auto cpu = cpu_chunks({whole_model(config_)});
  const double cpu_loss = run_step(cpu, cpu_, batches_);
  const auto expected = gradients(cpu, cpu_);
  using kernels::AttentionAlgorithm;
  struct Case {
    GemmPrecision precision;
    std::vector<ChunkSpec> specs;
    double loss_tolerance, max_nmse;
    AttentionAlgorithm attention = AttentionAlgorithm::kBatchedGemm;
  };
  const std::vector<Case> cases = {
      {GemmPrecision::kFp32, {whole_model(config_)}, 1e-5, 1e-8},
      {GemmPrecision::kFp32, three_chunks(), 1e-5, 1e-8},
      {GemmPrecision::kTf32, {whole_model(config_)}, 2e-3, 1e-4},
      {GemmPrecision::kBf16, three_chunks(), 2e-2, 5e-3},
      {GemmPrecision::kBf16Operands, three_chunks(), 2e-2, 5e-3},
      // The fused attention (the model's stash holds log-sum-exps instead of probabilities).
      {GemmPrecision::kFp32, three_chunks(), 1e-5, 1e-8, AttentionAlgorithm::kFused},
      {GemmPrecision::kTf32, {whole_model(config_)}, 2e-3, 1e-4, AttentionAlgorithm::kFused}};
  for (const auto& c : cases) {
    const std::string what = std::string(kernels::to_string(c.precision)) + ", " +
                             std::to_string(c.specs.size()) + " chunk(s), " +
                             std::string(kernels::to_string(c.attention)) + " attention";
    auto gpu = gpu_chunks(c.specs, c.precision, c.attention);
    const double gpu_loss = run_step(gpu, *backend_, batches_);
    EXPECT_NEAR(gpu_loss, cpu_loss, c.loss_tolerance * std::abs(cpu_loss)) << what;
    // The whole model's tensors in its order; a split model holds the same ones plus the
    // decoder's tied copy, whose gradient the whole model adds into the word embedding.
    auto actual = gradients(gpu, *backend_);
    for (const auto& [name, values] : expected) {
      std::vector<float> sum;
      for (const auto& [other, grad] : actual) {
        if (other != name &&
            !(name == tied_parameter_names().first && other == tied_parameter_names().second)) {
          continue;
        }
        if (sum.empty()) sum.assign(grad.size(), 0.0F);
        for (std::size_t i = 0; i < grad.size(); ++i) sum[i] += grad[i];
      }
      ASSERT_EQ(sum.size(), values.size()) << name << ", " << what;
      const std::string key_bias = "attention.self.key.bias";
      if (name.size() > key_bias.size() && name.ends_with(key_bias)) {
        // Zero in exact arithmetic (a key bias shifts every score of a query's row alike, and
        // softmax ignores that): both sides hold rounding noise, so the GPU's must be small next
        // to the gradient of the same layer's query bias.
        const std::string query_name =
            name.substr(0, name.size() - key_bias.size()) + "attention.self.query.bias";
        const auto query = std::find_if(expected.begin(), expected.end(), [&](const auto& entry) {
          return entry.first == query_name;
        });
        ASSERT_NE(query, expected.end()) << query_name;
        double scale = 0.0;
        for (const float q : query->second)
          scale = std::max(scale, std::abs(static_cast<double>(q)));
        double largest = 0.0;
        for (const float g : sum) largest = std::max(largest, std::abs(static_cast<double>(g)));
        const double tolerance = c.precision == GemmPrecision::kFp32   ? 1e-4
                                 : c.precision == GemmPrecision::kTf32 ? 2e-2
                                                                       : 1e-1;
        EXPECT_LE(largest, tolerance * scale) << name << ", " << what;
        continue;
      }
      if (c.precision == GemmPrecision::kFp32) {
        expect_close(sum, values, 2e-4, name + ", " + what);
      } else {
        EXPECT_LT(nmse(sum, values), c.max_nmse) << name << ", " << what;
      }
    }
  }
}

// pipefisher_train's stash on the GPU is what the simulator's memory counts
// (sim/runtime_stash.h), byte for byte, with either attention: the batched core keeps the
// probabilities, the fused one a log-sum-exp per query row (flash_attention.cu); after a step of
// two micro-batches each chunk keeps two arenas of the size the analytic model counts.
TEST_F(BertCudaTest, StashBytesAreTheSimulators) {
  using kernels::AttentionAlgorithm;
  for (const auto attention : {AttentionAlgorithm::kBatchedGemm, AttentionAlgorithm::kFused}) {
    sim::Workload w;
    w.config = config_;
    w.seq_len = static_cast<int>(batches_[0].seq_len);
    w.micro_batch_size = static_cast<int>(batches_[0].batch_size);
    w.max_predictions = static_cast<int>(batches_[0].max_predictions);
    w.precision = sim::Precision::kFp32;
    w.attention = attention == AttentionAlgorithm::kFused ? sim::AttentionAlgorithm::kFused
                                                          : sim::AttentionAlgorithm::kBatched;
    const auto specs = three_chunks();
    const std::string what = std::string(kernels::to_string(attention)) + " attention, chunk ";
    {
      auto chunks = gpu_chunks(specs, GemmPrecision::kFp32, attention);
      kernels::ConstMatrixView<float> activation;
      ForwardOptions options;
      options.seed = 3;
      for (std::size_t c = 0; c < chunks.size(); ++c) {
        activation = chunks[c]->forward(0, batches_[0], activation, options).output;
        const auto& spec = specs[c];
        EXPECT_EQ(static_cast<double>(chunks[c]->stash_bytes()),
                  sim::runtime_chunk_stash(w, spec.num_layers, spec.has_embeddings, spec.has_head)
                      .forward)
            << what << c;
      }
    }
    auto chunks = gpu_chunks(specs, GemmPrecision::kFp32, attention);
    (void)run_step(chunks, *backend_, batches_);
    for (std::size_t c = 0; c < chunks.size(); ++c) {
      const auto& spec = specs[c];
      EXPECT_EQ(
          static_cast<double>(chunks[c]->reserved_stash_bytes()),
          2 * sim::chunk_activation_bytes(w, spec.num_layers, spec.has_embeddings, spec.has_head))
          << what << c;
    }
  }
}

TEST_F(BertCudaTest, SplitBackwardMatchesTheFusedBackward) {
  auto fused = gpu_chunks(three_chunks(), GemmPrecision::kFp32);
  auto split = gpu_chunks(three_chunks(), GemmPrecision::kFp32);
  const double fused_loss = run_step(fused, *backend_, batches_, false);
  const double split_loss = run_step(split, *backend_, batches_, true);
  EXPECT_NEAR(split_loss, fused_loss, 1e-6 * std::abs(fused_loss));
  const auto expected = gradients(fused, *backend_);
  const auto actual = gradients(split, *backend_);
  ASSERT_EQ(actual.size(), expected.size());
  for (std::size_t i = 0; i < actual.size(); ++i) {
    // Atomic scatter-adds may sum in another order: close, not bitwise.
    expect_close(actual[i].second, expected[i].second, 1e-6, actual[i].first);
  }
  for (auto& chunk : split) EXPECT_EQ(chunk->in_flight(), 0);
}

TEST_F(BertCudaTest, NonFiniteGradientsNameTheTensorAndElement) {
  auto gpu = gpu_chunks({whole_model(config_)}, GemmPrecision::kFp32);
  gpu.front()->zero_grad();
  run_step(gpu, *backend_, {batches_.front()});
  EXPECT_NO_THROW(gpu.front()->check_finite_gradients(3));
  const auto bias = gpu.front()->parameter("bert.encoder.layer.2.intermediate.dense.bias");
  ASSERT_TRUE(bias);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  backend_->copy(bias->grad + 4, &nan, sizeof(float), tensor::CopyKind::kHostToDevice);
  try {
    gpu.front()->check_finite_gradients(3);
    FAIL() << "expected an exception";
  } catch (const std::runtime_error& error) {
    const std::string what = error.what();
    EXPECT_NE(what.find("step 3"), std::string::npos) << what;
    EXPECT_NE(what.find("bert.encoder.layer.2.intermediate.dense.bias' (element 4 is nan"),
              std::string::npos)
        << what;
  }
}

// Feeds one encoder layer's captures straight into device K-FAC layers (no copies).
class DeviceFactorCapture final : public KfacCapture<float> {
 public:
  DeviceFactorCapture(kfac::cuda::KfacCuda& kfac, const BertConfig& config, int layer)
      : layer_(layer) {
    const std::int64_t H = config.hidden_size, I = config.intermediate_size;
    for (const auto& [kind, d_in, d_out] :
         std::vector<std::tuple<LinearKind, std::int64_t, std::int64_t>>{
             {LinearKind::kQuery, H, H},
             {LinearKind::kValue, H, H},
             {LinearKind::kAttentionOut, H, H},
             {LinearKind::kFfnIn, H, I},
             {LinearKind::kFfnOut, I, H}}) {
      layers_.emplace(
          kind, std::make_unique<kfac::cuda::KfacLayerCuda>(kfac, d_in, d_out, "capture test"));
    }
  }
  void on_input(int layer, LinearKind linear, int, kernels::ConstMatrixView<float> a) override {
    if (layer == layer_ && layers_.contains(linear)) layers_.at(linear)->accumulate_a(a);
  }
  void on_output_grad(int layer, LinearKind linear, int,
                      kernels::ConstMatrixView<float> g) override {
    if (layer == layer_ && layers_.contains(linear)) layers_.at(linear)->accumulate_b(g, 2.0F);
  }
  std::map<LinearKind, std::unique_ptr<kfac::cuda::KfacLayerCuda>> layers_;

 private:
  int layer_;
};

TEST_F(BertCudaTest, KfacFactorsFromDeviceCapturesMatchTheCpu) {
  auto cpu = cpu_chunks({whole_model(config_)});
  KfacCaptureStore<float> store;
  ForwardOptions options;
  options.seed = 3;
  cpu.front()->forward(0, batches_.front(), {}, options, &store);
  cpu.front()->backward(0, {}, {}, 1.0F, &store);

  auto gpu = gpu_chunks({whole_model(config_)}, GemmPrecision::kFp32);
  kfac::cuda::KfacCuda kfac(*backend_);
  DeviceFactorCapture capture(kfac, config_, 1);
  gpu.front()->forward(0, batches_.front(), {}, options, &capture);
  gpu.front()->backward(0, {}, {}, 1.0F, &capture);
  for (auto& [kind, device_layer] : capture.layers_) {
    const auto& a = store.inputs().at({1, kind, 0});
    const auto& g = store.output_grads().at({1, kind, 0});
    kfac::KfacLayerState expected(a.cols(), g.cols());
    kfac::accumulate_a(expected, a.data(), a.rows());
    kfac::accumulate_b(expected, g.data(), g.rows(), 2.0F);
    kfac::finalize_a(expected);
    kfac::finalize_b(expected);
    device_layer->finalize_a();
    device_layer->finalize_b();
    const auto actual = device_layer->to_host();
    const std::string what(kfac::linear_name(kind));
    const auto flat = [](const Eigen::MatrixXf& m) {
      return std::vector<float>(m.data(), m.data() + m.size());
    };
    expect_close(flat(actual.a.value), flat(expected.a.value), 2e-4, what + " A");
    expect_close(flat(actual.b.value), flat(expected.b.value), 2e-4, what + " B");
  }
}

}  // namespace
}  // namespace pf::model
