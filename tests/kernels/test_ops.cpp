// Every op's backward against central finite differences in double precision, plus the
// forward against direct formulas where one exists.
#include <omp.h>

#include <cmath>
#include <random>
#include <set>

#include <gtest/gtest.h>

#include "kernels/ops.h"
#include "kernels/rng.h"
#include "tests/kernels/finite_difference.h"

namespace pf::kernels {
namespace {

using pf::testing::dot;
using pf::testing::expect_gradients_near;
using pf::testing::numeric_gradient;
using pf::testing::random_vector;
using Vec = std::vector<double>;

MatrixView<double> view(Vec& v, std::int64_t rows, std::int64_t cols) {
  return {v.data(), rows, cols};
}

TEST(Gemm, AllTransposesMatchTheDefinition) {
  std::mt19937_64 rng(1);
  const std::int64_t m = 3, k = 4, n = 5;
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      Vec a = random_vector(static_cast<std::size_t>(m * k), rng);
      Vec b = random_vector(static_cast<std::size_t>(k * n), rng);
      Vec c = random_vector(static_cast<std::size_t>(m * n), rng);
      const Vec c0 = c;
      auto av = ta ? view(a, k, m) : view(a, m, k);
      auto bv = tb ? view(b, n, k) : view(b, k, n);
      gemm<double>(av, ta ? Transpose::kYes : Transpose::kNo, bv,
                   tb ? Transpose::kYes : Transpose::kNo, view(c, m, n), 2.0, 0.5);
      for (std::int64_t i = 0; i < m; ++i) {
        for (std::int64_t j = 0; j < n; ++j) {
          double expected = 0.5 * c0[static_cast<std::size_t>(i * n + j)];
          for (std::int64_t p = 0; p < k; ++p) {
            const double x = ta ? a[static_cast<std::size_t>(p * m + i)]
                                : a[static_cast<std::size_t>(i * k + p)];
            const double y = tb ? b[static_cast<std::size_t>(j * k + p)]
                                : b[static_cast<std::size_t>(p * n + j)];
            expected += 2.0 * x * y;
          }
          EXPECT_NEAR(c[static_cast<std::size_t>(i * n + j)], expected, 1e-12);
        }
      }
    }
  }
}

TEST(Gemm, ThreadedRowSplitMatchesTheDefinition) {
  // Large enough for the row-split parallel path (m*n*k >= 2^18), forced onto 3 threads so the
  // blocks are uneven.
  const int saved = omp_get_max_threads();
  omp_set_num_threads(3);
  std::mt19937_64 rng(15);
  const std::int64_t m = 101, k = 64, n = 70;
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      Vec a = random_vector(static_cast<std::size_t>(m * k), rng);
      Vec b = random_vector(static_cast<std::size_t>(k * n), rng);
      Vec c = random_vector(static_cast<std::size_t>(m * n), rng);
      const Vec c0 = c;
      gemm<double>(ta ? view(a, k, m) : view(a, m, k), ta ? Transpose::kYes : Transpose::kNo,
                   tb ? view(b, n, k) : view(b, k, n), tb ? Transpose::kYes : Transpose::kNo,
                   view(c, m, n), 1.5, 1.0);
      for (std::int64_t i = 0; i < m; ++i) {
        for (std::int64_t j = 0; j < n; ++j) {
          double expected = c0[static_cast<std::size_t>(i * n + j)];
          for (std::int64_t p = 0; p < k; ++p) {
            const double x = ta ? a[static_cast<std::size_t>(p * m + i)]
                                : a[static_cast<std::size_t>(i * k + p)];
            const double y = tb ? b[static_cast<std::size_t>(j * k + p)]
                                : b[static_cast<std::size_t>(p * n + j)];
            expected += 1.5 * x * y;
          }
          ASSERT_NEAR(c[static_cast<std::size_t>(i * n + j)], expected, 1e-11)
              << "ta " << ta << " tb " << tb << " at " << i << "," << j;
        }
      }
    }
  }
  omp_set_num_threads(saved);
}

