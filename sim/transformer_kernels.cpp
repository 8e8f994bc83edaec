#include "sim/transformer_kernels.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace pf::sim {
namespace {

// Per-rank dimensions of one layer.
struct RankDims {
  double T, H, I_t, q_out, kv_out, N, e, b, S, head_dim, heads_t;
};

RankDims rank_dims(const ParallelWorkload& w) {
  const auto& m = w.model;
  const double t = w.tensor_parallel;
  RankDims d{};
  d.T = w.tokens();
  d.H = m.hidden_size;
  d.I_t = m.intermediate_size / t;
  d.head_dim = m.head_dim();
  d.heads_t = m.num_heads / t;
  d.q_out = d.heads_t * d.head_dim;
  // Fewer key/value heads than ranks: each rank keeps a copy of one (Megatron replicates them).
  d.kv_out = std::max(1.0, m.num_kv_heads / t) * d.head_dim;
  d.b = w.micro_batch_size;
  d.S = w.seq_len;
  d.N = d.b * d.heads_t * d.S * d.S;
  d.e = element_bytes(w.precision);
  return d;
}

Kernel attention_kernel(Precision p, double flops, double bytes) {
  Kernel kernel;
  kernel.op_class = OpClass::kAttention;
  kernel.precision = p;
  kernel.flops = flops;
  kernel.bytes = bytes;
  return kernel;
}

// y = x W^T (+ bias fused into the product's epilogue read: the bias-filled output, as addmm).
void linear_forward(Kernels& out, Precision p, double e, double rows, double in, double out_dim,
                    bool bias) {
  Kernel product = gemm_kernel(p, rows, out_dim, in, e);
  if (bias) {
    out.push_back(memory_kernel(e * rows * out_dim));
    product.bytes += e * rows * out_dim;
  }
  out.push_back(product);
}

void linear_backward(PieceKernels& k, Precision p, double e, double rows, double in, double out_dim,
                     bool bias) {
  k.backward_input.push_back(gemm_kernel(p, rows, in, out_dim, e));
  k.backward_weight.push_back(gemm_kernel(p, out_dim, in, rows, e));
  if (bias) k.backward_weight.push_back(memory_kernel(e * rows * out_dim));
}

// The fused attention core of one rank (its a / t heads, its copy of the key / value heads).
AttentionShape attention_shape(const ParallelWorkload& w, const RankDims& d) {
  AttentionShape s;
  s.batch = d.b;
  s.seq = d.S;
  s.heads = d.heads_t;
  s.kv_heads = d.kv_out / d.head_dim;
  s.head_dim = d.head_dim;
  s.element_bytes = d.e;
  s.precision = w.precision;
  return s;  // no product_size: the batched core's products here have none either
}

// The attention core: scores, (scale + mask + softmax fused), dropout, probabilities x V; or the
// fused kernel.
Kernels attention_core_forward(const ParallelWorkload& w, const RankDims& d) {
  if (w.attention == AttentionAlgorithm::kFused) {
    return fused_attention_kernels(attention_shape(w, d)).forward;
  }
  const Precision p = w.precision;
  const double products = 2.0 * d.b * d.heads_t * d.S * d.S * d.head_dim;
  Kernels f;
  f.push_back(attention_kernel(p, products, d.e * (d.T * (d.q_out + d.kv_out) + d.N)));
  f.push_back(memory_kernel(2.0 * d.e * d.N));
  if (w.model.dropout) f.push_back(memory_kernel(d.N * (2.0 * d.e + 1.0)));
  f.push_back(attention_kernel(p, products, d.e * (d.N + d.T * (d.kv_out + d.q_out))));
  return f;
}

// Bias + dropout + residual add, fused (Megatron's bias_dropout_add): reads x and the residual,
// writes the sum (and a one-byte mask with dropout).
Kernel bias_dropout_add(const ParallelWorkload& w, const RankDims& d) {
  return memory_kernel(3.0 * d.e * d.T * d.H + (w.model.dropout ? d.T * d.H : 0.0));
}

}  // namespace

std::string_view to_string(Recompute recompute) {
  switch (recompute) {
    case Recompute::kNone:
      return "none";
    case Recompute::kSelective:
      return "selective";
    case Recompute::kFull:
      return "full";
  }
  return "none";
}

Recompute recompute_from_string(std::string_view name) {
  if (name == "none") return Recompute::kNone;
  if (name == "selective") return Recompute::kSelective;
  if (name == "full") return Recompute::kFull;
  throw std::invalid_argument("--recompute '" + std::string(name) +
                              "' is not one of none, selective, full");
}

