// The fused and re-partitioned CPU kernels against straightforward references: odd sizes,
// strided views, aliasing, and bit equality across thread counts. Where a fused kernel promises
// the bits of the unfused ops it replaces, the test compares bit for bit (EXPECT_EQ on floats).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/ops.h"
#include "kernels/rng.h"

namespace pf::kernels {
namespace {

using Floats = std::vector<float>;

Floats random_floats(std::size_t count, std::mt19937_64& rng, float scale = 1.0F) {
  std::normal_distribution<float> normal(0.0F, scale);
  Floats values(count);
  for (float& value : values) value = normal(rng);
  return values;
}

// Runs `body` with 1, 2 and 3 OpenMP threads and returns its results.
template <typename Result>
std::vector<Result> for_thread_counts(const std::function<Result()>& body) {
  const int saved = omp_get_max_threads();
  std::vector<Result> results;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    results.push_back(body());
  }
  omp_set_num_threads(saved);
  return results;
}

TEST(FusedOps, CutProductsMatchTheDefinitionForAnyThreadCount) {
  // Cut into an even number of blocks by rows (653: 4 blocks of 192, the last 77) and by
  // columns (45 x 700), each transposition, alpha and beta not 1.
  struct Shape {
    std::int64_t m, n, k;
  };
  std::mt19937_64 rng(30);
  for (const Shape shape : {Shape{653, 37, 29}, Shape{45, 700, 21}}) {
    for (int ta = 0; ta < 2; ++ta) {
      for (int tb = 0; tb < 2; ++tb) {
        const auto [m, n, k] = shape;
        const Floats a = random_floats(static_cast<std::size_t>(m * k), rng);
        const Floats b = random_floats(static_cast<std::size_t>(k * n), rng);
        const Floats c0 = random_floats(static_cast<std::size_t>(m * n), rng);
        const auto results = for_thread_counts<Floats>([&] {
          Floats c = c0;
          gemm<float>(
              ta ? ConstMatrixView<float>(a.data(), k, m) : ConstMatrixView<float>(a.data(), m, k),
              ta ? Transpose::kYes : Transpose::kNo,
              tb ? ConstMatrixView<float>(b.data(), n, k) : ConstMatrixView<float>(b.data(), k, n),
              tb ? Transpose::kYes : Transpose::kNo, MatrixView<float>(c.data(), m, n), 0.75F,
              -0.5F);
          return c;
        });
        EXPECT_EQ(results[0], results[1]);
        EXPECT_EQ(results[0], results[2]);
        for (std::int64_t i = 0; i < m; ++i) {
          for (std::int64_t j = 0; j < n; ++j) {
            double expected = -0.5 * static_cast<double>(c0[static_cast<std::size_t>(i * n + j)]);
            for (std::int64_t p = 0; p < k; ++p) {
              const float x = ta ? a[static_cast<std::size_t>(p * m + i)]
                                 : a[static_cast<std::size_t>(i * k + p)];
              const float y = tb ? b[static_cast<std::size_t>(j * k + p)]
                                 : b[static_cast<std::size_t>(p * n + j)];
              expected += 0.75 * static_cast<double>(x) * static_cast<double>(y);
            }
            ASSERT_NEAR(results[0][static_cast<std::size_t>(i * n + j)], expected, 1e-4)
                << m << "x" << n << "x" << k << " ta " << ta << " tb " << tb << " at " << i << ","
                << j;
          }
        }
      }
    }
  }
}

TEST(FusedOps, DropoutAddIsDropoutThenAccumulateBitForBit) {
  // 333 x 123 is above the threaded threshold; rows strided (ld 130) in x, residual and y.
  const std::int64_t rows = 333, cols = 123, ld = 130;
  std::mt19937_64 rng(31);
  const Floats x = random_floats(static_cast<std::size_t>(rows * ld), rng);
  const Floats residual = random_floats(x.size(), rng);
  for (const float p : {0.0F, 0.1F, 0.37F}) {
    Floats expected(x.size(), 0.0F);
    dropout_forward<float>({x.data(), rows, cols, ld}, {expected.data(), rows, cols, ld}, p, 99);
    accumulate<float>({residual.data(), rows, cols, ld}, {expected.data(), rows, cols, ld});
    const auto results = for_thread_counts<Floats>([&] {
      Floats y(x.size(), 0.0F);
      dropout_add_forward<float>({x.data(), rows, cols, ld}, {residual.data(), rows, cols, ld},
                                 {y.data(), rows, cols, ld}, p, 99);
      return y;
    });
    for (const auto& y : results) EXPECT_EQ(y, expected) << "p " << p;
    // In place, as the model calls it (y is x).
    Floats in_place = x;
    dropout_add_forward<float>({in_place.data(), rows, cols, ld}, {residual.data(), rows, cols, ld},
                               {in_place.data(), rows, cols, ld}, p, 99);
    for (std::int64_t i = 0; i < rows; ++i) {
      for (std::int64_t j = 0; j < cols; ++j) {
        const auto at = static_cast<std::size_t>(i * ld + j);
        ASSERT_EQ(in_place[at], expected[at]) << "in place, p " << p << " at " << i << ", " << j;
      }
    }
  }
  Floats y(x.size());
  EXPECT_THROW(
      dropout_add_forward<float>({x.data(), rows, cols, ld}, {residual.data(), rows, cols, ld},
                                 {y.data(), rows, cols, ld}, 1.0F, 1),
      std::invalid_argument);
}

TEST(FusedOps, AddAndAccumulateMatchTheElementSums) {
  const std::int64_t rows = 301, cols = 117, ld = 121;
  std::mt19937_64 rng(32);
  const Floats a = random_floats(static_cast<std::size_t>(rows * ld), rng);
  const Floats b = random_floats(a.size(), rng);
  const auto sums = for_thread_counts<Floats>([&] {
    Floats y(a.size(), 7.0F);
    add<float>({a.data(), rows, cols, ld}, {b.data(), rows, cols, ld}, {y.data(), rows, cols, ld});
    return y;
  });
  const auto accumulated = for_thread_counts<Floats>([&] {
    Floats y = b;
    accumulate<float>({a.data(), rows, cols, ld}, {y.data(), rows, cols, ld});
    return y;
  });
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t j = 0; j < ld; ++j) {
      const auto at = static_cast<std::size_t>(i * ld + j);
      const bool inside = j < cols;
      for (std::size_t t = 0; t < sums.size(); ++t) {
        ASSERT_EQ(sums[t][at], inside ? a[at] + b[at] : 7.0F) << i << ", " << j;
        ASSERT_EQ(accumulated[t][at], inside ? b[at] + a[at] : b[at]) << i << ", " << j;
      }
    }
  }
}

