// The attention core's two algorithms in the simulator (sim/attention_kernels.h): the fused
// kernel replaces only the attention core's kernels, prices flash_attention.cu's work (one
// forward kernel; row sums, the key-block kernel with the recomputed scores, the dQ sum), keeps
// no [S, S] tensor in the stash, and travels from pipefisher_train's calibration records.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "runtime/model/bert_config.h"
#include "scheduler/compile.h"
#include "sim/analytic_cost_model.h"
#include "sim/attention_kernels.h"
#include "sim/bert_kernels.h"
#include "sim/calibration.h"
#include "sim/device.h"
#include "sim/profile_measurements.h"
#include "sim/simulator.h"
#include "sim/transformer_kernels.h"
#include "tests/sim/error_message.h"

namespace pf::sim {
namespace {

using test::error_of;

Workload bert_large(int seq, int batch, AttentionAlgorithm attention,
                    Precision precision = Precision::kBf16) {
  Workload w;
  w.config = model::bert_preset("large");
  w.seq_len = seq;
  w.micro_batch_size = batch;
  w.precision = precision;
  w.storage_precision = Precision::kFp32;  // as pipefisher_train stores
  w.attention = attention;
  return w;
}

bool same(const Kernel& a, const Kernel& b) {
  return a.op_class == b.op_class && a.precision == b.precision && a.flops == b.flops &&
         a.bytes == b.bytes && a.size == b.size && a.mean_size == b.mean_size &&
         a.exponentials == b.exponentials && a.error_functions == b.error_functions &&
         a.random_numbers == b.random_numbers && a.count == b.count && a.host_sync == b.host_sync &&
         a.curvature_host == b.curvature_host;
}

bool same(const Kernels& a, const Kernels& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!same(a[i], b[i])) return false;
  }
  return true;
}

// Where two kernel lists differ: the length of their common prefix and common suffix, and the
// differing middles.
struct Difference {
  std::size_t prefix = 0, suffix = 0;
  Kernels first, second;
};
Difference difference(const Kernels& a, const Kernels& b) {
  Difference d;
  while (d.prefix < a.size() && d.prefix < b.size() && same(a[d.prefix], b[d.prefix])) ++d.prefix;
  while (d.suffix < a.size() - d.prefix && d.suffix < b.size() - d.prefix &&
         same(a[a.size() - 1 - d.suffix], b[b.size() - 1 - d.suffix])) {
    ++d.suffix;
  }
  d.first.assign(a.begin() + static_cast<std::ptrdiff_t>(d.prefix),
                 a.end() - static_cast<std::ptrdiff_t>(d.suffix));
  d.second.assign(b.begin() + static_cast<std::ptrdiff_t>(d.prefix),
                  b.end() - static_cast<std::ptrdiff_t>(d.suffix));
  return d;
}

double class_flops(const Kernels& kernels, OpClass op_class) {
  double flops = 0.0;
  for (const Kernel& k : kernels) {
    if (k.op_class == op_class) flops += k.count * k.flops;
  }
  return flops;
}

// Both table shapes of docs/cuda.md (BERT-Large, 16 heads of 64).
TEST(SimAttention, FusedReplacesOnlyTheAttentionCore) {
  for (const auto& [seq, batch] : {std::pair{128, 32}, std::pair{512, 8}}) {
    const Workload bw = bert_large(seq, batch, AttentionAlgorithm::kBatched);
    const Workload fw = bert_large(seq, batch, AttentionAlgorithm::kFused);
    const PieceKernels batched = encoder_layer_kernels(bw);
    const PieceKernels fused = encoder_layer_kernels(fw);
    const AttentionCoreKernels core = fused_attention_kernels(attention_shape(fw));
    // Forward: the Q, K, V Linears (bias fill + product each) come first, then the core: the
    // batched path's 8 entries (split copies, Q K^T, scale + mask, softmax, dropout, V split,
    // P V, heads merged) become the one fused kernel; everything after it is the same.
    const Difference f = difference(batched.forward, fused.forward);
    EXPECT_EQ(f.prefix, 6U) << "S = " << seq;
    EXPECT_EQ(f.first.size(), 8U);
    EXPECT_TRUE(same(f.second, core.forward));
    EXPECT_EQ(f.prefix + f.first.size() + f.suffix, batched.forward.size());
    EXPECT_EQ(total_kernels(f.first), 10);  // launches of the batched core
    EXPECT_EQ(total_kernels(f.second), 1);
    // Backward-input: the batched core's 10 entries (11 launches) become row sums, the
    // key-block kernel and the dQ sum; the Linears' and element-wise backward are untouched.
    const Difference b = difference(batched.backward_input, fused.backward_input);
    EXPECT_EQ(b.first.size(), 10U);
    EXPECT_EQ(total_kernels(b.first), 11);
    EXPECT_TRUE(same(b.second, core.backward));
    EXPECT_EQ(total_kernels(b.second), 3);
    // Parameter gradients do not touch the core.
    EXPECT_TRUE(same(batched.backward_weight, fused.backward_weight));
    // The other pieces do not depend on the attention.
    EXPECT_TRUE(same(embeddings_kernels(bw).forward, embeddings_kernels(fw).forward));
    EXPECT_TRUE(same(heads_kernels(bw).backward_input, heads_kernels(fw).backward_input));
  }
}

