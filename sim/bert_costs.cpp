#include "sim/bert_costs.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "sim/runtime_stash.h"

namespace pf::sim {

std::string_view to_string(ActivationStash stash) {
  return stash == ActivationStash::kEager ? "eager" : "runtime";
}

ActivationStash activation_stash_from_string(std::string_view name) {
  if (name == "runtime") return ActivationStash::kRuntime;
  if (name == "eager") return ActivationStash::kEager;
  throw std::invalid_argument("--stash '" + std::string(name) + "' is not one of runtime, eager");
}

int Workload::predictions() const {
  if (max_predictions > 0) return max_predictions;
  return std::max(1, static_cast<int>(std::lround(seq_len * 20.0 / 128.0)));
}

void Workload::validate() const {
  config.validate();
  if (seq_len <= 0 || seq_len > config.max_position_embeddings) {
    throw std::invalid_argument("--seq-len " + std::to_string(seq_len) + " must lie in [1, " +
                                std::to_string(config.max_position_embeddings) +
                                "] (max_position_embeddings of model '" + config.name + "')");
  }
  if (micro_batch_size <= 0) {
    throw std::invalid_argument("--micro-batch-size must be positive, got " +
                                std::to_string(micro_batch_size));
  }
  if (predictions() > seq_len) {
    throw std::invalid_argument("max_predictions " + std::to_string(predictions()) +
                                " exceeds the sequence length " + std::to_string(seq_len));
  }
  if (attention == AttentionAlgorithm::kFused) {
    check_fused_attention_head(config.head_dim());
  }
}

AttentionShape attention_shape(const Workload& w) {
  const auto& c = w.config;
  AttentionShape s;
  s.batch = w.micro_batch_size;
  s.seq = w.seq_len;
  s.heads = c.num_heads;
  s.kv_heads = c.num_heads;
  s.head_dim = c.head_dim();
  s.element_bytes = w.storage_bytes();
  s.precision = w.precision;
  // As the batched products' (bert_kernels.cpp): S x S x head width.
  s.product_size = std::min(s.seq, s.head_dim);
  s.product_mean_size = 3.0 / (2.0 / s.seq + 1.0 / s.head_dim);
  return s;
}

double encoder_layer_params(const model::BertConfig& c) {
  const double H = c.hidden_size, I = c.intermediate_size;
  return 4.0 * H * H + 2.0 * H * I + 9.0 * H + I;
}

double embeddings_params(const model::BertConfig& c) {
  const double H = c.hidden_size;
  return (double{1.0} * c.vocab_size + c.max_position_embeddings + c.type_vocab_size) * H + 2.0 * H;
}

double heads_params(const model::BertConfig& c, bool holds_tied_embeddings) {
  const double H = c.hidden_size, V = c.vocab_size;
  double params = (H * H + H) + (2.0 * H + 2.0) + (H * H + H) + 2.0 * H + V;
  if (!holds_tied_embeddings) params += V * H;
  return params;
}

double encoder_layer_activation_bytes(const Workload& w) {
  if (w.stash == ActivationStash::kRuntime) return runtime_layer_stash(w).total();
  const auto& c = w.config;
  const double T = w.tokens(), H = c.hidden_size, I = c.intermediate_size, a = c.num_heads;
  const double b = w.micro_batch_size, S = w.seq_len;
  // Korthikanti et al.'s count for 16-bit training, generalised to any FFN width:
  // attention 11 T H + 5 a b S^2, MLP 3 T H + 4 T I, LayerNorms 4 T H (with I = 4H this is
  // T H (34 + 5 a S / H)). 32-bit elements double it (dropout masks included: an overestimate).
  // 5 a b S^2 are the scores' softmax output, dropout mask and dropout output; the fused
  // attention keeps none of them, only its fp32 log-sum-exps.
  if (w.attention == AttentionAlgorithm::kFused) {
    return T * (18.0 * H + 4.0 * I) * w.storage_bytes() / 2.0 +
           fused_attention_saved_bytes(attention_shape(w));
  }
  const double sixteen_bit = T * (18.0 * H + 4.0 * I) + 5.0 * a * b * S * S;
  return sixteen_bit * w.storage_bytes() / 2.0;
}

double embeddings_activation_bytes(const Workload& w) {
  if (w.stash == ActivationStash::kRuntime) return runtime_embeddings_stash(w).total();
  const double T = w.tokens(), H = w.config.hidden_size, e = w.storage_bytes();
  return T * H * (2.0 * e + 1.0);  // LayerNorm input and output, dropout mask
}

double heads_activation_bytes(const Workload& w) {
  if (w.stash == ActivationStash::kRuntime) return runtime_head_stash(w).total();
  const double H = w.config.hidden_size, V = w.config.vocab_size, b = w.micro_batch_size;
  const double P = b * w.predictions(), e = w.storage_bytes();
  return e * 4.0 * P * H + 4.0 * P * V + e * 2.0 * b * H;  // transform, fp32 logits, pooler
}

double chunk_activation_bytes(const Workload& w, int num_layers, bool has_embeddings,
                              bool has_head) {
  if (w.stash == ActivationStash::kRuntime) {
    return runtime_chunk_arena_bytes(w, num_layers, has_embeddings, has_head);
  }
  double bytes = num_layers * encoder_layer_activation_bytes(w);
  if (has_embeddings) bytes += embeddings_activation_bytes(w);
  if (has_head) bytes += heads_activation_bytes(w);
  return bytes;
}

double boundary_bytes(const Workload& w) {
  return w.tokens() * w.config.hidden_size * w.storage_bytes();
}

LinearDims linear_dims(const model::BertConfig& c, sched::LinearKind linear) {
  switch (linear) {
    case sched::LinearKind::kFfnIn:
      return {c.hidden_size, c.intermediate_size};
    case sched::LinearKind::kFfnOut:
      return {c.intermediate_size, c.hidden_size};
    default:
      return {c.hidden_size, c.hidden_size};
  }
}

double model_flops_per_sequence(const Workload& w) {
  const auto& c = w.config;
  const double T = w.tokens(), H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size;
  const double b = w.micro_batch_size, S = w.seq_len, P = b * w.predictions();
  // Layer: Q, K, V, attention output 4 x 2 H^2 and FFN 2 x 2 H I per token, attention products
  // 4 S H per token; heads: MLM transform and decoder per scored position, pooler and NSP.
  const double layer = T * (8.0 * H * H + 4.0 * H * I) + 4.0 * b * S * S * H;
  const double heads = P * (2.0 * H * H + 2.0 * H * V) + b * (2.0 * H * H + 4.0 * H);
  return 3.0 * (c.num_layers * layer + heads) / w.micro_batch_size;
}

}  // namespace pf::sim
