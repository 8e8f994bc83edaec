// Every op of the CUDA backend (CudaOps) against the CPU op (CpuOps) on the same random inputs:
// odd sizes, strided views, forward and backward. Skipped where no CUDA device is present.
#include <cmath>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/bfloat16.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cuda/cublas_gemm.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/make_ops.h"
#include "tests/kernels/cuda_test_util.h"

namespace pf::kernels::cuda {
namespace {

using pf::testing::expect_close;
using pf::testing::nmse;
using Vec = std::vector<float>;
using Ids = std::vector<std::int64_t>;

class CudaOpsTest : public pf::testing::CudaTest {
 protected:
  void SetUp() override {
    CudaTest::SetUp();
    if (backend_ == nullptr) return;
    gpu_ = std::make_unique<CudaOps>(*backend_, nullptr, GemmPrecision::kFp32);
  }
  std::vector<float> get(const float* device, std::size_t count) { return download(device, count); }

  CpuOps<float> cpu_;
  std::unique_ptr<CudaOps> gpu_;
};

constexpr double kTight = 2e-6;  // elementwise, one rounding apart
constexpr double kRows = 2e-5;   // row reductions in another order
constexpr double kGemm = 2e-5;   // fp32 products in another order
// Products of bf16 operands are exact in fp32, so a bf16-operand product and the CPU's fp32
// product of the same rounded operands differ by the order of fp32 accumulation only (kGemm);
// the unrounded operands' product is about 2^-9 (relative) away, kNotRounded and more.
constexpr double kNotRounded = 1e-4;

Vec rounded_to_bf16(Vec values) {
  for (auto& v : values) v = round_to_bf16(v);
  return values;
}

// max |actual - expected| over max |expected|.
double relative_max_error(const Vec& actual, const Vec& expected) {
  double scale = 1e-30, worst = 0.0;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    scale = std::max(scale, std::abs(static_cast<double>(expected[i])));
    worst = std::max(worst, std::abs(static_cast<double>(actual[i]) - expected[i]));
  }
  return worst / scale;
}

TEST_F(CudaOpsTest, GemmAllTransposesAlphaBetaAndStridedViews) {
  const std::int64_t m = 37, k = 65, n = 19, pad = 3;
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      const std::int64_t a_rows = ta ? k : m, a_cols = ta ? m : k;
      const std::int64_t b_rows = tb ? n : k, b_cols = tb ? k : n;
      Vec a = random(static_cast<std::size_t>(a_rows * (a_cols + pad)));
      Vec b = random(static_cast<std::size_t>(b_rows * b_cols));
      Vec c = random(static_cast<std::size_t>(m * (n + pad)));
      float* da = upload(a);
      float* db = upload(b);
      float* dc = upload(c);
      const auto trans_a = ta ? Transpose::kYes : Transpose::kNo;
      const auto trans_b = tb ? Transpose::kYes : Transpose::kNo;
      cpu_.gemm({a.data(), a_rows, a_cols, a_cols + pad}, trans_a, {b.data(), b_rows, b_cols},
                trans_b, {c.data(), m, n, n + pad}, 1.5F, 0.5F);
      gpu_->gemm({da, a_rows, a_cols, a_cols + pad}, trans_a, {db, b_rows, b_cols}, trans_b,
                 {dc, m, n, n + pad}, 1.5F, 0.5F);
      expect_close(get(dc, c.size()), c, kGemm,
                   "gemm ta=" + std::to_string(ta) + " tb=" + std::to_string(tb));
    }
  }
}

TEST_F(CudaOpsTest, TensorCorePrecisionsStayWithinTheirRounding) {
  const std::int64_t m = 128, k = 256, n = 96;
  Vec a = random(static_cast<std::size_t>(m * k)), b = random(static_cast<std::size_t>(k * n));
  Vec c(static_cast<std::size_t>(m * n));
  cpu_.gemm({a.data(), m, k}, Transpose::kNo, {b.data(), k, n}, Transpose::kNo, {c.data(), m, n},
            1.0F, 0.0F);
  float* da = upload(a);
  float* db = upload(b);
  float* dc = upload(c);
  // TF32 keeps 10 mantissa bits (relative rounding 2^-11), BF16 7 (2^-8): the NMSE of a product
  // of random inputs is about the squared rounding.
  const std::pair<GemmPrecision, double> modes[] = {{GemmPrecision::kTf32, 1e-5},
                                                    {GemmPrecision::kBf16, 1e-4}};
  for (const auto& [precision, limit] : modes) {
    gpu_->set_precision(precision);
    gpu_->gemm({da, m, k}, Transpose::kNo, {db, k, n}, Transpose::kNo, {dc, m, n}, 1.0F, 0.0F);
    const double error = nmse(get(dc, c.size()), c);
    EXPECT_LT(error, limit) << to_string(precision);
    EXPECT_GT(error, 0.0) << to_string(precision) << " should round (not an fp32 product)";
  }
}

// GemmPrecision::kBf16Operands: each operand rounded to a bf16 copy (to nearest even), then a
// bf16 x bf16 -> fp32 product. Shapes cover the conversion's paths: odd sizes and padded rows
// (one element a thread), packed matrices (one long row, four a thread), padded rows of four
// (four a thread, row by row), and a view one element into its block (not 16-byte aligned).
TEST_F(CudaOpsTest, Bf16OperandProductsAreTheCpusProductOfRoundedOperands) {
  struct Shape {
    std::int64_t m, k, n, pad, offset;
  };
  const Shape shapes[] = {
      {37, 53, 29, 3, 0}, {64, 128, 96, 0, 0}, {40, 64, 48, 4, 0}, {36, 44, 20, 4, 1}};
  gpu_->set_precision(GemmPrecision::kBf16Operands);
  for (const auto& [m, k, n, pad, offset] : shapes) {
    for (int ta = 0; ta < 2; ++ta) {
      for (int tb = 0; tb < 2; ++tb) {
        const std::int64_t a_rows = ta ? k : m, a_cols = ta ? m : k;
        const std::int64_t b_rows = tb ? n : k, b_cols = tb ? k : n;
        const Vec a = random(static_cast<std::size_t>(offset + a_rows * (a_cols + pad)));
        const Vec b = random(static_cast<std::size_t>(offset + b_rows * (b_cols + pad)));
        const Vec c = random(static_cast<std::size_t>(m * (n + pad)));
        const auto trans_a = ta ? Transpose::kYes : Transpose::kNo;
        const auto trans_b = tb ? Transpose::kYes : Transpose::kNo;
        Vec a16 = rounded_to_bf16(a), b16 = rounded_to_bf16(b), expected = c, unrounded = c;
        cpu_.gemm({a16.data() + offset, a_rows, a_cols, a_cols + pad}, trans_a,
                  {b16.data() + offset, b_rows, b_cols, b_cols + pad}, trans_b,
                  {expected.data(), m, n, n + pad}, 1.5F, 0.5F);
        cpu_.gemm({a.data() + offset, a_rows, a_cols, a_cols + pad}, trans_a,
                  {b.data() + offset, b_rows, b_cols, b_cols + pad}, trans_b,
                  {unrounded.data(), m, n, n + pad}, 1.5F, 0.5F);
        // No synchronization between the cases: the operand copies grow while earlier
        // products may still read the blocks they grew out of.
        float* dc = upload(c);
        gpu_->gemm({upload(a) + offset, a_rows, a_cols, a_cols + pad}, trans_a,
                   {upload(b) + offset, b_rows, b_cols, b_cols + pad}, trans_b, {dc, m, n, n + pad},
                   1.5F, 0.5F);
        const Vec actual = get(dc, c.size());
        const std::string what = std::to_string(m) + "x" + std::to_string(k) + "x" +
                                 std::to_string(n) + " pad=" + std::to_string(pad) +
                                 " offset=" + std::to_string(offset) + " ta=" + std::to_string(ta) +
                                 " tb=" + std::to_string(tb);
        expect_close(actual, expected, kGemm, what);
        EXPECT_GT(relative_max_error(actual, unrounded), kNotRounded)
            << what << ": the operands were not rounded to bf16";
      }
    }
  }
}

