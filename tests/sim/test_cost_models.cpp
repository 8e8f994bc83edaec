// The analytic and measured cost models, device and profile files, and their bad input.
#include <unistd.h>

#include <gtest/gtest.h>
#include <limits>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "runtime/model/bert_config.h"
#include "scheduler/compile.h"
#include "sim/analytic_cost_model.h"
#include "sim/bert_kernels.h"
#include "sim/device.h"
#include "sim/kernel_costs.h"
#include "sim/kfac_kernels.h"
#include "sim/measured_cost_model.h"
#include "sim/report.h"
#include "sim/simulator.h"
#include "sim/uniform_cost_model.h"
#include "tests/sim/error_message.h"

namespace pf::sim {
namespace {

using sched::Instruction;
using sched::OpKind;
using sched::ScheduleKind;
using sched::ScheduleParams;

using test::error_of;

Workload bert(const char* preset, Precision precision, int seq = 128, int batch = 32) {
  Workload w;
  w.config = model::bert_preset(preset);
  w.seq_len = seq;
  w.micro_batch_size = batch;
  w.precision = precision;
  return w;
}

ScheduleParams params(ScheduleKind kind, int p, int m, int layers, int v = 1) {
  ScheduleParams out;
  out.kind = kind;
  out.workers = p;
  out.microbatches = m;
  out.chunks_per_worker = v;
  out.num_layers = layers;
  return out;
}

// Throughput of one GPU running BERT-Large phase 1 (no pipeline): NVIDIA's anchors are
// 317 seq/s in TF32 and 580 seq/s in mixed precision on an A100-80GB (REFERENCE.md).
double single_gpu_throughput(Precision precision) {
  const AnalyticCostModel costs(bert("large", precision), device_preset("a100"));
  const auto schedule = sched::compile(params(ScheduleKind::kGPipe, 1, 8, 24));
  const SimResult r = simulate(schedule, costs);
  RunDescription run;
  run.micro_batch_size = 32;
  return headline(schedule, r, run).sequences_per_s;
}

TEST(SimAnalytic, MatchesBertLargeAnchorsOnA100) {
  const double tf32 = single_gpu_throughput(Precision::kTf32);
  const double mixed = single_gpu_throughput(Precision::kBf16);
  EXPECT_NEAR(tf32 / 317.0, 1.0, 0.15) << tf32;
  EXPECT_NEAR(mixed / 580.0, 1.0, 0.25) << mixed;
}

TEST(SimAnalytic, FormulasOfOneLayerChunk) {
  const Workload w = bert("base", Precision::kBf16);
  const DeviceSpec h100 = device_preset("h100");
  const AnalyticCostModel costs(w, h100);
  // 12 layers on 4 workers: chunk 1 holds 3 layers and neither embeddings nor heads.
  const auto schedule = sched::compile(params(ScheduleKind::kOneFOneB, 4, 4, 12));
  Instruction in;
  in.chunk = 1;
  in.microbatch = 0;
  const double T = 128.0 * 32, H = 768, I = 3072, S = 128, a = 12, e = 2;
  // The preset has no launch overhead, so a chunk costs the sum of its kernels' device times:
  // each max(flops / (peak x efficiency), bytes / bandwidth).
  auto device_seconds = [&](const Kernels& kernels) {
    double total = 0.0;
    for (const Kernel& k : kernels) total += k.count * kernel_seconds(h100, k);
    return total;
  };
  const PieceKernels layer = encoder_layer_kernels(w);
  in.kind = OpKind::kForward;
  const double forward = costs.duration(schedule, 1, in);
  EXPECT_NEAR(forward, 3 * device_seconds(layer.forward), 1e-12 * forward);
  // One product of the layer by hand: the FFN-in Linear, 2 T H I FLOPs at 70% of bf16 peak.
  EXPECT_DOUBLE_EQ(kernel_seconds(h100, gemm_kernel(Precision::kBf16, T, I, H, e)),
                   2 * T * I * H / (989e12 * 0.7));
  in.kind = OpKind::kBackward;
  const double backward = costs.duration(schedule, 1, in);
  EXPECT_NEAR(backward,
              3 * (device_seconds(layer.backward_input) + device_seconds(layer.backward_weight)),
              1e-12 * backward);
  // Priced op by op, not as 2x forward: the attention products' input gradients and the
  // element-wise backward make it a little more than twice the forward here.
  EXPECT_GT(backward, 1.5 * forward);
  EXPECT_LT(backward, 2.5 * forward);
  in.kind = OpKind::kSendActivation;
  EXPECT_DOUBLE_EQ(costs.duration(schedule, 1, in), 5e-6 + T * H * e / 450e9);
  // K-FAC of the FFN-in Linear (768 -> 3072), fp32 factors, tf32 products on an H100.
  in.layer = 3;
  in.linear = sched::LinearKind::kFfnIn;
  in.kind = OpKind::kCurvatureB;
  const double d_out = 3072, d_in = 768;
  // a^T a: 2 T d^2 FLOPs (compute-bound), then the running-average update (3 fp32 passes).
  EXPECT_DOUBLE_EQ(costs.duration(schedule, 1, in),
                   2 * T * d_out * d_out / (494.7e12 * 0.7) + 12 * d_out * d_out / 3.35e12);
  // Cholesky inverse: damping, potrf (d^3/3), the identity, two triangular solves (2 d^3), the
  // factorization and solves at the fp32 peak (the preset's one efficiency).
  in.kind = OpKind::kInvertA;
  EXPECT_DOUBLE_EQ(costs.duration(schedule, 1, in),
                   8 * d_in / 3.35e12 + d_in * d_in * d_in / 3 / (67e12 * 0.7) +
                       4 * d_in * d_in / 3.35e12 + 2 * d_in * d_in * d_in / (67e12 * 0.7));
  in.kind = OpKind::kPrecondition;
  const double precondition = 2 * d_out * d_in * d_out / (494.7e12 * 0.7) +
                              2 * d_out * d_in * d_in / (494.7e12 * 0.7) +
                              4 * d_out * d_out / 3.35e12 + 8 * d_out * d_in / 3.35e12;
  EXPECT_DOUBLE_EQ(costs.duration(schedule, 1, in), precondition);
  // A piece of a quarter of the rows: its share of the rest plus the per-task overhead again.
  const double overhead = costs.kfac_task_overhead_s(in.kind);
  EXPECT_DOUBLE_EQ(overhead, sim::kDefaultKfacTaskOverheadS);
  in.piece_end = sched::kPieceUnits / 4;
  EXPECT_DOUBLE_EQ(costs.duration(schedule, 1, in), (precondition - overhead) / 4 + overhead);
  in.piece_end = sched::kPieceUnits;
  EXPECT_DOUBLE_EQ(costs.kfac_bytes(schedule, 3, sched::LinearKind::kFfnIn),
                   8 * (d_in * d_in + d_out * d_out));
  // Activations, as pipefisher_train's arena holds them (sim/runtime_stash.h): per layer QKV,
  // context, the two LayerNorms' inputs, outputs and statistics, the FFN's two I-wide tensors and
  // the probabilities, and the Linears' output gradients its backward keeps (5TH + TI), e bytes
  // each; per chunk the int64 mask and the incoming activation's copy.
  EXPECT_DOUBLE_EQ(costs.activation_bytes(schedule, 0, 1),
                   3 * e * (8 * T * H + 2 * T * I + 4 * T + a * 32 * S * S + 5 * T * H + T * I) +
                       8 * T + e * T * H);
  // Korthikanti's T H (34 + 5 a S / H) for 16-bit, per layer, behind --stash eager.
  Workload eager = w;
  eager.stash = ActivationStash::kEager;
  EXPECT_DOUBLE_EQ(AnalyticCostModel(eager, h100).activation_bytes(schedule, 0, 1),
                   3 * T * H * (34 + 5 * a * S / H));
  EXPECT_DOUBLE_EQ(costs.static_bytes(schedule, 0, 1),
                   16 * 3 * (4 * H * H + 2 * H * I + 9 * H + I));
}

TEST(SimAnalytic, OneFOneBHoldsLessMemoryThanGPipe) {
  const AnalyticCostModel costs(bert("large", Precision::kBf16), device_preset("h100"));
  const SimResult gpipe = simulate(sched::compile(params(ScheduleKind::kGPipe, 4, 16, 24)), costs);
  const SimResult ofob =
      simulate(sched::compile(params(ScheduleKind::kOneFOneB, 4, 16, 24)), costs);
  EXPECT_NEAR(gpipe.makespan_s, ofob.makespan_s, 0.02 * gpipe.makespan_s);
  for (int r = 0; r < 4; ++r) {
    EXPECT_LT(ofob.workers[r].peak_memory_bytes, gpipe.workers[r].peak_memory_bytes);
    EXPECT_EQ(ofob.workers[r].peak_stashed_microbatches, 4 - r);
    EXPECT_GT(ofob.workers[r].static_memory_bytes, 0.0);
  }
}

TEST(SimAnalytic, DataParallelReductionCostsAndOverlaps) {
  const AnalyticCostModel costs(bert("large", Precision::kBf16), device_preset("h100"));
  ScheduleParams ps = params(ScheduleKind::kOneFOneB, 4, 8, 24);
  const SimResult alone = simulate(sched::compile(ps), costs);
  ps.data_parallel = 8;
  const auto schedule = sched::compile(ps);
  const SimResult replicated = simulate(schedule, costs);
  EXPECT_GT(replicated.makespan_s, alone.makespan_s);
  // Ring all-reduce of worker 0's gradients (bf16) over 8 replicas, not hidden at the end at
  // worst: the step grows by at most its whole cost.
  double worst = 0.0;
  for (const Instruction& in : schedule.streams[0]) {
    if (in.kind == OpKind::kReduceGradDataParallel) worst += costs.duration(schedule, 0, in);
  }
  EXPECT_GT(worst, 0.0);
  EXPECT_LE(replicated.makespan_s, alone.makespan_s + worst + 1e-12);
}

TEST(SimAnalytic, RejectsUnsupportedPrecisionAndBadWorkload) {
  EXPECT_NE(error_of([] {
              AnalyticCostModel(bert("base", Precision::kBf16), device_preset("v100"));
            }).find("bf16"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              AnalyticCostModel(bert("base", Precision::kBf16, 1024), device_preset("h100"));
            }).find("--seq-len"),
            std::string::npos);
  EXPECT_NE(error_of([] { device_preset("tpu"); }).find("h100"), std::string::npos);
  EXPECT_NE(error_of([] { model::resolve_bert_config("huge"); }).find("huge"), std::string::npos);
}

TEST(SimDevice, JsonRoundTripAndErrors) {
  const DeviceSpec a100 = device_preset("a100");
  const DeviceSpec back = device_from_json(device_to_json(a100), "mem");
  EXPECT_EQ(back.peak_tf32_flops, a100.peak_tf32_flops);
  EXPECT_EQ(back.link_bandwidth, a100.link_bandwidth);

  nlohmann::json j = device_to_json(a100);
  j.erase("memory_bandwidth");
  EXPECT_NE(error_of([&] {
              device_from_json(j, "dev.json");
            }).find("dev.json: missing field 'memory_bandwidth'"),
            std::string::npos);
  j = device_to_json(a100);
  j["link_bandwidth"] = -5;
  EXPECT_NE(error_of([&] { device_from_json(j, "dev.json"); }).find("'link_bandwidth' = -5"),
            std::string::npos);
  j = device_to_json(a100);
  j["peak_flops"]["fp32"] = "NaN";
  EXPECT_NE(error_of([&] { device_from_json(j, "dev.json"); }).find("peak_flops.fp32"),
            std::string::npos);
  j = device_to_json(a100);
  j["matmul_efficiency"] = 1.5;
  EXPECT_NE(error_of([&] { device_from_json(j, "dev.json"); }).find("matmul_efficiency"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              device_from_json_file("/nonexistent/device.json");
            }).find("/nonexistent/device.json"),
            std::string::npos);
}

