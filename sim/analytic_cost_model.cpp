#include "sim/analytic_cost_model.h"

#include <stdexcept>
#include <string>
#include <utility>

#include "sim/communication.h"

namespace pf::sim {

using sched::OpKind;

AnalyticCostModel::AnalyticCostModel(Workload workload, DeviceSpec device)
    : workload_(std::move(workload)), device_(std::move(device)) {
  workload_.validate();
  device_.validate("device '" + device_.name + "'");
  matmul_rate_ = device_.peak_flops(workload_.precision) * device_.matmul_efficiency;
  kfac_matmul_rate_ = device_.kfac_matmul_peak(workload_.precision) * device_.matmul_efficiency;
  inversion_rate_ = device_.peak_fp32_flops * device_.matmul_efficiency;
  layer_ = encoder_layer_work(workload_);
  embeddings_ = embeddings_work(workload_);
  heads_ = heads_work(workload_);
}

double AnalyticCostModel::seconds(const Work& work) const {
  return work.matmul_flops / matmul_rate_ + work.memory_bytes / device_.memory_bandwidth;
}

const sched::ChunkPlacement& AnalyticCostModel::chunk_at(const sched::Schedule& schedule,
                                                         int pipeline, int chunk) const {
  const auto& placement = schedule.placement;
  const long index = static_cast<long>(pipeline) * placement.chunks_per_pipeline + chunk;
  if (chunk < 0 || chunk >= placement.chunks_per_pipeline || pipeline < 0 ||
      index >= static_cast<long>(placement.chunks.size())) {
    throw std::invalid_argument("analytic costs: no placement for pipeline " +
                                std::to_string(pipeline) + " chunk " + std::to_string(chunk));
  }
  return placement.chunks[static_cast<std::size_t>(index)];
}

double AnalyticCostModel::chunk_params(const sched::Schedule& schedule, int pipeline,
                                       int chunk) const {
  const auto& placed = chunk_at(schedule, pipeline, chunk);
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
  const auto& placed = chunk_at(schedule, in.pipeline, in.chunk);
  auto piece = [&](const PieceWork& w) -> const Work& {
    switch (in.kind) {
      case OpKind::kForward:
        return w.forward;
      case OpKind::kBackwardInput:
        return w.backward_input;
      default:
        return w.backward_weight;
    }
  };
  Work work = placed.num_layers * piece(layer_);
  if (placed.has_embeddings) work += piece(embeddings_);
  if (placed.has_head) work += piece(heads_);
  if (in.kind == OpKind::kBackward) {
    Work input = placed.num_layers * layer_.backward_input;
    if (placed.has_embeddings) input += embeddings_.backward_input;
    if (placed.has_head) input += heads_.backward_input;
    work += input;
  }
  return seconds(work);
}

double AnalyticCostModel::kfac_seconds(const sched::Schedule& schedule,
                                       const sched::Instruction& in) const {
  const LinearDims d = linear_dims(workload_.config, in.linear);
  const double T = workload_.tokens(), e = element_bytes(workload_.precision);
  const double d_in = d.in, d_out = d.out;
  switch (in.kind) {
    case OpKind::kCurvatureA:  // A = a^T a: read a (T x d_in), write d_in^2 fp32
      return 2.0 * T * d_in * d_in / kfac_matmul_rate_ +
             (T * d_in * e + 4.0 * d_in * d_in) / device_.memory_bandwidth;
    case OpKind::kCurvatureB:
      return 2.0 * T * d_out * d_out / kfac_matmul_rate_ +
             (T * d_out * e + 4.0 * d_out * d_out) / device_.memory_bandwidth;
    case OpKind::kInvertA:
      return d_in * d_in * d_in / inversion_rate_;
    case OpKind::kInvertB:
      return d_out * d_out * d_out / inversion_rate_;
    case OpKind::kPrecondition:
      return 2.0 * d_out * d_in * (d_in + d_out) / kfac_matmul_rate_;
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
        bytes = params * element_bytes(workload_.precision);
      }
      return ring_allreduce_seconds(bytes, participants, device_.link_bandwidth,
                                    device_.link_latency_s);
    }
    case OpKind::kOptimizerStep:
      return 28.0 * worker_params(schedule, worker) / device_.memory_bandwidth;
    case OpKind::kCurvatureA:
    case OpKind::kCurvatureB:
    case OpKind::kCurvatureSync:
    case OpKind::kInvertA:
    case OpKind::kInvertB:
    case OpKind::kPrecondition:
      return kfac_seconds(schedule, in);
  }
  return 0.0;
}

double AnalyticCostModel::activation_bytes(const sched::Schedule& schedule, int pipeline,
                                           int chunk) const {
  const auto& placed = chunk_at(schedule, pipeline, chunk);
  double bytes = placed.num_layers * encoder_layer_activation_bytes(workload_);
  if (placed.has_embeddings) bytes += embeddings_activation_bytes(workload_);
  if (placed.has_head) bytes += heads_activation_bytes(workload_);
  return bytes;
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

}  // namespace pf::sim
