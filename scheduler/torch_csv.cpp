#include "scheduler/torch_csv.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "common/input_error.h"
#include "scheduler/key_space.h"
#include "scheduler/placement.h"
#include "scheduler/torch_csv_actions.h"
#include "scheduler/validate.h"

namespace pf::sched {
namespace {

using Rows = std::vector<std::vector<TorchAction>>;

std::string str(long long value) {
  return std::to_string(value);
}

std::string cell_of(std::string_view source, const TorchAction& a) {
  return torch_cell_location(source, a.row, a.column, a.text);
}

std::string at_row_column(const TorchAction& a) {
  return "row " + str(a.row) + " column " + str(a.column);
}

// Which rank runs each stage, read from the compute actions (as torch infers it).
std::vector<int> stage_ranks(const Rows& rows, std::string_view source) {
  std::size_t compute_actions = 0;
  const TorchAction* highest = nullptr;
  for (const auto& row : rows) {
    for (const TorchAction& a : row) {
      if (is_torch_compute(a.type)) ++compute_actions;
      if (highest == nullptr || a.stage > highest->stage) highest = &a;
    }
  }
  if (highest == nullptr) throw std::invalid_argument(std::string(source) + ": no actions");
  // Every stage needs a compute action: a larger stage number cannot be right (and would only
  // allocate memory).
  if (static_cast<std::size_t>(highest->stage) >= compute_actions) {
    throw std::invalid_argument(cell_of(source, *highest) + ": stage " + str(highest->stage) +
                                " but the file has only " +
                                str(static_cast<long long>(compute_actions)) +
                                " compute actions; stages are numbered 0, 1, ... and each needs "
                                "its compute");
  }
  const auto stages = static_cast<std::size_t>(highest->stage) + 1;
  std::vector<int> rank_of(stages, -1);
  std::vector<const TorchAction*> first(stages, nullptr);
  for (std::size_t rank = 0; rank < rows.size(); ++rank) {
    for (const TorchAction& a : rows[rank]) {
      if (!is_torch_compute(a.type)) continue;
      const auto s = static_cast<std::size_t>(a.stage);
      if (rank_of[s] < 0) {
        rank_of[s] = static_cast<int>(rank);
        first[s] = &a;
      } else if (rank_of[s] != static_cast<int>(rank)) {
        throw std::invalid_argument(
            cell_of(source, a) + ": stage " + str(a.stage) + " runs on rank " +
            str(static_cast<long long>(rank)) + " here but on rank " + str(rank_of[s]) + " at " +
            at_row_column(*first[s]) + " (a stage lives on one rank; rows are ranks 0, 1, ...)");
      }
    }
  }
  for (std::size_t s = 0; s < stages; ++s) {
    if (rank_of[s] < 0) {
      throw std::invalid_argument(
          std::string(source) + ": stage " + str(static_cast<long long>(s)) +
          " has no compute action (stages run 0.." + str(static_cast<long long>(stages) - 1) + ")");
    }
  }
  for (std::size_t rank = 0; rank < rows.size(); ++rank) {
    for (const TorchAction& a : rows[rank]) {
      if (rank_of[static_cast<std::size_t>(a.stage)] != static_cast<int>(rank)) {
        throw std::invalid_argument(
            cell_of(source, a) + ": stage " + str(a.stage) + " lives on rank " +
            str(rank_of[static_cast<std::size_t>(a.stage)]) +
            " (where its compute runs), not rank " + str(static_cast<long long>(rank)));
      }
    }
  }
  return rank_of;
}

enum class Layout : std::uint8_t { kLooped, kVShape, kNeither };

Layout layout_of(const std::vector<int>& rank_of, int ranks) {
  const int stages = static_cast<int>(rank_of.size());
  if (stages % ranks != 0) return Layout::kNeither;
  bool looped = true;
  bool v_shape = stages >= 2 * ranks;
  for (int s = 0; s < stages; ++s) {
    looped &= rank_of[static_cast<std::size_t>(s)] == looped_worker(s, ranks);
    v_shape &= rank_of[static_cast<std::size_t>(s)] == v_shape_worker(s, ranks);
  }
  return looped ? Layout::kLooped : v_shape ? Layout::kVShape : Layout::kNeither;
}

// The rank each stage has under a requested kind (stages = pipelines x chunks).
int expected_rank(ScheduleKind kind, int stage, int ranks) {
  if (kind == ScheduleKind::kChimera) return stage < ranks ? stage : 2 * ranks - 1 - stage;
  if (kind == ScheduleKind::kZeroBubbleV) return v_shape_worker(stage, ranks);
  return looped_worker(stage, ranks);
}

std::string placement_rule(ScheduleKind kind, int ranks) {
  const std::string r = str(ranks);
  if (kind == ScheduleKind::kChimera) {
    return "stage i < " + r + " on rank i, stage " + r + "+i on rank " + str(ranks - 1) + "-i";
  }
  if (kind == ScheduleKind::kZeroBubbleV)
    return "stages i and " + str(2 * ranks - 1) + "-i on rank i";
  return "stage s on rank s mod " + r;
}

[[noreturn]] void refuse_kind(std::string_view source, ScheduleKind kind, const std::string& why) {
  throw std::invalid_argument(
      std::string(source) + ": refusing to read this file as " + std::string(to_string(kind)) +
      ": " + why +
      " (a file is never reinterpreted as another schedule kind; without a requested kind the "
      "file's own placement is used)");
}

// The stage layout the file must have under the requested kind.
void check_requested_kind(std::string_view source, ScheduleKind kind,
                          const std::vector<int>& rank_of, int ranks) {
  const int stages = static_cast<int>(rank_of.size());
  for (int s = 0; s < stages; ++s) {
    const int expected = expected_rank(kind, s, ranks);
    if (rank_of[static_cast<std::size_t>(s)] != expected) {
      refuse_kind(source, kind,
                  "the file runs stage " + str(s) + " on rank " +
                      str(rank_of[static_cast<std::size_t>(s)]) + ", but " +
                      std::string(to_string(kind)) + " places it on rank " + str(expected) + " (" +
                      placement_rule(kind, ranks) + ")");
    }
  }
  const int per_rank = stages / ranks;
  switch (kind) {
    case ScheduleKind::kGPipe:
    case ScheduleKind::kOneFOneB:
    case ScheduleKind::kZeroBubbleH1:
    case ScheduleKind::kZeroBubbleH2:
      if (stages != ranks) {
        refuse_kind(source, kind,
                    "it holds one stage per rank; the file has " + str(stages) + " stages on " +
                        str(ranks) + " ranks");
      }
      break;
    case ScheduleKind::kChimera:
      if (stages != 2 * ranks || ranks % 2 != 0) {
        refuse_kind(source, kind,
                    "it needs an even number D of ranks and 2D stages (two pipelines); the file "
                    "has " +
                        str(stages) + " stages on " + str(ranks) + " ranks");
      }
      break;
    case ScheduleKind::kZeroBubbleV:
      if (stages != 2 * ranks) {
        refuse_kind(source, kind,
                    "it holds two stages per rank; the file has " + str(per_rank) + " per rank");
      }
      break;
    default:
      break;
  }
}

// Every (pipeline, chunk, micro-batch) of a file has one forward and either one backward or a
// backward-input and a backward-weight: checked on the cells before anything else, so that
// errors name them.
class CellTable {
 public:
  CellTable(std::string_view source, const KeySpace& keys)
      : source_(source),
        keys_(keys),
        forward_(keys.size()),
        backward_(keys.size()),
        input_(keys.size()),
        weight_(keys.size()) {}