TEST(Gemm, BitsAreTheSameForAnyThreadCount) {
  // The products are cut into blocks by their shape only (kernels/cpu/gemm.cpp): a BLAS rounds
  // a row differently depending on where a block boundary falls, so a cut by thread count would
  // change the result with it. Tall (cut by rows), wide (cut by columns), each transposition;
  // and one product too narrow to cut but large enough for Eigen's GEMM to thread itself (with
  // blocks sized by its thread count) if it ran outside an OpenMP team.
  const int saved = omp_get_max_threads();
  std::mt19937_64 rng(16);
  struct Shape {
    std::int64_t m, n, k;
  };
  for (const Shape shape :
       {Shape{1000, 70, 64}, Shape{40, 900, 96}, Shape{300, 300, 33}, Shape{200, 200, 512}}) {
    for (int ta = 0; ta < 2; ++ta) {
      for (int tb = 0; tb < 2; ++tb) {
        const auto [m, n, k] = shape;
        std::vector<float> a(static_cast<std::size_t>(m * k)), b(static_cast<std::size_t>(k * n));
        std::uniform_real_distribution<float> uniform(-1.0F, 1.0F);
        for (float& x : a) x = uniform(rng);
        for (float& x : b) x = uniform(rng);
        std::vector<std::vector<float>> results;
        for (int threads : {1, 2, 3}) {
          omp_set_num_threads(threads);
          std::vector<float> c(static_cast<std::size_t>(m * n), 0.25F);
          gemm<float>(
              ta ? ConstMatrixView<float>(a.data(), k, m) : ConstMatrixView<float>(a.data(), m, k),
              ta ? Transpose::kYes : Transpose::kNo,
              tb ? ConstMatrixView<float>(b.data(), n, k) : ConstMatrixView<float>(b.data(), k, n),
              tb ? Transpose::kYes : Transpose::kNo, MatrixView<float>(c.data(), m, n), 0.5F, 1.0F);
          results.push_back(std::move(c));
        }
        EXPECT_EQ(results[0], results[1])
            << m << "x" << n << "x" << k << " ta " << ta << " tb " << tb;
        EXPECT_EQ(results[0], results[2])
            << m << "x" << n << "x" << k << " ta " << ta << " tb " << tb;
      }
    }
  }
  omp_set_num_threads(saved);
}

TEST(Bias, BackwardAddsColumnSumsTheSameForAnyThreadCount) {
  // Rows span several 256-row chunks, columns a few 16-wide blocks plus a remainder, and the
  // view is strided (ld > cols); large enough for the threaded path. The float sums are
  // compared bit for bit between 1 and 3 threads, and against double sums.
  const std::int64_t rows = 700, cols = 75, ld = 80;
  std::mt19937_64 rng(23);
  const Vec source = random_vector(static_cast<std::size_t>(rows * ld), rng);
  std::vector<float> dy(source.begin(), source.end());
  const ConstMatrixView<float> dy_view(dy.data(), rows, cols, ld);
  const int saved = omp_get_max_threads();
  std::vector<std::vector<float>> results;
  for (int threads : {1, 3}) {
    omp_set_num_threads(threads);
    std::vector<float> dbias(static_cast<std::size_t>(cols), 0.5F);
    bias_backward<float>(dy_view, dbias.data());
    results.push_back(dbias);
  }
  omp_set_num_threads(saved);
  EXPECT_EQ(results[0], results[1]);
  for (std::int64_t j = 0; j < cols; ++j) {
    double expected = 0.5;
    for (std::int64_t i = 0; i < rows; ++i) {
      expected += static_cast<double>(dy[static_cast<std::size_t>(i * ld + j)]);
    }
    EXPECT_NEAR(results[0][static_cast<std::size_t>(j)], expected, 1e-4) << "column " << j;
  }
}

TEST(Gemm, RejectsMismatchedShapes) {
  Vec a(6), b(6), c(4);
  EXPECT_THROW(
      gemm<double>(view(a, 2, 3), Transpose::kNo, view(b, 2, 3), Transpose::kNo, view(c, 2, 2)),
      std::invalid_argument);
}

