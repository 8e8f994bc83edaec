// The configuration search: enumeration, memory pruning, ranking, the command and bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "scheduler/compile.h"
#include "sim/config_search.h"
#include "sim/parallel_cost_model.h"
#include "sim/search_command.h"
#include "sim/simulator.h"

namespace pf::sim {
namespace {

SearchOptions small_search() {
  SearchOptions o;
  o.model = transformer_preset("gpt3-2.7b");
  o.cluster = cluster_preset("dgx-a100");
  o.gpus = 32;
  o.global_batch = 128;
  o.seq_len = 2048;
  o.precision = Precision::kFp16;
  o.simulate_top = 8;
  return o;
}

TEST(ConfigSearch, RanksWhatFitsAndCountsTheRest) {
  const SearchOptions o = small_search();
  const SearchResult r = search_configurations(o);
  ASSERT_FALSE(r.ranked.empty());
  EXPECT_EQ(r.enumerated, r.invalid + r.out_of_memory + static_cast<long>(r.ranked.size()));
  EXPECT_GT(r.out_of_memory, 0);  // no recomputation at b = 8 and t = 1 does not fit
  EXPECT_EQ(r.simulated, 8);
  for (std::size_t i = 0; i < r.ranked.size(); ++i) {
    const Candidate& c = r.ranked[i];
    EXPECT_EQ(c.tensor_parallel * c.stages * c.data_parallel, o.gpus);
    EXPECT_EQ(c.micro_batch_size * c.microbatches * c.data_parallel, o.global_batch);
    EXPECT_LE(c.peak_memory_bytes, o.cluster.gpu_memory_bytes);
    if (i > 0 && c.simulated) {
      EXPECT_GE(c.step_time_s, r.ranked[i - 1].step_time_s);
    }
  }
  // The simulated ones come first, and their closed-form estimates are close to the engine's.
  for (int i = 0; i < 8 && i < static_cast<int>(r.ranked.size()); ++i) {
    const Candidate& c = r.ranked[static_cast<std::size_t>(i)];
    if (!c.simulated) continue;
    EXPECT_NEAR(c.estimate_s / c.step_time_s, 1.0, 0.15) << c.schedule_name();
    EXPECT_NEAR(c.memory_estimate_bytes / c.peak_memory_bytes, 1.0, 0.15) << c.schedule_name();
  }
  // The best keeps tensor parallelism inside a node.
  EXPECT_LE(r.ranked[0].tensor_parallel, o.cluster.gpus_per_node);
}

TEST(ConfigSearch, TensorParallelismStaysInsideANode) {
  // Crossing nodes with t = 16 pays the network on every layer: slower than t = 8 with the
  // same p and d replaced by pipeline stages.
  SearchOptions o = small_search();
  o.model = transformer_preset("megatron-18.4b");
  o.gpus = 64;
  o.global_batch = 256;
  o.kinds = {sched::ScheduleKind::kOneFOneB};
  o.recompute = {Recompute::kFull};
  o.micro_batch_sizes = {1};
  o.tensor_parallel = {8, 16};
  o.simulate_top = 100;
  const SearchResult r = search_configurations(o);
  ASSERT_FALSE(r.ranked.empty());
  EXPECT_EQ(r.ranked[0].tensor_parallel, 8);
  double best16 = 1e30, best8 = 1e30;
  for (const Candidate& c : r.ranked) {
    (c.tensor_parallel == 16 ? best16 : best8) =
        std::min(c.tensor_parallel == 16 ? best16 : best8, c.step_time_s);
  }
  EXPECT_GT(best16, 1.2 * best8);
}

TEST(ConfigSearch, InterleavingHelpsAtSmallBatch) {
  // m = p (small batch): the 1F1B bubble (p - 1) / (m + p - 1) is large, interleaving shrinks it.
  const ParallelWorkload w = [] {
    ParallelWorkload x;
    x.model = transformer_preset("megatron-39.1b");
    x.precision = Precision::kFp16;
    x.tensor_parallel = 8;
    x.recompute = Recompute::kFull;
    return x;
  }();
  const ParallelCostModel model(w, cluster_preset("dgx-a100"));
  sched::ScheduleParams params;
  params.workers = 8;
  params.microbatches = 8;
  params.num_layers = 48;
  params.data_parallel = 4;
  params.kind = sched::ScheduleKind::kOneFOneB;
  const double one_f_one_b = simulate(sched::compile(params), model).step_time_s;
  params.kind = sched::ScheduleKind::kInterleaved;
  params.chunks_per_worker = 2;
  const double interleaved = simulate(sched::compile(params), model).step_time_s;
  EXPECT_LT(interleaved, 0.9 * one_f_one_b);
  // ... and helps less at a large batch.
  params.microbatches = 64;
  const double interleaved_large = simulate(sched::compile(params), model).step_time_s;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.chunks_per_worker = 1;
  const double one_f_one_b_large = simulate(sched::compile(params), model).step_time_s;
  EXPECT_GT(interleaved_large / one_f_one_b_large, interleaved / one_f_one_b);
}

TEST(ConfigSearch, KfacRunsThePassOnTheBest) {
  SearchOptions o = small_search();
  o.model = transformer_preset("gpt3-760m");
  o.gpus = 16;
  o.global_batch = 64;
  o.seq_len = 1024;
  o.simulate_top = 4;
  o.kfac = pipefisher::KfacOptions{};
  o.kfac_top = 2;
  const SearchResult r = search_configurations(o);
  ASSERT_GE(r.ranked.size(), 2U);
  int with_kfac = 0;
  for (const Candidate& c : r.ranked) {
    if (!c.kfac_run) continue;
    ++with_kfac;
    EXPECT_GE(c.utilization_after, c.utilization_before);
    EXPECT_GE(c.refresh_steps, 1);
    EXPECT_GE(c.formula_refresh_steps, 1);
  }
  EXPECT_EQ(with_kfac, 2);
  EXPECT_TRUE(r.ranked[0].kfac_run);
  const nlohmann::json json = search_json(o, r, 5);
  EXPECT_TRUE(json["candidates"][0].contains("kfac"));
}

TEST(ConfigSearch, ShardedKfacStateFitsWhatReplicatedCannot) {
  // GPT-3 13B in 4 stages of 10 layers on 8 replicas of an A100 with 120 GiB: the weights and
  // Adam state with activations take ~53 GiB, and every replica accumulates the factor sums of
  // its 10 layers during a refresh (41 GiB, half the 82 GiB of factors and inverses), whatever
  // the placement. Replicated, the state on top does not fit (53 + 82 + 41 = 176 GiB); sharded
  // over the 8 replicas (an eighth plus one Linear's, ~14 GiB: 108 GiB) it does. (An 80 GB GPU
  // fitted the sharded state before the search counted the sums; now nothing fits there.)
  SearchOptions o = small_search();
  o.model = transformer_preset("gpt3-13b");
  o.cluster.gpu_memory_bytes = 120.0 * 1024 * 1024 * 1024;
  o.gpus = 32;
  o.global_batch = 32;
  o.tensor_parallel = {1};
  o.pipeline_stages = {4};
  o.micro_batch_sizes = {1};
  o.kinds = {sched::ScheduleKind::kOneFOneB};
  o.recompute = {Recompute::kFull};
  o.zero_stages = {0};
  o.optimizer_offload = {Offload::kNone};
  o.kfac = pipefisher::KfacOptions{};
  o.kfac_top = 1;
  o.kfac_placements = parse_kfac_placements("replicate,shard");
  const SearchResult r = search_configurations(o);
  EXPECT_EQ(r.enumerated, 2);
  EXPECT_EQ(r.out_of_memory, 1);
  EXPECT_EQ(r.kfac_out_of_memory, 1);
  ASSERT_EQ(r.ranked.size(), 1U);
  const Candidate& c = r.ranked[0];
  EXPECT_EQ(kfac::to_string(c.kfac_placement), "shard");
  // Every Linear's sums (the size of its factors, half its state), sharded or not.
  EXPECT_NEAR(c.kfac_factor_sum_bytes, c.kfac_replicated_bytes / 2.0, 1.0);
  EXPECT_GT(
      c.kfac_replicated_bytes + c.peak_memory_bytes - c.kfac_memory_bytes + c.kfac_factor_sum_bytes,
      o.cluster.gpu_memory_bytes);
  EXPECT_LT(c.kfac_memory_bytes - c.kfac_factor_sum_bytes, c.kfac_replicated_bytes / 4.0);
  ASSERT_TRUE(c.kfac_run);
  EXPECT_LE(c.kfac_peak_memory_bytes, o.cluster.gpu_memory_bytes);
  EXPECT_GT(c.kfac_gradient_bytes_per_step, 0.0);
  // The pass ran on the sharded placement: its after-peak holds the busiest replica's share.
  EXPECT_LE(c.kfac_peak_memory_bytes, c.peak_memory_bytes + 1.0);
  const nlohmann::json json = search_json(o, r, 5);
  EXPECT_EQ(json["kfac_out_of_memory"], 1);
  EXPECT_EQ(json["candidates"][0]["kfac_state"]["placement"], "shard");
  // Only replication offered: nothing fits.
  o.kfac_placements = parse_kfac_placements("replicate");
  EXPECT_TRUE(search_configurations(o).ranked.empty());
  // On an 80 GB A100 neither does: the sums alone (41 GiB) leave too little room beside ~53 GiB.
  o.cluster = cluster_preset("dgx-a100");
  o.kfac_placements = parse_kfac_placements("replicate,shard");
  const SearchResult small = search_configurations(o);
  EXPECT_TRUE(small.ranked.empty());
  EXPECT_EQ(small.kfac_out_of_memory, 2);
  // The default menu for d = 8, and the list syntax.
  std::vector<std::string> names;
  for (const auto& placement : default_kfac_placements(8))
    names.push_back(kfac::to_string(placement));
  EXPECT_EQ(names, (std::vector<std::string>{"replicate", "factors=shard,inverses=replicate",
                                             "partial:2", "partial:4", "shard"}));
  EXPECT_EQ(kfac::to_string(parse_kfac_placements("factors=shard,inverses=partial:4,shard")[0]),
            "factors=shard,inverses=partial:4");
  EXPECT_THROW((void)parse_kfac_placements("factors=shard"), std::invalid_argument);
  EXPECT_THROW((void)parse_kfac_placements("auto"), std::invalid_argument);
  try {
    (void)parse_kfac_placements("replicate,,shard");
    ADD_FAILURE() << "an empty item was accepted";
  } catch (const std::invalid_argument& error) {
    EXPECT_STREQ(error.what(), "--kfac-sharding 'replicate,,shard': item 2 is empty");
  }
}

// GPT-3 6.7B, 1F1B in 4 stages, micro-batch 1, full recomputation, on 32
// GPUs of `gpu_gib` (8 replicas), with K-FAC: the K-FAC offload cases' search. Per GPU ~29 GiB
// without K-FAC (28.7 simulated); the 8 layers' replicated K-FAC state 42 GiB and the factor
// sums a refresh accumulates on the device 21 GiB (both sums of every Linear, in every
// placement and offload mode).
SearchOptions gpt3_6p7b_kfac_search(double gpu_gib) {
  SearchOptions o = small_search();
  o.model = transformer_preset("gpt3-6.7b");
  o.cluster.gpu_memory_bytes = gpu_gib * 1024 * 1024 * 1024;
  o.gpus = 32;
  o.global_batch = 32;
  o.tensor_parallel = {1};
  o.pipeline_stages = {4};
  o.micro_batch_sizes = {1};
  o.kinds = {sched::ScheduleKind::kOneFOneB};
  o.recompute = {Recompute::kFull};
  o.zero_stages = {0};
  o.optimizer_offload = {Offload::kNone};
  o.kfac = pipefisher::KfacOptions{};
  return o;
}

TEST(ConfigSearch, KfacOffloadPlacesItsCopiesAndFitsWhatTheDeviceCannot) {
  // GPT-3 6.7B in 4 stages on 8 replicas of an 80 GiB GPU: weights, Adam state and activations
  // take ~29 GiB, the replicated K-FAC state of 8 layers 42 GiB and its factor sums 21 GiB more
  // (92 GiB). In host memory (auto: the largest Linears until the simulated peak fits) it fits,
  // and the excess (~12 GiB) is less than the factors (21 GiB): the factors of some Linears
  // suffice. The offload pass's copies run on each GPU's host link.
  SearchOptions o = gpt3_6p7b_kfac_search(80);
  o.kfac_top = 1;
  o.kfac_placements = parse_kfac_placements("replicate");
  EXPECT_TRUE(search_configurations(o).ranked.empty());  // on the device it does not fit
  o.kfac_offload = pipefisher::OffloadMode::kAuto;
  const SearchResult r = search_configurations(o);
  ASSERT_EQ(r.ranked.size(), 1U);
  const Candidate& c = r.ranked[0];
  EXPECT_TRUE(c.kfac_offloaded);
  ASSERT_TRUE(c.kfac_run);
  EXPECT_GT(c.kfac_offloaded_linears, 0);
  EXPECT_LT(c.kfac_offloaded_linears, 4 * 8 * 6);  // auto: not every Linear
  EXPECT_GT(c.kfac_peak_before_offload_bytes, o.cluster.gpu_memory_bytes);
  EXPECT_LE(c.kfac_peak_memory_bytes, o.cluster.gpu_memory_bytes);
  EXPECT_GT(c.kfac_host_link_s_per_refresh, 0.0);
  // auto offloads factors first (docs/offload.md): enough here, no Linear whole.
  EXPECT_EQ(c.kfac_factors_only_linears, c.kfac_offloaded_linears);
  EXPECT_EQ(c.kfac_state_name(), "replicate+factors");
  const nlohmann::json json = search_json(o, r, 1);
  EXPECT_EQ(json["candidates"][0]["kfac_state"]["offload"], "auto");
  EXPECT_GT(json["candidates"][0]["kfac_state"]["offloaded_linears"].get<int>(), 0);
  o.kfac_offload = pipefisher::OffloadMode::kAuto;
  // Offload needs K-FAC.
  o.kfac.reset();
  EXPECT_THROW((void)search_configurations(o), std::invalid_argument);
  o.kfac_offload = pipefisher::OffloadMode::kFactors;
  EXPECT_THROW((void)search_configurations(o), std::invalid_argument);
}

TEST(ConfigSearch, FactorsOnlyOffloadFitsWhatTheDeviceCannotAndMovesLessThanWholeOffload) {
  // The same search: the replicated K-FAC state and its sums (29 + 42 + 21 = 92 GiB) do not fit
  // an 80 GiB GPU on the device. With every Linear's factors in host memory (its inverses, half
  // the state, on the device) it fits (the closed form: 29 + 21 inverses + 21 sums + the largest
  // Linear's factors, 72 GiB), and moves the factors only around their inversions, so the step
  // takes less than with every Linear offloaded whole (which brings each step's inverses in).
  SearchOptions o = gpt3_6p7b_kfac_search(80);
  o.kfac_top = 1;
  o.kfac_placements = parse_kfac_placements("replicate");
  EXPECT_TRUE(search_configurations(o).ranked.empty());
  o.kfac_offload = pipefisher::OffloadMode::kFactors;
  const SearchResult factors = search_configurations(o);
  ASSERT_EQ(factors.ranked.size(), 1U);
  const Candidate& f = factors.ranked[0];
  ASSERT_TRUE(f.kfac_run);
  EXPECT_EQ(f.kfac_state_name(), "replicate+factors");
  EXPECT_TRUE(f.kfac_estimate_factors);
  EXPECT_FALSE(f.kfac_estimate_whole);
  EXPECT_EQ(f.kfac_offloaded_linears, 4 * 8 * 6);  // every Linear: 4 stages of 8 layers
  EXPECT_EQ(f.kfac_factors_only_linears, f.kfac_offloaded_linears);
  EXPECT_GT(f.kfac_peak_before_offload_bytes, o.cluster.gpu_memory_bytes);
  EXPECT_LE(f.kfac_peak_memory_bytes, o.cluster.gpu_memory_bytes);
  // The closed form holds every inverse beside every sum, as a refresh in the steady state does
  // (the previous refresh's inverses precondition while the sums accumulate), and the largest
  // Linear's factors; so does the simulated window (a factors-only Linear's inverses from its
  // first K-FAC work on), whose copies may hold two Linears' factors at once: within 3%.
  EXPECT_NEAR(f.kfac_peak_memory_bytes / f.memory_estimate_bytes, 1.0, 0.03);
  // Per step the factors in and out once per refresh: (state / 2) 2 / k of the replicated
  // state (42 GiB), no inverses per step.
  EXPECT_NEAR(f.kfac_host_bytes_per_step,
              f.kfac_replicated_bytes / 2.0 * 2.0 / o.kfac->max_refresh_steps, 1.0);
  // The device keeps the inverses (half the state), the largest Linear's factors and the sums.
  EXPECT_NEAR(f.kfac_factor_sum_bytes, f.kfac_replicated_bytes / 2.0, 1.0);
  EXPECT_GT(f.kfac_memory_bytes - f.kfac_factor_sum_bytes, f.kfac_replicated_bytes / 2.0);
  EXPECT_LT(f.kfac_memory_bytes - f.kfac_factor_sum_bytes, 0.6 * f.kfac_replicated_bytes);
  const nlohmann::json json = search_json(o, factors, 1);
  EXPECT_EQ(json["candidates"][0]["kfac_state"]["placement"], "replicate+factors");
  EXPECT_EQ(json["candidates"][0]["kfac_state"]["offload"], "factors");
  EXPECT_EQ(json["candidates"][0]["kfac_state"]["factors_only_linears"].get<int>(),
            f.kfac_offloaded_linears);

  o.kfac_offload = pipefisher::OffloadMode::kHost;
  const SearchResult whole = search_configurations(o);
  ASSERT_EQ(whole.ranked.size(), 1U);
  const Candidate& h = whole.ranked[0];
  ASSERT_TRUE(h.kfac_run);
  EXPECT_EQ(h.kfac_state_name(), "replicate+offload");
  EXPECT_EQ(h.kfac_factors_only_linears, 0);
  EXPECT_LE(f.kfac_step_time_s, h.kfac_step_time_s);
  EXPECT_LT(f.kfac_host_bytes_per_step, h.kfac_host_bytes_per_step);
  EXPECT_LT(f.kfac_host_link_s_per_refresh, h.kfac_host_link_s_per_refresh);

  // auto goes factors first: on this GPU the factors of some Linears suffice, none whole, and
  // the closed form says so.
  o.kfac_offload = pipefisher::OffloadMode::kAuto;
  const SearchResult automatic = search_configurations(o);
  ASSERT_EQ(automatic.ranked.size(), 1U);
  const Candidate& a = automatic.ranked[0];
  ASSERT_TRUE(a.kfac_run);
  EXPECT_TRUE(a.kfac_estimate_factors);
  EXPECT_FALSE(a.kfac_estimate_whole);
  EXPECT_EQ(a.kfac_factors_only_linears, a.kfac_offloaded_linears);
  EXPECT_EQ(a.kfac_state_name(), "replicate+factors");
  EXPECT_LE(a.kfac_host_bytes_per_step, f.kfac_host_bytes_per_step);

  // On a 64 GiB GPU factors only is not enough (the closed form: 72 GiB): refused; auto moves
  // every Linear's factors and then the largest whole (one Linear's state, the waiting inverses
  // and the sums stay: 61 GiB) and prices both, and so does the offload pass.
  o = gpt3_6p7b_kfac_search(64);
  o.kfac_top = 1;
  o.kfac_placements = parse_kfac_placements("replicate");
  o.kfac_offload = pipefisher::OffloadMode::kFactors;
  EXPECT_TRUE(search_configurations(o).ranked.empty());
  o.kfac_offload = pipefisher::OffloadMode::kAuto;
  const SearchResult mixed = search_configurations(o);
  ASSERT_EQ(mixed.ranked.size(), 1U);
  const Candidate& x = mixed.ranked[0];
  ASSERT_TRUE(x.kfac_run);
  EXPECT_LE(x.kfac_peak_memory_bytes, o.cluster.gpu_memory_bytes);
  EXPECT_EQ(x.kfac_offloaded_linears, 4 * 8 * 6);  // every Linear's factors, ...
  EXPECT_GT(x.kfac_factors_only_linears, 0);       // ... and some whole
  EXPECT_LT(x.kfac_factors_only_linears, x.kfac_offloaded_linears);
  EXPECT_EQ(x.kfac_state_name(), "replicate+factors+offload");
  // More per step than factors only, less than every Linear whole.
  EXPECT_GT(x.kfac_host_bytes_per_step, f.kfac_host_bytes_per_step);
  EXPECT_LT(x.kfac_host_bytes_per_step, h.kfac_host_bytes_per_step);
  EXPECT_TRUE(x.kfac_estimate_factors);
  EXPECT_TRUE(x.kfac_estimate_whole);
}

TEST(ConfigSearch, FactorsOnlyOffloadKeepsTheStepOfTheMicroBatch8Node) {
  // BERT-Large (S = 128) on one DGX H100 node, 1F1B p = 8, micro-batch 8, m = 8: the node case
  // of docs/offload.md (pipefisher_sim's 10.710 ms step, peak 3669.6 MiB with the factor sums;
  // whole Linears 18.586 ms and 3719.6 MiB; factors only 10.710 ms and 3333.6 MiB). Here the
  // busiest worker holds 2.11 GiB without K-FAC, 0.98 GiB of K-FAC state and 0.49 GiB of sums:
  // 3.58 GiB on the device. On a 3.3 GiB GPU the state on the device does not fit, nor whole
  // offload (its inverse traffic raises the simulated peak, 3.63 GiB), but factors only does
  // (the closed form keeps the inverses, the sums and the largest Linear's factors: 3.16 GiB;
  // simulated 3.26 GiB), at the step without offload.
  SearchOptions o = small_search();
  o.model = transformer_preset("bert-large");
  o.cluster = cluster_preset("dgx-h100");
  o.seq_len = 128;
  o.precision = Precision::kBf16;
  o.gpus = 8;
  o.global_batch = 64;
  o.tensor_parallel = {1};
  o.pipeline_stages = {8};
  o.micro_batch_sizes = {8};
  o.kinds = {sched::ScheduleKind::kOneFOneB};
  o.recompute = {Recompute::kNone};
  o.zero_stages = {0};
  o.optimizer_offload = {Offload::kNone};
  o.kfac = pipefisher::KfacOptions{};
  o.kfac_top = 1;
  auto best = [&](pipefisher::OffloadMode mode) {
    o.kfac_offload = mode;
    const SearchResult r = search_configurations(o);
    return r.ranked.empty() || !r.ranked[0].kfac_run ? std::optional<Candidate>{}
                                                     : std::optional<Candidate>{r.ranked[0]};
  };
  const auto none = best(pipefisher::OffloadMode::kNone);
  const auto host = best(pipefisher::OffloadMode::kHost);
  ASSERT_TRUE(none && host);
  o.cluster.gpu_memory_bytes = 3.3 * 1024 * 1024 * 1024;
  EXPECT_FALSE(best(pipefisher::OffloadMode::kNone));
  EXPECT_FALSE(best(pipefisher::OffloadMode::kHost));
  const auto factors = best(pipefisher::OffloadMode::kFactors);
  ASSERT_TRUE(factors);
  EXPECT_EQ(factors->kfac_state_name(), "replicate+factors");
  EXPECT_EQ(factors->kfac_factors_only_linears, 8 * 18);  // every rank's 18 Linears
  EXPECT_LT(factors->kfac_peak_memory_bytes, none->kfac_peak_memory_bytes);
  EXPECT_NEAR(factors->kfac_step_time_s, none->kfac_step_time_s, 1e-9);
  EXPECT_LT(factors->kfac_step_time_s, 0.9 * host->kfac_step_time_s);
  EXPECT_LT(factors->kfac_host_bytes_per_step, host->kfac_host_bytes_per_step / 10.0);
  EXPECT_NEAR(factors->memory_estimate_bytes / factors->kfac_peak_memory_bytes, 1.0, 0.2);
  // auto: the factors of some Linears, none whole.
  const auto automatic = best(pipefisher::OffloadMode::kAuto);
  ASSERT_TRUE(automatic);
  EXPECT_EQ(automatic->kfac_state_name(), "replicate+factors");
  EXPECT_FALSE(automatic->kfac_estimate_whole);
  EXPECT_LE(automatic->kfac_peak_memory_bytes, o.cluster.gpu_memory_bytes);
}

TEST(ConfigSearch, ShardedKfacStateOffloadsAndFitsWhatNeitherAloneDoes) {
  // GPT-3 6.7B in 4 stages on 8 replicas: ~29 GiB without K-FAC, and 21 GiB of factor sums on
  // every replica during a refresh (all Linears' sums accumulate there before the sync). Sharded,
  // the busiest replica holds an eighth of the K-FAC state plus one Linear's (~7 GiB, ~47 GiB
  // simulated with the sums); replicated and offloaded, every replica brings in all its inverses
  // (21 GiB) each step on a host link slower than their preconditioning, so many wait on the
  // device when it starts (~63 GiB simulated). Sharded and offloaded, each replica moves only
  // what it holds: the lowest peak and the fewest bytes on the host link.
  SearchOptions o = gpt3_6p7b_kfac_search(80);
  o.kfac_top = 2;
  o.kfac_placements = parse_kfac_placements("replicate,shard");
  auto by_name = [](const SearchResult& r) {
    std::map<std::string, Candidate> out;
    for (const Candidate& c : r.ranked) out[c.kfac_state_name()] = c;
    return out;
  };
  auto on_device = by_name(search_configurations(o));
  o.kfac_offload = pipefisher::OffloadMode::kHost;
  auto offloaded = by_name(search_configurations(o));
  ASSERT_EQ(on_device.count("shard"), 1U);
  ASSERT_EQ(offloaded.count("shard+offload"), 1U);
  ASSERT_EQ(offloaded.count("replicate+offload"), 1U);
  const Candidate& shard = on_device["shard"];
  const Candidate& both = offloaded["shard+offload"];
  const Candidate& replicated = offloaded["replicate+offload"];
  ASSERT_TRUE(shard.kfac_run && both.kfac_run && replicated.kfac_run);
  EXPECT_TRUE(both.kfac_offloaded);
  EXPECT_EQ(kfac::to_string(both.kfac_placement), "shard");
  // Memory: the closed form keeps one Linear's state on the device, the inverses that arrive
  // before their preconditioning and every sum; the pass's peaks. Replicated it is within 5% of
  // the pass (it was 41% under when it kept one Linear only and counted no sums); sharded it is
  // above, by less than the sums: it keeps every Linear's sums to the refresh's end, while a
  // replica without a Linear's factors drops them at the curvature sync.
  EXPECT_NEAR(replicated.memory_estimate_bytes / replicated.kfac_peak_memory_bytes, 1.0, 0.05);
  EXPECT_GE(both.memory_estimate_bytes, both.kfac_peak_memory_bytes);
  EXPECT_LT(both.memory_estimate_bytes - both.kfac_peak_memory_bytes, both.kfac_factor_sum_bytes);
  EXPECT_GT(replicated.memory_estimate_bytes, both.memory_estimate_bytes + 4.0 * (1 << 30));
  EXPECT_LT(both.kfac_memory_bytes, shard.kfac_memory_bytes);
  EXPECT_LT(both.memory_estimate_bytes, shard.memory_estimate_bytes);
  EXPECT_LE(both.memory_estimate_bytes, replicated.memory_estimate_bytes);
  EXPECT_LT(both.kfac_peak_memory_bytes, shard.kfac_peak_memory_bytes);
  EXPECT_LT(both.kfac_peak_memory_bytes, replicated.kfac_peak_memory_bytes);
  EXPECT_NEAR(both.kfac_peak_before_offload_bytes, shard.kfac_peak_memory_bytes, 1.0);
  // The copies are priced, for the busiest replica: it moves about an eighth of what a
  // replicated one does (plus one Linear's), in the closed form and in the offload pass.
  EXPECT_GT(both.kfac_offloaded_linears, 0);
  EXPECT_GT(both.kfac_host_bytes_per_step, 0.0);
  EXPECT_LT(both.kfac_host_bytes_per_step, replicated.kfac_host_bytes_per_step / 4.0);
  EXPECT_EQ(shard.kfac_host_bytes_per_step, 0.0);
  EXPECT_GT(both.kfac_host_link_s_per_refresh, 0.0);
  EXPECT_LT(both.kfac_host_link_s_per_refresh, replicated.kfac_host_link_s_per_refresh / 4.0);
  EXPECT_GE(both.kfac_step_time_s, shard.kfac_step_time_s);
  // A GPU between the sharded-and-offloaded closed form and the others': only that one fits
  // (the sharded one on the device and the replicated and offloaded one are dropped by the
  // closed form).
  o.cluster.gpu_memory_bytes = (both.memory_estimate_bytes + shard.memory_estimate_bytes) / 2.0;
  ASSERT_LT(o.cluster.gpu_memory_bytes, shard.memory_estimate_bytes);
  ASSERT_LT(o.cluster.gpu_memory_bytes, replicated.memory_estimate_bytes);
  o.kfac_offload = pipefisher::OffloadMode::kNone;
  EXPECT_TRUE(search_configurations(o).ranked.empty());
  o.kfac_offload = pipefisher::OffloadMode::kHost;
  const SearchResult r = search_configurations(o);
  ASSERT_EQ(r.ranked.size(), 1U);
  EXPECT_EQ(r.ranked[0].kfac_state_name(), "shard+offload");
  ASSERT_TRUE(r.ranked[0].kfac_run);
  EXPECT_LE(r.ranked[0].kfac_peak_memory_bytes, o.cluster.gpu_memory_bytes);
  EXPECT_EQ(r.out_of_memory, 1);
  EXPECT_EQ(r.kfac_out_of_memory, 1);
  const nlohmann::json json = search_json(o, r, 1);
  EXPECT_EQ(json["candidates"][0]["kfac_state"]["placement"], "shard+offload");
  EXPECT_EQ(json["candidates"][0]["kfac_state"]["offload"], "host");
  EXPECT_GT(json["candidates"][0]["kfac_state"]["host_bytes_per_step_estimate"].get<double>(), 0.0);
  EXPECT_GT(json["candidates"][0]["kfac_state"]["host_link_seconds_per_refresh"].get<double>(),
            0.0);
}

// The closed form's K-FAC memory (state and factor sums) on top of the simulated peak without
// K-FAC bounds the PipeFisher pass's simulated peak, which counts the sums while they exist:
// for every placement, schedule and configuration the pass runs on here. With the state on the
// device the simulator holds every Linear's sums at once (the inversions wait for the last
// micro-batch's curvature), so replicated the bound is met exactly at the peak. (Offloaded
// state: the threshold tests above.)
TEST(ConfigSearch, ClosedFormKfacMemoryBoundsTheSimulatedPeak) {
  std::vector<SearchOptions> searches;
  for (sched::ScheduleKind kind :
       {sched::ScheduleKind::kGPipe, sched::ScheduleKind::kOneFOneB,
        sched::ScheduleKind::kInterleaved, sched::ScheduleKind::kChimera}) {
    SearchOptions o = small_search();  // GPT-3 760M on 16 GPUs, d up to 16
    o.model = transformer_preset("gpt3-760m");
    o.gpus = 16;
    o.global_batch = 64;
    o.seq_len = 1024;
    o.kinds = {kind};
    o.simulate_top = 4;
    o.kfac = pipefisher::KfacOptions{};
    o.kfac_top = 4;
    o.kfac_placements = parse_kfac_placements("replicate,shard");  // Chimera: replicate only
    searches.push_back(o);
  }
  for (const char* placements : {"replicate,factors=shard,inverses=replicate", "partial:2,shard"}) {
    SearchOptions o = gpt3_6p7b_kfac_search(1000);
    o.kfac_top = 2;
    o.kfac_placements = parse_kfac_placements(placements);
    searches.push_back(o);
  }
  int checked = 0, replicated = 0;
  for (const SearchOptions& o : searches) {
    for (const Candidate& c : search_configurations(o).ranked) {
      if (!c.kfac_run) continue;
      ++checked;
      const std::string name = c.schedule_name() + " p=" + std::to_string(c.stages) +
                               " d=" + std::to_string(c.data_parallel) + " " + c.kfac_state_name();
      EXPECT_GT(c.kfac_factor_sum_bytes, 0.0) << name;
      EXPECT_LE(c.kfac_peak_memory_bytes, c.peak_memory_bytes * (1.0 + 1e-9)) << name;
      if (kfac::to_string(c.kfac_placement) == "replicate") {
        ++replicated;
        EXPECT_NEAR(c.kfac_peak_memory_bytes / c.peak_memory_bytes, 1.0, 1e-6) << name;
      }
    }
  }
  EXPECT_GE(checked, 10);
  EXPECT_GE(replicated, 2);
}

// A configuration that fits with the K-FAC factors and inverses alone is pruned once the
// factor sums push it over the GPU: GPT-3 6.7B (H = 4096), 8 layers per stage, replicated, on
// an 80 GiB GPU: 29 GiB + 42 GiB of state fit, with the 21 GiB of sums they do not.
TEST(ConfigSearch, FactorSumsPruneWhatFitsWithoutThem) {
  SearchOptions o = gpt3_6p7b_kfac_search(1000);
  o.kfac_top = 0;
  o.kfac_placements = parse_kfac_placements("replicate");
  const SearchResult roomy = search_configurations(o);
  ASSERT_EQ(roomy.ranked.size(), 1U);
  const Candidate& c = roomy.ranked[0];
  // Both sums of every Linear (q, k, v and the output projection H x H, the MLP's H x 4H and
  // 4H x H): 4 bytes x H^2 (3 x 2 + 2 + 17 + 17) per layer.
  const double h2 = 4096.0 * 4096.0;
  EXPECT_DOUBLE_EQ(c.kfac_factor_sum_bytes, 8 * 4.0 * h2 * 42.0);
  EXPECT_DOUBLE_EQ(c.kfac_factor_sum_bytes, c.kfac_replicated_bytes / 2.0);
  EXPECT_DOUBLE_EQ(c.kfac_memory_bytes, c.kfac_replicated_bytes + c.kfac_factor_sum_bytes);
  const double gpu = 80.0 * 1024 * 1024 * 1024;
  ASSERT_LE(c.peak_memory_bytes - c.kfac_factor_sum_bytes, gpu);  // fits without the sums
  ASSERT_GT(c.peak_memory_bytes, gpu);
  o.cluster.gpu_memory_bytes = gpu;
  const SearchResult tight = search_configurations(o);
  EXPECT_TRUE(tight.ranked.empty());
  EXPECT_EQ(tight.out_of_memory, 1);
  EXPECT_EQ(tight.kfac_out_of_memory, 1);
  // A pipelined refresh also holds the previous window's set-aside sums: twice as many.
  o.cluster.gpu_memory_bytes = 1000.0 * 1024 * 1024 * 1024;
  o.kfac->pipelined_refresh = true;
  const SearchResult pipelined = search_configurations(o);
  ASSERT_EQ(pipelined.ranked.size(), 1U);
  EXPECT_DOUBLE_EQ(pipelined.ranked[0].kfac_factor_sum_bytes, 2.0 * c.kfac_factor_sum_bytes);
}

TEST(ConfigSearch, ShardingAndOffloadFitWhatReplicationCannot) {
  // An 18.4B model on 32 GPUs without tensor or pipeline parallelism: 16 bytes of replicated
  // state per parameter (294 GB) cannot fit in 80 GB; sharded over the 32 replicas, or with the
  // optimizer state in host memory, it can.
  SearchOptions o = small_search();
  o.model = transformer_preset("megatron-18.4b");
  o.tensor_parallel = {1};
  o.pipeline_stages = {1};
  o.kinds = {sched::ScheduleKind::kOneFOneB};
  o.recompute = {Recompute::kFull};
  o.micro_batch_sizes = {1};
  o.simulate_top = 4;
  o.zero_stages = {0};
  o.optimizer_offload = {Offload::kNone};
  const SearchResult replicated = search_configurations(o);
  EXPECT_EQ(replicated.enumerated, 1);
  EXPECT_TRUE(replicated.ranked.empty());
  EXPECT_EQ(replicated.out_of_memory, 1);

  o.zero_stages = {0, 1, 2, 3};
  o.optimizer_offload = {Offload::kNone, Offload::kHost};
  const SearchResult sharded = search_configurations(o);
  EXPECT_EQ(sharded.enumerated, 8);  // 4 stages x 2 places for the optimizer state
  ASSERT_FALSE(sharded.ranked.empty());
  for (const Candidate& c : sharded.ranked) {
    // What fits shards some state or keeps the optimizer's 12 bytes per parameter on the host.
    EXPECT_TRUE(c.zero_stage >= 1 || c.optimizer_offload != Offload::kNone) << c.state_name();
    EXPECT_LE(c.peak_memory_bytes, o.cluster.gpu_memory_bytes) << c.state_name();
  }
  // ZeRO-3 holds the least: every component split 32 ways.
  double zero3 = 0.0, least = 1e30;
  for (const Candidate& c : sharded.ranked) {
    least = std::min(least, c.peak_memory_bytes);
    if (c.zero_stage == 3 && c.optimizer_offload == Offload::kNone) zero3 = c.peak_memory_bytes;
  }
  EXPECT_GT(zero3, 0.0);
  EXPECT_LE(least, zero3);

  // Without data parallelism there is nothing to shard over: only stage 0 is tried.
  o.gpus = 1;
  o.global_batch = 8;
  o.model = transformer_preset("gpt3-2.7b");
  EXPECT_EQ(search_configurations(o).enumerated, 2);  // stage 0, optimizer on GPU or host
  EXPECT_EQ(zero_sharding(2).gradients, 0);
  EXPECT_EQ(zero_sharding(2).parameters, 1);
  EXPECT_THROW((void)zero_sharding(4), std::invalid_argument);
}

// --attention reaches every candidate's cost model: the fused core stashes no S x S scores, so
// the same configuration needs less memory, and on a GPU between the two peaks only the fused
// search finds it.
TEST(ConfigSearch, FusedAttentionFitsWhatBatchedCannot) {
  SearchOptions o;
  o.model = transformer_preset("gpt2");
  o.cluster = cluster_preset("dgx-h100");
  o.gpus = 1;
  o.global_batch = 16;
  o.seq_len = 1024;
  o.precision = Precision::kBf16;
  o.tensor_parallel = {1};
  o.pipeline_stages = {1};
  o.micro_batch_sizes = {8};
  o.kinds = {sched::ScheduleKind::kOneFOneB};
  o.recompute = {Recompute::kNone};
  o.zero_stages = {0};
  o.optimizer_offload = {Offload::kNone};
  o.simulate_top = 1;
  const SearchResult batched = search_configurations(o);
  o.attention = AttentionAlgorithm::kFused;
  const SearchResult fused = search_configurations(o);
  ASSERT_EQ(batched.ranked.size(), 1U);
  ASSERT_EQ(fused.ranked.size(), 1U);
  const Candidate& b = batched.ranked[0];
  const Candidate& f = fused.ranked[0];
  ASSERT_TRUE(b.simulated && f.simulated);
  // One micro-batch in flight on the single worker: per layer Korthikanti's 5 N' bytes in 16 bits
  // (softmax output, dropout mask and output; N' = b a S^2) out, b a S fp32 log-sum-exps in.
  const double N = 8.0 * 12 * 1024 * 1024;
  EXPECT_NEAR(b.peak_memory_bytes - f.peak_memory_bytes, 12 * (5 * N - 4 * 8.0 * 12 * 1024),
              1e-6 * b.peak_memory_bytes);
  EXPECT_NE(b.step_time_s, f.step_time_s);
  o.cluster.gpu_memory_bytes = (b.peak_memory_bytes + f.peak_memory_bytes) / 2;
  EXPECT_EQ(search_configurations(o).ranked.size(), 1U);
  o.attention = AttentionAlgorithm::kBatched;
  const SearchResult tight = search_configurations(o);
  EXPECT_TRUE(tight.ranked.empty());
  EXPECT_EQ(tight.out_of_memory, 1);
  // Heads the fused kernel cannot run are refused once, naming the limit.
  o.attention = AttentionAlgorithm::kFused;
  o.model.num_heads = o.model.num_kv_heads = 3;  // head_dim 256
  try {
    (void)search_configurations(o);
    ADD_FAILURE() << "head_dim 256 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim <= 128"), std::string::npos) << e.what();
  }
}

