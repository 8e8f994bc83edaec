// K-FAC state placed across data-parallel replicas (kfac/state_placement.h): memory per rank
// and bytes sent per refresh for every placement, measured against the cost model
// (docs/benchmarks.md, "K-FAC state across data-parallel replicas"). Run as
//
//   mpirun -np <stages x data-parallel> bench_kfac_sharding [--model mini] [--stages 2]
//          [--data-parallel 2] [--microbatches 4] [--micro-batch-size 2] [--seq-len 32]
//          [--refresh 2] [--rounds 2]
//   bench_kfac_sharding --simulate [--model large] [--stages 4] [--data-parallel 8]
//          [--microbatches 8] [--micro-batch-size 32] [--seq-len 128]
//   mpirun -np 4 bench_kfac_sharding --smoke    (a tiny model, for the test suite)
//
// Measured: for each valid placement (kfac::choose_state_placement's candidates), the
// PipeFisher pass places K-FAC with that placement at a fixed refresh interval, MpiExecutor runs
// `rounds` refreshes of 1F1B (LAMB, synthetic batches), and every rank reports the K-FAC state
// it holds at the end (factor values and inverses) and the payload bytes it handed to MPI in
// K-FAC collectives (factor all-reduce, broadcasts of inverses and preconditioned gradients),
// per refresh. The model column is kfac::state_cost for the same rank; the busiest rank of each
// is shown, and the step time of the run.
// Simulated: the same placements for a larger model on the analytic cost model (H100 links),
// through the PipeFisher pass: the busiest replica's K-FAC memory and bytes per refresh, the
// refresh interval the bubbles allow and the step time.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "kfac/state_placement.h"
#include "runtime/comm/mpi_communicator.h"
#include "runtime/executor/batch_source.h"
#include "runtime/executor/measured.h"
#include "runtime/executor/mpi_executor.h"
#include "runtime/optim/lamb.h"
#include "scheduler/compile.h"
#include "scheduler/pipefisher/kfac_work.h"
#include "scheduler/pipefisher/pass.h"
#include "sim/analytic_cost_model.h"
#include "sim/bert_costs.h"
#include "sim/uniform_cost_model.h"

namespace {

using namespace pf;

struct Settings {
  bool simulate = false;
  std::string model = "mini";
  int stages = 2;
  int data_parallel = 2;
  int microbatches = 4;
  std::int64_t micro_batch_size = 2;
  std::int64_t seq_len = 32;
  int refresh = 2;
  int rounds = 2;
};

int parse_count(const std::string& flag, const char* value) {
  char* end = nullptr;
  const long parsed = std::strtol(value, &end, 10);
  if (end == value || *end != '\0' || parsed < 1 || parsed > 1 << 20) {
    throw std::invalid_argument(flag + " " + value + ": not a count >= 1");
  }
  return static_cast<int>(parsed);
}

Settings parse(int argc, char** argv) {
  Settings s;
  bool model_given = false, shape_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--smoke") {
      s.model = "tiny";
      s.micro_batch_size = 2;
      s.seq_len = 8;
      s.microbatches = 4;
      s.rounds = 1;
      model_given = shape_given = true;
      continue;
    }
    if (flag == "--simulate") {
      s.simulate = true;
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument(flag + ": needs a value (see the header)");
    const char* value = argv[++i];
    if (flag == "--model") {
      s.model = value;
      model_given = true;
    } else if (flag == "--stages") {
      s.stages = parse_count(flag, value);
      shape_given = true;
    } else if (flag == "--data-parallel") {
      s.data_parallel = parse_count(flag, value);
      shape_given = true;
    } else if (flag == "--microbatches") {
      s.microbatches = parse_count(flag, value);
    } else if (flag == "--micro-batch-size") {
      s.micro_batch_size = parse_count(flag, value);
    } else if (flag == "--seq-len") {
      s.seq_len = parse_count(flag, value);
    } else if (flag == "--refresh") {
      s.refresh = parse_count(flag, value);
    } else if (flag == "--rounds") {
      s.rounds = parse_count(flag, value);
    } else {
      throw std::invalid_argument("unknown flag " + flag +
                                  " (see the header of bench_kfac_sharding.cpp)");
    }
  }
  if (s.simulate && !model_given) s.model = "large";
  if (s.simulate && !shape_given) {
    s.stages = 4;
    s.data_parallel = 8;
    s.microbatches = 8;
    s.micro_batch_size = 32;
    s.seq_len = 128;
  }
  return s;
}

