// K-FAC on the GPU (kfac/cuda) against the CPU path (kfac/) on the same factors: curvature,
// damping, Cholesky and eigen inversion, the Cholesky-to-eigen fallback with its info code,
// errors naming the layer, preconditioning in place; inversion chains and preconditioning by
// gradient rows (the pieces of divided tasks). Skipped without a CUDA device.
#include "kfac/eigen_core.h"  // first: silences GCC 12's AVX-512 false positives in Eigen

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "kfac/cuda/inverse_chain_cuda.h"
#include "kfac/cuda/kfac_cuda.h"
#include "kfac/cuda/layer_state_cuda.h"
#include "kfac/damping.h"
#include "kfac/factors.h"
#include "kfac/inverse.h"
#include "kfac/inverse_chain.h"
#include "kfac/layer_state.h"
#include "kfac/precondition.h"
#include "tests/kernels/cuda_test_util.h"

namespace pf::kfac::cuda {
namespace {

using pf::testing::expect_close;

std::vector<float> as_vector(const Eigen::MatrixXf& m) {
  return {m.data(), m.data() + m.size()};
}

class KfacCudaTest : public pf::testing::CudaTest {
 protected:
  void SetUp() override {
    CudaTest::SetUp();
    if (backend_ != nullptr) kfac_ = std::make_unique<KfacCuda>(*backend_);
  }
  // A symmetric positive definite factor: Gram matrix of `rows` random rows plus a ramp.
  Eigen::MatrixXf factor(std::int64_t d, std::int64_t rows = 64) {
    const auto x = random(static_cast<std::size_t>(rows * d));
    Eigen::MatrixXf f = Eigen::MatrixXf::Zero(d, d);
    add_gram_lower(f, x.data(), rows, d, 1.0F / static_cast<float>(rows));
    fill_upper_from_lower(f);
    f.diagonal() += Eigen::VectorXf::LinSpaced(d, 0.01F, 0.1F);
    return f;
  }
  float* upload_matrix(const Eigen::MatrixXf& m) { return upload(as_vector(m)); }
  std::vector<float> get(const float* device, std::int64_t count) {
    return download(device, static_cast<std::size_t>(count));
  }
  std::unique_ptr<KfacCuda> kfac_;
};

TEST_F(KfacCudaTest, CurvatureIsTheCpuGramMatrix) {
  const std::int64_t rows = 301, d = 67;
  const auto x = random(static_cast<std::size_t>(rows * d));
  Eigen::MatrixXf expected = Eigen::MatrixXf::Identity(d, d);
  add_gram_lower(expected, x.data(), rows, d, 0.5F);
  fill_upper_from_lower(expected);
  float* sum = upload_matrix(Eigen::MatrixXf::Identity(d, d));
  kfac_->add_gram_lower(sum, d, upload(x), rows, 0.5F);
  kfac_->fill_upper_from_lower(sum, d);
  expect_close(get(sum, d * d), as_vector(expected), 1e-5, "gram");
  // The same columns read in place from a wider row-major matrix (ld = d + 9, offset 4).
  const std::int64_t ld = d + 9;
  std::vector<float> wide(static_cast<std::size_t>(rows * ld), 1e3F);
  for (std::int64_t r = 0; r < rows; ++r) {
    std::copy_n(x.data() + r * d, d, wide.data() + r * ld + 4);
  }
  float* strided_sum = upload_matrix(Eigen::MatrixXf::Identity(d, d));
  kfac_->add_gram_lower(strided_sum, kernels::ConstMatrixView<float>(upload(wide) + 4, rows, d, ld),
                        0.5F);
  kfac_->fill_upper_from_lower(strided_sum, d);
  expect_close(get(strided_sum, d * d), as_vector(expected), 1e-5, "gram of a strided view");
  EXPECT_THROW(kfac_->add_gram_lower(strided_sum, kernels::ConstMatrixView<float>(sum, 4, 8, 7), 1),
               std::invalid_argument);
}

TEST_F(KfacCudaTest, DampingMatchesTheCpu) {
  const auto a = factor(48), b = factor(20);
  const auto expected = factored_damping(a, b, 0.03F);
  const auto actual = kfac_->factored_damping(upload_matrix(a), 48, upload_matrix(b), 20, 0.03F);
  EXPECT_NEAR(actual.pi, expected.pi, 1e-6 * expected.pi);
  EXPECT_NEAR(actual.a, expected.a, 1e-6F * expected.a);
  EXPECT_NEAR(actual.b, expected.b, 1e-6F * expected.b);
  EXPECT_THROW(kfac_->factored_damping(upload_matrix(a), 48, upload_matrix(b), 20, -1.0F),
               std::invalid_argument);
}

TEST_F(KfacCudaTest, CholeskyAndEigenInversesMatchTheCpu) {
  for (const std::int64_t d : {33, 257}) {
    const auto f = factor(d);
    float* device_factor = upload_matrix(f);
    float* inverse = upload_matrix(Eigen::MatrixXf::Zero(d, d));
    for (const auto method : {InverseMethod::kCholesky, InverseMethod::kEigen}) {
      const auto expected = damped_inverse(f, 0.01F, method);
      const auto result = kfac_->damped_inverse(device_factor, d, 0.01F, method, inverse, "layer");
      EXPECT_FALSE(result.fell_back_to_eigen);
      const auto actual = get(inverse, d * d);
      expect_close(actual, as_vector(expected.inverse), 2e-4,
                   "inverse d=" + std::to_string(d) +
                       (method == InverseMethod::kEigen ? " eigen" : " cholesky"));
      for (std::int64_t i = 0; i < d; ++i) {  // exactly symmetric, like the CPU's
        for (std::int64_t j = 0; j < i; ++j) {
          ASSERT_EQ(actual[static_cast<std::size_t>(i + j * d)],
                    actual[static_cast<std::size_t>(j + i * d)]);
        }
      }
    }
  }
}

TEST_F(KfacCudaTest, IndefiniteFactorFallsBackToEigenLikeTheCpu) {
  const std::int64_t d = 40;
  Eigen::MatrixXf f = factor(d);
  f(5, 5) = -2.0F;  // an eigenvalue below -damping: Cholesky fails
  const auto expected = damped_inverse(f, 0.05F, InverseMethod::kCholesky);
  ASSERT_TRUE(expected.fell_back_to_eigen);
  float* inverse = upload_matrix(Eigen::MatrixXf::Zero(d, d));
  const auto result =
      kfac_->damped_inverse(upload_matrix(f), d, 0.05F, InverseMethod::kCholesky, inverse, "l");
  EXPECT_TRUE(result.fell_back_to_eigen);
  EXPECT_GT(result.cholesky_info, 0);
  EXPECT_LE(result.cholesky_info, 6);  // the leading minor that is not positive definite
  expect_close(get(inverse, d * d), as_vector(expected.inverse), 2e-4, "fallback inverse");
}

TEST_F(KfacCudaTest, BadFactorsThrowNamingTheLayer) {
  const std::int64_t d = 8;
  float* inverse = upload_matrix(Eigen::MatrixXf::Zero(d, d));
  Eigen::MatrixXf nan_factor = factor(d);
  nan_factor(2, 3) = std::numeric_limits<float>::quiet_NaN();
  const auto message = [&](const Eigen::MatrixXf& f, float damping) {
    try {
      kfac_->damped_inverse(upload_matrix(f), d, damping, InverseMethod::kCholesky, inverse,
                            "layer 3 query A");
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(nan_factor, 0.1F).find("layer 3 query A: the factor has non-finite"),
            std::string::npos);
  EXPECT_NE(message(Eigen::MatrixXf::Zero(d, d), 0.0F)
                .find("layer 3 query A: the factor is "
                      "singular"),
            std::string::npos);
  EXPECT_NE(message(factor(d), -1.0F).find("damping must be >= 0"), std::string::npos);
}

TEST_F(KfacCudaTest, PreconditioningInPlaceMatchesTheCpu) {
  const std::int64_t d_out = 24, d_in = 56;
  const auto a_inv = damped_inverse(factor(d_in), 0.1F, InverseMethod::kCholesky).inverse;
  const auto b_inv = damped_inverse(factor(d_out), 0.1F, InverseMethod::kCholesky).inverse;
  auto grad_w = random(static_cast<std::size_t>(d_out * d_in));
  auto grad_b = random(static_cast<std::size_t>(d_out));
  float* device_w = upload(grad_w);
  float* device_b = upload(grad_b);
  precondition(a_inv, b_inv, grad_w.data(), grad_b.data(), d_out, d_in, grad_w.data(),
               grad_b.data());
  kfac_->precondition(upload_matrix(a_inv), upload_matrix(b_inv), device_w, device_b, d_out, d_in,
                      device_w, device_b);
  expect_close(get(device_w, d_out * d_in), grad_w, 1e-5, "preconditioned weight");
  expect_close(get(device_b, d_out), grad_b, 1e-5, "preconditioned bias");
}

// Preconditioning by gradient rows: the pieces together are the CPU's precondition_rows (and so
// precondition's result to rounding); every piece reads the whole gradient, so an output that
// aliases it is refused.
TEST_F(KfacCudaTest, PreconditioningByRowsMatchesTheCpuPieces) {
  const std::int64_t d_out = 300, d_in = 56;
  const auto a_inv = damped_inverse(factor(d_in), 0.1F, InverseMethod::kCholesky).inverse;
  const auto b_inv = damped_inverse(factor(d_out), 0.1F, InverseMethod::kCholesky).inverse;
  const auto grad_w = random(static_cast<std::size_t>(d_out * d_in));
  const auto grad_b = random(static_cast<std::size_t>(d_out));
  std::vector<float> out_w(grad_w.size()), out_b(grad_b.size());
  const float* device_w = upload(grad_w);
  const float* device_b = upload(grad_b);
  float* device_out_w = upload(out_w);
  float* device_out_b = upload(out_b);
  const float* device_a = upload_matrix(a_inv);
  const float* device_b_inv = upload_matrix(b_inv);
  const int cuts[] = {0, 1, 333, 600, kPieceUnits};
  for (int p = 0; p + 1 < 5; ++p) {
    precondition_rows(a_inv, b_inv, grad_w.data(), grad_b.data(), d_out, d_in, cuts[p], cuts[p + 1],
                      out_w.data(), out_b.data());
    kfac_->precondition_rows(device_a, device_b_inv, device_w, device_b, d_out, d_in, cuts[p],
                             cuts[p + 1], device_out_w, device_out_b);
  }
  expect_close(get(device_out_w, d_out * d_in), out_w, 1e-5, "weight by rows");
  expect_close(get(device_out_b, d_out), out_b, 1e-5, "bias by rows");
  EXPECT_THROW(kfac_->precondition_rows(device_a, device_b_inv, device_out_w, nullptr, d_out, d_in,
                                        0, kPieceUnits, device_out_w, nullptr),
               std::invalid_argument);
}

// The divided Cholesky inversion on the GPU: the CPU chain's inverse to fp32 rounding, exactly
// symmetric, the same bits when run again with other piece boundaries (a piece runs whole
// steps), nothing installed before the last piece, and an indefinite factor falling back to
// the eigen inverse with the failing minor's order, as damped_inverse does.
TEST_F(KfacCudaTest, InverseChainMatchesTheCpuChainAndRepeats) {
  const std::int64_t d = 300;  // 3 block columns of 128
  const auto f = factor(d, 400);
  const float* device_factor = upload_matrix(f);
  const auto run = [&](const std::vector<int>& cuts) {
    InverseChainCuda chain(*kfac_, device_factor, d, 0.01F, "layer 2 intermediate A");
    EXPECT_THROW(chain.take(), std::logic_error);
    for (std::size_t p = 0; p + 1 < cuts.size(); ++p) chain.run(cuts[p], cuts[p + 1]);
    auto result = chain.take();
    EXPECT_FALSE(result.status.fell_back_to_eigen);
    return get(result.inverse.data<float>(), d * d);
  };
  EXPECT_EQ(kfac_->spare_bytes(), 0);
  const auto first = run({0, 100, 400, 700, kPieceUnits});
  // The chain's factor copy, L and workspace come back for the next chain, which reuses them.
  const std::int64_t spare = kfac_->spare_bytes();
  EXPECT_GE(spare, 2 * d * d * 4);
  const auto again = run({0, 50, kPieceUnits});
  EXPECT_EQ(first, again);
  EXPECT_EQ(kfac_->spare_bytes(), spare);
  InverseChain cpu(f, 0.01F);
  cpu.run(0, kPieceUnits);
  expect_close(first, as_vector(cpu.take().inverse), 2e-4, "chain inverse");
  for (std::int64_t i = 0; i < d; ++i) {
    for (std::int64_t j = 0; j < i; ++j) {
      ASSERT_EQ(first[static_cast<std::size_t>(i + j * d)],
                first[static_cast<std::size_t>(j + i * d)]);
    }
  }
  InverseChainCuda out_of_order(*kfac_, device_factor, d, 0.01F, "l");
  EXPECT_THROW(out_of_order.run(100, 200), std::logic_error);

  Eigen::MatrixXf indefinite = f;
  indefinite(200, 200) = -2.0F;  // fails in the second block column
  const auto expected = damped_inverse(indefinite, 0.05F, InverseMethod::kCholesky);
  ASSERT_TRUE(expected.fell_back_to_eigen);
  InverseChainCuda falling(*kfac_, upload_matrix(indefinite), d, 0.05F, "l");
  falling.run(0, kPieceUnits / 2);
  falling.run(kPieceUnits / 2, kPieceUnits);
  auto result = falling.take();
  EXPECT_TRUE(result.status.fell_back_to_eigen);
  EXPECT_GT(result.status.cholesky_info, 128);
  EXPECT_LE(result.status.cholesky_info, 201);
  expect_close(get(result.inverse.data<float>(), d * d), as_vector(expected.inverse), 2e-4,
               "fallback inverse");
}

// A layer's chain: begin copies the value, the last piece installs the inverse like invert_a,
// device_bytes counts the chain meanwhile, and a chain resumed from its factor and progress ends
// with the uninterrupted chain's bits.
TEST_F(KfacCudaTest, LayerInverseChainInstallsAndResumes) {
  const std::int64_t d_in = 200, d_out = 20, tokens = 64;
  const auto make_layer = [&](const char* name) {
    auto layer = std::make_unique<KfacLayerCuda>(*kfac_, d_in, d_out, name);
    std::mt19937 generator(7);
    std::normal_distribution<float> normal;
    std::vector<float> a(static_cast<std::size_t>(tokens * d_in));
    std::vector<float> g(static_cast<std::size_t>(tokens * d_out));
    for (auto& x : a) x = normal(generator);
    for (auto& x : g) x = normal(generator);
    layer->accumulate_a({upload(a), tokens, d_in});
    layer->accumulate_b({upload(g), tokens, d_out}, 1.0F);
    layer->finalize_a();
    layer->finalize_b();
    return layer;
  };
  auto layer = make_layer("layer 0 ffn_out");
  EXPECT_THROW(layer->run_inverse_chain(true, 0, 10), std::logic_error);  // no chain begun
  const std::int64_t idle = layer->device_bytes();
  layer->begin_inverse_chain(true, 0.02F);
  EXPECT_GT(layer->device_bytes(), idle + 3 * d_in * d_in * 4 - 1);
  EXPECT_FALSE(layer->run_inverse_chain(true, 0, 300).has_value());
  EXPECT_FALSE(layer->a().inverted);
  const auto* chain = layer->inverse_chain(true);
  ASSERT_NE(chain, nullptr);
  const int next = chain->next_unit();
  const auto saved_factor = layer->to_host().a.value;
  const auto result = layer->run_inverse_chain(true, 300, kPieceUnits);
  ASSERT_TRUE(result.has_value());
  EXPECT_FALSE(result->fell_back_to_eigen);
  EXPECT_EQ(layer->inverse_chain(true), nullptr);
  EXPECT_TRUE(layer->a().inverted);
  EXPECT_EQ(layer->a().damping, 0.02F);
  const auto installed = layer->to_host().a.inverse;

  auto resumed = make_layer("layer 0 ffn_out");
  resumed->resume_inverse_chain(true, saved_factor, 0.02F, next);
  resumed->run_inverse_chain(true, next, kPieceUnits);
  EXPECT_EQ(as_vector(resumed->to_host().a.inverse), as_vector(installed));
  layer->invert_a(0.02F);  // the whole inversion: the same inverse to rounding
  expect_close(as_vector(layer->to_host().a.inverse), as_vector(installed), 2e-4, "whole vs chain");
  EXPECT_THROW(resumed->resume_inverse_chain(true, Eigen::MatrixXf::Identity(3, 3), 0.02F, 10),
               std::invalid_argument);
}

void expect_close_matrix(const Eigen::MatrixXf& actual, const Eigen::MatrixXf& expected,
                         double tolerance, const std::string& what) {
  ASSERT_EQ(actual.rows(), expected.rows()) << what;
  ASSERT_EQ(actual.cols(), expected.cols()) << what;
  expect_close(as_vector(actual), as_vector(expected), tolerance, what);
}

// A layer's life on the GPU against the CPU's KfacLayerState: two refreshes (the second blended
// with running average 0.9), one micro-batch accumulated in two pieces, a strided input,
// damping, both inversions, preconditioning; to_host gives the CPU's state and load restores it.
TEST_F(KfacCudaTest, LayerStateFollowsTheCpuLifeCycle) {
  const std::int64_t d_in = 48, d_out = 20, tokens = 37;
  KfacLayerState cpu(d_in, d_out);
  KfacLayerCuda gpu(*kfac_, d_in, d_out, "layer 1 ffn_in");
  for (int refresh = 0; refresh < 2; ++refresh) {
    for (int microbatch = 0; microbatch < 2; ++microbatch) {
      const auto a = random(static_cast<std::size_t>(tokens * d_in));
      const auto g = random(static_cast<std::size_t>(tokens * d_out), 0.1F);
      accumulate_b(cpu, g.data(), tokens, 3.0F);
      gpu.accumulate_b({upload(g), tokens, d_out}, 3.0F);
      if (microbatch == 0) {
        accumulate_a(cpu, a.data(), tokens);
        gpu.accumulate_a({upload(a), tokens, d_in}, 0, kPieceUnits / 2);
        gpu.accumulate_a({upload(a), tokens, d_in}, kPieceUnits / 2, kPieceUnits);
      } else {
        accumulate_a(cpu, a.data(), tokens);
        std::vector<float> wide(static_cast<std::size_t>(tokens * (d_in + 5)), 0.0F);
        for (std::int64_t r = 0; r < tokens; ++r) {
          std::copy_n(a.data() + r * d_in, d_in, wide.data() + r * (d_in + 5));
        }
        gpu.accumulate_a({upload(wide), tokens, d_in, d_in + 5});
      }
    }
    const float average = refresh == 0 ? 0.0F : 0.9F;
    finalize_a(cpu, average);
    finalize_b(cpu, average);
    gpu.finalize_a(average);
    gpu.finalize_b(average);
  }
  EXPECT_THROW(gpu.finalize_a(), std::logic_error);  // nothing accumulated since
  const auto expected_damping = layer_damping(cpu, 0.01F);
  const auto damping = gpu.damping(0.01F);
  EXPECT_NEAR(damping.a, expected_damping.a, 1e-5F * expected_damping.a);
  EXPECT_NEAR(damping.b, expected_damping.b, 1e-5F * expected_damping.b);
  EXPECT_THROW(gpu.precondition(nullptr, nullptr, nullptr, nullptr), std::logic_error);
  invert_a(cpu, expected_damping.a);
  invert_b(cpu, expected_damping.b);
  gpu.invert_a(expected_damping.a);
  gpu.invert_b(expected_damping.b);

  const auto host = gpu.to_host();
  EXPECT_EQ(host.a.refreshes, 2);
  EXPECT_EQ(host.b.inverted_refresh, 2);
  EXPECT_EQ(host.a.sum.size(), 0);
  expect_close_matrix(host.a.value, cpu.a.value, 1e-5, "A");
  expect_close_matrix(host.b.value, cpu.b.value, 1e-5, "B");
  expect_close_matrix(host.a.inverse, cpu.a.inverse, 2e-4, "A inverse");
  expect_close_matrix(host.b.inverse, cpu.b.inverse, 2e-4, "B inverse");

  auto grad_w = random(static_cast<std::size_t>(d_out * d_in));
  auto grad_b = random(static_cast<std::size_t>(d_out));
  float* device_w = upload(grad_w);
  float* device_b = upload(grad_b);
  precondition_layer(cpu, grad_w.data(), grad_b.data(), grad_w.data(), grad_b.data());
  gpu.precondition(device_w, device_b, device_w, device_b);
  expect_close(get(device_w, d_out * d_in), grad_w, 2e-4, "preconditioned weight");
  expect_close(get(device_b, d_out), grad_b, 2e-4, "preconditioned bias");

  KfacLayerCuda restored(*kfac_, d_in, d_out, "restored");
  restored.load(cpu);
  const auto round_trip = restored.to_host();
  EXPECT_EQ(round_trip.a.refreshes, cpu.a.refreshes);
  EXPECT_EQ(round_trip.b.damping, cpu.b.damping);
  EXPECT_EQ(as_vector(round_trip.a.inverse), as_vector(cpu.a.inverse));
  EXPECT_THROW(restored.load(KfacLayerState(d_in + 1, d_out)), std::invalid_argument);
}

}  // namespace
}  // namespace pf::kfac::cuda