// Every preset knows its memory (nvidia-smi's total); the B200's peaks are the HGX datasheet's
// per GPU. memory_gb is read and written (GB = 1e9 bytes), optional, and must be >= 0.
TEST(SimDevice, PresetsCarryTheirMemoryAndTheB200ItsPeaks) {
  for (const std::string& name : device_preset_names()) {
    EXPECT_GT(device_preset(name).memory_bytes, 0.0) << name;
  }
  EXPECT_GT(device_preset("h200").memory_bytes, device_preset("h100").memory_bytes);
  const DeviceSpec b200 = device_preset("b200");
  EXPECT_EQ(b200.peak_bf16_flops, 2.25e15);
  EXPECT_EQ(b200.peak_tf32_flops, 1.125e15);
  EXPECT_EQ(b200.peak_fp32_flops, 75e12);
  EXPECT_EQ(b200.link_bandwidth, 900e9);
  EXPECT_GT(b200.memory_bandwidth, device_preset("h200").memory_bandwidth);
  EXPECT_GT(b200.memory_bytes, device_preset("h200").memory_bytes);

  nlohmann::json j = device_to_json(b200);
  ASSERT_TRUE(j.contains("memory_gb"));
  EXPECT_NEAR(device_from_json(j, "b200.json").memory_bytes, b200.memory_bytes, 1.0);
  j.erase("memory_gb");
  EXPECT_EQ(device_from_json(j, "b200.json").memory_bytes, 0.0);
  EXPECT_FALSE(device_to_json(device_from_json(j, "b200.json")).contains("memory_gb"));
  j["memory_gb"] = -1;
  EXPECT_NE(error_of([&] { device_from_json(j, "dev.json"); }).find("dev.json: field 'memory_gb'"),
            std::string::npos);
  j["memory_gb"] = "80";
  EXPECT_NE(error_of([&] { device_from_json(j, "dev.json"); }).find("'memory_gb' must be a number"),
            std::string::npos);
}

