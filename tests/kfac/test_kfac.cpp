// The K-FAC math of one Linear layer checked against dense linear algebra in double precision.
#include "kfac/eigen_core.h"  // first: silences GCC 12's AVX-512 false positives in Eigen

#include <gtest/gtest.h>
#include <omp.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <random>
#include <utility>
#include <vector>

#include "kfac/cholesky_inverse_columns.h"
#include "kfac/damping.h"
#include "kfac/factors.h"
#include "kfac/inverse.h"
#include "kfac/inverse_chain.h"
#include "kfac/layer_state.h"
#include "kfac/lower_blas.h"
#include "kfac/padded_storage.h"
#include "kfac/precondition.h"
#include "kfac/sharding.h"

namespace pf::kfac {
namespace {

using RowMatrixF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using RowMatrixD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

RowMatrixF random_matrix(Eigen::Index rows, Eigen::Index cols, unsigned seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  RowMatrixF matrix(rows, cols);
  for (Eigen::Index i = 0; i < matrix.size(); ++i) matrix.data()[i] = normal(generator);
  return matrix;
}

// The mean Gram matrix x^T x / samples of `samples` random rows of width `dim`, both triangles:
// a positive semi-definite factor as the curvature builds one.
Eigen::MatrixXf gram_factor(std::int64_t dim, std::int64_t samples, unsigned seed) {
  const auto x = random_matrix(samples, dim, seed);
  Eigen::MatrixXf factor = Eigen::MatrixXf::Zero(dim, dim);
  add_gram_lower(factor, x.data(), samples, dim, 1.0F / static_cast<float>(samples));
  fill_upper_from_lower(factor);
  return factor;
}

// kron(X, Y)[(i * ny + k), (j * ny + l)] = X(i, j) * Y(k, l).
Eigen::MatrixXd kron(const Eigen::MatrixXd& x, const Eigen::MatrixXd& y) {
  Eigen::MatrixXd result(x.rows() * y.rows(), x.cols() * y.cols());
  for (Eigen::Index i = 0; i < x.rows(); ++i) {
    for (Eigen::Index j = 0; j < x.cols(); ++j) {
      result.block(i * y.rows(), j * y.cols(), y.rows(), y.cols()) = x(i, j) * y;
    }
  }
  return result;
}

// Row-major vec: vec(G)[o * d_in + i] = G(o, i).
Eigen::VectorXd vec(const RowMatrixD& matrix) {
  return Eigen::Map<const Eigen::VectorXd>(matrix.data(), matrix.size());
}

double max_relative_error(const Eigen::MatrixXd& actual, const Eigen::MatrixXd& expected) {
  return (actual - expected).cwiseAbs().maxCoeff() / expected.cwiseAbs().maxCoeff();
}

// A layer with factors from T random tokens, finalized.
KfacLayerState layer_with_factors(std::int64_t d_in, std::int64_t d_out, std::int64_t tokens,
                                  unsigned seed) {
  KfacLayerState layer(d_in, d_out);
  const auto a = random_matrix(tokens, d_in, seed);
  const auto g = random_matrix(tokens, d_out, seed + 1);
  accumulate_a(layer, a.data(), tokens);
  accumulate_b(layer, g.data(), tokens, output_grad_scale(tokens, tokens));
  finalize_a(layer);
  finalize_b(layer);
  return layer;
}

TEST(KfacFactors, GramMatchesDenseProductOnOneThreadAndOnSeveral) {
  // 23 rows run one SYRK; 150 rows and 300 columns split the rows over two threads (64 rows each
  // at least) when OpenMP offers them.
  for (const auto& [rows, cols] :
       {std::pair<std::int64_t, std::int64_t>{23, 5}, {23, 300}, {150, 300}}) {
    const auto x = random_matrix(rows, cols, 7);
    Eigen::MatrixXf sum = Eigen::MatrixXf::Zero(cols, cols);
    add_gram_lower(sum, x.data(), rows, cols, 0.5F);
    add_gram_lower(sum, x.data(), rows, cols, 0.25F);
    fill_upper_from_lower(sum);
    const Eigen::MatrixXd expected = 0.75 * x.cast<double>().transpose() * x.cast<double>();
    EXPECT_LT(max_relative_error(sum.cast<double>(), expected), 1e-5) << rows << " x " << cols;
    EXPECT_EQ(sum, sum.transpose());
  }
  Eigen::MatrixXf wrong = Eigen::MatrixXf::Zero(4, 4);
  const auto x = random_matrix(3, 5, 1);
  EXPECT_THROW(add_gram_lower(wrong, x.data(), 3, 5, 1.0F), std::invalid_argument);
}

TEST(KfacFactors, CurvatureInverseAndPreconditioningBitsAreTheSameForAnyThreadCount) {
  // The runtime's equivalence tests and checkpoint resumes compare bits: K-FAC's results must not
  // depend on how many OpenMP threads the process has (as the model's step does not).
  struct Result {
    Eigen::MatrixXf gram, inverse, eigen_inverse, chain_inverse;
    RowMatrixF preconditioned, eigen_preconditioned;
    double kl_dot = 0.0;
  };
  auto run = [](std::int64_t rows, std::int64_t cols) {
    const auto x = random_matrix(rows, cols, 91);
    Result r;
    r.gram = Eigen::MatrixXf::Zero(cols, cols);
    add_gram_lower(r.gram, x.data(), rows, cols, 1.0F / static_cast<float>(rows));
    fill_upper_from_lower(r.gram);
    r.inverse = damped_inverse(r.gram, 0.05F, InverseMethod::kCholesky).inverse;
    r.eigen_inverse = damped_inverse(r.gram, 0.05F, InverseMethod::kEigen).inverse;
    InverseChain chain(r.gram, 0.05F);  // the divided inversion, in three pieces
    chain.run(0, kPieceUnits / 3);
    chain.run(kPieceUnits / 3, 2 * kPieceUnits / 3);
    chain.run(2 * kPieceUnits / 3, kPieceUnits);
    r.chain_inverse = chain.take().inverse;
    const auto grad = random_matrix(cols, cols, 92);
    r.preconditioned = RowMatrixF(cols, cols);
    precondition(r.inverse, r.inverse, grad.data(), nullptr, cols, cols, r.preconditioned.data(),
                 nullptr);
    r.kl_dot =
        kl_clip_dot(r.preconditioned.data(), grad.data(), static_cast<std::size_t>(cols * cols));
    const EigenFactor factor = eigen_factor(r.gram);
    r.eigen_preconditioned = RowMatrixF(cols, cols);
    precondition_eigen_exact(factor, factor, 0.05F, grad.data(), nullptr, cols, cols,
                             r.eigen_preconditioned.data(), nullptr);
    return r;
  };
  const int original = omp_get_max_threads();
  for (const auto& [rows, cols] :
       {std::pair<std::int64_t, std::int64_t>{1024, 300}, {700, 600}, {200, 96}, {512, 513}}) {
    omp_set_num_threads(1);
    const Result one = run(rows, cols);
    for (const int threads : {2, 3, 4}) {
      omp_set_num_threads(threads);
      const Result many = run(rows, cols);
      EXPECT_TRUE(many.gram == one.gram) << rows << " x " << cols << ", " << threads << " threads";
      EXPECT_TRUE(many.inverse == one.inverse) << rows << " x " << cols << ", " << threads;
      EXPECT_TRUE(many.eigen_inverse == one.eigen_inverse)
          << rows << " x " << cols << ", " << threads;
      EXPECT_TRUE(many.chain_inverse == one.chain_inverse)
          << rows << " x " << cols << ", " << threads;
      EXPECT_TRUE(many.preconditioned == one.preconditioned)
          << rows << " x " << cols << ", " << threads;
      EXPECT_TRUE(many.eigen_preconditioned == one.eigen_preconditioned)
          << rows << " x " << cols << ", " << threads;
      EXPECT_EQ(many.kl_dot, one.kl_dot) << rows << " x " << cols << ", " << threads;
    }
  }
  omp_set_num_threads(original);
}

TEST(KfacFactors, OneSampleKroneckerEqualsTheExactFisherBlock) {
  // For one token, the per-example weight gradient is g a^T; its outer product is the exact
  // Fisher block of the weight, and K-FAC's kron(B, A) reproduces it.
  const std::int64_t d_in = 4, d_out = 3;
  const auto a = random_matrix(1, d_in, 11);
  const auto g = random_matrix(1, d_out, 12);
  KfacLayerState layer(d_in, d_out);
  accumulate_a(layer, a.data(), 1);
  accumulate_b(layer, g.data(), 1, output_grad_scale(1, 1));
  finalize_a(layer);
  finalize_b(layer);
  const RowMatrixD per_example_grad = g.cast<double>().transpose() * a.cast<double>();
  const Eigen::VectorXd v = vec(per_example_grad);
  const Eigen::MatrixXd fisher = v * v.transpose();
  const Eigen::MatrixXd kfac = kron(layer.b.value.cast<double>(), layer.a.value.cast<double>());
  EXPECT_LT(max_relative_error(kfac, fisher), 1e-6);
}

TEST(KfacFactors, OutputGradScaleUndoesTheLossMean) {
  // A loss averaged over T tokens back-propagates g_t = delta_t / T; with s = T the factor is the
  // mean per-token outer product E_t[delta delta^T].
  const std::int64_t tokens = 6, d_out = 3;
  const auto delta = random_matrix(tokens, d_out, 21);
  const RowMatrixF g = delta / static_cast<float>(tokens);
  KfacLayerState layer(2, d_out);
  accumulate_b(layer, g.data(), tokens, output_grad_scale(tokens, tokens));
  finalize_b(layer);
  const Eigen::MatrixXd expected =
      delta.cast<double>().transpose() * delta.cast<double>() / static_cast<double>(tokens);
  EXPECT_LT(max_relative_error(layer.b.value.cast<double>(), expected), 1e-6);
  EXPECT_FLOAT_EQ(output_grad_scale(20, 4096), 400.0F / 4096.0F);  // MLM: mean over 20 masks
  EXPECT_FLOAT_EQ(output_grad_scale(8, 8, 4), 128.0F);             // and divided by k = 4
  EXPECT_THROW(output_grad_scale(0, 8), std::invalid_argument);
}

TEST(KfacFactors, RefreshAveragesMicroBatchesThenReplacesOrBlends) {
  const std::int64_t d_in = 3;
  const auto first = random_matrix(4, d_in, 31);
  const auto second = random_matrix(9, d_in, 32);
  const auto gram = [](const RowMatrixF& x) {
    return Eigen::MatrixXd(x.cast<double>().transpose() * x.cast<double>() /
                           static_cast<double>(x.rows()));
  };
  KfacLayerState layer(d_in, 2);
  accumulate_a(layer, first.data(), 4);
  accumulate_a(layer, second.data(), 9);
  EXPECT_EQ(layer.a.microbatches, 2);
  finalize_a(layer, 0.9F);  // the first refresh replaces whatever the average says
  const Eigen::MatrixXd refresh1 = (gram(first) + gram(second)) / 2.0;
  EXPECT_LT(max_relative_error(layer.a.value.cast<double>(), refresh1), 1e-6);
  EXPECT_EQ(layer.a.microbatches, 0);
  EXPECT_EQ(layer.a.sum.size(), 0);
  EXPECT_EQ(layer.a.refreshes, 1);
  EXPECT_EQ(layer.a.value, layer.a.value.transpose());

  accumulate_a(layer, second.data(), 9);
  finalize_a(layer, 0.9F);
  const Eigen::MatrixXd blended = 0.9 * refresh1 + 0.1 * gram(second);
  EXPECT_LT(max_relative_error(layer.a.value.cast<double>(), blended), 1e-6);

  accumulate_a(layer, first.data(), 4);
  finalize_a(layer);  // PipeFisher: replace
  EXPECT_LT(max_relative_error(layer.a.value.cast<double>(), gram(first)), 1e-6);

  EXPECT_THROW(finalize_a(layer), std::logic_error);
  accumulate_a(layer, first.data(), 4);
  EXPECT_THROW(finalize_a(layer, 1.0F), std::invalid_argument);
  EXPECT_THROW(accumulate_a(layer, first.data(), 0), std::invalid_argument);
}

TEST(KfacDamping, PiAgainstHandValues) {
  Eigen::MatrixXf a = Eigen::Vector3f(1.0F, 2.0F, 3.0F).asDiagonal();  // tr / 3 = 2
  Eigen::MatrixXf b = Eigen::Vector2f(4.0F, 4.0F).asDiagonal();        // tr / 2 = 4
  EXPECT_NEAR(pi_adjustment(a, b), std::sqrt(0.5), 1e-12);
  const auto damping = factored_damping(a, b, 0.01F);
  EXPECT_NEAR(damping.a, 0.1 * std::sqrt(0.5), 1e-7);
  EXPECT_NEAR(damping.b, 0.1 / std::sqrt(0.5), 1e-7);
  const auto plain = factored_damping(a, b, 0.01F, false);
  EXPECT_FLOAT_EQ(plain.a, 0.1F);
  EXPECT_FLOAT_EQ(plain.b, 0.1F);
  // A dead output (B = 0) hits the trace floor instead of dividing by zero.
  const Eigen::MatrixXf zero = Eigen::MatrixXf::Zero(2, 2);
  EXPECT_NEAR(pi_adjustment(a, zero), std::sqrt(2.0 / kTraceFloor), 1e-6);
  EXPECT_THROW(factored_damping(a, b, -1.0F), std::invalid_argument);
  EXPECT_THROW(pi_adjustment(Eigen::MatrixXf(2, 3), b), std::invalid_argument);
}

TEST(KfacInverse, CholeskyAndEigenAgreeAndAreSymmetric) {
  auto layer = layer_with_factors(6, 5, 40, 41);
  const auto cholesky = damped_inverse(layer.a.value, 0.05F, InverseMethod::kCholesky);
  const auto eigen = damped_inverse(layer.a.value, 0.05F, InverseMethod::kEigen);
  EXPECT_FALSE(cholesky.fell_back_to_eigen);
  EXPECT_EQ(cholesky.inverse, cholesky.inverse.transpose());
  EXPECT_EQ(eigen.inverse, eigen.inverse.transpose());
  EXPECT_LT(max_relative_error(cholesky.inverse.cast<double>(), eigen.inverse.cast<double>()),
            1e-4);
  Eigen::MatrixXd damped = layer.a.value.cast<double>();
  damped.diagonal().array() += 0.05;
  const Eigen::MatrixXd exact = damped.inverse();
  EXPECT_LT(max_relative_error(cholesky.inverse.cast<double>(), exact), 1e-4);
}

TEST(KfacInverse, LargeFactorsTakeTheThreadedSolveAndStayExact) {
  // 300 >= 256 columns: the solve against I runs in column blocks on the OpenMP threads.
  const std::int64_t dim = 300;
  const Eigen::MatrixXf factor = gram_factor(dim, 2 * dim, 81);
  const auto result = damped_inverse(factor, 0.1F, InverseMethod::kCholesky);
  EXPECT_FALSE(result.fell_back_to_eigen);
  EXPECT_EQ(result.inverse, result.inverse.transpose());
  Eigen::MatrixXd damped = factor.cast<double>();
  damped.diagonal().array() += 0.1;
  EXPECT_LT(max_relative_error(result.inverse.cast<double>(), damped.inverse()), 1e-4);
  const auto eigen = damped_inverse(factor, 0.1F, InverseMethod::kEigen);
  EXPECT_LT(max_relative_error(eigen.inverse.cast<double>(), damped.inverse()), 1e-4);
}

TEST(KfacInverse, PaddedStorageKeepsTheBitsOfDenseStorage) {
  // The leading dimension: whole 64-byte lines, never a multiple of 512 bytes.
  for (Eigen::Index n : {1, 15, 16, 127, 128, 300, 1024, 4096}) {
    const Eigen::Index rows = padded_leading_dimension(n);
    EXPECT_GE(rows, n);
    EXPECT_EQ(rows % 16, 0) << n;
    EXPECT_NE(rows % 128, 0) << n;
    EXPECT_LE(rows, n + 31) << n;
  }
  // The inverse in padded storage against the same LLT and column-block solves on a dense
  // n x n matrix: the kernels' arithmetic does not depend on the stride, so the bits are equal.
  // 512 is a padded order (512 floats = 2 KiB).
  for (const std::int64_t dim : {std::int64_t{200}, std::int64_t{512}}) {
    const Eigen::MatrixXf factor = gram_factor(dim, 2 * dim, 83);
    Eigen::MatrixXf damped = factor;
    damped.diagonal().array() += 0.01F;
    ASSERT_TRUE(cholesky_lower(damped));
    Eigen::MatrixXf dense(dim, dim);
    for (Eigen::Index first = 0; first < dim; first += 128) {
      cholesky_inverse_columns(damped, dense, first, std::min<Eigen::Index>(128, dim - first));
    }
    fill_upper_from_lower(dense);
    const auto padded = damped_inverse(factor, 0.01F, InverseMethod::kCholesky);
    ASSERT_FALSE(padded.fell_back_to_eigen);
    EXPECT_EQ(padded.inverse, dense) << dim;
  }
}

// Column blocks of (L L^T)^-1 from L's trailing blocks, the lower triangle only, then mirrored:
// the inverse to fp32 rounding (against a double inverse), exactly symmetric, for blocks that
// do not divide the order; rows above a block's first are left alone until the mirror.
TEST(KfacInverse, LowerColumnBlocksOfTheCholeskyInverseAreTheInverse) {
  for (const std::int64_t dim : {std::int64_t{1}, std::int64_t{7}, std::int64_t{300}}) {
    Eigen::MatrixXf factor = gram_factor(dim, 3 * dim, 85);
    factor.diagonal().array() += 0.05F;
    const Eigen::LLT<Eigen::MatrixXf, Eigen::Lower> llt(factor);
    constexpr float kUntouched = 12345.0F;
    Eigen::MatrixXf inverse = Eigen::MatrixXf::Constant(dim, dim, kUntouched);
    const Eigen::Index block = 64;
    for (Eigen::Index first = 0; first < dim; first += block) {
      cholesky_inverse_columns(llt.matrixLLT(), inverse, first, std::min(block, dim - first));
    }
    for (Eigen::Index j = 0; j < dim; ++j) {
      for (Eigen::Index i = 0; i < j / block * block; ++i) {
        EXPECT_EQ(inverse(i, j), kUntouched) << dim << ": (" << i << ", " << j << ")";
      }
    }
    fill_upper_from_lower(inverse);
    EXPECT_EQ(inverse, inverse.transpose()) << dim;
    const Eigen::MatrixXd exact = factor.cast<double>().inverse();
    EXPECT_LT(max_relative_error(inverse.cast<double>(), exact), 1e-4) << dim;
  }
  Eigen::MatrixXf square = Eigen::MatrixXf::Zero(4, 4);
  EXPECT_THROW(cholesky_inverse_columns(square, square, 3, 2), std::invalid_argument);
  Eigen::MatrixXf wide(2, 3);
  EXPECT_THROW(fill_upper_from_lower(wide), std::invalid_argument);
}

// The Cholesky factor on the calling thread (OpenBLAS's potrf where the build has it) is Eigen's
// LLT to fp32 rounding, leaves the upper triangle alone, and reports a matrix that is not
// positive definite.
TEST(KfacInverse, CholeskyLowerIsTheLltAndReportsIndefiniteMatrices) {
  for (const std::int64_t dim : {std::int64_t{1}, std::int64_t{33}, std::int64_t{300}}) {
    Eigen::MatrixXf factor = gram_factor(dim, 2 * dim, 87);
    factor.diagonal().array() += 0.01F;
    Eigen::MatrixXf lower = factor;
    lower.triangularView<Eigen::StrictlyUpper>().setConstant(7.0F);
    ASSERT_TRUE(cholesky_lower(lower)) << dim;
    const Eigen::LLT<Eigen::MatrixXf, Eigen::Lower> llt(factor);
    const Eigen::MatrixXf expected = llt.matrixL();
    const Eigen::MatrixXf actual = lower.triangularView<Eigen::Lower>();
    EXPECT_LT((actual - expected).norm() / expected.norm(), 1e-5) << dim;
    for (Eigen::Index j = 1; j < dim; ++j) EXPECT_EQ(lower(0, j), 7.0F) << dim;
  }
  Eigen::MatrixXf indefinite(2, 2);
  indefinite << 1.0F, 2.0F, 2.0F, 1.0F;
  EXPECT_FALSE(cholesky_lower(indefinite));
  Eigen::MatrixXf wide(2, 3);
  EXPECT_THROW(cholesky_lower(wide), std::invalid_argument);
}

TEST(KfacInverse, FallsBackToEigenWhenCholeskyFails) {
  // Eigenvalues -1 and 3: not positive definite; eigen clamps -1 to 0 before damping.
  Eigen::MatrixXf indefinite(2, 2);
  indefinite << 1.0F, 2.0F, 2.0F, 1.0F;
  const auto result = damped_inverse(indefinite, 0.5F, InverseMethod::kCholesky);
  EXPECT_TRUE(result.fell_back_to_eigen);
  Eigen::MatrixXd q(2, 2);
  q << -std::sqrt(0.5), std::sqrt(0.5), std::sqrt(0.5), std::sqrt(0.5);
  const Eigen::MatrixXd expected =
      q * Eigen::Vector2d(1.0 / 0.5, 1.0 / 3.5).asDiagonal() * q.transpose();
  EXPECT_LT(max_relative_error(result.inverse.cast<double>(), expected), 1e-6);
  // Singular and undamped: no inverse exists.
  EXPECT_THROW(damped_inverse(Eigen::MatrixXf::Zero(2, 2), 0.0F, InverseMethod::kCholesky),
               std::runtime_error);
  Eigen::MatrixXf not_finite = Eigen::MatrixXf::Identity(2, 2);
  not_finite(1, 0) = std::nanf("");
  EXPECT_THROW(damped_inverse(not_finite, 0.1F, InverseMethod::kCholesky), std::runtime_error);
}

TEST(KfacPrecondition, EqualsDenseSolveWithKroneckerFactoredDamping) {
  const std::int64_t d_in = 5, d_out = 4;
  auto layer = layer_with_factors(d_in, d_out, 30, 51);
  const auto damping = layer_damping(layer, 1e-2F);
  for (const auto method : {InverseMethod::kCholesky, InverseMethod::kEigen}) {
    invert_a(layer, damping.a, method);
    invert_b(layer, damping.b, method);
    const auto grad = random_matrix(d_out, d_in, 52);
    const auto grad_b = random_matrix(d_out, 1, 53);
    RowMatrixF out(d_out, d_in);
    Eigen::VectorXf out_b(d_out);
    precondition_layer(layer, grad.data(), grad_b.data(), out.data(), out_b.data());

    // The damped inverse corresponds to the dense matrix (B + d_B I) kron (A + d_A I).
    Eigen::MatrixXd a = layer.a.value.cast<double>();
    Eigen::MatrixXd b = layer.b.value.cast<double>();
    a.diagonal().array() += damping.a;
    b.diagonal().array() += damping.b;
    const Eigen::VectorXd expected = kron(b, a).ldlt().solve(vec(grad.cast<double>()));
    const RowMatrixD actual = out.cast<double>();
    EXPECT_LT((vec(actual) - expected).cwiseAbs().maxCoeff() / expected.cwiseAbs().maxCoeff(),
              1e-4);
    // Bias: B's block only.
    const Eigen::VectorXd expected_b =
        b.ldlt().solve(Eigen::VectorXd(grad_b.cast<double>().col(0)));
    EXPECT_LT((out_b.cast<double>() - expected_b).cwiseAbs().maxCoeff() /
                  expected_b.cwiseAbs().maxCoeff(),
              1e-4);
    // In place gives the same.
    RowMatrixF in_place = grad;
    RowMatrixF bias_in_place = grad_b;
    precondition_layer(layer, in_place.data(), bias_in_place.data(), in_place.data(),
                       bias_in_place.data());
    EXPECT_EQ(in_place, out);
  }
}

TEST(KfacPrecondition, EigenExactEqualsDenseSolveWithPlainDamping) {
  const std::int64_t d_in = 4, d_out = 3;
  auto layer = layer_with_factors(d_in, d_out, 10, 61);
  const float lambda = 0.03F;
  const auto a = eigen_factor(layer.a.value);
  const auto b = eigen_factor(layer.b.value);
  const auto grad = random_matrix(d_out, d_in, 62);
  const auto grad_b = random_matrix(d_out, 1, 63);
  RowMatrixF out(d_out, d_in);
  Eigen::VectorXf out_b(d_out);
  precondition_eigen_exact(a, b, lambda, grad.data(), grad_b.data(), d_out, d_in, out.data(),
                           out_b.data());
  Eigen::MatrixXd dense = kron(layer.b.value.cast<double>(), layer.a.value.cast<double>());
  dense.diagonal().array() += lambda;
  const Eigen::VectorXd expected = dense.ldlt().solve(vec(grad.cast<double>()));
  const RowMatrixD actual = out.cast<double>();
  EXPECT_LT((vec(actual) - expected).cwiseAbs().maxCoeff() / expected.cwiseAbs().maxCoeff(), 1e-4);
  Eigen::MatrixXd bias_block = layer.b.value.cast<double>();
  bias_block.diagonal().array() += lambda;
  const Eigen::VectorXd expected_b =
      bias_block.ldlt().solve(Eigen::VectorXd(grad_b.cast<double>().col(0)));
  EXPECT_LT(
      (out_b.cast<double>() - expected_b).cwiseAbs().maxCoeff() / expected_b.cwiseAbs().maxCoeff(),
      1e-4);
}

TEST(KfacPrecondition, RejectsMissingInversesAndWrongSizes) {
  KfacLayerState layer(3, 2);
  std::vector<float> grad(6), out(6);
  EXPECT_THROW(precondition_layer(layer, grad.data(), nullptr, out.data(), nullptr),
               std::logic_error);
  const Eigen::MatrixXf a_inv = Eigen::MatrixXf::Identity(3, 3);
  const Eigen::MatrixXf b_inv = Eigen::MatrixXf::Identity(3, 3);
  EXPECT_THROW(precondition(a_inv, b_inv, grad.data(), nullptr, 2, 3, out.data(), nullptr),
               std::invalid_argument);
  std::vector<float> bias(2);
  EXPECT_THROW(precondition(a_inv, Eigen::MatrixXf::Identity(2, 2), grad.data(), bias.data(), 2, 3,
                            out.data(), nullptr),
               std::invalid_argument);
  EXPECT_THROW(invert_a(layer, 0.1F), std::logic_error);
  EXPECT_THROW(layer_damping(layer, 0.1F), std::logic_error);
  EXPECT_THROW(KfacLayerState(0, 3), std::invalid_argument);
}

TEST(KfacKlClip, AgainstHandValues) {
  const std::vector<float> precond = {1.0F, -2.0F, 0.5F};
  const std::vector<float> grad = {2.0F, 1.0F, 4.0F};
  EXPECT_DOUBLE_EQ(kl_clip_dot(precond.data(), grad.data(), 3), 2.0);  // 2 - 2 + 2
  // nu = min(1, sqrt(kappa / (|2| * lr^2))) = sqrt(0.001 / 0.02)
  EXPECT_NEAR(kl_clip_scale(2.0, 0.1F, 0.001F), std::sqrt(0.05), 1e-7);
  EXPECT_NEAR(kl_clip_scale(-2.0, 0.1F, 0.001F), std::sqrt(0.05), 1e-7);
  EXPECT_EQ(kl_clip_scale(2.0, 0.1F, 1.0F), 1.0F);
  EXPECT_EQ(kl_clip_scale(0.0, 0.1F, 0.001F), 1.0F);
  EXPECT_THROW(kl_clip_scale(1.0, 0.1F, 0.0F), std::invalid_argument);
  // The parallel path gives the same sum.
  std::vector<float> ones(200000, 0.5F);
  EXPECT_DOUBLE_EQ(kl_clip_dot(ones.data(), ones.data(), ones.size()), 50000.0);
}

TEST(KfacState, RoundTripsThroughSafetensorsIncludingARefreshInProgress) {
  KfacState state;
  const LayerKey query{3, sched::LinearKind::kQuery};
  const LayerKey ffn_out{0, sched::LinearKind::kFfnOut};
  auto& q = state.add_layer(query, 4, 4);
  q = layer_with_factors(4, 4, 12, 71);
  const auto damping = layer_damping(q, 1e-3F);
  invert_a(q, damping.a);
  invert_b(q, damping.b);
  const auto more = random_matrix(5, 4, 72);
  accumulate_a(q, more.data(), 5);  // a refresh under way
  state.add_layer(ffn_out, 8, 4);   // never touched

  const auto records = state.state_records();
  bool named = false;
  for (const auto& record : records) named = named || record.name == "kfac.layer.3.query.A";
  EXPECT_TRUE(named);
  const auto file = ckpt::parse_safetensors(ckpt::serialize_safetensors(records, {}), "memory");

  KfacState restored;
  restored.add_layer(query, 4, 4);
  restored.add_layer(ffn_out, 8, 4);
  restored.load_state(file);
  const auto& r = restored.at(query);
  EXPECT_EQ(r.a.value, q.a.value);
  EXPECT_EQ(r.b.inverse, q.b.inverse);
  EXPECT_EQ(r.a.sum, q.a.sum);
  EXPECT_EQ(r.a.microbatches, 1);
  EXPECT_EQ(r.a.refreshes, 1);
  EXPECT_EQ(r.a.damping, q.a.damping);
  EXPECT_EQ(restored.at(ffn_out).a.refreshes, 0);
  EXPECT_EQ(restored.at(ffn_out).a.value.size(), 0);

  // Dimensions that disagree with the file name the record.
  KfacState mismatched;
  mismatched.add_layer(query, 5, 4);
  try {
    mismatched.load_state(file);
    FAIL() << "no error";
  } catch (const std::runtime_error& error) {
    EXPECT_NE(std::string(error.what()).find("kfac.layer.3.query.A"), std::string::npos)
        << error.what();
  }
  EXPECT_THROW(state.add_layer(query, 5, 4), std::invalid_argument);
  EXPECT_THROW(state.at(LayerKey{9, sched::LinearKind::kKey}), std::out_of_range);
}

// A checkpoint saved inside a refresh window may hold the first pieces of a divided curvature
// task (its rows summed, the micro-batch not yet counted): the sum is saved and restored, while
// a matrix the counters rule out is still refused with the record's name.
TEST(KfacState, APartialCurvaturePieceRoundTripsAndStaleMatricesAreRefused) {
  KfacState state;
  const LayerKey ffn_out{2, sched::LinearKind::kFfnOut};
  auto& layer = state.add_layer(ffn_out, 4, 3);
  const auto rows = random_matrix(6, 4, 81);
  accumulate_a(layer, rows.data(), 6, 0, kPieceUnits / 3);  // the first third of the tokens
  ASSERT_EQ(layer.a.microbatches, 0);
  ASSERT_GT(layer.a.sum.size(), 0);
  const auto file =
      ckpt::parse_safetensors(ckpt::serialize_safetensors(state.state_records(), {}), "part.st");

  KfacState restored;
  restored.add_layer(ffn_out, 4, 3);
  restored.load_state(file);
  auto& r = restored.at(ffn_out);  // load_state replaces the layers
  ASSERT_EQ(r.a.sum.size(), layer.a.sum.size());
  EXPECT_EQ(r.a.sum, layer.a.sum);
  EXPECT_EQ(r.a.microbatches, 0);
  // The rest of the micro-batch after the resume gives the same bits as one uninterrupted task.
  accumulate_a(layer, rows.data(), 6, kPieceUnits / 3, kPieceUnits);
  accumulate_a(r, rows.data(), 6, kPieceUnits / 3, kPieceUnits);
  EXPECT_EQ(r.a.sum, layer.a.sum);
  EXPECT_EQ(r.a.microbatches, 1);

  // A factor never refreshed here may hold an inverse (a replica without the factors receives
  // the owner's by broadcast: kfac/state_placement.h): loaded as it is.
  const auto inverse_record =
      ckpt::make_f32_record("kfac.layer.2.ffn_out.A_inv", {4, 4}, std::vector<float>(16, 1.0F));
  auto records = state.state_records();
  records.push_back(inverse_record);
  {
    KfacState received;
    received.add_layer(ffn_out, 4, 3);
    received.load_state(
        ckpt::parse_safetensors(ckpt::serialize_safetensors(records, {}), "received.st"));
    EXPECT_EQ(received.at(ffn_out).a.inverse, Eigen::MatrixXf::Ones(4, 4));
  }
  // An inverse of a factor refreshed but never inverted is stale: refused, naming the record
  // and the file.
  accumulate_a(layer, rows.data(), 6, 0, kPieceUnits);
  finalize_a(layer);
  records = state.state_records();
  records.push_back(inverse_record);
  const auto stale = ckpt::parse_safetensors(ckpt::serialize_safetensors(records, {}), "stale.st");
  try {
    KfacState other;
    other.add_layer(ffn_out, 4, 3);
    other.load_state(stale);
    FAIL() << "no error";
  } catch (const std::runtime_error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("kfac.layer.2.ffn_out.A_inv"), std::string::npos) << message;
    EXPECT_NE(message.find("'stale.st'"), std::string::npos) << message;
  }
}

TEST(KfacSharding, GreedyLargestFirstToTheLeastLoaded) {
  const std::vector<double> costs = {4.0, 10.0, 3.0, 7.0, 5.0};
  // 10 -> w0; 7 -> w1; 5 -> w1 (7 < 10); 4 -> w0 (10 < 12); 3 -> w1 (12 < 14).
  EXPECT_EQ(assign_greedy(costs, 2), (std::vector<int>{0, 0, 1, 1, 1}));
  EXPECT_EQ(assign_greedy(costs, 1), (std::vector<int>{0, 0, 0, 0, 0}));
  EXPECT_THROW(assign_greedy(costs, 0), std::invalid_argument);
  EXPECT_THROW(assign_greedy(std::vector<double>{-1.0}, 2), std::invalid_argument);
}

TEST(KfacSharding, GradWorkerFractionChoosesMemOptHybridOrCommOpt) {
  // BERT-style: attention Linear 4x4 (cost 128) and FFN 4x16 (cost 4160), two layers.
  const std::vector<LinearDims> layers = {{4, 4}, {4, 16}, {4, 4}, {16, 4}};
  const auto mem = plan_kfac_sharding(layers, 4, 0.25);
  EXPECT_EQ(mem.grad_workers, 1);
  // Costs 128, 4160, 128, 4160 -> 4160s to ranks 0 and 1, 128s to ranks 2 and 3.
  EXPECT_EQ(mem.inverse_worker, (std::vector<int>{2, 0, 3, 1}));
  EXPECT_EQ(mem.grad_worker_ranks[1], (std::vector<int>{0}));
  EXPECT_EQ(mem.inverse_bytes, (std::vector<std::int64_t>{4 * 272, 4 * 272, 4 * 32, 4 * 32}));

  const auto hybrid = plan_kfac_sharding(layers, 4, 0.5);
  EXPECT_EQ(hybrid.grad_workers, 2);
  EXPECT_EQ(hybrid.grad_worker_ranks[0], (std::vector<int>{2, 3}));
  EXPECT_EQ(hybrid.grad_worker_ranks[1], (std::vector<int>{0, 1}));
  EXPECT_EQ(hybrid.inverse_bytes[0], 4 * (272 + 272));

  const auto comm = plan_kfac_sharding(layers, 4, 1.0);
  EXPECT_EQ(comm.grad_worker_ranks[2], (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(comm.inverse_bytes[3], 4 * (32 + 272 + 32 + 272));
  EXPECT_DOUBLE_EQ(comm.inversion_load[0], 4160.0);

  EXPECT_THROW(plan_kfac_sharding(layers, 4, 0.75), std::invalid_argument);  // 3 does not divide 4
  EXPECT_THROW(plan_kfac_sharding(layers, 4, 0.0), std::invalid_argument);
  EXPECT_THROW(plan_kfac_sharding(layers, 0, 1.0), std::invalid_argument);
}

}  // namespace
}  // namespace pf::kfac