  void add(const Instruction& in, const TorchAction& a) {
    const std::size_t key = keys_.index(0, in.pipeline, in.chunk, in.microbatch);
    switch (in.kind) {
      case OpKind::kForward:
        put(forward_, key, a, "forward");
        break;
      case OpKind::kBackward:
        put(backward_, key, a, "full backward");
        break;
      case OpKind::kBackwardInput:
        put(input_, key, a, "backward-input");
        break;
      case OpKind::kBackwardWeight:
        put(weight_, key, a, "backward-weight");
        break;
      default:
        break;
    }
  }

  void check_complete(const Placement& placement) const {
    for (int pipeline = 0; pipeline < keys_.pipelines; ++pipeline) {
      for (int chunk = 0; chunk < keys_.chunks; ++chunk) {
        for (int mb = 0; mb < keys_.microbatches; ++mb) {
          const std::size_t key = keys_.index(0, pipeline, chunk, mb);
          const std::string what =
              "stage " + str(pipeline * keys_.chunks + chunk) + " micro-batch " + str(mb);
          const std::string rank = " (rank " + str(placement.worker_of(pipeline, chunk)) +
                                   ", row " + str(placement.worker_of(pipeline, chunk) + 1) + ")";
          if (forward_[key] == nullptr) fail_missing(what + " has no forward" + rank);
          if (backward_[key] != nullptr && input_[key] != nullptr) {
            throw std::invalid_argument(cell_of(source_, *input_[key]) + ": " + what +
                                        " also has a full backward at " +
                                        at_row_column(*backward_[key]));
          }
          if (backward_[key] == nullptr && input_[key] == nullptr) {
            fail_missing(what + " has no backward (B, or I and W)" + rank);
          }
          if (input_[key] != nullptr && weight_[key] == nullptr) {
            throw std::invalid_argument(cell_of(source_, *input_[key]) +
                                        ": backward-input without a backward-weight (W) of " +
                                        what);
          }
          if (weight_[key] != nullptr && input_[key] == nullptr) {
            throw std::invalid_argument(cell_of(source_, *weight_[key]) +
                                        ": backward-weight without a backward-input (I) of " +
                                        what);
          }
        }
      }
    }
  }

