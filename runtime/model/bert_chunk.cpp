#include "runtime/model/bert_chunk.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>

#include "kernels/make_ops.h"
#include "kernels/ops.h"
#include "kernels/rng.h"

namespace pf::model {

using kernels::ConstMatrixView;
using kernels::MatrixView;
using sched::LinearKind;

namespace {

constexpr std::uint64_t kEmbeddingDropoutSalt = 0xE3B0C44298FC1C14ULL;

enum class Init : std::uint8_t { kNormal, kZero, kOne, kWordEmbedding };

std::uint64_t hash_name(std::string_view name) {
  std::uint64_t hash = 0xCBF29CE484222325ULL;  // FNV-1a
  for (char c : name) {
    hash ^= static_cast<unsigned char>(c);
    hash *= 0x100000001B3ULL;
  }
  return hash;
}

std::string layer_prefix(int layer) {
  return "bert.encoder.layer." + std::to_string(layer) + ".";
}

// Dropout stream of one site of one encoder layer (global index: the same on every chunking).
std::uint64_t site_seed(std::uint64_t seed, int layer, int site) {
  return kernels::derive_seed(
      seed, static_cast<std::uint64_t>(layer) * 4 + static_cast<std::uint64_t>(site));
}

}  // namespace

std::pair<std::string, std::string> tied_parameter_names() {
  return {"bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"};
}

void validate_chunk_specs(const BertConfig& config, const std::vector<ChunkSpec>& specs) {
  if (specs.empty()) throw std::invalid_argument("model chunks: no chunks given");
  int next_layer = 0;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const auto& spec = specs[i];
    const std::string where = "model chunk " + std::to_string(i) + ": ";
    if (spec.has_embeddings != (i == 0)) {
      throw std::invalid_argument(where + "the embeddings must be on the first chunk only");
    }
    if (spec.has_head != (i + 1 == specs.size())) {
      throw std::invalid_argument(where + "the head must be on the last chunk only");
    }
    if (spec.first_layer != next_layer || spec.num_layers < 0) {
      throw std::invalid_argument(where + "holds layers from " + std::to_string(spec.first_layer) +
                                  ", expected " + std::to_string(next_layer));
    }
    next_layer += spec.num_layers;
  }
  if (next_layer != config.num_layers) {
    throw std::invalid_argument("model chunks: cover " + std::to_string(next_layer) +
                                " encoder layers, the model has " +
                                std::to_string(config.num_layers));
  }
}

template <typename T>
struct BertChunk<T>::Registered {
  std::string name;
  std::vector<std::int64_t> shape;
  std::int64_t offset = 0;
  std::int64_t size = 0;
  bool no_decay = false;
  Init init = Init::kNormal;
  std::string init_name;  // the name whose random stream initialises it (tied copies share one)
};

template <typename T>
struct BertChunk<T>::LayerWeights {
  int global = 0;
  std::int64_t qkv_w = 0, qkv_b = 0, o_w = 0, o_b = 0, ln1_g = 0, ln1_b = 0;
  std::int64_t in_w = 0, in_b = 0, out_w = 0, out_b = 0, ln2_g = 0, ln2_b = 0;
};

template <typename T>
struct BertChunk<T>::Offsets {
  std::int64_t word = -1, position = -1, token_type = -1, emb_ln_g = -1, emb_ln_b = -1;
  std::int64_t pool_w = -1, pool_b = -1, transform_w = -1, transform_b = -1;
  std::int64_t transform_ln_g = -1, transform_ln_b = -1, decoder_w = -1, decoder_b = -1;
  std::int64_t nsp_w = -1, nsp_b = -1;
};

template <typename T>
struct BertChunk<T>::Stash {
  struct Layer {
    const T* input = nullptr;
    // attention_saved: what the attention forward keeps for its backward (the probabilities, or
    // a fused kernel's log-sum-exps: ops_->attention_saved_size).
    T *qkv = nullptr, *attention_saved = nullptr, *ctx = nullptr, *attn_sum = nullptr,
      *mean1 = nullptr, *rstd1 = nullptr, *h1 = nullptr, *ffn_pre = nullptr, *ffn_act = nullptr,
      *ffn_sum = nullptr, *mean2 = nullptr, *rstd2 = nullptr, *out = nullptr;
    // Output gradients of the Linears, kept by backward_input for backward_weight.
    T *d_qkv = nullptr, *d_attn_out = nullptr, *d_ffn_in = nullptr, *d_ffn_out = nullptr;
  };
  int microbatch = -1;
  std::unique_ptr<tensor::Arena> arena;
  std::int64_t batch = 0, seq = 0, predictions = 0;
  std::uint64_t seed = 0;
  float hidden_dropout = 0, attention_dropout = 0;
  std::int64_t* mask = nullptr;
  // Embeddings.
  std::int64_t *ids = nullptr, *types = nullptr, *positions = nullptr;
  T *emb_sum = nullptr, *emb_mean = nullptr, *emb_rstd = nullptr, *emb_out = nullptr;
  T* input = nullptr;
  std::vector<Layer> layers;
  // Head.
  const T* sequence = nullptr;
  std::int64_t *first_index = nullptr, *nsp_labels = nullptr, *mlm_index = nullptr,
               *mlm_labels = nullptr;
  T *mlm_weights = nullptr, *first_tokens = nullptr, *pooled = nullptr, *nsp_probs = nullptr,
    *gathered = nullptr, *transform_pre = nullptr, *transform_act = nullptr,
    *transform_mean = nullptr, *transform_rstd = nullptr, *transform_out = nullptr,
    *mlm_probs = nullptr;
  // Set by backward_input; what backward_weight needs beyond the forward's stash.
  bool input_done = false;
  T* d_embeddings = nullptr;  // gradient of the embedding sum (before its LayerNorm)
  T *d_pooled = nullptr, *d_transform = nullptr;  // head Linears' output gradients
};