TEST_F(CudaOpsTest, Bf16OperandBatchedProductsIncludingASharedOperand) {
  const std::int64_t count = 5, m = 13, k = 37, n = 9;
  const Vec a = random(static_cast<std::size_t>(count * m * k));
  const Vec b = random(static_cast<std::size_t>(count * n * k));
  const Vec c = random(static_cast<std::size_t>(count * m * n));
  gpu_->set_precision(GemmPrecision::kBf16Operands);
  const Vec a16 = rounded_to_bf16(a), b16 = rounded_to_bf16(b);
  // Every product its own b (stride n*k), then one b shared by all (stride 0).
  for (const std::int64_t stride_b : {n * k, std::int64_t{0}}) {
    Vec expected = c, unrounded = c;
    cpu_.batched_gemm(count, {a16.data(), m, k}, m * k, Transpose::kNo, {b16.data(), n, k},
                      stride_b, Transpose::kYes, {expected.data(), m, n}, m * n, 2.0F, 1.0F);
    cpu_.batched_gemm(count, {a.data(), m, k}, m * k, Transpose::kNo, {b.data(), n, k}, stride_b,
                      Transpose::kYes, {unrounded.data(), m, n}, m * n, 2.0F, 1.0F);
    float* dc = upload(c);
    gpu_->batched_gemm(count, {upload(a), m, k}, m * k, Transpose::kNo, {upload(b), n, k}, stride_b,
                       Transpose::kYes, {dc, m, n}, m * n, 2.0F, 1.0F);
    const Vec actual = get(dc, c.size());
    const std::string what = "batched, stride_b=" + std::to_string(stride_b);
    expect_close(actual, expected, kGemm, what);
    EXPECT_GT(relative_max_error(actual, unrounded), kNotRounded) << what;
  }
  // Transposed a, packed b.
  Vec expected = c;
  cpu_.batched_gemm(count, {a16.data(), k, m}, m * k, Transpose::kYes, {b16.data(), k, n}, n * k,
                    Transpose::kNo, {expected.data(), m, n}, m * n, 1.0F, 0.0F);
  float* dc = upload(c);
  gpu_->batched_gemm(count, {upload(a), k, m}, m * k, Transpose::kYes, {upload(b), k, n}, n * k,
                     Transpose::kNo, {dc, m, n}, m * n, 1.0F, 0.0F);
  expect_close(get(dc, c.size()), expected, kGemm, "batched, transposed a");
}

// The fp32-operand cuBLAS calls cannot honour bf16-operands (nothing converts): they refuse it
// rather than run another precision. CudaOps checks shapes before it converts.
TEST_F(CudaOpsTest, Fp32OperandProductsRefuseBf16OperandsAndShapesAreCheckedFirst) {
  float* d = upload(Vec(16, 1.0F));
  EXPECT_THROW(cuda::gemm(gpu_->cublas(), {d, 4, 4}, Transpose::kNo, {d, 4, 4}, Transpose::kNo,
                          {d, 4, 4}, 1.0F, 0.0F, GemmPrecision::kBf16Operands),
               std::invalid_argument);
  gpu_->set_precision(GemmPrecision::kBf16Operands);
  EXPECT_THROW(
      gpu_->gemm({d, 4, 4}, Transpose::kNo, {d, 4, 3}, Transpose::kNo, {d, 4, 4}, 1.0F, 0.0F),
      std::invalid_argument);
}

TEST_F(CudaOpsTest, BatchedGemm) {
  const std::int64_t count = 5, m = 13, k = 7, n = 9;
  Vec a = random(static_cast<std::size_t>(count * m * k));
  Vec b = random(static_cast<std::size_t>(count * n * k));
  Vec c = random(static_cast<std::size_t>(count * m * n));
  float* da = upload(a);
  float* db = upload(b);
  float* dc = upload(c);
  cpu_.batched_gemm(count, {a.data(), m, k}, m * k, Transpose::kNo, {b.data(), n, k}, n * k,
                    Transpose::kYes, {c.data(), m, n}, m * n, 2.0F, 1.0F);
  gpu_->batched_gemm(count, {da, m, k}, m * k, Transpose::kNo, {db, n, k}, n * k, Transpose::kYes,
                     {dc, m, n}, m * n, 2.0F, 1.0F);
  expect_close(get(dc, c.size()), c, kGemm, "batched_gemm");
}

TEST_F(CudaOpsTest, LinearForwardAndBackward) {
  const std::int64_t rows = 45, in = 33, out = 17;
  Vec x = random(static_cast<std::size_t>(rows * in)),
      w = random(static_cast<std::size_t>(out * in));
  Vec bias = random(static_cast<std::size_t>(out)),
      dy = random(static_cast<std::size_t>(rows * out));
  Vec y(static_cast<std::size_t>(rows * out)), dx(x.size());
  Vec dw = random(w.size()), dbias = random(bias.size());  // accumulated into
  float* d_x = upload(x);
  float* d_w = upload(w);
  float* d_b = upload(bias);
  float* d_dy = upload(dy);
  float* d_y = upload(y);
  float* d_dx = upload(dx);
  float* d_dw = upload(dw);
  float* d_db = upload(dbias);
  cpu_.linear_forward({x.data(), rows, in}, {w.data(), out, in}, bias.data(),
                      {y.data(), rows, out});
  cpu_.linear_backward({x.data(), rows, in}, {w.data(), out, in}, {dy.data(), rows, out},
                       {dx.data(), rows, in}, {dw.data(), out, in}, dbias.data());
  gpu_->linear_forward({d_x, rows, in}, {d_w, out, in}, d_b, {d_y, rows, out});
  gpu_->linear_backward({d_x, rows, in}, {d_w, out, in}, {d_dy, rows, out}, {d_dx, rows, in},
                        {d_dw, out, in}, d_db);
  expect_close(get(d_y, y.size()), y, kGemm, "y");
  expect_close(get(d_dx, dx.size()), dx, kGemm, "dx");
  expect_close(get(d_dw, dw.size()), dw, kGemm, "dweight");
  expect_close(get(d_db, dbias.size()), dbias, kRows, "dbias");
}