 private:
  void put(std::vector<const TorchAction*>& table, std::size_t key, const TorchAction& a,
           const char* what) {
    if (table[key] != nullptr) {
      throw std::invalid_argument(cell_of(source_, a) + ": a second " + what + " of stage " +
                                  str(a.stage) + " micro-batch " + str(a.microbatch) +
                                  " (the first is at " + at_row_column(*table[key]) + ")");
    }
    table[key] = &a;
  }
  [[noreturn]] void fail_missing(const std::string& what) const {
    throw std::invalid_argument(std::string(source_) + ": " + what);
  }

  std::string_view source_;
  KeySpace keys_;
  std::vector<const TorchAction*> forward_, backward_, input_, weight_;
};

// Replays compute-only streams (one instruction per rank per round, issued once its inputs
// exist, composites when both parts are ready); when no rank can move, names the cells that
// wait and what they wait for.
void check_compute_order(std::string_view source, const Schedule& s,
                         const std::vector<std::vector<const TorchAction*>>& cells,
                         const KeySpace& keys) {
  std::vector<std::uint8_t> forward_done(keys.size(), 0);
  std::vector<std::uint8_t> backward_done(keys.size(), 0);
  const auto m = static_cast<std::size_t>(keys.microbatches);
  auto missing = [&](const Instruction& in) -> std::string {
    const std::size_t key = keys.index(0, in.pipeline, in.chunk, in.microbatch);
    const int stage = in.pipeline * keys.chunks + in.chunk;
    const std::string mb = str(in.microbatch);
    switch (in.kind) {
      case OpKind::kForward:
        if (in.chunk > 0 && !forward_done[key - m]) return str(stage - 1) + "F" + mb;
        return "";
      case OpKind::kBackward:
      case OpKind::kBackwardInput:
        if (!forward_done[key]) return str(stage) + "F" + mb;
        if (in.chunk + 1 < keys.chunks && !backward_done[key + m]) {
          return str(stage + 1) + "B (or I)" + mb;
        }
        return "";
      default:
        return backward_done[key] ? "" : str(stage) + "I" + mb;
    }
  };
  auto mark = [&](const Instruction& in) {
    const std::size_t key = keys.index(0, in.pipeline, in.chunk, in.microbatch);
    if (in.kind == OpKind::kForward) forward_done[key] = 1;
    if (in.kind == OpKind::kBackward || in.kind == OpKind::kBackwardInput) backward_done[key] = 1;
  };
  const auto ranks = s.streams.size();
  std::vector<std::size_t> head(ranks, 0);
  while (true) {
    bool progress = false;
    bool done = true;
    for (std::size_t r = 0; r < ranks; ++r) {
      const auto& stream = s.streams[r];
      while (head[r] < stream.size()) {
        const Instruction& in = stream[head[r]];
        const bool composite = in.overlap_next && head[r] + 1 < stream.size();
        if (!missing(in).empty() || (composite && !missing(stream[head[r] + 1]).empty())) break;
        mark(in);
        if (composite) mark(stream[head[r] + 1]);
        head[r] += composite ? 2 : 1;
        progress = true;
      }
      done &= head[r] == stream.size();
    }
    if (done) return;
    if (progress) continue;
    std::string message = std::string(source) +
                          ": the compute order can never finish; every rank waits for work that "
                          "comes later:";
    for (std::size_t r = 0; r < ranks; ++r) {
      if (head[r] == s.streams[r].size()) continue;
      const Instruction& in = s.streams[r][head[r]];
      std::string waits = missing(in);
      if (waits.empty()) waits = missing(s.streams[r][head[r] + 1]);
      message += " rank " + str(static_cast<long long>(r)) + " at " +
                 at_row_column(*cells[r][head[r]]) + " '" + cells[r][head[r]]->text +
                 "' waits for " + waits + ";";
    }
    message.pop_back();
    throw std::invalid_argument(message);
  }
}

// Appends the end-of-step work of a single-step schedule whose communication is complete:
// pipeline reductions (ascending stage, both workers), data-parallel reductions, optimizer step.
void append_step_end(Schedule& schedule, const LoweringOptions& options,
                     std::int64_t next_pair_id) {
  const Placement& placement = schedule.placement;
  auto bytes_of = [&](int pipeline, int chunk) {
    return options.reduction_bytes_per_layer * placement.at(pipeline, chunk).num_layers;
  };
  bool has_dp_reduction = false;
  for (const auto& stream : schedule.streams) {
    for (const Instruction& in : stream) {
      has_dp_reduction |= in.kind == OpKind::kReduceGradDataParallel;
    }
  }
  if (placement.num_pipelines == 2) {
    for (int chunk = 0; chunk < placement.chunks_per_pipeline; ++chunk) {
      Instruction reduce;
      reduce.kind = OpKind::kReduceGradPipelines;
      reduce.chunk = chunk;
      reduce.pair_id = next_pair_id++;
      reduce.bytes = bytes_of(0, chunk);
      const int a = placement.worker_of(0, chunk);
      const int b = placement.worker_of(1, chunk);
      reduce.pipeline = 0;
      reduce.peer = b;
      schedule.streams[static_cast<std::size_t>(a)].push_back(reduce);
      reduce.pipeline = 1;
      reduce.peer = a;
      schedule.streams[static_cast<std::size_t>(b)].push_back(reduce);
    }
  }
  const auto owned = chunks_by_worker(placement, schedule.num_workers());
  for (int w = 0; w < schedule.num_workers(); ++w) {
    auto& stream = schedule.streams[static_cast<std::size_t>(w)];
    if (schedule.params.data_parallel > 1 && !has_dp_reduction) {
      for (const ChunkRef& ref : owned[static_cast<std::size_t>(w)]) {
        Instruction reduce;
        reduce.kind = OpKind::kReduceGradDataParallel;
        reduce.pipeline = static_cast<std::int8_t>(ref.pipeline);
        reduce.chunk = ref.chunk;
        reduce.bytes = bytes_of(ref.pipeline, ref.chunk);
        stream.push_back(reduce);
      }
    }
    if (options.optimizer_step) {
      Instruction opt;
      opt.kind = OpKind::kOptimizerStep;
      stream.push_back(opt);
    }
  }
}

// Builds the instruction streams from the actions; communication actions get their pair ids,
// WAIT_* are checked against what they wait for and dropped, UNSHARD/RESHARD dropped.
class StreamBuilder {
 public:
  StreamBuilder(std::string_view source, Schedule& schedule, const KeySpace& keys,
                const TorchCsvImportOptions& options)
      : source_(source),
        s_(schedule),
        keys_(keys),
        options_(options),
        send_f_pair_(keys.size(), -1),
        send_b_pair_(keys.size(), -1),
        send_f_cell_(keys.size(), nullptr),
        send_b_cell_(keys.size(), nullptr),
        waited_f_(keys.size(), 0),
        waited_b_(keys.size(), 0),
        reduced_(keys.num_chunk_keys(), 0) {}

