#include "sim/config_search.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <stdexcept>
#include <string_view>
#include <tuple>

#include <nlohmann/json.hpp>

#include "common/comma_list.h"
#include "scheduler/compile.h"
#include "scheduler/generators.h"
#include "scheduler/pipefisher/offload_pass.h"
#include "scheduler/pipefisher/pass.h"
#include "scheduler/placement.h"
#include "sim/parallel_cost_model.h"
#include "sim/simulator.h"

namespace pf::sim {
namespace {

using sched::OpKind;
using sched::ScheduleKind;

constexpr int kKfacRunsPerConfiguration = 2;

std::string text(const char* pattern, double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), pattern, value);
  return buffer;
}

std::string pad(std::string s, std::size_t width) {
  if (s.size() < width) s.insert(0, width - s.size(), ' ');
  return s;
}

sched::ScheduleParams params_of(const Candidate& c, int layers) {
  sched::ScheduleParams params;
  params.kind = c.kind;
  params.workers = c.stages;
  params.microbatches = c.microbatches;
  params.chunks_per_worker = c.chunks;
  params.num_layers = layers;
  params.data_parallel = c.data_parallel;
  return params;
}

// The placement of a schedule without its streams: what the cost model needs for durations.
sched::Schedule placement_only(const sched::ScheduleParams& params) {
  sched::Schedule schedule;
  schedule.params = params;
  schedule.placement = sched::make_placement(params);
  schedule.streams.resize(static_cast<std::size_t>(params.workers));
  return schedule;
}

double seconds_of(const ParallelCostModel& model, const sched::Schedule& s, int worker, OpKind kind,
                  int pipeline, int chunk) {
  sched::Instruction in;
  in.kind = kind;
  in.pipeline = static_cast<std::int8_t>(pipeline);
  in.chunk = chunk;
  return model.duration(s, worker, in);
}

// Per worker of a candidate's closed form: one micro-batch's work (W_w) and peak memory.
struct WorkerEstimate {
  double work = 0.0;
  double peak = 0.0;
};

// Closed-form step time and peak memory (config_search.h).
std::vector<WorkerEstimate> estimate(const ParallelCostModel& model, const SearchOptions& options,
                                     Candidate& c) {
  const sched::Schedule s = placement_only(params_of(c, options.model.num_layers));
  const int p = c.stages, m = c.microbatches, v = c.chunks;
  const auto by_worker = sched::chunks_by_worker(s.placement, p);
  std::vector<double> work(static_cast<std::size_t>(p), 0.0);
  std::vector<WorkerEstimate> workers(static_cast<std::size_t>(p));
  double tail = 0.0, peak = 0.0, chimera_backward = 0.0;
  const bool chimera = c.kind == ScheduleKind::kChimera;
  for (int w = 0; w < p; ++w) {
    double reductions = 0.0, fixed = 0.0, in_flight = 0.0;
    const auto& chunks = by_worker[static_cast<std::size_t>(w)];
    for (const sched::ChunkRef& ref : chunks) {
      const double backward = seconds_of(model, s, w, OpKind::kBackward, ref.pipeline, ref.chunk);
      const double fb =
          seconds_of(model, s, w, OpKind::kForward, ref.pipeline, ref.chunk) + backward;
      work[static_cast<std::size_t>(w)] += chimera ? fb / 2.0 : fb;
      if (chimera) chimera_backward = std::max(chimera_backward, backward);
      if (c.data_parallel > 1) {
        reductions +=
            seconds_of(model, s, w, OpKind::kReduceGradDataParallel, ref.pipeline, ref.chunk);
      }
      if (chimera) {
        reductions +=
            seconds_of(model, s, w, OpKind::kReduceGradPipelines, ref.pipeline, ref.chunk);
      }
      fixed += model.static_bytes(s, ref.pipeline, ref.chunk);
      const double act = model.activation_bytes(s, ref.pipeline, ref.chunk);
      double stash = 0.0;
      switch (c.kind) {
        case ScheduleKind::kGPipe:
          stash = m;
          break;
        case ScheduleKind::kOneFOneB:
          stash = std::min(m, p - w);
          break;
        case ScheduleKind::kInterleaved:
          stash = std::min(double{1.0} * m * v, 2.0 * (p - w - 1) + (v - 1.0) * p + 1.0) / v;
          break;
        case ScheduleKind::kChimera:
          // Both pipelines together: p / 2 + 1 + min(w, p - 1 - w), half on each stage.
          stash = std::min(double{1.0} * m, p / 2.0 + 1.0 + std::min(w, p - 1 - w)) / 2.0;
          break;
        default:
          stash = m;
      }
      in_flight += stash * act;
    }
    sched::Instruction step;
    step.kind = OpKind::kOptimizerStep;
    tail = std::max(tail, reductions + model.duration(s, w, step));
    peak = std::max(peak, fixed + in_flight);
    workers[static_cast<std::size_t>(w)].peak = fixed + in_flight;
  }
  double busiest = 0.0, total = 0.0;
  for (double x : work) {
    busiest = std::max(busiest, x);
    total += x;
  }
  const double hop = p > 1 ? seconds_of(model, s, 0, OpKind::kSendActivation, 0, 0) : 0.0;
  double step = 0.0;
  if (chimera) {
    // Units of p micro-batches, each with a bubble of p - 2 backward slots.
    step = m * busiest + double{1.0} * m / p * std::max(0, p - 2) * chimera_backward +
           2.0 * (p - 1) * hop;
  } else {
    step = m * busiest + (total - busiest) / v + 2.0 * (double{1.0} * p * v - 1.0) * hop;
  }
  c.estimate_s = step + tail;
  c.step_time_s = c.estimate_s;
  c.memory_estimate_bytes = peak;
  c.peak_memory_bytes = peak;
  for (int w = 0; w < p; ++w) {
    workers[static_cast<std::size_t>(w)].work = work[static_cast<std::size_t>(w)];
  }
  return workers;
}

