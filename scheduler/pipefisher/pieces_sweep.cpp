#include "scheduler/pipefisher/pieces_sweep.h"

#include <exception>
#include <optional>
#include <stdexcept>

#include "runtime/model/bert_config.h"
#include "scheduler/compile.h"
#include "scheduler/pipefisher/timeline.h"
#include "scheduler/validate.h"
#include "sim/analytic_cost_model.h"
#include "sim/measured_cost_model.h"

namespace pf::pipefisher {
namespace {

using sched::OpKind;
using sched::ScheduleKind;

sim::AnalyticCostModel analytic_model(const SweepCase& config) {
  sim::Workload workload;
  workload.config = model::bert_preset(config.model);
  workload.seq_len = 128;
  workload.micro_batch_size = config.micro_batch;
  const sim::DeviceSpec device = sim::device_preset(config.device);
  // Mixed precision: bf16 where the device has it, fp16 otherwise; K-FAC in fp32.
  workload.precision = device.peak_bf16_flops > 0.0 ? sim::Precision::kBf16 : sim::Precision::kFp16;
  return sim::AnalyticCostModel(workload, device);
}

// A measured-format profile with the analytic model's per-chunk and per-Linear times (what a
// profile of PipeFisher's published per-layer times looks like), its per-task overhead included.
sim::MeasuredCostModel measured_from(const sim::AnalyticCostModel& analytic,
                                     const sched::Schedule& schedule) {
  sim::Profile profile;
  profile.description = "from the analytic model";
  for (int c = 0; c < schedule.placement.chunks_per_pipeline; ++c) {
    const auto& placed = schedule.placement.at(0, c);
    sched::Instruction in;
    in.pipeline = 0;
    in.chunk = c;
    in.microbatch = 0;
    sim::ChunkProfile chunk;
    chunk.chunk = c;
    in.kind = OpKind::kForward;
    chunk.forward_s = analytic.duration(schedule, placed.worker, in);
    in.kind = OpKind::kBackward;
    chunk.backward_s = analytic.duration(schedule, placed.worker, in);
    chunk.activation_bytes = analytic.activation_bytes(schedule, 0, c);
    chunk.static_bytes = analytic.static_bytes(schedule, 0, c);
    profile.chunks.push_back(chunk);
  }
  const auto& device = analytic.device();
  profile.communication = {device.link_bandwidth, device.link_latency_s,
                           sim::boundary_bytes(analytic.workload())};
  profile.reduction = {device.link_bandwidth, device.link_latency_s, 0.0};
  profile.kfac_task_overhead_s = device.kfac_task_overhead_s;
  profile.kfac_kind_overheads_s = device.kfac_kind_overheads_s;
  for (int l = 0; l < sched::kNumLinearKinds; ++l) {
    sched::Instruction in;
    in.layer = 0;
    in.linear = static_cast<sched::LinearKind>(l);
    sim::KfacProfile k;
    k.linear = in.linear;
    auto time = [&](OpKind kind) {
      in.kind = kind;
      return analytic.duration(schedule, 0, in);
    };
    k.curvature_a_s = time(OpKind::kCurvatureA);
    k.curvature_b_s = time(OpKind::kCurvatureB);
    k.invert_a_s = time(OpKind::kInvertA);
    k.invert_b_s = time(OpKind::kInvertB);
    k.precondition_s = time(OpKind::kPrecondition);
    k.bytes = analytic.kfac_bytes(schedule, 0, in.linear);
    profile.kfac.push_back(k);
  }
  return sim::MeasuredCostModel(profile, "sweep profile");
}

double pipefisher_own_overhead(const sim::CostModel& costs, const sched::Schedule& base,
                               int steps) {
  const sched::Schedule before = repeat_steps(base, steps);
  sched::Schedule after = before;
  const KfacOptions options;
  for (std::size_t w = 0; w < before.streams.size(); ++w) {
    auto& stream = after.streams[w];
    stream.clear();
    for (const auto& in : before.streams[w]) {
      if (in.kind == OpKind::kOptimizerStep) {
        for (const auto& chunk : base.placement.chunks) {
          if (chunk.worker != static_cast<int>(w)) continue;
          for (int layer = chunk.first_layer; layer < chunk.first_layer + chunk.num_layers;
               ++layer) {
            for (const auto linear : options.linears) {
              sched::Instruction precondition;
              precondition.kind = OpKind::kPrecondition;
              precondition.pipeline = static_cast<std::int8_t>(chunk.pipeline);
              precondition.chunk = chunk.chunk;
              precondition.step = in.step;
              precondition.layer = static_cast<std::int16_t>(layer);
              precondition.linear = linear;
              stream.push_back(precondition);
            }
          }
        }
      }
      stream.push_back(in);
    }
  }
  const double step_before = sim::simulate(before, costs).step_time_s;
  const double step_after = sim::simulate(after, costs).step_time_s;
  return step_before > 0.0 ? step_after / step_before - 1.0 : 0.0;
}

}  // namespace

std::string SweepCase::name() const {
  return costs + "/" + device + "/" + model + "/" + std::to_string(micro_batch) + "/" +
         std::to_string(stages) + "/" + std::string(sched::to_string(kind));
}

std::vector<SweepCase> pieces_sweep_cases() {
  std::vector<SweepCase> cases;
  for (const char* costs : {"analytic", "measured"}) {
    for (const char* device : {"p100", "v100", "a100", "h100"}) {
      for (const char* model : {"base", "large"}) {
        for (int micro_batch : {8, 16, 32}) {
          for (int stages : {4, 8, 16}) {
            for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB,
                                      ScheduleKind::kInterleaved, ScheduleKind::kChimera}) {
              cases.push_back(SweepCase{costs, device, model, micro_batch, stages, kind});
            }
          }
        }
      }
    }
  }
  return cases;
}

