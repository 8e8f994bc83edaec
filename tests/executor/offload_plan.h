#pragma once
// Shared by the device offload tests (test_device_offload on the CPU backend, test_executor_cuda
// on a GPU): a PipeFisher schedule of the device tests' BERT and the same schedule with the
// offload pass's copies, priced with each Linear's K-FAC state at its real size.
#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kfac/state_placement.h"
#include "runtime/model/bert_config.h"
#include "scheduler/compile.h"
#include "scheduler/pipefisher/offload_pass.h"
#include "scheduler/pipefisher/pass.h"
#include "sim/uniform_cost_model.h"

namespace pf::exec::testing {

// Uniform times; each Linear's K-FAC state at its real size (fp32 A, B, A^-1, B^-1), so that the
// plan's offloaded bytes are what the workers stop holding.
class SizedCosts final : public sim::CostModel {
 public:
  SizedCosts(const model::BertConfig& config, sim::UniformCosts costs)
      : config_(config), uniform_(costs) {}
  double duration(const sched::Schedule& s, int w, const sched::Instruction& in) const override {
    return uniform_.duration(s, w, in);
  }
  double activation_bytes(const sched::Schedule& s, int p, int c) const override {
    return uniform_.activation_bytes(s, p, c);
  }
  double static_bytes(const sched::Schedule& s, int p, int c) const override {
    return uniform_.static_bytes(s, p, c);
  }
  double kfac_bytes(const sched::Schedule&, int, sched::LinearKind linear) const override {
    const double h = static_cast<double>(config_.hidden_size);
    const double i = static_cast<double>(config_.intermediate_size);
    const double d_in = linear == sched::LinearKind::kFfnOut ? i : h;
    const double d_out = linear == sched::LinearKind::kFfnIn ? i : h;
    return 2.0 * 4.0 * (d_in * d_in + d_out * d_out);
  }
  double kfac_sum_bytes(const sched::Schedule&, int, sched::LinearKind linear,
                        bool a_factor) const override {
    const double h = static_cast<double>(config_.hidden_size);
    const double i = static_cast<double>(config_.intermediate_size);
    const bool wide =
        a_factor ? linear == sched::LinearKind::kFfnOut : linear == sched::LinearKind::kFfnIn;
    return 4.0 * (wide ? i * i : h * h);
  }