TEST(SimAttention, FusedKernelsPriceFlashAttentionsWork) {
  const double b = 8, S = 512, H = 1024, a = 16, d = 64, T = b * S, e = 4;
  const Workload bw = bert_large(512, 8, AttentionAlgorithm::kBatched);
  const Workload fw = bert_large(512, 8, AttentionAlgorithm::kFused);
  const AttentionCoreKernels core = fused_attention_kernels(attention_shape(fw));
  ASSERT_EQ(core.forward.size(), 1U);
  ASSERT_EQ(core.backward.size(), 3U);
  const Kernel& forward = core.forward[0];
  EXPECT_EQ(forward.op_class, OpClass::kAttention);
  EXPECT_EQ(forward.precision, Precision::kTf32);  // bf16 runs get the TF32 WMMA kernels
  EXPECT_DOUBLE_EQ(forward.flops, 4 * b * a * S * S * d);
  // Q, K, V read, O written, one fp32 log-sum-exp per query row: no S x S term.
  EXPECT_DOUBLE_EQ(forward.bytes, e * 4 * T * H + 4 * b * a * S);
  EXPECT_DOUBLE_EQ(forward.size, d);
  EXPECT_DOUBLE_EQ(forward.mean_size, 3 / (2 / S + 1 / d));
  // The same sizes as the batched products': both algorithms read the class's curve alike.
  const Kernels batched_forward = encoder_layer_kernels(bw).forward;
  const auto product =
      std::find_if(batched_forward.begin(), batched_forward.end(),
                   [](const Kernel& k) { return k.op_class == OpClass::kAttention; });
  ASSERT_NE(product, batched_forward.end());
  EXPECT_DOUBLE_EQ(forward.size, product->size);
  EXPECT_DOUBLE_EQ(forward.mean_size, product->mean_size);
  const Kernel& row_dot = core.backward[0];
  EXPECT_EQ(row_dot.op_class, OpClass::kMemory);
  EXPECT_DOUBLE_EQ(row_dot.bytes, e * 2 * T * H + 4 * b * a * S);
  const Kernel& key_blocks = core.backward[1];
  EXPECT_EQ(key_blocks.op_class, OpClass::kAttention);
  // Recomputed Q K^T, dO V^T, dV, dK and dQ's shares: five products.
  EXPECT_DOUBLE_EQ(key_blocks.flops, 10 * b * a * S * S * d);
  // Q, K, V, dO, lse and row sums in; dK, dV and 512 / 64 = 8 fp32 partial dQs out.
  EXPECT_DOUBLE_EQ(key_blocks.bytes, e * 4 * T * H + 8 * b * a * S + e * 2 * T * H + 4 * 8 * T * H);
  const Kernel& dq_sum = core.backward[2];
  EXPECT_EQ(dq_sum.op_class, OpClass::kMemory);
  EXPECT_DOUBLE_EQ(dq_sum.bytes, 4 * 8 * T * H + e * T * H);
  // The layer's products: forward alike, backward with the recomputed scores on top of the
  // batched path's four gradient products.
  const PieceKernels batched = encoder_layer_kernels(bw);
  const PieceKernels fused = encoder_layer_kernels(fw);
  EXPECT_DOUBLE_EQ(class_flops(fused.forward, OpClass::kAttention),
                   class_flops(batched.forward, OpClass::kAttention));
  EXPECT_DOUBLE_EQ(class_flops(fused.backward_input, OpClass::kAttention),
                   class_flops(batched.backward_input, OpClass::kAttention) + 2 * b * S * S * H);
  EXPECT_DOUBLE_EQ(class_flops(fused.backward_input, OpClass::kGemm),
                   class_flops(batched.backward_input, OpClass::kGemm));
  // The products' arithmetic follows the runtime: fp32 FMA under fp32 and for heads over 64.
  EXPECT_EQ(fused_attention_precision(Precision::kFp32, 64), Precision::kFp32);
  EXPECT_EQ(fused_attention_precision(Precision::kTf32, 64), Precision::kTf32);
  EXPECT_EQ(fused_attention_precision(Precision::kBf16, 96), Precision::kFp32);
}

