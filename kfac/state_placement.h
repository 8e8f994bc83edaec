#pragma once
// Where the K-FAC state lives across data-parallel replicas (AMSP's replicate / shard /
// partially-shard choice applied to K-FAC), and a cost model that chooses it.
//
// Components, per preconditioned Linear:
//   factors   A and B after the refresh's sync; the replicas holding them invert (everyone who
//             holds the factors computes the inverses: no inverse is ever computed twice over
//             the wire and once locally);
//   inverses  A^-1 and B^-1; holders beyond the factor holders receive them by broadcast from
//             the layer's owner;
//   preconditioned gradients: computed where the inverses are; the replicas without them
//             receive B^-1 G A^-1 (and the bias's B^-1 g) by broadcast from the owner, every step.
// Each component is replicated (every replica of the data-parallel group), sharded (one
// replica, the layer's owner) or partial:G (the G replicas of the owner's contiguous group).
// The factor holders must lie inside the inverse holders (the inverses are computed there).
//
// Owners: the layers of one pipeline worker are assigned to the inverting groups largest
// inversion first, each to the least-loaded group (kfac-pytorch's greedy), ties to the lowest.
//
// How the executor moves the data (what the cost model counts): the factor sync is the
// deterministic all-reduce over the data-parallel group (every placement: the sum needs every
// replica's part); broadcasts go from the owner to each receiver point to point.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kfac/sharding.h"

namespace pf::kfac {

enum class Placement : unsigned char { kReplicate, kPartial, kShard };

struct ComponentPlacement {
  Placement placement = Placement::kReplicate;
  int group = 0;  // partial: replicas per group (>= 1)
  // Replicas holding the component for each layer, out of `replicas`.
  int holders(int replicas) const;
  friend bool operator==(const ComponentPlacement&, const ComponentPlacement&) = default;
};

struct StatePlacement {
  ComponentPlacement factors;
  ComponentPlacement inverses;  // the preconditioned gradients are computed where these are
  friend bool operator==(const StatePlacement&, const StatePlacement&) = default;
};

// "replicate", "shard", "partial:4": every component placed that way.
StatePlacement uniform_placement(ComponentPlacement placement);
// "replicate", "shard", "partial:G", or "factors=shard,inverses=partial:2".
std::string to_string(const StatePlacement& placement);
std::string to_string(const ComponentPlacement& placement);

// --kfac-sharding: auto | replicate | shard | partial:G (G >= 1) | factors=P,inverses=P (each
// component its own, as to_string writes it; P not auto). automatic is set for "auto"
// (the placement is then chosen by choose_state_placement). Throws std::invalid_argument naming
// the flag, the value and what is allowed.
struct ShardingChoice {
  bool automatic = false;
  StatePlacement placement;  // when not automatic
};
ShardingChoice parse_kfac_sharding(std::string_view text);

// Throws std::invalid_argument unless replicas >= 1, every group size divides `replicas`, and
// the factor holders nest inside the inverse holders (factor group divides inverse group).
void validate_placement(const StatePlacement& placement, int replicas);

// One Linear's placement across the data-parallel group.
struct LayerPlacement {
  int owner = 0;         // inverts (first of its inverting group) and roots the broadcasts
  int factor_first = 0;  // [factor_first, factor_first + factor_count): hold factors, invert
  int factor_count = 1;
  int inverse_first = 0;  // [inverse_first, inverse_first + inverse_count): hold inverses
  int inverse_count = 1;
  bool holds_factors(int replica) const {
    return replica >= factor_first && replica < factor_first + factor_count;
  }
  bool holds_inverses(int replica) const {
    return replica >= inverse_first && replica < inverse_first + inverse_count;
  }
  // The inverses go from the owner to inverse holders without factors.
  bool broadcasts_inverses() const { return inverse_count > factor_count; }
  // The preconditioned gradient goes from the owner to replicas without inverses.
  bool broadcasts_gradient(int replicas) const { return inverse_count < replicas; }
  // Ascending members: {owner} + inverse holders without factors.
  std::vector<int> inverse_broadcast_group() const;
  // Ascending members: {owner} + replicas without inverses.
  std::vector<int> gradient_broadcast_group(int replicas) const;
};

struct StatePlan {
  int replicas = 1;
  StatePlacement placement;
  std::vector<LayerPlacement> layers;  // parallel to the layers planned
};

// Plans the Linears of one pipeline worker (in a fixed order every replica agrees on). Throws
// std::invalid_argument for an invalid placement or a non-positive dimension.
StatePlan plan_state(std::span<const LinearDims> layers, int replicas,
                     const StatePlacement& placement);

// What a plan costs, per replica of the data-parallel group (fp32 state).
struct StateCost {
  // Factor values and inverses held between refreshes: 4 (d_in^2 + d_out^2) each.
  std::vector<std::int64_t> memory_bytes;
  // Payload bytes this replica sends per refresh of `refresh_steps` steps: the factor
  // all-reduce (S + (n - 2) * its own segment for S bytes over n members), the inverse
  // broadcast and `refresh_steps` preconditioned-gradient broadcasts ((members - 1) x payload
  // from the owner).
  std::vector<std::int64_t> sent_bytes_per_refresh;
  std::vector<double> inversion_flops;  // per refresh (inversion_flops per layer inverted)
  std::int64_t max_memory_bytes() const;
  std::int64_t max_sent_bytes() const;
  std::int64_t total_sent_bytes() const;
  double max_inversion_flops() const;
};
StateCost state_cost(const StatePlan& plan, std::span<const LinearDims> layers, int refresh_steps);

// The machine the cost model prices placements on.
struct PlacementMachine {
  double link_bandwidth = 10e9;   // bytes/s each replica sends at
  double link_latency_s = 5e-6;   // per message
  double inversion_flops = 1e11;  // FLOP/s of the inversions
  // Per replica: placements holding more K-FAC state are not chosen (0: no limit).
  double memory_budget_bytes = 0.0;
};

// Seconds per training step the placement adds: (the busiest replica's sends / bandwidth +
// messages x latency + its inversions / FLOP rate) / refresh_steps.
double placement_seconds_per_step(const StateCost& cost, const StatePlan& plan,
                                  const PlacementMachine& machine, int refresh_steps);

struct PlacementCandidate {
  StatePlacement placement;
  StateCost cost;
  double seconds_per_step = 0.0;
  bool within_budget = true;
};
struct PlacementChoice {
  StatePlacement chosen;
  std::vector<PlacementCandidate> candidates;  // every valid placement, in enumeration order
};
// Every valid (factors, inverses) pair for `replicas`, each priced; chooses the fastest within
// the memory budget, ties to less memory, then to the earlier candidate (replicate first).
// Over `workers` (one span of Linears per pipeline worker) the busiest worker counts.
PlacementChoice choose_state_placement(std::span<const std::vector<LinearDims>> workers,
                                       int replicas, int refresh_steps,
                                       const PlacementMachine& machine);

}  // namespace pf::kfac