std::string_view to_string(Offload offload) {
  switch (offload) {
    case Offload::kNone:
      return "none";
    case Offload::kHost:
      return "cpu";
    case Offload::kNvme:
      return "nvme";
  }
  return "none";
}

Offload offload_from_string(std::string_view name) {
  if (name == "none") return Offload::kNone;
  if (name == "cpu") return Offload::kHost;
  if (name == "nvme") return Offload::kNvme;
  throw std::invalid_argument("--offload-optimizer '" + std::string(name) +
                              "' is not one of none, cpu, nvme");
}

int ParallelWorkload::scored_positions() const {
  if (model.family != ModelFamily::kBert) return seq_len;
  return std::max(1, static_cast<int>(std::lround(seq_len * 20.0 / 128.0)));
}

void ParallelWorkload::validate() const {
  model.validate();
  if (seq_len <= 0 || seq_len > model.max_position_embeddings) {
    throw std::invalid_argument("--seq-len " + std::to_string(seq_len) + " must lie in [1, " +
                                std::to_string(model.max_position_embeddings) +
                                "] (max_position_embeddings of model '" + model.name + "')");
  }
  if (micro_batch_size <= 0) {
    throw std::invalid_argument("--micro-batch-size must be positive, got " +
                                std::to_string(micro_batch_size));
  }
  for (const auto& [value, flag] : {std::pair{sharding.parameters, "--shard-parameters"},
                                    std::pair{sharding.gradients, "--shard-gradients"},
                                    std::pair{sharding.optimizer, "--shard-optimizer"}}) {
    if (value < 0) {
      throw std::invalid_argument(std::string(flag) + " must be >= 0 (0: all replicas), got " +
                                  std::to_string(value));
    }
  }
  if (kfac_state.factors < 0 || kfac_state.inverses < 0) {
    throw std::invalid_argument(
        "--kfac-sharding: holders of the factors and inverses must be >= 0 (0: all replicas), "
        "got " +
        std::to_string(kfac_state.factors) + " and " + std::to_string(kfac_state.inverses));
  }
  if (attention == AttentionAlgorithm::kFused) check_fused_attention_head(model.head_dim());
  if (tensor_parallel <= 0 || model.num_heads % tensor_parallel != 0 ||
      model.intermediate_size % tensor_parallel != 0) {
    throw std::invalid_argument("--tensor-parallel " + std::to_string(tensor_parallel) +
                                " must be positive and divide the heads (" +
                                std::to_string(model.num_heads) + ") and the MLP width (" +
                                std::to_string(model.intermediate_size) + ") of model '" +
                                model.name + "'");
  }
}