  void build(const Rows& rows) {
    const int ranks = static_cast<int>(rows.size());
    s_.streams.assign(static_cast<std::size_t>(ranks), {});
    cells_.assign(static_cast<std::size_t>(ranks), {});
    for (const auto& row : rows) {
      for (const TorchAction& a : row) {
        reduce_waits_ |= a.type == TorchActionType::kWaitReduceGrad;
      }
    }
    for (int rank = 0; rank < ranks; ++rank) {
      const auto& row = rows[static_cast<std::size_t>(rank)];
      pending_reduce_ = nullptr;
      s_.streams[static_cast<std::size_t>(rank)].reserve(row.size() + 4);
      for (const TorchAction& a : row) add(rank, a);
    }
    if (any_send_wait_) {
      // torch's rule: once a file has waits, every send has one.
      for (std::size_t key = 0; key < keys_.size(); ++key) {
        if (send_f_cell_[key] != nullptr && !waited_f_[key]) no_wait(*send_f_cell_[key]);
        if (send_b_cell_[key] != nullptr && !waited_b_[key]) no_wait(*send_b_cell_[key]);
      }
    }
    // Receives take the pair id of the send they match.
    for (std::size_t rank = 0; rank < s_.streams.size(); ++rank) {
      auto& stream = s_.streams[rank];
      for (std::size_t i = 0; i < stream.size(); ++i) {
        Instruction& in = stream[i];
        if (in.kind != OpKind::kRecvActivation && in.kind != OpKind::kRecvGradient) continue;
        const bool activation = in.kind == OpKind::kRecvActivation;
        const int sender_chunk = in.chunk + (activation ? -1 : 1);
        const auto& table = activation ? send_f_pair_ : send_b_pair_;
        const std::int64_t pair = table[keys_.index(0, in.pipeline, sender_chunk, in.microbatch)];
        if (pair < 0) {
          throw std::invalid_argument(cell_of(source_, *cells_[rank][i]) + ": no matching " +
                                      str(in.pipeline * keys_.chunks + sender_chunk) +
                                      (activation ? "SEND_F" : "SEND_B") + str(in.microbatch) +
                                      " on rank " + str(in.peer));
        }
        in.pair_id = pair;
      }
    }
  }