TEST(FusedOps, LinearBiasAndBiasAddMatchTheDefinition) {
  const std::int64_t rows = 259, in = 37, out = 141;  // y above the threaded threshold
  std::mt19937_64 rng(33);
  const Floats x = random_floats(static_cast<std::size_t>(rows * in), rng);
  const Floats w = random_floats(static_cast<std::size_t>(out * in), rng);
  const Floats bias = random_floats(static_cast<std::size_t>(out), rng);
  const auto results = for_thread_counts<Floats>([&] {
    Floats y(static_cast<std::size_t>(rows * out), NAN);
    linear_forward<float>({x.data(), rows, in}, {w.data(), out, in}, bias.data(),
                          {y.data(), rows, out});
    return y;
  });
  EXPECT_EQ(results[0], results[1]);
  EXPECT_EQ(results[0], results[2]);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t o = 0; o < out; ++o) {
      double expected = bias[static_cast<std::size_t>(o)];
      for (std::int64_t i = 0; i < in; ++i) {
        expected += static_cast<double>(x[static_cast<std::size_t>(r * in + i)]) *
                    static_cast<double>(w[static_cast<std::size_t>(o * in + i)]);
      }
      ASSERT_NEAR(results[0][static_cast<std::size_t>(r * out + o)], expected, 1e-4)
          << r << ", " << o;
    }
  }
  const auto added = for_thread_counts<Floats>([&] {
    Floats y = x;  // rows x in, strided as rows x 35 with ld 37
    bias_add<float>({y.data(), rows, 35, in}, bias.data());
    return y;
  });
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < in; ++j) {
      const auto at = static_cast<std::size_t>(r * in + j);
      const float expected = j < 35 ? x[at] + bias[static_cast<std::size_t>(j)] : x[at];
      for (const auto& y : added) ASSERT_EQ(y[at], expected) << r << ", " << j;
    }
  }
}

