#pragma once
// The configuration search behind `pipefisher_sim search`: every way of running a model on N GPUs
// of a cluster with a global batch B (tensor-parallel t, pipeline stages p, data-parallel
// d = N / (t p), schedule GPipe / 1F1B / interleaved with v chunks / Chimera, micro-batch size b,
// m = B / (b d) micro-batches, recomputation none / selective / full, model state replicated or
// sharded over the data-parallel group as ZeRO stage 1, 2 or 3, optimizer state on the GPU or
// offloaded to host memory), priced by the parallel cost model (sim/parallel_cost_model.h),
// pruned by memory and ranked by time per step (ties: the one with less memory).
//
// Two tiers keep thousands of candidates to seconds: every candidate gets a closed-form step time
// and peak memory from the cost model's per-worker durations (below); the best `simulate_top`
// that fit are then compiled and replayed by the event engine, which gives the ranking's step
// time and the exact peak memory (a candidate that turns out not to fit is dropped). With K-FAC
// the best `kfac_top` simulated ones also run the PipeFisher pass.
//
// Closed form, with W_w = forward + backward of one micro-batch through worker w's chunks, c the
// send time of one boundary tensor and R_w, O_w its gradient reductions and optimizer step:
//   GPipe, 1F1B, interleaved: m max_w W_w + (sum_w W_w - max_w W_w) / v + 2 (p v - 1) c
//   Chimera (each worker holds stage w of one pipeline and p-1-w of the other, m / 2 each; the
//   generator runs units of p micro-batches): m max_w W'_w + m / p (p - 2) B_max, W'_w the mean
//   of its two stages' W, B_max the longest backward of one stage,
// plus max_w (R_w + O_w). Peak memory: weights and state plus the activations of the micro-batches
// in flight on worker w: GPipe m, 1F1B min(m, p - w), interleaved min(m v, 2 (p - w - 1) +
// (v - 1) p + 1) chunks, Chimera min(m, p / 2 + 1 + min(w, p - 1 - w)) over its two stages.
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "scheduler/pipefisher/kfac_options.h"
#include "scheduler/pipefisher/offload_planner.h"
#include "scheduler/schedule.h"
#include "sim/cluster.h"
#include "sim/transformer_kernels.h"

namespace pf::sim {

class ParallelCostModel;

struct SearchOptions {
  TransformerSpec model;
  ClusterSpec cluster;
  int gpus = 0;
  int global_batch = 0;
  int seq_len = 2048;
  Precision precision = Precision::kBf16;
  // The attention core every candidate runs (sim/attention_kernels.h): batched products with the
  // scores in memory, or the fused kernel (no S x S tensor stashed, the scores recomputed).
  AttentionAlgorithm attention = AttentionAlgorithm::kBatched;
  std::vector<int> tensor_parallel;  // empty: 1, 2, 4, ... up to 2 x GPUs per node
  std::vector<int> pipeline_stages;  // empty: every p dividing N / t, up to the layers
  std::vector<int> micro_batch_sizes = {1, 2, 4, 8};
  std::vector<sched::ScheduleKind> kinds = {
      sched::ScheduleKind::kGPipe, sched::ScheduleKind::kOneFOneB,
      sched::ScheduleKind::kInterleaved, sched::ScheduleKind::kChimera};
  std::vector<int> interleave_chunks = {2, 4};
  std::vector<Recompute> recompute = {Recompute::kNone, Recompute::kSelective, Recompute::kFull};
  // ZeRO stages (zero_sharding); stages above 0 are tried only with data parallelism (d > 1).
  std::vector<int> zero_stages = {0, 1, 2, 3};
  std::vector<Offload> optimizer_offload = {Offload::kNone, Offload::kHost};
  int simulate_top = 24;
  std::optional<pipefisher::KfacOptions> kfac;  // also run the PipeFisher pass
  int kfac_top = 6;
  // With kfac: the K-FAC state placements over the data-parallel group each candidate is tried
  // with (empty: default_kfac_placements(d)); its state joins the memory the search prunes by.
  std::vector<kfac::StatePlacement> kfac_placements;
  // With kfac: K-FAC state in host memory (docs/offload.md) for every placement, replicated or
  // sharded: host offloads every Linear whole, factors every Linear's factors only, auto what
  // does not fit the GPU (factors first, then whole Linears); the offload pass places
  // the copies on each GPU's host link after the PipeFisher pass (with sharded state each
  // replica moves only what it holds; the estimate and the pass price the busiest replica).
  pipefisher::OffloadMode kfac_offload = pipefisher::OffloadMode::kNone;
  // Throws std::invalid_argument naming the flag.
  void validate() const;
};

struct Candidate {
  int tensor_parallel = 1, stages = 1, data_parallel = 1, micro_batch_size = 1, microbatches = 1;
  sched::ScheduleKind kind = sched::ScheduleKind::kOneFOneB;
  int chunks = 1;  // v
  Recompute recompute = Recompute::kNone;
  int zero_stage = 0;
  Offload optimizer_offload = Offload::kNone;
  double estimate_s = 0.0;             // closed-form step time
  double memory_estimate_bytes = 0.0;  // closed-form peak per GPU
  bool simulated = false;
  double step_time_s = 0.0;  // the engine's (simulated), else the estimate
  double bubble_fraction = 0.0;
  double achieved_tflops_per_gpu = 0.0;
  double mfu = 0.0;
  double peak_memory_bytes = 0.0;
  bool kfac_run = false;
  double utilization_before = 0.0, utilization_after = 0.0;
  double kfac_step_time_s = 0.0;  // per step with K-FAC in the bubbles
  // With --kfac: the K-FAC state's placement, what one GPU of the worst worker holds of it (the
  // busiest replica, bounded as in ParallelCostModel::KfacStateCost) and what it would hold
  // replicated, the traffic one replica sends (ring collectives), and the closed-form time K-FAC
  // adds per step (below).
  kfac::StatePlacement kfac_placement;
  double kfac_memory_bytes = 0.0;
  double kfac_least_memory_bytes = 0.0;  // what must stay on the device (offload: one Linear's)
  // Of both: the factor sums a refresh accumulates, on the device in every placement and
  // offload mode (every Linear's of the worker; twice with a pipelined refresh).
  double kfac_factor_sum_bytes = 0.0;
  double kfac_replicated_bytes = 0.0;
  double kfac_factor_bytes_per_refresh = 0.0;
  double kfac_inverse_bytes_per_refresh = 0.0;
  double kfac_gradient_bytes_per_step = 0.0;
  // Per worker, max(0, precondition + gradient all-gather + (m curvature + sync + inversion +
  // inverse all-gather) / k_max - idle), k_max the pass's cap (or its fixed k), idle the
  // worker's idle time in the closed-form step; the worst worker.
  double kfac_overhead_estimate_s = 0.0;
  // The same without the idle time (the K-FAC work and traffic per step): breaks ties.
  double kfac_load_estimate_s = 0.0;
  double kfac_peak_memory_bytes = 0.0;  // the pass's simulated peak with K-FAC (kfac_run)
  // K-FAC state in host memory (SearchOptions::kfac_offload): the estimate keeps on the device
  // the largest Linear's state (host), the inverses and the largest Linear's factors (factors),
  // or what fits, factors first (auto); the offload pass's figures.
  bool kfac_offloaded = false;
  int kfac_offloaded_linears = 0;     // the pass's, whole and factors only
  int kfac_factors_only_linears = 0;  // of those, factors only
  // The closed form moves some Linears' factors only / some whole (auto: factors first).
  bool kfac_estimate_factors = false, kfac_estimate_whole = false;
  double kfac_host_link_s_per_refresh = 0.0;  // the busiest worker's copies
  // The closed form's bytes the busiest replica of the worst worker moves over its host link per
  // step (per-refresh copies spread over k_max steps).
  double kfac_host_bytes_per_step = 0.0;
  double kfac_peak_before_offload_bytes = 0.0;  // the PipeFisher schedule without offload
  int refresh_steps = 0, refresh_bound = -1;
  // PipeFisher's own analytic refresh period, ceil((N T_kron + T_inv) / bubble) on the worst
  // worker, with its pipeline model's bubble: (p - 1)(T_f + T_b) for GPipe / 1F1B, divided by v
  // for interleaved, m / p (p - 2) T_b for Chimera (c_f = D, c_b = 2D - 2 per unit of D); -1 when
  // there is no bubble.
  int formula_refresh_steps = -1;