TEST(ConfigSearch, CommandTakesTheAttention) {
  cli::SearchCommandOptions o;
  o.model = "gpt2";
  o.gpus = 8;
  o.global_batch = 32;
  o.cluster = "dgx-h100";
  o.simulate_top = 2;
  o.attention = "fused";
  o.out = (testing::TempDir() + "search_fused.json");
  std::ostringstream out;
  ASSERT_EQ(cli::run_search_command(o, out), 0) << out.str();
  EXPECT_NE(out.str().find("bf16, fused attention"), std::string::npos) << out.str();
  std::ifstream written(o.out);
  EXPECT_EQ(nlohmann::json::parse(written).at("attention"), "fused");
  o.attention = "flash";
  try {
    std::ostringstream ignored;
    (void)cli::run_search_command(o, ignored);
    ADD_FAILURE() << "--attention flash was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "--attention 'flash' is not one of batched, fused");
  }
  // The command line refuses it before anything runs, as the main command's --attention does.
  CLI::App app;
  cli::SearchCommandOptions parsed;
  cli::add_search_command(app, parsed);
  const std::vector<const char*> argv = {"pipefisher_sim", "search", "--model",        "gpt2",
                                         "--gpus",         "1",      "--global-batch", "1",
                                         "--attention",    "flash"};
  EXPECT_THROW(app.parse(static_cast<int>(argv.size()), argv.data()), CLI::ValidationError);
}