template <typename T>
BertChunk<T>::BertChunk(const BertConfig& config, const ChunkSpec& spec, tensor::Backend& backend,
                        tensor::Stream* stream, kernels::GemmPrecision precision,
                        kernels::AttentionAlgorithm attention)
    : config_(config),
      spec_(spec),
      backend_(&backend),
      stream_(stream),
      ops_(kernels::make_ops<T>(backend, stream, precision, attention)),
      offsets_(std::make_unique<Offsets>()),
      pool_(backend),
      scratch_(std::make_unique<tensor::Arena>(backend)) {
  config_.validate();
  if (spec.num_layers < 0 || spec.first_layer < 0 ||
      spec.first_layer + spec.num_layers > config.num_layers) {
    throw std::invalid_argument("model chunk: layers [" + std::to_string(spec.first_layer) + ", " +
                                std::to_string(spec.first_layer + spec.num_layers) +
                                ") are outside the model's " + std::to_string(config.num_layers));
  }
  const std::int64_t hidden = config.hidden_size;
  const std::int64_t inter = config.intermediate_size;
  const std::int64_t vocab = config.vocab_size;
  std::int64_t total = 0;
  auto add = [&](std::string name, std::vector<std::int64_t> shape, Init init) {
    Registered entry;
    entry.size = tensor::numel_of(shape);
    entry.no_decay = shape.size() == 1;
    entry.init_name = name;
    entry.name = std::move(name);
    entry.shape = std::move(shape);
    entry.init = init;
    entry.offset = total;
    total += entry.size;
    registry_.push_back(std::move(entry));
    return registry_.back().offset;
  };
  auto& o = *offsets_;
  if (spec.has_embeddings) {
    o.word = add("bert.embeddings.word_embeddings.weight", {vocab, hidden}, Init::kWordEmbedding);
    o.position = add("bert.embeddings.position_embeddings.weight",
                     {config.max_position_embeddings, hidden}, Init::kNormal);
    o.token_type = add("bert.embeddings.token_type_embeddings.weight",
                       {config.type_vocab_size, hidden}, Init::kNormal);
    o.emb_ln_g = add("bert.embeddings.LayerNorm.weight", {hidden}, Init::kOne);
    o.emb_ln_b = add("bert.embeddings.LayerNorm.bias", {hidden}, Init::kZero);
  }
  for (int l = 0; l < spec.num_layers; ++l) {
    LayerWeights w;
    w.global = spec.first_layer + l;
    const auto p = layer_prefix(w.global);
    // query, key and value are registered back to back, so their weights form the fused
    // [3H, H] matrix (and the biases the fused [3H] vector) of one QKV GEMM.
    w.qkv_w = add(p + "attention.self.query.weight", {hidden, hidden}, Init::kNormal);
    add(p + "attention.self.key.weight", {hidden, hidden}, Init::kNormal);
    add(p + "attention.self.value.weight", {hidden, hidden}, Init::kNormal);
    w.qkv_b = add(p + "attention.self.query.bias", {hidden}, Init::kZero);
    add(p + "attention.self.key.bias", {hidden}, Init::kZero);
    add(p + "attention.self.value.bias", {hidden}, Init::kZero);
    w.o_w = add(p + "attention.output.dense.weight", {hidden, hidden}, Init::kNormal);
    w.o_b = add(p + "attention.output.dense.bias", {hidden}, Init::kZero);
    w.ln1_g = add(p + "attention.output.LayerNorm.weight", {hidden}, Init::kOne);
    w.ln1_b = add(p + "attention.output.LayerNorm.bias", {hidden}, Init::kZero);
    w.in_w = add(p + "intermediate.dense.weight", {inter, hidden}, Init::kNormal);
    w.in_b = add(p + "intermediate.dense.bias", {inter}, Init::kZero);
    w.out_w = add(p + "output.dense.weight", {hidden, inter}, Init::kNormal);
    w.out_b = add(p + "output.dense.bias", {hidden}, Init::kZero);
    w.ln2_g = add(p + "output.LayerNorm.weight", {hidden}, Init::kOne);
    w.ln2_b = add(p + "output.LayerNorm.bias", {hidden}, Init::kZero);
    layers_.push_back(w);
  }
  if (spec.has_head) {
    o.pool_w = add("bert.pooler.dense.weight", {hidden, hidden}, Init::kNormal);
    o.pool_b = add("bert.pooler.dense.bias", {hidden}, Init::kZero);
    o.transform_w = add("cls.predictions.transform.dense.weight", {hidden, hidden}, Init::kNormal);
    o.transform_b = add("cls.predictions.transform.dense.bias", {hidden}, Init::kZero);
    o.transform_ln_g = add("cls.predictions.transform.LayerNorm.weight", {hidden}, Init::kOne);
    o.transform_ln_b = add("cls.predictions.transform.LayerNorm.bias", {hidden}, Init::kZero);
    if (spec.has_embeddings) {
      o.decoder_w = o.word;
    } else {
      o.decoder_w = add(tied_parameter_names().second, {vocab, hidden}, Init::kWordEmbedding);
      registry_.back().init_name = tied_parameter_names().first;
    }
    o.decoder_b = add("cls.predictions.bias", {vocab}, Init::kZero);
    o.nsp_w = add("cls.seq_relationship.weight", {2, hidden}, Init::kNormal);
    o.nsp_b = add("cls.seq_relationship.bias", {2}, Init::kZero);
  }
  // LayerNorm weights are 1-D too: every 1-D parameter is a bias or a LayerNorm parameter.
  values_ = tensor::Tensor::zeros(backend, {total}, tensor::dtype_of<T>);
  grads_ = tensor::Tensor::zeros(backend, {total}, tensor::dtype_of<T>);
}

