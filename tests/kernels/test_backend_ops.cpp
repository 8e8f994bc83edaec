// The ops interface on the CPU: make_ops gives CpuOps for a CPU backend, and a call through the
// interface is the free op of kernels/ops.h. Also the precision names and the host bf16
// rounding (the reference of the GPU's bf16-operand products).
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/backend_ops.h"
#include "kernels/bfloat16.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/make_ops.h"
#include "runtime/tensor/cpu_backend.h"

namespace pf::kernels {
namespace {

TEST(BackendOps, MakeOpsGivesCpuOpsForTheCpuBackend) {
  tensor::CpuBackend backend;
  auto ops = make_ops<double>(backend);
  EXPECT_EQ(ops->device(), (tensor::Device{tensor::DeviceKind::kCpu, 0}));
  EXPECT_NE(dynamic_cast<CpuOps<double>*>(ops.get()), nullptr);
  std::vector<double> a = {1, 2, 3, 4}, b = {5, 6, 7, 8}, c(4), expected(4);
  ops->gemm({a.data(), 2, 2}, Transpose::kNo, {b.data(), 2, 2}, Transpose::kYes, {c.data(), 2, 2});
  gemm<double>({a.data(), 2, 2}, Transpose::kNo, {b.data(), 2, 2}, Transpose::kYes,
               {expected.data(), 2, 2});
  EXPECT_EQ(c, expected);
  EXPECT_EQ(c[0], 1 * 5 + 2 * 6);
  EXPECT_DOUBLE_EQ(ops->sum_of_squares(a.data(), 4), 30.0);
}

// The global gradient norm's sum: every array's squares in double, in order (the executor's
// CPU path's sum, bit for bit), empty arrays and no arrays included.
TEST(BackendOps, SumOfSquaresTotalAddsEveryArrayInDouble) {
  CpuOps<float> ops;
  const std::vector<float> a = {0.1F, -0.2F, 3.0F}, b = {}, c = {1e-4F, 7.5F};
  double expected = 0.0;
  for (const auto* array : {&a, &b, &c}) {
    for (const float v : *array) expected += static_cast<double>(v) * static_cast<double>(v);
  }
  const std::vector<std::span<const float>> arrays = {a, b, c};
  EXPECT_EQ(ops.sum_of_squares_total(arrays), expected);
  EXPECT_EQ(ops.sum_of_squares_total({}), 0.0);
}

TEST(BackendOps, PrecisionNamesRoundTripAndBadNamesThrow) {
  for (const auto p : {GemmPrecision::kFp32, GemmPrecision::kTf32, GemmPrecision::kBf16,
                       GemmPrecision::kBf16Operands}) {
    EXPECT_EQ(parse_gemm_precision(to_string(p)), p);
  }
  EXPECT_EQ(parse_gemm_precision("bf16-operands"), GemmPrecision::kBf16Operands);
  EXPECT_THROW(parse_gemm_precision("fp16"), std::invalid_argument);
  EXPECT_THROW(parse_gemm_precision("bf16_operands"), std::invalid_argument);
}

TEST(BackendOps, AttentionAlgorithmNamesRoundTripAndTheCpuHasBatchedOnly) {
  for (const auto a : {AttentionAlgorithm::kBatchedGemm, AttentionAlgorithm::kFused}) {
    EXPECT_EQ(parse_attention_algorithm(to_string(a)), a);
  }
  EXPECT_EQ(parse_attention_algorithm("batched"), AttentionAlgorithm::kBatchedGemm);
  EXPECT_THROW(parse_attention_algorithm("flash"), std::invalid_argument);
  tensor::CpuBackend cpu;
  EXPECT_NO_THROW(
      make_ops<float>(cpu, nullptr, GemmPrecision::kFp32, AttentionAlgorithm::kBatchedGemm));
  EXPECT_THROW(make_ops<float>(cpu, nullptr, GemmPrecision::kFp32, AttentionAlgorithm::kFused),
               std::invalid_argument);
  // The CPU saves the probabilities.
  CpuOps<float> ops;
  const AttentionShape shape{2, 5, 3, 4};
  EXPECT_EQ(ops.attention_saved_size(shape), attention_probs_size(shape));
}

// The host rounding is the reference of the GPU's bf16-operand products, so it must be
// __float2bfloat16_rn's: nearest, ties to even, NaN kept, overflow to infinity.
TEST(Bfloat16, RoundsToNearestWithTiesToEven) {
  const auto from_bits = [](std::uint32_t bits) { return std::bit_cast<float>(bits); };
  const float unit = std::ldexp(1.0F, -7);  // bf16's spacing in [1, 2)
  EXPECT_EQ(round_to_bf16(1.0F), 1.0F);
  EXPECT_EQ(round_to_bf16(-2.5F), -2.5F);
  EXPECT_EQ(round_to_bf16(0.0F), 0.0F);
  EXPECT_TRUE(std::signbit(round_to_bf16(-0.0F)));
  // Below, at and above half a unit over 1 (even mantissa 0): down, down (tie to even), up.
  EXPECT_EQ(round_to_bf16(1.0F + 0.5F * unit - std::ldexp(1.0F, -20)), 1.0F);
  EXPECT_EQ(round_to_bf16(1.0F + 0.5F * unit), 1.0F);
  EXPECT_EQ(round_to_bf16(1.0F + 0.5F * unit + std::ldexp(1.0F, -20)), 1.0F + unit);
  // A tie over an odd mantissa (1 + unit) rounds up to the even one; negative alike.
  EXPECT_EQ(round_to_bf16(1.0F + 1.5F * unit), 1.0F + 2.0F * unit);
  EXPECT_EQ(round_to_bf16(-(1.0F + 1.5F * unit)), -(1.0F + 2.0F * unit));
  // Truncation would keep 1 + unit here; nearest is 1 + 2 units.
  EXPECT_EQ(round_to_bf16(1.0F + 1.75F * unit), 1.0F + 2.0F * unit);
  // A carry out of the mantissa moves to the next binade.
  EXPECT_EQ(round_to_bf16(from_bits(0x3FFFFFFFU)), 2.0F);
  // Past the largest bf16 (0x7F7F) by at least half a unit: infinity.
  EXPECT_EQ(round_to_bf16(std::numeric_limits<float>::max()),
            std::numeric_limits<float>::infinity());
  EXPECT_EQ(round_to_bf16(from_bits(0x7F7F0000U)), from_bits(0x7F7F0000U));
  EXPECT_EQ(round_to_bf16(-std::numeric_limits<float>::infinity()),
            -std::numeric_limits<float>::infinity());
  // Subnormals round like the rest (the smallest bf16 subnormal is 2^-133).
  EXPECT_EQ(round_to_bf16(from_bits(0x00010000U)), from_bits(0x00010000U));
  EXPECT_EQ(round_to_bf16(from_bits(0x00008000U)), 0.0F);                    // tie to even (zero)
  EXPECT_EQ(round_to_bf16(from_bits(0x00018000U)), from_bits(0x00020000U));  // tie to even
  // NaN stays NaN, also one whose payload lies only in the discarded bits.
  EXPECT_TRUE(std::isnan(round_to_bf16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(std::isnan(round_to_bf16(from_bits(0x7F800001U))));
  EXPECT_TRUE(std::isnan(round_to_bf16(from_bits(0xFFFFFFFFU))));
  // Every result is a bf16: its low 16 bits are zero, and rounding again changes nothing.
  for (const float x : {0.1F, -3.14159F, 1e-30F, 6.5e4F, 123456.789F}) {
    const float rounded = round_to_bf16(x);
    EXPECT_EQ(std::bit_cast<std::uint32_t>(rounded) & 0xFFFFU, 0U) << x;
    EXPECT_EQ(round_to_bf16(rounded), rounded) << x;
    EXPECT_LE(std::abs(rounded - x), std::ldexp(std::abs(x), -8)) << x;  // half a unit
  }
  EXPECT_EQ(bf16_bits_nearest_even(1.0F), 0x3F80U);
  EXPECT_EQ(bf16_bits_to_float(0xC040U), -3.0F);
}

}  // namespace
}  // namespace pf::kernels