// The runtime's Cholesky inverse (DeviceSpec::inverse_solve): solving against every column of I
// prices 2 d^3 FLOPs in the triangular solve, the lower triangle from L's trailing blocks a third
// of them; nothing else of the inversion moves. Read and written by the device JSON.
TEST(SimDevice, InverseSolveMovesOnlyTheInversionsTriangularSolve) {
  DeviceSpec identity = device_preset("v100");
  DeviceSpec lower = identity;
  lower.inverse_solve = InverseSolve::kLowerTriangle;
  const double d = 1024.0;
  const Kernels kernels = inversion_kernels(d);
  const auto a = price(identity, kernels), b = price(lower, kernels);
  ASSERT_EQ(a.seconds.size(), kernels.size());
  int solves = 0;
  for (std::size_t i = 0; i < kernels.size(); ++i) {
    if (!kernels[i].inverse_solve) {
      EXPECT_EQ(a.seconds[i], b.seconds[i]) << i;
      continue;
    }
    ++solves;
    ASSERT_EQ(identity.latency_s(kernels[i].op_class), 0.0);    // the preset: FLOPs alone
    EXPECT_NEAR(b.seconds[i] / a.seconds[i], 1.0 / 3.0, 1e-9);  // compute-bound at d = 1024
  }
  EXPECT_EQ(solves, 1);
  // Products and curvature carry no such kernel.
  for (const auto& k : precondition_kernels(Precision::kFp32, 768, 768))
    EXPECT_FALSE(k.inverse_solve);

  EXPECT_EQ(device_from_json(device_to_json(lower), "mem").inverse_solve,
            InverseSolve::kLowerTriangle);
  EXPECT_FALSE(device_to_json(identity).contains("inverse_solve"));
  nlohmann::json j = device_to_json(identity);
  j["inverse_solve"] = "upper";
  EXPECT_NE(
      error_of([&] { device_from_json(j, "dev.json"); }).find("dev.json: field 'inverse_solve'"),
      std::string::npos);
}