template <typename T>
BertChunk<T>::~BertChunk() = default;

template <typename T>
void BertChunk<T>::init_weights(std::uint64_t seed) {
  T* values = values_.template data<T>();
  std::vector<T> host;  // one tensor at a time, drawn on the host
  for (const auto& entry : registry_) {
    host.resize(static_cast<std::size_t>(entry.size));
    T* target = host.data();
    switch (entry.init) {
      case Init::kZero:
        std::fill(target, target + entry.size, T(0));
        break;
      case Init::kOne:
        std::fill(target, target + entry.size, T(1));
        break;
      case Init::kNormal:
      case Init::kWordEmbedding: {
        std::mt19937_64 rng(kernels::derive_seed(seed, hash_name(entry.init_name)));
        std::normal_distribution<double> normal(0.0, config_.initializer_range);
        for (std::int64_t i = 0; i < entry.size; ++i) target[i] = static_cast<T>(normal(rng));
        if (entry.init == Init::kWordEmbedding && config_.pad_token_id >= 0) {
          std::fill_n(target + config_.pad_token_id * config_.hidden_size, config_.hidden_size,
                      T(0));
        }
        break;
      }
    }
    upload(values + entry.offset, target, host.size() * sizeof(T));
  }
  ops_->synchronize();  // `host` is reused and freed
}

template <typename T>
void BertChunk<T>::upload(void* destination, const void* source, std::size_t bytes) {
  backend_->copy(destination, source, bytes, tensor::CopyKind::kHostToDevice, stream_);
}

template <typename T>
void BertChunk<T>::copy_rows(ConstMatrixView<T> from, T* to) {
  const auto row_bytes = static_cast<std::size_t>(from.cols) * sizeof(T);
  if (from.ld == from.cols) {
    backend_->copy(to, from.data, row_bytes * static_cast<std::size_t>(from.rows),
                   tensor::CopyKind::kDeviceToDevice, stream_);
    return;
  }
  for (std::int64_t r = 0; r < from.rows; ++r) {
    backend_->copy(to + r * from.cols, from.row(r), row_bytes, tensor::CopyKind::kDeviceToDevice,
                   stream_);
  }
}

template <typename T>
std::vector<ParameterView<T>> BertChunk<T>::parameters() {
  std::vector<ParameterView<T>> views;
  views.reserve(registry_.size());
  T* values = values_.template data<T>();
  T* grads = grads_.template data<T>();
  for (const auto& entry : registry_) {
    views.push_back({entry.name, values + entry.offset, grads + entry.offset, entry.size,
                     entry.shape, entry.no_decay});
  }
  return views;
}

template <typename T>
std::optional<ParameterView<T>> BertChunk<T>::parameter(std::string_view name) {
  for (const auto& entry : registry_) {
    if (entry.name == name) {
      return ParameterView<T>{entry.name,
                              values_.template data<T>() + entry.offset,
                              grads_.template data<T>() + entry.offset,
                              entry.size,
                              entry.shape,
                              entry.no_decay};
    }
  }
  return std::nullopt;
}

template <typename T>
std::span<T> BertChunk<T>::flat_values() {
  return {values_.template data<T>(), static_cast<std::size_t>(values_.numel())};
}
template <typename T>
std::span<T> BertChunk<T>::flat_grads() {
  return {grads_.template data<T>(), static_cast<std::size_t>(grads_.numel())};
}

template <typename T>
void BertChunk<T>::zero_grad() {
  backend_->fill_zero(grads_.raw_data(), grads_.nbytes(), stream_);
}

template <typename T>
void BertChunk<T>::check_finite_gradients(std::int64_t step) const {
  const T* grads = grads_.template data<T>();
  for (const auto& entry : registry_) {
    if (!ops_->all_finite(grads + entry.offset, entry.size)) {
      // Rare: fetch the tensor to name the element.
      std::vector<T> host(static_cast<std::size_t>(entry.size));
      backend_->copy(host.data(), grads + entry.offset, host.size() * sizeof(T),
                     tensor::CopyKind::kDeviceToHost, stream_);
      ops_->synchronize();
      std::size_t index = 0;
      while (index < host.size() && std::isfinite(static_cast<double>(host[index]))) ++index;
      const double value = index < host.size() ? static_cast<double>(host[index]) : 0.0;
      throw std::runtime_error("non-finite gradient at step " + std::to_string(step) + " in '" +
                               entry.name + "' (element " + std::to_string(index) + " is " +
                               std::to_string(value) + ")");
    }
  }
}

template <typename T>
int BertChunk<T>::in_flight() const {
  return static_cast<int>(in_flight_.size());
}

template <typename T>
typename BertChunk<T>::Stash& BertChunk<T>::stash_for(int microbatch) {
  for (auto& stash : in_flight_) {
    if (stash->microbatch == microbatch) return *stash;
  }
  throw std::invalid_argument("model chunk (layers " + std::to_string(spec_.first_layer) + "+" +
                              std::to_string(spec_.num_layers) + "): micro-batch " +
                              std::to_string(microbatch) + " has no forward in flight");
}

template <typename T>
void BertChunk<T>::discard(int microbatch) {
  for (auto it = in_flight_.begin(); it != in_flight_.end(); ++it) {
    if ((*it)->microbatch == microbatch) {
      released_stash_bytes_ = (*it)->arena->capacity();
      pool_.release(std::move((*it)->arena));
      idle_stashes_.push_back(std::move(*it));
      in_flight_.erase(it);
      return;
    }
  }
  stash_for(microbatch);  // throws
}

