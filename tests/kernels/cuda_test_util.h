#pragma once
// Helpers of the CUDA-vs-CPU tests: device copies of host vectors, and a closeness check
// normalised by the reference's scale. Skips the test where no CUDA device exists.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/cuda/cuda_backend.h"
#include "runtime/tensor/tensor.h"

namespace pf::testing {

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (kernels::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
    backend_ = std::make_unique<kernels::cuda::CudaBackend>(0);
  }

  // A device copy of `values` (kept alive by the fixture).
  template <typename T>
  T* upload(const std::vector<T>& values) {
    auto stored = tensor::Tensor::empty(
        *backend_, {static_cast<std::int64_t>(std::max<std::size_t>(values.size(), 1))},
        tensor::dtype_of<T>);
    backend_->copy(stored.raw_data(), values.data(), values.size() * sizeof(T),
                   tensor::CopyKind::kHostToDevice);
    tensors_.push_back(stored);
    return stored.template data<T>();
  }
  template <typename T>
  std::vector<T> download(const T* device, std::size_t count) {
    backend_->synchronize();
    std::vector<T> values(count);
    backend_->copy(values.data(), device, count * sizeof(T), tensor::CopyKind::kDeviceToHost);
    backend_->synchronize();
    return values;
  }

  std::vector<float> random(std::size_t count, float scale = 1.0F) {
    std::normal_distribution<float> normal(0.0F, scale);
    std::vector<float> values(count);
    for (auto& v : values) v = normal(rng_);
    return values;
  }

  std::unique_ptr<kernels::cuda::CudaBackend> backend_;
  std::vector<tensor::Tensor> tensors_;
  std::mt19937 rng_{7};
};

// max |actual - expected| <= tolerance * max(1e-30, max |expected|), reported with the worst
// element.
inline void expect_close(const std::vector<float>& actual, const std::vector<float>& expected,
                         double tolerance, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  double scale = 0.0;
  for (const float e : expected) scale = std::max(scale, std::abs(static_cast<double>(e)));
  scale = std::max(scale, 1e-30);
  double worst = 0.0;
  std::size_t worst_index = 0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double error = std::abs(static_cast<double>(actual[i]) - expected[i]);
    if (!(error <= worst)) {
      worst = error;
      worst_index = i;
    }
  }
  EXPECT_LE(worst, tolerance * scale)
      << what << ": element " << worst_index << " is " << actual[worst_index] << ", expected "
      << expected[worst_index] << " (scale " << scale << ")";
}

// Normalised mean squared error sum (a - e)^2 / sum e^2 (ggml's backend tests use it).
inline double nmse(const std::vector<float>& actual, const std::vector<float>& expected) {
  double error = 0.0;
  double norm = 0.0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double d = static_cast<double>(actual[i]) - expected[i];
    error += d * d;
    norm += static_cast<double>(expected[i]) * expected[i];
  }
  return norm == 0.0 ? error : error / norm;
}

}  // namespace pf::testing