nlohmann::json uniform_profile(double forward, double backward, int chunks) {
  nlohmann::json chunk_list = nlohmann::json::array();
  for (int c = 0; c < chunks; ++c) {
    chunk_list.push_back({{"chunk", c},
                          {"forward_s", forward},
                          {"backward_s", backward},
                          {"activation_bytes", 1.0}});
  }
  return {{"format_version", 1},
          {"chunks", chunk_list},
          {"communication", {{"bandwidth", 1e9}, {"latency_s", 0.0}, {"message_bytes", 0}}}};
}

// Per-kind K-FAC task overheads (sim/kfac_overheads.h): a kind's own overhead moves only the
// pieces of that kind, by (1 - share) x the difference; whole tasks keep their duration (the
// overhead is part of it). The same in the analytic, measured and uniform models.
TEST(SimKfacOverheads, AKindsOwnOverheadMovesOnlyItsKindsPieces) {
  const auto schedule = sched::compile(params(ScheduleKind::kChimera, 4, 4, 24));
  const OpKind kinds[] = {OpKind::kCurvatureA, OpKind::kCurvatureB, OpKind::kCurvatureSync,
                          OpKind::kInvertA,    OpKind::kInvertB,    OpKind::kPrecondition};
  auto compare = [&](const CostModel& base, const CostModel& moved, int index, double own) {
    for (int i = 0; i < kNumKfacOverheadKinds; ++i) {
      SCOPED_TRACE(std::string(kKfacOverheadFields[static_cast<std::size_t>(i)]));
      Instruction in;
      in.kind = kinds[i];
      ASSERT_EQ(kfac_overhead_index(in.kind), i);
      in.layer = 0;
      in.linear = sched::LinearKind::kFfnIn;
      const double whole = base.duration(schedule, 0, in);
      EXPECT_EQ(moved.duration(schedule, 0, in), whole);
      ASSERT_GT(whole, own);
      const double common = base.kfac_task_overhead_s(in.kind);
      EXPECT_EQ(moved.kfac_task_overhead_s(in.kind), i == index ? own : common);
      in.piece_end = sched::kPieceUnits / 4;
      const double piece = base.duration(schedule, 0, in);
      if (i == index) {
        EXPECT_NEAR(moved.duration(schedule, 0, in) - piece, 0.75 * (own - common), 1e-15);
      } else {
        EXPECT_EQ(moved.duration(schedule, 0, in), piece);
      }
    }
    // Kinds without an entry of their own keep the common value.
    EXPECT_EQ(moved.kfac_task_overhead_s(OpKind::kForward),
              base.kfac_task_overhead_s(OpKind::kForward));
  };
  for (int index = 0; index < kNumKfacOverheadKinds; ++index) {
    SCOPED_TRACE(index);
    const double own = 15e-6;
    const Workload workload = bert("large", Precision::kBf16);
    const AnalyticCostModel analytic(workload, device_preset("h100"));
    DeviceSpec device = device_preset("h100");
    device.kfac_kind_overheads_s[static_cast<std::size_t>(index)] = own;
    compare(analytic, AnalyticCostModel(workload, device), index, own);

    Profile profile = profile_from_json(uniform_profile(1.0, 2.0, 4), "p.json");
    KfacProfile linear;
    linear.curvature_a_s = 1e-3;
    linear.curvature_b_s = 2e-3;
    linear.invert_a_s = 3e-3;
    linear.invert_b_s = 4e-3;
    linear.precondition_s = 5e-3;
    linear.curvature_sync_s = 6e-3;
    profile.kfac.push_back(linear);
    const MeasuredCostModel measured(profile, "p.json");
    profile.kfac_kind_overheads_s[static_cast<std::size_t>(index)] = own;
    compare(measured, MeasuredCostModel(profile, "p.json"), index, own);

    UniformCosts costs{.curvature_a_s = 1e-3,
                       .curvature_b_s = 2e-3,
                       .curvature_sync_s = 6e-3,
                       .invert_a_s = 3e-3,
                       .invert_b_s = 4e-3,
                       .precondition_s = 5e-3,
                       .kfac_task_overhead_s = 10e-6};
    const UniformCostModel uniform(costs);
    costs.kfac_kind_overheads_s[static_cast<std::size_t>(index)] = own;
    compare(uniform, UniformCostModel(costs), index, own);
  }
}