template <typename T>
ForwardResult<T> BertChunk<T>::forward(int microbatch, const Batch& batch, ConstMatrixView<T> input,
                                       const ForwardOptions& options, KfacCapture<T>* capture) {
  for (const auto& stash : in_flight_) {
    if (stash->microbatch == microbatch) {
      throw std::invalid_argument("model chunk: micro-batch " + std::to_string(microbatch) +
                                  " is already in flight");
    }
  }
  batch.validate(config_);
  const std::int64_t tokens = batch.tokens();
  const std::int64_t H = config_.hidden_size;
  if (!spec_.has_embeddings && (input.rows != tokens || input.cols != H || input.data == nullptr)) {
    throw std::invalid_argument("model chunk: input activation is [" + std::to_string(input.rows) +
                                ", " + std::to_string(input.cols) + "], expected [" +
                                std::to_string(tokens) + ", " + std::to_string(H) + "]");
  }
  std::unique_ptr<Stash> owned;
  if (idle_stashes_.empty()) {
    owned = std::make_unique<Stash>();
  } else {
    owned = std::move(idle_stashes_.back());
    idle_stashes_.pop_back();
  }
  Stash& st = *owned;
  st.microbatch = microbatch;
  st.input_done = false;
  st.arena = pool_.acquire();
  st.batch = batch.batch_size;
  st.seq = batch.seq_len;
  st.predictions = batch.max_predictions;
  st.seed = options.seed;
  st.hidden_dropout = options.training ? config_.hidden_dropout : 0.0F;
  st.attention_dropout = options.training ? config_.attention_dropout : 0.0F;
  in_flight_.push_back(std::move(owned));
  try {
    return forward_stashed(st, batch, input, options, capture);
  } catch (...) {
    discard(microbatch);  // a failed forward leaves nothing in flight
    throw;
  }
}

