// Optimizer steps against reference values: AdamW and SGD from torch.optim (torch 1.13, float64),
// LAMB from a numpy transcription of apex FusedLAMB's two stages (the script is in docs/kfac.md).
#include <gtest/gtest.h>
#include <omp.h>

#include <array>
#include <cmath>
#include <numeric>
#include <vector>

#include "runtime/optim/adamw.h"
#include "runtime/optim/lamb.h"
#include "runtime/optim/lr_schedule.h"
#include "runtime/optim/sgd.h"

namespace pf::optim {
namespace {

// Two tensors: a 2x2 weight (decayed) and a bias of 2 (not decayed), three steps of gradients.
struct TwoParams {
  std::vector<float> w = {0.5F, -1.0F, 2.0F, 0.25F};
  std::vector<float> b = {0.1F, -0.2F};
  std::vector<float> gw = std::vector<float>(4);
  std::vector<float> gb = std::vector<float>(2);
  std::vector<ParamView> views() {
    return {ParamView{"w", w.data(), gw.data(), 4, {2, 2}, false},
            ParamView{"b", b.data(), gb.data(), 2, {2}, true}};
  }
  void set_grads(int step) {
    static constexpr std::array<std::array<float, 6>, 3> kGrads = {{
        {0.3F, -0.2F, 0.1F, 0.4F, 0.05F, -0.5F},
        {-0.1F, 0.6F, 0.2F, -0.3F, 0.2F, 0.1F},
        {0.0F, 0.1F, -0.4F, 0.2F, -0.3F, 0.0F},
    }};
    const auto& g = kGrads[static_cast<std::size_t>(step)];
    std::copy(g.begin(), g.begin() + 4, gw.begin());
    std::copy(g.begin() + 4, g.end(), gb.begin());
  }
  std::vector<float> values() const {
    std::vector<float> all = w;
    all.insert(all.end(), b.begin(), b.end());
    return all;
  }
};

constexpr std::array<float, 3> kLearningRates = {0.1F, 0.05F, 0.02F};

std::vector<float> run(Optimizer& optimizer, TwoParams& params) {
  for (int step = 0; step < 3; ++step) {
    params.set_grads(step);
    const auto views = params.views();
    optimizer.step(views, kLearningRates[static_cast<std::size_t>(step)]);
  }
  return params.values();
}

void expect_near(const std::vector<float>& actual, const std::vector<double>& expected,
                 double tolerance = 2e-6) {
  ASSERT_EQ(actual.size(), expected.size());
  for (std::size_t i = 0; i < actual.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i], tolerance) << "element " << i;
  }
}

TEST(AdamW, MatchesTorch) {
  TwoParams params;
  AdamW adamw({.beta1 = 0.9F, .beta2 = 0.999F, .eps = 1e-8F, .weight_decay = 0.01F});
  expect_near(run(adamw, params),
              {0.3730260657813857, -0.9326180874932739, 1.8522980423269664, 0.13914943782837036,
               -0.04142794777491648, -0.06654820634264481});
  EXPECT_EQ(adamw.steps_taken(), 3);
}

TEST(Sgd, MomentumMatchesTorch) {
  TwoParams params;
  Sgd sgd({.momentum = 0.9F, .dampening = 0.0F, .weight_decay = 0.01F, .nesterov = false});
  expect_near(run(sgd, params), {0.45722263194999996, -1.0080824679, 1.9733098387999999,
                                 0.201333063475, 0.08434, -0.12620000000000003});
}

TEST(Sgd, NesterovMatchesTorch) {
  TwoParams params;
  Sgd sgd({.momentum = 0.9F, .dampening = 0.0F, .weight_decay = 0.01F, .nesterov = true});
  expect_near(run(sgd, params), {0.43571230493005, -1.0176026492961001, 1.9606101981692001,
                                 0.17685182781752498, 0.076906, -0.08858000000000002});
}