// The K-FAC state of `c.kfac_placement` in the closed form (Candidate::kfac_*): memory per GPU
// added to each worker's peak, traffic, and the time it adds per step. Returns false when the
// placement does not suit the candidate (a group not dividing d; sharding under Chimera).
bool estimate_kfac(const ParallelCostModel& model, const SearchOptions& options,
                   const std::vector<WorkerEstimate>& workers, Candidate& c) {
  const int d = c.data_parallel;
  try {
    kfac::validate_placement(c.kfac_placement, d);
  } catch (const std::invalid_argument&) {
    return false;
  }
  ParallelCostModel::KfacHolders h;
  h.replicas = d;
  h.factors = c.kfac_placement.factors.holders(d);
  h.inverses = c.kfac_placement.inverses.holders(d);
  const bool spread = h.factors < d || h.inverses < d;
  if (spread && c.kind == ScheduleKind::kChimera) return false;  // the pass replicates there
  const sched::Schedule s = placement_only(params_of(c, options.model.num_layers));
  const auto& kfac = *options.kfac;
  const auto layer = model.kfac_layer_cost(s, kfac.linears, h);
  std::vector<double> layers(workers.size(), 0.0);
  for (const auto& placed : s.placement.chunks) {
    double held = placed.num_layers;
    if (!kfac.layers.empty()) {
      held = static_cast<double>(std::count_if(kfac.layers.begin(), kfac.layers.end(), [&](int l) {
        return l >= placed.first_layer && l < placed.first_layer + placed.num_layers;
      }));
    }
    layers[static_cast<std::size_t>(placed.worker)] += held;
  }
  const double k_max = kfac.refresh_steps > 0 ? kfac.refresh_steps : kfac.max_refresh_steps;
  c.memory_estimate_bytes = 0.0;
  c.kfac_memory_bytes = c.kfac_replicated_bytes = c.kfac_overhead_estimate_s = 0.0;
  c.kfac_load_estimate_s = 0.0;
  // K-FAC state may live in host memory, replicated or sharded: on the device the largest
  // Linear's state the busiest replica holds (host), its inverses and the largest Linear's
  // factors (factors), or what fits beside the rest, factors first (auto); the copies run on
  // the host link, their own lane, and each replica moves only what it holds (docs/offload.md:
  // a factor prefetch where it holds the factors, a write-back and an inverse prefetch where it
  // holds the inverses; factors only: the factor holders' prefetch and write-back).
  c.kfac_offloaded = options.kfac_offload != pipefisher::OffloadMode::kNone;
  c.kfac_host_bytes_per_step = 0.0;
  c.kfac_estimate_factors = c.kfac_estimate_whole = false;
  const double host_bandwidth = model.cluster().host_bandwidth > 0.0
                                    ? model.cluster().host_bandwidth
                                    : model.cluster().device.host_bandwidth;
  // The fraction of the replicas holding each Linear's factors, and its inverses.
  const double factor_share = static_cast<double>(h.factors) / d;
  const double inverse_share = static_cast<double>(h.inverses) / d;
  // The factor sums a refresh accumulates (kfac::FactorState::sum; docs/simulator.md "Memory"),
  // at the most the simulator's event model can have alive at once: both sums of every Linear
  // the worker holds layers of. A factor's sum lives from the first curvature of its refresh to
  // the Linear's first inversion, and that inversion (or, on a replica without the factors, the
  // curvature sync that drops them) needs the last micro-batch's curvature, which comes after
  // every Linear's first one in a refresh that draws its curvature from one step: all the sums
  // are open together. Every replica accumulates every Linear's sums whatever the placement
  // (the sync reduces them into the holders'), so sharding does not shrink them; nor does host
  // offload: the sums accumulate on the device, and an offloaded Linear's leave with its next
  // write-back. A pipelined refresh also holds the previous window's set-aside sums up to their
  // wrapped inversion: twice as many. Their own peak meets the activations' in the closed form
  // (it adds maxima), an upper bound on the simulated peak (tests/sim/test_search.cpp).
  const double sum_windows = kfac.pipelined_refresh ? 2.0 : 1.0;
  c.kfac_factor_sum_bytes = 0.0;
  for (std::size_t w = 0; w < workers.size(); ++w) {
    const auto cost = layer.times(layers[w], spread);
    const double sums = sum_windows * cost.factor_sum_bytes;
    double device = cost.busiest_memory_bytes, least = device;
    if (c.kfac_offloaded) {
      // What must stay: the Linear being refreshed, and the inverses that arrive before the
      // preconditioning needs them (auto keeps more where it fits). The offload pass starts an
      // inverse prefetch as late as it can, but the host link carries them one after another:
      // when bringing in the I bytes of inverses a replica holds takes the link L = I / bandwidth
      // seconds, longer than its preconditioning P, the copies start L - P before it and about
      // I (1 - P / L) bytes wait on the device when it begins (every replica holds all the
      // inverses when they are replicated).
      const double state = cost.replicated_bytes / 2.0;  // one kind: factors or inverses
      // The busiest replica's part of a per-replica average `value`: with sharded state the
      // owners are balanced greedily, so up to `extra` (the largest Linear's) more, at most `cap`.
      const auto busiest = [spread](double value, double cap, double extra) {
        return spread ? std::min(cap, value + extra) : value;
      };
      const double inverses_held =
          busiest(state * inverse_share, state, cost.largest_linear_bytes / 2.0);
      double waiting = 0.0;
      if (host_bandwidth > 0.0 && inverses_held > 0.0) {
        const double link = inverses_held / host_bandwidth;
        waiting = inverses_held * std::max(0.0, 1.0 - cost.precondition_seconds_per_step / link);
      }
      // Whole Linears (host): one Linear's state and the waiting inverses stay.
      const double whole_least =
          layers[w] > 0.0 ? std::min(layer.largest_linear_bytes + waiting, device) : 0.0;
      // Per step the inverses a replica holds come in; per refresh the factors it holds come
      // in and go back with their new inverses, and a replica holding only the inverses of a
      // Linear writes back the broadcast ones: with S the state of one kind (factors or
      // inverses) of the worker's Linears, S (i + (2 f + i) / k) per step on average, i and f
      // the replicas' shares (replicate: S (1 + 3 / k)). The busiest replica (owners balanced
      // greedily) moves at most that plus the largest Linear's copies.
      const double whole_copies = busiest(
          state * (inverse_share + (2.0 * factor_share + inverse_share) / k_max),
          state * (1.0 + 3.0 / k_max), cost.largest_linear_bytes / 2.0 * (1.0 + 3.0 / k_max));
      // Factors only (docs/offload.md): the inverses the busiest replica holds stay (its
      // inverse share, plus the largest Linear's where the owners are balanced greedily) and
      // the factors of the Linear being refreshed come in; only the factor holders move, per
      // refresh the factors in and out, S 2 f / k per step, nothing per step otherwise.
      const double factor_copies = busiest(state * 2.0 * factor_share / k_max, state * 2.0 / k_max,
                                           cost.largest_linear_bytes / 2.0 * 2.0 / k_max);
      const double factors_least =
          layers[w] > 0.0 ? std::min(device, inverses_held + cost.largest_linear_bytes / 2.0) : 0.0;
      // auto: the room beside the rest and the sums, which stay on the device.
      const double room = options.cluster.gpu_memory_bytes - workers[w].peak - sums;
      double copies = 0.0;
      bool factors = false, whole = false;
      switch (options.kfac_offload) {
        case pipefisher::OffloadMode::kHost:
          least = device = whole_least;
          copies = whole_copies;
          whole = true;
          break;
        case pipefisher::OffloadMode::kFactors:
          least = device = factors_least;
          copies = factor_copies;
          factors = true;
          break;
        default: {
          // auto, as the planner: the factors of the largest Linears until the worker fits, and
          // only once every Linear's factors are offloaded, the largest Linears whole; the
          // bytes moved in proportion to the state each granularity takes off the device.
          least = std::min(whole_least, factors_least);
          device = std::min(device, std::max(least, room));
          if (device >= factors_least) {
            if (device < cost.busiest_memory_bytes && cost.busiest_memory_bytes > factors_least) {
              copies = factor_copies * (cost.busiest_memory_bytes - device) /
                       (cost.busiest_memory_bytes - factors_least);
              factors = true;
            }
          } else {
            const double share =
                factors_least > least ? (factors_least - device) / (factors_least - least) : 1.0;
            copies = factor_copies + std::max(0.0, whole_copies - factor_copies) * share;
            factors = whole = true;
          }
          break;
        }
      }
      c.kfac_estimate_factors = c.kfac_estimate_factors || (factors && copies > 0.0);
      c.kfac_estimate_whole = c.kfac_estimate_whole || (whole && copies > 0.0);
      c.kfac_host_bytes_per_step = std::max(c.kfac_host_bytes_per_step, copies);
      // Time beyond the step delays it.
      if (host_bandwidth > 0.0) {
        c.kfac_overhead_estimate_s =
            std::max(c.kfac_overhead_estimate_s, copies / host_bandwidth - c.estimate_s);
      }
    }
    device += sums;
    least += sums;
    c.memory_estimate_bytes = std::max(c.memory_estimate_bytes, workers[w].peak + least);
    if (cost.replicated_bytes >= c.kfac_replicated_bytes) {
      c.kfac_memory_bytes = device;
      c.kfac_least_memory_bytes = least;
      c.kfac_factor_sum_bytes = sums;
      c.kfac_replicated_bytes = cost.replicated_bytes;
      c.kfac_factor_bytes_per_refresh = cost.factor_bytes_per_refresh;
      c.kfac_inverse_bytes_per_refresh = cost.inverse_bytes_per_refresh;
      c.kfac_gradient_bytes_per_step = cost.gradient_bytes_per_step;
    }
    const double idle = std::max(0.0, c.estimate_s - c.microbatches * workers[w].work);
    const double refresh = c.microbatches * cost.curvature_seconds_per_microbatch +
                           cost.factor_seconds_per_refresh + cost.inversion_seconds_per_refresh +
                           cost.inverse_seconds_per_refresh;
    const double load =
        cost.precondition_seconds_per_step + cost.gradient_seconds_per_step + refresh / k_max;
    c.kfac_load_estimate_s = std::max(c.kfac_load_estimate_s, load);
    c.kfac_overhead_estimate_s = std::max(c.kfac_overhead_estimate_s, load - idle);
  }
  c.peak_memory_bytes = c.memory_estimate_bytes;
  return true;
}

