#pragma once
// A contiguous slice of BERT (a pipeline chunk / virtual stage): optionally the embeddings, then
// encoder layers [first_layer, first_layer + num_layers), optionally the pooler and the MLM/NSP
// heads. Forward takes the incoming activation (or, on the embedding chunk, the batch) and
// returns the outgoing one; backward takes the gradient of that output and writes the gradient
// of the input, accumulating parameter gradients across micro-batches. The activations of each
// in-flight micro-batch are stashed in an arena of the chunk and released by its backward.
//
// Tied word embeddings: the MLM decoder uses the word-embedding matrix. When one chunk holds
// both the embeddings and the head it is one tensor. When they are on different chunks, the head
// chunk keeps its own copy named "cls.predictions.decoder.weight"; the two copies start equal
// (load/init), their gradients must be summed before the optimizer step (see
// tied_parameter_names()) and identical updates keep them equal, as Megatron does with its
// embedding group.
//
// Device: every op runs through the kernels' BackendOps of the backend's device (CpuOps on the
// CPU, CudaOps on a GPU, issued on `stream`), so the chunk's parameters, gradients, stashes,
// outputs and the views it hands to a KfacCapture live on that device; inputs, output
// gradients and grad_input buffers must too. The Batch stays on the host (it is validated there
// and its index arrays uploaded). Losses come back to the host (the cross-entropy waits for the
// device).
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kernels/backend_ops.h"
#include "kernels/matrix_view.h"
#include "runtime/model/batch.h"
#include "runtime/model/bert_config.h"
#include "runtime/model/gradients_ready.h"
#include "runtime/model/kfac_capture.h"
#include "runtime/model/parameter.h"
#include "runtime/tensor/arena.h"
#include "runtime/tensor/backend.h"
#include "runtime/tensor/tensor.h"
#include "scheduler/schedule.h"

namespace pf::model {

struct ChunkSpec {
  int first_layer = 0;
  int num_layers = 0;
  bool has_embeddings = false;
  bool has_head = false;
  friend bool operator==(const ChunkSpec&, const ChunkSpec&) = default;
};
inline ChunkSpec chunk_spec(const sched::ChunkPlacement& placement) {
  return {placement.first_layer, placement.num_layers, placement.has_embeddings,
          placement.has_head};
}
// The whole model as one chunk.
inline ChunkSpec whole_model(const BertConfig& config) {
  return {0, config.num_layers, true, true};
}
// Throws std::invalid_argument unless the specs cover the embeddings, every layer once in order
// and the head, in that order.
void validate_chunk_specs(const BertConfig& config, const std::vector<ChunkSpec>& specs);

// The Hugging Face names of a parameter and its tied copy, when the model is split so that the
// copy exists: {"bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"}.
std::pair<std::string, std::string> tied_parameter_names();

struct ForwardOptions {
  bool training = true;      // dropout on
  std::uint64_t seed = 0;    // dropout stream of this micro-batch (same on every chunk)
  bool keep_logits = false;  // keep the MLM and NSP logits (before softmax) for inspection
};

struct Losses {
  double mlm = 0;  // mean cross-entropy over real masked positions
  double nsp = 0;  // mean over sequences
  double total() const { return mlm + nsp; }
};

// Throws std::runtime_error naming the step and which loss is NaN or infinite.
void check_finite_loss(const Losses& losses, std::int64_t step);

template <typename T>
struct ForwardResult {
  kernels::ConstMatrixView<T> output;      // [B*S, H]; empty on the head chunk
  std::optional<Losses> losses;            // head chunk only
  kernels::ConstMatrixView<T> mlm_logits;  // [B*P, V] when keep_logits
  kernels::ConstMatrixView<T> nsp_logits;  // [B, 2] when keep_logits
};

template <typename T>
class BertChunk {
 public:
  // Ops issue on `stream` (null: the backend's default stream); `precision` picks how a GPU's
  // matrix products run (the CPU always computes in T), `attention` how a GPU computes the
  // attention core. Throws std::invalid_argument when this build has no ops of T for the
  // backend's device (or the backend has no such attention algorithm).
  BertChunk(const BertConfig& config, const ChunkSpec& spec, tensor::Backend& backend,
            tensor::Stream* stream = nullptr,
            kernels::GemmPrecision precision = kernels::GemmPrecision::kFp32,
            kernels::AttentionAlgorithm attention = kernels::AttentionAlgorithm::kBatchedGemm);
  ~BertChunk();
  BertChunk(const BertChunk&) = delete;
  BertChunk& operator=(const BertChunk&) = delete;

  const BertConfig& config() const { return config_; }
  const ChunkSpec& spec() const { return spec_; }
  tensor::Device device() const { return backend_->device(); }
  tensor::Backend& backend() const { return *backend_; }
  tensor::Stream* stream() const { return stream_; }
  // The ops the chunk runs on (e.g. for K-FAC work on the same device and stream).
  kernels::BackendOps<T>& ops() const { return *ops_; }

  // normal(0, initializer_range) weights and embeddings (the padding row zero), zero biases,
  // LayerNorm 1/0. Each tensor's values depend only on (seed, its name), so any chunking of the
  // model is initialised identically, on any device (drawn on the host, then uploaded).
  void init_weights(std::uint64_t seed);