TEST(Sgd, PlainStepByHand) {
  std::vector<float> p = {1.0F, -2.0F};
  std::vector<float> g = {0.5F, 0.25F};
  const std::vector<ParamView> views = {ParamView{"p", p.data(), g.data(), 2, {2}, false}};
  Sgd sgd({.momentum = 0.0F, .dampening = 0.0F, .weight_decay = 0.1F, .nesterov = false});
  sgd.step(views, 0.5F);
  // p - lr (g + wd p) = 1 - 0.5 (0.5 + 0.1) = 0.7;  -2 - 0.5 (0.25 - 0.2) = -2.025
  EXPECT_FLOAT_EQ(p[0], 0.7F);
  EXPECT_FLOAT_EQ(p[1], -2.025F);
}

TEST(Lamb, MatchesApexSemanticsWithoutClipping) {
  TwoParams params;
  Lamb lamb;  // NVIDIA's BERT defaults: eps 1e-6, wd 0.01, max_grad_norm 1 (norms here are < 1)
  expect_near(run(lamb, params), {0.3293307742067, -0.9575694733765258, 1.8054770971175844,
                                  0.10857483278298269, -0.0414256807205438, -0.06654850109712171});
  // Last step's trust ratios: the weight's ||p|| / ||u||, and 1 for the undecayed bias.
  ASSERT_EQ(lamb.last_trust_ratios().size(), 2U);
  EXPECT_NEAR(lamb.last_trust_ratios()[0], 3.099354696699163, 1e-5);
  EXPECT_EQ(lamb.last_trust_ratios()[1], 1.0);
}

TEST(Lamb, ClipsTheGlobalGradientNormBeforeTheMoments) {
  TwoParams params;
  Lamb lamb({.beta1 = 0.9F,
             .beta2 = 0.999F,
             .eps = 1e-6F,
             .weight_decay = 0.01F,
             .max_grad_norm = 0.5F,
             .trust_ratio_without_decay = false});
  params.set_grads(0);
  auto views = params.views();
  lamb.step(views, kLearningRates[0]);
  EXPECT_NEAR(lamb.last_grad_norm(), 0.7433034373659253, 1e-7);
  // The moments hold the clipped gradient g * 0.5 / 0.7433.
  const auto records = lamb.state_records("opt");
  ckpt::SafetensorsFile file;
  for (const auto& record : records) file.tensors[record.name] = record;
  const std::int64_t two_by_two[] = {2, 2};
  const std::int64_t two[] = {2};
  expect_near(
      ckpt::read_f32(file, "opt.w.exp_avg", two_by_two),
      {0.02018018381988937, -0.013453455879926246, 0.006726727939963123, 0.026906911759852492},
      1e-8);
  expect_near(ckpt::read_f32(file, "opt.b.exp_avg_sq", two),
              {1.1312217194570145e-06, 0.00011312217194570144},
              2e-9);  // 1 - 0.999F differs from 0.001 by 1.3e-5 relative
  for (int step = 1; step < 3; ++step) {
    params.set_grads(step);
    views = params.views();
    lamb.step(views, kLearningRates[static_cast<std::size_t>(step)]);
  }
  expect_near(params.values(), {0.3316681597093795, -0.9559287696219173, 1.8103610694527597,
                                0.10740085601766128, -0.0389911473662506, -0.0665732678132666});
}

TEST(Lamb, RefusesANonFiniteGradient) {
  TwoParams params;
  params.gw[2] = std::nanf("");
  Lamb lamb;
  const auto before = params.values();
  EXPECT_THROW(lamb.step(params.views(), 0.1F), std::runtime_error);
  EXPECT_EQ(lamb.steps_taken(), 0);
  EXPECT_EQ(params.w, std::vector<float>(before.begin(), before.begin() + 4));
}