std::vector<kfac::LinearDims> linear_dims_of(const model::BertConfig& config) {
  return pipefisher::encoder_linear_dims(config.hidden_size, config.intermediate_size);
}

// Each worker's Linears in the executor's order (layer, then kind), as dimensions.
std::vector<std::vector<kfac::LinearDims>> worker_dims(const sched::Schedule& schedule,
                                                       const pipefisher::KfacOptions& options) {
  std::vector<std::vector<kfac::LinearDims>> out;
  for (auto held : pipefisher::preconditioned_linears(schedule, options)) {
    std::sort(held.begin(), held.end(), [](const auto& a, const auto& b) {
      return std::make_pair(a.layer, static_cast<int>(a.linear)) <
             std::make_pair(b.layer, static_cast<int>(b.linear));
    });
    std::vector<kfac::LinearDims> dims;
    for (const auto& linear : held) {
      dims.push_back(options.linear_dims[static_cast<std::size_t>(linear.linear)]);
    }
    out.push_back(std::move(dims));
  }
  return out;
}

sched::ScheduleParams schedule_params(const Settings& s, const model::BertConfig& config) {
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = s.stages;
  params.microbatches = s.microbatches;
  params.num_layers = config.num_layers;
  params.data_parallel = s.data_parallel;
  return params;
}

constexpr double kMiB = 1024.0 * 1024.0;

int simulate(const Settings& s) {
  const auto config = model::bert_preset(s.model);
  sim::Workload workload;
  workload.config = config;
  workload.seq_len = s.seq_len;
  workload.micro_batch_size = s.micro_batch_size;
  const sim::AnalyticCostModel costs(workload, sim::resolve_device("h100"));
  const auto base = sched::compile(schedule_params(s, config));
  pipefisher::KfacOptions options;
  options.linear_dims = linear_dims_of(config);
  const auto dims = worker_dims(base, options);
  const auto candidates =
      kfac::choose_state_placement(dims, s.data_parallel, 1, kfac::PlacementMachine{}).candidates;
  std::printf(
      "BERT %s, 1F1B p = %d, DP = %d, %d micro-batches of %lld x %lld, analytic cost model "
      "(h100); per worker, its busiest replica\n",
      s.model.c_str(), s.stages, s.data_parallel, s.microbatches,
      static_cast<long long>(s.micro_batch_size), static_cast<long long>(s.seq_len));
  std::printf("%-36s %14s %18s %4s %14s\n", "placement", "K-FAC MiB/rank", "MiB sent/refresh", "k",
              "step overhead");
  for (const auto& candidate : candidates) {
    options.state_placement = candidate.placement;
    const auto pass = pipefisher::run_pipefisher(base, costs, options);
    std::printf("%-36s %14.1f %18.1f %4d %13.2f%%\n", kfac::to_string(candidate.placement).c_str(),
                pass.report.kfac_memory_bytes / kMiB,
                pass.report.kfac_sent_bytes_per_refresh / kMiB, pass.report.refresh_steps,
                100.0 * pass.report.step_time_overhead);
  }
  options.automatic_placement = true;
  const auto chosen = pipefisher::run_pipefisher(base, costs, options);
  std::printf("auto chooses: %s\n", chosen.report.state_placement.c_str());
  return 0;
}

exec::RunSetup<float> make_setup(const model::BertConfig& config, const sched::Schedule& schedule,
                                 exec::BatchSource& batches,
                                 const kfac::StatePlacement& placement) {
  exec::RunSetup<float> setup;
  setup.config = config;
  setup.schedule = schedule;
  setup.options.threads_per_worker = 1;
  setup.options.init_seed = 1;
  setup.options.dropout_seed = 2;
  setup.options.record_events = true;
  setup.options.wait_timeout = std::chrono::minutes(10);
  setup.options.kfac.placement = placement;
  setup.make_optimizer = [] { return std::make_unique<optim::Lamb>(); };
  setup.learning_rate = [](std::int64_t) { return 1e-3; };
  setup.batches = &batches;
  return setup;
}