// The device and profile formats' optional "kfac_task_overhead_s" and "kfac_task_overheads":
// absent, every kind has the default 10 us and the files written stay as they were; present,
// they survive a round trip; a negative, non-numeric or unknown field is refused naming the file
// and the field.
TEST(SimKfacOverheads, DeviceAndProfileFieldsReadWriteAndRefuseBadValues) {
  const DeviceSpec h200 = device_preset("h200");
  for (int i = 0; i < sched::kNumOpKinds; ++i) {
    EXPECT_EQ(h200.kfac_overhead(static_cast<OpKind>(i)), kDefaultKfacTaskOverheadS);
  }
  nlohmann::json j = device_to_json(h200);
  EXPECT_FALSE(j.contains("kfac_task_overhead_s"));
  EXPECT_FALSE(j.contains("kfac_task_overheads"));
  j["kfac_task_overhead_s"] = 20e-6;
  j["kfac_task_overheads"] = {{"invert_a_s", 5e-6}, {"precondition_s", 30e-6}};
  const DeviceSpec read = device_from_json(j, "dev.json");
  EXPECT_EQ(read.kfac_overhead(OpKind::kCurvatureA), 20e-6);
  EXPECT_EQ(read.kfac_overhead(OpKind::kInvertA), 5e-6);
  EXPECT_EQ(read.kfac_overhead(OpKind::kInvertB), 20e-6);
  EXPECT_EQ(read.kfac_overhead(OpKind::kPrecondition), 30e-6);
  EXPECT_EQ(device_to_json(read), j);
  const DeviceSpec back = device_from_json(device_to_json(read), "again");
  EXPECT_EQ(back.kfac_kind_overheads_s, read.kfac_kind_overheads_s);

  nlohmann::json bad = j;
  bad["kfac_task_overheads"]["invert_b_s"] = -1;
  EXPECT_NE(error_of([&] {
              device_from_json(bad, "dev.json");
            }).find("dev.json: field 'kfac_task_overheads.invert_b_s' = -1"),
            std::string::npos);
  bad = j;
  bad["kfac_task_overheads"]["inversion_s"] = 1e-5;
  EXPECT_NE(error_of([&] {
              device_from_json(bad, "dev.json");
            }).find("dev.json: unknown field 'kfac_task_overheads.inversion_s'"),
            std::string::npos);
  bad = j;
  bad["kfac_task_overheads"]["curvature_a_s"] = "fast";
  EXPECT_NE(error_of([&] {
              device_from_json(bad, "dev.json");
            }).find("dev.json: field 'kfac_task_overheads.curvature_a_s' must be a number"),
            std::string::npos);
  bad = j;
  bad["kfac_task_overheads"] = 1e-5;
  EXPECT_NE(error_of([&] {
              device_from_json(bad, "dev.json");
            }).find("dev.json: field 'kfac_task_overheads' must be an object"),
            std::string::npos);
  bad = j;
  bad["kfac_task_overhead_s"] = -3e-6;
  EXPECT_NE(error_of([&] {
              device_from_json(bad, "dev.json");
            }).find("dev.json: field 'kfac_task_overhead_s' = -0.000003"),
            std::string::npos);
  // From a file: the error names it.
  const auto path = std::filesystem::temp_directory_path() /
                    ("pf_test_bad_kind_overhead_" + std::to_string(::getpid()) + ".json");
  bad = j;
  bad["kfac_task_overheads"]["curvature_sync_s"] = -2e-5;
  {
    std::ofstream out(path);
    out << bad.dump();
  }
  EXPECT_NE(error_of([&] {
              device_from_json_file(path);
            }).find(path.string() + ": field 'kfac_task_overheads.curvature_sync_s'"),
            std::string::npos);
  std::filesystem::remove(path);

  nlohmann::json p = uniform_profile(1.0, 2.0, 2);
  EXPECT_FALSE(profile_to_json(profile_from_json(p, "prof.json")).contains("kfac_task_overheads"));
  p["kfac_task_overheads"] = {{"curvature_b_s", 25e-6}};
  const Profile profile = profile_from_json(p, "prof.json");
  EXPECT_EQ(profile.kfac_kind_overheads_s[1], 25e-6);
  EXPECT_FALSE(profile.kfac_kind_overheads_s[0]);
  EXPECT_EQ(MeasuredCostModel(profile, "prof.json").kfac_task_overhead_s(OpKind::kCurvatureA),
            kDefaultKfacTaskOverheadS);
  EXPECT_EQ(profile_from_json(profile_to_json(profile), "again").kfac_kind_overheads_s,
            profile.kfac_kind_overheads_s);
  p["kfac_task_overheads"]["precondition_s"] = -2;
  EXPECT_NE(error_of([&] { profile_from_json(p, "prof.json"); })
                .find("prof.json: field 'kfac_task_overheads.precondition_s' = -2 (must be finite "
                      "and >= 0)"),
            std::string::npos);
  p["kfac_task_overheads"] = {{"invert_s", 1e-5}};
  EXPECT_NE(error_of([&] {
              profile_from_json(p, "prof.json");
            }).find("prof.json: field 'kfac_task_overheads.invert_s' is unknown"),
            std::string::npos);
  p["kfac_task_overheads"] = nlohmann::json::array();
  EXPECT_NE(error_of([&] {
              profile_from_json(p, "prof.json");
            }).find("prof.json: field 'kfac_task_overheads' must be an object"),
            std::string::npos);
  // Built in code, a model refuses a bad value too.
  Profile negative = profile;
  negative.kfac_kind_overheads_s[4] = -1e-6;
  EXPECT_NE(error_of([&] {
              MeasuredCostModel(negative, "built");
            }).find("built: field 'kfac_task_overheads.invert_b_s'"),
            std::string::npos);
  UniformCosts costs;
  costs.kfac_kind_overheads_s[0] = std::numeric_limits<double>::infinity();
  EXPECT_NE(error_of([&] {
              UniformCostModel{costs};
            }).find("uniform costs: field 'kfac_task_overheads.curvature_a_s' = inf"),
            std::string::npos);
}

