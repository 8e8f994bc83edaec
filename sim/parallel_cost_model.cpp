#include "sim/parallel_cost_model.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

#include "sim/communication.h"
#include "sim/kfac_kernels.h"

namespace pf::sim {

using sched::OpKind;

namespace {

// Per-rank parameters of one layer: the products and their biases split t ways, the norms
// replicated.
double rank_layer_params(const TransformerSpec& m, int t) {
  const double norms = (m.rms_norm ? 1.0 : 2.0) * 2.0 * m.hidden_size;
  return (transformer_layer_params(m) - norms) / t + norms;
}

}  // namespace

ParallelCostModel::ParallelCostModel(ParallelWorkload workload, ClusterSpec cluster)
    : workload_(std::move(workload)), cluster_(std::move(cluster)) {
  workload_.validate();
  cluster_.validate("cluster '" + cluster_.name + "'");
  const DeviceSpec& device = cluster_.device;
  (void)device.peak_flops(workload_.precision);  // throws when the device lacks the precision
  check_fused_attention_device(device, workload_.attention, workload_.precision,
                               workload_.model.head_dim());
  layer_ = price_piece(cluster_.device, transformer_layer_kernels(workload_));
  embeddings_ = price_piece(cluster_.device, transformer_embedding_kernels(workload_));
  head_ = price_piece(cluster_.device, transformer_head_kernels(workload_));
  layer_params_ = rank_layer_params(workload_.model, workload_.tensor_parallel);
  const int t = workload_.tensor_parallel;
  const Link tensor_link = cluster_.link_for(t, 1);
  const double e = element_bytes(workload_.precision);
  tensor_allreduce_s_ =
      allreduce_seconds(workload_.tokens() * workload_.model.hidden_size * e, t, tensor_link);
  // The vocab-parallel cross-entropy's three reductions of one fp32 value per token.
  head_allreduce_s_ = 3.0 * allreduce_seconds(4.0 * workload_.tokens(), t, tensor_link);
  const Precision products = kfac_product_precision(device, workload_.precision);
  const double T = workload_.tokens();
  for (int i = 0; i < sched::kNumLinearKinds; ++i) {
    const Dims d = linear_dims(static_cast<sched::LinearKind>(i));
    auto& k = kfac_[static_cast<std::size_t>(i)];
    k.curvature_a = price(device, curvature_kernels(products, T, d.in, e));
    k.curvature_b = price(device, curvature_kernels(products, T, d.out, e));
    k.invert_a = price(device, inversion_kernels(d.in));
    k.invert_b = price(device, inversion_kernels(d.out));
    k.precondition = price(device, precondition_kernels(products, d.in, d.out));
  }
}

ParallelCostModel::Dims ParallelCostModel::linear_dims(sched::LinearKind linear) const {
  const auto& m = workload_.model;
  const double t = workload_.tensor_parallel, H = m.hidden_size;
  const double q = H / t, kv = std::max(1.0, m.num_kv_heads / t) * m.head_dim();
  const double I = m.intermediate_size / t;
  switch (linear) {
    case sched::LinearKind::kQuery:
      return {H, q};
    case sched::LinearKind::kKey:
    case sched::LinearKind::kValue:
      return {H, kv};
    case sched::LinearKind::kAttentionOut:
      return {q, H};
    case sched::LinearKind::kFfnIn:
      return {H, (m.gated_mlp ? 2.0 : 1.0) * I};  // gate and up as one Linear
    case sched::LinearKind::kFfnOut:
      return {I, H};
  }
  return {H, H};
}

double ParallelCostModel::chunk_params(const sched::Schedule& schedule, int pipeline,
                                       int chunk) const {
  const auto& placed = chunk_at(schedule, pipeline, chunk, "parallel costs");
  const auto& m = workload_.model;
  const double t = workload_.tensor_parallel, H = m.hidden_size, V = m.vocab_size;
  double params = placed.num_layers * layer_params_;
  if (placed.has_embeddings) {
    params += V / t * H + (transformer_embedding_params(m) - V * H);  // positions replicated
  }
  if (placed.has_head) {
    const double full = transformer_head_params(m, placed.has_embeddings);
    const bool has_matrix = !(m.tied_head && placed.has_embeddings);
    // A tied head on another stage keeps its own copy of the embedding (Megatron).
    const double matrix = (has_matrix || !m.tied_head) ? V * H : 0.0;
    params += (full - (has_matrix ? V * H : 0.0)) + matrix / t;
  }
  return params;
}

double ParallelCostModel::worker_params(const sched::Schedule& schedule, int worker) const {
  double params = 0.0;
  for (const auto& placed : schedule.placement.chunks) {
    if (placed.worker == worker) params += chunk_params(schedule, placed.pipeline, placed.chunk);
  }
  return params;
}

int ParallelCostModel::shard_group(int requested, const sched::Schedule& schedule,
                                   const char* flag) const {
  const int d = std::max(1, schedule.params.data_parallel);
  const int group = requested == 0 ? d : requested;
  if (group < 1 || group > d || d % group != 0) {
    throw std::invalid_argument(std::string(flag) + " " + std::to_string(requested) +
                                " must divide the data-parallel replicas " + std::to_string(d) +
                                " (0: all of them)");
  }
  return group;
}

double ParallelCostModel::tensor_allreduce_seconds() const {
  return tensor_allreduce_s_;
}

int ParallelCostModel::data_stride(const sched::Schedule& schedule) const {
  return rank_strides(workload_.rank_order, workload_.tensor_parallel,
                      schedule.params.data_parallel, schedule.num_workers())
      .data;
}

Link ParallelCostModel::pipeline_link(const sched::Schedule& schedule) const {
  // Stages are t x d ranks apart (Megatron's order; t in the runtime's): neighbours share a
  // node only when the whole pipeline fits in one (otherwise some hop crosses the network and
  // the pipeline moves at its pace).
  const long stride = rank_strides(workload_.rank_order, workload_.tensor_parallel,
                                   schedule.params.data_parallel, schedule.num_workers())
                          .pipeline;
  const long span = stride * std::max(1, schedule.num_workers());
  return span <= cluster_.gpus_per_node ? cluster_.nvlink : cluster_.network;
}

double ParallelCostModel::compute_seconds(const sched::Schedule& schedule,
                                          const sched::Instruction& in) const {
  const auto& placed = chunk_at(schedule, in.pipeline, in.chunk, "parallel costs");
  const ChunkParts parts = chunk_parts(placed, in.kind, embeddings_, layer_, head_);
  const bool forward = in.kind == OpKind::kForward;
  const DeviceSpec& device = cluster_.device;
  const double launch = forward ? device.launch_overhead_s : device.backward_launch_s();
  double seconds = queued_seconds(parts.span(), launch);
  // Tensor-parallel all-reduces sit on the critical path of the rank's stream.
  if (workload_.tensor_parallel > 1 && in.kind != OpKind::kBackwardWeight) {
    double reductions = 2.0 * placed.num_layers;
    if (!forward && workload_.recompute == Recompute::kFull) reductions *= 2.0;
    if (forward && placed.has_embeddings) reductions += 1.0;
    if (!forward && placed.has_head) reductions += 1.0;
    seconds += reductions * tensor_allreduce_s_;
    if (forward && placed.has_head) seconds += head_allreduce_s_;
  }
  // Sharded parameters: gathered before the chunk's forward and again before its backward.
  const int s_p = shard_group(workload_.sharding.parameters, schedule, "--shard-parameters");
  if (s_p > 1 && in.kind != OpKind::kBackwardWeight) {
    const double bytes =
        chunk_params(schedule, in.pipeline, in.chunk) * element_bytes(workload_.precision);
    seconds += allgather_seconds(bytes, s_p, cluster_.link_for(s_p, data_stride(schedule)));
  }
  return seconds;
}

ParallelCostModel::KfacHolders ParallelCostModel::kfac_holders(
    const sched::Schedule& schedule) const {
  KfacHolders h;
  h.replicas = std::max(1, schedule.params.data_parallel);
  const auto& state = workload_.kfac_state;
  h.factors = state.factors == 0 ? h.replicas : state.factors;
  h.inverses = state.inverses == 0 ? h.replicas : state.inverses;
  if (h.replicas % h.factors != 0 || h.replicas % h.inverses != 0 || h.inverses % h.factors != 0) {
    throw std::invalid_argument(
        "--kfac-sharding: the K-FAC factors' holders (" + std::to_string(h.factors) +
        ") and the inverses' (" + std::to_string(h.inverses) + ") must divide the " +
        std::to_string(h.replicas) +
        " data-parallel replicas, and the factors' the inverses' (the holders of the factors "
        "invert)");
  }
  return h;
}

double ParallelCostModel::kfac_seconds(const sched::Schedule& schedule,
                                       const sched::Instruction& in, const KfacHolders& h) const {
  const auto& k = kfac_[static_cast<std::size_t>(in.linear)];
  const double launch = cluster_.device.launch_overhead_s;
  const double d = h.replicas;
  switch (in.kind) {
    case OpKind::kCurvatureA:
      return queued_seconds(k.curvature_a, launch);
    case OpKind::kCurvatureB:
      return queued_seconds(k.curvature_b, launch);
    // The average replica inverts h_f / d of the Linears and preconditions h_i / d of them.
    case OpKind::kInvertA:
      return h.factors / d * queued_seconds(k.invert_a, launch);
    case OpKind::kInvertB:
      return h.factors / d * queued_seconds(k.invert_b, launch);
    case OpKind::kPrecondition:
      return h.inverses / d * queued_seconds(k.precondition, launch);
    case OpKind::kCurvatureSync: {
      const int replicas = std::max(1, schedule.placement.num_pipelines) * h.replicas;
      const Dims dims = linear_dims(in.linear);
      const double bytes = in.bytes > 0 ? static_cast<double>(in.bytes)
                                        : 4.0 * (dims.in * dims.in + dims.out * dims.out);
      const int stride = data_stride(schedule);
      if (h.factors == h.replicas || schedule.placement.num_pipelines > 1) {
        return allreduce_seconds(bytes, replicas, cluster_.link_for(h.replicas, stride));
      }
      // Reduce-scatter over the group, then all-gather inside the factor holders.
      return allgather_seconds(bytes, h.replicas, cluster_.link_for(h.replicas, stride)) +
             h.factors / d *
                 allgather_seconds(bytes, h.factors, cluster_.link_for(h.factors, stride));
    }
    case OpKind::kBroadcastInverses: {
      // All-gather over the h_i / h_f factor groups of an inverse group (stride h_f replicas).
      const Dims dims = linear_dims(in.linear);
      const double bytes = 4.0 * (dims.in * dims.in + dims.out * dims.out);
      const int groups = h.inverses / h.factors;
      return h.inverses / d *
             allgather_seconds(bytes, groups,
                               cluster_.link_for(groups, data_stride(schedule) * h.factors));
    }
    case OpKind::kBroadcastGradient: {
      // All-gather of the preconditioned gradients over the d / h_i inverse groups.
      const Dims dims = linear_dims(in.linear);
      const double bytes = 4.0 * (dims.in * dims.out + dims.out);
      const int groups = h.replicas / h.inverses;
      return allgather_seconds(bytes, groups,
                               cluster_.link_for(groups, data_stride(schedule) * h.inverses));
    }
    default:
      return 0.0;
  }
}

ParallelCostModel::KfacStateCost ParallelCostModel::kfac_state_cost(
    const sched::Schedule& schedule, int worker, const std::vector<sched::LinearKind>& linears,
    const std::vector<int>& layers) const {
  return kfac_state_cost(schedule, worker, linears, layers, kfac_holders(schedule));
}

ParallelCostModel::KfacStateCost ParallelCostModel::kfac_layer_cost(
    const sched::Schedule& schedule, const std::vector<sched::LinearKind>& linears,
    const KfacHolders& h) const {
  const double d = h.replicas;
  KfacStateCost cost;
  sched::Instruction in;
  auto seconds = [&](OpKind kind, sched::LinearKind linear) {
    in.kind = kind;
    in.linear = linear;
    return kfac_seconds(schedule, in, h);
  };
  for (sched::LinearKind linear : linears) {
    const Dims dims = linear_dims(linear);
    const double state = 4.0 * (dims.in * dims.in + dims.out * dims.out);
    const double gradient = 4.0 * (dims.in * dims.out + dims.out);
    cost.largest_linear_bytes = std::max(cost.largest_linear_bytes, 2.0 * state);
    cost.replicated_bytes += 2.0 * state;
    cost.memory_bytes += (h.factors + h.inverses) / d * state;
    if (h.replicas > 1) {
      cost.factor_bytes_per_refresh +=
          (h.factors == h.replicas ? 2.0 * (d - 1.0) : d + h.factors - 2.0) / d * state;
      cost.factor_seconds_per_refresh += seconds(OpKind::kCurvatureSync, linear);
    }
    if (h.inverses > h.factors) {
      cost.inverse_bytes_per_refresh += (h.inverses - h.factors) / d * state;
      cost.inverse_seconds_per_refresh += seconds(OpKind::kBroadcastInverses, linear);
    }
    if (h.inverses < h.replicas) {
      cost.gradient_bytes_per_step += (d - h.inverses) / d * gradient;
      cost.gradient_seconds_per_step += seconds(OpKind::kBroadcastGradient, linear);
    }
    cost.curvature_seconds_per_microbatch +=
        seconds(OpKind::kCurvatureA, linear) + seconds(OpKind::kCurvatureB, linear);
    cost.inversion_seconds_per_refresh +=
        seconds(OpKind::kInvertA, linear) + seconds(OpKind::kInvertB, linear);
    cost.precondition_seconds_per_step += seconds(OpKind::kPrecondition, linear);
    cost.factor_sum_bytes +=
        kfac_sum_bytes(schedule, 0, linear, true) + kfac_sum_bytes(schedule, 0, linear, false);
  }
  cost.busiest_memory_bytes = cost.memory_bytes;
  return cost;
}

ParallelCostModel::KfacStateCost ParallelCostModel::KfacStateCost::times(double layers,
                                                                         bool spread) const {
  KfacStateCost out = *this;
  for (double* x : {&out.replicated_bytes, &out.memory_bytes, &out.factor_bytes_per_refresh,
                    &out.inverse_bytes_per_refresh, &out.gradient_bytes_per_step,
                    &out.factor_seconds_per_refresh, &out.inverse_seconds_per_refresh,
                    &out.gradient_seconds_per_step, &out.curvature_seconds_per_microbatch,
                    &out.inversion_seconds_per_refresh, &out.precondition_seconds_per_step,
                    &out.factor_sum_bytes}) {
    *x *= layers;
  }
  if (layers <= 0.0) out.largest_linear_bytes = 0.0;
  // The owners are balanced greedily: the busiest replica holds at most the average plus the
  // largest Linear's state.
  out.busiest_memory_bytes =
      spread ? std::min(out.replicated_bytes, out.memory_bytes + out.largest_linear_bytes)
             : out.memory_bytes;
  return out;
}

ParallelCostModel::KfacStateCost ParallelCostModel::kfac_state_cost(
    const sched::Schedule& schedule, int worker, const std::vector<sched::LinearKind>& linears,
    const std::vector<int>& layers, const KfacHolders& h) const {
  double held = 0.0;
  for (const auto& placed : schedule.placement.chunks) {
    if (placed.worker != worker) continue;
    if (layers.empty()) {
      held += placed.num_layers;
      continue;
    }
    held += static_cast<double>(std::count_if(layers.begin(), layers.end(), [&](int layer) {
      return layer >= placed.first_layer && layer < placed.first_layer + placed.num_layers;
    }));
  }
  return kfac_layer_cost(schedule, linears, h)
      .times(held, h.factors < h.replicas || h.inverses < h.replicas);
}

double ParallelCostModel::duration(const sched::Schedule& schedule, int worker,
                                   const sched::Instruction& in) const {
  const double e = element_bytes(workload_.precision);
  const int t = workload_.tensor_parallel;
  switch (in.kind) {
    case OpKind::kForward:
    case OpKind::kBackward:
    case OpKind::kBackwardInput:
    case OpKind::kBackwardWeight:
      return compute_seconds(schedule, in);
    case OpKind::kSendActivation:
    case OpKind::kRecvActivation:
    case OpKind::kSendGradient:
    case OpKind::kRecvGradient: {
      const double boundary = workload_.tokens() * workload_.model.hidden_size * e;
      const Link link = pipeline_link(schedule);
      double seconds = transfer_seconds(boundary / t, link.bandwidth, link.latency_s);
      if (t > 1) seconds += allgather_seconds(boundary, t, cluster_.link_for(t, 1));
      return seconds;
    }
    case OpKind::kReduceGradPipelines: {
      const double bytes = in.bytes > 0 ? static_cast<double>(in.bytes)
                                        : chunk_params(schedule, in.pipeline, in.chunk) * e;
      return allreduce_seconds(bytes, 2, pipeline_link(schedule));
    }
    case OpKind::kReduceGradDataParallel: {
      const int d = std::max(1, schedule.params.data_parallel);
      double seconds = 0.0;
      if (in.chunk >= 0) {
        const double bytes = chunk_params(schedule, in.pipeline, in.chunk) * e;
        const int s_g =
            std::max(shard_group(workload_.sharding.gradients, schedule, "--shard-gradients"),
                     shard_group(workload_.sharding.parameters, schedule, "--shard-parameters"));
        if (s_g > 1) {
          // Reduce-scatter inside the shard group, then all-reduce each shard across groups.
          seconds = allgather_seconds(bytes, s_g, cluster_.link_for(s_g, data_stride(schedule))) +
                    allreduce_seconds(bytes / s_g, d / s_g,
                                      cluster_.link_for(d / s_g, data_stride(schedule) * s_g));
        } else {
          seconds = allreduce_seconds(bytes, d, cluster_.link_for(d, data_stride(schedule)));
        }
        const auto& placed = chunk_at(schedule, in.pipeline, in.chunk, "parallel costs");
        const bool split_tied = workload_.model.tied_head &&
                                schedule.placement.chunks_per_pipeline > 1 &&
                                (placed.has_embeddings || placed.has_head);
        if (split_tied) {
          // The embedding group: first and last stage sum their copies' gradients.
          const double embedding =
              double{1.0} * workload_.model.vocab_size / t * workload_.model.hidden_size * e;
          seconds += allreduce_seconds(embedding, 2, pipeline_link(schedule));
        }
      } else {
        seconds = allreduce_seconds(worker_params(schedule, worker) * e, d,
                                    cluster_.link_for(d, data_stride(schedule)));
      }
      return seconds;
    }
    case OpKind::kOptimizerStep: {
      const double params = worker_params(schedule, worker);
      const int s_o = shard_group(workload_.sharding.optimizer, schedule, "--shard-optimizer");
      const int s_p = shard_group(workload_.sharding.parameters, schedule, "--shard-parameters");
      const double shard = params / s_o;
      double seconds = 0.0;
      if (workload_.optimizer_offload == Offload::kNone) {
        seconds = cluster_.device.launch_overhead_s +
                  kernel_seconds(cluster_.device, memory_kernel(28.0 * shard));
      } else {
        if (!(cluster_.host_bandwidth > 0.0)) {
          throw std::invalid_argument(
              "--offload-optimizer needs the cluster's host_bandwidth_gbps");
        }
        seconds = 2.0 * e * shard / cluster_.host_bandwidth;  // gradients down, weights up
        if (workload_.optimizer_offload == Offload::kNvme) {
          if (!(cluster_.nvme_bandwidth > 0.0)) {
            throw std::invalid_argument(
                "--offload-optimizer nvme needs the cluster's nvme_bandwidth_gbps");
          }
          // The node's NVMe shared by its GPUs: the state read and written once per step.
          seconds += 2.0 * 12.0 * shard / (cluster_.nvme_bandwidth / cluster_.gpus_per_node);
        }
      }
      // Replicated weights: every replica gathers the shards the others updated.
      if (s_o > 1 && s_p == 1) {
        seconds +=
            allgather_seconds(params * e, s_o, cluster_.link_for(s_o, data_stride(schedule)));
      }
      return seconds;
    }
    case OpKind::kCurvatureSync:  // a piece: its share of the whole sync, plus overhead
      return kfac_piece_seconds(kfac_seconds(schedule, whole_task(in), kfac_holders(schedule)),
                                cluster_.device.kfac_overhead(in.kind), in);
    case OpKind::kBroadcastInverses:
    case OpKind::kBroadcastGradient:
      return kfac_seconds(schedule, in, kfac_holders(schedule));
    case OpKind::kCurvatureA:
    case OpKind::kCurvatureB:
    case OpKind::kInvertA:
    case OpKind::kInvertB:
    case OpKind::kPrecondition:
      return kfac_piece_seconds(kfac_seconds(schedule, in, kfac_holders(schedule)),
                                cluster_.device.kfac_overhead(in.kind), in);
    case OpKind::kPrefetchFactors:
    case OpKind::kWriteBackState:
    case OpKind::kPrefetchInverses: {
      // The cluster's PCIe per GPU where given, else the device's own host link.
      const bool cluster_link = cluster_.host_bandwidth > 0.0;
      return host_transfer_seconds(
          static_cast<double>(std::max<std::int64_t>(in.bytes, 0)),
          cluster_link ? cluster_.host_bandwidth : cluster_.device.host_bandwidth,
          cluster_.device.host_latency_s, "the cluster's host_bandwidth_gbps");
    }
  }
  return 0.0;
}

double ParallelCostModel::activation_bytes(const sched::Schedule& schedule, int pipeline,
                                           int chunk) const {
  const auto& placed = chunk_at(schedule, pipeline, chunk, "parallel costs");
  double bytes = placed.num_layers * transformer_layer_activation_bytes(workload_);
  if (placed.has_embeddings) bytes += transformer_embedding_activation_bytes(workload_);
  if (placed.has_head) bytes += transformer_head_activation_bytes(workload_);
  return bytes;
}

double ParallelCostModel::static_bytes(const sched::Schedule& schedule, int pipeline,
                                       int chunk) const {
  // Full recomputation rebuilds one layer's activations at a time: held once per worker, here
  // shared out over the chunks the worker holds.
  const auto& placement = schedule.placement;
  const double chunks_per_worker = std::max(
      1.0, static_cast<double>(placement.chunks.size()) / std::max(1, schedule.num_workers()));
  const int s_p = shard_group(workload_.sharding.parameters, schedule, "--shard-parameters");
  const int s_g =
      std::max(s_p, shard_group(workload_.sharding.gradients, schedule, "--shard-gradients"));
  const int s_o = shard_group(workload_.sharding.optimizer, schedule, "--shard-optimizer");
  // 16-bit weights and gradients, 12 bytes of fp32 master weights and Adam moments
  // (kStaticBytesPerParam = 16 unsharded), each over its shard group; offloaded state stays off.
  const double optimizer =
      workload_.optimizer_offload == Offload::kNone ? (kStaticBytesPerParam - 4.0) / s_o : 0.0;
  return chunk_params(schedule, pipeline, chunk) * (2.0 / s_p + 2.0 / s_g + optimizer) +
         transformer_recompute_transient_bytes(workload_) / chunks_per_worker;
}

double ParallelCostModel::kfac_bytes(const sched::Schedule& schedule, int /*layer*/,
                                     sched::LinearKind linear) const {
  // The average replica's share of the factors and inverses (all of both when replicated).
  const Dims d = linear_dims(linear);
  const KfacHolders h = kfac_holders(schedule);
  return (h.factors + h.inverses) / static_cast<double>(h.replicas) * 4.0 *
         (d.in * d.in + d.out * d.out);
}

double ParallelCostModel::kfac_sum_bytes(const sched::Schedule& /*schedule*/, int /*layer*/,
                                         sched::LinearKind linear, bool a_factor) const {
  const Dims d = linear_dims(linear);
  const double dim = a_factor ? d.in : d.out;
  return 4.0 * dim * dim;
}

}  // namespace pf::sim
