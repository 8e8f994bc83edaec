#pragma once
// Costs of one tensor-parallel rank of a PTD-P run (Megatron-LM's tensor x pipeline x data
// parallelism) on a cluster. The schedule is one pipeline of p workers (its data_parallel = d);
// every worker stands for its t tensor-parallel ranks and d data-parallel replicas, which run
// the same stream at the same times (one representative per equivalence class: the t ranks of a
// tensor-parallel group do identical work between their all-reduces, and the d replicas of a
// stage are symmetric), so a 3072-GPU step replays p streams, not t x p x d.
// - compute: the rank's kernels (sim/transformer_kernels.h) queued behind the host, plus the
//   tensor-parallel all-reduces of T x H x e bytes on the tensor-parallel group's link: 2 per
//   layer in the forward, 2 in the backward (and 2 more for a fully recomputed forward), 1 for
//   the vocab-parallel embedding, 1 for the head's input gradient;
// - send / receive: T x H x e / t bytes (Megatron's scatter / gather of the boundary tensor)
//   over the pipeline link, plus the all-gather of the pieces on the tensor-parallel link;
// - data-parallel gradient reduction: the chunk's per-rank parameters x e over d ranks spaced t
//   apart (t x p in the runtime's rank order, ParallelWorkload::rank_order) (plus the tied
//   embedding's all-reduce between first and last stage);
// - optimizer: 28 bytes per per-rank parameter over the memory bandwidth;
// - state sharding (AMSP / ZeRO, StateSharding): parameters split s_p ways are all-gathered
//   before each forward and backward of a chunk; gradients split s_g ways are reduce-scattered
//   over s_g ranks and all-reduced over the d / s_g groups; an optimizer split s_o ways updates
//   its 1 / s_o and all-gathers the weights (unless they are sharded too); memory per parameter
//   2 / s_p + 2 / s_g + 12 / s_o bytes;
// - offload (ZeRO-Infinity): the optimizer state in host memory (or NVMe): its 12 bytes leave
//   the GPU, and the step moves the gradient shard down and the weights up over PCIe (and the
//   state through NVMe: read and write), the host's Adam assumed hidden behind the transfers;
// - K-FAC: kfac_kernels.h on the rank's shard of each Linear; its state placed over the
//   data-parallel group (KfacStateHolders: factors on h_f replicas, inverses on h_i). The
//   representative stream does the average replica's share of the per-Linear work (each
//   replica owns h / d of the Linears): an inversion costs h_f / d of one, a preconditioning
//   h_i / d; the collectives are rings on the group's link (per Linear, F its factors' or
//   inverses' fp32 bytes, P its preconditioned gradient's, n-rank all-gather AG(B, n) =
//   (n - 1) / n B / bw + (n - 1) latency):
//     factor sync  h_f = d: all-reduce over d (as before); h_f < d: reduce-scatter over d, then
//                  all-gather inside the h_f holders: AG(F, d) + h_f / d AG(F, h_f);
//     inverses     h_i > h_f: all-gather over the h_i / h_f factor groups of the inverse group,
//                  the representative in h_i / d of them: h_i / d AG(F, h_i / h_f);
//     gradients    h_i < d: every step, all-gather over the d / h_i inverse groups: AG(P, d / h_i).
//   Bytes one replica receives (= sends) per Linear: (d + h_f - 2) / d F per refresh (2 (d - 1)
//   / d F replicated), (h_i - h_f) / d F per refresh, (d - h_i) / d P per step.
#include <array>
#include <vector>

#include "sim/bert_kernels.h"
#include "sim/cluster.h"
#include "sim/cost_model.h"
#include "sim/priced_pieces.h"
#include "sim/transformer_kernels.h"

namespace pf::sim {

class ParallelCostModel final : public CostModel {
 public:
  // Throws std::invalid_argument on an invalid workload or cluster.
  // The K-FAC task overheads are the cluster device's (DeviceSpec::kfac_overhead).
  ParallelCostModel(ParallelWorkload workload, ClusterSpec cluster);

  double duration(const sched::Schedule& schedule, int worker,
                  const sched::Instruction& instruction) const override;
  double activation_bytes(const sched::Schedule& schedule, int pipeline, int chunk) const override;
  double static_bytes(const sched::Schedule& schedule, int pipeline, int chunk) const override;
  double kfac_bytes(const sched::Schedule& schedule, int layer,
                    sched::LinearKind linear) const override;
  // Every replica accumulates both sums (those without the factors drop theirs at the sync).
  double kfac_sum_bytes(const sched::Schedule& schedule, int layer, sched::LinearKind linear,
                        bool a_factor) const override;
  double kfac_task_overhead_s(sched::OpKind kind) const override {
    return cluster_.device.kfac_overhead(kind);
  }