  std::vector<ParameterView<T>> parameters();
  // nullopt when this chunk has no parameter of that name.
  std::optional<ParameterView<T>> parameter(std::string_view name);
  // All values / gradients of the chunk as one contiguous array (parameters() order), in the
  // device's memory (parameters() too).
  std::span<T> flat_values();
  std::span<T> flat_grads();
  // Bytes allocated for the values / gradients (the two arrays above): the chunk's static memory
  // beside its optimizer's state (a worker's memory accounting, the profile's static_bytes).
  std::size_t parameter_bytes() const { return values_.nbytes(); }
  std::size_t gradient_bytes() const { return grads_.nbytes(); }
  void zero_grad();
  // Throws std::runtime_error naming the step and the first parameter whose gradient holds a
  // NaN or infinity.
  void check_finite_gradients(std::int64_t step) const;

  // Forward of `microbatch` (any id unique among the in-flight ones). `input` is the previous
  // chunk's output [B*S, H] (ignored, may be empty, on the embedding chunk); it is copied. The
  // returned views stay valid until backward(microbatch).
  ForwardResult<T> forward(int microbatch, const Batch& batch, kernels::ConstMatrixView<T> input,
                           const ForwardOptions& options, KfacCapture<T>* capture = nullptr);
  // Backward of a forwarded micro-batch. grad_output [B*S, H] is ignored on the head chunk,
  // whose loss gradient is loss_scale (e.g. 1/micro-batches). grad_input [B*S, H] is written
  // unless this is the embedding chunk (may be empty there). Frees the micro-batch's stash.
  // Exactly backward_input followed by backward_weight (bit for bit). `ready` (may be null) is
  // told which gradients are finished as backward_weight goes (gradients_ready.h).
  void backward(int microbatch, kernels::ConstMatrixView<T> grad_output,
                kernels::MatrixView<T> grad_input, T loss_scale = T(1),
                KfacCapture<T>* capture = nullptr, GradientsReady* ready = nullptr);
  // The zero-bubble split of backward. backward_input computes grad_input (what the previous
  // chunk waits for), the LayerNorm parameter gradients and the Linear output gradients, which
  // it reports to `capture` (K-FAC's g) and keeps in the micro-batch's stash. backward_weight
  // then accumulates the Linear weight and bias gradients and the embedding gradients from the
  // stash and frees it. Throws std::invalid_argument when called out of order.
  void backward_input(int microbatch, kernels::ConstMatrixView<T> grad_output,
                      kernels::MatrixView<T> grad_input, T loss_scale = T(1),
                      KfacCapture<T>* capture = nullptr);
  void backward_weight(int microbatch, GradientsReady* ready = nullptr);
  // Bytes held by the stashes of in-flight micro-batches (activations awaiting their backward,
  // output gradients awaiting backward_weight).
  std::size_t stash_bytes() const;
  // Bytes the stash arenas hold from the backend, in flight and pooled for the next micro-batches:
  // after a first forward and backward, each holds that cycle's forward stash and the gradients
  // its backward kept (what the simulator's memory counts per stashed micro-batch,
  // sim/runtime_stash.h).
  std::size_t reserved_stash_bytes() const;
  // Bytes the in-flight micro-batches' arenas hold from the backend (reserved_stash_bytes less
  // the idle pool): what the stashes occupy now.
  std::size_t live_stash_bytes() const;
  // The capacity of the arena that the last backward, backward_weight or discard released, as
  // it held it just before: one micro-batch's stash at its largest (the forward's buffers and
  // the output gradients backward_input added); 0 before any release.
  std::size_t released_stash_bytes() const { return released_stash_bytes_; }
  // Drops a forwarded micro-batch without a backward (evaluation).
  void discard(int microbatch);
  int in_flight() const;

 private:
  struct Stash;
  struct LayerWeights;
  struct Registered;
  Stash& stash_for(int microbatch);
  ForwardResult<T> forward_stashed(Stash& stash, const Batch& batch,
                                   kernels::ConstMatrixView<T> input, const ForwardOptions& options,
                                   KfacCapture<T>* capture);

  // Host to device (the chunk's stream); plain copies on the CPU.
  void upload(void* destination, const void* source, std::size_t bytes);
  // Device to device, row by row unless `from` is contiguous.
  void copy_rows(kernels::ConstMatrixView<T> from, T* to);

  BertConfig config_;
  ChunkSpec spec_;
  tensor::Backend* backend_;
  tensor::Stream* stream_;
  std::unique_ptr<kernels::BackendOps<T>> ops_;
  tensor::Tensor values_;
  tensor::Tensor grads_;
  std::vector<Registered> registry_;
  std::vector<LayerWeights> layers_;
  // Parameter offsets (into values_/grads_) of the embedding and head tensors; -1 when absent.
  struct Offsets;
  std::unique_ptr<Offsets> offsets_;
  tensor::ArenaPool pool_;
  std::unique_ptr<tensor::Arena> scratch_;
  std::vector<std::unique_ptr<Stash>> in_flight_;
  std::vector<std::unique_ptr<Stash>> idle_stashes_;
  std::size_t released_stash_bytes_ = 0;
};

// One chunk per spec (validated with validate_chunk_specs), initialised from `seed`.
template <typename T>
std::vector<std::unique_ptr<BertChunk<T>>> make_chunks(
    const BertConfig& config, const std::vector<ChunkSpec>& specs, tensor::Backend& backend,
    std::uint64_t seed, tensor::Stream* stream = nullptr,
    kernels::GemmPrecision precision = kernels::GemmPrecision::kFp32,
    kernels::AttentionAlgorithm attention = kernels::AttentionAlgorithm::kBatchedGemm);

extern template class BertChunk<float>;
extern template class BertChunk<double>;

}  // namespace pf::model