TEST(Gemm, BatchedEqualsLoopOfProducts) {
  std::mt19937_64 rng(2);
  const std::int64_t count = 3, m = 2, k = 3, n = 4;
  Vec a = random_vector(static_cast<std::size_t>(count * m * k), rng);
  Vec b = random_vector(static_cast<std::size_t>(count * n * k), rng);
  Vec c(static_cast<std::size_t>(count * m * n)), expected(c.size());
  batched_gemm<double>(count, view(a, m, k), m * k, Transpose::kNo, view(b, n, k), n * k,
                       Transpose::kYes, view(c, m, n), m * n);
  for (std::int64_t i = 0; i < count; ++i) {
    gemm<double>({a.data() + i * m * k, m, k}, Transpose::kNo, {b.data() + i * n * k, n, k},
                 Transpose::kYes, {expected.data() + i * m * n, m, n});
  }
  for (std::size_t i = 0; i < c.size(); ++i) EXPECT_DOUBLE_EQ(c[i], expected[i]);
}

TEST(Linear, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(3);
  const std::int64_t rows = 4, in = 3, out = 5;
  Vec x = random_vector(static_cast<std::size_t>(rows * in), rng);
  Vec w = random_vector(static_cast<std::size_t>(out * in), rng);
  Vec b = random_vector(static_cast<std::size_t>(out), rng);
  const Vec r = random_vector(static_cast<std::size_t>(rows * out), rng);
  Vec y(r.size());
  auto loss = [&] {
    linear_forward<double>(view(x, rows, in), view(w, out, in), b.data(), view(y, rows, out));
    return dot(y, r);
  };
  Vec dx(x.size()), dw(w.size(), 0.0), db(b.size(), 0.0);
  Vec dy = r;
  linear_backward<double>(view(x, rows, in), view(w, out, in), view(dy, rows, out),
                          view(dx, rows, in), view(dw, out, in), db.data());
  expect_gradients_near(dx, numeric_gradient(x, loss), "dx");
  expect_gradients_near(dw, numeric_gradient(w, loss), "dW");
  expect_gradients_near(db, numeric_gradient(b, loss), "db");
}

TEST(Linear, WeightGradientsAccumulate) {
  Vec x{1, 2}, w{0, 0}, dy{3};
  Vec dw{10, 20}, db{1};
  linear_backward<double>(view(x, 1, 2), view(w, 1, 2), view(dy, 1, 1), MatrixView<double>{},
                          view(dw, 1, 2), db.data());
  EXPECT_DOUBLE_EQ(dw[0], 13);
  EXPECT_DOUBLE_EQ(dw[1], 26);
  EXPECT_DOUBLE_EQ(db[0], 4);
}

TEST(Gelu, ForwardIsTheErfForm) {
  Vec x{-3, -1, -0.1, 0, 0.5, 2}, y(6);
  gelu_forward<double>(view(x, 2, 3), view(y, 2, 3));
  for (std::size_t i = 0; i < x.size(); ++i) {
    EXPECT_NEAR(y[i], 0.5 * x[i] * (1 + std::erf(x[i] / std::sqrt(2.0))), 1e-14);
  }
}

TEST(Gelu, FusedBiasBackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(4);
  const std::int64_t rows = 3, cols = 4;
  Vec x = random_vector(static_cast<std::size_t>(rows * cols), rng, 2.0);
  Vec bias = random_vector(static_cast<std::size_t>(cols), rng);
  const Vec r = random_vector(x.size(), rng);
  Vec pre(x.size()), y(x.size());
  auto loss = [&] {
    pre = x;
    bias_gelu_forward<double>(view(pre, rows, cols), bias.data(), view(y, rows, cols));
    return dot(y, r);
  };
  loss();
  Vec dy = r, dx(x.size());
  gelu_backward<double>(view(pre, rows, cols), view(dy, rows, cols), view(dx, rows, cols));
  Vec dbias(static_cast<std::size_t>(cols), 0.0);
  bias_backward<double>(view(dx, rows, cols), dbias.data());
  expect_gradients_near(dx, numeric_gradient(x, loss), "dx");
  expect_gradients_near(dbias, numeric_gradient(bias, loss), "dbias");
}

TEST(Tanh, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(5);
  Vec x = random_vector(6, rng), bias = random_vector(3, rng);
  const Vec r = random_vector(6, rng);
  Vec pre(6), y(6);
  auto loss = [&] {
    pre = x;
    bias_tanh_forward<double>(view(pre, 2, 3), bias.data(), view(y, 2, 3));
    return dot(y, r);
  };
  loss();
  Vec dy = r, dx(6);
  tanh_backward<double>(view(y, 2, 3), view(dy, 2, 3), view(dx, 2, 3));
  expect_gradients_near(dx, numeric_gradient(x, loss), "dx");
}