TEST(FusedOps, MaskedSoftmaxIsScaleMaskMaxExpNormalise) {
  // Odd widths (a vector tail), with and without a key mask, a fully masked row of keys.
  for (const std::int64_t cols : {1, 7, 13, 128, 131}) {
    const std::int64_t rows = 5;
    std::mt19937_64 rng(34 + static_cast<std::uint64_t>(cols));
    const Floats x = random_floats(static_cast<std::size_t>(rows * cols), rng, 3.0F);
    std::vector<std::int64_t> mask(static_cast<std::size_t>(cols), 1);
    for (std::int64_t j = 0; j < cols; j += 3) mask[static_cast<std::size_t>(j)] = 0;
    std::vector<std::int64_t> none(static_cast<std::size_t>(cols), 0);
    for (const std::int64_t* key_mask :
         {static_cast<const std::int64_t*>(nullptr), static_cast<const std::int64_t*>(mask.data()),
          static_cast<const std::int64_t*>(none.data())}) {
      Floats p = x;
      masked_softmax_forward<float>({p.data(), rows, cols}, 0.3F, key_mask);
      for (std::int64_t i = 0; i < rows; ++i) {
        std::vector<double> logits(static_cast<std::size_t>(cols));
        double max = -INFINITY;
        for (std::int64_t j = 0; j < cols; ++j) {
          // The logits in float as the op forms them (a fully masked row keeps their rounding).
          float logit = x[static_cast<std::size_t>(i * cols + j)] * 0.3F;
          if (key_mask != nullptr && key_mask[j] == 0) logit += static_cast<float>(kMaskedLogit);
          const auto value = static_cast<double>(logit);
          logits[static_cast<std::size_t>(j)] = value;
          max = std::max(max, value);
        }
        double total = 0.0;
        for (double& value : logits) total += (value = std::exp(value - max));
        for (std::int64_t j = 0; j < cols; ++j) {
          ASSERT_NEAR(p[static_cast<std::size_t>(i * cols + j)],
                      logits[static_cast<std::size_t>(j)] / total, 2e-6)
              << "cols " << cols << " row " << i << " key " << j;
        }
      }
    }
  }
}

TEST(FusedOps, LayerNormBackwardMatchesTheFormulaForAnyThreadCount) {
  // 197 rows: three full chunks of 64 and a last of 5; 37 columns (a vector tail); strided.
  const std::int64_t rows = 197, cols = 37, ld = 40;
  std::mt19937_64 rng(36);
  const Floats x = random_floats(static_cast<std::size_t>(rows * ld), rng, 2.0F);
  const Floats dy = random_floats(x.size(), rng);
  const Floats gamma = random_floats(static_cast<std::size_t>(cols), rng);
  const Floats beta = random_floats(static_cast<std::size_t>(cols), rng);
  Floats y(x.size()), mean(static_cast<std::size_t>(rows)), rstd(mean.size());
  layernorm_forward<float>({x.data(), rows, cols, ld}, gamma.data(), beta.data(), 1e-12F,
                           {y.data(), rows, cols, ld}, mean.data(), rstd.data());
  struct Result {
    Floats dx, dgamma, dbeta;
  };
  Result out{Floats(x.size()), Floats(gamma.size()), Floats(gamma.size())};
  const auto results = for_thread_counts<Result>([&] {
    std::fill(out.dx.begin(), out.dx.end(), 0.0F);
    std::fill(out.dgamma.begin(), out.dgamma.end(), 0.5F);
    std::fill(out.dbeta.begin(), out.dbeta.end(), -0.5F);
    layernorm_backward<float>({x.data(), rows, cols, ld}, {dy.data(), rows, cols, ld}, gamma.data(),
                              mean.data(), rstd.data(), {out.dx.data(), rows, cols, ld},
                              out.dgamma.data(), out.dbeta.data());
    return out;
  });
  for (const auto& r : results) {
    EXPECT_EQ(r.dx, results[0].dx);
    EXPECT_EQ(r.dgamma, results[0].dgamma);
    EXPECT_EQ(r.dbeta, results[0].dbeta);
  }
  std::vector<double> dgamma(gamma.size(), 0.5), dbeta(gamma.size(), -0.5);
  for (std::int64_t i = 0; i < rows; ++i) {
    // The row's statistics in double, from the data (not the op's saved ones).
    double mu = 0.0, var = 0.0;
    for (std::int64_t j = 0; j < cols; ++j) mu += x[static_cast<std::size_t>(i * ld + j)];
    mu /= static_cast<double>(cols);
    for (std::int64_t j = 0; j < cols; ++j) {
      const double c = x[static_cast<std::size_t>(i * ld + j)] - mu;
      var += c * c;
    }
    const double r = 1.0 / std::sqrt(var / static_cast<double>(cols) + 1e-12);
    double mean_dg = 0.0, mean_dg_xhat = 0.0;
    for (std::int64_t j = 0; j < cols; ++j) {
      const auto at = static_cast<std::size_t>(i * ld + j);
      const double dg = static_cast<double>(dy[at]) * gamma[static_cast<std::size_t>(j)];
      mean_dg += dg / static_cast<double>(cols);
      mean_dg_xhat += dg * (x[at] - mu) * r / static_cast<double>(cols);
    }
    for (std::int64_t j = 0; j < cols; ++j) {
      const auto at = static_cast<std::size_t>(i * ld + j);
      const double xhat = (x[at] - mu) * r;
      const double dg = static_cast<double>(dy[at]) * gamma[static_cast<std::size_t>(j)];
      ASSERT_NEAR(results[0].dx[at], r * (dg - mean_dg - xhat * mean_dg_xhat), 2e-4 * r)
          << i << ", " << j;
      dgamma[static_cast<std::size_t>(j)] += dy[at] * xhat;
      dbeta[static_cast<std::size_t>(j)] += dy[at];
    }
  }
  for (std::size_t j = 0; j < gamma.size(); ++j) {
    EXPECT_NEAR(results[0].dgamma[j], dgamma[j], 1e-3) << j;
    EXPECT_NEAR(results[0].dbeta[j], dbeta[j], 1e-4) << j;
  }
  // dx may be dy itself: the same bits as into a separate buffer (dy read from one buffer in
  // both calls, so that the vectorised sums see the same alignment).
  Floats source = dy, separate(x.size()), dg1(gamma.size(), 0.5F), db1(gamma.size(), -0.5F);
  Floats dg2 = dg1, db2 = db1;
  layernorm_backward<float>({x.data(), rows, cols, ld}, {source.data(), rows, cols, ld},
                            gamma.data(), mean.data(), rstd.data(),
                            {separate.data(), rows, cols, ld}, dg1.data(), db1.data());
  layernorm_backward<float>({x.data(), rows, cols, ld}, {source.data(), rows, cols, ld},
                            gamma.data(), mean.data(), rstd.data(), {source.data(), rows, cols, ld},
                            dg2.data(), db2.data());
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t j = 0; j < cols; ++j) {
      const auto at = static_cast<std::size_t>(i * ld + j);
      ASSERT_EQ(source[at], separate[at]) << i << ", " << j;
    }
  }
  EXPECT_EQ(dg1, dg2);
  EXPECT_EQ(db1, db2);
}

