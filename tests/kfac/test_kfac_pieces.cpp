// Pieces of K-FAC tasks (curvature by token rows, the inversion chain, preconditioning by
// gradient rows) against the unsplit math: fp32 rounding apart, and bit-identical for one plan.
#include "kfac/eigen_core.h"  // first: silences GCC 12's AVX-512 false positives in Eigen

#include <gtest/gtest.h>

#include <Eigen/Dense>
#include <random>
#include <stdexcept>
#include <utility>
#include <vector>

#include "kfac/factors.h"
#include "kfac/inverse.h"
#include "kfac/inverse_chain.h"
#include "kfac/layer_state.h"
#include "kfac/pieces.h"
#include "kfac/precondition.h"

namespace pf::kfac {
namespace {

using RowMatrixF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

RowMatrixF random_matrix(Eigen::Index rows, Eigen::Index cols, unsigned seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  RowMatrixF matrix(rows, cols);
  for (Eigen::Index i = 0; i < matrix.size(); ++i) matrix.data()[i] = normal(generator);
  return matrix;
}

// A symmetric positive semi-definite factor a^T a / T, like a curvature factor.
Eigen::MatrixXf random_factor(Eigen::Index n, Eigen::Index tokens, unsigned seed) {
  const RowMatrixF a = random_matrix(tokens, n, seed);
  Eigen::MatrixXf factor = (a.transpose() * a) / static_cast<float>(tokens);
  return 0.5F * (factor + factor.transpose());
}

double relative_error(const Eigen::MatrixXf& actual, const Eigen::MatrixXf& expected) {
  return (actual - expected).norm() / expected.norm();
}

bool bit_identical(const Eigen::MatrixXf& x, const Eigen::MatrixXf& y) {
  return x.rows() == y.rows() && x.cols() == y.cols() &&
         std::equal(x.data(), x.data() + x.size(), y.data());
}

// Cuts [0, kPieceUnits) at the given interior units.
std::vector<std::pair<int, int>> plan(const std::vector<int>& cuts) {
  std::vector<std::pair<int, int>> pieces;
  int begin = 0;
  for (int cut : cuts) {
    pieces.emplace_back(begin, cut);
    begin = cut;
  }
  pieces.emplace_back(begin, kPieceUnits);
  return pieces;
}

TEST(Pieces, ItemsCoverEveryItemOnce) {
  const auto pieces = plan({1, 700, 701, 2048, 4000});
  for (std::int64_t count : {0, 1, 7, 128, 1000, 4097}) {
    std::int64_t next = 0;
    for (auto [begin, end] : pieces) {
      const ItemRange range = piece_items(count, begin, end);
      EXPECT_EQ(range.begin, next);
      EXPECT_GE(range.end, range.begin);
      next = range.end;
    }
    EXPECT_EQ(next, count);
  }
  EXPECT_THROW(piece_items(10, 5, 5), std::invalid_argument);
  EXPECT_THROW(piece_items(10, -1, 5), std::invalid_argument);
  EXPECT_THROW(piece_items(10, 0, kPieceUnits + 1), std::invalid_argument);
}

TEST(Pieces, CurvatureByTokenBlocksEqualsWholeMicroBatch) {
  const std::int64_t tokens = 300;
  const RowMatrixF a = random_matrix(tokens, 96, 1);
  const RowMatrixF g = random_matrix(tokens, 80, 2);
  KfacLayerState whole(96, 80);
  accumulate_a(whole, a.data(), tokens);
  accumulate_b(whole, g.data(), tokens, 3.0F);
  const auto pieces = plan({1000, 1001, 3000});
  auto split_layer = [&] {
    KfacLayerState layer(96, 80);
    for (auto [begin, end] : pieces) {
      accumulate_a(layer, a.data(), tokens, begin, end);
      accumulate_b(layer, g.data(), tokens, 3.0F, begin, end);
      EXPECT_EQ(layer.a.microbatches, end == kPieceUnits ? 1 : 0);
    }
    return layer;
  };
  const KfacLayerState split = split_layer();
  EXPECT_LT(relative_error(split.a.sum, whole.a.sum), 1e-6);
  EXPECT_LT(relative_error(split.b.sum, whole.b.sum), 1e-6);
  EXPECT_TRUE(bit_identical(split.a.sum, split_layer().a.sum));
  // The single piece [0, kPieceUnits) is the unsplit call itself.
  KfacLayerState one(96, 80);
  accumulate_a(one, a.data(), tokens, 0, kPieceUnits);
  EXPECT_TRUE(bit_identical(one.a.sum, whole.a.sum));
}

// The curvature sync's pieces: consecutive column ranges of the accumulator that cover it
// exactly once, contiguous in memory; the whole task is the whole sum.
TEST(Pieces, SyncPiecesCoverTheAccumulatorOnce) {
  FactorState factor;
  EXPECT_THROW(sync_piece(factor, 0, kPieceUnits), std::logic_error);  // nothing accumulated
  const std::int64_t d = 48;
  factor.sum = Eigen::MatrixXf::Zero(d, d);
  const auto whole = sync_piece(factor, 0, kPieceUnits);
  EXPECT_EQ(whole.data(), factor.sum.data());
  EXPECT_EQ(static_cast<std::int64_t>(whole.size()), d * d);
  for (const int cuts : {2, 3, 7, 100, 1000}) {
    const float* next = factor.sum.data();
    for (int c = 0; c < cuts; ++c) {
      const auto range = sync_piece(factor, kPieceUnits * c / cuts, kPieceUnits * (c + 1) / cuts);
      EXPECT_EQ(range.data(), next);
      EXPECT_EQ(range.size() % static_cast<std::size_t>(d), 0U);  // whole columns (rows)
      next = range.data() + range.size();
    }
    EXPECT_EQ(next, factor.sum.data() + d * d) << cuts << " pieces";
  }
  EXPECT_THROW(sync_piece(factor, 5, 5), std::invalid_argument);
}

TEST(Pieces, InverseChainStepsAndFlops) {
  const auto steps = inverse_chain_steps(300, 128);
  ASSERT_EQ(steps.size(), 6U);  // 3 Cholesky block columns, 3 solve blocks
  EXPECT_EQ(steps[2].width, 44);
  EXPECT_EQ(steps[3].kind, InverseChainStep::Kind::kSolveColumns);
  // About n^3/3 (Cholesky) + 2 n^3/3 (forward and backward solves below each block's first
  // row): LAPACK potrf + potri's n^3.
  const double n = 4096.0;
  EXPECT_NEAR(inverse_chain_flops(4096) / (n * n * n), 1.0, 0.05);  // 1.03: the blocks
  // Adjacent pieces share their boundary step exactly; the whole range runs every step.
  const auto all = inverse_chain_piece(steps, 0, kPieceUnits);
  EXPECT_EQ(all.first, 0U);
  EXPECT_EQ(all.last, steps.size());
  const auto left = inverse_chain_piece(steps, 0, 1234);
  const auto right = inverse_chain_piece(steps, 1234, kPieceUnits);
  EXPECT_EQ(left.last, right.first);
  EXPECT_THROW(inverse_chain_steps(0), std::invalid_argument);
}

TEST(Pieces, InverseChainEqualsDampedInverse) {
  for (Eigen::Index n : {1, 50, 128, 300, 513}) {
    const Eigen::MatrixXf factor = random_factor(n, 2 * n + 8, static_cast<unsigned>(n));
    const float damping = 0.05F;
    const Eigen::MatrixXf reference =
        damped_inverse(factor, damping, InverseMethod::kCholesky).inverse;
    for (const auto& cuts :
         {std::vector<int>{}, std::vector<int>{5, 900, 2000, 4095}, std::vector<int>{2048}}) {
      auto run = [&] {
        InverseChain chain(factor, damping);
        for (auto [begin, end] : plan(cuts)) chain.run(begin, end);
        EXPECT_TRUE(chain.finished());
        return chain.take();
      };
      const InverseResult result = run();
      EXPECT_FALSE(result.fell_back_to_eigen);
      EXPECT_LT(relative_error(result.inverse, reference), 2e-5) << "n " << n;
      EXPECT_TRUE(bit_identical(result.inverse, run().inverse)) << "n " << n;
      EXPECT_TRUE(bit_identical(result.inverse, result.inverse.transpose()));
    }
    // The pieces' result does not depend on where the cuts fall (the steps are the same).
    InverseChain whole(factor, damping);
    whole.run(0, kPieceUnits);
    InverseChain cut(factor, damping);
    for (auto [begin, end] : plan({100, 3000})) cut.run(begin, end);
    EXPECT_TRUE(bit_identical(whole.take().inverse, cut.take().inverse));
  }
}

TEST(Pieces, InverseChainRefusesOutOfOrderPiecesAndFallsBack) {
  const Eigen::MatrixXf factor = random_factor(40, 100, 3);
  InverseChain chain(factor, 0.1F);
  EXPECT_THROW(chain.run(10, 20), std::logic_error);
  chain.run(0, 10);
  EXPECT_THROW(chain.take(), std::logic_error);
  EXPECT_THROW(chain.run(0, 20), std::logic_error);
  chain.run(10, kPieceUnits);
  EXPECT_NO_THROW(chain.take());
  EXPECT_THROW(InverseChain(Eigen::MatrixXf(3, 4), 0.1F), std::invalid_argument);
  EXPECT_THROW(InverseChain(factor, -1.0F), std::invalid_argument);
  // Indefinite: the chain falls back to the eigen inverse (clamped eigenvalues), like
  // damped_inverse.
  Eigen::MatrixXf indefinite = Eigen::MatrixXf::Identity(200, 200);
  indefinite(150, 150) = -1.0F;
  InverseChain fallback(indefinite, 0.01F);
  for (auto [begin, end] : plan({1000, 2000})) fallback.run(begin, end);
  const InverseResult result = fallback.take();
  EXPECT_TRUE(result.fell_back_to_eigen);
  const InverseResult reference = damped_inverse(indefinite, 0.01F, InverseMethod::kCholesky);
  EXPECT_TRUE(reference.fell_back_to_eigen);
  EXPECT_LT(relative_error(result.inverse, reference.inverse), 1e-6);
}

TEST(Pieces, PreconditionByRowBlocksEqualsWhole) {
  const std::int64_t d_out = 70;
  const std::int64_t d_in = 90;
  const Eigen::MatrixXf a_inv =
      damped_inverse(random_factor(d_in, 200, 4), 0.1F, InverseMethod::kCholesky).inverse;
  const Eigen::MatrixXf b_inv =
      damped_inverse(random_factor(d_out, 200, 5), 0.1F, InverseMethod::kCholesky).inverse;
  const RowMatrixF grad = random_matrix(d_out, d_in, 6);
  const RowMatrixF grad_bias = random_matrix(d_out, 1, 7);
  RowMatrixF whole(d_out, d_in);
  RowMatrixF whole_bias(d_out, 1);
  precondition(a_inv, b_inv, grad.data(), grad_bias.data(), d_out, d_in, whole.data(),
               whole_bias.data());
  auto split = [&] {
    RowMatrixF out = RowMatrixF::Constant(d_out, d_in, -7.0F);
    RowMatrixF out_bias = RowMatrixF::Constant(d_out, 1, -7.0F);
    for (auto [begin, end] : plan({3, 1500, 1501, 2600})) {
      precondition_rows(a_inv, b_inv, grad.data(), grad_bias.data(), d_out, d_in, begin, end,
                        out.data(), out_bias.data());
    }
    return std::pair{out, out_bias};
  };
  const auto [out, out_bias] = split();
  EXPECT_LT((out - whole).norm() / whole.norm(), 1e-5);
  EXPECT_LT((out_bias - whole_bias).norm() / whole_bias.norm(), 1e-6);
  const auto again = split();
  EXPECT_TRUE(std::equal(out.data(), out.data() + out.size(), again.first.data()));
  // Aliasing the gradient would let one piece overwrite rows the next one reads.
  RowMatrixF in_place = grad;
  EXPECT_THROW(precondition_rows(a_inv, b_inv, in_place.data(), nullptr, d_out, d_in, 0, 100,
                                 in_place.data(), nullptr),
               std::invalid_argument);
  // FLOPs of the pieces add up to the whole: (2 w d_out d_in + 2 w d_in^2) summed over w.
  EXPECT_DOUBLE_EQ(precondition_flops(d_out, d_in),
                   2.0 * d_out * d_out * d_in + 2.0 * d_out * d_in * d_in);
}

}  // namespace
}  // namespace pf::kfac