template <typename T>
ForwardResult<T> BertChunk<T>::forward_stashed(Stash& st, const Batch& batch,
                                               kernels::ConstMatrixView<T> input,
                                               const ForwardOptions& options,
                                               KfacCapture<T>* capture) {
  const int microbatch = st.microbatch;
  const std::int64_t B = st.batch;
  const std::int64_t S = st.seq;
  const std::int64_t P = st.predictions;
  const std::int64_t tokens = B * S;
  const std::int64_t H = config_.hidden_size;
  const std::int64_t I = config_.intermediate_size;
  const std::int64_t V = config_.vocab_size;
  scratch_->reset();

  tensor::Arena& arena = *st.arena;
  // Index arrays are built on the host and uploaded into the stash (the copies finish reading
  // the host vectors before they return, so they may be temporaries).
  auto copy_ids = [&](const std::vector<std::int64_t>& source) {
    auto* target =
        arena.template allocate_array<std::int64_t>(static_cast<std::int64_t>(source.size()));
    upload(target, source.data(), source.size() * sizeof(std::int64_t));
    return target;
  };
  auto buffer = [&](std::int64_t count) { return arena.template allocate_array<T>(count); };
  st.mask = copy_ids(batch.attention_mask);
  T* values = values_.template data<T>();
  const auto& o = *offsets_;
  const T eps = static_cast<T>(config_.layer_norm_eps);

  const T* x = nullptr;
  if (spec_.has_embeddings) {
    st.ids = copy_ids(batch.input_ids);
    st.types = copy_ids(batch.token_type_ids);
    std::vector<std::int64_t> positions(static_cast<std::size_t>(tokens));
    for (std::int64_t t = 0; t < tokens; ++t) positions[static_cast<std::size_t>(t)] = t % S;
    st.positions = copy_ids(positions);
    st.emb_sum = buffer(tokens * H);
    st.emb_mean = buffer(tokens);
    st.emb_rstd = buffer(tokens);
    st.emb_out = buffer(tokens * H);
    MatrixView<T> sum(st.emb_sum, tokens, H);
    ops_->embedding_forward({values + o.word, V, H}, st.ids, sum, "input_ids");
    ops_->embedding_forward({values + o.position, config_.max_position_embeddings, H}, st.positions,
                            sum, "position", true);
    ops_->embedding_forward({values + o.token_type, config_.type_vocab_size, H}, st.types, sum,
                            "token_type_ids", true);
    MatrixView<T> out(st.emb_out, tokens, H);
    ops_->layernorm_forward(sum, values + o.emb_ln_g, values + o.emb_ln_b, eps, out, st.emb_mean,
                            st.emb_rstd);
    ops_->dropout_forward(out, out, st.hidden_dropout,
                          kernels::derive_seed(st.seed, kEmbeddingDropoutSalt));
    x = st.emb_out;
  } else {
    st.input = buffer(tokens * H);
    copy_rows(input, st.input);
    x = st.input;
  }

  const kernels::AttentionShape shape{B, S, config_.num_heads, config_.head_dim()};
  st.layers.resize(layers_.size());
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    const auto& w = layers_[l];
    auto& a = st.layers[l];
    a.input = x;
    ConstMatrixView<T> in(x, tokens, H);
    if (capture != nullptr) {
      for (auto kind : {LinearKind::kQuery, LinearKind::kKey, LinearKind::kValue}) {
        capture->on_input(w.global, kind, microbatch, in);
      }
    }
    a.qkv = buffer(tokens * 3 * H);
    ops_->linear_forward(in, {values + w.qkv_w, 3 * H, H}, values + w.qkv_b,
                         {a.qkv, tokens, 3 * H});
    a.attention_saved = buffer(ops_->attention_saved_size(shape));
    a.ctx = buffer(tokens * H);
    T* workspace = st.attention_dropout > 0.0F
                       ? scratch_->template allocate_array<T>(ops_->attention_workspace_size(shape))
                       : nullptr;
    ops_->attention_forward(shape, {a.qkv, tokens, 3 * H}, st.mask, st.attention_dropout,
                            site_seed(st.seed, w.global, 0), a.attention_saved, workspace,
                            {a.ctx, tokens, H});
    ConstMatrixView<T> ctx(a.ctx, tokens, H);
    if (capture != nullptr) capture->on_input(w.global, LinearKind::kAttentionOut, microbatch, ctx);
    a.attn_sum = buffer(tokens * H);
    MatrixView<T> attn_sum(a.attn_sum, tokens, H);
    ops_->linear_forward(ctx, {values + w.o_w, H, H}, values + w.o_b, attn_sum);
    ops_->dropout_add_forward(attn_sum, in, attn_sum, st.hidden_dropout,
                              site_seed(st.seed, w.global, 1));
    a.mean1 = buffer(tokens);
    a.rstd1 = buffer(tokens);
    a.h1 = buffer(tokens * H);
    ops_->layernorm_forward(attn_sum, values + w.ln1_g, values + w.ln1_b, eps, {a.h1, tokens, H},
                            a.mean1, a.rstd1);
    ConstMatrixView<T> h1(a.h1, tokens, H);
    if (capture != nullptr) capture->on_input(w.global, LinearKind::kFfnIn, microbatch, h1);
    a.ffn_pre = buffer(tokens * I);
    a.ffn_act = buffer(tokens * I);
    ops_->linear_forward(h1, {values + w.in_w, I, H}, nullptr, {a.ffn_pre, tokens, I});
    ops_->bias_gelu_forward({a.ffn_pre, tokens, I}, values + w.in_b, {a.ffn_act, tokens, I});
    ConstMatrixView<T> act(a.ffn_act, tokens, I);
    if (capture != nullptr) capture->on_input(w.global, LinearKind::kFfnOut, microbatch, act);
    a.ffn_sum = buffer(tokens * H);
    MatrixView<T> ffn_sum(a.ffn_sum, tokens, H);
    ops_->linear_forward(act, {values + w.out_w, H, I}, values + w.out_b, ffn_sum);
    ops_->dropout_add_forward(ffn_sum, h1, ffn_sum, st.hidden_dropout,
                              site_seed(st.seed, w.global, 2));
    a.mean2 = buffer(tokens);
    a.rstd2 = buffer(tokens);
    a.out = buffer(tokens * H);
    ops_->layernorm_forward(ffn_sum, values + w.ln2_g, values + w.ln2_b, eps, {a.out, tokens, H},
                            a.mean2, a.rstd2);
    x = a.out;
  }

  ForwardResult<T> result;
  if (!spec_.has_head) {
    result.output = ConstMatrixView<T>(x, tokens, H);
    return result;
  }
  st.sequence = x;
  ConstMatrixView<T> sequence(x, tokens, H);
  Losses losses;
  // NSP: pooler on the first token of each sequence, then the 2-way classifier.
  std::vector<std::int64_t> first_index(static_cast<std::size_t>(B));
  for (std::int64_t b = 0; b < B; ++b) first_index[static_cast<std::size_t>(b)] = b * S;
  st.first_index = copy_ids(first_index);
  st.nsp_labels = copy_ids(batch.next_sentence_labels);
  st.first_tokens = buffer(B * H);
  ops_->gather_rows(sequence, st.first_index, {st.first_tokens, B, H});
  T* pooled_pre = scratch_->template allocate_array<T>(B * H);
  st.pooled = buffer(B * H);
  ops_->linear_forward({st.first_tokens, B, H}, {values + o.pool_w, H, H}, nullptr,
                       {pooled_pre, B, H});
  ops_->bias_tanh_forward({pooled_pre, B, H}, values + o.pool_b, {st.pooled, B, H});
  st.nsp_probs = buffer(B * 2);
  MatrixView<T> nsp(st.nsp_probs, B, 2);
  ops_->linear_forward({st.pooled, B, H}, {values + o.nsp_w, 2, H}, values + o.nsp_b, nsp);
  if (options.keep_logits) {
    T* kept = buffer(B * 2);
    copy_rows({st.nsp_probs, B, 2}, kept);
    result.nsp_logits = ConstMatrixView<T>(kept, B, 2);
  }
  losses.nsp = static_cast<double>(
      ops_->cross_entropy_forward(nsp, st.nsp_labels, nullptr, "next_sentence_labels"));
  // MLM: gather the masked positions, transform, decode with the (tied) word embeddings.
  const std::int64_t R = B * P;
  if (R > 0) {
    std::vector<std::int64_t> mlm_index(static_cast<std::size_t>(R));
    std::vector<T> mlm_weights(static_cast<std::size_t>(R));
    for (std::int64_t r = 0; r < R; ++r) {
      const auto i = static_cast<std::size_t>(r);
      mlm_index[i] = (r / P) * S + batch.masked_lm_positions[i];
      mlm_weights[i] = static_cast<T>(batch.masked_lm_weights[i]);
    }
    st.mlm_index = copy_ids(mlm_index);
    st.mlm_labels = copy_ids(batch.masked_lm_ids);
    st.mlm_weights = buffer(R);
    upload(st.mlm_weights, mlm_weights.data(), mlm_weights.size() * sizeof(T));
    st.gathered = buffer(R * H);
    ops_->gather_rows(sequence, st.mlm_index, {st.gathered, R, H});
    st.transform_pre = buffer(R * H);
    st.transform_act = buffer(R * H);
    ops_->linear_forward({st.gathered, R, H}, {values + o.transform_w, H, H}, nullptr,
                         {st.transform_pre, R, H});
    ops_->bias_gelu_forward({st.transform_pre, R, H}, values + o.transform_b,
                            {st.transform_act, R, H});
    st.transform_mean = buffer(R);
    st.transform_rstd = buffer(R);
    st.transform_out = buffer(R * H);
    ops_->layernorm_forward({st.transform_act, R, H}, values + o.transform_ln_g,
                            values + o.transform_ln_b, eps, {st.transform_out, R, H},
                            st.transform_mean, st.transform_rstd);
    st.mlm_probs = buffer(R * V);
    MatrixView<T> logits(st.mlm_probs, R, V);
    ops_->linear_forward({st.transform_out, R, H}, {values + o.decoder_w, V, H},
                         values + o.decoder_b, logits);
    if (options.keep_logits) {
      T* kept = buffer(R * V);
      copy_rows({st.mlm_probs, R, V}, kept);
      result.mlm_logits = ConstMatrixView<T>(kept, R, V);
    }
    losses.mlm = static_cast<double>(
        ops_->cross_entropy_forward(logits, st.mlm_labels, st.mlm_weights, "masked_lm_ids"));
  }
  result.losses = losses;
  return result;
}

