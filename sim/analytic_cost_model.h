#pragma once
// Analytic costs from the model's FLOPs and bytes on a device (sim/bert_costs.h for the model
// side, sim/device.h for the device side). Formulas in docs/simulator.md:
// - compute: matmul_flops / (peak(precision) * matmul_efficiency) + memory_bytes / bandwidth;
//   backward = 2x forward (backward-input and backward-weight split it as bert_costs.h says);
// - send / receive: link_latency + bytes / link_bandwidth (bytes = instruction.bytes, or the
//   T x H boundary tensor when 0);
// - gradient reductions and curvature sync: ring all-reduce (sim/communication.h);
// - optimizer step: 28 bytes per parameter (LAMB/Adam read w, g, m, v and write w, m, v in fp32)
//   over the memory bandwidth;
// - K-FAC (fp32): curvature A 2 T d_in^2 and B 2 T d_out^2 FLOPs, precondition
//   2 d_out d_in (d_in + d_out), at the tf32 tensor-core peak where the device has one and the run
//   is not strict fp32 (fp32 peak otherwise); inversions d^3 (Cholesky d^3/3 + inverse 2d^3/3)
//   at the fp32 peak (cuSOLVER's factorizations do not use tensor cores).
#include "sim/bert_costs.h"
#include "sim/cost_model.h"
#include "sim/device.h"

namespace pf::sim {

class AnalyticCostModel final : public CostModel {
 public:
  // Throws std::invalid_argument when the workload or the device is invalid, or the device lacks
  // the workload's precision.
  AnalyticCostModel(Workload workload, DeviceSpec device);

  double duration(const sched::Schedule& schedule, int worker,
                  const sched::Instruction& instruction) const override;
  double activation_bytes(const sched::Schedule& schedule, int pipeline, int chunk) const override;
  double static_bytes(const sched::Schedule& schedule, int pipeline, int chunk) const override;
  double kfac_bytes(const sched::Schedule& schedule, int layer,
                    sched::LinearKind linear) const override;

  const Workload& workload() const { return workload_; }
  const DeviceSpec& device() const { return device_; }
  double seconds(const Work& work) const;
  double chunk_params(const sched::Schedule& schedule, int pipeline, int chunk) const;
  double worker_params(const sched::Schedule& schedule, int worker) const;

 private:
  const sched::ChunkPlacement& chunk_at(const sched::Schedule& schedule, int pipeline,
                                        int chunk) const;
  double compute_seconds(const sched::Schedule& schedule, const sched::Instruction& in) const;
  double kfac_seconds(const sched::Schedule& schedule, const sched::Instruction& in) const;

  Workload workload_;
  DeviceSpec device_;
  double matmul_rate_ = 0.0;       // FLOP/s achieved by the model's matrix products
  double kfac_matmul_rate_ = 0.0;  // FLOP/s of K-FAC's fp32 products
  double inversion_rate_ = 0.0;    // FLOP/s of fp32 factorizations
  PieceWork layer_, embeddings_, heads_;
};

}  // namespace pf::sim