TEST_F(CudaOpsTest, ElementwiseOps) {
  const std::int64_t rows = 37, cols = 129, ld = 131;
  const auto size = static_cast<std::size_t>(rows * ld);
  Vec x = random(size, 2.0F), dy = random(size), bias = random(static_cast<std::size_t>(cols));
  Vec y(size, 0.0F), dx(size, 0.0F);
  const auto run = [&](const char* name, auto&& cpu_call, auto&& gpu_call, std::vector<Vec*> outs) {
    std::vector<Vec> before;
    for (Vec* o : outs) before.push_back(*o);
    std::vector<float*> device;
    for (Vec* o : outs) device.push_back(upload(*o));
    cpu_call();
    gpu_call(device);
    for (std::size_t i = 0; i < outs.size(); ++i) {
      expect_close(get(device[i], outs[i]->size()), *outs[i], kTight, name);
      *outs[i] = before[i];
    }
  };
  float* d_x = upload(x);
  float* d_dy = upload(dy);
  float* d_bias = upload(bias);
  auto m = [&](Vec& v) { return MatrixView<float>(v.data(), rows, cols, ld); };
  auto md = [&](float* p) { return MatrixView<float>(p, rows, cols, ld); };
  run(
      "gelu_forward", [&] { cpu_.gelu_forward(m(x), m(y)); },
      [&](auto& d) { gpu_->gelu_forward(md(d_x), md(d[0])); }, {&y});
  run(
      "gelu_backward", [&] { cpu_.gelu_backward(m(x), m(dy), m(dx)); },
      [&](auto& d) { gpu_->gelu_backward(md(d_x), md(d_dy), md(d[0])); }, {&dx});
  run(
      "tanh_backward", [&] { cpu_.tanh_backward(m(x), m(dy), m(dx)); },
      [&](auto& d) { gpu_->tanh_backward(md(d_x), md(d_dy), md(d[0])); }, {&dx});
  run(
      "add", [&] { cpu_.add(m(x), m(dy), m(y)); },
      [&](auto& d) { gpu_->add(md(d_x), md(d_dy), md(d[0])); }, {&y});
  Vec acc = random(size);
  run(
      "accumulate", [&] { cpu_.accumulate(m(x), m(acc)); },
      [&](auto& d) { gpu_->accumulate(md(d_x), md(d[0])); }, {&acc});
  run(
      "bias_add", [&] { cpu_.bias_add(m(acc), bias.data()); },
      [&](auto& d) { gpu_->bias_add(md(d[0]), d_bias); }, {&acc});
  Vec pre = x;
  run(
      "bias_gelu_forward", [&] { cpu_.bias_gelu_forward(m(pre), bias.data(), m(y)); },
      [&](auto& d) { gpu_->bias_gelu_forward(md(d[0]), d_bias, md(d[1])); }, {&pre, &y});
  run(
      "bias_tanh_forward", [&] { cpu_.bias_tanh_forward(m(pre), bias.data(), m(y)); },
      [&](auto& d) { gpu_->bias_tanh_forward(md(d[0]), d_bias, md(d[1])); }, {&pre, &y});
  Vec db = random(static_cast<std::size_t>(cols));
  float* d_db = upload(db);
  cpu_.bias_backward(m(dy), db.data());
  gpu_->bias_backward(md(d_dy), d_db);
  expect_close(get(d_db, db.size()), db, kRows, "bias_backward");
}

TEST_F(CudaOpsTest, DropoutMasksAreBitIdenticalToCpu) {
  const std::int64_t rows = 64, cols = 100;
  Vec x = random(static_cast<std::size_t>(rows * cols)), residual = random(x.size());
  Vec y(x.size());
  float* d_x = upload(x);
  float* d_r = upload(residual);
  float* d_y = upload(y);
  for (const float p : {0.0F, 0.1F, 0.5F}) {
    cpu_.dropout_forward({x.data(), rows, cols}, {y.data(), rows, cols}, p, 1234, 77);
    gpu_->dropout_forward({d_x, rows, cols}, {d_y, rows, cols}, p, 1234, 77);
    EXPECT_EQ(get(d_y, y.size()), y) << "dropout p=" << p;
    cpu_.dropout_backward({x.data(), rows, cols}, {y.data(), rows, cols}, p, 99, 5);
    gpu_->dropout_backward({d_x, rows, cols}, {d_y, rows, cols}, p, 99, 5);
    EXPECT_EQ(get(d_y, y.size()), y) << "dropout_backward p=" << p;
    cpu_.dropout_add_forward({x.data(), rows, cols}, {residual.data(), rows, cols},
                             {y.data(), rows, cols}, p, 4321);
    gpu_->dropout_add_forward({d_x, rows, cols}, {d_r, rows, cols}, {d_y, rows, cols}, p, 4321);
    EXPECT_EQ(get(d_y, y.size()), y) << "dropout_add p=" << p;
  }
  EXPECT_THROW(gpu_->dropout_forward({d_x, rows, cols}, {d_y, rows, cols}, 1.0F, 1, 0),
               std::invalid_argument);
}

TEST_F(CudaOpsTest, LayerNormForwardAndBackward) {
  for (const std::int64_t cols : {7, 768, 1031}) {
    const std::int64_t rows = 93;
    const auto size = static_cast<std::size_t>(rows * cols);
    Vec x = random(size, 3.0F), dy = random(size), gamma = random(static_cast<std::size_t>(cols));
    Vec beta = random(gamma.size()), y(size), mean(static_cast<std::size_t>(rows));
    Vec rstd(mean.size()), dx(size), dgamma = random(gamma.size()), dbeta = random(gamma.size());
    for (auto& v : x) v += 1.5F;  // a mean far from 0
    float* d_x = upload(x);
    float* d_dy = upload(dy);
    float* d_g = upload(gamma);
    float* d_b = upload(beta);
    float* d_y = upload(y);
    float* d_mean = upload(mean);
    float* d_rstd = upload(rstd);
    float* d_dx = upload(dx);
    float* d_dg = upload(dgamma);
    float* d_db = upload(dbeta);
    cpu_.layernorm_forward({x.data(), rows, cols}, gamma.data(), beta.data(), 1e-12F,
                           {y.data(), rows, cols}, mean.data(), rstd.data());
    cpu_.layernorm_backward({x.data(), rows, cols}, {dy.data(), rows, cols}, gamma.data(),
                            mean.data(), rstd.data(), {dx.data(), rows, cols}, dgamma.data(),
                            dbeta.data());
    gpu_->layernorm_forward({d_x, rows, cols}, d_g, d_b, 1e-12F, {d_y, rows, cols}, d_mean, d_rstd);
    gpu_->layernorm_backward({d_x, rows, cols}, {d_dy, rows, cols}, d_g, d_mean, d_rstd,
                             {d_dx, rows, cols}, d_dg, d_db);
    const std::string at = " cols=" + std::to_string(cols);
    expect_close(get(d_y, size), y, kRows, "layernorm y" + at);
    expect_close(get(d_mean, mean.size()), mean, kRows, "mean" + at);
    expect_close(get(d_rstd, rstd.size()), rstd, kRows, "rstd" + at);
    expect_close(get(d_dx, size), dx, kRows, "dx" + at);
    expect_close(get(d_dg, dgamma.size()), dgamma, kRows, "dgamma" + at);
    expect_close(get(d_db, dbeta.size()), dbeta, kRows, "dbeta" + at);
  }
}

