#include "sim/analytic_cost_model.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

#include "sim/communication.h"
#include "sim/kfac_kernels.h"

namespace pf::sim {

using sched::OpKind;

namespace {

DeviceSpec with_overhead(DeviceSpec device, double kfac_task_overhead_s) {
  device.kfac_task_overhead_s = kfac_task_overhead_s;
  device.kfac_kind_overheads_s = {};
  return device;
}

}  // namespace

AnalyticCostModel::AnalyticCostModel(Workload workload, DeviceSpec device,
                                     double kfac_task_overhead_s)
    : AnalyticCostModel(std::move(workload),
                        with_overhead(std::move(device), kfac_task_overhead_s)) {}

AnalyticCostModel::AnalyticCostModel(Workload workload, DeviceSpec device)
    : workload_(std::move(workload)), device_(std::move(device)) {
  workload_.validate();
  device_.validate("device '" + device_.name + "'");
  (void)device_.peak_flops(workload_.precision);  // throws when the device lacks the precision
  check_fused_attention_device(device_, workload_.attention, workload_.precision,
                               workload_.config.head_dim());
  layer_ = price_piece(device_, encoder_layer_kernels(workload_));
  embeddings_ = price_piece(device_, embeddings_kernels(workload_));
  heads_ = price_piece(device_, heads_kernels(workload_));
  const Precision products = kfac_product_precision(device_, workload_.precision);
  const double T = workload_.tokens(), e = workload_.storage_bytes();
  for (int i = 0; i < sched::kNumLinearKinds; ++i) {
    const LinearDims d = linear_dims(workload_.config, static_cast<sched::LinearKind>(i));
    auto& k = kfac_[static_cast<std::size_t>(i)];
    k.curvature_a = price(device_, curvature_kernels(products, T, d.in, e));
    k.curvature_b = price(device_, curvature_kernels(products, T, d.out, e));
    k.invert_a = price(device_, inversion_kernels(d.in));
    k.invert_b = price(device_, inversion_kernels(d.out));
    k.precondition = price(device_, precondition_kernels(products, d.in, d.out));
  }
}

double AnalyticCostModel::chunk_params(const sched::Schedule& schedule, int pipeline,
                                       int chunk) const {
  const auto& placed = chunk_at(schedule, pipeline, chunk, "analytic costs");
  const auto& c = workload_.config;
  double params = placed.num_layers * encoder_layer_params(c);
  if (placed.has_embeddings) params += embeddings_params(c);
  if (placed.has_head) params += heads_params(c, placed.has_embeddings);
  return params;
}

double AnalyticCostModel::worker_params(const sched::Schedule& schedule, int worker) const {
  double params = 0.0;
  for (const auto& placed : schedule.placement.chunks) {
    if (placed.worker == worker) params += chunk_params(schedule, placed.pipeline, placed.chunk);
  }
  return params;
}

double AnalyticCostModel::compute_seconds(const sched::Schedule& schedule,
                                          const sched::Instruction& in) const {
  const auto& placed = chunk_at(schedule, in.pipeline, in.chunk, "analytic costs");
  const ChunkParts parts = chunk_parts(placed, in.kind, embeddings_, layer_, heads_);
  return instruction_seconds(device_, parts.span(), in.kind != OpKind::kForward);
}

double AnalyticCostModel::kfac_seconds(const sched::Schedule& schedule,
                                       const sched::Instruction& in) const {
  const LinearDims d = linear_dims(workload_.config, in.linear);
  const double d_in = d.in, d_out = d.out;
  const auto& k = kfac_[static_cast<std::size_t>(in.linear)];
  switch (in.kind) {
    case OpKind::kCurvatureA:
      return instruction_seconds(device_, k.curvature_a, false);
    case OpKind::kCurvatureB:
      return instruction_seconds(device_, k.curvature_b, false);
    case OpKind::kInvertA:
      return instruction_seconds(device_, k.invert_a, false);
    case OpKind::kInvertB:
      return instruction_seconds(device_, k.invert_b, false);
    case OpKind::kPrecondition:
      return instruction_seconds(device_, k.precondition, false);
    case OpKind::kCurvatureSync: {
      const int replicas = std::max(1, schedule.placement.num_pipelines) *
                           std::max(1, schedule.params.data_parallel);
      const double bytes =
          in.bytes > 0 ? static_cast<double>(in.bytes) : 4.0 * (d_in * d_in + d_out * d_out);
      return ring_allreduce_seconds(bytes, replicas, device_.link_bandwidth,
                                    device_.link_latency_s);
    }
    default:
      return 0.0;
  }
}

double AnalyticCostModel::duration(const sched::Schedule& schedule, int worker,
                                   const sched::Instruction& in) const {
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
      const double bytes = in.bytes > 0 ? static_cast<double>(in.bytes) : boundary_bytes(workload_);
      return transfer_seconds(bytes, device_.link_bandwidth, device_.link_latency_s);
    }
    case OpKind::kReduceGradPipelines:
    case OpKind::kReduceGradDataParallel: {
      const int participants =
          in.kind == OpKind::kReduceGradPipelines ? 2 : std::max(1, schedule.params.data_parallel);
      double bytes = static_cast<double>(in.bytes);
      if (bytes <= 0.0) {
        const double params = in.chunk >= 0 ? chunk_params(schedule, in.pipeline, in.chunk)
                                            : worker_params(schedule, worker);
        bytes = params * workload_.storage_bytes();
      }
      return ring_allreduce_seconds(bytes, participants, device_.link_bandwidth,
                                    device_.link_latency_s);
    }
    case OpKind::kOptimizerStep: {
      return instruction_seconds(
          device_, price(device_, {optimizer_step_kernel(worker_params(schedule, worker))}), false);
    }
    case OpKind::kCurvatureSync:  // a piece: its share of the whole all-reduce, plus overhead
      return kfac_piece_seconds(kfac_seconds(schedule, whole_task(in)),
                                device_.kfac_overhead(in.kind), in);
    case OpKind::kBroadcastInverses:
    case OpKind::kBroadcastGradient:
      // The owner sends `bytes` in all over its link.
      return transfer_seconds(static_cast<double>(std::max<std::int64_t>(in.bytes, 0)),
                              device_.link_bandwidth, device_.link_latency_s);
    case OpKind::kCurvatureA:
    case OpKind::kCurvatureB:
    case OpKind::kInvertA:
    case OpKind::kInvertB:
    case OpKind::kPrecondition:
      return kfac_piece_seconds(kfac_seconds(schedule, in), device_.kfac_overhead(in.kind), in);
    case OpKind::kPrefetchFactors:
    case OpKind::kWriteBackState:
    case OpKind::kPrefetchInverses:
      return host_transfer_seconds(static_cast<double>(std::max<std::int64_t>(in.bytes, 0)),
                                   device_.host_bandwidth, device_.host_latency_s,
                                   "the device's host_bandwidth (device " + device_.name + ")");
  }
  return 0.0;
}

