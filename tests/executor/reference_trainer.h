#pragma once
// The oracle of the executor tests: plain single-worker training of the whole model, one
// micro-batch after another, with the K-FAC updates run in sequence after each step's backward
// (curvature of the refresh's first step, inversion at its last step, preconditioning every
// step with the inverses the pipelined run must use; with a pipelined refresh the inversion
// follows the last step's preconditioning). No schedule, no communicator.
#include <cmath>
#include <map>
#include <memory>
#include <optional>

#include "kernels/rng.h"
#include "kfac/factors.h"
#include "kfac/layer_state.h"
#include "kfac/precondition.h"
#include "runtime/executor/batch_source.h"
#include "runtime/executor/executor.h"
#include "runtime/model/bert_chunk.h"
#include "runtime/optim/optimizer.h"
#include "runtime/tensor/cpu_backend.h"

namespace pf::exec::testing {

struct ReferenceKfac {
  int refresh_steps = 1;  // k
  KfacSettings settings;
  // A pipelined refresh (--kfac-pipelined-refresh on): the refresh's inverses serve from the
  // next window's first step, so the last step of a window preconditions with the previous
  // refresh's and the inversion follows it.
  bool pipelined = false;
};

template <typename T>
class ReferenceTrainer {
 public:
  ReferenceTrainer(const model::BertConfig& config, std::uint64_t init_seed,
                   std::uint64_t dropout_seed, std::unique_ptr<optim::BasicOptimizer<T>> optimizer,
                   LearningRate learning_rate, std::optional<ReferenceKfac> kfac = std::nullopt)
      : config_(config),
        model_(config, model::whole_model(config), backend_),
        dropout_seed_(dropout_seed),
        optimizer_(std::move(optimizer)),
        learning_rate_(std::move(learning_rate)),
        kfac_(kfac) {
    model_.init_weights(init_seed);
    for (auto& p : model_.parameters()) {
      views_.push_back({p.name, p.value, p.grad, static_cast<std::size_t>(p.size), p.shape,
                        p.is_bias_or_layernorm});
    }
    if (kfac_) {
      for (int layer = 0; layer < config.num_layers; ++layer) {
        for (int k = 0; k < sched::kNumLinearKinds; ++k) {
          const auto linear = static_cast<sched::LinearKind>(k);
          const std::int64_t H = config.hidden_size, I = config.intermediate_size;
          state_.add_layer({layer, linear}, linear == sched::LinearKind::kFfnOut ? I : H,
                           linear == sched::LinearKind::kFfnIn ? I : H);
        }
      }
    }
  }

  // One step on the global batch: micro-batches 0 .. count-1 of `source` for `step`.
  void step(std::int64_t step, BatchSource& source, int count) {
    const int k = kfac_ ? kfac_->refresh_steps : 1;
    const bool curvature = kfac_ && step % k == 0;
    model::KfacCaptureStore<T> store;
    for (int i = 0; i < count; ++i) {
      const auto batch = source.batch(step, i);
      model::ForwardOptions options;
      options.seed = kernels::derive_seed(
          kernels::derive_seed(dropout_seed_, static_cast<std::uint64_t>(step)),
          static_cast<std::uint64_t>(i));
      model_.forward(i, *batch, {}, options, curvature ? &store : nullptr);
      model_.backward(i, {}, {}, T(1) / static_cast<T>(count), curvature ? &store : nullptr);
      sequences_ = batch->batch_size;
    }
    if constexpr (std::is_same_v<T, float>) {
      if (kfac_) kfac_step(step, store, count);
    }
    const double norm = optim::global_grad_norm(std::span<const optim::BasicParamView<T>>(views_));
    optimizer_->step(views_, static_cast<T>(learning_rate_(step)), norm);
    model_.zero_grad();
  }

  model::BertChunk<T>& model() { return model_; }
  kfac::KfacState& kfac_state() { return state_; }

 private:
  void kfac_step(std::int64_t step, const model::KfacCaptureStore<T>& store, int count) {
    const int k = kfac_->refresh_steps;
    for (auto& [key, layer] : state_.layers()) {
      if (step % k == 0) {
        for (int i = 0; i < count; ++i) {
          const auto& a = store.inputs().at({key.layer, key.linear, i});
          const auto& g = store.output_grads().at({key.layer, key.linear, i});
          kfac::accumulate_a(layer, a.data(), a.rows());
          kfac::accumulate_b(layer, g.data(), g.rows(),
                             kfac::output_grad_scale(sequences_, g.rows(), count));
        }
      }
      const bool refresh = step % k == k - 1;
      if (refresh && !kfac_->pipelined) invert(layer);
      if (layer.a.inverse.size() != 0 && layer.b.inverse.size() != 0) {
        static constexpr const char* kNames[] = {"attention.self.query", "attention.self.key",
                                                 "attention.self.value", "attention.output.dense",
                                                 "intermediate.dense",   "output.dense"};
        const std::string prefix = "bert.encoder.layer." + std::to_string(key.layer) + "." +
                                   kNames[static_cast<int>(key.linear)] + ".";
        auto w = model_.parameter(prefix + "weight");
        auto b = model_.parameter(prefix + "bias");
        kfac::precondition(layer.a.inverse, layer.b.inverse, w->grad, b->grad, w->shape[0],
                           w->shape[1], w->grad, b->grad);
      }
      if (refresh && kfac_->pipelined) invert(layer);
    }
  }

  void invert(kfac::KfacLayerState& layer) {
    kfac::finalize_a(layer, kfac_->settings.running_average);
    kfac::finalize_b(layer, kfac_->settings.running_average);
    const auto damping =
        kfac::layer_damping(layer, kfac_->settings.damping, kfac_->settings.pi_adjusted);
    kfac::invert_a(layer, damping.a, kfac_->settings.method);
    kfac::invert_b(layer, damping.b, kfac_->settings.method);
  }

  model::BertConfig config_;
  tensor::CpuBackend backend_;
  model::BertChunk<T> model_;
  std::uint64_t dropout_seed_;
  std::unique_ptr<optim::BasicOptimizer<T>> optimizer_;
  LearningRate learning_rate_;
  std::optional<ReferenceKfac> kfac_;
  kfac::KfacState state_;
  std::vector<optim::BasicParamView<T>> views_;
  std::int64_t sequences_ = 1;
};

}  // namespace pf::exec::testing