TEST(FusedOps, CrossEntropyLossIsTheSameForAnyThreadCount) {
  // 97 rows of 1001 classes (above the threaded threshold), some weights zero.
  const std::int64_t rows = 97, cols = 1001;
  std::mt19937_64 rng(37);
  const Floats logits = random_floats(static_cast<std::size_t>(rows * cols), rng, 3.0F);
  std::vector<std::int64_t> labels(static_cast<std::size_t>(rows));
  Floats weights(static_cast<std::size_t>(rows));
  for (std::int64_t r = 0; r < rows; ++r) {
    labels[static_cast<std::size_t>(r)] = (r * 37) % cols;
    weights[static_cast<std::size_t>(r)] = r % 5 == 0 ? 0.0F : 1.0F + 0.01F * static_cast<float>(r);
  }
  struct Result {
    float loss;
    Floats probs;
  };
  // One buffer for every thread count: Eigen's vectorised row sums start at the first aligned
  // element, so their order follows the buffer's alignment (fixed in the model's arenas).
  Floats work(logits.size());
  const auto results = for_thread_counts<Result>([&] {
    work = logits;
    const float loss = cross_entropy_forward<float>({work.data(), rows, cols}, labels.data(),
                                                    weights.data(), "label");
    return Result{loss, work};
  });
  double total = 0.0, total_weight = 0.0;
  for (std::int64_t r = 0; r < rows; ++r) {
    double max = -INFINITY, normaliser = 0.0;
    for (std::int64_t j = 0; j < cols; ++j) {
      max = std::max(max, static_cast<double>(logits[static_cast<std::size_t>(r * cols + j)]));
    }
    for (std::int64_t j = 0; j < cols; ++j) {
      normaliser += std::exp(logits[static_cast<std::size_t>(r * cols + j)] - max);
    }
    const double w = weights[static_cast<std::size_t>(r)];
    const auto label = static_cast<std::size_t>(r * cols + labels[static_cast<std::size_t>(r)]);
    total += w * (std::log(normaliser) + max - logits[label]);
    total_weight += w;
  }
  for (const auto& r : results) {
    EXPECT_EQ(r.loss, results[0].loss);
    EXPECT_EQ(r.probs, results[0].probs);
  }
  EXPECT_NEAR(results[0].loss, total / total_weight, 1e-5 * total / total_weight);
}

