#include "sim/runtime_stash.h"

#include <cmath>

namespace pf::sim {
namespace {

// One arena allocation of `count` elements of `bytes` each.
double buffer(double count, double bytes) {
  return std::ceil(count * bytes / kRuntimeStashAlignment) * kRuntimeStashAlignment;
}

constexpr double kIndexBytes = 8.0;  // std::int64_t

}  // namespace

double runtime_layer_stash_bytes(const Workload& w) {
  const auto& c = w.config;
  const double T = w.tokens(), H = c.hidden_size, I = c.intermediate_size, e = w.storage_bytes();
  const double b = w.micro_batch_size, S = w.seq_len, a = c.num_heads;
  const double saved = w.attention == AttentionAlgorithm::kFused ? b * a * S : b * a * S * S;
  return buffer(3.0 * T * H, e) + buffer(saved, e) +
         5.0 * buffer(T * H, e) +  // context, LayerNorm 1 input and output, FFN sum, output
         2.0 * buffer(T * I, e) +  // FFN pre-activation, GELU output
         4.0 * buffer(T, e);       // the two LayerNorms' mean and 1/std
}

double runtime_embeddings_stash_bytes(const Workload& w) {
  const double T = w.tokens(), H = w.config.hidden_size, e = w.storage_bytes();
  return 3.0 * buffer(T, kIndexBytes) + 2.0 * buffer(T * H, e) + 2.0 * buffer(T, e);
}

double runtime_head_stash_bytes(const Workload& w) {
  const double H = w.config.hidden_size, V = w.config.vocab_size, e = w.storage_bytes();
  const double b = w.micro_batch_size, R = b * w.predictions();
  const double nsp = 2.0 * buffer(b, kIndexBytes) + 2.0 * buffer(b * H, e) + buffer(2.0 * b, e);
  const double mlm = 2.0 * buffer(R, kIndexBytes) + buffer(R, e) + 4.0 * buffer(R * H, e) +
                     2.0 * buffer(R, e) + buffer(R * V, e);
  return nsp + (R > 0 ? mlm : 0.0);
}

double runtime_chunk_base_stash_bytes(const Workload& w, bool has_embeddings) {
  const double T = w.tokens();
  const double mask = buffer(T, kIndexBytes);
  return has_embeddings ? mask : mask + buffer(T * w.config.hidden_size, w.storage_bytes());
}

}  // namespace pf::sim