int measure(const Settings& s, comm::MpiCommunicator& comm) {
  const auto config = model::bert_preset(s.model);
  const auto base = sched::compile(schedule_params(s, config));
  const int ranks = s.stages * s.data_parallel;
  if (comm.size() != ranks) {
    throw std::invalid_argument(exec::mpi_layout_error(comm.size(), s.stages, s.data_parallel));
  }
  const bool root = comm.rank() == 0;
  const auto predictions = std::max<std::int64_t>(1, (s.seq_len * 15 + 50) / 100);
  // Positions only: the pass needs durations, the placements' memory and bytes do not.
  sim::UniformCosts costs{.forward_s = 1.0, .backward_s = 2.0, .communication_s = 0.05};
  costs.curvature_a_s = costs.curvature_b_s = 0.05;
  costs.invert_a_s = costs.invert_b_s = 0.2;
  costs.precondition_s = costs.curvature_sync_s = 0.02;
  pipefisher::KfacOptions options;
  options.refresh_steps = s.refresh;
  options.linear_dims = linear_dims_of(config);
  const auto dims = worker_dims(base, options);
  const auto candidates =
      kfac::choose_state_placement(dims, s.data_parallel, s.refresh, kfac::PlacementMachine{})
          .candidates;
  if (root) {
    std::printf(
        "BERT %s (hidden %d, intermediate %d, %d layers), 1F1B p = %d, DP = %d (%d MPI ranks), "
        "%d micro-batches of %lld x %lld, refresh every %d steps, %d refresh(es) measured\n",
        s.model.c_str(), config.hidden_size, config.intermediate_size, config.num_layers, s.stages,
        s.data_parallel, ranks, s.microbatches, static_cast<long long>(s.micro_batch_size),
        static_cast<long long>(s.seq_len), s.refresh, s.rounds);
    std::printf("%-36s %22s %26s %12s\n", "placement", "K-FAC MiB/rank (model)",
                "MiB sent/refresh (model)", "s/step");
  }
  const auto far = [] { return comm::Clock::now() + std::chrono::hours(1); };
  for (const auto& candidate : candidates) {
    options.state_placement = candidate.placement;
    const auto schedule =
        pipefisher::run_pipefisher(base, sim::UniformCostModel(costs), options).schedule;
    comm.barrier(far());
    exec::SyntheticBatches batches(config, s.micro_batch_size, s.seq_len, predictions, 3);
    exec::MpiExecutor<float> executor(make_setup(config, schedule, batches, candidate.placement),
                                      comm);
    executor.run(0, static_cast<std::int64_t>(s.rounds) * schedule.num_steps, {});
    const auto events = executor.take_events();
    const auto states = executor.kfac_state_per_rank();
    if (!root) continue;
    std::int64_t held = 0, model_held = 0, sent = 0, model_sent = 0;
    for (int r = 0; r < ranks; ++r) {
      const int worker = r % s.stages, replica = r / s.stages;
      const auto& layers = dims[static_cast<std::size_t>(worker)];
      const auto cost = kfac::state_cost(
          kfac::plan_state(layers, s.data_parallel, candidate.placement), layers, s.refresh);
      const auto state = states[static_cast<std::size_t>(r)];
      held = std::max(held, state.state_bytes);
      sent = std::max(sent, state.sent_bytes / s.rounds);
      model_held = std::max(model_held, cost.memory_bytes[static_cast<std::size_t>(replica)]);
      model_sent =
          std::max(model_sent, cost.sent_bytes_per_refresh[static_cast<std::size_t>(replica)]);
    }
    const double step_s = exec::summarize_run(events, ranks, 1).step_time_s;
    std::printf("%-36s %9.3f (%9.3f) %12.3f (%11.3f) %12.3f\n",
                kfac::to_string(candidate.placement).c_str(), static_cast<double>(held) / kMiB,
                static_cast<double>(model_held) / kMiB, static_cast<double>(sent) / kMiB,
                static_cast<double>(model_sent) / kMiB, step_s);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Settings settings;
  try {
    settings = parse(argc, argv);
  } catch (const std::exception& error) {
    std::cerr << "bench_kfac_sharding: error: " << error.what() << "\n";
    return 2;
  }
  if (settings.simulate) {
    try {
      return simulate(settings);
    } catch (const std::exception& error) {
      std::cerr << "bench_kfac_sharding: error: " << error.what() << "\n";
      return 2;
    }
  }
  std::optional<comm::MpiSession> session;
  try {
    session.emplace(&argc, &argv);
  } catch (const std::exception& error) {
    std::cerr << "bench_kfac_sharding: " << error.what() << "\n";
    return 2;
  }
  comm::MpiCommunicator comm(*session);
  try {
    return measure(settings, comm);
  } catch (const std::invalid_argument& error) {
    if (comm.rank() == 0) std::cerr << "bench_kfac_sharding: error: " << error.what() << "\n";
    return 2;
  } catch (const std::exception& error) {
    comm.abort(std::string("bench_kfac_sharding: ") + error.what());
  }
}