  // The K-FAC state's holders for `schedule`'s data-parallel group: d, h_f and h_i. Throws
  // std::invalid_argument unless h_f and h_i divide d and h_f divides h_i.
  struct KfacHolders {
    int replicas = 1, factors = 1, inverses = 1;
  };
  KfacHolders kfac_holders(const sched::Schedule& schedule) const;
  // (d_in, d_out) of the rank's shard of a Linear (gate and up as one).
  struct Dims {
    double in = 0.0, out = 0.0;
  };
  Dims linear_dims(sched::LinearKind linear) const;
  // What the K-FAC state placement costs one replica of `worker` (the layers it holds, of
  // `layers` when not empty; the Linears `linears`), in the ring model above.
  struct KfacStateCost {
    double replicated_bytes = 0.0;  // factors and inverses of every Linear (replicate)
    double memory_bytes = 0.0;      // the average replica's share, (h_f + h_i) / d of that
    // The busiest replica's: the owners are balanced greedily, so at most the average plus
    // the largest Linear's state (what the search checks against the GPU).
    double busiest_memory_bytes = 0.0;
    double factor_bytes_per_refresh = 0.0;          // received by one replica: factor sync
    double inverse_bytes_per_refresh = 0.0;         // inverse all-gather
    double gradient_bytes_per_step = 0.0;           // preconditioned-gradient all-gather
    double factor_seconds_per_refresh = 0.0;        // on the data-parallel link
    double inverse_seconds_per_refresh = 0.0;       // on the data-parallel link
    double gradient_seconds_per_step = 0.0;         // on the data-parallel link
    double curvature_seconds_per_microbatch = 0.0;  // A and B of every Linear, one micro-batch
    double inversion_seconds_per_refresh = 0.0;     // the average replica's share
    double precondition_seconds_per_step = 0.0;     // the average replica's share
    double largest_linear_bytes = 0.0;              // one Linear's factors and inverses
    // Both factor sums of every Linear (kfac_sum_bytes): every replica accumulates them during
    // a refresh, whatever the placement (one without the factors drops them at the sync).
    double factor_sum_bytes = 0.0;
    // `layers` layers of this (one layer's) cost; `spread`: some component is not replicated.
    KfacStateCost times(double layers, bool spread) const;
  };
  // One layer's Linears `linears` under `holders`.
  KfacStateCost kfac_layer_cost(const sched::Schedule& schedule,
                                const std::vector<sched::LinearKind>& linears,
                                const KfacHolders& holders) const;
  KfacStateCost kfac_state_cost(const sched::Schedule& schedule, int worker,
                                const std::vector<sched::LinearKind>& linears,
                                const std::vector<int>& layers = {}) const;
  // The same for another placement than the workload's (the search prices each on one model).
  KfacStateCost kfac_state_cost(const sched::Schedule& schedule, int worker,
                                const std::vector<sched::LinearKind>& linears,
                                const std::vector<int>& layers, const KfacHolders& holders) const;

  const ParallelWorkload& workload() const { return workload_; }
  const ClusterSpec& cluster() const { return cluster_; }
  // Parameters one rank holds of (pipeline, chunk) and of everything on `worker`.
  double chunk_params(const sched::Schedule& schedule, int pipeline, int chunk) const;
  double worker_params(const sched::Schedule& schedule, int worker) const;
  // One tensor-parallel all-reduce of a layer's T x H activations.
  double tensor_allreduce_seconds() const;
  // The link between neighbouring pipeline stages of `schedule`.
  Link pipeline_link(const sched::Schedule& schedule) const;
  // The distance between neighbouring members of a data-parallel group (workload's rank order).
  int data_stride(const sched::Schedule& schedule) const;

 private:
  double compute_seconds(const sched::Schedule& schedule, const sched::Instruction& in) const;
  double kfac_seconds(const sched::Schedule& schedule, const sched::Instruction& in,
                      const KfacHolders& holders) const;
  // The ranks a state component is split over (StateSharding: 0 = all d replicas); throws when
  // it does not divide the schedule's data-parallel replicas.
  int shard_group(int requested, const sched::Schedule& schedule, const char* flag) const;

  ParallelWorkload workload_;
  ClusterSpec cluster_;
  PricedPiece layer_, embeddings_, head_;
  std::array<PricedKfac, 6> kfac_{};
  double layer_params_ = 0.0;  // per rank
  double tensor_allreduce_s_ = 0.0;
  double head_allreduce_s_ = 0.0;
};

}  // namespace pf::sim
