// The ops interface on the CPU: make_ops gives CpuOps for a CPU backend, and a call through the
// interface is the free op of kernels/ops.h.
#include <span>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/backend_ops.h"
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
  for (const auto p : {GemmPrecision::kFp32, GemmPrecision::kTf32, GemmPrecision::kBf16}) {
    EXPECT_EQ(parse_gemm_precision(to_string(p)), p);
  }
  EXPECT_THROW(parse_gemm_precision("fp16"), std::invalid_argument);
}

}  // namespace
}  // namespace pf::kernels
