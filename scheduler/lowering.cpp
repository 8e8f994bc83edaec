#include "scheduler/lowering.h"

#include <stdexcept>
#include <string>
#include <vector>

#include "scheduler/key_space.h"
#include "scheduler/placement.h"

namespace pf::sched {
namespace {

std::string where(int worker, std::size_t position, const Instruction& in) {
  return "worker " + std::to_string(worker) + " position " + std::to_string(position) + " (" +
         short_label(in) + ")";
}

enum class WorkerState : std::uint8_t { kRunning, kEpilogue, kDone };

class Lowerer {
 public:
  Lowerer(Schedule& schedule, const LoweringOptions& options)
      : schedule_(schedule), options_(options), placement_(schedule.placement) {
    const ScheduleParams& params = schedule.params;
    workers_ = schedule.num_workers();
    if (workers_ != params.workers) {
      throw std::invalid_argument("cannot lower: the schedule has " + std::to_string(workers_) +
                                  " streams but its parameters say " +
                                  std::to_string(params.workers) + " workers");
    }
    if (schedule.num_steps < 1) {
      throw std::invalid_argument("cannot lower: num_steps must be >= 1, got " +
                                  std::to_string(schedule.num_steps));
    }
    const int pipelines = placement_.num_pipelines;
    if (pipelines < 1 || pipelines > 2 ||
        placement_.chunks.size() !=
            static_cast<std::size_t>(pipelines * placement_.chunks_per_pipeline)) {
      throw std::invalid_argument("cannot lower: the placement is inconsistent (" +
                                  std::to_string(pipelines) + " pipelines, " +
                                  std::to_string(placement_.chunks.size()) + " chunks)");
    }
    if (params.microbatches % pipelines != 0) {
      throw std::invalid_argument("cannot lower: " + std::to_string(params.microbatches) +
                                  " micro-batches do not split over " + std::to_string(pipelines) +
                                  " pipelines");
    }
    keys_ = KeySpace{schedule.num_steps, pipelines, placement_.chunks_per_pipeline,
                     params.microbatches / pipelines};
    if (keys_.size() > schedule.num_instructions()) {
      throw std::invalid_argument(
          "cannot lower: the parameters call for " + std::to_string(keys_.size()) +
          " forwards (steps x pipelines x chunks x micro-batches) but the streams hold only " +
          std::to_string(schedule.num_instructions()) + " instructions");
    }
    forward_done_.assign(keys_.size(), 0);
    backward_done_.assign(keys_.size(), 0);
    weight_done_count_.assign(keys_.num_chunk_keys(), 0);
    reduction_emitted_.assign(
        static_cast<std::size_t>(schedule.num_steps) * static_cast<std::size_t>(keys_.chunks), 0);
    chunks_of_worker_ = chunks_by_worker(placement_, workers_);
  }