template <typename T>
void BertChunk<T>::backward(int microbatch, ConstMatrixView<T> grad_output,
                            MatrixView<T> grad_input, T loss_scale, KfacCapture<T>* capture,
                            GradientsReady* ready) {
  backward_input(microbatch, grad_output, grad_input, loss_scale, capture);
  backward_weight(microbatch, ready);
}

template <typename T>
std::size_t BertChunk<T>::stash_bytes() const {
  std::size_t bytes = 0;
  for (const auto& stash : in_flight_) bytes += stash->arena->bytes_used();
  return bytes;
}

template <typename T>
std::size_t BertChunk<T>::reserved_stash_bytes() const {
  std::size_t bytes = pool_.idle_capacity();
  for (const auto& stash : in_flight_) bytes += stash->arena->capacity();
  return bytes;
}

template <typename T>
std::size_t BertChunk<T>::live_stash_bytes() const {
  std::size_t bytes = 0;
  for (const auto& stash : in_flight_) bytes += stash->arena->capacity();
  return bytes;
}

template <typename T>
void BertChunk<T>::backward_input(int microbatch, ConstMatrixView<T> grad_output,
                                  MatrixView<T> grad_input, T loss_scale, KfacCapture<T>* capture) {
  Stash& st = stash_for(microbatch);
  if (st.input_done) {
    throw std::invalid_argument("model chunk: micro-batch " + std::to_string(microbatch) +
                                " already had its backward-input");
  }
  const std::int64_t B = st.batch;
  const std::int64_t S = st.seq;
  const std::int64_t P = st.predictions;
  const std::int64_t tokens = B * S;
  const std::int64_t H = config_.hidden_size;
  const std::int64_t I = config_.intermediate_size;
  const std::int64_t V = config_.vocab_size;
  if (!spec_.has_head &&
      (grad_output.rows != tokens || grad_output.cols != H || grad_output.data == nullptr)) {
    throw std::invalid_argument("model chunk: output gradient is [" +
                                std::to_string(grad_output.rows) + ", " +
                                std::to_string(grad_output.cols) + "], expected [" +
                                std::to_string(tokens) + ", " + std::to_string(H) + "]");
  }
  if (!spec_.has_embeddings &&
      (grad_input.rows != tokens || grad_input.cols != H || grad_input.data == nullptr)) {
    throw std::invalid_argument("model chunk: input gradient buffer is [" +
                                std::to_string(grad_input.rows) + ", " +
                                std::to_string(grad_input.cols) + "], expected [" +
                                std::to_string(tokens) + ", " + std::to_string(H) + "]");
  }
  scratch_->reset();
  auto scratch = [&](std::int64_t count) { return scratch_->template allocate_array<T>(count); };
  auto keep = [&](std::int64_t count) { return st.arena->template allocate_array<T>(count); };
  // dx = dy W of a Linear y = x W^T + b (its weight half runs in backward_weight).
  auto linear_input_grad = [this](ConstMatrixView<T> dy, ConstMatrixView<T> weight,
                                  MatrixView<T> dx) {
    ops_->gemm(dy, kernels::Transpose::kNo, weight, kernels::Transpose::kNo, dx);
  };
  T* values = values_.template data<T>();
  T* grads = grads_.template data<T>();
  const auto& o = *offsets_;

  T* ping = scratch(tokens * H);
  T* pong = scratch(tokens * H);
  ConstMatrixView<T> d = grad_output;
  if (spec_.has_head) {
    MatrixView<T> dseq(ping, tokens, H);
    backend_->fill_zero(ping, static_cast<std::size_t>(tokens * H) * sizeof(T), stream_);
    // NSP.
    MatrixView<T> dnsp(st.nsp_probs, B, 2);
    ops_->cross_entropy_backward(dnsp, st.nsp_labels, nullptr, loss_scale);
    st.d_pooled = keep(B * H);
    MatrixView<T> dpooled(st.d_pooled, B, H);
    linear_input_grad(dnsp, {values + o.nsp_w, 2, H}, dpooled);
    ops_->tanh_backward({st.pooled, B, H}, dpooled, dpooled);
    T* dfirst = scratch(B * H);
    linear_input_grad(dpooled, {values + o.pool_w, H, H}, {dfirst, B, H});
    ops_->scatter_add_rows({dfirst, B, H}, st.first_index, dseq);
    // MLM.
    const std::int64_t R = B * P;
    if (R > 0) {
      MatrixView<T> dlogits(st.mlm_probs, R, V);
      ops_->cross_entropy_backward(dlogits, st.mlm_labels, st.mlm_weights, loss_scale);
      T* dout = scratch(R * H);
      linear_input_grad(dlogits, {values + o.decoder_w, V, H}, {dout, R, H});
      st.d_transform = keep(R * H);
      MatrixView<T> dact(st.d_transform, R, H);
      ops_->layernorm_backward({st.transform_act, R, H}, {dout, R, H}, values + o.transform_ln_g,
                               st.transform_mean, st.transform_rstd, dact, grads + o.transform_ln_g,
                               grads + o.transform_ln_b);
      ops_->gelu_backward({st.transform_pre, R, H}, dact, dact);
      T* dgathered = scratch(R * H);
      linear_input_grad(dact, {values + o.transform_w, H, H}, {dgathered, R, H});
      ops_->scatter_add_rows({dgathered, R, H}, st.mlm_index, dseq);
    }
    d = dseq;
    std::swap(ping, pong);
  }

  const kernels::AttentionShape shape{B, S, config_.num_heads, config_.head_dim()};
  T* d_sum = scratch(tokens * H);
  T* d_ctx = scratch(tokens * H);
  T* workspace = scratch(ops_->attention_workspace_size(shape));
  for (std::size_t l = layers_.size(); l-- > 0;) {
    const auto& w = layers_[l];
    auto& a = st.layers[l];
    a.d_ffn_out = keep(tokens * H);
    a.d_ffn_in = keep(tokens * I);
    a.d_attn_out = keep(tokens * H);
    a.d_qkv = keep(tokens * 3 * H);
    const bool last = l == 0 && !spec_.has_embeddings;
    MatrixView<T> dinput = last ? grad_input : MatrixView<T>(ping, tokens, H);
    // Output LayerNorm; its input is h1 + dropout(FFN(h1)). Its input gradient is the residual
    // branch's share of dh1: written straight into dh1, the FFN-in product adds to it (beta 1).
    MatrixView<T> dh1(d_ctx, tokens, H);
    ops_->layernorm_backward({a.ffn_sum, tokens, H}, d, values + w.ln2_g, a.mean2, a.rstd2, dh1,
                             grads + w.ln2_g, grads + w.ln2_b);
    MatrixView<T> dffn_out(a.d_ffn_out, tokens, H);
    ops_->dropout_backward(dh1, dffn_out, st.hidden_dropout, site_seed(st.seed, w.global, 2));
    if (capture != nullptr)
      capture->on_output_grad(w.global, LinearKind::kFfnOut, microbatch, dffn_out);
    MatrixView<T> dact(a.d_ffn_in, tokens, I);
    linear_input_grad(dffn_out, {values + w.out_w, H, I}, dact);
    ops_->gelu_backward({a.ffn_pre, tokens, I}, dact, dact);
    if (capture != nullptr) capture->on_output_grad(w.global, LinearKind::kFfnIn, microbatch, dact);
    // dh1 = the residual's gradient (above) + the FFN-in input gradient.
    ops_->gemm(dact, kernels::Transpose::kNo, {values + w.in_w, I, H}, kernels::Transpose::kNo, dh1,
               T(1), T(1));
    // Attention LayerNorm; its input is x + dropout(attention output projection). Its input
    // gradient goes straight into dinput, to which the QKV product adds below.
    ops_->layernorm_backward({a.attn_sum, tokens, H}, dh1, values + w.ln1_g, a.mean1, a.rstd1,
                             dinput, grads + w.ln1_g, grads + w.ln1_b);
    MatrixView<T> dattn_out(a.d_attn_out, tokens, H);
    ops_->dropout_backward(dinput, dattn_out, st.hidden_dropout, site_seed(st.seed, w.global, 1));
    if (capture != nullptr) {
      capture->on_output_grad(w.global, LinearKind::kAttentionOut, microbatch, dattn_out);
    }
    MatrixView<T> dctx(d_ctx, tokens, H);  // dh1 is no longer needed
    linear_input_grad(dattn_out, {values + w.o_w, H, H}, dctx);
    MatrixView<T> dqkv(a.d_qkv, tokens, 3 * H);
    ops_->attention_backward(shape, {a.qkv, tokens, 3 * H}, st.mask, {a.ctx, tokens, H},
                             a.attention_saved, dctx, st.attention_dropout,
                             site_seed(st.seed, w.global, 0), workspace, dqkv);
    if (capture != nullptr) {
      capture->on_output_grad(w.global, LinearKind::kQuery, microbatch, dqkv.block_cols(0, H));
      capture->on_output_grad(w.global, LinearKind::kKey, microbatch, dqkv.block_cols(H, H));
      capture->on_output_grad(w.global, LinearKind::kValue, microbatch, dqkv.block_cols(2 * H, H));
    }
    ops_->gemm(dqkv, kernels::Transpose::kNo, {values + w.qkv_w, 3 * H, H}, kernels::Transpose::kNo,
               dinput, T(1), T(1));
    d = dinput;
    std::swap(ping, pong);
  }

  if (spec_.has_embeddings) {
    MatrixView<T> dln(d_sum, tokens, H);
    ops_->dropout_backward(d, dln, st.hidden_dropout,
                           kernels::derive_seed(st.seed, kEmbeddingDropoutSalt));
    st.d_embeddings = keep(tokens * H);
    ops_->layernorm_backward({st.emb_sum, tokens, H}, dln, values + o.emb_ln_g, st.emb_mean,
                             st.emb_rstd, {st.d_embeddings, tokens, H}, grads + o.emb_ln_g,
                             grads + o.emb_ln_b);
  } else if (layers_.empty()) {
    // A chunk with no layers passes the gradient through.
    if (grad_input.ld == H) {
      copy_rows(d, grad_input.data);
    } else {
      for (std::int64_t r = 0; r < tokens; ++r) copy_rows(d.block_rows(r, 1), grad_input.row(r));
    }
  }
  st.input_done = true;
}

