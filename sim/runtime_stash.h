#pragma once
// What pipefisher_train keeps per micro-batch from a chunk's forward until its backward: the
// buffers BertChunk::forward (runtime/model/bert_chunk.cpp) allocates in the micro-batch's stash
// arena, each rounded up to the arena's 64-byte alignment (runtime/tensor/arena.cpp), so that the
// BERT analytic model's memory is this runtime's. BertChunk::stash_bytes() sums the same arena;
// tests/model/test_runtime_stash.cpp compares the two exactly (CPU; test_model_cuda on a GPU for
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
// Not counted, as the stash is not: the gradients the backward keeps for its weight gradients
// (split backward), the per-chunk scratch (attention workspace, pooler pre-activation) and the
// messages between chunks.
#include "sim/bert_costs.h"

namespace pf::sim {

// tensor::Arena's alignment of every allocation.
inline constexpr double kRuntimeStashAlignment = 64.0;

double runtime_layer_stash_bytes(const Workload& w);
double runtime_embeddings_stash_bytes(const Workload& w);
double runtime_head_stash_bytes(const Workload& w);
// What every chunk keeps besides its layers, embeddings and head: the attention mask, and the
// incoming activation's copy unless the chunk holds the embeddings.
double runtime_chunk_base_stash_bytes(const Workload& w, bool has_embeddings);

}  // namespace pf::sim