TEST(ConfigSearch, CommandWritesTableAndJsonAndRejectsBadInput) {
  cli::SearchCommandOptions o;
  o.model = "gpt2";
  o.gpus = 8;
  o.global_batch = 32;
  o.precision = "bf16";
  o.cluster = "dgx-h100";
  o.simulate_top = 4;
  o.out = (testing::TempDir() + "search.json");
  std::ostringstream out;
  ASSERT_EQ(cli::run_search_command(o, out), 0) << out.str();
  EXPECT_NE(out.str().find("rank    t    p    d"), std::string::npos) << out.str();
  auto error_of = [](const cli::SearchCommandOptions& bad) -> std::string {
    std::ostringstream ignored;
    try {
      cli::run_search_command(bad, ignored);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "(no error)";
  };
  cli::SearchCommandOptions bad = o;
  bad.gpus = 100000;
  EXPECT_NE(error_of(bad).find("exceeds cluster 'dgx-h100' (4608 GPUs)"), std::string::npos);
  bad = o;
  bad.schedules = "1f1b,zigzag";
  EXPECT_NE(error_of(bad).find("'zigzag' is not one of"), std::string::npos);
  bad = o;
  bad.micro_batch_sizes = "1,x";
  EXPECT_EQ(error_of(bad), "--micro-batch-sizes '1,x': item 2 'x' is not a positive integer");
  bad = o;
  bad.stages = "2,,4";
  EXPECT_EQ(error_of(bad), "--stages '2,,4': item 2 is empty");
  bad = o;
  bad.tensor_parallel = "1,0";
  EXPECT_EQ(error_of(bad), "--tensor-parallel '1,0': item 2 '0' is not a positive integer");
  bad = o;
  bad.schedules = "1f1b,";
  EXPECT_EQ(error_of(bad), "--schedules '1f1b,': item 2 is empty");
  bad = o;
  bad.zero_stages = "0,4";
  EXPECT_NE(error_of(bad).find("--zero-stages: '4' is not one of 0, 1, 2, 3"), std::string::npos);
  bad = o;
  bad.optimizer_offload = "host";
  EXPECT_NE(error_of(bad).find("--optimizer-offload: 'host' is not one of none, cpu, nvme"),
            std::string::npos);
  bad = o;
  bad.model = "gpt9";
  EXPECT_NE(error_of(bad).find("unknown model 'gpt9'"), std::string::npos);
  // Nothing fits: a 175B model on 8 GPUs.
  cli::SearchCommandOptions huge = o;
  huge.model = "gpt3-175b";
  huge.out.clear();
  std::ostringstream none;
  EXPECT_EQ(cli::run_search_command(huge, none), 1);
  EXPECT_NE(none.str().find("no configuration fits"), std::string::npos);
}

}  // namespace
}  // namespace pf::sim