  bool has_communication() const { return has_communication_; }
  std::int64_t next_pair() const { return next_pair_; }
  const std::vector<std::vector<const TorchAction*>>& cells() const { return cells_; }

 private:
  [[noreturn]] void fail(const TorchAction& a, const std::string& what) const {
    throw std::invalid_argument(cell_of(source_, a) + ": " + what);
  }
  [[noreturn]] void no_wait(const TorchAction& send) const {
    fail(send,
         "this send has no WAIT_SEND after it on its rank (the file has waits for other "
         "sends; torch requires one per send)");
  }

  void add(int rank, const TorchAction& a) {
    const int chunks = keys_.chunks;
    const Placement& placement = s_.placement;
    Instruction in;
    in.pipeline = static_cast<std::int8_t>(a.stage / chunks);
    in.chunk = a.stage % chunks;
    in.microbatch = a.microbatch;
    in.overlap_next = a.overlap_next;
    if (a.microbatch >= keys_.microbatches) fail(a, "micro-batch out of range");
    auto neighbour = [&](int delta) {
      const int chunk = in.chunk + delta;
      if (chunk < 0 || chunk >= chunks) {
        fail(a, "stage " + str(a.stage) + " has no " + (delta > 0 ? "next" : "previous") +
                    " stage to communicate with");
      }
      return placement.worker_of(in.pipeline, chunk);
    };
    auto& stream = s_.streams[static_cast<std::size_t>(rank)];
    switch (a.type) {
      case TorchActionType::kForward:
        in.kind = OpKind::kForward;
        break;
      case TorchActionType::kBackward:
        in.kind = OpKind::kBackward;
        break;
      case TorchActionType::kBackwardInput:
        in.kind = OpKind::kBackwardInput;
        break;
      case TorchActionType::kBackwardWeight:
        in.kind = OpKind::kBackwardWeight;
        break;
      case TorchActionType::kSendF:
      case TorchActionType::kSendB: {
        const bool forward = a.type == TorchActionType::kSendF;
        in.kind = forward ? OpKind::kSendActivation : OpKind::kSendGradient;
        in.peer = neighbour(forward ? +1 : -1);
        in.bytes = forward ? options_.lowering.activation_bytes : options_.lowering.gradient_bytes;
        const std::size_t key = keys_.index(0, in.pipeline, in.chunk, in.microbatch);
        auto& pair = forward ? send_f_pair_[key] : send_b_pair_[key];
        if (pair >= 0) fail(a, "the same send appears twice");
        pair = next_pair_++;
        in.pair_id = pair;
        (forward ? send_f_cell_ : send_b_cell_)[key] = &a;
        has_communication_ = true;
        break;
      }
      case TorchActionType::kRecvF:
        in.kind = OpKind::kRecvActivation;
        in.peer = neighbour(-1);
        in.bytes = options_.lowering.activation_bytes;
        has_communication_ = true;
        break;
      case TorchActionType::kRecvB:
        in.kind = OpKind::kRecvGradient;
        in.peer = neighbour(+1);
        in.bytes = options_.lowering.gradient_bytes;
        has_communication_ = true;
        break;
      case TorchActionType::kWaitSendF:
      case TorchActionType::kWaitSendB: {
        // The completion point of an earlier send on this rank; this IR's sends complete at
        // their rendezvous, so the wait is implied once checked.
        const bool forward = a.type == TorchActionType::kWaitSendF;
        const std::size_t key = keys_.index(0, in.pipeline, in.chunk, in.microbatch);
        const auto* send = (forward ? send_f_cell_ : send_b_cell_)[key];
        if (send == nullptr) {
          fail(a, std::string("waits for ") + (forward ? "SEND_F" : "SEND_B") + " of stage " +
                      str(a.stage) + " micro-batch " + str(a.microbatch) +
                      ", which has not been sent before it on this rank");
        }
        auto& waited = (forward ? waited_f_ : waited_b_)[key];
        if (waited) fail(a, "a second wait for the same send");
        waited = 1;
        any_send_wait_ = true;
        has_communication_ = true;
        return;
      }
      case TorchActionType::kReduceGrad: {
        const std::size_t chunk_key = keys_.chunk_index(0, in.pipeline, in.chunk);
        if (reduced_[chunk_key]) fail(a, "a second REDUCE_GRAD of stage " + str(a.stage));
        reduced_[chunk_key] = 1;
        if (pending_reduce_ != nullptr && reduce_waits_) {
          fail(a, "REDUCE_GRAD while stage " + str(pending_reduce_->stage) + "'s reduction (" +
                      at_row_column(*pending_reduce_) +
                      ") has not been waited for (WAIT_REDUCE_GRAD)");
        }
        pending_reduce_ = &a;
        has_communication_ = true;
        // With one replica the reduction is a no-op (torch issues it regardless).
        if (s_.params.data_parallel == 1) return;
        in.kind = OpKind::kReduceGradDataParallel;
        in.microbatch = -1;
        in.bytes = options_.lowering.reduction_bytes_per_layer *
                   placement.at(in.pipeline, in.chunk).num_layers;
        break;
      }
      case TorchActionType::kWaitReduceGrad:
        if (pending_reduce_ == nullptr || pending_reduce_->stage != a.stage) {
          fail(a, "no pending REDUCE_GRAD of stage " + str(a.stage) + " to wait for on this rank");
        }
        pending_reduce_ = nullptr;
        return;
      case TorchActionType::kUnshard:
      case TorchActionType::kReshard:
        has_communication_ = true;  // torch's lowered form; FSDP only: nothing to do here
        return;
    }
    stream.push_back(in);
    cells_[static_cast<std::size_t>(rank)].push_back(&a);
  }

