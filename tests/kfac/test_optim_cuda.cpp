// The fused CUDA optimizers (runtime/optim/cuda) against the CPU optimizers over several steps:
// AdamW, LAMB (clipping on, norm computed and given), momentum and Nesterov SGD, tensors with
// and without weight decay, sizes across chunk boundaries; checkpoint state that crosses between
// the devices. Skipped without a CUDA device.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
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
  // A device copy of host parameters (their current values and gradients).
  Params on_device(const Params& host) {
    Params p = host;
    for (std::size_t i = 0; i < p.views.size(); ++i) {
      p.views[i].value = upload(host.values[i]);
      p.views[i].grad = upload(host.grads[i]);
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

// The fused optimizers' state_bytes: the state buffers allocated for each tensor (two for AdamW
// and LAMB, one for SGD), none before the first step binds the list.
TEST_F(CudaOptimTest, StateBytesAreTheStateBuffersOfEachTensor) {
  auto gpu = make(true);
  CudaAdamW adamw(*backend_, nullptr);
  CudaSgd sgd(*backend_, nullptr, SgdOptions{.momentum = 0.9});
  EXPECT_EQ(adamw.state_bytes("p0"), 0);
  adamw.step(gpu.views, 1e-3F);
  sgd.step(gpu.views, 1e-3F);
  EXPECT_EQ(adamw.state_bytes("p0"), 2 * 40000 * 4);
  EXPECT_EQ(adamw.state_bytes("p2"), 2 * 17 * 4);
  EXPECT_EQ(sgd.state_bytes("p1"), 333 * 4);
  EXPECT_EQ(sgd.state_bytes("other"), 0);
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

std::vector<float> record_floats(const ckpt::TensorRecord& record) {
  std::vector<float> values(record.data.size() / sizeof(float));
  std::memcpy(values.data(), record.data.data(), values.size() * sizeof(float));
  return values;
}

// After two steps the GPU's records are the CPU's (names, order, shapes, dtype; values close);
// the CPU's records loaded into a fresh GPU optimizer continue as the CPU run does.
TEST_F(CudaOptimTest, CheckpointStateCrossesDevices) {
  for (int kind = 0; kind < 3; ++kind) {
    const auto make_optimizer = [&](bool gpu) -> std::unique_ptr<Optimizer> {
      const SgdOptions sgd{.momentum = 0.9, .weight_decay = 1e-3};
      if (kind == 0) {
        if (gpu) return std::make_unique<CudaAdamW>(*backend_, nullptr, AdamWOptions{});
        return std::make_unique<AdamW>();
      }
      if (kind == 1) {
        if (gpu) return std::make_unique<CudaLamb>(*backend_, nullptr, LambOptions{});
        return std::make_unique<Lamb>();
      }
      if (gpu) return std::make_unique<CudaSgd>(*backend_, nullptr, sgd);
      return std::make_unique<Sgd>(sgd);
    };
    auto cpu = make_optimizer(false);
    auto gpu = make_optimizer(true);
    auto cpu_params = make(false);
    auto gpu_params = make(true);
    for (int step = 0; step < 2; ++step) {
      cpu->step(cpu_params.views, 1e-2F);
      gpu->step(gpu_params.views, 1e-2F);
    }
    const auto expected = cpu->state_records("opt");
    const auto actual = gpu->state_records("opt");
    EXPECT_EQ(gpu->name(), cpu->name());
    ASSERT_EQ(actual.size(), expected.size()) << cpu->name();
    for (std::size_t i = 0; i < actual.size(); ++i) {
      EXPECT_EQ(actual[i].name, expected[i].name);
      EXPECT_EQ(actual[i].shape, expected[i].shape) << expected[i].name;
      ASSERT_EQ(actual[i].dtype, expected[i].dtype) << expected[i].name;
      if (expected[i].dtype == ckpt::DType::kF32) {
        expect_close(record_floats(actual[i]), record_floats(expected[i]), 2e-6, expected[i].name);
      } else {
        EXPECT_EQ(actual[i].data, expected[i].data) << expected[i].name;  // the step count
      }
    }
    const auto file = ckpt::parse_safetensors(ckpt::serialize_safetensors(expected, {}), "cpu");
    auto resumed = make_optimizer(true);
    auto resumed_params = on_device(cpu_params);
    resumed->load_state(file, resumed_params.views, "opt");
    EXPECT_EQ(resumed->steps_taken(), 2);
    cpu->step(cpu_params.views, 1e-2F);
    resumed->step(resumed_params.views, 1e-2F);
    expect_same(resumed_params, cpu_params, std::string(cpu->name()) + " resumed from the CPU");
  }
}

}  // namespace
}  // namespace pf::optim::cuda