PieceKernels transformer_layer_kernels(const ParallelWorkload& w) {
  const RankDims d = rank_dims(w);
  const auto& m = w.model;
  const Precision p = w.precision;
  const bool bias = m.linear_bias;
  const double up_out = (m.gated_mlp ? 2.0 : 1.0) * d.I_t;
  PieceKernels k;
  auto& f = k.forward;
  // Attention block: norm, fused Q/K/V (column-parallel), rotary, core, output (row-parallel),
  // bias + dropout + residual.
  f.push_back(memory_kernel(2.0 * d.e * d.T * d.H));
  linear_forward(f, p, d.e, d.T, d.H, d.q_out + 2.0 * d.kv_out, bias);
  if (!m.learned_positions && m.family != ModelFamily::kBert) {
    f.push_back(memory_kernel(2.0 * d.e * d.T * (d.q_out + d.kv_out)));
  }
  const Kernels core = attention_core_forward(w, d);
  f.insert(f.end(), core.begin(), core.end());
  linear_forward(f, p, d.e, d.T, d.q_out, d.H, false);
  f.push_back(bias_dropout_add(w, d));
  // MLP block: norm, up (column-parallel; gate and up together when gated), activation
  // (bias + GELU fused, or SiLU(gate) x up), down (row-parallel), bias + dropout + residual.
  f.push_back(memory_kernel(2.0 * d.e * d.T * d.H));
  linear_forward(f, p, d.e, d.T, d.H, up_out, false);
  f.push_back(memory_kernel((m.gated_mlp ? 3.0 : 2.0) * d.e * d.T * d.I_t));
  linear_forward(f, p, d.e, d.T, d.I_t, d.H, false);
  f.push_back(bias_dropout_add(w, d));

  // Backward in autograd's order. Recomputation re-runs its forward kernels first.
  auto& bi = k.backward_input;
  auto& bw = k.backward_weight;
  if (w.recompute == Recompute::kFull) {
    bi.insert(bi.end(), f.begin(), f.end());
  } else if (w.recompute == Recompute::kSelective) {
    bi.insert(bi.end(), core.begin(), core.end());
  }
  const double residual = 3.0 * d.e * d.T * d.H;
  const double mask = m.dropout ? d.T * d.H : 0.0;
  bi.push_back(memory_kernel(2.0 * d.e * d.T * d.H + mask));  // dropout backward
  linear_backward(k, p, d.e, d.T, d.I_t, d.H, bias);
  bi.push_back(memory_kernel((m.gated_mlp ? 5.0 : 3.0) * d.e * d.T * d.I_t));
  linear_backward(k, p, d.e, d.T, d.H, up_out, bias);
  bi.push_back(memory_kernel(3.0 * d.e * d.T * d.H));  // norm dx
  bw.push_back(memory_kernel(2.0 * d.e * d.T * d.H));  // norm d gamma (d beta)
  bi.push_back(memory_kernel(residual));
  bi.push_back(memory_kernel(2.0 * d.e * d.T * d.H + mask));
  linear_backward(k, p, d.e, d.T, d.q_out, d.H, bias);
  if (w.attention == AttentionAlgorithm::kFused) {
    const Kernels core_backward = fused_attention_kernels(attention_shape(w, d)).backward;
    bi.insert(bi.end(), core_backward.begin(), core_backward.end());
  } else {
    const double products = 2.0 * d.b * d.heads_t * d.S * d.S * d.head_dim;
    const double product_bytes = d.e * (d.N + d.T * (d.q_out + d.kv_out));
    bi.push_back(attention_kernel(p, products, product_bytes));  // d probabilities
    bi.push_back(attention_kernel(p, products, product_bytes));  // d V
    if (m.dropout) bi.push_back(memory_kernel(d.N * (2.0 * d.e + 1.0)));
    bi.push_back(memory_kernel(3.0 * d.e * d.N));                // softmax
    bi.push_back(attention_kernel(p, products, product_bytes));  // d Q
    bi.push_back(attention_kernel(p, products, product_bytes));  // d K
  }
  if (!m.learned_positions && m.family != ModelFamily::kBert) {
    bi.push_back(memory_kernel(2.0 * d.e * d.T * (d.q_out + d.kv_out)));
  }
  linear_backward(k, p, d.e, d.T, d.H, d.q_out + 2.0 * d.kv_out, bias);
  bi.push_back(memory_kernel(3.0 * d.e * d.T * d.H));
  bw.push_back(memory_kernel(2.0 * d.e * d.T * d.H));
  bi.push_back(memory_kernel(residual));
  return k;
}

PieceKernels transformer_embedding_kernels(const ParallelWorkload& w) {
  const RankDims d = rank_dims(w);
  const auto& m = w.model;
  const double TH = d.T * d.H;
  PieceKernels k;
  // Word gather (vocab-parallel: each rank its rows, the others masked to 0, then all-reduced),
  // position gather and add, BERT's type gather and LayerNorm, dropout.
  k.forward.push_back(memory_kernel(2.0 * d.e * TH));
  if (m.learned_positions) {
    k.forward.push_back(memory_kernel(d.e * TH));
    k.forward.push_back(memory_kernel(3.0 * d.e * TH));
  }
  if (m.family == ModelFamily::kBert) {
    k.forward.push_back(memory_kernel(4.0 * d.e * TH));
    k.forward.push_back(memory_kernel(2.0 * d.e * TH));
  }
  if (m.dropout) k.forward.push_back(memory_kernel(TH * (2.0 * d.e + 1.0)));
  // Backward: dropout, the norm, scatter-adds into the tables (parameter-gradient work).
  if (m.dropout) k.backward_weight.push_back(memory_kernel(TH * (2.0 * d.e + 1.0)));
  if (m.family == ModelFamily::kBert) k.backward_weight.push_back(memory_kernel(5.0 * d.e * TH));
  k.backward_weight.push_back(memory_kernel(3.0 * d.e * TH, m.learned_positions ? 2 : 1));
  return k;
}

