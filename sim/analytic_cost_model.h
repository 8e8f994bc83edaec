#pragma once
// Analytic costs from the kernels the model launches on a device (sim/bert_kernels.h and
// sim/kfac_kernels.h for the work, sim/device.h for the per-class rates, sim/kernel_costs.h for
// pricing a kernel sequence with its launch floor). Formulas in docs/simulator.md:
// - compute: the chunk's kernels (embeddings, n layers, heads) queued behind the host's launches;
//   backward priced op by op (input-gradient and weight-gradient products, element-wise
//   backward), the fused backward = backward-input then backward-weight kernels;
// - send / receive: link_latency + bytes / link_bandwidth (bytes = instruction.bytes, or the
//   T x H boundary tensor when 0);
// - gradient reductions and curvature sync: ring all-reduce (sim/communication.h);
// - optimizer step: 28 bytes per parameter (LAMB/Adam read w, g, m, v and write w, m, v in fp32)
//   over the memory bandwidth;
// - K-FAC (fp32): curvature, Cholesky inversion and preconditioning kernels (kfac_kernels.h):
//   products at the tf32 tensor-core peak where the device has one and the run is not strict
//   fp32, factorizations at the fp32 peak (cuSOLVER's do not use tensor cores).
#include <array>

#include "sim/bert_kernels.h"
#include "sim/cost_model.h"
#include "sim/device.h"
#include "sim/priced_pieces.h"

namespace pf::sim {

class AnalyticCostModel final : public CostModel {
 public:
  // Throws std::invalid_argument when the workload or the device is invalid, or the device lacks
  // the workload's precision.
  // The device's K-FAC task overheads (DeviceSpec::kfac_task_overhead_s and its per-kind values):
  // the part of each K-FAC task's modeled time that a piece of a divided task pays again
  // (launches, synchronization): a piece costs its share of the rest plus its kind's overhead
  // (kfac_piece_seconds).
  AnalyticCostModel(Workload workload, DeviceSpec device);
  // The same with one overhead for every kind in place of the device's.
  AnalyticCostModel(Workload workload, DeviceSpec device, double kfac_task_overhead_s);

  double duration(const sched::Schedule& schedule, int worker,
                  const sched::Instruction& instruction) const override;
  double activation_bytes(const sched::Schedule& schedule, int pipeline, int chunk) const override;
  double static_bytes(const sched::Schedule& schedule, int pipeline, int chunk) const override;
  double kfac_bytes(const sched::Schedule& schedule, int layer,
                    sched::LinearKind linear) const override;
  double kfac_sum_bytes(const sched::Schedule& schedule, int layer, sched::LinearKind linear,
                        bool a_factor) const override;

  const Workload& workload() const { return workload_; }
  const DeviceSpec& device() const { return device_; }
  double kfac_task_overhead_s(sched::OpKind kind) const override {
    return device_.kfac_overhead(kind);
  }
  double chunk_params(const sched::Schedule& schedule, int pipeline, int chunk) const;
  double worker_params(const sched::Schedule& schedule, int worker) const;

 private:
  double compute_seconds(const sched::Schedule& schedule, const sched::Instruction& in) const;
  double kfac_seconds(const sched::Schedule& schedule, const sched::Instruction& in) const;

  Workload workload_;
  DeviceSpec device_;
  PricedPiece layer_, embeddings_, heads_;
  std::array<PricedKfac, 6> kfac_{};  // index LinearKind
};

}  // namespace pf::sim