TEST_F(CudaOpsTest, MaskedSoftmaxForwardAndBackward) {
  const std::int64_t rows = 21, cols = 45;
  Vec s = random(static_cast<std::size_t>(rows * cols), 3.0F), dp = random(s.size());
  Ids mask(static_cast<std::size_t>(cols), 1);
  for (std::int64_t j = 30; j < cols; ++j) mask[static_cast<std::size_t>(j)] = 0;
  float* d_s = upload(s);
  float* d_dp = upload(dp);
  std::int64_t* d_mask = upload(mask);
  cpu_.masked_softmax_forward({s.data(), rows, cols}, 0.25F, mask.data());
  gpu_->masked_softmax_forward({d_s, rows, cols}, 0.25F, d_mask);
  expect_close(get(d_s, s.size()), s, kRows, "softmax");
  Vec dx(s.size());
  float* d_dx = upload(dx);
  cpu_.softmax_backward({s.data(), rows, cols}, {dp.data(), rows, cols}, 0.25F,
                        {dx.data(), rows, cols});
  gpu_->softmax_backward({d_s, rows, cols}, {d_dp, rows, cols}, 0.25F, {d_dx, rows, cols});
  expect_close(get(d_dx, dx.size()), dx, kRows, "softmax_backward");
}

struct AttentionCase {
  AttentionShape shape;
  float dropout;
};

TEST_F(CudaOpsTest, AttentionForwardAndBackwardWithPaddingAndDropout) {
  const AttentionCase cases[] = {
      {{2, 13, 3, 8}, 0.0F}, {{2, 13, 3, 8}, 0.1F}, {{3, 128, 4, 16}, 0.1F}};
  for (const auto& [shape, dropout] : cases) {
    const std::int64_t tokens = shape.tokens(), hidden = shape.hidden();
    Vec qkv = random(static_cast<std::size_t>(tokens * 3 * hidden));
    Vec dctx = random(static_cast<std::size_t>(tokens * hidden));
    Ids mask(static_cast<std::size_t>(tokens), 1);
    for (std::int64_t s = shape.seq - 3; s < shape.seq; ++s) mask[static_cast<std::size_t>(s)] = 0;
    const auto probs_size = static_cast<std::size_t>(attention_probs_size(shape));
    Vec probs(probs_size), work(static_cast<std::size_t>(cpu_.attention_workspace_size(shape)));
    Vec ctx(dctx.size()), dqkv(qkv.size());
    float* d_qkv = upload(qkv);
    float* d_dctx = upload(dctx);
    std::int64_t* d_mask = upload(mask);
    float* d_probs = upload(probs);
    float* d_work = upload(Vec(static_cast<std::size_t>(gpu_->attention_workspace_size(shape))));
    float* d_ctx = upload(ctx);
    float* d_dqkv = upload(dqkv);
    cpu_.attention_forward(shape, {qkv.data(), tokens, 3 * hidden}, mask.data(), dropout, 42,
                           probs.data(), work.data(), {ctx.data(), tokens, hidden});
    cpu_.attention_backward(shape, {qkv.data(), tokens, 3 * hidden}, mask.data(),
                            {ctx.data(), tokens, hidden}, probs.data(),
                            {dctx.data(), tokens, hidden}, dropout, 42, work.data(),
                            {dqkv.data(), tokens, 3 * hidden});
    gpu_->attention_forward(shape, {d_qkv, tokens, 3 * hidden}, d_mask, dropout, 42, d_probs,
                            d_work, {d_ctx, tokens, hidden});
    gpu_->attention_backward(shape, {d_qkv, tokens, 3 * hidden}, d_mask, {d_ctx, tokens, hidden},
                             d_probs, {d_dctx, tokens, hidden}, dropout, 42, d_work,
                             {d_dqkv, tokens, 3 * hidden});
    const std::string at = " seq=" + std::to_string(shape.seq) + " p=" + std::to_string(dropout);
    expect_close(get(d_probs, probs_size), probs, kRows, "probs" + at);
    expect_close(get(d_ctx, ctx.size()), ctx, kGemm, "ctx" + at);
    expect_close(get(d_dqkv, dqkv.size()), dqkv, 1e-4, "dqkv" + at);
  }
}

// Attention's pointer-batched products under bf16-operands: each product is the CPU's product
// of the bf16-rounded operands the GPU had (QKV, dctx, and its own probabilities and score
// gradients, read back), the softmax in fp32 as on the CPU.
TEST_F(CudaOpsTest, Bf16OperandAttentionProductsAreTheCpusOfRoundedOperands) {
  const AttentionCase cases[] = {
      {{2, 13, 3, 8}, 0.0F}, {{2, 13, 3, 8}, 0.1F}, {{3, 128, 4, 16}, 0.0F}};
  gpu_->set_precision(GemmPrecision::kBf16Operands);
  for (const auto& [shape, dropout] : cases) {
    const std::int64_t tokens = shape.tokens(), hidden = shape.hidden();
    const std::int64_t seq = shape.seq, d = shape.head_dim, ld = 3 * hidden;
    const Vec qkv = random(static_cast<std::size_t>(tokens * 3 * hidden));
    const Vec dctx = random(static_cast<std::size_t>(tokens * hidden));
    Ids mask(static_cast<std::size_t>(tokens), 1);
    for (std::int64_t s = seq - 3; s < seq; ++s) mask[static_cast<std::size_t>(s)] = 0;
    const auto probs_size = static_cast<std::size_t>(attention_probs_size(shape));
    const auto work_size = static_cast<std::size_t>(gpu_->attention_workspace_size(shape));
    float* d_qkv = upload(qkv);
    float* d_probs = upload(Vec(probs_size));
    float* d_work = upload(Vec(work_size));
    float* d_ctx = upload(Vec(dctx.size()));
    float* d_dqkv = upload(Vec(qkv.size()));
    const std::int64_t* d_mask = upload(mask);
    gpu_->attention_forward(shape, {d_qkv, tokens, ld}, d_mask, dropout, 42, d_probs, d_work,
                            {d_ctx, tokens, hidden});
    const Vec probs = get(d_probs, probs_size);
    // The weights that multiplied V: the dropped copy in the workspace, or the probabilities.
    const Vec weights = dropout > 0.0F ? get(d_work, probs_size) : probs;
    const Vec ctx = get(d_ctx, dctx.size());
    gpu_->attention_backward(shape, {d_qkv, tokens, ld}, d_mask, {d_ctx, tokens, hidden}, d_probs,
                             {upload(dctx), tokens, hidden}, dropout, 42, d_work,
                             {d_dqkv, tokens, ld});
    const Vec ds = get(d_work, probs_size);  // the score gradient, left in the workspace
    const Vec dqkv = get(d_dqkv, qkv.size());

    const std::string at = " seq=" + std::to_string(seq) + " p=" + std::to_string(dropout);
    // The probabilities: the CPU's softmax of the rounded operands' scores.
    const Vec qkv16 = rounded_to_bf16(qkv), dctx16 = rounded_to_bf16(dctx);
    Vec cpu_probs(probs_size),
        cpu_work(static_cast<std::size_t>(cpu_.attention_workspace_size(shape)));
    Vec cpu_ctx(dctx.size());
    cpu_.attention_forward(shape, {qkv16.data(), tokens, ld}, mask.data(), 0.0F, 42,
                           cpu_probs.data(), cpu_work.data(), {cpu_ctx.data(), tokens, hidden});
    expect_close(probs, cpu_probs, kRows, "probs" + at);
    // Each product per (sequence, head) pair on the CPU.
    const Vec weights16 = rounded_to_bf16(weights), ds16 = rounded_to_bf16(ds);
    Vec expected_ctx(dctx.size()), expected_dqkv(qkv.size()), expected_ds(probs_size);
    const float scale = 1.0F / std::sqrt(static_cast<float>(d));
    for (std::int64_t b = 0; b < shape.batch; ++b) {
      for (std::int64_t h = 0; h < shape.heads; ++h) {
        const std::int64_t pair = b * shape.heads + h;
        const std::int64_t head = b * seq * ld + h * d;
        const std::int64_t square = pair * seq * seq;
        const std::int64_t ctx_head = b * seq * hidden + h * d;
        const ConstMatrixView<float> q(qkv16.data() + head, seq, d, ld);
        const ConstMatrixView<float> k(qkv16.data() + head + hidden, seq, d, ld);
        const ConstMatrixView<float> v(qkv16.data() + head + 2 * hidden, seq, d, ld);
        const ConstMatrixView<float> dctx_pair(dctx16.data() + ctx_head, seq, d, hidden);
        cpu_.gemm({weights16.data() + square, seq, seq}, Transpose::kNo, v, Transpose::kNo,
                  {expected_ctx.data() + ctx_head, seq, d, hidden}, 1.0F, 0.0F);
        cpu_.gemm({weights16.data() + square, seq, seq}, Transpose::kYes, dctx_pair, Transpose::kNo,
                  {expected_dqkv.data() + head + 2 * hidden, seq, d, ld}, 1.0F, 0.0F);
        cpu_.gemm({ds16.data() + square, seq, seq}, Transpose::kNo, k, Transpose::kNo,
                  {expected_dqkv.data() + head, seq, d, ld}, 1.0F, 0.0F);
        cpu_.gemm({ds16.data() + square, seq, seq}, Transpose::kYes, q, Transpose::kNo,
                  {expected_dqkv.data() + head + hidden, seq, d, ld}, 1.0F, 0.0F);
        if (dropout == 0.0F) {
          // dS = softmax'(dctx V^T), with the GPU's probabilities.
          Vec dprobs(static_cast<std::size_t>(seq * seq));
          cpu_.gemm(dctx_pair, Transpose::kNo, v, Transpose::kYes, {dprobs.data(), seq, seq}, 1.0F,
                    0.0F);
          cpu_.softmax_backward({probs.data() + square, seq, seq}, {dprobs.data(), seq, seq}, scale,
                                {expected_ds.data() + square, seq, seq});
        }
      }
    }
    expect_close(ctx, expected_ctx, kGemm, "ctx" + at);
    expect_close(dqkv, expected_dqkv, kGemm, "dqkv" + at);
    if (dropout == 0.0F) expect_close(ds, expected_ds, kRows, "dS" + at);
  }
}

