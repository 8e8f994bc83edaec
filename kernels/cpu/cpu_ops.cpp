#include "kernels/cpu/cpu_ops.h"

#include <stdexcept>
#include <string>

namespace pf::kernels {

std::string_view to_string(GemmPrecision precision) {
  switch (precision) {
    case GemmPrecision::kFp32:
      return "fp32";
    case GemmPrecision::kTf32:
      return "tf32";
    case GemmPrecision::kBf16:
      return "bf16";
    case GemmPrecision::kBf16Operands:
      return "bf16-operands";
  }
  return "?";
}

GemmPrecision parse_gemm_precision(std::string_view text) {
  if (text == "fp32") return GemmPrecision::kFp32;
  if (text == "tf32") return GemmPrecision::kTf32;
  if (text == "bf16") return GemmPrecision::kBf16;
  if (text == "bf16-operands") return GemmPrecision::kBf16Operands;
  throw std::invalid_argument("precision '" + std::string(text) +
                              "' is not one of fp32, tf32, bf16, bf16-operands");
}

std::string_view to_string(AttentionAlgorithm algorithm) {
  return algorithm == AttentionAlgorithm::kFused ? "fused" : "batched";
}

AttentionAlgorithm parse_attention_algorithm(std::string_view text) {
  if (text == "batched") return AttentionAlgorithm::kBatchedGemm;
  if (text == "fused") return AttentionAlgorithm::kFused;
  throw std::invalid_argument("attention '" + std::string(text) + "' is not one of batched, fused");
}

template class CpuOps<float>;
template class CpuOps<double>;

}  // namespace pf::kernels