// state_bytes counts what each optimizer allocated per parameter: nothing before its first step,
// then LAMB's and AdamW's two moments and SGD's momentum buffer, in the optimizer's precision.
TEST(Optimizers, StateBytesAreTheBuffersEachParameterHolds) {
  TwoParams params;
  Lamb lamb;
  AdamW adamw;
  Sgd sgd;
  BasicSgd<double> sgd_double;
  EXPECT_EQ(lamb.state_bytes("w"), 0);
  EXPECT_EQ(sgd.state_bytes("b"), 0);
  run(lamb, params);
  run(adamw, params);
  run(sgd, params);
  EXPECT_EQ(lamb.state_bytes("w"), 2 * 4 * 4);
  EXPECT_EQ(lamb.state_bytes("b"), 2 * 2 * 4);
  EXPECT_EQ(adamw.state_bytes("w"), 2 * 4 * 4);
  EXPECT_EQ(sgd.state_bytes("w"), 4 * 4);
  EXPECT_EQ(sgd.state_bytes("b"), 2 * 4);
  EXPECT_EQ(lamb.state_bytes("not a parameter"), 0);
  std::vector<double> w(4, 1.0), gw(4, 0.5);
  const std::vector<BasicParamView<double>> views = {{"w", w.data(), gw.data(), 4, {2, 2}, false}};
  sgd_double.step(views, 0.1);
  EXPECT_EQ(sgd_double.state_bytes("w"), 4 * 8);
}

TEST(Optimizers, StateRoundTripsThroughSafetensors) {
  // Two steps, save, restore into a fresh optimizer, third step: same as three steps straight.
  for (int kind = 0; kind < 3; ++kind) {
    const auto make = [kind]() -> std::unique_ptr<Optimizer> {
      if (kind == 0) return std::make_unique<AdamW>();
      if (kind == 1) return std::make_unique<Lamb>();
      return std::make_unique<Sgd>(SgdOptions{.momentum = 0.9F, .weight_decay = 0.01F});
    };
    TwoParams straight;
    auto reference = make();
    const auto expected = run(*reference, straight);

    TwoParams resumed;
    auto first = make();
    for (int step = 0; step < 2; ++step) {
      resumed.set_grads(step);
      first->step(resumed.views(), kLearningRates[static_cast<std::size_t>(step)]);
    }
    const auto bytes = ckpt::serialize_safetensors(first->state_records("optimizer"), {});
    const auto file = ckpt::parse_safetensors(bytes, "memory");
    auto second = make();
    second->load_state(file, resumed.views(), "optimizer");
    EXPECT_EQ(second->steps_taken(), 2);
    resumed.set_grads(2);
    second->step(resumed.views(), kLearningRates[2]);
    EXPECT_EQ(resumed.values(), expected) << first->name();
  }
}

TEST(Optimizers, LoadStateNamesTheMissingOrMisshapedRecord) {
  TwoParams params;
  AdamW adamw;
  params.set_grads(0);
  adamw.step(params.views(), 0.1F);
  auto records = adamw.state_records("optimizer");
  ckpt::SafetensorsFile file;
  for (const auto& record : records) file.tensors[record.name] = record;
  file.tensors.erase("optimizer.b.exp_avg_sq");
  AdamW fresh;
  try {
    fresh.load_state(file, params.views(), "optimizer");
    FAIL() << "no error";
  } catch (const std::runtime_error& error) {
    EXPECT_NE(std::string(error.what()).find("optimizer.b.exp_avg_sq"), std::string::npos);
  }
  EXPECT_EQ(fresh.steps_taken(), 0);
}

TEST(Optimizers, RejectInconsistentParameters) {
  std::vector<float> p(3), g(3);
  AdamW adamw;
  const std::vector<ParamView> wrong_size = {ParamView{"p", p.data(), g.data(), 3, {2, 2}, false}};
  EXPECT_THROW(adamw.step(wrong_size, 0.1F), std::invalid_argument);
  const std::vector<ParamView> repeated = {ParamView{"p", p.data(), g.data(), 3, {3}, false},
                                           ParamView{"p", p.data(), g.data(), 3, {3}, false}};
  EXPECT_THROW(adamw.step(repeated, 0.1F), std::invalid_argument);
}