TEST(SimAttention, FusedStashDropsExactlyTheScores) {
  for (const auto& [seq, batch] : {std::pair{128, 32}, std::pair{512, 8}}) {
    const Workload bw = bert_large(seq, batch, AttentionAlgorithm::kBatched);
    const Workload fw = bert_large(seq, batch, AttentionAlgorithm::kFused);
    const double a = 16, S = seq, b = batch, e = 4;
    // pipefisher_train's stash (the default): the probabilities (e a b S^2) out, one log-sum-exp
    // per query row (e a b S, in the chunk's element type) in.
    const double scores = e * a * b * S * S, lse = e * a * b * S;
    EXPECT_DOUBLE_EQ(encoder_layer_activation_bytes(bw) - encoder_layer_activation_bytes(fw),
                     scores - lse)
        << "S = " << seq;
    // The eager count (--stash eager): Korthikanti's 5 a b S^2 (softmax output, dropout mask,
    // dropout output; 16-bit counts scaled by e / 2) out, the fp32 log-sum-exps in.
    Workload be = bw, fe = fw;
    be.stash = fe.stash = ActivationStash::kEager;
    EXPECT_DOUBLE_EQ(encoder_layer_activation_bytes(be) - encoder_layer_activation_bytes(fe),
                     5 * a * b * S * S * e / 2 - 4 * a * b * S)
        << "S = " << seq;
    EXPECT_DOUBLE_EQ(embeddings_activation_bytes(bw), embeddings_activation_bytes(fw));
    EXPECT_DOUBLE_EQ(heads_activation_bytes(bw), heads_activation_bytes(fw));
    // The simulated peak: GPipe on one worker stashes all 4 micro-batches of 24 layers.
    sched::ScheduleParams params;
    params.kind = sched::ScheduleKind::kGPipe;
    params.workers = 1;
    params.microbatches = 4;
    params.num_layers = 24;
    const auto schedule = sched::compile(params);
    const DeviceSpec h100 = device_preset("h100");
    const SimResult with_batched = simulate(schedule, AnalyticCostModel(bw, h100));
    const SimResult with_fused = simulate(schedule, AnalyticCostModel(fw, h100));
    const double saved =
        with_batched.workers[0].peak_memory_bytes - with_fused.workers[0].peak_memory_bytes;
    EXPECT_NEAR(saved, 4 * 24 * (scores - lse), 1e-9 * saved);
    EXPECT_DOUBLE_EQ(with_batched.workers[0].static_memory_bytes,
                     with_fused.workers[0].static_memory_bytes);
  }
}

TEST(SimAttention, ParallelModelPricesAndStashesTheFusedCore) {
  ParallelWorkload batched;
  batched.model = transformer_preset("gpt2");
  batched.seq_len = 1024;
  batched.micro_batch_size = 2;
  batched.precision = Precision::kBf16;
  batched.tensor_parallel = 2;
  ParallelWorkload fused = batched;
  fused.attention = AttentionAlgorithm::kFused;
  const PieceKernels bk = transformer_layer_kernels(batched);
  const PieceKernels fk = transformer_layer_kernels(fused);
  const Difference f = difference(bk.forward, fk.forward);
  EXPECT_EQ(total_kernels(f.second), 1);
  EXPECT_EQ(f.second[0].op_class, OpClass::kAttention);
  const Difference b = difference(bk.backward_input, fk.backward_input);
  EXPECT_EQ(total_kernels(b.second), 3);
  EXPECT_TRUE(same(bk.backward_weight, fk.backward_weight));
  // 6 of 12 heads per rank: N = b a_t S^2 scores, 5 N 16-bit units of scores out (dropout on).
  const double S = 1024, bs = 2, a_t = 6, H = 768;
  EXPECT_DOUBLE_EQ(
      transformer_layer_activation_bytes(batched) - transformer_layer_activation_bytes(fused),
      5 * bs * a_t * S * S - 4 * bs * a_t * S);
  // Hardware FLOPs: the recomputed Q K^T of every layer.
  EXPECT_DOUBLE_EQ(transformer_hardware_flops_per_sequence(fused) -
                       transformer_hardware_flops_per_sequence(batched),
                   12 * 2 * S * S * H);
  // Selective recomputation of a fused core re-runs the fused forward.
  fused.recompute = Recompute::kSelective;
  const PieceKernels selective = transformer_layer_kernels(fused);
  EXPECT_EQ(total_kernels(selective.backward_input), total_kernels(fk.backward_input) + 1);
}

