#pragma once
// Placement of K-FAC inversions and inverses across data-parallel replicas (kfac-pytorch's
// grad-worker fraction; AMSP's replicate / shard / partially-shard choice applied to K-FAC state).
//
// Each layer's two inversions run on one replica, its "inverse worker", chosen greedily: layers in
// decreasing cost, each to the least-loaded replica (ties to the lowest rank). With g = fraction *
// world grad workers per layer, the replicas are cut into world / g contiguous groups; a layer's
// grad workers are the group of its inverse worker: they receive its inverses and precondition its
// gradient, and every other replica receives the preconditioned gradient.
//   fraction 1         COMM-OPT: one group, every replica holds every inverse.
//   fraction 1/world   MEM-OPT: each inverse lives only on its inverse worker.
//   in between         HYBRID-OPT.
#include <cstdint>
#include <span>
#include <vector>

namespace pf::kfac {

// Greedy longest-processing-time assignment: returns the worker of each item.
// Throws std::invalid_argument for workers < 1 or a negative or non-finite cost.
std::vector<int> assign_greedy(std::span<const double> costs, int workers);

struct LinearDims {
  std::int64_t d_in = 0;
  std::int64_t d_out = 0;
};

// FLOP model of inverting both factors: Cholesky d^3/3 plus the inverse 2 d^3 / 3 for each.
double inversion_flops(LinearDims dims);

struct KfacShardingPlan {
  int world_size = 1;
  int grad_workers = 1;                             // per layer
  std::vector<int> inverse_worker;                  // per layer
  std::vector<std::vector<int>> grad_worker_ranks;  // per layer, ascending
  std::vector<double> inversion_load;               // per replica, FLOP
  std::vector<std::int64_t> inverse_bytes;          // per replica, fp32 inverses held
};

// Throws std::invalid_argument unless world_size >= 1, 0 < fraction <= 1 and
// g = round(fraction * world) (at least 1) divides world_size.
KfacShardingPlan plan_kfac_sharding(std::span<const LinearDims> layers, int world_size,
                                    double grad_worker_fraction);

}  // namespace pf::kfac
