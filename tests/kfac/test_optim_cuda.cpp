// The fused CUDA optimizers (runtime/optim/cuda) against the CPU optimizers over several steps:
// AdamW, LAMB (clipping on, norm computed and given), momentum and Nesterov SGD, tensors with
// and without weight decay, sizes across chunk boundaries. Skipped without a CUDA device.
#include <gtest/gtest.h>

#include <vector>

#include "runtime/optim/adamw.h"
#include "runtime/optim/cuda/fused_optimizers.h"
#include "runtime/optim/lamb.h"
#include "runtime/optim/sgd.h"
#include "tests/kernels/cuda_test_util.h"

namespace pf::optim::cuda {
namespace {

using pf::testing::expect_close;

class CudaOptimTest : public pf::testing::CudaTest {
 protected:
  struct Params {
    std::vector<std::vector<float>> values, grads;
    std::vector<ParamView> views;
  };
  // Three tensors: a weight spanning several chunks, an odd-sized one, a bias without decay.
  Params make(bool on_device) {
    Params p;
    const std::size_t sizes[] = {40000, 333, 17};
    std::mt19937 rng(3);
    for (std::size_t i = 0; i < 3; ++i) {
      std::normal_distribution<float> normal(0.0F, 1.0F);
      std::vector<float> v(sizes[i]), g(sizes[i]);
      for (auto& x : v) x = normal(rng);
      for (auto& x : g) x = 3.0F * normal(rng);
      p.values.push_back(v);
      p.grads.push_back(g);
    }
    for (std::size_t i = 0; i < 3; ++i) {
      float* value = on_device ? upload(p.values[i]) : p.values[i].data();
      float* grad = on_device ? upload(p.grads[i]) : p.grads[i].data();
      p.views.push_back({"p" + std::to_string(i),
                         value,
                         grad,
                         sizes[i],
                         {static_cast<std::int64_t>(sizes[i])},
                         i == 2});
    }
    return p;
  }
  void expect_same(const Params& gpu, const Params& cpu, const std::string& what) {
    for (std::size_t i = 0; i < 3; ++i) {
      expect_close(download(gpu.views[i].value, gpu.views[i].size), cpu.values[i], 2e-6,
                   what + " tensor " + std::to_string(i));
    }
  }
};

TEST_F(CudaOptimTest, AdamWMatchesTheCpu) {
  auto cpu = make(false);
  auto gpu = make(true);
  AdamW reference({.weight_decay = 0.1});
  CudaAdamW fused(*backend_, nullptr, {.weight_decay = 0.1});
  for (int step = 0; step < 3; ++step) {
    reference.step(cpu.views, 1e-2F);
    fused.step(gpu.views, 1e-2F);
  }
  EXPECT_EQ(fused.steps_taken(), 3);
  expect_same(gpu, cpu, "AdamW");
}

TEST_F(CudaOptimTest, LambMatchesTheCpuWithClippingAndAGivenNorm) {
  auto cpu = make(false);
  auto gpu = make(true);
  Lamb reference({.weight_decay = 0.01, .max_grad_norm = 1.0});
  CudaLamb fused(*backend_, nullptr, {.weight_decay = 0.01, .max_grad_norm = 1.0});
  for (int step = 0; step < 3; ++step) {
    const std::optional<double> norm =
        step == 2 ? std::optional<double>(123.0) : std::nullopt;  // as a pipeline worker passes
    reference.step(cpu.views, 1e-2F, norm);
    fused.step(gpu.views, 1e-2F, norm);
    EXPECT_NEAR(fused.last_grad_norm(), reference.last_grad_norm(),
                1e-6 * reference.last_grad_norm());
    const auto ratios = fused.last_trust_ratios();
    ASSERT_EQ(ratios.size(), reference.last_trust_ratios().size());
    for (std::size_t i = 0; i < ratios.size(); ++i) {
      EXPECT_NEAR(ratios[i], reference.last_trust_ratios()[i], 1e-5 * ratios[i]) << i;
    }
  }
  expect_same(gpu, cpu, "LAMB");
  EXPECT_THROW(fused.step(gpu.views, 1e-2F, std::numeric_limits<double>::infinity()),
               std::runtime_error);
}

TEST_F(CudaOptimTest, SgdMomentumAndNesterovMatchTheCpu) {
  for (const bool nesterov : {false, true}) {
    auto cpu = make(false);
    auto gpu = make(true);
    const SgdOptions options{.momentum = 0.9, .weight_decay = 1e-3, .nesterov = nesterov};
    Sgd reference(options);
    CudaSgd fused(*backend_, nullptr, options);
    for (int step = 0; step < 3; ++step) {
      reference.step(cpu.views, 0.05F);
      fused.step(gpu.views, 0.05F);
    }
    expect_same(gpu, cpu, nesterov ? "SGD nesterov" : "SGD");
  }
}

TEST_F(CudaOptimTest, AChangedParameterListIsRejected) {
  auto gpu = make(true);
  CudaAdamW fused(*backend_, nullptr);
  fused.step(gpu.views, 1e-3F);
  auto fewer = gpu.views;
  fewer.pop_back();
  EXPECT_THROW(fused.step(fewer, 1e-3F), std::invalid_argument);
  auto renamed = gpu.views;
  renamed[1].name = "other";
  EXPECT_THROW(fused.step(renamed, 1e-3F), std::invalid_argument);
}

}  // namespace
}  // namespace pf::optim::cuda