TEST(SimMeasured, UniformProfileReproducesUniformModel) {
  const auto schedule = sched::compile(params(ScheduleKind::kOneFOneB, 4, 8, 0));
  const MeasuredCostModel measured(profile_from_json(uniform_profile(1.0, 2.0, 4), "p.json"),
                                   "p.json");
  const UniformCostModel uniform(UniformCosts{.forward_s = 1.0, .backward_s = 2.0});
  const SimResult a = simulate(schedule, measured);
  const SimResult b = simulate(schedule, uniform);
  EXPECT_EQ(a.makespan_s, b.makespan_s);
  EXPECT_EQ(a.workers[0].peak_memory_bytes, b.workers[0].peak_memory_bytes);
  // And through the file format.
  const Profile back = profile_from_json(profile_to_json(measured.profile()), "again");
  EXPECT_EQ(simulate(schedule, MeasuredCostModel(back, "again")).makespan_s, a.makespan_s);
}

TEST(SimMeasured, BadProfilesNameFileFieldAndValue) {
  nlohmann::json j = uniform_profile(1.0, 2.0, 2);
  j["chunks"][1].erase("forward_s");
  EXPECT_NE(error_of([&] {
              profile_from_json(j, "prof.json");
            }).find("prof.json: field 'chunks[1].forward_s' is missing"),
            std::string::npos);
  j = uniform_profile(1.0, 2.0, 2);
  j["chunks"][0]["backward_s"] = -0.5;
  EXPECT_NE(
      error_of([&] { profile_from_json(j, "prof.json"); }).find("'chunks[0].backward_s' = -0.5"),
      std::string::npos);
  j = uniform_profile(1.0, 2.0, 2);
  j["chunks"][0]["forward_s"] = "NaN";
  EXPECT_NE(error_of([&] { profile_from_json(j, "prof.json"); }).find("chunks[0].forward_s"),
            std::string::npos);
  j = uniform_profile(1.0, 2.0, 2);
  j["format_version"] = 7;
  EXPECT_NE(error_of([&] { profile_from_json(j, "prof.json"); }).find("format_version"),
            std::string::npos);
  j = uniform_profile(1.0, 2.0, 2);
  j.erase("communication");
  EXPECT_NE(error_of([&] { profile_from_json(j, "prof.json"); }).find("communication"),
            std::string::npos);
  // A profile with fewer chunks than the schedule: the simulation names the missing chunk.
  const MeasuredCostModel two(profile_from_json(uniform_profile(1.0, 2.0, 2), "two.json"),
                              "two.json");
  const auto schedule = sched::compile(params(ScheduleKind::kGPipe, 4, 4, 0));
  EXPECT_NE(error_of([&] {
              simulate(schedule, two);
            }).find("two.json: no entry in 'chunks' for pipeline 0 chunk 2"),
            std::string::npos);
}