TEST(Optimizers, LargeTensorsTakeTheParallelPathWithTheSameResult) {
  // 100000 elements exceed the threshold for an OpenMP region; compare with a hand loop.
  const std::size_t n = 100000;
  std::vector<float> p(n), g(n);
  for (std::size_t i = 0; i < n; ++i) {
    p[i] = std::sin(static_cast<float>(i));
    g[i] = std::cos(static_cast<float>(i) * 0.5F) * 1e-3F;
  }
  auto expected = p;
  for (std::size_t i = 0; i < n; ++i) expected[i] -= 0.1F * g[i];  // momentum 0, no decay
  Sgd sgd({.momentum = 0.0F});
  sgd.step(std::vector<ParamView>{ParamView{"p", p.data(), g.data(), n, {100, 1000}, false}}, 0.1F);
  EXPECT_EQ(p, expected);
  const double norm = global_grad_norm(
      std::vector<ParamView>{ParamView{"p", p.data(), g.data(), n, {100, 1000}, false}});
  const double by_hand =
      std::sqrt(std::inner_product(g.begin(), g.end(), g.begin(), 0.0, std::plus<>(),
                                   [](float a, float b) { return double{a} * b; }));
  EXPECT_NEAR(norm, by_hand, 1e-12 * by_hand + 1e-15);
}

TEST(Optimizers, NormsAndStepsAreBitIdenticalForAnyThreadCount) {
  // The global gradient norm (LAMB's clipping) and LAMB's step with its trust-ratio norms, on a
  // tensor large enough for the chunked OpenMP path: the same bits on 1, 2, 3 and 4 threads.
  const std::size_t n = 300001;
  std::vector<float> p0(n), g(n);
  for (std::size_t i = 0; i < n; ++i) {
    p0[i] = std::sin(static_cast<float>(i) * 0.37F);
    g[i] = std::cos(static_cast<float>(i) * 0.11F) * (1.0F + static_cast<float>(i % 7));
  }
  const int saved = omp_get_max_threads();
  std::vector<double> norms;
  std::vector<std::vector<float>> params;
  for (const int threads : {1, 2, 3, 4}) {
    omp_set_num_threads(threads);
    auto p = p0;
    const std::vector<ParamView> views{ParamView{"p", p.data(), g.data(), n, {1, 300001}, false}};
    norms.push_back(global_grad_norm(views));
    Lamb lamb({.max_grad_norm = 1.0});
    lamb.step(views, 0.01F);
    lamb.step(views, 0.01F);
    params.push_back(p);
  }
  omp_set_num_threads(saved);
  for (std::size_t t = 1; t < norms.size(); ++t) {
    EXPECT_EQ(norms[t], norms[0]) << t + 1 << " threads";
    EXPECT_TRUE(params[t] == params[0]) << t + 1 << " threads";
  }
}

TEST(PolyWarmupSchedule, WarmUpBoundaryAndEnd) {
  // 1000 steps, 10% warm-up: the k-th update (step k-1) uses progress k / 1000.
  const PolyWarmupSchedule schedule{
      .base_lr = 6e-3F, .total_steps = 1000, .warmup_fraction = 0.1, .power = 0.5};
  EXPECT_FLOAT_EQ(schedule.learning_rate(0), 6e-3F * 0.001F / 0.1F);
  EXPECT_FLOAT_EQ(schedule.learning_rate(98), 6e-3F * 0.099F / 0.1F);  // last warm-up step
  EXPECT_FLOAT_EQ(schedule.learning_rate(99), static_cast<float>(6e-3 * std::sqrt(0.9)));
  EXPECT_FLOAT_EQ(schedule.learning_rate(899), static_cast<float>(6e-3 * std::sqrt(0.1)));
  EXPECT_FLOAT_EQ(schedule.learning_rate(998), static_cast<float>(6e-3 * std::sqrt(0.001)));
  EXPECT_EQ(schedule.learning_rate(999), 0.0F);
  EXPECT_EQ(schedule.learning_rate(5000), 0.0F);
  EXPECT_THROW(schedule.learning_rate(-1), std::invalid_argument);
  const PolyWarmupSchedule no_warmup{.base_lr = 1.0F, .total_steps = 4, .warmup_fraction = 0.0};
  EXPECT_FLOAT_EQ(no_warmup.learning_rate(0), static_cast<float>(std::sqrt(0.75)));
  const PolyWarmupSchedule bad{.base_lr = 1.0F, .total_steps = 0};
  EXPECT_THROW(bad.learning_rate(0), std::invalid_argument);
}

}  // namespace
}  // namespace pf::optim
