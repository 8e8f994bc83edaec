// The optimizers in float and double: float results bit-identical to the float-only code they
// replaced, double results against straightforward double references written out here, a global
// gradient norm supplied by the caller (a pipeline worker steps only its own tensors), and
// optimizer state in F32 / F64.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/optim/adamw.h"
#include "runtime/optim/lamb.h"
#include "runtime/optim/sgd.h"

namespace pf::optim {
namespace {

// Deterministic values in [-1000, 1000] from integer arithmetic only, so the inputs do not depend
// on compiler flags or libm.
template <typename T>
T tick(std::size_t i, std::size_t multiplier, std::size_t offset) {
  return static_cast<T>(static_cast<int>((i * multiplier + offset) % 2001) - 1000);
}

// A 100000-element decayed weight (takes the OpenMP path) and a 5000-element undecayed bias
// (inline path), three steps with fresh gradients and learning rates 0.1, 0.05, 0.02.
template <typename T>
struct Model {
  static constexpr std::size_t kWeight = 100000, kBias = 5000;
  std::vector<T> w = std::vector<T>(kWeight), b = std::vector<T>(kBias);
  std::vector<T> gw = std::vector<T>(kWeight), gb = std::vector<T>(kBias);
  Model() {
    for (std::size_t i = 0; i < kWeight; ++i) w[i] = tick<T>(i, 7919, 0) * static_cast<T>(1e-3);
    for (std::size_t i = 0; i < kBias; ++i) b[i] = tick<T>(i, 613, 5) * static_cast<T>(1e-5);
  }
  void set_grads(std::size_t step) {
    for (std::size_t i = 0; i < kWeight; ++i) {
      gw[i] = tick<T>(i, 104729, 31 * step) * static_cast<T>(1e-6);
    }
    for (std::size_t i = 0; i < kBias; ++i)
      gb[i] = tick<T>(i, 1301, 17 * step) * static_cast<T>(2e-6);
  }
  std::vector<BasicParamView<T>> views() {
    return {BasicParamView<T>{"w", w.data(), gw.data(), kWeight, {100, 1000}, false},
            BasicParamView<T>{"b", b.data(), gb.data(), kBias, {5000}, true}};
  }
  std::vector<T> values() const {
    std::vector<T> all = w;
    all.insert(all.end(), b.begin(), b.end());
    return all;
  }
};

template <typename T>
constexpr std::array<T, 3> kLearningRates = {static_cast<T>(0.1), static_cast<T>(0.05),
                                             static_cast<T>(0.02)};

template <typename T>
std::vector<T> run(BasicOptimizer<T>& optimizer, Model<T>& model) {
  for (std::size_t step = 0; step < 3; ++step) {
    model.set_grads(step);
    optimizer.step(model.views(), kLearningRates<T>[step]);
  }
  return model.values();
}

std::uint64_t fingerprint(const std::vector<float>& values) {  // FNV-1a over the bit patterns
  std::uint64_t hash = 1469598103934665603ULL;
  for (const float value : values) {
    std::uint32_t bits = 0;
    std::memcpy(&bits, &value, sizeof bits);
    for (int byte = 0; byte < 4; ++byte) {
      hash ^= (bits >> (8 * byte)) & 0xFFU;
      hash *= 1099511628211ULL;
    }
  }
  return hash;
}

// Fingerprints of the float-only optimizers before they became templates (commit 7601fcf), for
// the two ways GCC compiles their loops: with a*b+c contracted to FMA (-march=native on x86-64
// with FMA, the release build) and without (baseline x86-64, the sanitizer build).
TEST(FloatOptimizers, ResultsAreBitIdenticalToTheFloatOnlyCode) {
  struct Case {
    const char* name;
    std::function<std::unique_ptr<Optimizer>()> make;
    std::uint64_t with_fma, without_fma;
  };
  const std::vector<Case> cases = {
      {"adamw", [] { return std::make_unique<AdamW>(); }, 0x2e09c874c6829e46ULL,
       0x12e418f17d704a83ULL},
      {"lamb", [] { return std::make_unique<Lamb>(); }, 0xe34950d6c22a75a3ULL,
       0xf023f49db1f31618ULL},
      {"lamb clipped, trust ratio everywhere",
       [] {
         return std::make_unique<Lamb>(
             LambOptions{.max_grad_norm = 0.05F, .trust_ratio_without_decay = true});
       },
       0x73e206a8eb117c3eULL, 0x739c31490d00c517ULL},
      {"sgd momentum dampening",
       [] {
         return std::make_unique<Sgd>(
             SgdOptions{.momentum = 0.9F, .dampening = 0.1F, .weight_decay = 0.01F});
       },
       0xfe3318853929c629ULL, 0x80ea8590584cff9cULL},
      {"sgd nesterov",
       [] {
         return std::make_unique<Sgd>(
             SgdOptions{.momentum = 0.9F, .weight_decay = 0.01F, .nesterov = true});
       },
       0x0298137bcc1be569ULL, 0xc47c83a3371d1342ULL},
      {"sgd plain",
       [] { return std::make_unique<Sgd>(SgdOptions{.momentum = 0.0F, .weight_decay = 0.01F}); },
       0xa36cb4a3b8d9c6fcULL, 0x3e9be2e18c019226ULL},
  };
  for (const auto& c : cases) {
    Model<float> model;
    const auto optimizer = c.make();
    const auto print = fingerprint(run(*optimizer, model));
    EXPECT_TRUE(print == c.with_fma || print == c.without_fma)
        << c.name << ": fingerprint 0x" << std::hex << print;
  }
}

// ---- Double references, written for clarity, one element at a time ----

struct RefParam {
  std::vector<double> p, g, m, v;
  bool no_weight_decay;
};

std::vector<RefParam> reference_params(const Model<double>& model) {
  return {RefParam{model.w,
                   {},
                   std::vector<double>(model.w.size()),
                   std::vector<double>(model.w.size()),
                   false},
          RefParam{model.b,
                   {},
                   std::vector<double>(model.b.size()),
                   std::vector<double>(model.b.size()),
                   true}};
}

// Runs `update(params, lr, t)` for three steps on the same data as run<double>.
template <typename Update>
std::vector<double> run_reference(Update&& update) {
  Model<double> model;
  auto params = reference_params(model);
  for (std::size_t step = 0; step < 3; ++step) {
    model.set_grads(step);
    params[0].g = model.gw;
    params[1].g = model.gb;
    update(params, kLearningRates<double>[step], static_cast<double>(step + 1));
  }
  std::vector<double> all = params[0].p;
  all.insert(all.end(), params[1].p.begin(), params[1].p.end());
  return all;
}

void expect_close(const std::vector<double>& actual, const std::vector<double>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  double worst = 0.0;
  std::size_t worst_index = 0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double error = std::abs(actual[i] - expected[i]) / std::max(1.0, std::abs(expected[i]));
    if (error > worst) {
      worst = error;
      worst_index = i;
    }
  }
  EXPECT_LE(worst, 1e-14) << "element " << worst_index << ": " << actual[worst_index] << " vs "
                          << expected[worst_index];
}

TEST(DoubleOptimizers, AdamWMatchesTheReference) {
  const AdamWOptions options{.beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01};
  Model<double> model;
  BasicAdamW<double> adamw(options);
  const auto actual = run(adamw, model);
  const auto expected = run_reference([&](std::vector<RefParam>& params, double lr, double t) {
    for (auto& param : params) {
      for (std::size_t i = 0; i < param.p.size(); ++i) {
        if (!param.no_weight_decay) param.p[i] *= 1.0 - lr * options.weight_decay;
        param.m[i] = options.beta1 * param.m[i] + (1.0 - options.beta1) * param.g[i];
        param.v[i] = options.beta2 * param.v[i] + (1.0 - options.beta2) * param.g[i] * param.g[i];
        const double m_hat = param.m[i] / (1.0 - std::pow(options.beta1, t));
        const double v_hat = param.v[i] / (1.0 - std::pow(options.beta2, t));
        param.p[i] -= lr * m_hat / (std::sqrt(v_hat) + options.eps);
      }
    }
  });
  expect_close(actual, expected);
}

std::vector<double> lamb_reference(const LambOptions& options) {
  return run_reference([&](std::vector<RefParam>& params, double lr, double t) {
    double square_sum = 0.0;
    for (const auto& param : params) {
      for (const double g : param.g) square_sum += g * g;
    }
    const double norm = std::sqrt(square_sum);
    const double clip = norm > options.max_grad_norm ? norm / options.max_grad_norm : 1.0;
    for (auto& param : params) {
      const double wd = param.no_weight_decay ? 0.0 : options.weight_decay;
      std::vector<double> update(param.p.size());
      double p_sq = 0.0, u_sq = 0.0;
      for (std::size_t i = 0; i < param.p.size(); ++i) {
        const double g = param.g[i] / clip;
        param.m[i] = options.beta1 * param.m[i] + (1.0 - options.beta1) * g;
        param.v[i] = options.beta2 * param.v[i] + (1.0 - options.beta2) * g * g;
        const double m_hat = param.m[i] / (1.0 - std::pow(options.beta1, t));
        const double v_hat = param.v[i] / (1.0 - std::pow(options.beta2, t));
        update[i] = m_hat / (std::sqrt(v_hat) + options.eps) + wd * param.p[i];
        p_sq += param.p[i] * param.p[i];
        u_sq += update[i] * update[i];
      }
      const bool use_ratio = wd != 0.0 || options.trust_ratio_without_decay;
      const double ratio =
          use_ratio && p_sq > 0 && u_sq > 0 ? std::sqrt(p_sq) / std::sqrt(u_sq) : 1.0;
      for (std::size_t i = 0; i < param.p.size(); ++i) param.p[i] -= lr * ratio * update[i];
    }
  });
}

TEST(DoubleOptimizers, LambMatchesTheReference) {
  // The gradient norm here is about 0.18: 1.0 does not clip, 0.05 does.
  for (const LambOptions options :
       {LambOptions{}, LambOptions{.max_grad_norm = 0.05, .trust_ratio_without_decay = true}}) {
    Model<double> model;
    BasicLamb<double> lamb(options);
    expect_close(run(lamb, model), lamb_reference(options));
  }
}

TEST(DoubleOptimizers, SgdMatchesTheReference) {
  for (const SgdOptions options :
       {SgdOptions{.momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01},
        SgdOptions{.momentum = 0.9, .weight_decay = 0.01, .nesterov = true},
        SgdOptions{.momentum = 0.0, .weight_decay = 0.01}}) {
    Model<double> model;
    BasicSgd<double> sgd(options);
    const auto actual = run(sgd, model);
    const auto expected = run_reference([&](std::vector<RefParam>& params, double lr, double t) {
      for (auto& param : params) {
        const double wd = param.no_weight_decay ? 0.0 : options.weight_decay;
        for (std::size_t i = 0; i < param.p.size(); ++i) {
          double d = param.g[i] + wd * param.p[i];
          if (options.momentum != 0.0) {
            auto& buffer = param.m[i];
            buffer = t == 1.0 ? d : options.momentum * buffer + (1.0 - options.dampening) * d;
            d = options.nesterov ? d + options.momentum * buffer : buffer;
          }
          param.p[i] -= lr * d;
        }
      }
    });
    expect_close(actual, expected);
  }
}

// ---- A caller-supplied global gradient norm ----

// One worker steps the weight, another the bias, each with the norm of both: the same as one
// optimizer stepping both. Clipping is on so that the norm matters.
template <typename T>
void expect_split_lamb_equals_whole() {
  const LambOptions options{.max_grad_norm = 0.05};
  Model<T> whole;
  BasicLamb<T> lamb(options);
  const auto expected = run(lamb, whole);

  Model<T> split, split_without_norm;
  BasicLamb<T> weight_worker(options), bias_worker(options);
  BasicLamb<T> weight_alone(options), bias_alone(options);
  for (std::size_t step = 0; step < 3; ++step) {
    split.set_grads(step);
    const auto views = split.views();
    const double norm = std::sqrt(grad_square_sum(std::span(views).first(1)) +
                                  grad_square_sum(std::span(views).last(1)));
    weight_worker.step(std::span(views).first(1), kLearningRates<T>[step], norm);
    bias_worker.step(std::span(views).last(1), kLearningRates<T>[step], norm);
    EXPECT_EQ(weight_worker.last_grad_norm(), norm);

    split_without_norm.set_grads(step);
    const auto alone = split_without_norm.views();
    weight_alone.step(std::span(alone).first(1), kLearningRates<T>[step]);
    bias_alone.step(std::span(alone).last(1), kLearningRates<T>[step]);
  }
  EXPECT_EQ(split.values(), expected);
  // Without the global norm each worker clips by its own and the result differs.
  EXPECT_NE(split_without_norm.values(), expected);
}

TEST(GlobalGradNorm, SteppingPartsWithTheWholeNormEqualsSteppingTheWhole) {
  expect_split_lamb_equals_whole<float>();
  expect_split_lamb_equals_whole<double>();
}

TEST(GlobalGradNorm, NegativeIsRefusedAndNonFiniteStopsLambBeforeAnyChange) {
  Model<double> model;
  model.set_grads(0);
  const auto before = model.values();
  BasicLamb<double> lamb;
  EXPECT_THROW(lamb.step(model.views(), 0.1, -1.0), std::invalid_argument);
  EXPECT_THROW(lamb.step(model.views(), 0.1, std::nan("")), std::runtime_error);
  EXPECT_THROW(lamb.step(model.views(), 0.1, HUGE_VAL), std::runtime_error);
  EXPECT_EQ(lamb.steps_taken(), 0);
  EXPECT_EQ(model.values(), before);
  BasicAdamW<double> adamw;
  EXPECT_THROW(adamw.step(model.views(), 0.1, -1.0), std::invalid_argument);
  EXPECT_EQ(adamw.steps_taken(), 0);
}

TEST(GlobalGradNorm, AdamWAndSgdDoNotClip) {
  // They take the norm (one call shape for every optimizer) and give the same result without it.
  Model<double> with_norm, without;
  BasicAdamW<double> adamw_a, adamw_b;
  BasicSgd<double> sgd_a, sgd_b;
  with_norm.set_grads(0);
  without.set_grads(0);
  adamw_a.step(with_norm.views(), 0.1, 1e-6);
  sgd_a.step(with_norm.views(), 0.1, 1e-6);
  adamw_b.step(without.views(), 0.1);
  sgd_b.step(without.views(), 0.1);
  EXPECT_EQ(with_norm.values(), without.values());
}

TEST(GlobalGradNorm, SquareSumsAddUpOverParts) {
  Model<double> model;
  model.set_grads(1);
  const auto views = model.views();
  double by_hand = 0.0;
  for (const double g : model.gw) by_hand += g * g;
  for (const double g : model.gb) by_hand += g * g;
  const double parts =
      grad_square_sum(std::span(views).first(1)) + grad_square_sum(std::span(views).last(1));
  EXPECT_NEAR(parts, by_hand, 1e-14 * by_hand);
  EXPECT_NEAR(global_grad_norm(views), std::sqrt(by_hand), 1e-14 * std::sqrt(by_hand));
}

// ---- State in F32 and F64 ----

ckpt::SafetensorsFile as_file(const std::vector<ckpt::TensorRecord>& records) {
  const auto bytes = ckpt::serialize_safetensors(records, {});
  return ckpt::parse_safetensors(bytes, "memory");
}

template <typename T>
std::vector<std::unique_ptr<BasicOptimizer<T>>> all_optimizers() {
  std::vector<std::unique_ptr<BasicOptimizer<T>>> optimizers;
  optimizers.push_back(std::make_unique<BasicAdamW<T>>());
  optimizers.push_back(std::make_unique<BasicLamb<T>>());
  optimizers.push_back(
      std::make_unique<BasicSgd<T>>(SgdOptions{.momentum = 0.9, .weight_decay = 0.01}));
  return optimizers;
}

TEST(DoubleOptimizers, StateIsF64AndRoundTripsBitForBit) {
  for (std::size_t kind = 0; kind < 3; ++kind) {
    Model<double> straight;
    const auto expected = run(*all_optimizers<double>()[kind], straight);

    Model<double> resumed;
    const auto first = std::move(all_optimizers<double>()[kind]);
    for (std::size_t step = 0; step < 2; ++step) {
      resumed.set_grads(step);
      first->step(resumed.views(), kLearningRates<double>[step]);
    }
    const auto records = first->state_records("optimizer");
    for (const auto& record : records) {
      const auto expected_dtype =
          record.name == "optimizer.step" ? ckpt::DType::kI64 : ckpt::DType::kF64;
      EXPECT_EQ(record.dtype, expected_dtype) << record.name;
    }
    const auto second = std::move(all_optimizers<double>()[kind]);
    second->load_state(as_file(records), resumed.views(), "optimizer");
    EXPECT_EQ(second->steps_taken(), 2);
    resumed.set_grads(2);
    second->step(resumed.views(), kLearningRates<double>[2]);
    EXPECT_EQ(resumed.values(), expected) << first->name();
  }
}

TEST(DoubleOptimizers, WidenFloatStateAndFloatRefusesDoubleState) {
  for (std::size_t kind = 0; kind < 3; ++kind) {
    Model<float> float_model;
    const auto float_optimizer = std::move(all_optimizers<float>()[kind]);
    float_model.set_grads(0);
    float_optimizer->step(float_model.views(), 0.1F);
    const auto float_file = as_file(float_optimizer->state_records("optimizer"));

    // A double optimizer takes the F32 buffers exactly widened.
    Model<double> double_model;
    const auto widened = std::move(all_optimizers<double>()[kind]);
    widened->load_state(float_file, double_model.views(), "optimizer");
    EXPECT_EQ(widened->steps_taken(), 1);
    const auto double_file = as_file(widened->state_records("optimizer"));
    for (const auto& [name, record] : float_file.tensors) {
      if (name == "optimizer.step") continue;
      const auto narrow = ckpt::read_f32(float_file, name, record.shape);
      EXPECT_EQ(ckpt::read_f64(double_file, name, record.shape),
                std::vector<double>(narrow.begin(), narrow.end()))
          << name;
    }

    // A float optimizer refuses F64 buffers, naming the record and both dtypes.
    const auto narrowing = std::move(all_optimizers<float>()[kind]);
    try {
      narrowing->load_state(double_file, float_model.views(), "optimizer");
      FAIL() << "no error for " << narrowing->name();
    } catch (const std::runtime_error& error) {
      const std::string message = error.what();
      EXPECT_NE(message.find("optimizer."), std::string::npos) << message;
      EXPECT_NE(message.find("F64"), std::string::npos) << message;
      EXPECT_NE(message.find("F32"), std::string::npos) << message;
    }
    EXPECT_EQ(narrowing->steps_taken(), 0);
  }
}

}  // namespace
}  // namespace pf::optim