TEST(LayerNorm, ForwardNormalisesRows) {
  Vec x{1, 2, 3, 4, 10, 10, 10, 14}, gamma{1, 1, 1, 1}, beta{0, 0, 0, 0}, y(8), mean(2), rstd(2);
  layernorm_forward<double>(view(x, 2, 4), gamma.data(), beta.data(), 1e-12, view(y, 2, 4),
                            mean.data(), rstd.data());
  EXPECT_DOUBLE_EQ(mean[0], 2.5);
  EXPECT_NEAR(rstd[0], 1 / std::sqrt(1.25), 1e-12);
  EXPECT_NEAR(y[0] + y[1] + y[2] + y[3], 0, 1e-12);
  EXPECT_NEAR(y[4], -1 / std::sqrt(3.0), 1e-9);
}

TEST(LayerNorm, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(6);
  const std::int64_t rows = 3, cols = 5;
  Vec x = random_vector(static_cast<std::size_t>(rows * cols), rng);
  Vec gamma = random_vector(static_cast<std::size_t>(cols), rng);
  Vec beta = random_vector(static_cast<std::size_t>(cols), rng);
  const Vec r = random_vector(x.size(), rng);
  Vec y(x.size()), mean(static_cast<std::size_t>(rows)), rstd(mean.size());
  auto loss = [&] {
    layernorm_forward<double>(view(x, rows, cols), gamma.data(), beta.data(), 1e-12,
                              view(y, rows, cols), mean.data(), rstd.data());
    return dot(y, r);
  };
  loss();
  Vec dy = r, dx(x.size()), dgamma(gamma.size(), 0.0), dbeta(beta.size(), 0.0);
  layernorm_backward<double>(view(x, rows, cols), view(dy, rows, cols), gamma.data(), mean.data(),
                             rstd.data(), view(dx, rows, cols), dgamma.data(), dbeta.data());
  expect_gradients_near(dx, numeric_gradient(x, loss), "dx");
  expect_gradients_near(dgamma, numeric_gradient(gamma, loss), "dgamma");
  expect_gradients_near(dbeta, numeric_gradient(beta, loss), "dbeta");
}

TEST(Softmax, MaskedKeysGetZeroWeight) {
  Vec s{1, 2, 3, 4, 0, 0, 0, 0};
  const std::int64_t mask[] = {1, 1, 0, 1};
  masked_softmax_forward<double>(view(s, 2, 4), 1.0, mask);
  EXPECT_NEAR(s[2], 0.0, 1e-300);
  EXPECT_NEAR(s[0] + s[1] + s[3], 1.0, 1e-12);
  EXPECT_NEAR(s[5], 1.0 / 3, 1e-12);
}

TEST(Softmax, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(7);
  Vec x = random_vector(8, rng);
  const Vec r = random_vector(8, rng);
  const std::int64_t mask[] = {1, 0, 1, 1};
  Vec p(8);
  auto loss = [&] {
    p = x;
    masked_softmax_forward<double>(view(p, 2, 4), 0.7, mask);
    return dot(p, r);
  };
  loss();
  Vec dp = r, dx(8);
  softmax_backward<double>(view(p, 2, 4), view(dp, 2, 4), 0.7, view(dx, 2, 4));
  expect_gradients_near(dx, numeric_gradient(x, loss), "dx");
}

