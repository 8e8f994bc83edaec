#pragma once
// What pipefisher_train keeps per micro-batch from a chunk's forward until its backward: the
// buffers BertChunk::forward (runtime/model/bert_chunk.cpp) allocates in the micro-batch's stash
// arena, each rounded up to the arena's 64-byte alignment (runtime/tensor/arena.cpp), and what
// its backward adds there, so that the BERT analytic model's memory is this runtime's.
// BertChunk::stash_bytes() and reserved_stash_bytes() measure the same arenas;
// tests/model/test_runtime_stash.cpp compares them exactly (CPU; test_model_cuda on a GPU for
// both attention algorithms). Notation of sim/bert_costs.h: T = b S tokens, e bytes per stored
// element (sizeof the chunk's element type: 4 for pipefisher_train's fp32 storage, 8 in fp64),
// index arrays int64 (8 bytes); every term below is one buffer, rounded up to 64 bytes.
//
// Per encoder layer: the fused QKV projection (3 e T H), the attention's saved tensor (batched:
// the probabilities, e b a S^2; fused: one log-sum-exp per query row, e b a S), the context
// (e T H), the attention output + residual, LayerNorm 1's input (e T H), LayerNorm 1's mean and
// 1/std (2 x e T) and output (e T H), the FFN's pre-activation and GELU output (2 x e T I), its
// output + residual (e T H), LayerNorm 2's mean and 1/std (2 x e T) and output (e T H), the next
// layer's input: e (8 T H + 2 T I + 4 T) + the saved tensor. No dropout mask is kept (the
// backward regenerates it from the micro-batch's seed), nor the pre-softmax scores.
// Per chunk: the attention mask (8 T), and either the embeddings' stash or, on a chunk without
// them, its copy of the incoming activation (e T H).
// Embeddings: input, token-type and position ids (3 x 8 T), their sum (e T H), the LayerNorm's
// mean and 1/std (2 x e T) and output (e T H).
// Head (R = b P scored positions): the first tokens' row indices and the NSP labels (2 x 8 b),
// the first tokens and the pooled output (2 x e b H), the NSP logits (2 e b); with R > 0 the MLM
// row indices and labels (2 x 8 R), weights (e R), the gathered rows, the transform's
// pre-activation, GELU output and LayerNorm output (4 x e R H), its mean and 1/std (2 x e R) and
// the logits (e R V).
//
// The backward adds to the same arena the output gradients of the Linears, which backward_input
// keeps for backward_weight (the zero-bubble split; the plain backward runs the two back to back):
// per layer the FFN output's and input's (e T H, e T I), the attention output's (e T H) and the
// QKV projection's (3 e T H); the embeddings' LayerNorm input gradient (e T H); the pooler's
// (e b H) and, with R > 0, the MLM transform's (e R H). The arena is pooled (BertChunk keeps a
// released micro-batch's arena for the next one, and Arena::reset keeps one block of the whole
// cycle), so after the first step each stashed micro-batch holds forward + backward bytes: that
// is what the simulator's memory counts (BertChunk::reserved_stash_bytes()); an arena is at
// least 1 MiB (tensor::Arena's smallest block), which only a toy model notices.
//
// Not counted: the per-chunk scratch (attention workspace, the backward's ping-pong buffers,
// held once per chunk, not per micro-batch) and the messages between chunks.
#include "sim/bert_costs.h"

namespace pf::sim {

// tensor::Arena's alignment of every allocation, and its smallest block.
inline constexpr double kRuntimeStashAlignment = 64.0;
inline constexpr double kRuntimeArenaMinBytes = 1024.0 * 1024.0;

// Bytes of one micro-batch's arena: what the forward keeps, and what backward_input adds.
struct RuntimeStash {
  double forward = 0.0;
  double backward = 0.0;
  double total() const { return forward + backward; }
};

RuntimeStash runtime_layer_stash(const Workload& w);
RuntimeStash runtime_embeddings_stash(const Workload& w);
RuntimeStash runtime_head_stash(const Workload& w);
// A chunk of num_layers encoder layers, with or without the embeddings and the heads, including
// what every chunk keeps: the attention mask, and the incoming activation's copy unless the chunk
// holds the embeddings.
RuntimeStash runtime_chunk_stash(const Workload& w, int num_layers, bool has_embeddings,
                                 bool has_head);
// What one stashed micro-batch's arena of such a chunk holds after the first step:
// max(forward + backward, kRuntimeArenaMinBytes).
double runtime_chunk_arena_bytes(const Workload& w, int num_layers, bool has_embeddings,
                                 bool has_head);

}  // namespace pf::sim