int formula_refresh_steps(const ParallelCostModel& model, const SearchOptions& options,
                          const Candidate& c) {
  const sched::Schedule s = placement_only(params_of(c, options.model.num_layers));
  const int p = c.stages, m = c.microbatches;
  const auto by_worker = sched::chunks_by_worker(s.placement, p);
  const auto& linears = options.kfac->linears;
  int worst = 0;
  for (int w = 0; w < p; ++w) {
    double forward = 0.0, backward = 0.0, kron = 0.0, inversion = 0.0;
    for (const sched::ChunkRef& ref : by_worker[static_cast<std::size_t>(w)]) {
      const double share = c.kind == ScheduleKind::kChimera ? 0.5 : 1.0;
      forward += share * seconds_of(model, s, w, OpKind::kForward, ref.pipeline, ref.chunk);
      backward += share * seconds_of(model, s, w, OpKind::kBackward, ref.pipeline, ref.chunk);
      const int layers = s.placement.at(ref.pipeline, ref.chunk).num_layers;
      for (sched::LinearKind linear : linears) {
        sched::Instruction in;
        in.linear = linear;
        for (OpKind kind : {OpKind::kCurvatureA, OpKind::kCurvatureB}) {
          in.kind = kind;
          kron += share * layers * model.duration(s, w, in);
        }
        for (OpKind kind : {OpKind::kInvertA, OpKind::kInvertB}) {
          in.kind = kind;
          inversion += share * layers * model.duration(s, w, in);
        }
      }
    }
    double bubble = (p - 1.0) * (forward + backward);
    if (c.kind == ScheduleKind::kInterleaved) bubble /= c.chunks;
    if (c.kind == ScheduleKind::kChimera) bubble = double{1.0} * m / p * (p - 2.0) * backward;
    if (bubble <= 0.0) return -1;
    worst = std::max(worst, static_cast<int>(std::ceil((m * kron + inversion) / bubble)));
  }
  return worst;
}