  std::string_view source_;
  Schedule& s_;
  const KeySpace& keys_;
  const TorchCsvImportOptions& options_;
  std::vector<std::int64_t> send_f_pair_, send_b_pair_;
  std::vector<const TorchAction*> send_f_cell_, send_b_cell_;
  std::vector<std::uint8_t> waited_f_, waited_b_, reduced_;
  const TorchAction* pending_reduce_ = nullptr;
  std::vector<std::vector<const TorchAction*>> cells_;
  std::int64_t next_pair_ = 0;
  bool has_communication_ = false;
  bool any_send_wait_ = false;
  bool reduce_waits_ = false;  // the file pairs REDUCE_GRAD with WAIT_REDUCE_GRAD
};

// Whether the compute order is a valid single V-shaped pipeline (torch's ZBV / DualPipeV
// reading of a file with 2R stages on R ranks).
bool valid_as_v_pipeline(const Schedule& chimera_reading) {
  Schedule v;
  v.params.kind = ScheduleKind::kCustom;
  v.params.workers = chimera_reading.params.workers;
  v.params.chunks_per_worker = 2;
  v.params.microbatches = chimera_reading.params.microbatches / 2;
  v.params.v_shape = true;
  v.placement = make_placement(v.params);
  v.streams.resize(chimera_reading.streams.size());
  const int chunks = chimera_reading.placement.chunks_per_pipeline;
  for (std::size_t w = 0; w < v.streams.size(); ++w) {
    for (Instruction in : chimera_reading.streams[w]) {
      if (!is_compute(in.kind)) continue;
      in.chunk += in.pipeline * chunks;
      in.pipeline = 0;
      v.streams[w].push_back(in);
    }
  }
  try {
    validate(lower(std::move(v)));
  } catch (const std::invalid_argument&) {
    return false;
  }
  return true;
}

}  // namespace

Schedule schedule_from_torch_csv(std::string_view text, std::string_view source,
                                 const TorchCsvImportOptions& options) {
  const Rows rows = parse_torch_csv(text, source);
  const int ranks = static_cast<int>(rows.size());
  int max_mb = -1;
  std::size_t total_actions = 0;
  for (const auto& row : rows) {
    total_actions += row.size();
    for (const TorchAction& a : row) max_mb = std::max(max_mb, a.microbatch);
  }
  const std::vector<int> rank_of = stage_ranks(rows, source);
  const int stages = static_cast<int>(rank_of.size());
  if (max_mb < 0) throw std::invalid_argument(std::string(source) + ": no compute actions");
  // Every stage runs every micro-batch forward: fewer actions than that cannot be a schedule.
  if (static_cast<std::size_t>(stages) * static_cast<std::size_t>(max_mb + 1) > total_actions) {
    throw std::invalid_argument(
        std::string(source) + ": " + str(static_cast<long long>(total_actions)) +
        " actions cannot cover " + str(stages) + " stages x " + str(max_mb + 1) + " micro-batches");
  }
  ScheduleParams params;
  params.kind = options.kind.value_or(ScheduleKind::kCustom);
  params.workers = ranks;
  params.num_layers = options.num_layers;
  params.data_parallel = options.data_parallel;
  const bool chimera = params.kind == ScheduleKind::kChimera;
  const int pipelines = chimera ? 2 : 1;
  if (options.kind && *options.kind != ScheduleKind::kCustom) {
    check_requested_kind(source, *options.kind, rank_of, ranks);
  } else {
    const Layout layout = layout_of(rank_of, ranks);
    if (layout == Layout::kNeither) {
      for (int s = 0; s < stages; ++s) {
        if (rank_of[static_cast<std::size_t>(s)] != looped_worker(s, ranks)) {
          throw std::invalid_argument(
              std::string(source) + ": stage " + str(s) + " runs on rank " +
              str(rank_of[static_cast<std::size_t>(s)]) + "; the stages of " + str(ranks) +
              " ranks must be looped (stage s on rank s mod " + str(ranks) +
              ") or V-shaped (stage s and " + str(2 * ranks - 1) + "-s on rank s, then zig-zag)" +
              (stages % ranks != 0 ? ", with the stage count a multiple of the rank count" : ""));
        }
      }
    }
    params.v_shape = layout == Layout::kVShape;
  }
  // Every rank holds the same number of stages; 3 stages on 2 ranks would index a chunk that the
  // placement does not have (a fuzzer's finding: a looped layout passed the rank checks above).
  if (stages % ranks != 0) {
    throw std::invalid_argument(std::string(source) + ": " + str(stages) + " stages on " +
                                str(ranks) +
                                " ranks (allowed: the stage count a multiple of the rank count, "
                                "every rank holding as many stages)");
  }
  params.chunks_per_worker = chimera ? 1 : stages / ranks;
  params.microbatches = (max_mb + 1) * pipelines;
  for (const auto& row : rows) {
    for (const TorchAction& a : row) {
      params.split_backward |= a.type == TorchActionType::kBackwardInput;
    }
  }

  Schedule schedule;
  schedule.params = params;
  try {
    schedule.placement = make_placement(params);
  } catch (const std::invalid_argument& error) {
    throw std::invalid_argument(std::string(source) + ": " + error.what());
  }
  const KeySpace keys{1, pipelines, schedule.placement.chunks_per_pipeline, max_mb + 1};
  StreamBuilder builder(source, schedule, keys, options);
  builder.build(rows);
  CellTable table(source, keys);
  for (std::size_t r = 0; r < schedule.streams.size(); ++r) {
    for (std::size_t i = 0; i < schedule.streams[r].size(); ++i) {
      table.add(schedule.streams[r][i], *builder.cells()[r][i]);
    }
  }
  table.check_complete(schedule.placement);
  const bool has_comm = builder.has_communication();
  if (!has_comm) check_compute_order(source, schedule, builder.cells(), keys);
  if (chimera && valid_as_v_pipeline(schedule)) {
    refuse_kind(source, ScheduleKind::kChimera,
                "its compute order is also a valid single V-shaped pipeline over " + str(stages) +
                    " stages (torch's ZBV / DualPipeV layout), which is how torch reads it");
  }
  try {
    if (has_comm) {
      append_step_end(schedule, options.lowering, builder.next_pair());
    } else {
      schedule = lower(std::move(schedule), options.lowering);
    }
    validate(schedule);
  } catch (const ValidationError& error) {
    throw ValidationError(std::string(source) + ": " + error.what(), error.worker, error.position);
  } catch (const std::invalid_argument& error) {
    throw std::invalid_argument(std::string(source) + ": " + error.what());
  }
  return schedule;
}

Schedule load_torch_csv(const std::filesystem::path& path, const TorchCsvImportOptions& options) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError("cannot open CSV file " + path.string());
  std::ostringstream text;
  text << in.rdbuf();
  return schedule_from_torch_csv(text.str(), path.string(), options);
}

