#include "sim/runtime_stash.h"

#include <algorithm>
#include <cmath>

namespace pf::sim {
namespace {

// One arena allocation of `count` elements of `bytes` each.
double buffer(double count, double bytes) {
  return std::ceil(count * bytes / kRuntimeStashAlignment) * kRuntimeStashAlignment;
}

constexpr double kIndexBytes = 8.0;  // std::int64_t

}  // namespace

RuntimeStash runtime_layer_stash(const Workload& w) {
  const auto& c = w.config;
  const double T = w.tokens(), H = c.hidden_size, I = c.intermediate_size, e = w.storage_bytes();
  const double b = w.micro_batch_size, S = w.seq_len, a = c.num_heads;
  const double saved = w.attention == AttentionAlgorithm::kFused ? b * a * S : b * a * S * S;
  RuntimeStash stash;
  stash.forward =
      buffer(3.0 * T * H, e) + buffer(saved, e) +
      5.0 * buffer(T * H, e) +  // context, LayerNorm 1 input and output, FFN sum, output
      2.0 * buffer(T * I, e) +  // FFN pre-activation, GELU output
      4.0 * buffer(T, e);       // the two LayerNorms' mean and 1/std
  // The output gradients of the FFN output, FFN input, attention output and QKV Linears.
  stash.backward = 2.0 * buffer(T * H, e) + buffer(T * I, e) + buffer(3.0 * T * H, e);
  return stash;
}

RuntimeStash runtime_embeddings_stash(const Workload& w) {
  const double T = w.tokens(), H = w.config.hidden_size, e = w.storage_bytes();
  return {3.0 * buffer(T, kIndexBytes) + 2.0 * buffer(T * H, e) + 2.0 * buffer(T, e),
          buffer(T * H, e)};
}

RuntimeStash runtime_head_stash(const Workload& w) {
  const double H = w.config.hidden_size, V = w.config.vocab_size, e = w.storage_bytes();
  const double b = w.micro_batch_size, R = b * w.predictions();
  RuntimeStash stash;
  stash.forward = 2.0 * buffer(b, kIndexBytes) + 2.0 * buffer(b * H, e) + buffer(2.0 * b, e);
  stash.backward = buffer(b * H, e);
  if (R > 0) {
    stash.forward += 2.0 * buffer(R, kIndexBytes) + buffer(R, e) + 4.0 * buffer(R * H, e) +
                     2.0 * buffer(R, e) + buffer(R * V, e);
    stash.backward += buffer(R * H, e);
  }
  return stash;
}

RuntimeStash runtime_chunk_stash(const Workload& w, int num_layers, bool has_embeddings,
                                 bool has_head) {
  const double T = w.tokens();
  RuntimeStash stash;
  stash.forward = buffer(T, kIndexBytes);  // the attention mask
  if (!has_embeddings) stash.forward += buffer(T * w.config.hidden_size, w.storage_bytes());
  auto add = [&](const RuntimeStash& piece, double times) {
    stash.forward += times * piece.forward;
    stash.backward += times * piece.backward;
  };
  add(runtime_layer_stash(w), num_layers);
  if (has_embeddings) add(runtime_embeddings_stash(w), 1.0);
  if (has_head) add(runtime_head_stash(w), 1.0);
  return stash;
}

double runtime_chunk_arena_bytes(const Workload& w, int num_layers, bool has_embeddings,
                                 bool has_head) {
  return std::max(runtime_chunk_stash(w, num_layers, has_embeddings, has_head).total(),
                  kRuntimeArenaMinBytes);
}

}  // namespace pf::sim
