#pragma once
// The kernels one tensor-parallel rank launches for one micro-batch of each piece of a
// transformer (a layer, the embeddings, the head), as Megatron-LM runs them: column-parallel
// Q/K/V and MLP-up products, row-parallel attention-output and MLP-down products, heads split
// over the t ranks, the norms, residuals and dropouts replicated on every rank. The
// tensor-parallel all-reduces are communication, priced by the cost model (2 in the forward, 2
// in the backward of a layer). Recomputation adds the forward kernels it re-runs (full: the
// whole layer; selective: the attention core) to the backward-input list.
// Notation (per rank): T = b S tokens, H hidden, a_t = a / t heads, kv_t = max(1, kv / t) key /
// value heads, d head size, I_t = I / t, N = b a_t S^2 attention scores, e bytes per element.
#include "sim/attention_kernels.h"
#include "sim/bert_kernels.h"
#include "sim/cluster.h"
#include "sim/transformer_spec.h"

namespace pf::sim {

enum class Recompute { kNone, kSelective, kFull };
std::string_view to_string(Recompute recompute);
Recompute recompute_from_string(std::string_view name);  // throws naming the allowed values

// AMSP-style state sharding: over how many ranks of the data-parallel group each component of
// the model state is split (1: replicated on every replica, ZeRO-0; 0: all d replicas, fully
// sharded). Optimizer alone sharded over d is ZeRO-1, with gradients ZeRO-2, all three ZeRO-3.
struct StateSharding {
  int parameters = 1;
  int gradients = 1;
  int optimizer = 1;
};

// ZeRO-Infinity: where the optimizer state (fp32 master weights and Adam moments, 12 bytes per
// parameter) lives; the update runs where it lives, the gradients and weights cross PCIe.
enum class Offload { kNone, kHost, kNvme };
std::string_view to_string(Offload offload);
Offload offload_from_string(std::string_view name);  // throws naming the allowed values

// Where the K-FAC state of each preconditioned Linear lives across the data-parallel group, as
// the runtime's --kfac-sharding places it (kfac/state_placement.h), counted in holders: its
// factors on `factors` replicas (they also invert), its inverses on `inverses` (>= factors; the
// rest receive the preconditioned gradient every step). 0: all d replicas. replicate = {0, 0},
// shard = {1, 1}, partial:G = {G, G}, factors=shard,inverses=replicate = {1, 0}.
struct KfacStateHolders {
  int factors = 0;
  int inverses = 0;
};

struct ParallelWorkload {
  TransformerSpec model;
  int seq_len = 2048;
  int micro_batch_size = 1;
  Precision precision = Precision::kBf16;
  int tensor_parallel = 1;
  Recompute recompute = Recompute::kNone;
  StateSharding sharding;
  Offload optimizer_offload = Offload::kNone;
  RankOrder rank_order = RankOrder::kMegatron;  // which groups share a node (sim/cluster.h)
  KfacStateHolders kfac_state;                  // K-FAC state over the data-parallel group
  // The attention core (sim/attention_kernels.h): batched products with the scores in memory, or
  // the fused kernel (no [S, S] tensor stored; the backward recomputes the scores).
  AttentionAlgorithm attention = AttentionAlgorithm::kBatched;

  double tokens() const { return double{1.0} * micro_batch_size * seq_len; }
  // BERT's scored positions per sequence (round(20 S / 128)); every position for decoders.
  int scored_positions() const;
  // Throws std::invalid_argument naming the flag.
  void validate() const;
};

PieceKernels transformer_layer_kernels(const ParallelWorkload& w);
PieceKernels transformer_embedding_kernels(const ParallelWorkload& w);
PieceKernels transformer_head_kernels(const ParallelWorkload& w);

// Bytes one rank stashes per micro-batch of one layer until its backward (Korthikanti et al.'s
// count generalised to gated MLPs and grouped-query attention; 16-bit baseline scaled by e / 2):
// none: T (10 H + (4 H + 4 kv d + 4 I') / t) + 5 N' (5: scores, dropout mask and output; 2
// without attention dropout), I' = I (2 I for a gated MLP's two inputs + 1 I output: 6 I / 4),
// selective: the same without the N' terms; full: the layer's input only, 2 T H. The fused
// attention drops the N' terms and keeps b a_t S fp32 log-sum-exps instead.
double transformer_layer_activation_bytes(const ParallelWorkload& w);
// The largest transient of full recomputation: one layer's activations rebuilt during its
// backward (held once per rank, not per stashed micro-batch). 0 for none / selective.
double transformer_recompute_transient_bytes(const ParallelWorkload& w);
double transformer_embedding_activation_bytes(const ParallelWorkload& w);
double transformer_head_activation_bytes(const ParallelWorkload& w);

// Executed matrix-product FLOPs of one sequence on all t ranks, forward + backward +
// recomputation (what "achieved TFLOP/s per GPU" counts in the Megatron-LM paper: 4x the
// layers' forward with full recomputation, 3x without; 3x for the head), plus the fused
// attention backward's recomputed Q K^T (2 S^2 H per layer).
double transformer_hardware_flops_per_sequence(const ParallelWorkload& w);

}  // namespace pf::sim