  Schedule run() {
    std::vector<std::vector<Instruction>> input = std::move(schedule_.streams);
    check_input(input);
    out_.assign(static_cast<std::size_t>(workers_), {});
    for (int w = 0; w < workers_; ++w) {
      out_[static_cast<std::size_t>(w)].reserve(input[static_cast<std::size_t>(w)].size() * 3 + 8);
    }
    std::vector<std::size_t> head(static_cast<std::size_t>(workers_), 0);
    std::vector<int> step(static_cast<std::size_t>(workers_), -1);
    std::vector<WorkerState> state(static_cast<std::size_t>(workers_), WorkerState::kRunning);

    while (true) {
      bool progress = false;
      bool all_done = true;
      for (int w = 0; w < workers_; ++w) {
        const auto wi = static_cast<std::size_t>(w);
        if (state[wi] == WorkerState::kDone) continue;
        all_done = false;
        if (state[wi] == WorkerState::kEpilogue) continue;
        const std::vector<Instruction>& stream = input[wi];
        if (head[wi] == stream.size()) {
          state[wi] = step[wi] < 0 ? WorkerState::kDone : WorkerState::kEpilogue;
          progress = true;
          continue;
        }
        const Instruction& in = stream[head[wi]];
        if (is_compute(in.kind)) {
          if (step[wi] < 0) step[wi] = in.step;
          if (in.step < step[wi]) {
            throw std::invalid_argument("cannot lower: " + where(w, head[wi], in) +
                                        " belongs to step " + std::to_string(in.step) +
                                        " after compute of step " + std::to_string(step[wi]) +
                                        " (steps must not decrease along a stream)");
          }
          if (in.step > step[wi]) {
            state[wi] = WorkerState::kEpilogue;
            progress = true;
            continue;
          }
          if (in.overlap_next) {
            // A composite (torch's OVERLAP_F_B): both parts issue together once both are
            // ready, then the communication of each.
            const Instruction& partner = overlap_partner(w, stream, head[wi]);
            if (!ready(in) || !ready(partner)) continue;
            record_compute(w, in);
            record_compute(w, partner);
            emit_follow_ups(w, in);
            emit_follow_ups(w, partner);
            head[wi] += 2;
            progress = true;
            continue;
          }
          if (!ready(in)) continue;
          record_compute(w, in);
          emit_follow_ups(w, in);
        } else {
          out_[wi].push_back(in);  // K-FAC work stays where it is
        }
        ++head[wi];
        progress = true;
      }
      if (all_done) break;
      progress |= run_epilogues(input, head, step, state);
      if (!progress) report_stall(input, head, state);
    }
    schedule_.streams = std::move(out_);
    return std::move(schedule_);
  }

 private:
  void check_input(const std::vector<std::vector<Instruction>>& input) const {
    for (int w = 0; w < workers_; ++w) {
      const auto& stream = input[static_cast<std::size_t>(w)];
      for (std::size_t i = 0; i < stream.size(); ++i) {
        const Instruction& in = stream[i];
        if (!is_compute(in.kind) && !is_kfac(in.kind)) {
          throw std::invalid_argument(
              "cannot lower: " + where(w, i, in) + " is a " + std::string(to_string(in.kind)) +
              "; lower() takes compute-only streams (forward/backward, optionally K-FAC work)");
        }
        if (!is_compute(in.kind)) continue;
        if (!keys_.in_range(in.step, in.pipeline, in.chunk, in.microbatch)) {
          throw std::invalid_argument(
              "cannot lower: " + where(w, i, in) + " is out of range (steps " +
              std::to_string(keys_.steps) + ", pipelines " + std::to_string(keys_.pipelines) +
              ", chunks " + std::to_string(keys_.chunks) + ", micro-batches per pipeline " +
              std::to_string(keys_.microbatches) + ")");
        }
        const int owner = placement_.worker_of(in.pipeline, in.chunk);
        if (owner != w) {
          throw std::invalid_argument("cannot lower: " + where(w, i, in) + " runs chunk " +
                                      std::to_string(in.chunk) + " of pipeline " +
                                      std::to_string(in.pipeline) + ", which lives on worker " +
                                      std::to_string(owner));
        }
      }
    }
  }

  bool ready(const Instruction& in) const {
    const std::size_t key = keys_.index(in.step, in.pipeline, in.chunk, in.microbatch);
    switch (in.kind) {
      case OpKind::kForward:
        return in.chunk == 0 || forward_done_[key - static_cast<std::size_t>(keys_.microbatches)];
      case OpKind::kBackward:
      case OpKind::kBackwardInput:
        return forward_done_[key] != 0 &&
               (in.chunk == keys_.chunks - 1 ||
                backward_done_[key + static_cast<std::size_t>(keys_.microbatches)] != 0);
      case OpKind::kBackwardWeight:
        return backward_done_[key] != 0;
      default:
        return true;
    }
  }

  const Instruction& overlap_partner(int w, const std::vector<Instruction>& stream,
                                     std::size_t position) const {
    const Instruction& in = stream[position];
    if (in.kind != OpKind::kForward || position + 1 >= stream.size() ||
        (stream[position + 1].kind != OpKind::kBackward &&
         stream[position + 1].kind != OpKind::kBackwardInput)) {
      throw std::invalid_argument("cannot lower: " + where(w, position, in) +
                                  " overlaps with the next instruction, which must be a backward "
                                  "or backward-input (a forward overlaps with a backward)");
    }
    return stream[position + 1];
  }

