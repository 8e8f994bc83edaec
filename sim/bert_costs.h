#pragma once
// The workload, parameters and stashed activations of the pieces of BERT (an encoder layer, the
// embeddings, the pooler + MLM/NSP heads) for one micro-batch; their kernels (FLOPs and bytes)
// are in sim/bert_kernels.h. Every formula is written out here and in docs/simulator.md. Notation:
// b micro-batch size, S sequence length, T = b*S tokens, H hidden, I intermediate (FFN), a heads, V
// vocabulary, P = b * predictions (masked positions the MLM head scores), e bytes per activation
// element.
#include <cstdint>
#include <optional>
#include <string_view>

#include "runtime/model/bert_config.h"
#include "scheduler/instruction.h"
#include "sim/attention_kernels.h"
#include "sim/device.h"

namespace pf::sim {

// How the stashed activations are counted. kRuntime: the arena pipefisher_train's BertChunk
// holds per stashed micro-batch (sim/runtime_stash.h; the default: the simulator predicts this
// project's runtime). kEager: Korthikanti et al.'s count for an eager framework (Megatron-LM,
// PyTorch autograd as PipeFisher's code runs it: the softmax output, dropout masks and outputs,
// 16-bit counts scaled by e / 2), for comparisons with published figures.
enum class ActivationStash : std::uint8_t { kRuntime, kEager };
std::string_view to_string(ActivationStash stash);  // "runtime", "eager"
// Throws std::invalid_argument naming the allowed values (the --stash flag).
ActivationStash activation_stash_from_string(std::string_view name);

struct Workload {
  model::BertConfig config;
  int seq_len = 128;
  int micro_batch_size = 32;
  Precision precision = Precision::kBf16;  // of the matrix products
  // Precision activations, gradients and the messages between chunks are stored in; unset: the
  // products' (2 bytes for bf16 / fp16, 4 for fp32 / tf32). pipefisher_train keeps them in fp32
  // whatever its product precision (BertChunk<float>: bf16 and tf32 change only the cuBLAS
  // compute type), so its bf16 runs move 4-byte elements.
  std::optional<Precision> storage_precision;
  // MLM positions scored per sequence; <= 0 means round(S * 20 / 128) (NVIDIA's recipe: 20 at
  // S = 128, 80 at S = 512).
  int max_predictions = 0;
  // How the attention core runs (sim/attention_kernels.h): batched products with the scores in
  // memory, or pipefisher_train's fused (flash-style) kernel.
  AttentionAlgorithm attention = AttentionAlgorithm::kBatched;
  // Whose activation stash the memory counts: pipefisher_train's (the tensors its BertChunk
  // keeps, sim/runtime_stash.h) or an eager framework's (Korthikanti et al.'s count).
  ActivationStash stash = ActivationStash::kRuntime;

  int predictions() const;
  double tokens() const { return double{1.0} * micro_batch_size * seq_len; }
  // Bytes of one stored activation / gradient element (e of the formulas).
  double storage_bytes() const { return element_bytes(storage_precision.value_or(precision)); }
  // Throws std::invalid_argument naming the field (and the model's limit).
  void validate() const;
};

// The attention core of one micro-batch of an encoder layer (sim/attention_kernels.h).
AttentionShape attention_shape(const Workload& w);

// Parameter counts.
double encoder_layer_params(const model::BertConfig& c);  // 4H^2 + 2HI + 9H + I
double embeddings_params(const model::BertConfig& c);     // (V + positions + types) H + 2H
// pooler H^2+H, NSP 2H+2, MLM transform H^2+H + LayerNorm 2H, decoder bias V, plus the decoder
// weight V*H when it is not tied to embeddings held by the same chunk.
double heads_params(const model::BertConfig& c, bool holds_tied_embeddings);

// Bytes a stashed micro-batch holds until its backward is done, as w.stash counts them: for the
// runtime, its pooled arena (the forward's stash and the output gradients the backward keeps,
// sim/runtime_stash.h); for the eager count, the activations. The fused attention keeps no
// [S, S] probabilities or dropout mask, only one log-sum-exp per query row.
double encoder_layer_activation_bytes(const Workload& w);
double embeddings_activation_bytes(const Workload& w);
double heads_activation_bytes(const Workload& w);
// A chunk of num_layers encoder layers, with or without the embeddings and the heads: its pieces
// plus, for the runtime, what every chunk keeps (the mask, the incoming activation).
double chunk_activation_bytes(const Workload& w, int num_layers, bool has_embeddings,
                              bool has_head);
// Hidden states crossing a chunk boundary (and their gradient): T * H * e.
double boundary_bytes(const Workload& w);

// Weights + gradients + optimizer state per parameter: 16 bytes in fp32 (w, g, m, v) and in
// mixed precision (16-bit w and g, fp32 master w, m, v).
inline constexpr double kStaticBytesPerParam = 16.0;

// K-FAC on one Linear of an encoder layer (fp32 factors).
struct LinearDims {
  int in = 0;
  int out = 0;
};
LinearDims linear_dims(const model::BertConfig& c, sched::LinearKind linear);

// Model FLOPs of one sequence, forward + backward (3x the forward matmul FLOPs), for MFU.
double model_flops_per_sequence(const Workload& w);

}  // namespace pf::sim
