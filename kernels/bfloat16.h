#pragma once
// bfloat16 on the host: the upper 16 bits of an IEEE fp32 (sign, 8 exponent bits, 7 mantissa
// bits). The rounding is the one CUDA's __float2bfloat16_rn applies, so that a CPU product of
// operands rounded here is the reference for the GPU's bf16-operand products
// (GemmPrecision::kBf16Operands).
#include <bit>
#include <cstdint>

namespace pf::kernels {

// The bf16 nearest to x, ties to even. NaN stays NaN (quieted, sign kept); values past the
// largest bf16 round to infinity, as IEEE rounding does.
inline std::uint16_t bf16_bits_nearest_even(float x) {
  const auto bits = std::bit_cast<std::uint32_t>(x);
  if ((bits & 0x7FFFFFFFU) > 0x7F800000U) {
    // Adding the rounding bias could carry a NaN's mantissa into the exponent (or leave only
    // zero mantissa bits, an infinity): keep the upper half and set the quiet bit instead.
    return static_cast<std::uint16_t>((bits >> 16) | 0x0040U);
  }
  // Add just under half a bf16 unit, plus one when the kept part is odd: a tie then carries
  // into the kept bits exactly when they are odd (to even); carries into the exponent are the
  // correct round-up to the next binade (or to infinity).
  const std::uint32_t odd = (bits >> 16) & 1U;
  return static_cast<std::uint16_t>((bits + 0x7FFFU + odd) >> 16);
}

inline float bf16_bits_to_float(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

// x rounded to bf16 (to nearest, ties to even), as the float it represents.
inline float round_to_bf16(float x) {
  return bf16_bits_to_float(bf16_bits_nearest_even(x));
}

}  // namespace pf::kernels