  // Appends a compute to its worker's stream and marks its output as produced.
  void record_compute(int w, const Instruction& in) {
    out_[static_cast<std::size_t>(w)].push_back(in);
    const std::size_t key = keys_.index(in.step, in.pipeline, in.chunk, in.microbatch);
    if (in.kind == OpKind::kForward) forward_done_[key] = 1;
    if (in.kind == OpKind::kBackward || in.kind == OpKind::kBackwardInput) {
      backward_done_[key] = 1;
    }
  }

  // The communication a compute's output needs, and the data-parallel reduction after the last
  // backward of a chunk.
  void emit_follow_ups(int w, const Instruction& in) {
    auto& stream = out_[static_cast<std::size_t>(w)];
    if (in.kind == OpKind::kForward) {
      if (in.chunk + 1 < keys_.chunks) {
        emit_pair(w, in, placement_.worker_of(in.pipeline, in.chunk + 1), OpKind::kSendActivation,
                  OpKind::kRecvActivation, in.chunk + 1, options_.activation_bytes);
      }
      return;
    }
    if (in.kind == OpKind::kBackward || in.kind == OpKind::kBackwardInput) {
      if (in.chunk > 0) {
        emit_pair(w, in, placement_.worker_of(in.pipeline, in.chunk - 1), OpKind::kSendGradient,
                  OpKind::kRecvGradient, in.chunk - 1, options_.gradient_bytes);
      }
    }
    if (in.kind == OpKind::kBackward || in.kind == OpKind::kBackwardWeight) {
      const std::size_t chunk_key = keys_.chunk_index(in.step, in.pipeline, in.chunk);
      if (++weight_done_count_[chunk_key] == keys_.microbatches &&
          schedule_.params.data_parallel > 1) {
        Instruction reduce;
        reduce.kind = OpKind::kReduceGradDataParallel;
        reduce.pipeline = in.pipeline;
        reduce.step = in.step;
        reduce.chunk = in.chunk;
        reduce.bytes = reduction_bytes(in.pipeline, in.chunk);
        stream.push_back(reduce);
      }
    }
  }

  void emit_pair(int w, const Instruction& producer, int peer, OpKind send_kind, OpKind recv_kind,
                 int consumer_chunk, std::int64_t bytes) {
    if (peer == w) return;  // same worker: the data stays in memory
    Instruction send;
    send.kind = send_kind;
    send.pipeline = producer.pipeline;
    send.step = producer.step;
    send.chunk = producer.chunk;
    send.microbatch = producer.microbatch;
    send.peer = peer;
    send.pair_id = next_pair_id_;
    send.bytes = bytes;
    Instruction recv = send;
    recv.kind = recv_kind;
    recv.chunk = consumer_chunk;
    recv.peer = w;
    ++next_pair_id_;
    out_[static_cast<std::size_t>(w)].push_back(send);
    out_[static_cast<std::size_t>(peer)].push_back(recv);
  }

  std::int64_t reduction_bytes(int pipeline, int chunk) const {
    return options_.reduction_bytes_per_layer * placement_.at(pipeline, chunk).num_layers;
  }