template <typename T>
void BertChunk<T>::backward_weight(int microbatch, GradientsReady* ready) {
  Stash& st = stash_for(microbatch);
  if (!st.input_done) {
    throw std::invalid_argument("model chunk: backward-weight of micro-batch " +
                                std::to_string(microbatch) + " before its backward-input");
  }
  const std::int64_t B = st.batch;
  const std::int64_t tokens = B * st.seq;
  const std::int64_t R = B * st.predictions;
  const std::int64_t H = config_.hidden_size;
  const std::int64_t I = config_.intermediate_size;
  const std::int64_t V = config_.vocab_size;
  T* values = values_.template data<T>();
  T* grads = grads_.template data<T>();
  const auto& o = *offsets_;
  // dW += dy^T x and db += sum_rows dy of a Linear (its input half ran in backward_input).
  auto linear_weight_grad = [this](ConstMatrixView<T> x, ConstMatrixView<T> weight,
                                   ConstMatrixView<T> dy, T* dweight, T* dbias) {
    ops_->linear_backward(x, weight, dy, MatrixView<T>(nullptr, x.rows, x.cols),
                          {dweight, weight.rows, weight.cols}, dbias);
  };
  if (spec_.has_head) {
    linear_weight_grad({st.pooled, B, H}, {values + o.nsp_w, 2, H}, {st.nsp_probs, B, 2},
                       grads + o.nsp_w, grads + o.nsp_b);
    linear_weight_grad({st.first_tokens, B, H}, {values + o.pool_w, H, H}, {st.d_pooled, B, H},
                       grads + o.pool_w, grads + o.pool_b);
    if (R > 0) {
      linear_weight_grad({st.transform_out, R, H}, {values + o.decoder_w, V, H},
                         {st.mlm_probs, R, V}, grads + o.decoder_w, grads + o.decoder_b);
      linear_weight_grad({st.gathered, R, H}, {values + o.transform_w, H, H},
                         {st.d_transform, R, H}, grads + o.transform_w, grads + o.transform_b);
    }
    // The head's LayerNorm gradients came from backward_input; its decoder weight is the word
    // embeddings' (reported with them) when this chunk holds both.
    if (ready != nullptr) ready->on_gradients_ready(o.pool_w, grads_.numel());
  }
  for (std::size_t l = layers_.size(); l-- > 0;) {
    const auto& w = layers_[l];
    const auto& a = st.layers[l];
    linear_weight_grad({a.ffn_act, tokens, I}, {values + w.out_w, H, I}, {a.d_ffn_out, tokens, H},
                       grads + w.out_w, grads + w.out_b);
    linear_weight_grad({a.h1, tokens, H}, {values + w.in_w, I, H}, {a.d_ffn_in, tokens, I},
                       grads + w.in_w, grads + w.in_b);
    linear_weight_grad({a.ctx, tokens, H}, {values + w.o_w, H, H}, {a.d_attn_out, tokens, H},
                       grads + w.o_w, grads + w.o_b);
    linear_weight_grad({a.input, tokens, H}, {values + w.qkv_w, 3 * H, H}, {a.d_qkv, tokens, 3 * H},
                       grads + w.qkv_w, grads + w.qkv_b);
    // The layer's parameters run from its fused QKV weight to its output LayerNorm's bias.
    if (ready != nullptr) ready->on_gradients_ready(w.qkv_w, w.ln2_b + H);
  }
  if (spec_.has_embeddings) {
    ConstMatrixView<T> dsum(st.d_embeddings, tokens, H);
    ops_->embedding_backward(dsum, st.ids, {grads + o.word, V, H}, config_.pad_token_id);
    ops_->embedding_backward(dsum, st.positions,
                             {grads + o.position, config_.max_position_embeddings, H});
    ops_->embedding_backward(dsum, st.types, {grads + o.token_type, config_.type_vocab_size, H});
    if (ready != nullptr) ready->on_gradients_ready(o.word, o.emb_ln_b + H);
  }
  discard(microbatch);
}

