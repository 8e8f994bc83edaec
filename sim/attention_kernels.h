#pragma once
// The attention core's algorithm and the kernels of the fused one. pipefisher_train runs the
// attention core (Q K^T, masked softmax, dropout, probabilities x V and their gradients) either as
// batched products with the [b, heads, S, S] scores in memory (`--attention batched`, the
// default) or as this project's flash-style kernel (`--attention fused`,
// kernels/cuda/flash_attention.cu, cuda only), which keeps no [S, S] matrix in global memory
// and saves one log-sum-exp per query row. The simulator prices the one the run uses: the
// batched core stays in the kernel lists of bert_kernels.cpp and transformer_kernels.cpp, the
// fused core is built here from what flash_attention.cu launches. docs/simulator.md has the
// formulas and the reasoning.
#include <string_view>

#include "sim/kernel_costs.h"

namespace pf::sim {

enum class AttentionAlgorithm : std::uint8_t { kBatched, kFused };
std::string_view to_string(AttentionAlgorithm algorithm);  // "batched", "fused"
// "batched" or "fused" (pipefisher_train's --attention names); throws std::invalid_argument
// naming the allowed values.
AttentionAlgorithm attention_from_string(std::string_view name);

// flash_attention.cu's tiles (64 query and key rows) and its largest head (it throws beyond).
inline constexpr int kFusedAttentionTile = 64;
inline constexpr int kFusedAttentionMaxHeadDim = 128;
// Whether the fused kernel's products run on TF32 tensor cores (WMMA): under every precision but
// fp32, for heads of at most 64 (the rest runs fp32 FMA on the SIMT cores).
inline constexpr int kFusedAttentionTensorCoreMaxHeadDim = 64;

// The attention core of one micro-batch on one rank: b sequences of S tokens, `heads` query
// heads of head_dim (T = b S tokens), kv_heads key / value heads, e bytes per stored element.
struct AttentionShape {
  double batch = 1.0;
  double seq = 1.0;
  double heads = 1.0;
  double kv_heads = 1.0;
  double head_dim = 1.0;
  double element_bytes = 4.0;
  Precision precision = Precision::kFp32;  // the run's product precision
  // Kernel::size of the core's product kernels (the shape factor's dimension; 0: none), as the
  // caller's batched products use it, so that both algorithms meet the same efficiency curve.
  double product_size = 0.0;
  // Kernel::mean_size of the same products (their harmonic mean dimension; 0: none).
  double product_mean_size = 0.0;
};

// The arithmetic of the fused kernel's products: TF32 under tf32, bf16 and fp16 with
// head_dim <= 64 (WMMA, docs/cuda.md: "TF32 is what bf16 gets for now"), fp32 otherwise.
Precision fused_attention_precision(Precision products, double head_dim);

// Throws std::invalid_argument when flash_attention.cu cannot run the head (head_dim > 128).
void check_fused_attention_head(double head_dim);
// With the fused algorithm: throws std::invalid_argument when the device lacks the precision its
// products run in (fused_attention_precision: tf32 under bf16 on a device without tf32).
void check_fused_attention_device(const DeviceSpec& device, AttentionAlgorithm algorithm,
                                  Precision products, double head_dim);

// The fused core's kernels, in launch order. FLOPs count the products only (2 x rows x cols x
// inner each, over b heads_q pairs; the exp, mask and dropout inside the kernels ride along), and
// bytes the tensors that reach global memory:
// forward (1 kernel, attention class): Q K^T and P V, 4 b h S^2 d FLOPs; reads Q, K, V, writes O
//   and the fp32 log-sum-exps (4 b h S bytes);
// backward (3 kernels): rowsum(dO * O) per query row (memory class: reads O and dO, writes 4 b h S
//   bytes); the key-block kernel (attention class: recomputes Q K^T, then dO V^T, dV, dK and its
//   share of dQ, 10 b h S^2 d FLOPs; reads Q, K, V, dO, the log-sum-exps and row sums, writes dK,
//   dV and ceil(S / 64) fp32 partial dQs); the dQ sum (memory class: reads the partials in
//   key-block order, writes dQ).
struct AttentionCoreKernels {
  Kernels forward;
  Kernels backward;
};
AttentionCoreKernels fused_attention_kernels(const AttentionShape& shape);

// What the fused forward saves for the backward beyond Q, K, V and O: one fp32 log-sum-exp per
// query row, 4 b h S bytes (the batched core keeps the probabilities and the dropout mask).
double fused_attention_saved_bytes(const AttentionShape& shape);

}  // namespace pf::sim