namespace {

// Writes one rank's row.
class RowWriter {
 public:
  RowWriter(const Schedule& schedule, bool with_communication)
      : with_comm_(with_communication), chunks_(schedule.placement.chunks_per_pipeline) {
    for (const auto& stream : schedule.streams) {
      for (const Instruction& in : stream)
        has_dp_reduction_ |= in.kind == OpKind::kReduceGradDataParallel;
    }
    const auto m = static_cast<std::size_t>(microbatches_per_pipeline(schedule.params));
    const KeySpace keys{1, schedule.placement.num_pipelines, chunks_, static_cast<int>(m)};
    keys_ = keys;
  }

  std::string write(const std::vector<Instruction>& stream) {
    out_.clear();
    pending_sends_.clear();
    weights_done_.assign(keys_.num_chunk_keys(), 0);
    for (std::size_t i = 0; i < stream.size(); ++i) {
      const Instruction& in = stream[i];
      if (!is_send(in.kind)) flush_reductions();
      if (in.overlap_next && i + 1 < stream.size()) {
        const Instruction& partner = stream[i + 1];
        cell("(" + action(in, "F") + ";" + action(partner, compute_name(partner)) + ")OVERLAP_F_B");
        after_compute(in);
        after_compute(partner);
        ++i;
        continue;
      }
      if (is_compute(in.kind)) {
        cell(action(in, compute_name(in)));
        after_compute(in);
        continue;
      }
      if (!with_comm_) continue;
      switch (in.kind) {
        case OpKind::kSendActivation:
        case OpKind::kSendGradient:
          cell(action(in, in.kind == OpKind::kSendActivation ? "SEND_F" : "SEND_B"));
          pending_sends_.push_back(in);
          break;
        case OpKind::kRecvActivation:
          cell(action(in, "RECV_F"));
          break;
        case OpKind::kRecvGradient:
          cell(action(in, "RECV_B"));
          break;
        case OpKind::kReduceGradDataParallel:
          reduce(in.pipeline, in.chunk);
          break;
        default:
          break;  // not expressible in the format
      }
    }
    flush_reductions();
    if (with_comm_) {
      for (const Instruction& send : pending_sends_) {
        cell(action(send, send.kind == OpKind::kSendActivation ? "WAIT_SEND_F" : "WAIT_SEND_B"));
      }
    }
    return out_;
  }