// --- the fused (flash-style) attention: against the CPU op, against the batched path with the
// same dropout mask, its saved log-sum-exp, bit-for-bit repeats, and its head_dim limit.

struct AttentionResult {
  Vec ctx, dqkv, saved;
};

// Padding at the end of each sequence (a different count per sequence, none where seq < 4).
Ids padding_mask(const AttentionShape& shape) {
  Ids mask(static_cast<std::size_t>(shape.tokens()), 1);
  for (std::int64_t b = 0; b < shape.batch; ++b) {
    const std::int64_t padded = shape.seq < 4 ? 0 : (shape.seq / 4 + b) % shape.seq;
    for (std::int64_t s = shape.seq - padded; s < shape.seq; ++s) {
      mask[static_cast<std::size_t>(b * shape.seq + s)] = 0;
    }
  }
  return mask;
}

// The CPU op's ctx and dqkv (saved: its probabilities).
AttentionResult cpu_attention(CpuOps<float>& cpu, const AttentionShape& shape, const Vec& qkv,
                              const Vec& dctx, const Ids& mask, float dropout) {
  const std::int64_t tokens = shape.tokens(), hidden = shape.hidden();
  AttentionResult r{Vec(dctx.size()), Vec(qkv.size()),
                    Vec(static_cast<std::size_t>(cpu.attention_saved_size(shape)))};
  Vec work(static_cast<std::size_t>(cpu.attention_workspace_size(shape)));
  cpu.attention_forward(shape, {qkv.data(), tokens, 3 * hidden}, mask.data(), dropout, 42,
                        r.saved.data(), work.data(), {r.ctx.data(), tokens, hidden});
  cpu.attention_backward(shape, {qkv.data(), tokens, 3 * hidden}, mask.data(),
                         {r.ctx.data(), tokens, hidden}, r.saved.data(),
                         {dctx.data(), tokens, hidden}, dropout, 42, work.data(),
                         {r.dqkv.data(), tokens, 3 * hidden});
  return r;
}

// TF32 products (10-bit mantissas) against the CPU's fp32: the GEMM tests' 1e-5 for the
// forward, ten times that for the gradients (the softmax backward's P (dP - rowsum) cancels).
constexpr double kTf32ContextNmse = 1e-5;
constexpr double kTf32GradientNmse = 1e-4;

class FusedAttentionTest : public CudaOpsTest {
 protected:
  // Forward and backward through gpu_ with `algorithm`; outputs start as garbage (NaN), so a
  // value left unwritten shows.
  AttentionResult gpu_attention(AttentionAlgorithm algorithm, const AttentionShape& shape,
                                const Vec& qkv, const Vec& dctx, const Ids& mask, float dropout) {
    gpu_->set_attention_algorithm(algorithm);
    const std::int64_t tokens = shape.tokens(), hidden = shape.hidden();
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const auto saved_size = static_cast<std::size_t>(gpu_->attention_saved_size(shape));
    float* d_qkv = upload(qkv);
    float* d_dctx = upload(dctx);
    const std::int64_t* d_mask = upload(mask);
    float* d_saved = upload(Vec(saved_size, nan));
    float* d_work =
        upload(Vec(static_cast<std::size_t>(gpu_->attention_workspace_size(shape)), nan));
    float* d_ctx = upload(Vec(dctx.size(), nan));
    float* d_dqkv = upload(Vec(qkv.size(), nan));
    gpu_->attention_forward(shape, {d_qkv, tokens, 3 * hidden}, d_mask, dropout, 42, d_saved,
                            d_work, {d_ctx, tokens, hidden});
    gpu_->attention_backward(shape, {d_qkv, tokens, 3 * hidden}, d_mask, {d_ctx, tokens, hidden},
                             d_saved, {d_dctx, tokens, hidden}, dropout, 42, d_work,
                             {d_dqkv, tokens, 3 * hidden});
    AttentionResult r{get(d_ctx, dctx.size()), get(d_dqkv, qkv.size()), get(d_saved, saved_size)};
    tensors_.clear();  // the device copies of this run
    return r;
  }
};