// The memory fields of a profile (pipefisher_train writes them from what the workers
// allocated): absent in an older file they are 0; a negative or non-finite one is refused naming
// the field and the chunk or Linear it belongs to.
TEST(SimMeasured, MemoryFieldsDefaultToZeroAndBadOnesNameTheFieldAndChunk) {
  const Profile old = profile_from_json(uniform_profile(1.0, 2.0, 2), "old.json");
  EXPECT_EQ(old.chunks[1].static_bytes, 0.0);
  EXPECT_EQ(old.chunks[1].gradient_bytes, 0.0);
  nlohmann::json j = uniform_profile(1.0, 2.0, 2);
  j["chunks"][1]["static_bytes"] = -4096;
  EXPECT_EQ(error_of([&] { profile_from_json(j, "prof.json"); }),
            "prof.json: field 'chunks[1].static_bytes (pipeline any, chunk 1)' = -4096 (must be "
            "finite and >= 0)");
  for (const double bad :
       {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    j = uniform_profile(1.0, 2.0, 2);
    j["chunks"][0]["pipeline"] = 1;
    j["chunks"][0]["static_bytes"] = bad;
    EXPECT_NE(error_of([&] {
                profile_from_json(j, "prof.json");
              }).find("field 'chunks[0].static_bytes (pipeline 1, chunk 0)' = "),
              std::string::npos)
        << bad;
  }
  const nlohmann::json kfac_entry = {
      {"layer", 3},        {"linear", "ffn_in"}, {"curvature_a_s", 1.0}, {"curvature_b_s", 1.0},
      {"invert_a_s", 1.0}, {"invert_b_s", 1.0},  {"precondition_s", 1.0}};
  j = uniform_profile(1.0, 2.0, 2);
  j["kfac"] = nlohmann::json::array({kfac_entry});
  EXPECT_EQ(profile_from_json(j, "old.json").kfac[0].bytes, 0.0);
  j["kfac"][0]["bytes"] = -1.5;
  EXPECT_EQ(error_of([&] { profile_from_json(j, "prof.json"); }),
            "prof.json: field 'kfac[0].bytes (layer 3, ffn_in)' = -1.5 (must be finite and >= 0)");
  j["kfac"][0].erase("layer");
  j["kfac"][0].erase("linear");
  j["kfac"][0]["bytes"] = std::numeric_limits<double>::infinity();
  EXPECT_NE(error_of([&] {
              profile_from_json(j, "prof.json");
            }).find("field 'kfac[0].bytes (layer any, any Linear)' = "),
            std::string::npos);
}

// A profile's static_bytes and K-FAC bytes are in the replay's peak: its whole footprint.
TEST(SimMeasured, StaticAndKfacBytesAddToThePeak) {
  auto p = params(ScheduleKind::kOneFOneB, 2, 4, 0);
  const auto schedule = sched::compile(p);
  nlohmann::json j = uniform_profile(1.0, 2.0, 2);
  const double base = simulate(schedule, MeasuredCostModel(profile_from_json(j, "a"), "a"))
                          .workers[0]
                          .peak_memory_bytes;
  j["chunks"][0]["static_bytes"] = 1000.0;
  j["chunks"][1]["static_bytes"] = 50.0;
  const auto result = simulate(schedule, MeasuredCostModel(profile_from_json(j, "b"), "b"));
  EXPECT_EQ(result.workers[0].peak_memory_bytes, base + 1000.0);
  EXPECT_EQ(result.workers[0].static_memory_bytes, 1000.0);
  EXPECT_EQ(result.workers[1].static_memory_bytes, 50.0);
}

// Issue #16 defect 4: the lookup tables were sized by the largest index in the file, so a
// 200-byte profile asked for 4 GiB and failed with a bare std::bad_alloc.
TEST(SimMeasured, LargeIndicesCostNoMemoryAndOutOfRangeOnesNameTheField) {
  nlohmann::json j = uniform_profile(1.0, 2.0, 1);
  j["chunks"][0]["pipeline"] = 1073741824;
  j["chunks"][0]["chunk"] = 1073741824;
  const MeasuredCostModel model(profile_from_json(j, "big.json"), "big.json");
  EXPECT_NE(error_of([&] {
              (void)model.activation_bytes(sched::Schedule{}, 0, 0);
            }).find("big.json: no entry in 'chunks' for pipeline 0 chunk 0"),
            std::string::npos);
  j["chunks"][0]["chunk"] = 4294967296;
  EXPECT_EQ(error_of([&] { profile_from_json(j, "big.json"); }),
            "big.json: field 'chunks[0].chunk' = 4294967296 (allowed: an integer in [0, "
            "1073741824])");
  j = uniform_profile(1.0, 2.0, 1);
  j["kfac"] = {{{"layer", 1073741824},
                {"curvature_a_s", 1.0},
                {"curvature_b_s", 1.0},
                {"invert_a_s", 1.0},
                {"invert_b_s", 1.0},
                {"precondition_s", 1.0}}};
  const MeasuredCostModel kfac(profile_from_json(j, "k.json"), "k.json");
  EXPECT_EQ(kfac.kfac_bytes(sched::Schedule{}, 1073741824, sched::LinearKind::kQuery), 0.0);
  EXPECT_NE(error_of([&] {
              (void)kfac.kfac_bytes(sched::Schedule{}, 3, sched::LinearKind::kQuery);
            }).find("k.json: no entry in 'kfac' for layer 3"),
            std::string::npos);
  j["description"] = 12;
  EXPECT_EQ(error_of([&] { profile_from_json(j, "k.json"); }),
            "k.json: field 'description' = 12 (allowed: a string)");
}

// Issue #16: a non-string "name" threw nlohmann's bare type error without the file name.
TEST(SimDevice, NonStringNameNamesTheFile) {
  nlohmann::json j = device_to_json(device_preset("a100"));
  j["name"] = 7;
  EXPECT_EQ(error_of([&] { device_from_json(j, "dev.json"); }),
            "dev.json: field 'name' = 7 (allowed: a string)");
}

}  // namespace
}  // namespace pf::sim
