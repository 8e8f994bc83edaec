// K-FAC state placement across data-parallel replicas: parsing, plans, the cost model.
#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

#include "kfac/state_placement.h"

namespace pf::kfac {
namespace {

// Two BERT-like layers: attention 4x4 (inversion cost 128) and FFN 4x16 / 16x4 (cost 4160).
const std::vector<LinearDims> kLayers = {{4, 4}, {4, 16}, {4, 4}, {16, 4}};

TEST(KfacPlacement, ParsesTheFlag) {
  EXPECT_TRUE(parse_kfac_sharding("auto").automatic);
  const auto replicate = parse_kfac_sharding("replicate");
  EXPECT_FALSE(replicate.automatic);
  EXPECT_EQ(replicate.placement.factors.placement, Placement::kReplicate);
  EXPECT_EQ(parse_kfac_sharding("shard").placement.inverses.placement, Placement::kShard);
  const auto partial = parse_kfac_sharding("partial:2").placement;
  EXPECT_EQ(partial.factors.placement, Placement::kPartial);
  EXPECT_EQ(partial.inverses.group, 2);
  EXPECT_EQ(to_string(partial), "partial:2");
  EXPECT_EQ(to_string(StatePlacement{{Placement::kShard, 0}, {Placement::kReplicate, 0}}),
            "factors=shard,inverses=replicate");
  // Each component its own: what to_string writes (a checkpoint's state.kfac.placement).
  for (const StatePlacement placement :
       {StatePlacement{{Placement::kShard, 0}, {Placement::kReplicate, 0}},
        StatePlacement{{Placement::kShard, 0}, {Placement::kPartial, 4}},
        StatePlacement{{Placement::kPartial, 2}, {Placement::kReplicate, 0}}}) {
    const auto parsed = parse_kfac_sharding(to_string(placement));
    EXPECT_FALSE(parsed.automatic);
    EXPECT_EQ(parsed.placement, placement) << to_string(placement);
  }
  for (const char* bad :
       {"", "sharded", "partial:", "partial:0", "partial:x", "partial:2x", "factors=shard",
        "factors=shard,inverses=", "factors=auto,inverses=shard", "factors=shard,inverses=auto",
        "factors=shard,inverses=factors=shard,inverses=shard", "inverses=shard,factors=shard",
        "factors=shard,inverses=partial:0"}) {
    try {
      parse_kfac_sharding(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const std::invalid_argument& error) {
      EXPECT_NE(std::string(error.what()).find("--kfac-sharding"), std::string::npos);
    }
  }
}

TEST(KfacPlacement, ValidatesGroupsAndNesting) {
  EXPECT_NO_THROW(validate_placement(uniform_placement({Placement::kPartial, 2}), 4));
  EXPECT_THROW(validate_placement(uniform_placement({Placement::kPartial, 3}), 4),
               std::invalid_argument);
  // Factors on 2 replicas, inverses on 1: the inverses would be computed outside their holders.
  EXPECT_THROW(validate_placement({{Placement::kPartial, 2}, {Placement::kShard, 0}}, 4),
               std::invalid_argument);
  EXPECT_THROW(validate_placement(uniform_placement({Placement::kShard, 0}), 0),
               std::invalid_argument);
}

TEST(KfacPlacement, ShardPlacesEachLayerOnItsGreedyOwner) {
  const auto plan = plan_state(kLayers, 4, uniform_placement({Placement::kShard, 0}));
  // Largest first to the least-loaded: the FFNs to 0 and 1, the attention Linears to 2 and 3.
  std::vector<int> owners;
  for (const auto& layer : plan.layers) owners.push_back(layer.owner);
  EXPECT_EQ(owners, (std::vector<int>{2, 0, 3, 1}));
  const auto& ffn = plan.layers[1];
  EXPECT_TRUE(ffn.holds_factors(0));
  EXPECT_FALSE(ffn.holds_inverses(1));
  EXPECT_FALSE(ffn.broadcasts_inverses());
  EXPECT_TRUE(ffn.broadcasts_gradient(4));
  EXPECT_EQ(ffn.gradient_broadcast_group(4), (std::vector<int>{0, 1, 2, 3}));

  const auto cost = state_cost(plan, kLayers, 3);
  // Replica 0 holds the first FFN's factors and inverses: 2 x 4 (16 + 256) bytes.
  EXPECT_EQ(cost.memory_bytes[0], 2 * 4 * (16 + 256));
  EXPECT_EQ(cost.memory_bytes[2], 2 * 4 * (16 + 16));
  EXPECT_DOUBLE_EQ(cost.inversion_flops[0], 4160.0);
  // Sync of every layer: S + 2 x own segment per all-reduce of 4 members, plus the counts;
  // replica 0 broadcasts the FFN's preconditioned gradient (4 x (64 + 16) bytes) to 3 replicas,
  // 3 times per refresh.
  std::int64_t sync = 0;
  for (const auto& dims : kLayers) {
    for (const std::int64_t d : {dims.d_in, dims.d_out}) {
      const std::int64_t count = d * d;
      sync += 4 * (count - (count / 4) + 3 * (count / 4));  // member 0 owns [0, count / 4)
      sync += 8 * 1;  // one double over 4: member 0 owns nothing, sends the element once
    }
  }
  EXPECT_EQ(cost.sent_bytes_per_refresh[0], sync + 3 * 3 * 4 * (64 + 16));
}

TEST(KfacPlacement, ReplicateHoldsEverythingEverywhereAndBroadcastsNothing) {
  const auto plan = plan_state(kLayers, 2, StatePlacement{});
  for (const auto& layer : plan.layers) {
    EXPECT_EQ(layer.owner, 0);
    EXPECT_FALSE(layer.broadcasts_inverses());
    EXPECT_FALSE(layer.broadcasts_gradient(2));
  }
  const auto cost = state_cost(plan, kLayers, 1);
  EXPECT_EQ(cost.memory_bytes[0], cost.memory_bytes[1]);
  EXPECT_EQ(cost.memory_bytes[0], 2 * 4 * (16 + 16 + 16 + 256 + 16 + 16 + 256 + 16));
  EXPECT_DOUBLE_EQ(cost.inversion_flops[1], 2 * (128.0 + 4160.0));
}

TEST(KfacPlacement, PartialShardsAcrossGroupsAndCommOptBroadcastsInverses) {
  const auto partial = plan_state(kLayers, 4, uniform_placement({Placement::kPartial, 2}));
  // Two inverting groups {0, 1} and {2, 3}; each layer's owner is its group's first replica.
  EXPECT_EQ(partial.layers[1].owner, 0);
  EXPECT_EQ(partial.layers[3].owner, 2);
  EXPECT_TRUE(partial.layers[3].holds_factors(3));
  EXPECT_EQ(partial.layers[3].gradient_broadcast_group(4), (std::vector<int>{0, 1, 2}));
  const auto cost = state_cost(partial, kLayers, 1);
  EXPECT_EQ(cost.memory_bytes[0], cost.memory_bytes[1]);

  // kfac-pytorch's COMM-OPT: factors sharded, inverses everywhere by broadcast.
  const StatePlacement comm_opt{{Placement::kShard, 0}, {Placement::kReplicate, 0}};
  const auto plan = plan_state(kLayers, 4, comm_opt);
  EXPECT_TRUE(plan.layers[0].broadcasts_inverses());
  EXPECT_FALSE(plan.layers[0].broadcasts_gradient(4));
  EXPECT_EQ(plan.layers[0].inverse_broadcast_group(), (std::vector<int>{0, 1, 2, 3}));
}

TEST(KfacPlacement, MemoryFallsAsTheStateIsSharded) {
  std::vector<LinearDims> layers;
  for (int i = 0; i < 4; ++i) {
    for (const LinearDims dims : {LinearDims{64, 64}, LinearDims{64, 256}, LinearDims{256, 64}}) {
      layers.push_back(dims);
    }
  }
  const auto replicate = state_cost(plan_state(layers, 8, {}), layers, 1);
  const auto partial =
      state_cost(plan_state(layers, 8, uniform_placement({Placement::kPartial, 4})), layers, 1);
  const auto shard =
      state_cost(plan_state(layers, 8, uniform_placement({Placement::kShard, 0})), layers, 1);
  EXPECT_GT(replicate.max_memory_bytes(), partial.max_memory_bytes());
  EXPECT_GT(partial.max_memory_bytes(), shard.max_memory_bytes());
  // Balanced greedy: within one largest layer of the even share.
  const std::int64_t total = replicate.max_memory_bytes();
  EXPECT_LE(shard.max_memory_bytes(), total / 8 + 2 * 4 * (64 * 64 + 256 * 256));
  EXPECT_GT(shard.max_sent_bytes(), replicate.max_sent_bytes());  // gradient broadcasts
}

TEST(KfacPlacement, AutoPicksTheFastestWithinTheBudget) {
  const std::vector<std::vector<LinearDims>> workers = {kLayers};
  PlacementMachine fast_link;
  fast_link.link_bandwidth = 1e15;
  fast_link.link_latency_s = 0.0;
  fast_link.inversion_flops = 1e3;  // inversions dominate: spread them
  const auto spread = choose_state_placement(workers, 4, 1, fast_link);
  EXPECT_EQ(spread.chosen.factors.placement, Placement::kShard);
  // replicate, partial:2, shard for factors, inverses nested: 3 + 2 + 1 candidates.
  EXPECT_EQ(spread.candidates.size(), 6U);

  PlacementMachine slow_link;
  slow_link.link_bandwidth = 1.0;
  slow_link.inversion_flops = 1e15;  // communication dominates: broadcast nothing
  const auto local = choose_state_placement(workers, 4, 1, slow_link);
  EXPECT_EQ(local.chosen, StatePlacement{});

  slow_link.memory_budget_bytes = 2 * 4 * (16 + 256) + 1;  // only the fully sharded state fits
  const auto tight = choose_state_placement(workers, 4, 1, slow_link);
  EXPECT_EQ(tight.chosen, uniform_placement({Placement::kShard, 0}));
  EXPECT_THROW(choose_state_placement(workers, 4, 1, PlacementMachine{0.0, 0.0, 1.0, 0.0}),
               std::invalid_argument);
}

}  // namespace
}  // namespace pf::kfac