// log(sum_j exp(scale q_i . k_j + mask_j)) per (sequence, head, query) row, in double.
Vec expected_log_sum_exp(const AttentionShape& shape, const Vec& qkv, const Ids& mask) {
  const std::int64_t seq = shape.seq, d = shape.head_dim, hidden = shape.hidden();
  const std::int64_t ld = 3 * hidden;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  Vec lse(static_cast<std::size_t>(shape.batch * shape.heads * seq));
  for (std::int64_t b = 0; b < shape.batch; ++b) {
    for (std::int64_t h = 0; h < shape.heads; ++h) {
      for (std::int64_t i = 0; i < seq; ++i) {
        std::vector<double> logits(static_cast<std::size_t>(seq));
        double max = -INFINITY;
        for (std::int64_t j = 0; j < seq; ++j) {
          double dot = 0.0;
          for (std::int64_t c = 0; c < d; ++c) {
            dot +=
                static_cast<double>(qkv[static_cast<std::size_t>((b * seq + i) * ld + h * d + c)]) *
                qkv[static_cast<std::size_t>((b * seq + j) * ld + hidden + h * d + c)];
          }
          double logit = dot * scale;
          if (mask[static_cast<std::size_t>(b * seq + j)] == 0) logit += kMaskedLogit;
          logits[static_cast<std::size_t>(j)] = logit;
          max = std::max(max, logit);
        }
        double total = 0.0;
        for (const double l : logits) total += std::exp(l - max);
        lse[static_cast<std::size_t>((b * shape.heads + h) * seq + i)] =
            static_cast<float>(max + std::log(total));
      }
    }
  }
  return lse;
}

TEST_F(FusedAttentionTest, MatchesTheCpuAtOddSequencesPaddingAndDropout) {
  // Sequences 1, 7, 128, 129 (a partial key and query block), 512; head_dim 64 (BERT), 20 and
  // 96 (padded inside the 64 and 128 kernels), 128.
  const AttentionCase cases[] = {
      {{2, 1, 3, 64}, 0.0F},   {{2, 7, 2, 64}, 0.0F},   {{2, 7, 2, 64}, 0.1F},
      {{2, 128, 2, 64}, 0.0F}, {{2, 128, 2, 64}, 0.1F}, {{2, 129, 2, 64}, 0.1F},
      {{1, 512, 2, 64}, 0.0F}, {{1, 512, 2, 64}, 0.1F}, {{3, 13, 3, 20}, 0.1F},
      {{2, 70, 2, 96}, 0.1F},  {{1, 65, 2, 128}, 0.0F}, {{1, 65, 2, 128}, 0.1F}};
  for (const auto& [shape, dropout] : cases) {
    const Vec qkv = random(static_cast<std::size_t>(shape.tokens() * 3 * shape.hidden()));
    const Vec dctx = random(static_cast<std::size_t>(shape.tokens() * shape.hidden()));
    const Ids mask = padding_mask(shape);
    const AttentionResult expected = cpu_attention(cpu_, shape, qkv, dctx, mask, dropout);
    const AttentionResult fused =
        gpu_attention(AttentionAlgorithm::kFused, shape, qkv, dctx, mask, dropout);
    const std::string at = " seq=" + std::to_string(shape.seq) +
                           " d=" + std::to_string(shape.head_dim) + " p=" + std::to_string(dropout);
    ASSERT_EQ(fused.saved.size(), static_cast<std::size_t>(shape.batch * shape.heads * shape.seq));
    expect_close(fused.saved, expected_log_sum_exp(shape, qkv, mask), kRows, "lse" + at);
    expect_close(fused.ctx, expected.ctx, kGemm, "ctx" + at);
    expect_close(fused.dqkv, expected.dqkv, 1e-4, "dqkv" + at);
    EXPECT_LT(nmse(fused.ctx, expected.ctx), 1e-10) << "ctx" << at;
    EXPECT_LT(nmse(fused.dqkv, expected.dqkv), 1e-9) << "dqkv" << at;
    // TF32: the tensor-core kernels (head_dim <= 64; the fp32 ones above that), within TF32's
    // product tolerance.
    gpu_->set_precision(GemmPrecision::kTf32);
    const AttentionResult tf32 =
        gpu_attention(AttentionAlgorithm::kFused, shape, qkv, dctx, mask, dropout);
    gpu_->set_precision(GemmPrecision::kFp32);
    EXPECT_LT(nmse(tf32.ctx, expected.ctx), kTf32ContextNmse) << "TF32 ctx" << at;
    EXPECT_LT(nmse(tf32.dqkv, expected.dqkv), kTf32GradientNmse) << "TF32 dqkv" << at;
    EXPECT_LT(nmse(tf32.saved, fused.saved), kTf32ContextNmse) << "TF32 lse" << at;
  }
}

// fp32 FMA under fp32, TF32 tensor cores under the other precisions (bf16 gets TF32's products
// for now): within each precision's product tolerance of the CPU, as the other ops' tests.
TEST_F(FusedAttentionTest, EveryPrecisionStaysWithinItsTolerance) {
  const AttentionShape shape{2, 129, 4, 64};
  const Vec qkv = random(static_cast<std::size_t>(shape.tokens() * 3 * shape.hidden()));
  const Vec dctx = random(static_cast<std::size_t>(shape.tokens() * shape.hidden()));
  const Ids mask = padding_mask(shape);
  const AttentionResult expected = cpu_attention(cpu_, shape, qkv, dctx, mask, 0.1F);
  struct Limit {
    GemmPrecision precision;
    double ctx, dqkv;
  };
  const Limit limits[] = {{GemmPrecision::kFp32, 1e-10, 1e-9},
                          {GemmPrecision::kTf32, kTf32ContextNmse, kTf32GradientNmse},
                          {GemmPrecision::kBf16, 5e-3, 5e-3},
                          {GemmPrecision::kBf16Operands, 5e-3, 5e-3}};
  for (const auto& [precision, ctx_limit, dqkv_limit] : limits) {
    gpu_->set_precision(precision);
    const AttentionResult fused =
        gpu_attention(AttentionAlgorithm::kFused, shape, qkv, dctx, mask, 0.1F);
    const std::string at = " precision=" + std::string(to_string(precision));
    EXPECT_LT(nmse(fused.ctx, expected.ctx), ctx_limit) << "ctx" << at;
    EXPECT_LT(nmse(fused.dqkv, expected.dqkv), dqkv_limit) << "dqkv" << at;
  }
}

// Same inputs, same seed: the batched path and the fused kernels drop the same probabilities, so
// their results agree to rounding (a different mask would differ by O(1)).
TEST_F(FusedAttentionTest, DropoutMaskIsTheBatchedPathsBitForBit) {
  const AttentionCase cases[] = {
      {{4, 128, 4, 64}, 0.1F}, {{1, 512, 2, 64}, 0.1F}, {{3, 37, 2, 32}, 0.5F}};
  for (const auto& [shape, dropout] : cases) {
    const Vec qkv = random(static_cast<std::size_t>(shape.tokens() * 3 * shape.hidden()));
    const Vec dctx = random(static_cast<std::size_t>(shape.tokens() * shape.hidden()));
    const Ids mask = padding_mask(shape);
    const AttentionResult batched =
        gpu_attention(AttentionAlgorithm::kBatchedGemm, shape, qkv, dctx, mask, dropout);
    const AttentionResult fused =
        gpu_attention(AttentionAlgorithm::kFused, shape, qkv, dctx, mask, dropout);
    const std::string at = " seq=" + std::to_string(shape.seq) + " p=" + std::to_string(dropout);
    expect_close(fused.ctx, batched.ctx, kGemm, "ctx vs batched" + at);
    expect_close(fused.dqkv, batched.dqkv, 1e-4, "dqkv vs batched" + at);
    // The tensor-core kernels draw the same mask.
    gpu_->set_precision(GemmPrecision::kTf32);
    const AttentionResult tf32 =
        gpu_attention(AttentionAlgorithm::kFused, shape, qkv, dctx, mask, dropout);
    gpu_->set_precision(GemmPrecision::kFp32);
    EXPECT_LT(nmse(tf32.ctx, batched.ctx), kTf32ContextNmse) << "TF32 ctx vs batched" << at;
    EXPECT_LT(nmse(tf32.dqkv, batched.dqkv), kTf32GradientNmse) << "TF32 dqkv vs batched" << at;
  }
}

