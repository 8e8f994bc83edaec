#include "sim/attention_kernels.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace pf::sim {
namespace {

Kernel core_product(const AttentionShape& s, double flops, double bytes) {
  Kernel kernel;
  kernel.op_class = OpClass::kAttention;
  kernel.precision = fused_attention_precision(s.precision, s.head_dim);
  kernel.flops = flops;
  kernel.bytes = bytes;
  kernel.size = s.product_size;
  kernel.mean_size = s.product_mean_size;
  return kernel;
}

}  // namespace

std::string_view to_string(AttentionAlgorithm algorithm) {
  return algorithm == AttentionAlgorithm::kFused ? "fused" : "batched";
}

AttentionAlgorithm attention_from_string(std::string_view name) {
  if (name == "batched") return AttentionAlgorithm::kBatched;
  if (name == "fused") return AttentionAlgorithm::kFused;
  throw std::invalid_argument("--attention '" + std::string(name) +
                              "' is not one of batched, fused");
}

Precision fused_attention_precision(Precision products, double head_dim) {
  if (products == Precision::kFp32 || head_dim > kFusedAttentionTensorCoreMaxHeadDim) {
    return Precision::kFp32;
  }
  return Precision::kTf32;
}

void check_fused_attention_head(double head_dim) {
  if (head_dim > kFusedAttentionMaxHeadDim) {
    throw std::invalid_argument("--attention fused: the fused attention takes head_dim <= " +
                                std::to_string(kFusedAttentionMaxHeadDim) + ", the model has " +
                                std::to_string(static_cast<long>(head_dim)) +
                                " (use --attention batched)");
  }
}

void check_fused_attention_device(const DeviceSpec& device, AttentionAlgorithm algorithm,
                                  Precision products, double head_dim) {
  if (algorithm != AttentionAlgorithm::kFused) return;
  const Precision fused = fused_attention_precision(products, head_dim);
  try {
    (void)device.peak_flops(fused);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("--attention fused runs its products in " +
                                std::string(to_string(fused)) + " under " +
                                std::string(to_string(products)) + ": " + e.what());
  }
}

AttentionCoreKernels fused_attention_kernels(const AttentionShape& s) {
  const double T = s.batch * s.seq, e = s.element_bytes;
  const double q_width = s.heads * s.head_dim, kv_width = s.kv_heads * s.head_dim;
  // One product over all (sequence, head) pairs: 2 S^2 d FLOPs per pair.
  const double product = 2.0 * s.batch * s.heads * s.seq * s.seq * s.head_dim;
  const double rows = s.batch * s.heads * s.seq;  // query rows: one fp32 lse / row sum each
  const double qkv = e * T * (q_width + 2.0 * kv_width);
  const double key_blocks = std::ceil(s.seq / kFusedAttentionTile);
  const double dq_partials = 4.0 * key_blocks * T * q_width;  // fp32 workspace
  AttentionCoreKernels k;
  // Forward: Q K^T and dropout(P) V with the online softmax; writes O and the lse.
  k.forward.push_back(core_product(s, 2.0 * product, qkv + e * T * q_width + 4.0 * rows));
  // Backward: rowsum(dO * O) (a warp per row), the key-block kernel, the ordered dQ sum.
  k.backward.push_back(elementwise_kernel(2.0 * e * T * q_width + 4.0 * rows,
                                          per_element(T * q_width, {.flops = 2})));
  k.backward.push_back(core_product(
      s, 5.0 * product,
      qkv + e * T * q_width + 2.0 * 4.0 * rows + 2.0 * e * T * kv_width + dq_partials));
  k.backward.push_back(elementwise_kernel(dq_partials + e * T * q_width,
                                          per_element(key_blocks * T * q_width, {.flops = 1})));
  return k;
}

double fused_attention_saved_bytes(const AttentionShape& s) {
  return 4.0 * s.batch * s.heads * s.seq;
}

}  // namespace pf::sim
