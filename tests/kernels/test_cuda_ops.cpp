// The CUDA ops against the CPU ops. Skipped where no CUDA device is present.
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/cuda/cublas_gemm.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/ops.h"
#include "runtime/tensor/tensor.h"

namespace pf::kernels::cuda {
namespace {

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
    backend_ = std::make_unique<CudaBackend>(0);
  }

  tensor::Tensor upload(const std::vector<float>& values, std::int64_t rows, std::int64_t cols) {
    auto t = tensor::Tensor::empty(*backend_, {rows, cols}, tensor::DType::kF32);
    backend_->copy(t.raw_data(), values.data(), values.size() * sizeof(float),
                   tensor::CopyKind::kHostToDevice);
    return t;
  }
  std::vector<float> download(const tensor::Tensor& t) {
    std::vector<float> values(static_cast<std::size_t>(t.numel()));
    backend_->copy(values.data(), t.raw_data(), t.nbytes(), tensor::CopyKind::kDeviceToHost);
    backend_->synchronize();
    return values;
  }
  static MatrixView<float> view(tensor::Tensor& t) {
    return {t.data<float>(), t.size(0), t.size(1)};
  }
  std::vector<float> random(std::size_t count) {
    std::normal_distribution<float> normal(0.0F, 2.0F);
    std::vector<float> values(count);
    for (auto& v : values) v = normal(rng_);
    return values;
  }

  std::unique_ptr<CudaBackend> backend_;
  std::mt19937 rng_{1};
};

TEST_F(CudaOps, BiasGeluMatchesCpu) {
  const std::int64_t rows = 37, cols = 129;
  auto x = random(static_cast<std::size_t>(rows * cols));
  auto bias = random(static_cast<std::size_t>(cols));
  auto dy = random(x.size());
  auto dx_device = upload(x, rows, cols), y_device = upload(x, rows, cols);
  auto bias_device = upload(bias, 1, cols), dy_device = upload(dy, rows, cols);
  auto x_device = upload(x, rows, cols);
  CudaStream stream;
  bias_gelu_forward(view(x_device), bias_device.data<float>(), view(y_device), stream.get());
  gelu_backward(view(x_device), view(dy_device), view(dx_device), stream.get());
  stream.synchronize();
  std::vector<float> y(x.size()), dx(x.size());
  kernels::bias_gelu_forward<float>({x.data(), rows, cols}, bias.data(), {y.data(), rows, cols});
  kernels::gelu_backward<float>({x.data(), rows, cols}, {dy.data(), rows, cols},
                                {dx.data(), rows, cols});
  const auto y_gpu = download(y_device), dx_gpu = download(dx_device), x_gpu = download(x_device);
  for (std::size_t i = 0; i < x.size(); ++i) {
    ASSERT_FLOAT_EQ(x_gpu[i], x[i]);  // the pre-activation kept in place
    ASSERT_NEAR(y_gpu[i], y[i], 1e-5F * (1 + std::abs(y[i])));
    ASSERT_NEAR(dx_gpu[i], dx[i], 1e-5F * (1 + std::abs(dx[i])));
  }
}

TEST_F(CudaOps, DropoutMaskIsBitIdenticalToCpu) {
  const std::int64_t rows = 64, cols = 100;
  auto x = random(static_cast<std::size_t>(rows * cols));
  auto x_device = upload(x, rows, cols), y_device = upload(x, rows, cols);
  dropout_forward(view(x_device), view(y_device), 0.1F, 1234, 77, nullptr);
  std::vector<float> y(x.size());
  kernels::dropout_forward<float>({x.data(), rows, cols}, {y.data(), rows, cols}, 0.1F, 1234, 77);
  EXPECT_EQ(download(y_device), y);
}

TEST_F(CudaOps, CublasGemmMatchesCpu) {
  const std::int64_t m = 33, k = 65, n = 17;
  auto a = random(static_cast<std::size_t>(k * m));  // stored transposed: [k, m]
  auto b = random(static_cast<std::size_t>(n * k));  // stored transposed: [n, k]
  auto a_device = upload(a, k, m), b_device = upload(b, n, k);
  auto c_device = tensor::Tensor::zeros(*backend_, {m, n}, tensor::DType::kF32);
  CublasHandle handle;
  gemm(handle, view(a_device), Transpose::kYes, view(b_device), Transpose::kYes, view(c_device));
  std::vector<float> c(static_cast<std::size_t>(m * n));
  kernels::gemm<float>({a.data(), k, m}, Transpose::kYes, {b.data(), n, k}, Transpose::kYes,
                       {c.data(), m, n});
  const auto c_gpu = download(c_device);
  for (std::size_t i = 0; i < c.size(); ++i) ASSERT_NEAR(c_gpu[i], c[i], 1e-3F);
}

TEST_F(CudaOps, StreamsAndEventsOrderWork) {
  auto stream = backend_->create_stream();
  auto event = backend_->create_event();
  std::vector<float> host(1 << 20, 3.0F), back(host.size());
  auto device = tensor::Tensor::empty(*backend_, {static_cast<std::int64_t>(host.size())},
                                      tensor::DType::kF32);
  backend_->copy(device.raw_data(), host.data(), device.nbytes(), tensor::CopyKind::kHostToDevice,
                 stream.get());
  event->record(*stream);
  auto other = backend_->create_stream();
  other->wait(*event);
  backend_->copy(back.data(), device.raw_data(), device.nbytes(), tensor::CopyKind::kDeviceToHost,
                 other.get());
  other->synchronize();
  EXPECT_TRUE(event->completed());
  EXPECT_EQ(back, host);
}

}  // namespace
}  // namespace pf::kernels::cuda