TEST_F(FusedAttentionTest, RepeatsBitForBit) {
  const AttentionShape shape{3, 129, 4, 64};
  const Vec qkv = random(static_cast<std::size_t>(shape.tokens() * 3 * shape.hidden()));
  const Vec dctx = random(static_cast<std::size_t>(shape.tokens() * shape.hidden()));
  const Ids mask = padding_mask(shape);
  // fp32: the FMA kernels; TF32: the tensor-core ones.
  for (const GemmPrecision precision : {GemmPrecision::kFp32, GemmPrecision::kTf32}) {
    gpu_->set_precision(precision);
    const std::string at = std::string(to_string(precision)) + ", run ";
    const AttentionResult first =
        gpu_attention(AttentionAlgorithm::kFused, shape, qkv, dctx, mask, 0.1F);
    for (int run = 0; run < 3; ++run) {
      const AttentionResult again =
          gpu_attention(AttentionAlgorithm::kFused, shape, qkv, dctx, mask, 0.1F);
      const auto same = [](const Vec& a, const Vec& b) {
        return a.size() == b.size() &&
               std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
      };
      EXPECT_TRUE(same(again.ctx, first.ctx)) << "ctx, " << at << run;
      EXPECT_TRUE(same(again.saved, first.saved)) << "lse, " << at << run;
      EXPECT_TRUE(same(again.dqkv, first.dqkv)) << "dqkv, " << at << run;
    }
  }
}

TEST_F(FusedAttentionTest, SizesAndTheHeadDimLimit) {
  const AttentionShape shape{2, 129, 3, 64};
  gpu_->set_attention_algorithm(AttentionAlgorithm::kBatchedGemm);
  EXPECT_EQ(gpu_->attention_saved_size(shape), attention_probs_size(shape));
  gpu_->set_attention_algorithm(AttentionAlgorithm::kFused);
  EXPECT_EQ(gpu_->attention_saved_size(shape), 2 * 3 * 129);
  // dO.O per row, and a partial dQ per block of 64 keys (3 blocks).
  EXPECT_EQ(gpu_->attention_workspace_size(shape), 2 * 3 * 129 + 3 * 2 * 3 * 129 * 64);
  const AttentionShape wide{1, 8, 2, 160};
  float* qkv = upload(Vec(static_cast<std::size_t>(wide.tokens() * 3 * wide.hidden())));
  float* ctx = upload(Vec(static_cast<std::size_t>(wide.tokens() * wide.hidden())));
  float* saved = upload(Vec(static_cast<std::size_t>(gpu_->attention_saved_size(wide))));
  EXPECT_THROW(gpu_->attention_forward(wide, {qkv, wide.tokens(), 3 * wide.hidden()}, nullptr, 0.0F,
                                       1, saved, nullptr, {ctx, wide.tokens(), wide.hidden()}),
               std::invalid_argument);
}

TEST_F(CudaOpsTest, EmbeddingGatherScatterAndBadIds) {
  const std::int64_t vocab = 50, width = 33, rows = 77;
  Vec table = random(static_cast<std::size_t>(vocab * width));
  Vec dout = random(static_cast<std::size_t>(rows * width));
  Ids ids(static_cast<std::size_t>(rows));
  for (std::size_t r = 0; r < ids.size(); ++r) ids[r] = static_cast<std::int64_t>((r * 7) % 11);
  Vec out = random(dout.size()), dtable = random(table.size());
  float* d_table = upload(table);
  float* d_dout = upload(dout);
  std::int64_t* d_ids = upload(ids);
  float* d_out = upload(out);
  float* d_dtable = upload(dtable);
  cpu_.embedding_forward({table.data(), vocab, width}, ids.data(), {out.data(), rows, width}, "ids",
                         true);
  gpu_->embedding_forward({d_table, vocab, width}, d_ids, {d_out, rows, width}, "ids", true);
  expect_close(get(d_out, out.size()), out, kTight, "embedding_forward (accumulate)");
  cpu_.embedding_backward({dout.data(), rows, width}, ids.data(), {dtable.data(), vocab, width}, 3);
  gpu_->embedding_backward({d_dout, rows, width}, d_ids, {d_dtable, vocab, width}, 3);
  // Sorted by id, each table row adding its rows in row order: the CPU's bits.
  expect_close(get(d_dtable, dtable.size()), dtable, 0.0, "embedding_backward (skip 3)");
  cpu_.gather_rows({table.data(), vocab, width}, ids.data(), {out.data(), rows, width});
  gpu_->gather_rows({d_table, vocab, width}, d_ids, {d_out, rows, width});
  expect_close(get(d_out, out.size()), out, 0.0, "gather_rows");
  cpu_.scatter_add_rows({dout.data(), rows, width}, ids.data(), {dtable.data(), vocab, width});
  gpu_->scatter_add_rows({d_dout, rows, width}, d_ids, {d_dtable, vocab, width});
  expect_close(get(d_dtable, dtable.size()), dtable, 0.0, "scatter_add_rows");

  ids[40] = vocab;  // out of range: the same message as the CPU op
  std::int64_t* d_bad = upload(ids);
  std::string cpu_message, gpu_message;
  try {
    cpu_.embedding_forward({table.data(), vocab, width}, ids.data(), {out.data(), rows, width},
                           "input_ids", false);
  } catch (const std::invalid_argument& e) {
    cpu_message = e.what();
  }
  try {
    gpu_->embedding_forward({d_table, vocab, width}, d_bad, {d_out, rows, width}, "input_ids",
                            false);
  } catch (const std::invalid_argument& e) {
    gpu_message = e.what();
  }
  EXPECT_NE(cpu_message.find("at row 40"), std::string::npos) << cpu_message;
  EXPECT_EQ(gpu_message, cpu_message);
}

