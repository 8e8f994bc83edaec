#include "scheduler/pipefisher/kfac_work.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>

namespace pf::pipefisher {
namespace {

using sched::Instruction;
using sched::OpKind;

bool produces_weight_gradient(OpKind kind) {
  return kind == OpKind::kBackward || kind == OpKind::kBackwardWeight;
}

bool produces_output_gradient(OpKind kind) {
  return kind == OpKind::kBackward || kind == OpKind::kBackwardInput;
}

void check_base(const sched::Schedule& base) {
  if (base.num_steps != 1) {
    throw std::invalid_argument(
        "PipeFisher pass: the base schedule must be a one-step schedule, got "
        "num_steps = " +
        std::to_string(base.num_steps));
  }
  for (int w = 0; w < base.num_workers(); ++w) {
    const auto& stream = base.streams[static_cast<std::size_t>(w)];
    for (std::size_t x = 0; x < stream.size(); ++x) {
      if (stream[x].step != 0) {
        throw std::invalid_argument("PipeFisher pass: base stream of worker " + std::to_string(w) +
                                    ", position " + std::to_string(x) + " has step " +
                                    std::to_string(stream[x].step) + " (expected 0)");
      }
      if (sched::is_kfac(stream[x].kind)) {
        throw std::invalid_argument("PipeFisher pass: base stream of worker " + std::to_string(w) +
                                    ", position " + std::to_string(x) +
                                    " already holds K-FAC work (" + sched::short_label(stream[x]) +
                                    ")");
      }
    }
  }
}

std::vector<char> selected_layers(const sched::Schedule& base, const KfacOptions& options) {
  const int num_layers = base.placement.num_layers;
  std::vector<char> selected(static_cast<std::size_t>(std::max(num_layers, 0)),
                             options.layers.empty() ? 1 : 0);
  for (int layer : options.layers) {
    if (layer < 0 || layer >= num_layers) {
      throw std::invalid_argument("--kfac-layers: layer " + std::to_string(layer) +
                                  " is out of range (the model has " + std::to_string(num_layers) +
                                  " encoder layers)");
    }
    selected[static_cast<std::size_t>(layer)] = 1;
  }
  return selected;
}

// The preconditioned (layer, linear) pairs of one chunk.
std::vector<HeldLinear> chunk_linears(const sched::ChunkPlacement& chunk,
                                      const std::vector<char>& selected,
                                      const KfacOptions& options) {
  std::vector<HeldLinear> out;
  for (int layer = chunk.first_layer; layer < chunk.first_layer + chunk.num_layers; ++layer) {
    if (layer < 0 || layer >= static_cast<int>(selected.size())) {
      throw std::invalid_argument("placement: chunk " + std::to_string(chunk.chunk) +
                                  " of pipeline " + std::to_string(chunk.pipeline) +
                                  " holds layer " + std::to_string(layer) + " outside [0, " +
                                  std::to_string(selected.size()) + ")");
    }
    if (!selected[static_cast<std::size_t>(layer)]) continue;
    for (sched::LinearKind linear : options.linears) out.push_back({layer, linear});
  }
  return out;
}

const sched::ChunkPlacement& chunk_of(const sched::Schedule& base, const Instruction& in, int w,
                                      std::size_t x) {
  if (in.pipeline < 0 || in.pipeline >= base.placement.num_pipelines || in.chunk < 0 ||
      in.chunk >= base.placement.chunks_per_pipeline) {
    throw std::invalid_argument("PipeFisher pass: worker " + std::to_string(w) + ", position " +
                                std::to_string(x) + ": " + sched::short_label(in) +
                                " names a chunk the placement does not have");
  }
  return base.placement.at(in.pipeline, in.chunk);
}

Instruction kfac_instruction(OpKind kind, int pipeline, int chunk, int step, int microbatch,
                             const HeldLinear& held) {
  Instruction in;
  in.kind = kind;
  in.pipeline = static_cast<std::int8_t>(pipeline);
  in.chunk = chunk;
  in.step = static_cast<std::int16_t>(step);
  in.microbatch = microbatch;
  in.layer = static_cast<std::int16_t>(held.layer);
  in.linear = held.linear;
  return in;
}

// (worker, layer, linear): one factor pair held on one worker.
using FactorKey = std::tuple<int, int, int>;
FactorKey key(int worker, const HeldLinear& held) {
  return {worker, held.layer, static_cast<int>(held.linear)};
}

}  // namespace

StateBroadcasts state_broadcasts(const sched::Schedule& base, const KfacOptions& options) {
  const int replicas = std::max(1, base.params.data_parallel);
  kfac::validate_placement(options.state_placement, replicas);
  StateBroadcasts out;
  const int factor_holders = options.state_placement.factors.holders(replicas);
  const int inverse_holders = options.state_placement.inverses.holders(replicas);
  out.inverse_receivers = inverse_holders - factor_holders;
  out.gradient_receivers = replicas - inverse_holders;
  if ((out.inverse_receivers > 0 || out.gradient_receivers > 0) &&
      base.placement.num_pipelines > 1) {
    throw std::invalid_argument("--kfac-sharding " + kfac::to_string(options.state_placement) +
                                ": sharded K-FAC state needs a schedule with one pipeline (" +
                                "Chimera's two replicas of a stage sync their factors too); use "
                                "--kfac-sharding replicate");
  }
  if ((out.inverse_receivers > 0 || out.gradient_receivers > 0) && options.linear_dims.empty()) {
    throw std::invalid_argument(
        "--kfac-sharding " + kfac::to_string(options.state_placement) +
        ": the pass needs the Linears' dimensions (KfacOptions::linear_dims) to size the "
        "broadcasts");
  }
  return out;
}

std::vector<std::vector<HeldLinear>> preconditioned_linears(const sched::Schedule& base,
                                                            const KfacOptions& options) {
  const auto selected = selected_layers(base, options);
  std::vector<std::vector<HeldLinear>> held(static_cast<std::size_t>(base.num_workers()));
  for (const auto& chunk : base.placement.chunks) {
    if (chunk.worker < 0 || chunk.worker >= base.num_workers()) {
      throw std::invalid_argument(
          "placement: chunk " + std::to_string(chunk.chunk) + " of pipeline " +
          std::to_string(chunk.pipeline) + " is on worker " + std::to_string(chunk.worker) +
          " but the schedule has " + std::to_string(base.num_workers()) + " workers");
    }
    for (const auto& linear : chunk_linears(chunk, selected, options)) {
      held[static_cast<std::size_t>(chunk.worker)].push_back(linear);
    }
  }
  return held;
}

KfacWork build_kfac_work(const sched::Schedule& base, const KfacOptions& options, int refresh_steps,
                         const DurationFn& duration) {
  options.validate();
  check_base(base);
  if (refresh_steps < 1) {
    throw std::invalid_argument("build_kfac_work: refresh_steps must be >= 1, got " +
                                std::to_string(refresh_steps));
  }
  if (base.placement.num_layers > sched::kMaxKfacLayer + 1) {
    throw std::invalid_argument("PipeFisher pass: the model has " +
                                std::to_string(base.placement.num_layers) +
                                " encoder layers; K-FAC instructions address at most " +
                                std::to_string(sched::kMaxKfacLayer + 1));
  }
  const auto selected = selected_layers(base, options);
  const StateBroadcasts broadcasts = state_broadcasts(base, options);
  const auto dims_of = [&](sched::LinearKind linear) {
    return options.linear_dims[static_cast<std::size_t>(linear)];
  };
  const int curvature_steps = options.curvature == CurvatureSource::kFirstStep ? 1 : refresh_steps;
  const int last_curvature_step = curvature_steps - 1;

  KfacWork work;
  work.refresh_steps = refresh_steps;
  auto add = [&](int worker, Instruction in, SmallVector<BaseRef, 1> base_deps,
                 SmallVector<int, 2> task_deps, int step_bound) {
    KfacTask task;
    task.workers = {worker};
    task.duration_s = duration(worker, in);
    task.instructions = {in};
    task.base_deps = std::move(base_deps);
    task.task_deps = std::move(task_deps);
    task.step_bound = step_bound;
    work.tasks.push_back(std::move(task));
    return static_cast<int>(work.tasks.size()) - 1;
  };

  // The preconditioned Linears of every chunk, computed once.
  std::vector<std::vector<HeldLinear>> linears_of_chunk;
  linears_of_chunk.reserve(base.placement.chunks.size());
  for (const auto& chunk : base.placement.chunks) {
    linears_of_chunk.push_back(chunk_linears(chunk, selected, options));
  }
  // `chunk` is always an element of base.placement.chunks (from Placement::at).
  auto linears_of = [&](const sched::ChunkPlacement& chunk) -> const std::vector<HeldLinear>& {
    return linears_of_chunk[static_cast<std::size_t>(&chunk - base.placement.chunks.data())];
  };
  std::size_t curvature_count = 0;
  for (int w = 0; w < base.num_workers(); ++w) {
    for (std::size_t x = 0; x < base.streams[static_cast<std::size_t>(w)].size(); ++x) {
      const Instruction& in = base.streams[static_cast<std::size_t>(w)][x];
      if (in.kind == OpKind::kForward || produces_output_gradient(in.kind)) {
        curvature_count += linears_of(chunk_of(base, in, w, x)).size();
      }
    }
  }
  work.tasks.reserve(curvature_count * static_cast<std::size_t>(curvature_steps) +
                     4 * base.placement.chunks.size() * options.linears.size() *
                         static_cast<std::size_t>(refresh_steps + 3));

  // Curvature: A after each forward, B after each backward that yields output gradients.
  std::map<FactorKey, std::vector<int>> curvature_a, curvature_b;
  for (OpKind kind : {OpKind::kCurvatureA, OpKind::kCurvatureB}) {
    for (int step = 0; step < curvature_steps; ++step) {
      for (int w = 0; w < base.num_workers(); ++w) {
        const auto& stream = base.streams[static_cast<std::size_t>(w)];
        for (std::size_t x = 0; x < stream.size(); ++x) {
          const Instruction& in = stream[x];
          const bool source = kind == OpKind::kCurvatureA ? in.kind == OpKind::kForward
                                                          : produces_output_gradient(in.kind);
          if (!source) continue;
          const auto& chunk = chunk_of(base, in, w, x);
          for (const auto& held : linears_of(chunk)) {
            const int id =
                add(w, kfac_instruction(kind, in.pipeline, in.chunk, step, in.microbatch, held),
                    {BaseRef{w, static_cast<int>(x), step}}, {}, -1);
            (kind == OpKind::kCurvatureA ? curvature_a : curvature_b)[key(w, held)].push_back(id);
          }
        }
      }
    }
  }

  // Where each (layer, linear) lives: its replicas (two for Chimera) and their chunks.
  struct Replica {
    int worker;
    int pipeline;
    int chunk;
  };
  std::map<std::pair<int, int>, std::vector<Replica>> replicas;
  for (const auto& chunk : base.placement.chunks) {
    for (const auto& held : chunk_linears(chunk, selected, options)) {
      replicas[{held.layer, static_cast<int>(held.linear)}].push_back(
          {chunk.worker, chunk.pipeline, chunk.chunk});
    }
  }

  // Curvature sync across the replicas (Chimera's two pipelines and/or data parallelism).
  const bool needs_sync = base.placement.num_pipelines > 1 || base.params.data_parallel > 1;
  std::map<FactorKey, int> sync_of;
  if (needs_sync) {
    for (const auto& [layer_linear, where] : replicas) {
      const HeldLinear held{layer_linear.first,
                            static_cast<sched::LinearKind>(layer_linear.second)};
      KfacTask task;
      for (std::size_t r = 0; r < where.size(); ++r) {
        Instruction in = kfac_instruction(OpKind::kCurvatureSync, where[r].pipeline, where[r].chunk,
                                          last_curvature_step, -1, held);
        // Two replicas exchange with each other; data-parallel peers are outside the schedule.
        if (where.size() == 2) in.peer = where[1 - r].worker;
        task.workers.push_back(where[r].worker);
        task.instructions.push_back(in);
        task.duration_s = std::max(task.duration_s, duration(where[r].worker, in));
        for (const auto* factor : {&curvature_a, &curvature_b}) {
          auto it = factor->find(key(where[r].worker, held));
          if (it != factor->end()) {
            task.task_deps.insert(task.task_deps.end(), it->second.begin(), it->second.end());
          }
        }
      }
      if (where.size() > 2) {
        throw std::invalid_argument("PipeFisher pass: layer " + std::to_string(held.layer) +
                                    " is held by " + std::to_string(where.size()) +
                                    " chunks; at most two replicas are supported");
      }
      work.tasks.push_back(std::move(task));
      const int id = static_cast<int>(work.tasks.size()) - 1;
      for (const auto& replica : where) sync_of[key(replica.worker, held)] = id;
    }
  }

  // Inversions on every replica (each holds the synced factors), then preconditions.
  std::map<FactorKey, std::vector<int>> inversions;
  for (OpKind kind : {OpKind::kInvertA, OpKind::kInvertB}) {
    for (const auto& [layer_linear, where] : replicas) {
      const HeldLinear held{layer_linear.first,
                            static_cast<sched::LinearKind>(layer_linear.second)};
      for (const auto& replica : where) {
        std::vector<int> deps;
        const FactorKey k = key(replica.worker, held);
        if (auto it = sync_of.find(k); it != sync_of.end()) {
          deps.push_back(it->second);
        } else {
          // Both factors: the pi-adjusted damping of either inverse needs both (damping.h).
          for (const auto* factor : {&curvature_a, &curvature_b}) {
            if (auto f = factor->find(k); f != factor->end()) {
              deps.insert(deps.end(), f->second.begin(), f->second.end());
            }
          }
        }
        inversions[k].push_back(add(
            replica.worker,
            kfac_instruction(kind, replica.pipeline, replica.chunk, last_curvature_step, -1, held),
            {}, std::move(deps), -1));
      }
    }
  }

  // Sharded inverses: the owner sends both inverses to the holders without factors; the
  // refresh's last preconditions wait for them instead of the inversions.
  if (broadcasts.inverse_receivers > 0) {
    for (const auto& [layer_linear, where] : replicas) {
      const HeldLinear held{layer_linear.first,
                            static_cast<sched::LinearKind>(layer_linear.second)};
      for (const auto& replica : where) {
        const FactorKey k = key(replica.worker, held);
        Instruction in = kfac_instruction(OpKind::kBroadcastInverses, replica.pipeline,
                                          replica.chunk, last_curvature_step, -1, held);
        const auto dims = dims_of(held.linear);
        in.bytes =
            broadcasts.inverse_receivers * 4 * (dims.d_in * dims.d_in + dims.d_out * dims.d_out);
        const int id = add(replica.worker, in, {}, inversions[k], -1);
        inversions[k] = {id};
      }
    }
  }

  // Preconditioning: after the step's last weight-gradient backward of the chunk and after its
  // gradient reductions (Chimera's replicas, data parallelism), so that every replica
  // preconditions the same reduced gradient. The refresh's last step uses the new inverses;
  // earlier steps use the previous refresh's (pipelined: every step does).
  for (int step = 0; step < refresh_steps; ++step) {
    for (int w = 0; w < base.num_workers(); ++w) {
      const auto& stream = base.streams[static_cast<std::size_t>(w)];
      std::map<std::pair<int, int>, int> last_backward;  // (pipeline, chunk) -> position
      for (std::size_t x = 0; x < stream.size(); ++x) {
        if (produces_weight_gradient(stream[x].kind)) {
          chunk_of(base, stream[x], w, x);
          last_backward[{stream[x].pipeline, stream[x].chunk}] = static_cast<int>(x);
        }
        if (stream[x].kind == OpKind::kReduceGradPipelines ||
            stream[x].kind == OpKind::kReduceGradDataParallel) {
          last_backward[{stream[x].pipeline, stream[x].chunk}] = static_cast<int>(x);
        }
      }
      for (const auto& [pipeline_chunk, position] : last_backward) {
        const auto& chunk = base.placement.at(pipeline_chunk.first, pipeline_chunk.second);
        for (const auto& held : linears_of(chunk)) {
          std::vector<int> deps;
          // Pipelined: the new inverses serve from the next window's first step (the pass
          // places the inversions before that step's preconditioning), none of this window.
          if (step == refresh_steps - 1 && !options.pipelined_refresh) {
            deps = inversions[key(w, held)];
          }
          const int precondition = add(w,
                                       kfac_instruction(OpKind::kPrecondition, pipeline_chunk.first,
                                                        pipeline_chunk.second, step, -1, held),
                                       {BaseRef{w, position, step}}, std::move(deps), step);
          if (broadcasts.gradient_receivers > 0) {
            // Sharded inverses: the owner sends the preconditioned gradient to the replicas
            // without them, before the step's optimizer step.
            Instruction in = kfac_instruction(OpKind::kBroadcastGradient, pipeline_chunk.first,
                                              pipeline_chunk.second, step, -1, held);
            const auto dims = dims_of(held.linear);
            in.bytes = broadcasts.gradient_receivers * 4 * (dims.d_in * dims.d_out + dims.d_out);
            add(w, in, {}, {precondition}, step);
          }
        }
      }
    }
  }
  return work;
}

}  // namespace pf::pipefisher
