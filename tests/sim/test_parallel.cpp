// The simulator at scale: transformer families, the cluster description, the parallel (PTD-P)
// cost model and its memory check.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "runtime/model/bert_config.h"
#include "scheduler/compile.h"
#include "sim/bert_kernels.h"
#include "sim/cluster.h"
#include "sim/parallel_cost_model.h"
#include "sim/simulator.h"
#include "sim/transformer_kernels.h"
#include "sim/transformer_spec.h"
#include "tests/sim/error_message.h"

namespace pf::sim {
namespace {

using test::error_of;

double matmul_flops(const Kernels& kernels) {
  double flops = 0.0;
  for (const Kernel& k : kernels) {
    if (k.op_class == OpClass::kGemm || k.op_class == OpClass::kAttention)
      flops += k.flops * k.count;
  }
  return flops;
}

ParallelWorkload gpt_workload(const char* model, int t, Recompute recompute, int b = 1) {
  ParallelWorkload w;
  w.model = transformer_preset(model);
  w.seq_len = 2048;
  w.micro_batch_size = b;
  w.precision = Precision::kFp16;
  w.tensor_parallel = t;
  w.recompute = recompute;
  return w;
}

TEST(TransformerSpec, PresetsHaveTheirPublishedSizes) {
  auto billions = [](const char* name) {
    return transformer_total_params(transformer_preset(name)) / 1e9;
  };
  EXPECT_NEAR(billions("gpt2"), 0.124, 0.002);
  EXPECT_NEAR(billions("gpt3-175b"), 175.0, 1.5);
  EXPECT_NEAR(billions("llama-7b"), 6.74, 0.02);
  EXPECT_NEAR(billions("llama2-70b"), 69.0, 0.3);
  EXPECT_NEAR(billions("megatron-1.7b"), 1.7, 0.05);
  EXPECT_NEAR(billions("megatron-145.6b"), 145.6, 1.0);
  EXPECT_NEAR(billions("megatron-1t"), 1008.0, 5.0);
  EXPECT_EQ(transformer_preset("large").family, ModelFamily::kBert);
  EXPECT_EQ(transformer_preset("bert-large"), transformer_preset("large"));
  EXPECT_NE(error_of([] { (void)transformer_preset("gpt5"); }).find("llama-7b"), std::string::npos);
}

TEST(TransformerSpec, ReadsHuggingFaceConfigs) {
  const nlohmann::json gpt2 = {{"model_type", "gpt2"}, {"n_embd", 768},       {"n_layer", 12},
                               {"n_head", 12},         {"vocab_size", 50257}, {"n_positions", 1024},
                               {"n_inner", nullptr}};
  TransformerSpec from_file = transformer_from_hf_json(gpt2, "gpt2/config.json");
  TransformerSpec preset = transformer_preset("gpt2");
  from_file.name = preset.name;
  EXPECT_EQ(from_file, preset);

  const nlohmann::json llama = {{"model_type", "llama"},    {"hidden_size", 8192},
                                {"num_hidden_layers", 80},  {"num_attention_heads", 64},
                                {"num_key_value_heads", 8}, {"intermediate_size", 28672},
                                {"vocab_size", 32000},      {"max_position_embeddings", 4096}};
  const TransformerSpec l = transformer_from_hf_json(llama, "l/config.json");
  EXPECT_EQ(l.family, ModelFamily::kLlama);
  EXPECT_EQ(l.num_kv_heads, 8);
  EXPECT_TRUE(l.gated_mlp && l.rms_norm && !l.tied_head && !l.linear_bias);
  EXPECT_NEAR(transformer_total_params(l) / 1e9, 69.0, 0.3);

  const nlohmann::json bert = {{"hidden_size", 1024},
                               {"num_hidden_layers", 24},
                               {"num_attention_heads", 16},
                               {"intermediate_size", 4096},
                               {"vocab_size", 30522}};
  EXPECT_EQ(transformer_from_hf_json(bert, "b.json").family, ModelFamily::kBert);

  EXPECT_NE(error_of([] {
              (void)transformer_from_hf_json({{"model_type", "t5"}}, "t5/config.json");
            }).find("model_type 't5' is not supported"),
            std::string::npos);
  nlohmann::json missing = llama;
  missing.erase("num_hidden_layers");
  EXPECT_NE(error_of([&] {
              (void)transformer_from_hf_json(missing, "m.json");
            }).find("m.json: field 'num_hidden_layers' is missing"),
            std::string::npos);
  nlohmann::json bad_groups = llama;
  bad_groups["num_key_value_heads"] = 7;
  EXPECT_NE(error_of([&] {
              (void)transformer_from_hf_json(bad_groups, "g.json");
            }).find("not a multiple of num_kv_heads 7"),
            std::string::npos);
}

TEST(TransformerKernels, FlopsMatchTheFormulasAndSplitOverTensorParallelRanks) {
  for (const char* model : {"gpt3-1.3b", "llama2-70b"}) {
    const ParallelWorkload one = gpt_workload(model, 1, Recompute::kNone, 2);
    const double per_token = transformer_layer_forward_flops_per_token(one.model, one.seq_len);
    const PieceKernels k1 = transformer_layer_kernels(one);
    EXPECT_NEAR(matmul_flops(k1.forward) / (one.tokens() * per_token), 1.0, 1e-12) << model;
    // Backward: input and weight gradients, twice the forward.
    EXPECT_NEAR(matmul_flops(k1.backward_input) + matmul_flops(k1.backward_weight),
                2.0 * matmul_flops(k1.forward), 1e-6 * matmul_flops(k1.forward))
        << model;
    const ParallelWorkload eight = gpt_workload(model, 8, Recompute::kNone, 2);
    EXPECT_NEAR(matmul_flops(transformer_layer_kernels(eight).forward),
                matmul_flops(k1.forward) / 8.0, 1e-6 * matmul_flops(k1.forward))
        << model;
    // Full recomputation runs the forward again inside the backward.
    const PieceKernels full =
        transformer_layer_kernels(gpt_workload(model, 1, Recompute::kFull, 2));
    EXPECT_NEAR(matmul_flops(full.backward_input),
                matmul_flops(k1.backward_input) + matmul_flops(k1.forward), 1.0);
  }
  // A BERT layer costs the same products in the parallel model as in the BERT model.
  Workload bert;
  bert.config = model::bert_preset("large");
  bert.seq_len = 128;
  bert.micro_batch_size = 8;
  ParallelWorkload same;
  same.model = transformer_preset("large");
  same.seq_len = 128;
  same.micro_batch_size = 8;
  EXPECT_NEAR(matmul_flops(transformer_layer_kernels(same).forward),
              matmul_flops(encoder_layer_kernels(bert).forward), 1.0);
}

TEST(TransformerKernels, MegatronHardwareFlopsFormula) {
  // 96 B s l h^2 (1 + s / 6h + V / 16 l h) per step with full recomputation (Narayanan et al.).
  const ParallelWorkload w = gpt_workload("megatron-145.6b", 8, Recompute::kFull);
  const double s = 2048, l = 80, h = 12288, V = 51200;
  const double paper = 96.0 * s * l * h * h * (1.0 + s / (6.0 * h) + V / (16.0 * l * h));
  EXPECT_NEAR(transformer_hardware_flops_per_sequence(w) / paper, 1.0, 1e-12);
  const ParallelWorkload none = gpt_workload("megatron-145.6b", 8, Recompute::kNone);
  EXPECT_NEAR(transformer_hardware_flops_per_sequence(none) /
                  transformer_model_flops_per_sequence(none.model, 2048, 2048),
              1.0, 1e-12);
}

TEST(TransformerKernels, ActivationMemoryFollowsKorthikanti) {
  // 16-bit GPT layer: s b h (10 + 24 / t) + 5 a s^2 b / t; selective drops the a s^2 term; full
  // keeps the input, 2 s b h.
  const double s = 2048, b = 2, h = 12288, a = 96;
  for (int t : {1, 2, 8}) {
    const ParallelWorkload none = gpt_workload("megatron-145.6b", t, Recompute::kNone, 2);
    EXPECT_NEAR(transformer_layer_activation_bytes(none),
                s * b * h * (10.0 + 24.0 / t) + 5.0 * a * s * s * b / t, 1.0);
    const ParallelWorkload selective = gpt_workload("megatron-145.6b", t, Recompute::kSelective, 2);
    EXPECT_NEAR(transformer_layer_activation_bytes(selective), s * b * h * (10.0 + 24.0 / t), 1.0);
    const ParallelWorkload full = gpt_workload("megatron-145.6b", t, Recompute::kFull, 2);
    EXPECT_NEAR(transformer_layer_activation_bytes(full), 2.0 * s * b * h, 1.0);
    EXPECT_NEAR(transformer_recompute_transient_bytes(full),
                transformer_layer_activation_bytes(none), 1.0);
  }
}

TEST(Cluster, LinksAndCollectives) {
  const ClusterSpec c = cluster_preset("dgx-a100");
  EXPECT_EQ(c.gpus_per_node, 8);
  EXPECT_EQ(c.link_for(8, 1).bandwidth, c.nvlink.bandwidth);    // tensor-parallel inside a node
  EXPECT_EQ(c.link_for(16, 1).bandwidth, c.network.bandwidth);  // ... or across two
  EXPECT_EQ(c.link_for(2, 4).bandwidth, c.nvlink.bandwidth);    // t = 4, d = 2: one node
  EXPECT_EQ(c.link_for(2, 8).bandwidth, c.network.bandwidth);   // t = 8: replicas on two nodes
  const Link link{100e9, 5e-6};
  EXPECT_EQ(allreduce_seconds(1e9, 1, link), 0.0);
  // Large messages: the ring's bandwidth term; tiny ones: the tree's log latency.
  EXPECT_NEAR(allreduce_seconds(1e9, 4, link), 1.5 * 1e9 / 100e9 + 6 * 5e-6, 1e-12);
  EXPECT_NEAR(allreduce_seconds(8.0, 64, link), 2 * 8.0 / 100e9 + 2 * 6 * 5e-6, 1e-12);
  EXPECT_NEAR(allgather_seconds(1e9, 4, link), 0.75 * 1e9 / 100e9 + 3 * 5e-6, 1e-12);
}

TEST(Cluster, JsonRoundTripAndBadInput) {
  const ClusterSpec c = cluster_preset("dgx-h100");
  const ClusterSpec back = cluster_from_json(cluster_to_json(c), "c.json");
  EXPECT_EQ(back.gpus_per_node, c.gpus_per_node);
  EXPECT_NEAR(back.network.bandwidth, c.network.bandwidth, 1.0);
  EXPECT_NEAR(back.nvlink.latency_s, c.nvlink.latency_s, 1e-15);
  EXPECT_NEAR(back.gpu_memory_bytes, c.gpu_memory_bytes, 1.0);
  nlohmann::json json = cluster_to_json(c);
  json.erase("nvlink");
  EXPECT_NE(error_of([&] {
              (void)cluster_from_json(json, "c.json");
            }).find("c.json: missing field 'nvlink'"),
            std::string::npos);
  json = cluster_to_json(c);
  json["network"]["bandwidth_gbps"] = -1;
  EXPECT_NE(error_of([&] {
              (void)cluster_from_json(json, "c.json");
            }).find("'network.bandwidth_gbps' must be positive"),
            std::string::npos);
  json = cluster_to_json(c);
  json["gpus"] = 8;
  EXPECT_NE(error_of([&] { (void)cluster_from_json(json, "c.json"); }).find("unknown field 'gpus'"),
            std::string::npos);
  EXPECT_NE(
      error_of([] { (void)resolve_cluster("dgx-x100"); }).find("dgx-a100, dgx-h100, dgx-b200"),
      std::string::npos);
}

// A cluster of one device type holds the device's memory where the device gives it (an H200:
// 141 GB, not the H100's 80), else 80 GiB; dgx-b200 is B200 nodes.
TEST(Cluster, OfADeviceTakesItsMemory) {
  constexpr double kMiB = 1024.0 * 1024.0;
  EXPECT_EQ(cluster_of_device(device_preset("h200")).gpu_memory_bytes, 143771 * kMiB);
  EXPECT_EQ(cluster_of_device(device_preset("v100")).gpu_memory_bytes, 32 * 1024 * kMiB);
  DeviceSpec unknown = device_preset("h100");
  unknown.memory_bytes = 0.0;
  EXPECT_EQ(cluster_of_device(unknown).gpu_memory_bytes, 80 * 1024 * kMiB);
  const ClusterSpec b200 = cluster_preset("dgx-b200");
  EXPECT_EQ(b200.device.name, "b200");
  EXPECT_EQ(b200.gpu_memory_bytes, 183359 * kMiB);
  EXPECT_EQ(b200.gpus_per_node, 8);
  EXPECT_EQ(b200.nvlink.bandwidth, 900e9);
  EXPECT_EQ(b200.network.bandwidth, cluster_preset("dgx-h100").network.bandwidth);
}

sched::Schedule pipeline(int p, int m, int d, int layers,
                         sched::ScheduleKind kind = sched::ScheduleKind::kOneFOneB) {
  sched::ScheduleParams params;
  params.kind = kind;
  params.workers = p;
  params.microbatches = m;
  params.num_layers = layers;
  params.data_parallel = d;
  params.chunks_per_worker = kind == sched::ScheduleKind::kInterleaved ? 2 : 1;
  return sched::compile(params);
}

TEST(ParallelCostModel, TensorParallelAllReducesArePricedOnTheirLink) {
  // A middle stage's forward: the rank's kernels plus 2 all-reduces per layer; moving the
  // tensor-parallel group from NVLink to a slower link adds exactly 2 L x the difference.
  const sched::Schedule schedule = pipeline(4, 8, 1, 16);
  sched::Instruction forward;
  forward.kind = sched::OpKind::kForward;
  forward.chunk = 1;
  ClusterSpec fast = cluster_preset("dgx-a100");
  ClusterSpec slow = fast;
  slow.nvlink.bandwidth /= 10.0;
  const ParallelWorkload w = gpt_workload("megatron-18.4b", 8, Recompute::kNone);
  const ParallelCostModel on_fast(w, fast), on_slow(w, slow);
  const int layers = schedule.placement.at(0, 1).num_layers;
  EXPECT_NEAR(
      on_slow.duration(schedule, 1, forward) - on_fast.duration(schedule, 1, forward),
      2.0 * layers * (on_slow.tensor_allreduce_seconds() - on_fast.tensor_allreduce_seconds()),
      1e-9);
  // More ranks, less work per rank; a group spanning two nodes pays the network.
  const ParallelCostModel t1(gpt_workload("megatron-18.4b", 1, Recompute::kNone), fast);
  EXPECT_LT(on_fast.duration(schedule, 1, forward), t1.duration(schedule, 1, forward) / 4.0);
  const ParallelCostModel t16(gpt_workload("megatron-18.4b", 16, Recompute::kNone), fast);
  EXPECT_GT(t16.tensor_allreduce_seconds(), 5.0 * on_fast.tensor_allreduce_seconds());
  EXPECT_GT(t16.duration(schedule, 1, forward), on_fast.duration(schedule, 1, forward));
  // Full recomputation: the backward re-runs the forward (and its all-reduces).
  sched::Instruction backward = forward;
  backward.kind = sched::OpKind::kBackward;
  const ParallelCostModel full(gpt_workload("megatron-18.4b", 8, Recompute::kFull), fast);
  EXPECT_NEAR(full.duration(schedule, 1, backward) - on_fast.duration(schedule, 1, backward),
              on_fast.duration(schedule, 1, forward),
              0.02 * on_fast.duration(schedule, 1, forward));
}

TEST(ParallelCostModel, OneRepresentativePerEquivalenceClass) {
  // The streams are one pipeline whatever t and d: d only prices the gradient all-reduce.
  const ClusterSpec c = cluster_preset("dgx-a100");
  const ParallelCostModel model(gpt_workload("megatron-39.1b", 8, Recompute::kFull), c);
  const sched::Schedule alone = pipeline(2, 8, 1, 48);
  const sched::Schedule replicated = pipeline(2, 8, 32, 48);
  EXPECT_EQ(replicated.num_workers(), 2);
  const SimResult a = simulate(alone, model), r = simulate(replicated, model);
  EXPECT_GT(r.step_time_s, a.step_time_s);
  sched::Instruction reduce;
  reduce.kind = sched::OpKind::kReduceGradDataParallel;
  reduce.chunk = 0;
  const double params = model.chunk_params(replicated, 0, 0);
  // 32 replicas spaced 8 apart: the network, ring.
  EXPECT_NEAR(model.duration(replicated, 0, reduce),
              allreduce_seconds(params * 2.0, 32, c.network) +
                  allreduce_seconds(51200.0 / 8 * 8192 * 2.0, 2, c.network),
              1e-9);
  EXPECT_LT(r.step_time_s - a.step_time_s, 1.5 * model.duration(replicated, 0, reduce) + 1e-3);
}

TEST(ParallelCostModel, RankOrderDecidesWhichGroupsShareANode) {
  // 8 GPUs per node, t = 1, p = 8 stages, d = 2 replicas (16 GPUs, two nodes).
  const ClusterSpec c = cluster_preset("dgx-a100");
  const sched::Schedule schedule = pipeline(8, 16, 2, 24);
  ParallelWorkload megatron = gpt_workload("megatron-1.7b", 1, Recompute::kNone);
  ParallelWorkload runtime = megatron;
  runtime.rank_order = RankOrder::kPipelineInner;
  EXPECT_EQ(rank_strides(RankOrder::kMegatron, 1, 2, 8).pipeline, 2);
  EXPECT_EQ(rank_strides(RankOrder::kMegatron, 1, 2, 8).data, 1);
  EXPECT_EQ(rank_strides(RankOrder::kPipelineInner, 1, 2, 8).pipeline, 1);
  EXPECT_EQ(rank_strides(RankOrder::kPipelineInner, 1, 2, 8).data, 8);
  EXPECT_EQ(rank_strides(RankOrder::kPipelineInner, 4, 2, 8).data, 32);
  const ParallelCostModel by_megatron(megatron, c), by_runtime(runtime, c);
  // Megatron: the replicas of a stage are neighbours (NVLink), the pipeline spans both nodes.
  EXPECT_EQ(by_megatron.pipeline_link(schedule).bandwidth, c.network.bandwidth);
  // The runtime: a pipeline per node (NVLink hops), the replicas a node apart (the network).
  EXPECT_EQ(by_runtime.pipeline_link(schedule).bandwidth, c.nvlink.bandwidth);
  sched::Instruction reduce;
  reduce.kind = sched::OpKind::kReduceGradDataParallel;
  reduce.chunk = 3;
  const double bytes = by_runtime.chunk_params(schedule, 0, 3) * 2.0;
  EXPECT_NEAR(by_megatron.duration(schedule, 3, reduce), allreduce_seconds(bytes, 2, c.nvlink),
              1e-12);
  EXPECT_NEAR(by_runtime.duration(schedule, 3, reduce), allreduce_seconds(bytes, 2, c.network),
              1e-12);
  sched::Instruction send;
  send.kind = sched::OpKind::kSendActivation;
  EXPECT_LT(by_runtime.duration(schedule, 3, send), by_megatron.duration(schedule, 3, send));
  EXPECT_EQ(rank_order_from_string("pipeline-inner"), RankOrder::kPipelineInner);
  EXPECT_EQ(to_string(RankOrder::kMegatron), "megatron");
  EXPECT_NE(
      error_of([] { (void)rank_order_from_string("ring"); }).find("megatron or pipeline-inner"),
      std::string::npos);
}

TEST(ParallelCostModel, MemoryPerRankAndWhatDoesNotFit) {
  const ClusterSpec c = cluster_preset("dgx-a100");
  // 175B parameters on one GPU: 16 bytes each, far beyond 80 GiB.
  const ParallelCostModel whole(gpt_workload("gpt3-175b", 1, Recompute::kFull), c);
  const sched::Schedule one = pipeline(1, 1, 1, 96);
  EXPECT_GT(simulate(one, whole).workers[0].peak_memory_bytes, 2e12);
  // t = 8, p = 16: about 175e9 x 16 / 128 bytes of state per GPU, plus activations.
  const ParallelCostModel split(gpt_workload("gpt3-175b", 8, Recompute::kFull), c);
  const SimResult r = simulate(pipeline(16, 32, 1, 96), split);
  for (const WorkerReport& w : r.workers) {
    EXPECT_LT(w.peak_memory_bytes, c.gpu_memory_bytes);
    EXPECT_GT(w.static_memory_bytes, 175e9 * 16 / 128 * 0.8);
  }
  // Activations: 1F1B stashes at most p - r micro-batches of its layers' inputs on stage r.
  const double per_microbatch = split.activation_bytes(pipeline(16, 32, 1, 96), 0, 1);
  EXPECT_NEAR(r.workers[1].peak_activation_bytes, 15 * per_microbatch, 1.0);
}

TEST(ParallelCostModel, ShardedAndOffloadedState) {
  const ClusterSpec c = cluster_preset("dgx-a100");
  const sched::Schedule s = pipeline(4, 8, 8, 48);  // d = 8 replicas, t = 8: 64 ranks apart
  const ParallelWorkload base = gpt_workload("megatron-39.1b", 8, Recompute::kFull);
  const ParallelCostModel replicated(base, c);
  ParallelWorkload zero3 = base;
  zero3.sharding = {0, 0, 0};  // everything over all 8 replicas
  const ParallelCostModel sharded(zero3, c);
  const double params = replicated.chunk_params(s, 0, 1);
  const double transient = transformer_recompute_transient_bytes(base);
  EXPECT_NEAR(replicated.static_bytes(s, 0, 1) - transient, 16.0 * params, 1.0);
  EXPECT_NEAR(sharded.static_bytes(s, 0, 1) - transient, 16.0 * params / 8.0, 1.0);
  // Weights gathered before the forward: one all-gather of the chunk over the 8 replicas.
  sched::Instruction forward;
  forward.kind = sched::OpKind::kForward;
  forward.chunk = 1;
  EXPECT_NEAR(sharded.duration(s, 1, forward) - replicated.duration(s, 1, forward),
              allgather_seconds(params * 2.0, 8, c.network), 1e-9);
  // Gradients: reduce-scatter over the 8 (no replica groups left to all-reduce across).
  sched::Instruction reduce;
  reduce.kind = sched::OpKind::kReduceGradDataParallel;
  reduce.chunk = 1;
  EXPECT_NEAR(sharded.duration(s, 1, reduce), allgather_seconds(params * 2.0, 8, c.network), 1e-9);
  // ZeRO-1: the optimizer updates an eighth and gathers the weights.
  ParallelWorkload zero1 = base;
  zero1.sharding = {1, 1, 8};
  const ParallelCostModel optimizer_sharded(zero1, c);
  sched::Instruction step;
  step.kind = sched::OpKind::kOptimizerStep;
  const double worker = replicated.worker_params(s, 1);
  EXPECT_NEAR(optimizer_sharded.duration(s, 1, step),
              kernel_seconds(c.device, memory_kernel(28.0 * worker / 8.0)) +
                  allgather_seconds(worker * 2.0, 8, c.network),
              1e-9);
  // Offload: 12 bytes per parameter leave the GPU; the step crosses PCIe (and NVMe).
  ParallelWorkload host = base;
  host.optimizer_offload = Offload::kHost;
  const ParallelCostModel offloaded(host, c);
  EXPECT_NEAR(offloaded.static_bytes(s, 0, 1) - transient, 4.0 * params, 1.0);
  EXPECT_NEAR(offloaded.duration(s, 1, step), 2.0 * 2.0 * worker / c.host_bandwidth, 1e-9);
  host.optimizer_offload = Offload::kNvme;
  const ParallelCostModel on_nvme(host, c);
  EXPECT_NEAR(on_nvme.duration(s, 1, step) - offloaded.duration(s, 1, step),
              24.0 * worker / (c.nvme_bandwidth / 8.0), 1e-9);
  // A shard group must divide the replicas.
  ParallelWorkload three = base;
  three.sharding.optimizer = 3;
  const ParallelCostModel bad(three, c);
  std::string error;
  try {
    (void)bad.duration(s, 1, step);
  } catch (const std::invalid_argument& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("--shard-optimizer 3 must divide the data-parallel replicas 8"),
            std::string::npos)
      << error;
  EXPECT_NE(error_of([] { (void)offload_from_string("tape"); }).find("none, cpu, nvme"),
            std::string::npos);
}

TEST(ParallelCostModel, KfacStatePlacementTrafficIsTheRingFormula) {
  // megatron-39.1b at t = 8 (a node), p = 4, d = 8: the data-parallel group is 8 ranks 8 apart,
  // on the network. Per Linear (rank shard d_in x d_out): F = 4 (d_in^2 + d_out^2) bytes of
  // factors (and as many of inverses), P = 4 (d_in d_out + d_out) of preconditioned gradient.
  const ClusterSpec c = cluster_preset("dgx-a100");
  const sched::Schedule s = pipeline(4, 8, 8, 48);
  const ParallelWorkload base = gpt_workload("megatron-39.1b", 8, Recompute::kFull);
  const ParallelCostModel replicated(base, c);
  const auto place = [&](int factors, int inverses) {
    ParallelWorkload w = base;
    w.kfac_state = {factors, inverses};
    return ParallelCostModel(w, c);
  };
  const ParallelCostModel shard = place(1, 1), partial = place(2, 2), factors_only = place(1, 0);
  const auto linear = sched::LinearKind::kFfnIn;  // 8192 -> 32768 / 8 = 4096 per rank
  const auto dims = replicated.linear_dims(linear);
  EXPECT_EQ(dims.in, 8192.0);
  EXPECT_EQ(dims.out, 4096.0);
  const double F = 4.0 * (dims.in * dims.in + dims.out * dims.out);
  const double P = 4.0 * (dims.in * dims.out + dims.out);
  const double bw = c.network.bandwidth, lat = c.network.latency_s;
  sched::Instruction in;
  in.linear = linear;
  in.layer = 12;
  in.chunk = 1;
  const auto seconds = [&](const ParallelCostModel& m, sched::OpKind kind) {
    in.kind = kind;
    return m.duration(s, 1, in);
  };
  // Factor sync: replicated, the all-reduce as before; sharded, a reduce-scatter over 8
  // (7/8 F); partial:2, that plus an all-gather inside the pairs (2/8 x 1/2 F).
  EXPECT_NEAR(seconds(replicated, sched::OpKind::kCurvatureSync),
              allreduce_seconds(F, 8, c.network), 1e-12);
  EXPECT_NEAR(seconds(shard, sched::OpKind::kCurvatureSync), 7.0 / 8.0 * F / bw + 7.0 * lat, 1e-12);
  EXPECT_NEAR(seconds(partial, sched::OpKind::kCurvatureSync),
              7.0 / 8.0 * F / bw + 7.0 * lat + 2.0 / 8.0 * (F / 2.0 / bw + lat), 1e-12);
  // Inversions and preconditioning: the average replica's share.
  const double invert = seconds(replicated, sched::OpKind::kInvertA);
  EXPECT_NEAR(seconds(shard, sched::OpKind::kInvertA), invert / 8.0, 1e-15);
  EXPECT_NEAR(seconds(partial, sched::OpKind::kInvertA), invert / 4.0, 1e-15);
  const double precondition = seconds(replicated, sched::OpKind::kPrecondition);
  EXPECT_NEAR(seconds(shard, sched::OpKind::kPrecondition), precondition / 8.0, 1e-15);
  EXPECT_NEAR(seconds(factors_only, sched::OpKind::kPrecondition), precondition, 1e-15);
  // Preconditioned gradients: an all-gather over the 8 (shard) or the 4 pairs (partial:2,
  // pairs 16 ranks apart: still the network); inverses (factors sharded, inverses
  // replicated): an all-gather over the 8, each replica in all of them.
  EXPECT_NEAR(seconds(shard, sched::OpKind::kBroadcastGradient), 7.0 / 8.0 * P / bw + 7.0 * lat,
              1e-12);
  EXPECT_NEAR(seconds(partial, sched::OpKind::kBroadcastGradient), 3.0 / 4.0 * P / bw + 3.0 * lat,
              1e-12);
  EXPECT_NEAR(seconds(factors_only, sched::OpKind::kBroadcastInverses),
              7.0 / 8.0 * F / bw + 7.0 * lat, 1e-12);
  // Per worker (12 layers, all six Linears): bytes one replica receives, and memory.
  const std::vector<sched::LinearKind> all = {
      sched::LinearKind::kQuery,        sched::LinearKind::kKey,   sched::LinearKind::kValue,
      sched::LinearKind::kAttentionOut, sched::LinearKind::kFfnIn, sched::LinearKind::kFfnOut};
  double state = 0.0, gradient = 0.0, largest = 0.0;
  for (auto kind : all) {
    const auto d = replicated.linear_dims(kind);
    state += 4.0 * (d.in * d.in + d.out * d.out);
    gradient += 4.0 * (d.in * d.out + d.out);
    largest = std::max(largest, 8.0 * (d.in * d.in + d.out * d.out));
  }
  const auto full = replicated.kfac_state_cost(s, 1, all);
  EXPECT_NEAR(full.replicated_bytes, 12 * 2.0 * state, 1.0);
  EXPECT_NEAR(full.memory_bytes, full.replicated_bytes, 1.0);
  EXPECT_NEAR(full.factor_bytes_per_refresh, 12 * 14.0 / 8.0 * state, 1.0);
  EXPECT_EQ(full.gradient_bytes_per_step, 0.0);
  const auto sharded = shard.kfac_state_cost(s, 1, all);
  EXPECT_NEAR(sharded.memory_bytes, full.replicated_bytes / 8.0, 1.0);
  EXPECT_NEAR(sharded.busiest_memory_bytes, sharded.memory_bytes + largest, 1.0);
  EXPECT_NEAR(sharded.factor_bytes_per_refresh, 12 * 7.0 / 8.0 * state, 1.0);
  EXPECT_NEAR(sharded.gradient_bytes_per_step, 12 * 7.0 / 8.0 * gradient, 1.0);
  EXPECT_EQ(sharded.inverse_bytes_per_refresh, 0.0);
  const auto gathered = factors_only.kfac_state_cost(s, 1, all);
  EXPECT_NEAR(gathered.memory_bytes, 12 * (1.0 / 8.0 + 1.0) * state, 1.0);
  EXPECT_NEAR(gathered.inverse_bytes_per_refresh, 12 * 7.0 / 8.0 * state, 1.0);
  // The engine's K-FAC memory (kfac_bytes) is the average replica's share.
  EXPECT_NEAR(partial.kfac_bytes(s, 12, linear), 2.0 * F * 2.0 / 8.0, 1.0);
  // Holders must divide d, the factors' the inverses'.
  const ParallelCostModel three = place(3, 3), crossed = place(4, 2);
  EXPECT_NE(error_of([&] { (void)seconds(three, sched::OpKind::kInvertA); }).find("must divide"),
            std::string::npos);
  EXPECT_NE(error_of([&] { (void)seconds(crossed, sched::OpKind::kInvertA); }).find("must divide"),
            std::string::npos);
}

TEST(ParallelCostModel, BadWorkloadsAreNamed) {
  const ClusterSpec c = cluster_preset("dgx-a100");
  EXPECT_NE(error_of([&] {
              ParallelCostModel m(gpt_workload("megatron-1.7b", 5, Recompute::kNone), c);
            }).find("--tensor-parallel 5 must be positive and divide the heads (24)"),
            std::string::npos);
  ParallelWorkload long_sequence = gpt_workload("gpt2", 1, Recompute::kNone);
  EXPECT_NE(error_of([&] {
              ParallelCostModel m(long_sequence, c);
            }).find("--seq-len 2048 must lie in [1, 1024]"),
            std::string::npos);
  EXPECT_NE(error_of([] { (void)recompute_from_string("some"); }).find("none, selective, full"),
            std::string::npos);
}

}  // namespace
}  // namespace pf::sim