 private:
  model::BertConfig config_;
  sim::UniformCostModel uniform_;
};

inline sim::UniformCosts offload_unit_costs(bool long_tasks) {
  sim::UniformCosts costs{.forward_s = 1.0, .backward_s = 2.0, .communication_s = 0.05};
  costs.curvature_a_s = costs.curvature_b_s = long_tasks ? 0.7 : 0.05;
  costs.invert_a_s = costs.invert_b_s = long_tasks ? 3.0 : 0.2;
  costs.precondition_s = long_tasks ? 1.5 : 0.02;
  costs.curvature_sync_s = 0.05;
  costs.static_bytes = 1e4;
  costs.activation_bytes = 1e3;
  costs.host_bandwidth = 1e8;
  return costs;
}

// How the refresh runs: PipeFisher's (inside its window), or pipelined (--kfac-pipelined-refresh
// on: inverses serve from the next window, and part of a refresh's work runs there): whole
// inversions run in the next window (k = 2 of 4-worker 1F1B, the plain refresh needs 3), chains
// of pieces begun in their own window and ended in the next, or (Chimera) curvature syncs and
// the inversions after them there.
enum class Refresh { kPlain, kPipelinedWhole, kPipelinedChains, kPipelinedSyncs };

struct OffloadCase {
  std::string name;
  sched::ScheduleKind kind;
  int workers;
  int data_parallel;
  int refresh_steps;
  bool long_tasks;
  pipefisher::OffloadMode mode;
  float running_average = 0.0F;         // of the K-FAC factors (the value must come back to blend)
  kfac::StatePlacement placement = {};  // across the data-parallel replicas (--kfac-sharding)
  Refresh refresh = Refresh::kPlain;
  // auto's budget: the memory without K-FAC and this share of one worker's K-FAC state.
  double auto_state_share = 0.5;
};

// The Linears' dimensions of `config` per kind (KfacOptions::linear_dims).
inline std::vector<kfac::LinearDims> linear_dims_of(const model::BertConfig& config) {
  return pipefisher::encoder_linear_dims(config.hidden_size, config.intermediate_size);
}

struct Plans {
  sched::Schedule without, with;
  pipefisher::OffloadPlan plan;
};

// Host offload on 4-worker 1F1B with a pipelined refresh whose chains of inversion pieces run
// on into the next window (the case the training and checkpoint tests run end to end).
inline OffloadCase pipelined_chains_case() {
  return {"OneFOneBPipelinedChainsOfPieces",
          sched::ScheduleKind::kOneFOneB,
          4,
          1,
          0,
          false,
          pipefisher::OffloadMode::kHost,
          0.0F,
          {},
          Refresh::kPipelinedChains};
}

inline Plans plan_offload_run(const OffloadCase& c, const model::BertConfig& config) {
  sched::ScheduleParams params;
  params.kind = c.kind;
  params.workers = c.workers;
  params.microbatches = 4;
  params.num_layers = config.num_layers;
  params.data_parallel = c.data_parallel;
  sim::UniformCosts unit = offload_unit_costs(c.long_tasks);
  pipefisher::KfacOptions kfac;
  kfac.refresh_steps = c.refresh_steps;
  kfac.state_placement = c.placement;
  // Sharded: the broadcasts' payloads and each replica's share come from the Linears' sizes.
  if (!(c.placement == kfac::StatePlacement{})) kfac.linear_dims = linear_dims_of(config);
  if (c.refresh != Refresh::kPlain) {
    kfac.pipelined_refresh = true;
    kfac.split = c.refresh != Refresh::kPipelinedWhole;
    unit.invert_a_s = unit.invert_b_s = 1.0;  // long against the gaps: run in the next window
    if (c.refresh == Refresh::kPipelinedSyncs) {
      unit.curvature_sync_s = 3.0;  // long syncs: the refresh's late work
      unit.invert_a_s = unit.invert_b_s = 0.1;
    }
  }
  const SizedCosts costs(config, unit);
  const auto pass = pipefisher::run_pipefisher(sched::compile(params), costs, kfac);
  double budget = 0.0;
  if (c.mode == pipefisher::OffloadMode::kAuto) {
    // Room for the memory without K-FAC and about half of one worker's K-FAC state.
    double other = 0.0, state = 0.0;
    for (const auto& w : pass.before.workers) other = std::max(other, w.peak_memory_bytes);
    for (const auto& w : pass.after.workers) state = std::max(state, w.peak_memory_bytes - other);
    budget = other + c.auto_state_share * state;
  }
  auto offload = pipefisher::run_offload_pass(pass, costs, {c.mode, budget, {}});
  return {pass.schedule, std::move(offload.schedule), std::move(offload.plan)};
}

// Whether a pipelined refresh's plan runs work in the next window (sched::is_wrapped), and how
// much of it continues a chain of pieces begun in its own window or is a curvature sync.
struct WrappedWork {
  int instructions = 0, continued = 0, syncs = 0;
};
inline WrappedWork wrapped_work(const sched::Schedule& schedule) {
  WrappedWork work;
  for (const auto& stream : schedule.streams) {
    for (const auto& in : stream) {
      if (!sched::is_wrapped(in) || sched::is_kfac_transfer(in.kind)) continue;
      ++work.instructions;
      work.continued += in.piece_begin > 0 ? 1 : 0;
      work.syncs += in.kind == sched::OpKind::kCurvatureSync ? 1 : 0;
    }
  }
  return work;
}

// What each rank (replica x workers + worker) holds of the offloaded Linears' state, by the
// placement across the data-parallel replicas (kfac::plan_state over each worker's Linears in
// the executor's order): `state`, the factors' values and inverses where it holds them (a
// replica holding the inverses without the factors: the inverses); `host`, with offload, also
// the inverses a refresh replaced (factor holders 1.5x their state, the others 2x). A Linear
// offloaded factors only moves its factors' values alone, on the factor holders: `state` and
// `host` are those values (its inverses stay on the device).
// `sums`: the factor sums of the offloaded Linears whose factors it holds (one of each factor),
// which the executor takes back from a device layer at their write-back (the CUDA layer would
// keep their buffer for the next accumulation; the CPU backend's frees them at the finalize).
struct RankState {
  std::int64_t state = 0, host = 0, sums = 0;
};
inline std::vector<RankState> offloaded_state_per_rank(const OffloadCase& c, const Plans& plans,
                                                       const model::BertConfig& config) {
  const auto dims = linear_dims_of(config);
  std::vector<RankState> ranks(static_cast<std::size_t>(c.workers * c.data_parallel));
  for (int w = 0; w < c.workers; ++w) {
    std::set<std::tuple<int, int, int>> linears;  // pipeline, layer, linear: the executor's order
    for (const auto& in : plans.with.streams[static_cast<std::size_t>(w)]) {
      if (sched::is_kfac(in.kind)) {
        linears.insert({in.pipeline, in.layer, static_cast<int>(in.linear)});
      }
    }
    std::vector<kfac::LinearDims> held;
    for (const auto& [pipeline, layer, linear] : linears) {
      held.push_back(dims[static_cast<std::size_t>(linear)]);
    }
    const auto plan = kfac::plan_state(held, c.data_parallel, c.placement);
    std::size_t i = 0;
    for (const auto& [pipeline, layer, linear] : linears) {
      const auto& placed = plan.layers[i];
      const auto& d = held[i++];
      const auto& worker_plan = plans.plan.workers[static_cast<std::size_t>(w)];
      const auto listed = [&](const std::vector<pipefisher::LinearState>& states) {
        return std::any_of(states.begin(), states.end(), [&](const auto& state) {
          return state.pipeline == pipeline && state.layer == layer &&
                 static_cast<int>(state.linear) == linear;
        });
      };
      const bool whole = listed(worker_plan.offloaded);
      const bool factors_only = listed(worker_plan.factors_only);
      if (!whole && !factors_only) continue;
      const std::int64_t set = 4 * (d.d_in * d.d_in + d.d_out * d.d_out);  // one of each factor
      for (int r = 0; r < c.data_parallel; ++r) {
        auto& rank = ranks[static_cast<std::size_t>(r * c.workers + w)];
        if (factors_only) {
          if (placed.holds_factors(r)) {
            rank.state += set;
            rank.host += set;
            rank.sums += set;
          }
        } else if (placed.holds_factors(r)) {
          rank.state += 2 * set;
          rank.host += 3 * set;
          rank.sums += set;
        } else if (placed.holds_inverses(r)) {
          rank.state += set;
          rank.host += 2 * set;
        }
      }
    }
  }
  return ranks;
}

}  // namespace pf::exec::testing