// attention_backward draws each pair's dropout mask once and applies it twice; the reference is
// the composition of the public ops it replaced (dropout_forward of P, dV = P_d^T dctx,
// dP = dctx V^T, dropout_backward, softmax_backward, dQ = dS K, dK = dS^T Q), pair by pair.
void reference_attention_backward(const AttentionShape& shape, const Floats& qkv,
                                  const Floats& probs, const Floats& dctx, float dropout,
                                  std::uint64_t seed, Floats& dqkv) {
  const std::int64_t seq = shape.seq, d = shape.head_dim, hidden = shape.hidden();
  const std::int64_t ld = 3 * hidden;
  const float scale = 1.0F / std::sqrt(static_cast<float>(d));
  Floats w(static_cast<std::size_t>(seq * seq));
  for (std::int64_t b = 0; b < shape.batch; ++b) {
    for (std::int64_t h = 0; h < shape.heads; ++h) {
      const std::int64_t pair = b * shape.heads + h;
      const auto offset = static_cast<std::uint64_t>(pair * seq * seq);
      const float* rows = qkv.data() + b * seq * ld;
      ConstMatrixView<float> q(rows + h * d, seq, d, ld), k(rows + hidden + h * d, seq, d, ld),
          v(rows + 2 * hidden + h * d, seq, d, ld);
      float* drows = dqkv.data() + b * seq * ld;
      MatrixView<float> dq(drows + h * d, seq, d, ld), dk(drows + hidden + h * d, seq, d, ld),
          dv(drows + 2 * hidden + h * d, seq, d, ld);
      ConstMatrixView<float> dout(dctx.data() + b * seq * hidden + h * d, seq, d, hidden);
      ConstMatrixView<float> p(probs.data() + pair * seq * seq, seq, seq);
      MatrixView<float> wv(w.data(), seq, seq);
      dropout_forward<float>(p, wv, dropout, seed, offset);
      gemm<float>(wv, Transpose::kYes, dout, Transpose::kNo, dv);
      gemm<float>(dout, Transpose::kNo, v, Transpose::kYes, wv);
      dropout_backward<float>(wv, wv, dropout, seed, offset);
      softmax_backward<float>(p, wv, scale, wv);
      gemm<float>(wv, Transpose::kNo, k, Transpose::kNo, dq);
      gemm<float>(wv, Transpose::kYes, q, Transpose::kNo, dk);
    }
  }
}

TEST(FusedOps, AttentionBackwardIsTheComposedOpsBitForBit) {
  // Odd sequence length, head dimension and head count; padded keys in the second sequence.
  for (const float dropout : {0.0F, 0.1F, 0.45F}) {
    const AttentionShape shape{2, 13, 3, 5};
    const std::int64_t tokens = shape.tokens(), hidden = shape.hidden();
    std::mt19937_64 rng(35);
    const Floats qkv = random_floats(static_cast<std::size_t>(tokens * 3 * hidden), rng);
    const Floats dctx = random_floats(static_cast<std::size_t>(tokens * hidden), rng);
    std::vector<std::int64_t> mask(static_cast<std::size_t>(tokens), 1);
    for (std::int64_t s = 9; s < shape.seq; ++s) mask[static_cast<std::size_t>(shape.seq + s)] = 0;
    Floats probs(static_cast<std::size_t>(attention_probs_size(shape)));
    Floats workspace(static_cast<std::size_t>(attention_workspace_size(shape)));
    Floats ctx(dctx.size());
    attention_forward<float>(shape, {qkv.data(), tokens, 3 * hidden}, mask.data(), dropout, 5,
                             probs.data(), workspace.data(), {ctx.data(), tokens, hidden});
    Floats expected(qkv.size(), NAN);
    reference_attention_backward(shape, qkv, probs, dctx, dropout, 5, expected);
    Floats dqkv(qkv.size()), work(workspace.size());  // the same buffers (alignment) each time
    const auto results = for_thread_counts<Floats>([&] {
      std::fill(dqkv.begin(), dqkv.end(), NAN);
      std::fill(work.begin(), work.end(), NAN);
      attention_backward<float>(shape, {qkv.data(), tokens, 3 * hidden}, probs.data(),
                                {dctx.data(), tokens, hidden}, dropout, 5, work.data(),
                                {dqkv.data(), tokens, 3 * hidden});
      return dqkv;
    });
    for (const auto& result : results) EXPECT_EQ(result, expected) << "dropout " << dropout;
  }
}

}  // namespace
}  // namespace pf::kernels
