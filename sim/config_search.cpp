#include "sim/config_search.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <stdexcept>
#include <tuple>

#include <nlohmann/json.hpp>

#include "scheduler/compile.h"
#include "scheduler/generators.h"
#include "scheduler/pipefisher/pass.h"
#include "scheduler/placement.h"
#include "sim/parallel_cost_model.h"
#include "sim/simulator.h"

namespace pf::sim {
namespace {

using sched::OpKind;
using sched::ScheduleKind;

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

// Closed-form step time and peak memory (config_search.h).
void estimate(const ParallelCostModel& model, const SearchOptions& options, Candidate& c) {
  const sched::Schedule s = placement_only(params_of(c, options.model.num_layers));
  const int p = c.stages, m = c.microbatches, v = c.chunks;
  const auto by_worker = sched::chunks_by_worker(s.placement, p);
  std::vector<double> work(static_cast<std::size_t>(p), 0.0);
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

bool better(const Candidate& a, const Candidate& b) {
  if (a.simulated != b.simulated) return a.simulated;
  const double ta = a.kfac_run ? a.kfac_step_time_s : a.step_time_s;
  const double tb = b.kfac_run ? b.kfac_step_time_s : b.step_time_s;
  if (a.kfac_run != b.kfac_run) return a.kfac_run;
  if (ta != tb) return ta < tb;
  return a.peak_memory_bytes < b.peak_memory_bytes;
}

}  // namespace

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
  // One cost model per (t, b, recompute, state): the kernels are priced once.
  std::map<std::tuple<int, int, int, int, int>, std::shared_ptr<ParallelCostModel>> models;
  auto model_for = [&](int t, int b, Recompute r, int zero,
                       Offload offload) -> std::shared_ptr<ParallelCostModel> {
    const auto key = std::make_tuple(t, b, static_cast<int>(r), zero, static_cast<int>(offload));
    auto it = models.find(key);
    if (it != models.end()) return it->second;
    ParallelWorkload w;
    w.model = options.model;
    w.seq_len = options.seq_len;
    w.micro_batch_size = b;
    w.precision = options.precision;
    w.tensor_parallel = t;
    w.recompute = r;
    w.sharding = zero_sharding(zero);
    w.optimizer_offload = offload;
    std::shared_ptr<ParallelCostModel> model;
    try {
      model = std::make_shared<ParallelCostModel>(w, options.cluster);
    } catch (const std::invalid_argument&) {
      model = nullptr;  // t does not divide the heads: not a candidate
    }
    models.emplace(key, model);
    return model;
  };
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
                  ++result.enumerated;
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
                    ++result.invalid;
                    continue;
                  }
                  try {
                    sched::check_params(params_of(c, L));
                  } catch (const std::invalid_argument&) {
                    ++result.invalid;
                    continue;
                  }
                  estimate(*model, options, c);
                  if (c.memory_estimate_bytes > options.cluster.gpu_memory_bytes) {
                    ++result.out_of_memory;
                    continue;
                  }
                  feasible.push_back(c);
                }
              }
            }
          }
        }
      }
    }
  }
  std::sort(feasible.begin(), feasible.end(),
            [](const Candidate& a, const Candidate& b) { return a.estimate_s < b.estimate_s; });
  // The engine re-ranks the best estimates (and drops what does not fit after all).
  std::vector<Candidate> ranked;
  std::size_t next = 0;
  while (next < feasible.size() && result.simulated < options.simulate_top) {
    Candidate c = feasible[next++];
    const auto model = model_for(c.tensor_parallel, c.micro_batch_size, c.recompute, c.zero_stage,
                                 c.optimizer_offload);
    const sched::Schedule schedule = sched::compile(params_of(c, L));
    const SimResult sim = simulate(schedule, *model);
    ++result.simulated;
    double peak = 0.0;
    for (const auto& w : sim.workers) peak = std::max(peak, w.peak_memory_bytes);
    if (peak > options.cluster.gpu_memory_bytes) {
      ++result.out_of_memory;
      continue;
    }
    c.simulated = true;
    c.step_time_s = sim.step_time_s;
    c.bubble_fraction = sim.bubble_fraction;
    c.peak_memory_bytes = peak;
    ranked.push_back(c);
  }
  for (; next < feasible.size(); ++next) ranked.push_back(feasible[next]);
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
    for (Candidate& c : ranked) {
      if (runs >= options.kfac_top || !c.simulated) break;
      const auto model = model_for(c.tensor_parallel, c.micro_batch_size, c.recompute, c.zero_stage,
                                   c.optimizer_offload);
      const pipefisher::PassResult pass =
          pipefisher::run_pipefisher(sched::compile(params_of(c, L)), *model, *options.kfac);
      ++runs;
      c.kfac_run = true;
      c.utilization_before = pass.report.utilization_before;
      c.utilization_after = pass.report.utilization_after;
      c.kfac_step_time_s = pass.report.step_time_after_s;
      c.refresh_steps = pass.report.refresh_steps;
      c.refresh_bound = pass.report.refresh_bound;
      c.formula_refresh_steps = formula_refresh_steps(*model, options, c);
    }
    std::stable_sort(ranked.begin(), ranked.end(), better);
  }
  result.ranked = std::move(ranked);
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return result;
}

std::string search_table(const SearchOptions& options, const SearchResult& result, int top) {
  std::string out = "search: " + options.model.name + " on " + std::to_string(options.gpus) +
                    " GPUs of " + options.cluster.name + ", global batch " +
                    std::to_string(options.global_batch) +
                    ", S=" + std::to_string(options.seq_len) + ", " +
                    std::string(to_string(options.precision)) + "\n";
  out += std::to_string(result.enumerated) + " candidates: " + std::to_string(result.invalid) +
         " break a schedule's rules, " + std::to_string(result.out_of_memory) +
         " do not fit in memory, " + std::to_string(result.ranked.size()) + " fit; " +
         std::to_string(result.simulated) + " simulated; " + text("%.2f", result.seconds) + " s\n";
  const bool kfac = options.kfac.has_value();
  out +=
      "rank    t    p    d  schedule         b      m  recompute  state         step time  "
      "TFLOP/s/GPU    MFU  bubble   memory";
  if (kfac) out += "  util before -> after   k  formula k  step w/ K-FAC";
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
    if (c.kfac_run) {
      item["kfac"] = {{"utilization_before", c.utilization_before},
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
          {"enumerated", result.enumerated},
          {"invalid", result.invalid},
          {"out_of_memory", result.out_of_memory},
          {"fitting", result.ranked.size()},
          {"simulated", result.simulated},
          {"seconds", result.seconds},
          {"candidates", list}};
}

}  // namespace pf::sim