 private:
  static const char* compute_name(const Instruction& in) {
    switch (in.kind) {
      case OpKind::kForward:
        return "F";
      case OpKind::kBackward:
        return "B";
      case OpKind::kBackwardInput:
        return "I";
      default:
        return "W";
    }
  }
  std::string action(const Instruction& in, const std::string& name) const {
    std::string text = str(in.pipeline * chunks_ + in.chunk) + name;
    if (in.microbatch >= 0) text += str(in.microbatch);
    return text;
  }
  void cell(const std::string& text) {
    if (!out_.empty()) out_ += ',';
    out_ += text;
  }
  void reduce(int pipeline, int chunk) {
    const std::string stage = str(pipeline * chunks_ + chunk);
    cell(stage + "REDUCE_GRAD");
    cell(stage + "WAIT_REDUCE_GRAD");
  }
  // WAIT_SEND_F after the local backward that proves the activation was consumed (torch's
  // rule); with one replica, the REDUCE_GRAD torch issues after a stage's last backward.
  void after_compute(const Instruction& in) {
    if (!with_comm_) return;
    if (in.kind == OpKind::kBackward || in.kind == OpKind::kBackwardInput) {
      for (auto it = pending_sends_.begin(); it != pending_sends_.end(); ++it) {
        if (it->kind == OpKind::kSendActivation && it->pipeline == in.pipeline &&
            it->chunk == in.chunk && it->microbatch == in.microbatch) {
          cell(action(*it, "WAIT_SEND_F"));
          pending_sends_.erase(it);
          break;
        }
      }
    }
    if (!has_dp_reduction_ &&
        (in.kind == OpKind::kBackward || in.kind == OpKind::kBackwardWeight)) {
      const std::size_t key = keys_.chunk_index(0, in.pipeline, in.chunk);
      if (++weights_done_[key] == keys_.microbatches) {
        pending_reductions_.push_back({in.pipeline, in.chunk});
      }
    }
  }
  // A stage's reduction follows its last backward and that backward's sends.
  void flush_reductions() {
    for (const auto& [pipeline, chunk] : pending_reductions_) reduce(pipeline, chunk);
    pending_reductions_.clear();
  }

  bool with_comm_;
  int chunks_;
  bool has_dp_reduction_ = false;
  KeySpace keys_;
  std::string out_;
  std::vector<Instruction> pending_sends_;
  std::vector<int> weights_done_;
  std::vector<std::pair<int, int>> pending_reductions_;
};

}  // namespace

std::string to_torch_csv(const Schedule& schedule, bool with_communication) {
  if (schedule.num_steps != 1) {
    throw std::invalid_argument("the torch CSV format holds one step; this schedule has " +
                                str(schedule.num_steps));
  }
  // The format has no action for a copy between device and host memory: refuse rather than
  // write a schedule whose preconditioning would find no inverses on the device.
  for (std::size_t w = 0; w < schedule.streams.size(); ++w) {
    for (std::size_t i = 0; i < schedule.streams[w].size(); ++i) {
      const Instruction& in = schedule.streams[w][i];
      if (is_kfac_transfer(in.kind)) {
        throw std::invalid_argument(
            "the torch CSV format cannot express K-FAC offload transfers (worker " + str(w) +
            ", position " + str(i) + ": " + std::string(to_string(in.kind)) +
            "); write the schedule as JSON instead");
      }
    }
  }
  RowWriter writer(schedule, with_communication);
  std::string out;
  for (const auto& stream : schedule.streams) {
    out += writer.write(stream);
    out += '\n';
  }
  return out;
}

void save_torch_csv(const std::filesystem::path& path, const Schedule& schedule,
                    bool with_communication) {
  std::ofstream out(path, std::ios::binary);
  if (!out) throw InputError("cannot write CSV file " + path.string());
  out << to_torch_csv(schedule, with_communication);
  if (!out) throw InputError("failed writing CSV file " + path.string());
}

}  // namespace pf::sched