  // Workers waiting at the end of a step get their pipeline reductions (pairs issued to both
  // workers at once, ascending stage order) and then their optimizer step.
  bool run_epilogues(const std::vector<std::vector<Instruction>>& input,
                     const std::vector<std::size_t>& head, std::vector<int>& step,
                     std::vector<WorkerState>& state) {
    bool progress = false;
    if (keys_.pipelines == 2) {
      for (int chunk = 0; chunk < keys_.chunks; ++chunk) {
        const int a = placement_.worker_of(0, chunk);
        const int b = placement_.worker_of(1, chunk);
        const auto ai = static_cast<std::size_t>(a);
        const auto bi = static_cast<std::size_t>(b);
        if (state[ai] != WorkerState::kEpilogue || state[bi] != WorkerState::kEpilogue) continue;
        if (step[ai] != step[bi]) continue;
        const std::size_t flag =
            static_cast<std::size_t>(step[ai]) * static_cast<std::size_t>(keys_.chunks) +
            static_cast<std::size_t>(chunk);
        if (reduction_emitted_[flag]) continue;
        reduction_emitted_[flag] = 1;
        Instruction reduce;
        reduce.kind = OpKind::kReduceGradPipelines;
        reduce.step = static_cast<std::int16_t>(step[ai]);
        reduce.chunk = chunk;
        reduce.pair_id = next_pair_id_++;
        reduce.bytes = reduction_bytes(0, chunk);
        reduce.pipeline = 0;
        reduce.peer = b;
        out_[ai].push_back(reduce);
        reduce.pipeline = 1;
        reduce.peer = a;
        out_[bi].push_back(reduce);
        progress = true;
      }
    }
    for (int w = 0; w < workers_; ++w) {
      const auto wi = static_cast<std::size_t>(w);
      if (state[wi] != WorkerState::kEpilogue) continue;
      if (keys_.pipelines == 2 && !reductions_complete(w, step[wi])) continue;
      if (options_.optimizer_step) {
        Instruction opt;
        opt.kind = OpKind::kOptimizerStep;
        opt.step = static_cast<std::int16_t>(step[wi]);
        out_[wi].push_back(opt);
      }
      if (head[wi] == input[wi].size()) {
        state[wi] = WorkerState::kDone;
      } else {
        step[wi] = input[wi][head[wi]].step;
        state[wi] = WorkerState::kRunning;
      }
      progress = true;
    }
    return progress;
  }

  bool reductions_complete(int w, int step) const {
    for (const ChunkRef& ref : chunks_of_worker_[static_cast<std::size_t>(w)]) {
      const std::size_t flag =
          static_cast<std::size_t>(step) * static_cast<std::size_t>(keys_.chunks) +
          static_cast<std::size_t>(ref.chunk);
      if (!reduction_emitted_[flag]) return false;
    }
    return true;
  }

  [[noreturn]] void report_stall(const std::vector<std::vector<Instruction>>& input,
                                 const std::vector<std::size_t>& head,
                                 const std::vector<WorkerState>& state) const {
    std::string message =
        "cannot lower: the compute order can never finish; stuck workers wait for inputs that "
        "are never produced:";
    int shown = 0;
    for (int w = 0; w < workers_ && shown < 8; ++w) {
      const auto wi = static_cast<std::size_t>(w);
      if (state[wi] == WorkerState::kDone) continue;
      if (state[wi] == WorkerState::kEpilogue) {
        message += " worker " + std::to_string(w) + " waits at the end of step for its partner;";
      } else {
        message += " " + where(w, head[wi], input[wi][head[wi]]) + ";";
      }
      ++shown;
    }
    throw std::invalid_argument(message);
  }

  Schedule& schedule_;
  const LoweringOptions& options_;
  const Placement& placement_;
  int workers_ = 0;
  KeySpace keys_;
  std::vector<std::uint8_t> forward_done_;
  std::vector<std::uint8_t> backward_done_;  // full backward or backward-input
  std::vector<int> weight_done_count_;       // per (step, pipeline, chunk)
  std::vector<std::uint8_t> reduction_emitted_;
  std::vector<std::vector<ChunkRef>> chunks_of_worker_;
  std::vector<std::vector<Instruction>> out_;
  std::int64_t next_pair_id_ = 0;
};

}  // namespace

bool has_communication(const Schedule& schedule) {
  for (const auto& stream : schedule.streams) {
    for (const Instruction& in : stream) {
      if (is_point_to_point(in.kind)) return true;
    }
  }
  return false;
}

Schedule lower(Schedule compute_only, const LoweringOptions& options) {
  Lowerer lowerer(compute_only, options);
  return lowerer.run();
}

}  // namespace pf::sched