std::vector<int> tensor_degrees(const SearchOptions& o) {
  if (!o.tensor_parallel.empty()) return o.tensor_parallel;
  std::vector<int> out;
  for (int t = 1; t <= 2 * o.cluster.gpus_per_node && t <= o.gpus; t *= 2) out.push_back(t);
  return out;
}

bool fits_offload(const ClusterSpec& cluster, Offload offload) {
  if (offload == Offload::kNone) return true;
  if (!(cluster.host_bandwidth > 0.0)) return false;
  return offload != Offload::kNvme || cluster.nvme_bandwidth > 0.0;
}

// The time a candidate is ranked by: with K-FAC the pass's step, else the closed form's
// overhead on the step (0 without --kfac).
double ranking_time(const Candidate& c) {
  return c.kfac_run ? c.kfac_step_time_s : c.step_time_s + c.kfac_overhead_estimate_s;
}

bool better(const Candidate& a, const Candidate& b) {
  if (a.simulated != b.simulated) return a.simulated;
  const double ta = ranking_time(a);
  const double tb = ranking_time(b);
  if (a.kfac_run != b.kfac_run) return a.kfac_run;
  if (ta != tb) return ta < tb;
  // Placements the idle time hides equally: the one with less K-FAC work and traffic.
  if (a.kfac_load_estimate_s != b.kfac_load_estimate_s) {
    return a.kfac_load_estimate_s < b.kfac_load_estimate_s;
  }
  return a.peak_memory_bytes < b.peak_memory_bytes;
}

}  // namespace

std::string Candidate::kfac_state_name() const {
  // Where some state moves (the offload pass offloaded a Linear (kfac_run), else the closed
  // form moves bytes: auto keeps on the device what fits): "+factors" where every offloaded
  // Linear moves its factors only, "+offload" where every one moves whole, "+factors+offload"
  // where some of each (auto).
  if (!kfac_offloaded) return kfac::to_string(kfac_placement);
  bool factors = kfac_estimate_factors, whole = kfac_estimate_whole;
  if (kfac_run) {
    factors = kfac_factors_only_linears > 0;
    whole = kfac_offloaded_linears > kfac_factors_only_linears;
  } else if (kfac_host_bytes_per_step <= 0.0) {
    factors = whole = false;
  }
  return kfac::to_string(kfac_placement) + (factors ? "+factors" : "") + (whole ? "+offload" : "");
}

std::string Candidate::state_name() const {
  std::string name = "zero" + std::to_string(zero_stage);
  if (optimizer_offload != Offload::kNone) name += "+" + std::string(to_string(optimizer_offload));
  return name;
}

StateSharding zero_sharding(int stage) {
  if (stage < 0 || stage > 3) {
    throw std::invalid_argument("ZeRO stage " + std::to_string(stage) + " (allowed: 0, 1, 2, 3)");
  }
  StateSharding sharding;  // 1: replicated; 0: over the whole data-parallel group
  if (stage >= 1) sharding.optimizer = 0;
  if (stage >= 2) sharding.gradients = 0;
  if (stage >= 3) sharding.parameters = 0;
  return sharding;
}

KfacStateHolders kfac_state_holders(const kfac::StatePlacement& placement) {
  const auto holders = [](const kfac::ComponentPlacement& c) {
    switch (c.placement) {
      case kfac::Placement::kReplicate:
        return 0;
      case kfac::Placement::kShard:
        return 1;
      case kfac::Placement::kPartial:
        return c.group;
    }
    return 0;
  };
  return {holders(placement.factors), holders(placement.inverses)};
}

std::vector<kfac::LinearDims> kfac_linear_dims(const ParallelCostModel& model) {
  std::vector<kfac::LinearDims> dims;
  for (int i = 0; i < sched::kNumLinearKinds; ++i) {
    const auto d = model.linear_dims(static_cast<sched::LinearKind>(i));
    dims.push_back({static_cast<std::int64_t>(d.in), static_cast<std::int64_t>(d.out)});
  }
  return dims;
}

