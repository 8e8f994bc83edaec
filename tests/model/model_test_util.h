#pragma once
// Helpers shared by the model tests.
#include <memory>
#include <vector>

#include "runtime/model/bert_chunk.h"
#include "runtime/tensor/cpu_backend.h"

namespace pf::model::testing {

inline BertConfig tiny_test_config() {
  BertConfig config;
  config.name = "test";
  config.vocab_size = 23;
  config.hidden_size = 8;
  config.num_layers = 4;
  config.num_heads = 2;
  config.intermediate_size = 12;
  config.max_position_embeddings = 10;
  config.type_vocab_size = 2;
  config.hidden_dropout = 0.1F;
  config.attention_dropout = 0.1F;
  return config;
}

template <typename T>
struct ChunkedModel {
  std::vector<std::unique_ptr<BertChunk<T>>> chunks;

  ChunkedModel(const BertConfig& config, const std::vector<ChunkSpec>& specs,
               tensor::Backend& backend, std::uint64_t seed) {
    chunks = make_chunks<T>(config, specs, backend, seed);
  }

  // Forward then backward of one micro-batch through every chunk; returns the losses.
  Losses step(int microbatch, const Batch& batch, const ForwardOptions& options,
              T loss_scale = T(1)) {
    const auto losses = forward(microbatch, batch, options);
    backward(microbatch, batch, loss_scale);
    return losses;
  }

  Losses forward(int microbatch, const Batch& batch, const ForwardOptions& options) {
    kernels::ConstMatrixView<T> activation;
    std::vector<T> copy;
    Losses losses;
    for (auto& chunk : chunks) {
      auto result = chunk->forward(microbatch, batch, activation, options);
      if (result.losses) losses = *result.losses;
      // Pipeline transfer: the next chunk receives a copy.
      copy.assign(result.output.data, result.output.data + result.output.rows * result.output.cols);
      transfers.push_back(copy);
      activation = kernels::ConstMatrixView<T>(transfers.back().data(), result.output.rows,
                                               result.output.cols);
    }
    return losses;
  }

  void backward(int microbatch, const Batch& batch, T loss_scale) {
    const std::int64_t rows = batch.tokens();
    const std::int64_t hidden = chunks.front()->config().hidden_size;
    std::vector<T> grad, next(static_cast<std::size_t>(rows * hidden));
    for (std::size_t i = chunks.size(); i-- > 0;) {
      kernels::MatrixView<T> grad_input;
      if (i > 0) grad_input = kernels::MatrixView<T>(next.data(), rows, hidden);
      chunks[i]->backward(microbatch, {grad.data(), rows, hidden}, grad_input, loss_scale);
      grad = next;
    }
  }

  void zero_grad() {
    for (auto& chunk : chunks) chunk->zero_grad();
  }

  // Gradient by Hugging Face name, the tied copies summed.
  std::vector<T> gradient(const std::string& name) {
    std::vector<T> total;
    auto add = [&](const std::string& n) {
      for (auto& chunk : chunks) {
        if (auto p = chunk->parameter(n)) {
          if (total.empty()) total.assign(static_cast<std::size_t>(p->size), T(0));
          for (std::int64_t i = 0; i < p->size; ++i)
            total[static_cast<std::size_t>(i)] += p->grad[i];
        }
      }
    };
    add(name);
    if (name == tied_parameter_names().first) add(tied_parameter_names().second);
    return total;
  }

  std::vector<std::vector<T>> transfers;
};

}  // namespace pf::model::testing