sched::Schedule sweep_schedule(const SweepCase& config) {
  sched::ScheduleParams params;
  params.kind = config.kind;
  params.workers = config.stages;
  params.microbatches = config.stages;
  params.chunks_per_worker = config.kind == ScheduleKind::kInterleaved ? 2 : 1;
  params.num_layers = config.stages * params.chunks_per_worker;  // one layer per stage
  return sched::compile(params);
}

SweepResult run_sweep_case(const SweepCase& config, const KfacOptions& options) {
  SweepResult result;
  result.config = config;
  const auto analytic = analytic_model(config);
  const auto base = sweep_schedule(config);
  std::optional<sim::MeasuredCostModel> measured;
  if (config.costs == "measured") measured = measured_from(analytic, base);
  const sim::CostModel& costs = measured ? static_cast<const sim::CostModel&>(*measured) : analytic;
  KfacOptions split = options;
  split.split = true;
  KfacOptions whole = options;
  whole.split = false;
  try {
    const PassResult pass = run_pipefisher(base, costs, split);
    result.split = pass.report;
    try {
      sched::validate(pass.schedule);
    } catch (const std::invalid_argument& error) {
      result.invalid = error.what();
    }
    result.pipefisher_overhead = pipefisher_own_overhead(costs, base, result.split.refresh_steps);
  } catch (const std::exception& error) {
    result.refused = error.what();
  }
  try {
    result.whole = run_pipefisher(base, costs, whole).report;
  } catch (const std::exception& error) {
    result.whole_refused = error.what();
  }
  return result;
}

SweepSummary summarize(const std::vector<SweepResult>& results) {
  SweepSummary summary;
  for (const SweepResult& r : results) {
    ++summary.configurations;
    if (!r.whole_refused.empty()) ++summary.whole_refused;
    if (!r.refused.empty()) {
      ++summary.refused;
      continue;
    }
    const int k = r.split.refresh_steps;
    if (k == r.split.refresh_bound) ++summary.at_bound;
    if (r.whole_refused.empty() && r.whole.refresh_steps == r.whole.refresh_bound) {
      ++summary.whole_at_bound;
    }
    if (k == r.split.release_bound) ++summary.at_release_bound;
    if (k == r.split.usable_bound) ++summary.at_usable_bound;
    if (!r.invalid.empty()) ++summary.invalid;
    if (k <= r.split.refresh_bound + 1) ++summary.within_one;
    if (k > r.split.refresh_bound + 1) ++summary.above_bound_plus_one;
    if (r.capped_below_bound()) ++summary.capped_below_bound;
    if (r.split.step_time_overhead <= r.pipefisher_overhead + 1e-3) ++summary.not_costlier;
    const int plain = r.split.plain_refresh_steps >= 0 ? r.split.plain_refresh_steps : k;
    if (plain == r.split.refresh_bound) ++summary.plain_at_bound;
    if (plain <= r.split.refresh_bound + 1) ++summary.plain_within_one;
    if (r.split.pipelined_refresh) ++summary.pipelined_plans;
    if (r.split.wrapped_tasks > 0) ++summary.wrapping_plans;
  }
  return summary;
}

}  // namespace pf::pipefisher