std::vector<kfac::StatePlacement> default_kfac_placements(int data_parallel) {
  std::vector<kfac::StatePlacement> out = {kfac::StatePlacement{}};
  if (data_parallel <= 1) return out;
  kfac::StatePlacement factors_sharded;
  factors_sharded.factors = {kfac::Placement::kShard, 0};
  out.push_back(factors_sharded);
  for (int group = 2; group < data_parallel && group <= 64; group *= 2) {
    if (data_parallel % group == 0) {
      out.push_back(kfac::uniform_placement({kfac::Placement::kPartial, group}));
    }
  }
  out.push_back(kfac::uniform_placement({kfac::Placement::kShard, 0}));
  return out;
}

std::vector<kfac::StatePlacement> parse_kfac_placements(const std::string& list) {
  const std::vector<std::string_view> views = split_comma_list(list, "--kfac-sharding");
  const std::vector<std::string> items(views.begin(), views.end());
  const auto component = [&](const std::string& text) {
    const auto choice = kfac::parse_kfac_sharding(text);
    if (choice.automatic) {
      throw std::invalid_argument(
          "--kfac-sharding: 'auto' in a list (the search compares the "
          "placements it lists)");
    }
    return choice.placement.factors;
  };
  std::vector<kfac::StatePlacement> out;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const std::string& item = items[i];
    const std::string factors = "factors=", inverses = "inverses=";
    if (item.rfind(factors, 0) == 0) {
      if (i + 1 >= items.size() || items[i + 1].rfind(inverses, 0) != 0) {
        throw std::invalid_argument("--kfac-sharding: '" + item +
                                    "' must be followed by inverses=PLACEMENT");
      }
      out.push_back({component(item.substr(factors.size())),
                     component(items[i + 1].substr(inverses.size()))});
      ++i;
      continue;
    }
    out.push_back(kfac::uniform_placement(component(item)));
  }
  return out;
}

std::string Candidate::schedule_name() const {
  std::string name(sched::to_string(kind));
  if (kind == ScheduleKind::kInterleaved) name += " v=" + std::to_string(chunks);
  return name;
}

void SearchOptions::validate() const {
  model.validate();
  cluster.validate("cluster '" + cluster.name + "'");
  if (gpus <= 0)
    throw std::invalid_argument("--gpus must be positive, got " + std::to_string(gpus));
  if (cluster.num_nodes > 0 && gpus > cluster.total_gpus()) {
    throw std::invalid_argument("--gpus " + std::to_string(gpus) + " exceeds cluster '" +
                                cluster.name + "' (" + std::to_string(cluster.total_gpus()) +
                                " GPUs)");
  }
  if (global_batch <= 0) {
    throw std::invalid_argument("--global-batch must be positive, got " +
                                std::to_string(global_batch));
  }
  if (seq_len <= 0 || seq_len > model.max_position_embeddings) {
    throw std::invalid_argument("--seq-len " + std::to_string(seq_len) + " must lie in [1, " +
                                std::to_string(model.max_position_embeddings) + "] for model '" +
                                model.name + "'");
  }
  for (int b : micro_batch_sizes) {
    if (b <= 0) throw std::invalid_argument("micro-batch sizes must be positive");
  }
  if (simulate_top < 0 || kfac_top < 0) {
    throw std::invalid_argument("--simulate-top and --kfac-top must be >= 0");
  }
  if (zero_stages.empty() || optimizer_offload.empty()) {
    throw std::invalid_argument("--zero-stages and --optimizer-offload must list a value each");
  }
  for (int stage : zero_stages) (void)zero_sharding(stage);
  if (attention == AttentionAlgorithm::kFused) {
    // Every candidate runs the same heads on the same GPU: refuse here, once, rather than drop
    // them all as unpriceable.
    check_fused_attention_head(model.head_dim());
    check_fused_attention_device(cluster.device, attention, precision, model.head_dim());
  }
  if (kfac_offload != pipefisher::OffloadMode::kNone && !kfac) {
    throw std::invalid_argument("--kfac-offload offloads K-FAC state: add --kfac");
  }
  for (Offload offload : optimizer_offload) {
    if (!fits_offload(cluster, offload)) {
      throw std::invalid_argument("--optimizer-offload " + std::string(to_string(offload)) +
                                  ": cluster '" + cluster.name + "' has no " +
                                  (offload == Offload::kNvme && cluster.host_bandwidth > 0.0
                                       ? "nvme_bandwidth_gbps"
                                       : "host_bandwidth_gbps"));
    }
  }
  (void)cluster.device.peak_flops(precision);
}