TEST(Dropout, MaskDependsOnlyOnSeedAndIndex) {
  const std::int64_t rows = 64, cols = 64;
  Vec x(static_cast<std::size_t>(rows * cols), 1.0), whole(x.size()), halves(x.size());
  dropout_forward<double>(view(x, rows, cols), view(whole, rows, cols), 0.25F, 42);
  // The same tensor processed as two halves with index offsets gives the same mask.
  dropout_forward<double>(view(x, rows / 2, cols), view(halves, rows / 2, cols), 0.25F, 42, 0);
  dropout_forward<double>({x.data() + rows / 2 * cols, rows / 2, cols},
                          {halves.data() + rows / 2 * cols, rows / 2, cols}, 0.25F, 42,
                          static_cast<std::uint64_t>(rows / 2 * cols));
  EXPECT_EQ(whole, halves);
  int dropped = 0;
  for (double v : whole) {
    if (v == 0.0) {
      ++dropped;
    } else {
      EXPECT_DOUBLE_EQ(v, 1.0 / 0.75);
    }
  }
  // 4096 Bernoulli(0.25) draws: mean 1024, sd 27.7; 5 sd either way.
  EXPECT_NEAR(dropped, 1024, 140);
  Vec other(x.size());
  dropout_forward<double>(view(x, rows, cols), view(other, rows, cols), 0.25F, 43);
  EXPECT_NE(whole, other);
}

TEST(Dropout, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(8);
  Vec x = random_vector(20, rng);
  const Vec r = random_vector(20, rng);
  Vec y(20);
  auto loss = [&] {
    dropout_forward<double>(view(x, 4, 5), view(y, 4, 5), 0.4F, 9);
    return dot(y, r);
  };
  Vec dy = r, dx(20);
  dropout_backward<double>(view(dy, 4, 5), view(dx, 4, 5), 0.4F, 9);
  expect_gradients_near(dx, numeric_gradient(x, loss), "dx");
  EXPECT_THROW(dropout_forward<double>(view(x, 4, 5), view(y, 4, 5), 1.0F, 9),
               std::invalid_argument);
}

TEST(Dropout, RngIsPlainIntegerArithmetic) {
  // Fixed values pin the generator: a CUDA or any other backend must reproduce them.
  EXPECT_EQ(random_bits(0, 0), random_bits(0, 0));
  std::set<std::uint32_t> distinct;
  for (std::uint64_t i = 0; i < 1000; ++i) distinct.insert(random_bits(7, i));
  EXPECT_EQ(distinct.size(), 1000U);
  EXPECT_NE(derive_seed(1, 2), derive_seed(1, 3));
}

TEST(Attention, BackwardMatchesFiniteDifferences) {
  for (float dropout : {0.0F, 0.3F}) {
    std::mt19937_64 rng(10);
    const AttentionShape shape{2, 3, 2, 2};  // batch, seq, heads, head_dim
    const auto hidden = shape.hidden();
    Vec qkv = random_vector(static_cast<std::size_t>(shape.tokens() * 3 * hidden), rng);
    const Vec r = random_vector(static_cast<std::size_t>(shape.tokens() * hidden), rng);
    const std::int64_t mask[] = {1, 1, 0, 1, 1, 1};
    Vec probs(static_cast<std::size_t>(attention_probs_size(shape)));
    Vec workspace(static_cast<std::size_t>(attention_workspace_size(shape)));
    Vec ctx(r.size());
    auto loss = [&] {
      attention_forward<double>(shape, view(qkv, shape.tokens(), 3 * hidden), mask, dropout, 77,
                                probs.data(), workspace.data(), view(ctx, shape.tokens(), hidden));
      return dot(ctx, r);
    };
    loss();
    Vec dctx = r, dqkv(qkv.size());
    attention_backward<double>(shape, view(qkv, shape.tokens(), 3 * hidden), probs.data(),
                               view(dctx, shape.tokens(), hidden), dropout, 77, workspace.data(),
                               view(dqkv, shape.tokens(), 3 * hidden));
    expect_gradients_near(dqkv, numeric_gradient(qkv, loss),
                          "dqkv, dropout " + std::to_string(dropout));
  }
}

TEST(Embedding, BackwardMatchesFiniteDifferencesAndChecksIds) {
  std::mt19937_64 rng(11);
  Vec table = random_vector(12, rng);  // 4 rows x 3
  const std::int64_t ids[] = {2, 0, 2};
  const Vec r = random_vector(9, rng);
  Vec out(9);
  auto loss = [&] {
    embedding_forward<double>(view(table, 4, 3), ids, view(out, 3, 3), "token id");
    return dot(out, r);
  };
  Vec dy = r, dtable(12, 0.0);
  embedding_backward<double>(view(dy, 3, 3), ids, view(dtable, 4, 3));
  expect_gradients_near(dtable, numeric_gradient(table, loss), "dtable");
  const std::int64_t bad[] = {0, 4, 1};
  try {
    embedding_forward<double>(view(table, 4, 3), bad, view(out, 3, 3), "token id");
    FAIL() << "expected an exception";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("token id value 4 at row 1"), std::string::npos)
        << error.what();
  }
}