  std::string schedule_name() const;  // "1f1b", "interleaved v=2", ...
  std::string state_name() const;     // "zero0", "zero3+cpu", ...
  // kfac::to_string of the placement, and where some of its state moves to host memory
  // "+offload" (whole Linears: "shard+offload"), "+factors" (factors only: "replicate+factors")
  // or "+factors+offload" (some of each, auto).
  std::string kfac_state_name() const;
};

// Model state sharded over the whole data-parallel group as ZeRO stage `stage`: 0 replicates
// everything, 1 shards the optimizer state, 2 also the gradients, 3 also the parameters.
// Throws std::invalid_argument outside [0, 3].
StateSharding zero_sharding(int stage);

// The parallel model's holder counts (KfacStateHolders) of a --kfac-sharding placement:
// replicate 0 (all), shard 1, partial:G G.
KfacStateHolders kfac_state_holders(const kfac::StatePlacement& placement);
// The rank's (d_in, d_out) of each Linear kind, indexed by it (KfacOptions::linear_dims).
std::vector<kfac::LinearDims> kfac_linear_dims(const ParallelCostModel& model);
// The placements `search --kfac` tries by default over d replicas: replicate; the factors
// sharded with the inverses replicated; partial:G for G = 2, 4, ... < d dividing d (at most
// 64); shard. Only replicate where d = 1 or the schedule has two pipelines (Chimera).
std::vector<kfac::StatePlacement> default_kfac_placements(int data_parallel);
// --kfac-sharding of `search`: a comma list of placements (a "factors=X" item joins the
// "inverses=Y" item after it). Throws std::invalid_argument naming the flag.
std::vector<kfac::StatePlacement> parse_kfac_placements(const std::string& list);

struct SearchResult {
  std::vector<Candidate> ranked;  // fitting candidates, best first (simulated ones first)
  long enumerated = 0;     // (t, p, b, kind, v, recompute, ZeRO stage, offload) combinations tried
  long invalid = 0;        // broke a schedule's rules (m < p for 1F1B, ...)
  long out_of_memory = 0;  // pruned by the closed-form or the simulated memory
  long kfac_out_of_memory = 0;  // of those, fitting without K-FAC but not with its state
  long simulated = 0;
  double seconds = 0.0;  // wall time of the search
};

SearchResult search_configurations(const SearchOptions& options);

std::string search_table(const SearchOptions& options, const SearchResult& result, int top);
nlohmann::json search_json(const SearchOptions& options, const SearchResult& result, int top);

}  // namespace pf::sim