SearchResult search_configurations(const SearchOptions& options) {
  options.validate();
  const auto started = std::chrono::steady_clock::now();
  SearchResult result;
  const int L = options.model.num_layers;
  std::vector<Candidate> feasible;
  // One cost model per (t, b, recompute, state, K-FAC holders): the kernels are priced once.
  // The closed forms price every K-FAC placement on the replicated model (holders passed).
  std::map<std::tuple<int, int, int, int, int, int, int>, std::shared_ptr<ParallelCostModel>>
      models;
  auto model_for = [&](int t, int b, Recompute r, int zero, Offload offload,
                       KfacStateHolders kfac_state = {}) -> std::shared_ptr<ParallelCostModel> {
    const auto key = std::make_tuple(t, b, static_cast<int>(r), zero, static_cast<int>(offload),
                                     kfac_state.factors, kfac_state.inverses);
    auto it = models.find(key);
    if (it != models.end()) return it->second;
    ParallelWorkload w;
    w.model = options.model;
    w.seq_len = options.seq_len;
    w.micro_batch_size = b;
    w.precision = options.precision;
    w.attention = options.attention;
    w.tensor_parallel = t;
    w.recompute = r;
    w.sharding = zero_sharding(zero);
    w.optimizer_offload = offload;
    w.kfac_state = kfac_state;
    std::shared_ptr<ParallelCostModel> model;
    try {
      model = std::make_shared<ParallelCostModel>(w, options.cluster);
    } catch (const std::invalid_argument&) {
      model = nullptr;  // t does not divide the heads: not a candidate
    }
    models.emplace(key, model);
    return model;
  };
  const std::vector<kfac::StatePlacement> replicated_only = {kfac::StatePlacement{}};
  for (int t : tensor_degrees(options)) {
    if (options.gpus % t != 0) continue;
    for (int p = 1; p <= options.gpus / t && p <= L; ++p) {
      if ((options.gpus / t) % p != 0) continue;
      if (!options.pipeline_stages.empty() &&
          std::find(options.pipeline_stages.begin(), options.pipeline_stages.end(), p) ==
              options.pipeline_stages.end()) {
        continue;
      }
      const int d = options.gpus / (t * p);
      const std::vector<kfac::StatePlacement> defaults =
          options.kfac ? default_kfac_placements(d) : replicated_only;
      const auto& placements =
          options.kfac && !options.kfac_placements.empty() ? options.kfac_placements : defaults;
      for (int b : options.micro_batch_sizes) {
        if (options.global_batch % (static_cast<long>(b) * d) != 0) continue;
        const int m = static_cast<int>(options.global_batch / (static_cast<long>(b) * d));
        for (Recompute r : options.recompute) {
          for (int zero : options.zero_stages) {
            if (zero > 0 && d == 1) continue;  // nothing to shard over: the same as stage 0
            for (Offload offload : options.optimizer_offload) {
              const auto model = model_for(t, b, r, zero, offload);
              for (ScheduleKind kind : options.kinds) {
                std::vector<int> chunks = {1};
                if (kind == ScheduleKind::kInterleaved) chunks = options.interleave_chunks;
                for (int v : chunks) {
                  const auto count = static_cast<long>(placements.size());
                  result.enumerated += count;
                  Candidate c;
                  c.tensor_parallel = t;
                  c.stages = p;
                  c.data_parallel = d;
                  c.micro_batch_size = b;
                  c.microbatches = m;
                  c.kind = kind;
                  c.chunks = v;
                  c.recompute = r;
                  c.zero_stage = zero;
                  c.optimizer_offload = offload;
                  if (!model || (kind == ScheduleKind::kInterleaved && p == 1)) {
                    result.invalid += count;
                    continue;
                  }
                  try {
                    sched::check_params(params_of(c, L));
                  } catch (const std::invalid_argument&) {
                    result.invalid += count;
                    continue;
                  }
                  const auto workers = estimate(*model, options, c);
                  const bool base_fits =
                      c.memory_estimate_bytes <= options.cluster.gpu_memory_bytes;
                  for (const kfac::StatePlacement& placement : placements) {
                    Candidate with = c;
                    with.kfac_placement = placement;
                    if (options.kfac && !estimate_kfac(*model, options, workers, with)) {
                      ++result.invalid;
                      continue;
                    }
                    if (with.memory_estimate_bytes > options.cluster.gpu_memory_bytes) {
                      ++result.out_of_memory;
                      if (base_fits) ++result.kfac_out_of_memory;
                      continue;
                    }
                    feasible.push_back(with);
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  std::stable_sort(feasible.begin(), feasible.end(), [](const Candidate& a, const Candidate& b) {
    const double ta = a.estimate_s + a.kfac_overhead_estimate_s;
    const double tb = b.estimate_s + b.kfac_overhead_estimate_s;
    if (ta != tb) return ta < tb;
    return a.kfac_load_estimate_s < b.kfac_load_estimate_s;
  });
  // The engine re-ranks the best estimates (and drops what does not fit after all). The K-FAC
  // placements of one configuration share its simulation (the base schedule has no K-FAC).
  struct Simulated {
    double step_time_s = 0.0, bubble_fraction = 0.0, peak = 0.0;
  };
  std::map<std::tuple<int, int, int, int, int, int, int, int, int>, Simulated> simulations;
  std::vector<Candidate> ranked;
  for (Candidate& c : feasible) {
    const auto key =
        std::make_tuple(c.tensor_parallel, c.stages, c.micro_batch_size, static_cast<int>(c.kind),
                        c.chunks, static_cast<int>(c.recompute), c.zero_stage,
                        static_cast<int>(c.optimizer_offload), c.data_parallel);
    auto it = simulations.find(key);
    if (it == simulations.end()) {
      if (result.simulated >= options.simulate_top) {
        ranked.push_back(c);
        continue;
      }
      const auto model = model_for(c.tensor_parallel, c.micro_batch_size, c.recompute, c.zero_stage,
                                   c.optimizer_offload);
      const SimResult sim = simulate(sched::compile(params_of(c, L)), *model);
      ++result.simulated;
      Simulated x;
      x.step_time_s = sim.step_time_s;
      x.bubble_fraction = sim.bubble_fraction;
      for (const auto& w : sim.workers) x.peak = std::max(x.peak, w.peak_memory_bytes);
      it = simulations.emplace(key, x).first;
    }
    // The K-FAC state on top of the simulated peak (the worst worker's both: an upper bound).
    const double peak = it->second.peak + c.kfac_least_memory_bytes;
    if (peak > options.cluster.gpu_memory_bytes) {
      ++result.out_of_memory;
      if (it->second.peak <= options.cluster.gpu_memory_bytes) ++result.kfac_out_of_memory;
      continue;
    }
    c.simulated = true;
    c.step_time_s = it->second.step_time_s;
    c.bubble_fraction = it->second.bubble_fraction;
    c.peak_memory_bytes = peak;
    ranked.push_back(c);
  }
  // Throughput figures from the step time.
  for (Candidate& c : ranked) {
    ParallelWorkload w;
    w.model = options.model;
    w.seq_len = options.seq_len;
    w.micro_batch_size = c.micro_batch_size;
    w.tensor_parallel = c.tensor_parallel;
    w.recompute = c.recompute;
    const double gpus = options.gpus;
    const double sequences_per_s = options.global_batch / c.step_time_s;
    c.achieved_tflops_per_gpu =
        sequences_per_s * transformer_hardware_flops_per_sequence(w) / gpus / 1e12;
    c.mfu =
        sequences_per_s *
        transformer_model_flops_per_sequence(options.model, options.seq_len, w.scored_positions()) /
        (gpus * options.cluster.device.peak_flops(options.precision));
  }
  std::stable_sort(ranked.begin(), ranked.end(), better);
  if (options.kfac) {
    int runs = 0;
    std::vector<Candidate> kept;
    kept.reserve(ranked.size());
    // At most two placements per configuration, so that the passes see several configurations
    // (the closed form ranks the placements of the best one close together).
    std::map<std::tuple<int, int, int, int, int, int, int, int>, int> runs_of;
    for (Candidate& c : ranked) {
      int& same = runs_of[std::make_tuple(
          c.tensor_parallel, c.stages, c.micro_batch_size, static_cast<int>(c.kind), c.chunks,
          static_cast<int>(c.recompute), c.zero_stage, static_cast<int>(c.optimizer_offload))];
      if (runs >= options.kfac_top || !c.simulated || same >= kKfacRunsPerConfiguration) {
        kept.push_back(c);
        continue;
      }
      ++same;
      const auto model = model_for(c.tensor_parallel, c.micro_batch_size, c.recompute, c.zero_stage,
                                   c.optimizer_offload, kfac_state_holders(c.kfac_placement));
      pipefisher::KfacOptions kfac = *options.kfac;
      kfac.state_placement = c.kfac_placement;
      kfac.automatic_placement = false;
      kfac.linear_dims = kfac_linear_dims(*model);
      // The pass and the offload pass simulate the factor sums, as the closed form counts them.
      const pipefisher::PassResult pass =
          pipefisher::run_pipefisher(sched::compile(params_of(c, L)), *model, kfac);
      ++runs;
      double peak = 0.0;
      for (const auto& w : pass.after.workers) peak = std::max(peak, w.peak_memory_bytes);
      double step = pass.report.step_time_after_s;
      if (c.kfac_offloaded) {
        const pipefisher::OffloadResult offload = pipefisher::run_offload_pass(
            pass, *model, {options.kfac_offload, options.cluster.gpu_memory_bytes, {}});
        c.kfac_peak_before_offload_bytes = peak;
        peak = offload.report.max_peak_memory_after;
        step = offload.report.step_time_after_s;
        c.kfac_offloaded_linears = offload.report.offloaded_linears;
        c.kfac_factors_only_linears = offload.report.factors_only_linears;
        for (const auto& w : offload.report.workers) {
          c.kfac_host_link_s_per_refresh = std::max(c.kfac_host_link_s_per_refresh, w.transfer_s);
        }
      }
      if (peak > options.cluster.gpu_memory_bytes) {
        ++result.out_of_memory;
        ++result.kfac_out_of_memory;
        continue;
      }
      c.kfac_run = true;
      c.kfac_peak_memory_bytes = peak;
      c.utilization_before = pass.report.utilization_before;
      c.utilization_after = pass.report.utilization_after;
      c.kfac_step_time_s = step;
      c.refresh_steps = pass.report.refresh_steps;
      c.refresh_bound = pass.report.refresh_bound;
      c.formula_refresh_steps = formula_refresh_steps(*model, options, c);
      kept.push_back(c);
    }
    ranked = std::move(kept);
    std::stable_sort(ranked.begin(), ranked.end(), better);
  }
  result.ranked = std::move(ranked);
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return result;
}

std::string search_table(const SearchOptions& options, const SearchResult& result, int top) {
  std::string out =
      "search: " + options.model.name + " on " + std::to_string(options.gpus) + " GPUs of " +
      options.cluster.name + ", global batch " + std::to_string(options.global_batch) +
      ", S=" + std::to_string(options.seq_len) + ", " + std::string(to_string(options.precision)) +
      (options.attention == AttentionAlgorithm::kFused ? ", fused attention" : "") + "\n";
  out += std::to_string(result.enumerated) + " candidates: " + std::to_string(result.invalid) +
         " break a schedule's rules, " + std::to_string(result.out_of_memory) +
         " do not fit in memory, " + std::to_string(result.ranked.size()) + " fit; " +
         std::to_string(result.simulated) + " simulated; " + text("%.2f", result.seconds) + " s\n";
  const bool kfac = options.kfac.has_value();
  if (kfac) {
    out += "with K-FAC: each configuration tried with its K-FAC state placements; " +
           std::to_string(result.kfac_out_of_memory) +
           " fit without K-FAC but not with its state (memory includes it)\n";
  }
  out +=
      "rank    t    p    d  schedule         b      m  recompute  state         step time  "
      "TFLOP/s/GPU    MFU  bubble   memory";
  if (kfac) {
    out +=
        "  K-FAC state                    GiB  util before -> after   k  formula k  step w/ K-FAC";
  }
  out += "\n";
  const int n = std::min<int>(top, static_cast<int>(result.ranked.size()));
  for (int i = 0; i < n; ++i) {
    const Candidate& c = result.ranked[static_cast<std::size_t>(i)];
    out += pad(std::to_string(i + 1), 4) + pad(std::to_string(c.tensor_parallel), 5) +
           pad(std::to_string(c.stages), 5) + pad(std::to_string(c.data_parallel), 5) + "  " +
           c.schedule_name() +
           std::string(15 - std::min<std::size_t>(15, c.schedule_name().size()), ' ') +
           pad(std::to_string(c.micro_batch_size), 3) + pad(std::to_string(c.microbatches), 7) +
           pad(std::string(to_string(c.recompute)), 11) + "  " + c.state_name() +
           std::string(11 - std::min<std::size_t>(11, c.state_name().size()), ' ') +
           pad(text("%.3f s", c.step_time_s) + (c.simulated ? "" : "*"), 11) +
           pad(text("%.1f", c.achieved_tflops_per_gpu), 13) + pad(text("%.1f%%", 100 * c.mfu), 7) +
           pad(c.simulated ? text("%.1f%%", 100 * c.bubble_fraction) : "-", 8) +
           pad(text("%.1f GiB", c.peak_memory_bytes / (1024.0 * 1024 * 1024)), 9);
    if (kfac) {
      const std::string name = c.kfac_state_name();
      out += "  " + name + std::string(27 - std::min<std::size_t>(27, name.size()), ' ') +
             pad(text("%.1f", c.kfac_memory_bytes / (1024.0 * 1024 * 1024)), 6);
    }
    if (kfac && c.kfac_run) {
      out += pad(text("%.1f%%", 100 * c.utilization_before), 13) + " ->" +
             pad(text("%.1f%%", 100 * c.utilization_after), 7) +
             pad(std::to_string(c.refresh_steps), 4) +
             pad(std::to_string(c.formula_refresh_steps), 11) +
             pad(text("%.3f s", c.kfac_step_time_s), 15);
    }
    out += "\n";
  }
  out += "(* closed-form estimate, not simulated)\n";
  return out;
}

nlohmann::json search_json(const SearchOptions& options, const SearchResult& result, int top) {
  nlohmann::json list = nlohmann::json::array();
  const int n = std::min<int>(top, static_cast<int>(result.ranked.size()));
  for (int i = 0; i < n; ++i) {
    const Candidate& c = result.ranked[static_cast<std::size_t>(i)];
    nlohmann::json item = {{"rank", i + 1},
                           {"tensor_parallel", c.tensor_parallel},
                           {"stages", c.stages},
                           {"data_parallel", c.data_parallel},
                           {"schedule", sched::to_string(c.kind)},
                           {"chunks_per_worker", c.chunks},
                           {"micro_batch_size", c.micro_batch_size},
                           {"microbatches", c.microbatches},
                           {"recompute", to_string(c.recompute)},
                           {"zero_stage", c.zero_stage},
                           {"optimizer_offload", to_string(c.optimizer_offload)},
                           {"simulated", c.simulated},
                           {"step_time_s", c.step_time_s},
                           {"estimate_s", c.estimate_s},
                           {"achieved_tflops_per_gpu", c.achieved_tflops_per_gpu},
                           {"mfu", c.mfu},
                           {"peak_memory_bytes", c.peak_memory_bytes},
                           {"memory_estimate_bytes", c.memory_estimate_bytes}};
    if (c.simulated) item["bubble_fraction"] = c.bubble_fraction;
    if (options.kfac) {
      item["kfac_state"] = {{"placement", c.kfac_state_name()},
                            {"memory_bytes_per_gpu", c.kfac_memory_bytes},
                            {"replicated_memory_bytes_per_gpu", c.kfac_replicated_bytes},
                            {"factor_sum_bytes_per_gpu", c.kfac_factor_sum_bytes},
                            {"factor_bytes_per_refresh", c.kfac_factor_bytes_per_refresh},
                            {"inverse_bytes_per_refresh", c.kfac_inverse_bytes_per_refresh},
                            {"gradient_bytes_per_step", c.kfac_gradient_bytes_per_step},
                            {"overhead_estimate_s", c.kfac_overhead_estimate_s},
                            {"offloaded", c.kfac_offloaded}};
      if (c.kfac_offloaded) {
        item["kfac_state"]["offload"] = std::string(pipefisher::to_string(options.kfac_offload));
        item["kfac_state"]["host_bytes_per_step_estimate"] = c.kfac_host_bytes_per_step;
      }
      if (c.kfac_offloaded && c.kfac_run) {
        item["kfac_state"]["offloaded_linears"] = c.kfac_offloaded_linears;
        item["kfac_state"]["factors_only_linears"] = c.kfac_factors_only_linears;
        item["kfac_state"]["host_link_seconds_per_refresh"] = c.kfac_host_link_s_per_refresh;
        item["kfac_state"]["peak_before_offload_bytes"] = c.kfac_peak_before_offload_bytes;
      }
    }
    if (c.kfac_run) {
      item["kfac"] = {{"utilization_before", c.utilization_before},
                      {"peak_memory_bytes", c.kfac_peak_memory_bytes},
                      {"utilization_after", c.utilization_after},
                      {"refresh_steps", c.refresh_steps},
                      {"refresh_bound", c.refresh_bound},
                      {"pipefisher_formula_refresh_steps", c.formula_refresh_steps},
                      {"step_time_s", c.kfac_step_time_s}};
    }
    list.push_back(item);
  }
  return {{"model", options.model.name},
          {"cluster", options.cluster.name},
          {"gpus", options.gpus},
          {"global_batch", options.global_batch},
          {"seq_len", options.seq_len},
          {"precision", to_string(options.precision)},
          {"attention", to_string(options.attention)},
          {"enumerated", result.enumerated},
          {"invalid", result.invalid},
          {"out_of_memory", result.out_of_memory},
          {"kfac_out_of_memory", result.kfac_out_of_memory},
          {"fitting", result.ranked.size()},
          {"simulated", result.simulated},
          {"seconds", result.seconds},
          {"candidates", list}};
}

}  // namespace pf::sim