TEST(GatherRows, ScatterAddIsTheBackward) {
  std::mt19937_64 rng(12);
  Vec in = random_vector(10, rng);  // 5 x 2
  const std::int64_t index[] = {4, 1, 4};
  const Vec r = random_vector(6, rng);
  Vec out(6);
  auto loss = [&] {
    gather_rows<double>(view(in, 5, 2), index, view(out, 3, 2));
    return dot(out, r);
  };
  Vec dy = r, din(10, 0.0);
  scatter_add_rows<double>(view(dy, 3, 2), index, view(din, 5, 2));
  expect_gradients_near(din, numeric_gradient(in, loss), "din");
}

TEST(CrossEntropy, WeightedMeanAndBackward) {
  std::mt19937_64 rng(13);
  Vec logits = random_vector(12, rng);  // 3 rows x 4 classes
  const std::int64_t labels[] = {1, 3, 0};
  Vec weights{1, 0, 1};
  Vec work(12);
  auto loss = [&] {
    work = logits;
    return cross_entropy_forward<double>(view(work, 3, 4), labels, weights.data(), "label");
  };
  const double value = loss();
  double expected = 0;
  for (int row : {0, 2}) {
    double normaliser = 0;
    for (int j = 0; j < 4; ++j)
      normaliser += std::exp(logits[static_cast<std::size_t>(row * 4 + j)]);
    expected += std::log(normaliser) - logits[static_cast<std::size_t>(row * 4 + labels[row])];
  }
  EXPECT_NEAR(value, expected / 2, 1e-12);
  cross_entropy_backward<double>(view(work, 3, 4), labels, weights.data(), 1.0);
  const Vec analytic = work;  // loss() below reuses `work`
  expect_gradients_near(analytic, numeric_gradient(logits, loss), "dlogits");
  const std::int64_t bad[] = {1, 3, 7};
  work = logits;
  EXPECT_THROW(cross_entropy_forward<double>(view(work, 3, 4), bad, weights.data(), "label"),
               std::invalid_argument);
}

TEST(Reductions, SumsAndFiniteness) {
  Vec x{1, -2, 3};
  EXPECT_DOUBLE_EQ(sum(x.data(), 3), 2);
  EXPECT_DOUBLE_EQ(sum_of_squares(x.data(), 3), 14);
  EXPECT_TRUE(all_finite(x.data(), 3));
  x[1] = std::nan("");
  EXPECT_FALSE(all_finite(x.data(), 3));
  x[1] = INFINITY;
  EXPECT_FALSE(all_finite(x.data(), 3));
}

TEST(FloatPath, AgreesWithDouble) {
  std::mt19937_64 rng(14);
  const std::int64_t rows = 8, cols = 16;
  Vec x = random_vector(static_cast<std::size_t>(rows * cols), rng);
  Vec gamma(static_cast<std::size_t>(cols), 1.0), beta(static_cast<std::size_t>(cols), 0.1);
  Vec y(x.size()), mean(static_cast<std::size_t>(rows)), rstd(mean.size()), g(x.size());
  layernorm_forward<double>(view(x, rows, cols), gamma.data(), beta.data(), 1e-12,
                            view(y, rows, cols), mean.data(), rstd.data());
  gelu_forward<double>(view(y, rows, cols), view(g, rows, cols));
  std::vector<float> xf(x.begin(), x.end()), gf(gamma.begin(), gamma.end()),
      bf(beta.begin(), beta.end()), yf(x.size()), mf(mean.size()), rf(mean.size()), gelu(x.size());
  layernorm_forward<float>({xf.data(), rows, cols}, gf.data(), bf.data(), 1e-12F,
                           {yf.data(), rows, cols}, mf.data(), rf.data());
  gelu_forward<float>({yf.data(), rows, cols}, {gelu.data(), rows, cols});
  for (std::size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(gelu[i], g[i], 1e-5);
}

}  // namespace
}  // namespace pf::kernels