TEST_F(CudaOpsTest, CrossEntropyWeightedForwardBackwardAndBadLabels) {
  const std::int64_t rows = 29, classes = 1000;
  Vec logits = random(static_cast<std::size_t>(rows * classes), 3.0F);
  Ids labels(static_cast<std::size_t>(rows));
  Vec weights(labels.size());
  for (std::size_t r = 0; r < labels.size(); ++r) {
    labels[r] = static_cast<std::int64_t>((r * 37) % classes);
    weights[r] = r % 4 == 3 ? 0.0F : 1.0F;
  }
  labels[3] = -5;  // weight 0: ignored, as on the CPU
  for (const bool weighted : {false, true}) {
    if (!weighted)
      labels[3] = 1;
    else
      labels[3] = -5;
    Vec probs = logits;
    float* d_probs = upload(probs);
    std::int64_t* d_labels = upload(labels);
    float* d_weights = upload(weights);
    const float* cpu_w = weighted ? weights.data() : nullptr;
    const float* gpu_w = weighted ? d_weights : nullptr;
    const float cpu_loss =
        cpu_.cross_entropy_forward({probs.data(), rows, classes}, labels.data(), cpu_w, "labels");
    const float gpu_loss =
        gpu_->cross_entropy_forward({d_probs, rows, classes}, d_labels, gpu_w, "labels");
    EXPECT_NEAR(gpu_loss, cpu_loss, 2e-6 * std::abs(cpu_loss));
    expect_close(get(d_probs, probs.size()), probs, kRows, "softmax probabilities");
    cpu_.cross_entropy_backward({probs.data(), rows, classes}, labels.data(), cpu_w, 0.25F);
    gpu_->cross_entropy_backward({d_probs, rows, classes}, d_labels, gpu_w, 0.25F);
    expect_close(get(d_probs, probs.size()), probs, kRows, "cross_entropy_backward");
  }
  labels[3] = 1;
  labels[5] = classes;  // weight 1 and out of range
  std::int64_t* d_bad = upload(labels);
  float* d_logits = upload(logits);
  EXPECT_THROW(
      {
        try {
          gpu_->cross_entropy_forward({d_logits, rows, classes}, d_bad, nullptr, "masked_lm_ids");
        } catch (const std::invalid_argument& e) {
          EXPECT_NE(std::string(e.what()).find("masked_lm_ids value 1000 at row 5"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      std::invalid_argument);
}

// The embedding gradients of a BERT batch: a vocabulary-sized table with repeated ids, and a
// two-row table (token types) whose two runs hold half the rows each. Bit for bit the CPU's,
// and the same on a second run (no atomic adds).
TEST_F(CudaOpsTest, EmbeddingBackwardIsTheCpusBitsAndRepeats) {
  const std::int64_t width = 64, rows = 4099;
  for (const std::int64_t vocab : {std::int64_t{30522}, std::int64_t{2}}) {
    SCOPED_TRACE("vocab " + std::to_string(vocab));
    Vec dout = random(static_cast<std::size_t>(rows * width));
    Ids ids(static_cast<std::size_t>(rows));
    for (std::size_t r = 0; r < ids.size(); ++r) {
      ids[r] = static_cast<std::int64_t>((r * r * 2654435761ULL) % static_cast<std::size_t>(vocab));
    }
    const Vec start = random(static_cast<std::size_t>(vocab * width));
    Vec dtable = start;
    cpu_.embedding_backward({dout.data(), rows, width}, ids.data(), {dtable.data(), vocab, width},
                            0);
    const float* d_dout = upload(dout);
    const std::int64_t* d_ids = upload(ids);
    Vec first;
    for (int run = 0; run < 2; ++run) {
      float* d_dtable = upload(start);
      gpu_->embedding_backward({d_dout, rows, width}, d_ids, {d_dtable, vocab, width}, 0);
      const Vec got = get(d_dtable, start.size());
      expect_close(got, dtable, 0.0, "embedding_backward run " + std::to_string(run));
      if (run == 0) {
        first = got;
      } else {
        EXPECT_EQ(std::memcmp(got.data(), first.data(), got.size() * sizeof(float)), 0);
      }
    }
  }
}

TEST_F(CudaOpsTest, ReductionsAndNonFiniteCheck) {
  Vec x = random(100003);
  float* d_x = upload(x);
  double sum = 0.0, squares = 0.0;
  for (const float v : x) {
    sum += v;
    squares += static_cast<double>(v) * v;
  }
  EXPECT_NEAR(gpu_->sum(d_x, static_cast<std::int64_t>(x.size())), sum, 1e-5 * squares);
  EXPECT_NEAR(gpu_->sum_of_squares(d_x, static_cast<std::int64_t>(x.size())), squares,
              1e-6 * squares);
  // Deterministic (the blocks' partials added in a fixed order): a large array twice.
  Vec big = random(std::size_t{1} << 23);
  const float* d_big = upload(big);
  const float once = gpu_->sum_of_squares(d_big, static_cast<std::int64_t>(big.size()));
  const float again = gpu_->sum_of_squares(d_big, static_cast<std::int64_t>(big.size()));
  EXPECT_EQ(std::memcmp(&once, &again, sizeof(float)), 0);
  // Many arrays at once, one wait: the per-array sums added in double (within their rounding).
  const std::vector<std::span<const float>> arrays = {
      {d_x, x.size()}, {d_big, big.size()}, {d_x + 5, 0}, {d_x + 7, 1000}};
  double per_array = 0.0;
  for (const auto array : arrays) {
    per_array += array.empty() ? 0.0
                               : static_cast<double>(gpu_->sum_of_squares(
                                     array.data(), static_cast<std::int64_t>(array.size())));
  }
  const double total = gpu_->sum_of_squares_total(arrays);
  EXPECT_NEAR(total, per_array, 1e-6 * per_array);
  EXPECT_EQ(gpu_->sum_of_squares_total(arrays), total);  // deterministic
  EXPECT_TRUE(gpu_->all_finite(d_x, static_cast<std::int64_t>(x.size())));
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    Vec y = x;
    y[77777] = bad;
    EXPECT_FALSE(gpu_->all_finite(upload(y), static_cast<std::int64_t>(y.size())));
    EXPECT_FALSE(cpu_.all_finite(y.data(), static_cast<std::int64_t>(y.size())));
  }
}

TEST_F(CudaOpsTest, ShapeMismatchesThrowBeforeLaunching) {
  Vec a(12);
  float* d = upload(a);
  EXPECT_THROW(
      gpu_->gemm({d, 3, 4}, Transpose::kNo, {d, 3, 4}, Transpose::kNo, {d, 3, 4}, 1.0F, 0.0F),
      std::invalid_argument);
  EXPECT_THROW(gpu_->add({d, 3, 4}, {d, 4, 3}, {d, 3, 4}), std::invalid_argument);
  EXPECT_THROW(gpu_->layernorm_forward({d, 3, 4}, d, d, 1e-5F, {d, 4, 3}, d, d),
               std::invalid_argument);
}

TEST_F(CudaOpsTest, MakeOpsPicksTheImplementationOfTheBackendsDevice) {
  auto ops = make_ops<float>(*backend_);
  EXPECT_EQ(ops->device(), (tensor::Device{tensor::DeviceKind::kCuda, 0}));
  EXPECT_NE(dynamic_cast<CudaOps*>(ops.get()), nullptr);
  EXPECT_THROW(make_ops<double>(*backend_), std::invalid_argument);
}

TEST_F(CudaOpsTest, StreamsAndEventsOrderWork) {
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

TEST_F(CudaOpsTest, OpsOnAWorkerStreamFollowThatStream) {
  auto stream = backend_->create_stream();
  CudaOps worker(*backend_, stream.get(), GemmPrecision::kTf32);
  EXPECT_EQ(worker.stream(), dynamic_cast<CudaStream&>(*stream).get());
  Vec x = random(1000);
  float* d = upload(x);
  EXPECT_NEAR(worker.sum(d, 1000), gpu_->sum(d, 1000), 1e-4);
}

}  // namespace
}  // namespace pf::kernels::cuda