double AnalyticCostModel::activation_bytes(const sched::Schedule& schedule, int pipeline,
                                           int chunk) const {
  const auto& placed = chunk_at(schedule, pipeline, chunk, "analytic costs");
  return chunk_activation_bytes(workload_, placed.num_layers, placed.has_embeddings,
                                placed.has_head);
}

double AnalyticCostModel::static_bytes(const sched::Schedule& schedule, int pipeline,
                                       int chunk) const {
  return kStaticBytesPerParam * chunk_params(schedule, pipeline, chunk);
}

double AnalyticCostModel::kfac_bytes(const sched::Schedule& /*schedule*/, int /*layer*/,
                                     sched::LinearKind linear) const {
  const LinearDims d = linear_dims(workload_.config, linear);
  // A and B, each with its inverse, in fp32.
  return 2.0 * 4.0 * (double{1.0} * d.in * d.in + double{1.0} * d.out * d.out);
}

double AnalyticCostModel::kfac_sum_bytes(const sched::Schedule& /*schedule*/, int /*layer*/,
                                         sched::LinearKind linear, bool a_factor) const {
  const LinearDims d = linear_dims(workload_.config, linear);
  const double dim = a_factor ? d.in : d.out;
  return 4.0 * dim * dim;  // the whole d x d matrix, though only its lower triangle is summed
}

}  // namespace pf::sim