TEST(SimAttention, FusedLimitsAreNamed) {
  Workload wide = bert_large(128, 8, AttentionAlgorithm::kFused);
  wide.config.num_heads = 4;  // head_dim 256
  EXPECT_NE(error_of([&] { wide.validate(); }).find("head_dim <= 128"), std::string::npos);
  wide.attention = AttentionAlgorithm::kBatched;
  EXPECT_NO_THROW(wide.validate());
  // Under fp16 the fused products need TF32, which a V100 lacks.
  Workload fp16 = bert_large(128, 8, AttentionAlgorithm::kFused, Precision::kFp16);
  EXPECT_NE(error_of([&] {
              (void)AnalyticCostModel(fp16, device_preset("v100"));
            }).find("--attention fused runs its products in tf32"),
            std::string::npos);
  fp16.attention = AttentionAlgorithm::kBatched;
  EXPECT_NO_THROW((void)AnalyticCostModel(fp16, device_preset("v100")));
  EXPECT_EQ(attention_from_string("fused"), AttentionAlgorithm::kFused);
  EXPECT_EQ(to_string(attention_from_string("batched")), "batched");
  EXPECT_NE(error_of([] {
              (void)attention_from_string("flash");
            }).find("--attention 'flash' is not one of batched, fused"),
            std::string::npos);
}

// pipefisher_train --calibration-out names the run's attention, and the calibration prices the
// chunk's layers with it.
TEST(SimAttention, CalibrationRecordsCarryTheRunsAttention) {
  sched::ScheduleParams one;
  one.kind = sched::ScheduleKind::kGPipe;
  one.workers = 1;
  one.microbatches = 1;
  one.num_layers = 24;
  const auto schedule = sched::compile(one);
  Profile profile;
  profile.chunks.push_back({.pipeline = 0, .chunk = 0, .forward_s = 0.1, .backward_s = 0.2});
  ProfileWorkload run{model::bert_preset("large"), 512, 8, Precision::kBf16};
  const auto batched_json = measurements_from_profile(profile, schedule, run);
  EXPECT_FALSE(batched_json.at("measurements").at(0).contains("attention"));
  run.attention = AttentionAlgorithm::kFused;
  const auto fused_json = measurements_from_profile(profile, schedule, run);
  EXPECT_EQ(fused_json.at("measurements").at(0).at("attention"), "fused");
  const DeviceSpec h100 = device_preset("h100");
  const auto batched = measurements_from_json(batched_json, "batched run", h100);
  const auto fused = measurements_from_json(fused_json, "fused run", h100);
  ASSERT_EQ(fused.size(), 2U);
  // chunk_forward: embeddings, 24 layers, heads, each layer with its core.
  Workload w = bert_large(512, 8, AttentionAlgorithm::kFused);
  EXPECT_EQ(total_kernels(fused[0].timed),
            total_kernels(embeddings_kernels(w).forward) +
                24 * total_kernels(encoder_layer_kernels(w).forward) +
                total_kernels(heads_kernels(w).forward));
  EXPECT_EQ(total_kernels(batched[0].timed) - total_kernels(fused[0].timed), 24 * 9);
  EXPECT_NE(predict(h100, fused[1]), predict(h100, batched[1]));
  nlohmann::json bad = fused_json;
  bad["measurements"][0]["attention"] = "flash";
  EXPECT_NE(error_of([&] {
              measurements_from_json(bad, "bad", h100);
            }).find("measurements[0].'attention'"),
            std::string::npos);
}

}  // namespace
}  // namespace pf::sim