PieceKernels transformer_head_kernels(const ParallelWorkload& w) {
  const RankDims d = rank_dims(w);
  const auto& m = w.model;
  const double V_t = std::ceil(double{1.0} * m.vocab_size / w.tensor_parallel);
  if (m.family == ModelFamily::kBert) {
    // BERT's pooler, MLM transform and vocab-parallel decoder: its own heads with V / t words.
    Workload bert;
    bert.config.name = m.name;
    bert.config.hidden_size = m.hidden_size;
    bert.config.num_heads = m.num_heads;
    bert.config.num_layers = m.num_layers;
    bert.config.intermediate_size = m.intermediate_size;
    bert.config.vocab_size = static_cast<int>(V_t);
    bert.config.max_position_embeddings = m.max_position_embeddings;
    bert.seq_len = w.seq_len;
    bert.micro_batch_size = w.micro_batch_size;
    bert.precision = w.precision;
    return heads_kernels(bert);
  }
  const Precision p = w.precision;
  const double TV = d.T * V_t;
  PieceKernels k;
  // Final norm, logits (this rank's V / t columns), vocab-parallel cross-entropy over fp32
  // logits (conversion, max / sum-exp / loss passes).
  k.forward.push_back(memory_kernel(2.0 * d.e * d.T * d.H));
  k.forward.push_back(gemm_kernel(p, d.T, V_t, d.H, d.e));
  k.forward.push_back(memory_kernel((d.e + 4.0) * TV));
  k.forward.push_back(memory_kernel(4.0 * TV * 2.0, 2));
  // Backward: the logits' gradient, the product's input and weight gradients, the norm.
  k.backward_input.push_back(memory_kernel((4.0 + d.e) * TV));
  k.backward_input.push_back(gemm_kernel(p, d.T, d.H, V_t, d.e));
  k.backward_weight.push_back(gemm_kernel(p, V_t, d.H, d.T, d.e));
  k.backward_input.push_back(memory_kernel(3.0 * d.e * d.T * d.H));
  k.backward_weight.push_back(memory_kernel(2.0 * d.e * d.T * d.H));
  return k;
}

double transformer_layer_activation_bytes(const ParallelWorkload& w) {
  const RankDims d = rank_dims(w);
  const auto& m = w.model;
  const double scale = d.e / 2.0;  // counts below are for 16-bit elements
  if (w.recompute == Recompute::kFull) return scale * 2.0 * d.T * d.H;
  const double replicated = d.T * d.H * (m.dropout ? 10.0 : 8.0);
  const double attention = 4.0 * d.T * d.q_out + 4.0 * d.T * d.kv_out;
  const double mlp = (m.gated_mlp ? 6.0 : 4.0) * d.T * d.I_t;
  if (w.attention == AttentionAlgorithm::kFused) {
    return scale * (replicated + attention + mlp) +
           fused_attention_saved_bytes(attention_shape(w, d));
  }
  const double scores = w.recompute == Recompute::kSelective ? 0.0 : (m.dropout ? 5.0 : 2.0) * d.N;
  return scale * (replicated + attention + mlp + scores);
}

double transformer_recompute_transient_bytes(const ParallelWorkload& w) {
  if (w.recompute != Recompute::kFull) return 0.0;
  ParallelWorkload none = w;
  none.recompute = Recompute::kNone;
  return transformer_layer_activation_bytes(none);
}

double transformer_embedding_activation_bytes(const ParallelWorkload& w) {
  const RankDims d = rank_dims(w);
  return w.model.dropout ? d.T * d.H * (2.0 * d.e + 1.0) : 0.0;
}

double transformer_head_activation_bytes(const ParallelWorkload& w) {
  const RankDims d = rank_dims(w);
  const auto& m = w.model;
  const double V_t = std::ceil(double{1.0} * m.vocab_size / w.tensor_parallel);
  if (m.family == ModelFamily::kBert) {
    const double P = d.b * w.scored_positions();
    return d.e * 4.0 * P * d.H + 4.0 * P * V_t + d.e * 2.0 * d.b * d.H;
  }
  return 2.0 * d.e * d.T * d.H + 4.0 * d.T * V_t;  // norm input and output, fp32 softmax
}

double transformer_hardware_flops_per_sequence(const ParallelWorkload& w) {
  const auto& m = w.model;
  const double S = w.seq_len, H = m.hidden_size;
  const double model = transformer_model_flops_per_sequence(m, w.seq_len, w.scored_positions());
  const double layer_forward =
      m.num_layers * S * transformer_layer_forward_flops_per_token(m, w.seq_len);
  const double rescored =
      w.attention == AttentionAlgorithm::kFused ? m.num_layers * S * 2.0 * S * H : 0.0;
  switch (w.recompute) {
    case Recompute::kFull:
      return model + layer_forward + rescored;
    case Recompute::kSelective:
      return model + m.num_layers * S * 4.0 * S * H + rescored;
    case Recompute::kNone:
      break;
  }
  return model + rescored;
}

}  // namespace pf::sim