void check_finite_loss(const Losses& losses, std::int64_t step) {
  if (std::isfinite(losses.mlm) && std::isfinite(losses.nsp)) return;
  throw std::runtime_error("non-finite loss at step " + std::to_string(step) + ": MLM " +
                           std::to_string(losses.mlm) + ", NSP " + std::to_string(losses.nsp));
}

template <typename T>
std::vector<std::unique_ptr<BertChunk<T>>> make_chunks(const BertConfig& config,
                                                       const std::vector<ChunkSpec>& specs,
                                                       tensor::Backend& backend, std::uint64_t seed,
                                                       tensor::Stream* stream,
                                                       kernels::GemmPrecision precision,
                                                       kernels::AttentionAlgorithm attention) {
  validate_chunk_specs(config, specs);
  std::vector<std::unique_ptr<BertChunk<T>>> chunks;
  for (const auto& spec : specs) {
    chunks.push_back(
        std::make_unique<BertChunk<T>>(config, spec, backend, stream, precision, attention));
    chunks.back()->init_weights(seed);
  }
  return chunks;
}

template class BertChunk<float>;
template class BertChunk<double>;
template std::vector<std::unique_ptr<BertChunk<float>>> make_chunks<float>(
    const BertConfig&, const std::vector<ChunkSpec>&, tensor::Backend&, std::uint64_t,
    tensor::Stream*, kernels::GemmPrecision, kernels::AttentionAlgorithm);
template std::vector<std::unique_ptr<BertChunk<double>>> make_chunks<double>(
    const BertConfig&, const std::vector<ChunkSpec>&, tensor::Backend&, std::uint64_t,
    tensor::Stream*, kernels::GemmPrecision, kernels::AttentionAlgorithm);

}  // namespace pf::model
