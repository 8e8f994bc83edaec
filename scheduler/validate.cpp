#include "scheduler/validate.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "common/checked_arithmetic.h"
#include "scheduler/grid.h"
#include "scheduler/key_space.h"
#include "scheduler/placement.h"

namespace pf::sched {
namespace {

constexpr std::int32_t kNone = -1;
using Timings = std::vector<std::vector<traces::SpanTiming>>;

std::string str(long long value) {
  return std::to_string(value);
}

std::string describe_key(int step, int pipeline, int chunk, int microbatch) {
  return "step " + str(step) + ", pipeline " + str(pipeline) + ", chunk " + str(chunk) +
         ", micro-batch " + str(microbatch);
}

class Validator {
 public:
  explicit Validator(const Schedule& schedule) : s_(schedule) {}

  void check() {
    check_structure();
    scan();
    check_per_key();
    check_reductions_and_steps();
    if (has_kfac_) check_kfac();
    if (has_kfac_) check_kfac_offload();
  }

  // Blocking replay; fills timings when duration is given.
  void replay(const DurationFn* duration, Timings* timings) {
    const auto workers = static_cast<std::size_t>(workers_);
    std::vector<std::int32_t> head(workers, 0);
    std::vector<double> clock(workers, 0.0);
    std::size_t remaining = s_.num_instructions();
    const bool track_deps = !lowered_ || duration != nullptr;
    if (track_deps) {
      forward_end_.assign(keys_.size(), -1.0);
      backward_end_.assign(keys_.size(), -1.0);
    }
    if (timings != nullptr) {
      timings->assign(workers, {});
      for (std::size_t w = 0; w < workers; ++w) timings->at(w).resize(s_.streams[w].size());
    }
    auto stream_size = [&](int w) {
      return static_cast<std::int32_t>(s_.streams[static_cast<std::size_t>(w)].size());
    };
    auto record = [&](int w, std::int32_t pos, double start, double length) {
      if (timings != nullptr) {
        (*timings)[static_cast<std::size_t>(w)][static_cast<std::size_t>(pos)] = {start, length};
      }
    };
    auto length_of = [&](int w, const Instruction& in) {
      return duration != nullptr ? (*duration)(w, in) : 0.0;
    };
    // Tries to execute worker w's head; returns whether it ran.
    // Without durations (validation): sends and receives rendezvous (blocking semantics).
    // With durations (layouts): a send is posted when its worker reaches it and does not hold
    // the worker; a receive completes once its send has been posted and does not hold the
    // worker either (a posted irecv); the compute that needs the data waits for its arrival.
    const bool timing = duration != nullptr;
    if (timing) {
      activation_arrival_.assign(lowered_ ? keys_.size() : 0, 0.0);
      gradient_arrival_.assign(lowered_ ? keys_.size() : 0, 0.0);
    }
    auto try_execute = [&](int w) -> bool {
      const auto wi = static_cast<std::size_t>(w);
      const std::int32_t pos = head[wi];
      const Instruction& in = s_.streams[wi][static_cast<std::size_t>(pos)];
      if (timing && is_send(in.kind)) {
        const double length = length_of(w, in);
        record(w, pos, clock[wi], length);
        ++head[wi];
        --remaining;
        return true;
      }
      if (timing && is_receive(in.kind)) {
        const Cell partner = partner_of(in);
        const auto pi = static_cast<std::size_t>(partner.worker);
        if (head[pi] <= partner.position) return false;  // not sent yet
        const traces::SpanTiming& sent = (*timings)[pi][static_cast<std::size_t>(partner.position)];
        const double start = std::max(clock[wi], sent.start_us);
        const double length = length_of(w, in);
        record(w, pos, start, length);
        const std::size_t key = keys_.index(in.step, in.pipeline, in.chunk, in.microbatch);
        (in.kind == OpKind::kRecvActivation ? activation_arrival_ : gradient_arrival_)[key] =
            std::max(start + length, sent.start_us + sent.duration_us);
        ++head[wi];
        --remaining;
        return true;
      }
      if (is_point_to_point(in.kind) || in.kind == OpKind::kReduceGradPipelines) {
        const Cell partner = partner_of(in);
        const auto pi = static_cast<std::size_t>(partner.worker);
        if (head[pi] != partner.position) return false;
        const Instruction& other = s_.streams[pi][static_cast<std::size_t>(partner.position)];
        const double start = std::max(clock[wi], clock[pi]);
        const double mine = length_of(w, in);
        const double theirs = length_of(partner.worker, other);
        record(w, pos, start, mine);
        record(partner.worker, partner.position, start, theirs);
        clock[wi] = start + mine;
        clock[pi] = start + theirs;
        ++head[wi];
        ++head[pi];
        remaining -= 2;
        return true;
      }
      double start = clock[wi];
      if (is_compute(in.kind) && track_deps) {
        const std::size_t key = keys_.index(in.step, in.pipeline, in.chunk, in.microbatch);
        const auto m = static_cast<std::size_t>(keys_.microbatches);
        double ready = 0;
        auto need = [&](double end) {
          if (end < 0) return false;
          ready = std::max(ready, end);
          return true;
        };
        bool ok = true;
        switch (in.kind) {
          case OpKind::kForward:
            if (in.chunk > 0) ok = need(forward_end_[key - m]);
            if (ok && timing && lowered_) ready = std::max(ready, activation_arrival_[key]);
            break;
          case OpKind::kBackward:
          case OpKind::kBackwardInput:
            ok = need(forward_end_[key]);
            if (ok && in.chunk + 1 < keys_.chunks) ok = need(backward_end_[key + m]);
            if (ok && timing && lowered_) ready = std::max(ready, gradient_arrival_[key]);
            break;
          default:
            ok = need(backward_end_[key]);
            break;
        }
        if (!ok) return false;
        start = std::max(start, ready);
        const double end = start + length_of(w, in);
        if (in.kind == OpKind::kForward) forward_end_[key] = end;
        if (in.kind == OpKind::kBackward || in.kind == OpKind::kBackwardInput) {
          backward_end_[key] = end;
        }
      }
      const double length = length_of(w, in);
      record(w, pos, start, length);
      clock[wi] = start + length;
      ++head[wi];
      --remaining;
      return true;
    };
    int sweep = 0;
    while (remaining > 0) {
      bool progress = false;
      for (int i = 0; i < workers_; ++i) {
        // Alternate the sweep direction: activations flow up, gradients down.
        const int w = (sweep % 2 == 0) ? i : workers_ - 1 - i;
        while (head[static_cast<std::size_t>(w)] < stream_size(w) && try_execute(w)) {
          progress = true;
        }
      }
      if (!progress) report_deadlock(head);
      ++sweep;
    }
  }

 private:
  struct Cell {
    int worker = -1;
    std::int32_t position = kNone;
  };

  [[noreturn]] void fail(int worker, std::int64_t position, const std::string& what) const {
    std::string message = "invalid schedule: ";
    if (worker >= 0) {
      message += "worker " + str(worker) + " position " + str(position);
      const auto& stream = s_.streams[static_cast<std::size_t>(worker)];
      if (position >= 0 && static_cast<std::size_t>(position) < stream.size()) {
        message += " (" + short_label(stream[static_cast<std::size_t>(position)]) + ")";
      } else {
        message += " (end of stream)";
      }
      message += ": ";
    }
    message += what;
    if (worker >= 0) {
      message += "\n" + render_grid_around(s_, worker, static_cast<int>(position));
    }
    throw ValidationError(message, worker, static_cast<int>(position));
  }

  void check_structure() {
    const ScheduleParams& params = s_.params;
    const Placement& placement = s_.placement;
    workers_ = s_.num_workers();
    if (workers_ != params.workers) {
      fail(-1, -1,
           "the schedule has " + str(workers_) + " streams but its parameters say " +
               str(params.workers) + " workers");
    }
    if (workers_ < 1) fail(-1, -1, "the schedule has no workers");
    if (s_.num_steps < 1 || s_.num_steps > std::numeric_limits<std::int16_t>::max()) {
      fail(-1, -1, "num_steps must be in [1, 32767], got " + str(s_.num_steps));
    }
    if (placement.num_pipelines < 1 || placement.num_pipelines > 2) {
      fail(-1, -1, "the placement must have 1 or 2 pipelines, got " + str(placement.num_pipelines));
    }
    if (placement.chunks_per_pipeline < 1) {
      fail(-1, -1, "the placement must have at least one chunk per pipeline");
    }
    if (placement.chunks.size() != static_cast<std::size_t>(placement.num_pipelines) *
                                       static_cast<std::size_t>(placement.chunks_per_pipeline)) {
      fail(-1, -1,
           "the placement lists " + str(static_cast<long long>(placement.chunks.size())) +
               " chunks, expected " + str(placement.num_pipelines) + " x " +
               str(placement.chunks_per_pipeline));
    }
    if (params.microbatches < 1 || params.microbatches % placement.num_pipelines != 0) {
      fail(-1, -1,
           str(params.microbatches) + " micro-batches cannot be split over " +
               str(placement.num_pipelines) + " pipeline(s)");
    }
    num_layers_ = placement.num_layers;
    if (num_layers_ < 0 || num_layers_ > kMaxLayers) {
      fail(-1, -1,
           "the placement's layer count must be in [0, " + str(kMaxLayers) + "], got " +
               str(num_layers_));
    }
    layer_chunk_.assign(static_cast<std::size_t>(placement.num_pipelines) *
                            static_cast<std::size_t>(std::max(num_layers_, 0)),
                        kNone);
    for (std::size_t i = 0; i < placement.chunks.size(); ++i) {
      const ChunkPlacement& cp = placement.chunks[i];
      const int expected_pipeline = static_cast<int>(i) / placement.chunks_per_pipeline;
      const int expected_chunk = static_cast<int>(i) % placement.chunks_per_pipeline;
      if (cp.pipeline != expected_pipeline || cp.chunk != expected_chunk) {
        fail(-1, -1,
             "placement entry " + str(static_cast<long long>(i)) + " is pipeline " +
                 str(cp.pipeline) + " chunk " + str(cp.chunk) + ", expected pipeline " +
                 str(expected_pipeline) + " chunk " + str(expected_chunk));
      }
      if (cp.worker < 0 || cp.worker >= workers_) {
        fail(-1, -1,
             "placement puts pipeline " + str(cp.pipeline) + " chunk " + str(cp.chunk) +
                 " on worker " + str(cp.worker) + " (workers 0.." + str(workers_ - 1) + ")");
      }
      // Compared without forming first_layer + num_layers: from a file, that sum may overflow.
      if (cp.num_layers < 0 || cp.first_layer < 0 || cp.first_layer > num_layers_ ||
          cp.num_layers > num_layers_ - cp.first_layer) {
        fail(-1, -1,
             "placement gives pipeline " + str(cp.pipeline) + " chunk " + str(cp.chunk) +
                 " layers [" + str(cp.first_layer) + ", " +
                 str(static_cast<long long>(cp.first_layer) + cp.num_layers) +
                 ") outside the model's " + str(num_layers_) + " layers");
      }
      for (int layer = cp.first_layer; layer < cp.first_layer + cp.num_layers; ++layer) {
        layer_chunk_[static_cast<std::size_t>(cp.pipeline * num_layers_ + layer)] = cp.chunk;
      }
    }
    keys_ = KeySpace{s_.num_steps, placement.num_pipelines, placement.chunks_per_pipeline,
                     params.microbatches / placement.num_pipelines};
    // Every key needs a forward: more keys than instructions cannot be valid (and would only
    // allocate memory). The product is checked: from a file it may not fit std::size_t.
    std::optional<std::size_t> key_count = std::size_t{1};
    for (const int factor : {keys_.steps, keys_.pipelines, keys_.chunks, keys_.microbatches}) {
      if (key_count) key_count = checked_mul(*key_count, static_cast<std::size_t>(factor));
    }
    if (!key_count || keys_.size() > s_.num_instructions()) {
      fail(-1, -1,
           "the parameters call for " +
               (key_count ? std::to_string(*key_count) : std::string("over 2^64")) +
               " forwards (steps x pipelines x chunks x micro-batches) but the streams "
               "hold only " +
               str(static_cast<long long>(s_.num_instructions())) + " instructions");
    }
    chunks_of_worker_ = chunks_by_worker(placement, workers_);
  }

  int worker_of(int pipeline, int chunk) const {
    return s_.placement.chunks[static_cast<std::size_t>(pipeline * keys_.chunks + chunk)].worker;
  }

  // Records one position in a per-key array, refusing duplicates.
  void put(std::vector<std::int32_t>& positions, std::size_t key, int w, std::int32_t pos,
           const char* what) const {
    if (positions[key] != kNone) {
      fail(w, pos,
           std::string("second ") + what + " of the same " + "(step, pipeline, chunk, " +
               "micro-batch); the first is at position " + str(positions[key]));
    }
    positions[key] = pos;
  }

  void scan() {
    for (const auto& stream : s_.streams) {
      for (const Instruction& in : stream) {
        lowered_ |= is_point_to_point(in.kind);
        has_kfac_ |= is_kfac(in.kind);
      }
      if (stream.size() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
        fail(-1, -1, "a stream is longer than 2^31 instructions");
      }
    }
    const std::size_t n = keys_.size();
    forward_pos_.assign(n, kNone);
    backward_pos_.assign(n, kNone);
    weight_pos_.assign(n, kNone);
    split_.assign(n, 0);
    if (lowered_) {
      send_act_pos_.assign(n, kNone);
      recv_act_pos_.assign(n, kNone);
      send_grad_pos_.assign(n, kNone);
      recv_grad_pos_.assign(n, kNone);
    }
    reduce_pipelines_pos_.assign(keys_.num_chunk_keys(), kNone);
    reduce_dp_pos_.assign(keys_.num_chunk_keys(), kNone);
    optimizer_pos_.assign(
        static_cast<std::size_t>(workers_) * static_cast<std::size_t>(keys_.steps), kNone);
    std::size_t pair_count = 0;
    std::int64_t max_pair = -1;
    for (int w = 0; w < workers_; ++w) {
      const auto& stream = s_.streams[static_cast<std::size_t>(w)];
      for (std::size_t i = 0; i < stream.size(); ++i) {
        const Instruction& in = stream[i];
        const auto pos = static_cast<std::int32_t>(i);
        if (static_cast<int>(in.kind) >= kNumOpKinds) fail(w, pos, "unknown instruction kind");
        if (in.step < 0 && is_kfac(in.kind)) {
          check_wrapped_step(w, pos, in);
        } else if (in.step < 0 || in.step >= keys_.steps) {
          fail(w, pos, "step " + str(in.step) + " outside [0, " + str(keys_.steps) + ")");
        }
        if (in.overlap_next) check_overlap(w, stream, i);
        if (is_kfac(in.kind)) continue;  // checked in check_kfac
        if (in.kind == OpKind::kOptimizerStep) {
          put(optimizer_pos_,
              static_cast<std::size_t>(w) * static_cast<std::size_t>(keys_.steps) +
                  static_cast<std::size_t>(in.step),
              w, pos, "optimizer step");
          continue;
        }
        if (in.pipeline < 0 || in.pipeline >= keys_.pipelines || in.chunk < 0 ||
            in.chunk >= keys_.chunks) {
          fail(w, pos,
               "pipeline " + str(in.pipeline) + " chunk " + str(in.chunk) +
                   " is not in the placement (" + str(keys_.pipelines) + " pipeline(s) of " +
                   str(keys_.chunks) + " chunks)");
        }
        const int owner = worker_of(in.pipeline, in.chunk);
        if (owner != w) {
          fail(w, pos,
               "chunk " + str(in.chunk) + " of pipeline " + str(in.pipeline) + " lives on worker " +
                   str(owner) + ", not here");
        }
        const std::size_t chunk_key = keys_.chunk_index(in.step, in.pipeline, in.chunk);
        if (in.kind == OpKind::kReduceGradDataParallel) {
          put(reduce_dp_pos_, chunk_key, w, pos, "data-parallel reduction");
          continue;
        }
        if (in.kind == OpKind::kReduceGradPipelines) {
          if (keys_.pipelines != 2) fail(w, pos, "a pipeline reduction needs two pipelines");
          const int partner = worker_of(1 - in.pipeline, in.chunk);
          if (in.peer != partner) {
            fail(w, pos,
                 "the other replica of chunk " + str(in.chunk) + " lives on worker " +
                     str(partner) + ", but the reduction's peer is " + str(in.peer));
          }
          if (in.pair_id < 0) fail(w, pos, "a pipeline reduction needs a pair id >= 0");
          put(reduce_pipelines_pos_, chunk_key, w, pos, "pipeline reduction");
          if (in.pipeline == 0) {
            ++pair_count;
            max_pair = std::max(max_pair, in.pair_id);
          }
          continue;
        }
        if (in.microbatch < 0 || in.microbatch >= keys_.microbatches) {
          fail(w, pos,
               "micro-batch " + str(in.microbatch) + " outside [0, " + str(keys_.microbatches) +
                   ") (micro-batches per pipeline)");
        }
        const std::size_t key = keys_.index(in.step, in.pipeline, in.chunk, in.microbatch);
        switch (in.kind) {
          case OpKind::kForward:
            put(forward_pos_, key, w, pos, "forward");
            break;
          case OpKind::kBackward:
            if (backward_pos_[key] != kNone && split_[key]) {
              fail(w, pos,
                   "full backward of a micro-batch that also has a backward-input at "
                   "position " +
                       str(backward_pos_[key]));
            }
            put(backward_pos_, key, w, pos, "backward");
            break;
          case OpKind::kBackwardInput:
            if (backward_pos_[key] != kNone && !split_[key]) {
              fail(w, pos,
                   "backward-input of a micro-batch that also has a full backward at "
                   "position " +
                       str(backward_pos_[key]));
            }
            put(backward_pos_, key, w, pos, "backward-input");
            split_[key] = 1;
            break;
          case OpKind::kBackwardWeight:
            put(weight_pos_, key, w, pos, "backward-weight");
            break;
          default: {  // point-to-point
            int expected_peer = -1;
            std::vector<std::int32_t>* slot = nullptr;
            const char* name = "";
            switch (in.kind) {
              case OpKind::kSendActivation:
                if (in.chunk + 1 < keys_.chunks)
                  expected_peer = worker_of(in.pipeline, in.chunk + 1);
                slot = &send_act_pos_;
                name = "activation send (the next chunk";
                break;
              case OpKind::kRecvActivation:
                if (in.chunk > 0) expected_peer = worker_of(in.pipeline, in.chunk - 1);
                slot = &recv_act_pos_;
                name = "activation receive (the previous chunk";
                break;
              case OpKind::kSendGradient:
                if (in.chunk > 0) expected_peer = worker_of(in.pipeline, in.chunk - 1);
                slot = &send_grad_pos_;
                name = "gradient send (the previous chunk";
                break;
              default:
                if (in.chunk + 1 < keys_.chunks)
                  expected_peer = worker_of(in.pipeline, in.chunk + 1);
                slot = &recv_grad_pos_;
                name = "gradient receive (the next chunk";
                break;
            }
            if (expected_peer < 0) {
              fail(w, pos, std::string(name) + " does not exist for chunk " + str(in.chunk) + ")");
            }
            if (expected_peer == w) {
              fail(w, pos,
                   std::string(name) +
                       " is on this same worker: no communication is "
                       "needed)");
            }
            if (in.peer != expected_peer) {
              fail(w, pos,
                   std::string(name) + " lives on worker " + str(expected_peer) +
                       ", but the peer is " + str(in.peer) + ")");
            }
            if (in.pair_id < 0) fail(w, pos, "communication needs a pair id >= 0");
            put(*slot, key, w, pos, std::string(to_string(in.kind)).c_str());
            if (is_send(in.kind)) {
              ++pair_count;
              max_pair = std::max(max_pair, in.pair_id);
            }
            break;
          }
        }
      }
    }
    check_unique_pair_ids(pair_count, max_pair);
  }

  // A composite (torch's OVERLAP_F_B): a forward directly followed by a backward (or
  // backward-input) of another chunk, which may run at the same time.
  void check_overlap(int w, const std::vector<Instruction>& stream, std::size_t i) const {
    const Instruction& in = stream[i];
    const auto pos = static_cast<std::int64_t>(i);
    if (in.kind != OpKind::kForward) {
      fail(w, pos, "only a forward can overlap with the next instruction (OVERLAP_F_B)");
    }
    if (i + 1 >= stream.size() ||
        (stream[i + 1].kind != OpKind::kBackward && stream[i + 1].kind != OpKind::kBackwardInput)) {
      fail(w, pos,
           "a forward that overlaps with the next instruction needs a backward or "
           "backward-input right after it (OVERLAP_F_B)");
    }
    const Instruction& next = stream[i + 1];
    if (next.pipeline == in.pipeline && next.chunk == in.chunk) {
      fail(w, pos, "a forward and a backward of the same chunk cannot overlap");
    }
  }

  // Each pair id names exactly one pair: count the sends (and pipeline-0 reductions).
  void check_unique_pair_ids(std::size_t pair_count, std::int64_t max_pair) const {
    if (pair_count == 0) return;
    auto report = [&](std::int64_t id) {
      for (int w = 0; w < workers_; ++w) {
        const auto& stream = s_.streams[static_cast<std::size_t>(w)];
        for (std::size_t i = 0; i < stream.size(); ++i) {
          if (stream[i].pair_id == id &&
              (is_send(stream[i].kind) ||
               (stream[i].kind == OpKind::kReduceGradPipelines && stream[i].pipeline == 0))) {
            fail(w, static_cast<std::int64_t>(i),
                 "pair id " + str(id) + " is used by more than one send/receive pair");
          }
        }
      }
      fail(-1, -1, "pair id " + str(id) + " is used by more than one pair");
    };
    auto for_each_pair_id = [&](auto&& visit) {
      for (const auto& stream : s_.streams) {
        for (const Instruction& in : stream) {
          if (is_send(in.kind) || (in.kind == OpKind::kReduceGradPipelines && in.pipeline == 0)) {
            visit(in.pair_id);
          }
        }
      }
    };
    if (static_cast<std::uint64_t>(max_pair) < 8 * pair_count + 1024) {
      std::vector<std::uint8_t> seen(static_cast<std::size_t>(max_pair) + 1, 0);
      for_each_pair_id([&](std::int64_t id) {
        if (seen[static_cast<std::size_t>(id)]++) report(id);
      });
    } else {
      std::vector<std::int64_t> ids;
      ids.reserve(pair_count);
      for_each_pair_id([&](std::int64_t id) { ids.push_back(id); });
      std::sort(ids.begin(), ids.end());
      const auto dup = std::adjacent_find(ids.begin(), ids.end());
      if (dup != ids.end()) report(*dup);
    }
  }

  const Instruction& at(int w, std::int32_t pos) const {
    return s_.streams[static_cast<std::size_t>(w)][static_cast<std::size_t>(pos)];
  }

  void check_pair(int send_worker, std::int32_t send_pos, int recv_worker,
                  std::int32_t recv_pos) const {
    const Instruction& send = at(send_worker, send_pos);
    const Instruction& recv = at(recv_worker, recv_pos);
    if (send.pair_id != recv.pair_id) {
      fail(send_worker, send_pos,
           "its receive at worker " + str(recv_worker) + " position " + str(recv_pos) + " (" +
               short_label(recv) + ") has pair id " + str(recv.pair_id) + ", the send has " +
               str(send.pair_id));
    }
    if (send.bytes != recv.bytes) {
      fail(send_worker, send_pos,
           "sends " + str(send.bytes) + " bytes but its receive at worker " + str(recv_worker) +
               " position " + str(recv_pos) + " expects " + str(recv.bytes));
    }
  }

  void check_per_key() {
    const int m = keys_.microbatches;
    last_backward_.assign(keys_.num_chunk_keys(), kNone);
    for (int step = 0; step < keys_.steps; ++step) {
      for (int pl = 0; pl < keys_.pipelines; ++pl) {
        for (int c = 0; c < keys_.chunks; ++c) {
          const int w = worker_of(pl, c);
          const std::int32_t end =
              static_cast<std::int32_t>(s_.streams[static_cast<std::size_t>(w)].size());
          std::int32_t last = kNone;
          for (int mb = 0; mb < m; ++mb) {
            const std::size_t key = keys_.index(step, pl, c, mb);
            auto what = [&] { return describe_key(step, pl, c, mb); };
            const std::int32_t f = forward_pos_[key];
            const std::int32_t b = backward_pos_[key];
            const std::int32_t wt = weight_pos_[key];
            if (f == kNone) fail(w, end, "missing forward of " + what());
            if (b == kNone) {
              fail(w, end,
                   std::string("missing ") + (wt == kNone ? "backward" : "backward-input") +
                       " of " + what());
            }
            if (split_[key] && wt == kNone) fail(w, end, "missing backward-weight of " + what());
            if (!split_[key] && wt != kNone) {
              fail(w, wt,
                   "backward-weight of a micro-batch that has a full backward at "
                   "position " +
                       str(b));
            }
            if (b < f) fail(w, b, "backward before its forward (position " + str(f) + ")");
            if (wt != kNone && wt < b) {
              fail(w, wt, "backward-weight before its backward-input (position " + str(b) + ")");
            }
            last = std::max(last, split_[key] ? wt : b);
            // Dependencies on neighbouring chunks.
            if (c > 0) check_boundary(step, pl, c - 1, mb);
          }
          last_backward_[keys_.chunk_index(step, pl, c)] = last;
        }
      }
    }
  }

  // The boundary between chunk c and c + 1 of one micro-batch.
  void check_boundary(int step, int pl, int c, int mb) const {
    const auto m = static_cast<std::size_t>(keys_.microbatches);
    const std::size_t lo = keys_.index(step, pl, c, mb);
    const std::size_t hi = lo + m;
    const int wlo = worker_of(pl, c);
    const int whi = worker_of(pl, c + 1);
    if (wlo == whi) {
      if (forward_pos_[hi] < forward_pos_[lo]) {
        fail(wlo, forward_pos_[hi],
             "forward before the forward of the previous chunk it needs "
             "(position " +
                 str(forward_pos_[lo]) + ")");
      }
      if (backward_pos_[lo] < backward_pos_[hi]) {
        fail(wlo, backward_pos_[lo],
             "backward before the backward of the next chunk it needs "
             "(position " +
                 str(backward_pos_[hi]) + ")");
      }
      return;
    }
    if (!lowered_) return;  // compute-only: the replay checks cross-worker order
    auto what = [&] { return describe_key(step, pl, c, mb); };
    const std::int32_t sa = send_act_pos_[lo];
    const std::int32_t ra = recv_act_pos_[hi];
    const std::int32_t sg = send_grad_pos_[hi];
    const std::int32_t rg = recv_grad_pos_[lo];
    if (sa == kNone)
      fail(wlo, forward_pos_[lo], "no activation send after the forward of " + what());
    if (ra == kNone) {
      fail(whi, forward_pos_[hi],
           "no activation receive before this forward (from worker " + str(wlo) + ")");
    }
    if (sg == kNone) {
      fail(whi, backward_pos_[hi],
           "no gradient send after this backward (to worker " + str(wlo) + ")");
    }
    if (rg == kNone) {
      fail(wlo, backward_pos_[lo],
           "no gradient receive before this backward (from worker " + str(whi) + ")");
    }
    if (sa < forward_pos_[lo]) {
      fail(wlo, sa,
           "activation sent before it is computed (forward at position " + str(forward_pos_[lo]) +
               ")");
    }
    if (ra > forward_pos_[hi]) {
      fail(whi, forward_pos_[hi],
           "forward before its activation is received (position " + str(ra) + ")");
    }
    if (sg < backward_pos_[hi]) {
      fail(whi, sg,
           "gradient sent before it is computed (backward at position " + str(backward_pos_[hi]) +
               ")");
    }
    if (rg > backward_pos_[lo]) {
      fail(wlo, backward_pos_[lo],
           "backward before its gradient is received (position " + str(rg) + ")");
    }
    check_pair(wlo, sa, whi, ra);
    check_pair(whi, sg, wlo, rg);
  }

  void check_reductions_and_steps() const {
    for (int step = 0; step < keys_.steps; ++step) {
      for (int pl = 0; pl < keys_.pipelines; ++pl) {
        for (int c = 0; c < keys_.chunks; ++c) {
          const std::size_t ck = keys_.chunk_index(step, pl, c);
          const int w = worker_of(pl, c);
          const std::int32_t rp = reduce_pipelines_pos_[ck];
          const std::int32_t rd = reduce_dp_pos_[ck];
          if (rp != kNone) {
            if (rp < last_backward_[ck]) {
              fail(w, rp,
                   "pipeline reduction before the last backward of its chunk (position " +
                       str(last_backward_[ck]) + ")");
            }
            const std::int32_t other = reduce_pipelines_pos_[keys_.chunk_index(step, 1 - pl, c)];
            if (other == kNone) {
              fail(w, rp,
                   "the other replica (worker " + str(worker_of(1 - pl, c)) +
                       ") has no matching pipeline reduction");
            }
            if (pl == 0) check_pair(w, rp, worker_of(1, c), other);
          }
          if (rd != kNone && rd < last_backward_[ck]) {
            fail(w, rd,
                 "data-parallel reduction before the last backward of its chunk "
                 "(position " +
                     str(last_backward_[ck]) + ")");
          }
        }
      }
      for (int w = 0; w < workers_; ++w) {
        const std::int32_t opt =
            optimizer_pos_[static_cast<std::size_t>(w) * static_cast<std::size_t>(keys_.steps) +
                           static_cast<std::size_t>(step)];
        if (opt == kNone) continue;
        for (const ChunkRef& ref : chunks_of_worker_[static_cast<std::size_t>(w)]) {
          const std::size_t ck = keys_.chunk_index(step, ref.pipeline, ref.chunk);
          const std::int32_t before =
              std::max({last_backward_[ck], reduce_pipelines_pos_[ck], reduce_dp_pos_[ck]});
          if (opt < before) {
            fail(w, opt,
                 "optimizer step before the backward or gradient reduction of chunk " +
                     str(ref.chunk) + " at position " + str(before));
          }
        }
      }
    }
  }

  // Resolves the chunk a K-FAC instruction works on; fails when its layer is not there.
  ChunkRef kfac_chunk(int w, std::int32_t pos, const Instruction& in) const {
    if (in.layer < 0 || in.layer >= num_layers_) {
      fail(w, pos, "layer " + str(in.layer) + " outside [0, " + str(num_layers_) + ")");
    }
    if (static_cast<int>(in.linear) >= kNumLinearKinds) fail(w, pos, "unknown Linear kind");
    for (const ChunkRef& ref : chunks_of_worker_[static_cast<std::size_t>(w)]) {
      const int chunk =
          layer_chunk_[static_cast<std::size_t>(ref.pipeline * num_layers_ + in.layer)];
      if (chunk != ref.chunk) continue;
      if (in.chunk >= 0 && (in.chunk != ref.chunk || in.pipeline != ref.pipeline)) continue;
      return ref;
    }
    std::string where;
    for (int pl = 0; pl < keys_.pipelines; ++pl) {
      const int chunk = layer_chunk_[static_cast<std::size_t>(pl * num_layers_ + in.layer)];
      if (chunk == kNone) continue;
      where += (where.empty() ? "" : ", ") + std::string("pipeline ") + str(pl) + " chunk " +
               str(chunk) + " on worker " + str(worker_of(pl, chunk));
    }
    fail(w, pos,
         "layer " + str(in.layer) +
             (in.chunk >= 0 ? " is not in pipeline " + str(in.pipeline) + " chunk " +
                                  str(in.chunk) + " on this worker"
                            : " does not live on this worker") +
             " (it lives in " + where + ")");
  }

  // A K-FAC instruction with a negative step: a pipelined refresh's work of the previous window
  // (Schedule::kfac_pipelined_refresh); only inversions and curvature syncs run there, and the
  // offload copies of those inversions' factors (check_kfac_offload).
  void check_wrapped_step(int w, std::int32_t pos, const Instruction& in) const {
    if (!s_.kfac_pipelined_refresh) {
      fail(w, pos,
           "step " + str(in.step) + " outside [0, " + str(keys_.steps) +
               "): a negative step (K-FAC work of the previous refresh window) needs a pipelined "
               "refresh (kfac_pipelined_refresh, --kfac-pipelined-refresh on)");
    }
    if (in.kind != OpKind::kInvertA && in.kind != OpKind::kInvertB &&
        in.kind != OpKind::kCurvatureSync && in.kind != OpKind::kPrefetchFactors &&
        in.kind != OpKind::kWriteBackState) {
      fail(w, pos,
           short_label(in) + " has step " + str(in.step) +
               ": only inversions and curvature syncs of a pipelined refresh run in the next "
               "window (and the offload copies of those inversions' factors)");
    }
    if (in.step < -keys_.steps) {
      fail(w, pos,
           "step " + str(in.step) + " outside [-" + str(keys_.steps) + ", " + str(keys_.steps) +
               ") (a negative step names step + " + str(keys_.steps) + " of the previous window)");
    }
  }

  // One divided K-FAC task of a worker: (kind, step, pipeline, microbatch, layer, linear).
  using PieceTask = std::tuple<int, int, int, int, int, int>;
  struct PieceChain {
    int next_unit = 0;
    std::int32_t last_position = 0;
  };
  using PieceChains = std::map<PieceTask, PieceChain>;

  // The pieces of a task run in order: each starts where the previous one ended, and the last
  // ends at kPieceUnits. (The inversion chain's steps need the previous piece's factor; the
  // curvature and preconditioning of one task reproduce the whole task only in full.)
  void check_piece(PieceChains& chains, int w, std::int32_t pos, const Instruction& in) const {
    if (in.piece_begin >= in.piece_end || in.piece_end > kPieceUnits) {
      fail(w, pos,
           "piece [" + str(in.piece_begin) + ", " + str(in.piece_end) +
               ") must satisfy 0 <= begin "
               "< end <= " +
               str(kPieceUnits));
    }
    if (!is_piece(in) && chains.empty()) return;
    if (is_piece(in) && !is_divisible(in.kind)) {
      fail(w, pos,
           std::string(to_string(in.kind)) +
               " cannot run in pieces (only curvature, curvature sync, inversion and "
               "precondition can)");
    }
    const PieceTask task{static_cast<int>(in.kind),  in.step, in.pipeline, in.microbatch, in.layer,
                         static_cast<int>(in.linear)};
    auto it = chains.find(task);
    const int expected = it == chains.end() ? 0 : it->second.next_unit;
    const bool starts_new = in.piece_begin == 0 && (expected == 0 || expected == kPieceUnits);
    if (!starts_new && in.piece_begin != expected) {
      fail(w, pos,
           "broken chain of pieces: " + short_label(in) + " starts at unit " + str(in.piece_begin) +
               " but the task's previous piece ended at unit " + str(expected) +
               (it == chains.end() ? " (no earlier piece)"
                                   : " (position " + str(it->second.last_position) + ")"));
    }
    if (!is_piece(in) && it == chains.end()) return;
    chains[task] = PieceChain{in.piece_end, pos};
  }

  // A curvature sync between two workers (Chimera's replicas, `peer` set) is one all-reduce, or
  // one per piece: both members must post the same syncs and pieces in the same order, or the
  // collectives pair wrongly (a runtime's all-reduces over the pair's group match by order).
  struct SyncPost {
    std::tuple<int, int, int, int, int> what;  // step, layer, linear, piece begin, piece end
    std::int32_t position = 0;
  };
  std::string sync_name(const SyncPost& post) const {
    const auto& [step, layer, linear, begin, end] = post.what;
    return "sync of layer " + str(layer) + " " +
           std::string(to_string(static_cast<LinearKind>(linear))) + " (step " + str(step) +
           ", piece [" + str(begin) + ", " + str(end) + "))";
  }
  void check_sync_partners(const std::vector<std::vector<std::pair<int, SyncPost>>>& posts) const {
    for (int w = 0; w < workers_; ++w) {
      const auto& mine = posts[static_cast<std::size_t>(w)];
      std::set<int> peers;
      for (const auto& [peer, post] : mine) peers.insert(peer);
      for (int p : peers) {
        if (p < 0 || p >= workers_ || p == w) {
          const auto it = std::find_if(mine.begin(), mine.end(),
                                       [&](const auto& entry) { return entry.first == p; });
          fail(w, it->second.position, "curvature sync names an invalid peer " + str(p));
        }
        if (p < w) continue;  // checked from the lower worker
        std::vector<const SyncPost*> a, b;
        for (const auto& [peer, post] : mine) {
          if (peer == p) a.push_back(&post);
        }
        for (const auto& [peer, post] : posts[static_cast<std::size_t>(p)]) {
          if (peer == w) b.push_back(&post);
        }
        for (std::size_t n = 0; n < std::max(a.size(), b.size()); ++n) {
          if (n < a.size() && n < b.size() && a[n]->what == b[n]->what) continue;
          if (n >= a.size()) {
            fail(p, b[n]->position,
                 sync_name(*b[n]) + " with worker " + str(w) + " has no partner there (worker " +
                     str(w) + " posts only " + str(a.size()) + " syncs with worker " + str(p) +
                     "); every member posts the same syncs and pieces in the same order");
          }
          fail(w, a[n]->position,
               sync_name(*a[n]) + " is sync number " + str(n) + " with worker " + str(p) +
                   ", whose sync number " + str(n) + " is " +
                   (n < b.size() ? sync_name(*b[n]) + " at position " + str(b[n]->position)
                                 : std::string("missing")) +
                   "; every member posts the same syncs and pieces in the same order");
        }
      }
    }
  }

  PieceTask task_of(const Instruction& in, int step) const {
    return PieceTask{static_cast<int>(in.kind),  step, in.pipeline, in.microbatch, in.layer,
                     static_cast<int>(in.linear)};
  }

  // A pipelined refresh (Schedule::kfac_pipelined_refresh), per worker: where each Linear's
  // K-FAC work of this window starts, where the previous refresh's (wrapped) work of it ends, the
  // unit at which each inversion's pieces in its own window stop, and the wrapped pieces.
  using LinearOnWorker = std::tuple<int, int, int>;  // pipeline, layer, linear
  struct WindowOrder {
    std::map<LinearOnWorker, std::int32_t> first_own, last_wrapped;
    // The window's own inversions (any piece): the first's position per Linear.
    std::map<LinearOnWorker, std::int32_t> first_own_inversion;
    // The previous refresh's syncs run in this window: the last piece's position per Linear.
    std::map<LinearOnWorker, std::int32_t> last_wrapped_sync;
    std::map<PieceTask, int> own_end;
    std::map<PieceTask, std::vector<std::int32_t>> wrapped;  // by the task's own step
  };

  // The rules of a pipelined refresh's work in the next window, on worker w:
  // - an inversion or sync task run partly or wholly there continues its own window's pieces:
  //   the wrapped pieces start where those stopped (at 0 when none ran) and end the task;
  // - its refresh's curvature is in the stream (it ran in the previous window);
  // - a sync run there precedes the wrapped inversions of its Linear, and none of the
  //   refresh's inversions of that Linear ran in its own window (before the sync had ended);
  //   the syncs pair with their partner's by stream order (check_sync_partners);
  // - it precedes the window's inversions and preconditioning of its Linear: their inversion
  //   would finalize the factors (and replace the inverse chain) the wrapped one still reads,
  //   and the preconditioning uses the inverses it produces. The window's curvature and sync
  //   may come before it: they accumulate into a second set of factor sums (counted in memory),
  //   so the previous refresh's sums stay until its inversion finalizes them.
  template <typename LayerKey>
  void check_wrapped_work(int w, const WindowOrder& order, const std::vector<std::int32_t>& last_a,
                          const std::vector<std::int32_t>& last_b,
                          const LayerKey& layer_key) const {
    for (const auto& [task, positions] : order.wrapped) {
      const auto own = order.own_end.find(task);
      int expected = own == order.own_end.end() ? 0 : own->second;
      for (const std::int32_t pos : positions) {
        const Instruction& in = at(w, pos);
        if (in.piece_begin != expected) {
          fail(w, pos,
               "broken chain of pieces across refresh windows: " + short_label(in) +
                   " (the previous refresh's, run in this window) starts at unit " +
                   str(in.piece_begin) + " but the task's pieces before it end at unit " +
                   str(expected) +
                   (expected == kPieceUnits ? " (the task is complete in its own window)" : ""));
        }
        expected = in.piece_end;
      }
      if (expected != kPieceUnits) {
        fail(w, positions.back(),
             "the pieces of " + short_label(at(w, positions.back())) + "'s task stop at unit " +
                 str(expected) + " of " + str(kPieceUnits) +
                 ": the rest of the previous refresh's task is missing from the stream");
      }
      const Instruction& first = at(w, positions.front());
      const ChunkRef ref = kfac_chunk(w, positions.front(), first);
      Instruction own_step = first;
      own_step.step = static_cast<std::int16_t>(std::get<1>(task));
      const std::size_t lk = layer_key(own_step, ref.pipeline);
      if (last_a[lk] == kNone || last_b[lk] == kNone) {
        fail(w, positions.front(),
             short_label(first) +
                 (first.kind == OpKind::kCurvatureSync ? " syncs layer " : " inverts layer ") +
                 str(first.layer) + " " + std::string(to_string(first.linear)) +
                 " of the previous refresh (step " + str(own_step.step) +
                 " of the previous window), whose curvature A and B are "
                 "not in the stream");
      }
      if (first.kind == OpKind::kCurvatureSync) continue;
      // An inversion after a sync of its Linear that continued in this window: after its last
      // piece, and wholly in this window.
      const LinearOnWorker linear{ref.pipeline, first.layer, static_cast<int>(first.linear)};
      const auto sync = order.last_wrapped_sync.find(linear);
      if (sync == order.last_wrapped_sync.end()) continue;
      if (sync->second > positions.front()) {
        fail(w, positions.front(),
             short_label(first) + " (the previous refresh's, run in this window) comes before " +
                 short_label(at(w, sync->second)) + " at position " + str(sync->second) +
                 ": an inversion follows the last piece of its Linear's curvature sync");
      }
      if (own != order.own_end.end()) {
        fail(w, positions.front(),
             short_label(first) +
                 " continues an inversion begun in its own window before the "
                 "curvature sync of layer " +
                 str(first.layer) + " " + std::string(to_string(first.linear)) +
                 " ended (the sync continues in this window, at position " + str(sync->second) +
                 "): an inversion follows the last piece of its Linear's curvature sync");
      }
    }
    // A sync run in the next window and an inversion of its Linear in its own window: every
    // window runs the same stream, so that inversion finalizes its refresh's sums before the
    // sync of them (a data-parallel run: each replica's own micro-batches only).
    for (const auto& [linear, sync] : order.last_wrapped_sync) {
      const auto own = order.first_own_inversion.find(linear);
      if (own == order.first_own_inversion.end()) continue;
      fail(w, own->second,
           short_label(at(w, own->second)) + " inverts layer " + str(std::get<1>(linear)) + " " +
               std::string(to_string(static_cast<LinearKind>(std::get<2>(linear)))) +
               " in its own window, but its refresh's curvature sync runs in the next window (" +
               short_label(at(w, sync)) + " at position " + str(sync) +
               "): an inversion follows the last piece of its Linear's curvature sync");
    }
    for (const auto& [linear, last] : order.last_wrapped) {
      const auto own = order.first_own.find(linear);
      if (own == order.first_own.end() || own->second > last) continue;
      fail(w, last,
           short_label(at(w, last)) + " (the previous refresh's inversion of layer " +
               str(std::get<1>(linear)) + " " +
               std::string(to_string(static_cast<LinearKind>(std::get<2>(linear)))) +
               ", run in this window) comes after " + short_label(at(w, own->second)) +
               " of this window at position " + str(own->second) +
               ": with a pipelined refresh the previous refresh's inversions of a Linear precede "
               "the window's inversions of it (which finalize the factors they read) and its "
               "preconditioning (which uses their inverses)");
    }
  }

  void check_kfac() const {
    const std::size_t layer_keys = static_cast<std::size_t>(keys_.steps) *
                                   static_cast<std::size_t>(keys_.pipelines) *
                                   static_cast<std::size_t>(num_layers_) * kNumLinearKinds;
    auto layer_key = [&](const Instruction& in, int pipeline) {
      return ((static_cast<std::size_t>(in.step) * static_cast<std::size_t>(keys_.pipelines) +
               static_cast<std::size_t>(pipeline)) *
                  static_cast<std::size_t>(num_layers_) +
              static_cast<std::size_t>(in.layer)) *
                 kNumLinearKinds +
             static_cast<std::size_t>(in.linear);
    };
    std::vector<std::int32_t> last_a(layer_keys, kNone);
    std::vector<std::int32_t> last_b(layer_keys, kNone);
    std::vector<std::int32_t> last_sync(layer_keys, kNone);
    std::vector<std::int32_t> last_inversion(layer_keys, kNone);
    std::vector<std::int32_t> last_precondition(layer_keys, kNone);
    // Per (worker, pipeline, layer, linear), any step: the refresh's inverse broadcast.
    std::map<std::tuple<int, int, int, int>, std::int32_t> inverse_broadcast;
    // Per worker: its curvature syncs with a peer worker, in stream order.
    std::vector<std::vector<std::pair<int, SyncPost>>> sync_posts(
        static_cast<std::size_t>(workers_));
    // Pass 1: last positions of curvature and sync per (step, pipeline, layer, linear), and the
    // chains of pieces.
    for (int w = 0; w < workers_; ++w) {
      const auto& stream = s_.streams[static_cast<std::size_t>(w)];
      PieceChains chains;
      WindowOrder order;
      for (std::size_t i = 0; i < stream.size(); ++i) {
        const Instruction& in = stream[i];
        if (!is_kfac(in.kind)) continue;
        const auto pos = static_cast<std::int32_t>(i);
        const ChunkRef ref = kfac_chunk(w, pos, in);
        const LinearOnWorker linear{ref.pipeline, in.layer, static_cast<int>(in.linear)};
        if (is_kfac_transfer(in.kind)) continue;  // check_kfac_offload
        if (is_wrapped(in)) {
          order.wrapped[task_of(in, in.step + keys_.steps)].push_back(pos);
          if (in.kind == OpKind::kCurvatureSync) {
            // It reduces the previous refresh's sums (set aside): it shares no state with the
            // window's work, and pairs with its partner's in stream order like any sync.
            auto& last = order.last_wrapped_sync[linear];
            last = std::max(last, pos);
            if (in.peer >= 0) {
              sync_posts[static_cast<std::size_t>(w)].emplace_back(
                  in.peer, SyncPost{{in.step, in.layer, static_cast<int>(in.linear), in.piece_begin,
                                     in.piece_end},
                                    pos});
            }
            continue;
          }
          auto& last = order.last_wrapped[linear];
          last = std::max(last, pos);
          continue;  // its curvature ran in the previous window: checked below
        }
        // The window's curvature and sync accumulate into a second set of factor sums: only
        // its inversions and preconditioning share state with the wrapped inversions.
        const bool uses_inverse_state = in.kind == OpKind::kInvertA ||
                                        in.kind == OpKind::kInvertB ||
                                        in.kind == OpKind::kPrecondition;
        if (uses_inverse_state && order.first_own.count(linear) == 0) order.first_own[linear] = pos;
        if ((in.kind == OpKind::kInvertA || in.kind == OpKind::kInvertB) &&
            order.first_own_inversion.count(linear) == 0) {
          order.first_own_inversion[linear] = pos;
        }
        if (in.kind == OpKind::kInvertA || in.kind == OpKind::kInvertB ||
            in.kind == OpKind::kCurvatureSync) {
          order.own_end[task_of(in, in.step)] = in.piece_end;
        }
        check_piece(chains, w, pos, in);
        const std::size_t lk = layer_key(in, ref.pipeline);
        if (in.kind == OpKind::kCurvatureA) last_a[lk] = std::max(last_a[lk], pos);
        if (in.kind == OpKind::kCurvatureB) last_b[lk] = std::max(last_b[lk], pos);
        if (in.kind == OpKind::kCurvatureSync) {
          last_sync[lk] = std::max(last_sync[lk], pos);
          if (in.peer >= 0) {
            sync_posts[static_cast<std::size_t>(w)].emplace_back(
                in.peer, SyncPost{{in.step, in.layer, static_cast<int>(in.linear), in.piece_begin,
                                   in.piece_end},
                                  pos});
          }
        }
        if (in.kind == OpKind::kInvertA || in.kind == OpKind::kInvertB) {
          last_inversion[lk] = std::max(last_inversion[lk], pos);
        }
        if (in.kind == OpKind::kPrecondition) {
          last_precondition[lk] = std::max(last_precondition[lk], pos);
        }
        if (in.kind == OpKind::kBroadcastInverses) {
          auto& at_pos =
              inverse_broadcast[{w, ref.pipeline, in.layer, static_cast<int>(in.linear)}];
          at_pos = std::max(at_pos, pos);
        }
      }
      check_wrapped_work(w, order, last_a, last_b, layer_key);
      for (const auto& [task, chain] : chains) {
        if (order.wrapped.count(task) != 0) continue;  // continued in the next window: checked
        if (chain.next_unit != 0 && chain.next_unit != kPieceUnits) {
          fail(w, chain.last_position,
               "the pieces of " + short_label(at(w, chain.last_position)) +
                   "'s task stop at unit " + str(chain.next_unit) + " of " + str(kPieceUnits) +
                   ": the rest of the task is missing from the stream");
        }
      }
    }
    check_sync_partners(sync_posts);
    // Pass 2: ordering.
    for (int w = 0; w < workers_; ++w) {
      const auto& stream = s_.streams[static_cast<std::size_t>(w)];
      for (std::size_t i = 0; i < stream.size(); ++i) {
        const Instruction& in = stream[i];
        if (!is_kfac(in.kind) || is_wrapped(in)) continue;  // wrapped: check_wrapped_work
        const auto pos = static_cast<std::int32_t>(i);
        const ChunkRef ref = kfac_chunk(w, pos, in);
        const std::size_t lk = layer_key(in, ref.pipeline);
        const std::string layer_name =
            "layer " + str(in.layer) + " " + std::string(to_string(in.linear));
        switch (in.kind) {
          case OpKind::kCurvatureA:
          case OpKind::kCurvatureB: {
            if (in.microbatch < 0 || in.microbatch >= keys_.microbatches) {
              fail(w, pos,
                   "curvature needs a micro-batch in [0, " + str(keys_.microbatches) + "), got " +
                       str(in.microbatch));
            }
            const std::size_t key = keys_.index(in.step, ref.pipeline, ref.chunk, in.microbatch);
            const bool is_a = in.kind == OpKind::kCurvatureA;
            const std::int32_t needed = is_a ? forward_pos_[key] : backward_pos_[key];
            if (needed > pos) {
              fail(w, pos,
                   std::string(is_a ? "curvature A before its forward"
                                    : "curvature B before its backward") +
                       " (position " + str(needed) + ")");
            }
            break;
          }
          case OpKind::kCurvatureSync: {
            const std::int32_t last = std::max(last_a[lk], last_b[lk]);
            if (last > pos) {
              fail(w, pos,
                   "curvature sync of " + layer_name +
                       " before its curvature at "
                       "position " +
                       str(last));
            }
            break;
          }
          case OpKind::kInvertA:
          case OpKind::kInvertB: {
            // Both factors: the pi-adjusted damping of either inverse needs both.
            const bool is_a = in.kind == OpKind::kInvertA;
            const std::int32_t last = std::max({last_a[lk], last_b[lk], last_sync[lk]});
            if (last > pos) {
              fail(w, pos,
                   std::string(is_a ? "inversion A" : "inversion B") + " of " + layer_name +
                       " before the curvature (A and B) or sync at position " + str(last));
            }
            break;
          }
          case OpKind::kBroadcastInverses: {
            if (last_inversion[lk] == kNone || last_inversion[lk] > pos) {
              fail(w, pos,
                   "inverse broadcast of " + layer_name +
                       (last_inversion[lk] == kNone
                            ? std::string(" without its inversions in the stream")
                            : " before its inversion at position " + str(last_inversion[lk])));
            }
            break;
          }
          case OpKind::kBroadcastGradient: {
            if (last_precondition[lk] == kNone || last_precondition[lk] > pos) {
              fail(
                  w, pos,
                  "preconditioned-gradient broadcast of " + layer_name +
                      (last_precondition[lk] == kNone
                           ? std::string(" without its step's precondition in the stream")
                           : " before its precondition at position " + str(last_precondition[lk])));
            }
            const std::int32_t opt =
                optimizer_pos_[static_cast<std::size_t>(w) * static_cast<std::size_t>(keys_.steps) +
                               static_cast<std::size_t>(in.step)];
            if (opt != kNone && opt < pos) {
              fail(w, pos,
                   "preconditioned-gradient broadcast of " + layer_name +
                       " after its step's optimizer step at position " + str(opt));
            }
            break;
          }
          case OpKind::kPrefetchFactors:
          case OpKind::kWriteBackState:
          case OpKind::kPrefetchInverses:
            break;    // check_kfac_offload
          default: {  // precondition
            // The refresh's last step preconditions with the new inverses: after their broadcast.
            if (in.step == keys_.steps - 1) {
              const auto it =
                  inverse_broadcast.find({w, ref.pipeline, in.layer, static_cast<int>(in.linear)});
              if (it != inverse_broadcast.end() && it->second > pos) {
                fail(w, pos,
                     "precondition of " + layer_name +
                         " in the refresh's last step before the inverse broadcast at position " +
                         str(it->second));
              }
            }
            const std::size_t ck = keys_.chunk_index(in.step, ref.pipeline, ref.chunk);
            const std::int32_t last = last_backward_[ck];
            if (last > pos) {
              fail(w, pos,
                   "precondition of " + layer_name +
                       " before the last backward of its chunk at position " + str(last));
            }
            // Every replica preconditions the same, reduced, gradient.
            const std::int32_t reduced = std::max(reduce_pipelines_pos_[ck], reduce_dp_pos_[ck]);
            if (reduced != kNone && reduced > pos) {
              fail(w, pos,
                   "precondition of " + layer_name +
                       " before the gradient reduction of its chunk at position " + str(reduced));
            }
            const std::int32_t opt =
                optimizer_pos_[static_cast<std::size_t>(w) * static_cast<std::size_t>(keys_.steps) +
                               static_cast<std::size_t>(in.step)];
            if (opt != kNone && opt < pos) {
              fail(w, pos,
                   "precondition of " + layer_name +
                       " after its step's optimizer step "
                       "at position " +
                       str(opt));
            }
            break;
          }
        }
      }
    }
  }

  // K-FAC state offloaded to host memory (docs/offload.md): a Linear with offload transfers in a
  // worker's stream holds its state on the device only between a prefetch and its release, so
  // every use must follow its prefetch: each inversion between a factor prefetch and the
  // write-back after it (which needs an inversion since the prefetch), each step's
  // preconditioning after that step's inverse prefetch (one per step, released by the
  // preconditioning's last piece, so that one copy is on the device at a time), and the
  // inverse prefetches that read new inverses after those have been written back: the
  // refresh's last step's; with a pipelined refresh every step's, after the previous refresh's
  // inversions run in the window (whose factor windows hold no inversion of this refresh, and
  // whose write-backs may end an unfinished chain of pieces). With sharded state (inverse
  // broadcasts) the broadcast runs inside the factor window of the refresh's last inversion,
  // and its write-back follows it (the broadcast reads or fills the new inverses on the device).
  // A Linear offloaded factors only (its factor copies marked, sched::is_factors_only) keeps its
  // inverses on the device: no inverse prefetch of it anywhere, its preconditionings need none.
  void check_kfac_offload() const {
    using LinearOf = std::tuple<int, int, int>;  // pipeline, layer, linear
    struct Residency {
      bool factors = false;         // prefetched, not yet written back
      bool pieces = false;          // an inversion piece ran since the factor prefetch
      bool inverted = false;        // an inversion completed since the factor prefetch
      int refresh = -1;             // ... of the window's refresh (1: the previous, wrapped)
      bool unwritten = false;       // an inversion completed since the last write-back
      int inversions = 0;           // inversion tasks of the window's refresh in the stream
      int inversions_done = 0;      // completed so far
      int wrapped = 0;              // the previous refresh's, run in this window (pipelined)
      int wrapped_done = 0;         // completed so far
      int broadcasts = 0;           // the refresh's inverse broadcasts (sharded state)
      bool broadcast_done = false;  // since the last write-back
      std::set<int> inverse_steps;  // steps whose inverses were prefetched
      int fetched_step = -1;        // the step whose prefetched inverses are on the device
      std::int32_t factors_position = kNone;
      // Offloaded factors only (sched::is_factors_only on its factor copies): the inverses stay
      // on the device, so no inverse prefetch, and its preconditionings need none.
      bool factors_only = false;
    };
    const bool pipelined = s_.kfac_pipelined_refresh;
    for (int w = 0; w < workers_; ++w) {
      const auto& stream = s_.streams[static_cast<std::size_t>(w)];
      std::map<LinearOf, Residency> offloaded;
      for (std::size_t i = 0; i < stream.size(); ++i) {
        const Instruction& in = stream[i];
        if (!is_kfac_transfer(in.kind)) continue;
        const ChunkRef ref = kfac_chunk(w, static_cast<std::int32_t>(i), in);
        Residency& r = offloaded[{ref.pipeline, in.layer, static_cast<int>(in.linear)}];
        if (is_factors_only(in)) r.factors_only = true;
      }
      if (offloaded.empty()) continue;
      // A factors-only Linear's factor copies all say so, and it has no inverse prefetch.
      for (std::size_t i = 0; i < stream.size(); ++i) {
        const Instruction& in = stream[i];
        if (!is_kfac_transfer(in.kind)) continue;
        const auto pos = static_cast<std::int32_t>(i);
        const ChunkRef ref = kfac_chunk(w, pos, in);
        const Residency& r = offloaded.at({ref.pipeline, in.layer, static_cast<int>(in.linear)});
        if (!r.factors_only) continue;
        const std::string name = "layer " + str(in.layer) + " " + std::string(to_string(in.linear));
        if (in.kind == OpKind::kPrefetchInverses) {
          fail(w, pos,
               "inverse prefetch of " + name +
                   ", offloaded factors only (its inverses stay on the device; a Linear whose "
                   "inverses are offloaded marks no factor copy factors-only)");
        }
        if (!is_factors_only(in)) {
          fail(w, pos,
               "factor copy of " + name +
                   " not marked factors-only while another of its copies is (every factor "
                   "prefetch and write-back of a Linear offloaded factors only carries the mark)");
        }
      }
      for (std::size_t i = 0; i < stream.size(); ++i) {
        const Instruction& in = stream[i];
        const bool completes = (in.kind == OpKind::kInvertA || in.kind == OpKind::kInvertB) &&
                               in.piece_end == kPieceUnits;
        if (!completes && in.kind != OpKind::kBroadcastInverses) continue;
        const ChunkRef ref = kfac_chunk(w, static_cast<std::int32_t>(i), in);
        const auto it = offloaded.find({ref.pipeline, in.layer, static_cast<int>(in.linear)});
        if (it == offloaded.end()) continue;
        if (in.kind == OpKind::kBroadcastInverses) {
          ++it->second.broadcasts;
        } else {
          ++(is_wrapped(in) ? it->second.wrapped : it->second.inversions);
        }
      }
      for (std::size_t i = 0; i < stream.size(); ++i) {
        const Instruction& in = stream[i];
        if (!is_kfac(in.kind) || in.kind == OpKind::kCurvatureSync ||
            in.kind == OpKind::kBroadcastGradient) {
          continue;
        }
        const auto pos = static_cast<std::int32_t>(i);
        const ChunkRef ref = kfac_chunk(w, pos, in);
        const auto it = offloaded.find({ref.pipeline, in.layer, static_cast<int>(in.linear)});
        if (it == offloaded.end()) continue;
        Residency& r = it->second;
        const std::string name =
            "offloaded layer " + str(in.layer) + " " + std::string(to_string(in.linear));
        switch (in.kind) {
          case OpKind::kPrefetchFactors:
            if (r.factors) {
              fail(w, pos,
                   "second factor prefetch of " + name + " (the one at position " +
                       str(r.factors_position) + " was not written back)");
            }
            r.factors = true;
            r.pieces = r.inverted = false;
            r.refresh = -1;
            r.factors_position = pos;
            break;
          case OpKind::kInvertA:
          case OpKind::kInvertB: {
            if (!r.factors) {
              fail(w, pos,
                   "inversion of " + name +
                       " without its factors on the device: no prefetch_factors before it since "
                       "the last write-back");
            }
            r.pieces = true;
            if (in.piece_end != kPieceUnits) break;
            const int refresh = is_wrapped(in) ? 1 : 0;
            if (r.refresh >= 0 && r.refresh != refresh) {
              fail(w, pos,
                   "inversion of " + name + " in the factor window of the " +
                       (refresh == 1 ? "window's own refresh" : "previous refresh") +
                       " (prefetched at position " + str(r.factors_position) +
                       "): the previous refresh's inverses are written back before the next "
                       "ones are computed");
            }
            r.refresh = refresh;
            r.inverted = r.unwritten = true;
            ++(refresh == 1 ? r.wrapped_done : r.inversions_done);
            break;
          }
          case OpKind::kBroadcastInverses:
            if (!r.factors || r.inversions_done < r.inversions) {
              fail(w, pos,
                   "inverse broadcast of " + name +
                       (r.factors ? std::string(" before the refresh's last inversion")
                                  : std::string(" outside a factor window (its owner sends, the "
                                                "others receive, the new inverses on the device "
                                                "before their write-back)")));
            }
            r.broadcast_done = true;
            break;
          case OpKind::kWriteBackState:
            // A pipelined refresh's chain of pieces may stop at the window's end and finish in
            // the next one: its own window writes back the factors it finalized.
            if (!r.factors || !(pipelined ? r.pieces : r.inverted)) {
              fail(w, pos,
                   "write-back of " + name +
                       (r.factors ? std::string(" before an inversion since its factor prefetch")
                                  : std::string(" without a factor prefetch before it")));
            }
            if (r.broadcasts > 0 && r.refresh == 0 && r.inversions_done == r.inversions &&
                !r.broadcast_done) {
              fail(w, pos, "write-back of " + name + " before its inverse broadcast");
            }
            r.factors = false;
            r.unwritten = false;
            r.broadcast_done = false;
            break;
          case OpKind::kPrefetchInverses:
            if (!r.inverse_steps.insert(in.step).second) {
              fail(w, pos, "second inverse prefetch of " + name + " in step " + str(in.step));
            }
            if (r.fetched_step >= 0) {
              fail(w, pos,
                   "inverse prefetch of " + name + " while the inverses of step " +
                       str(r.fetched_step) +
                       " are still on the device (its preconditioning has not finished)");
            }
            if (pipelined && (r.wrapped_done < r.wrapped || (r.unwritten && r.refresh == 1))) {
              fail(w, pos,
                   "inverse prefetch of " + name +
                       " before the write-back of the previous refresh's inverses (its "
                       "inversions run in this window; with a pipelined refresh every step "
                       "reads them)");
            }
            if (!pipelined && in.step == keys_.steps - 1 &&
                (r.inversions_done < r.inversions || r.unwritten)) {
              fail(w, pos,
                   "inverse prefetch of " + name +
                       " in the refresh's last step before the write-back of its new inverses");
            }
            r.fetched_step = in.step;
            break;
          case OpKind::kPrecondition:
            if (r.factors_only) break;  // the inverses are on the device
            if (r.fetched_step != in.step) {
              fail(w, pos,
                   "precondition of " + name + " in step " + str(in.step) +
                       " without its inverses on the device: no prefetch_inverses of that step "
                       "before it");
            }
            if (in.piece_end == kPieceUnits) r.fetched_step = -1;  // released
            break;
          default:
            break;
        }
      }
      for (const auto& [linear, r] : offloaded) {
        if (r.factors) {
          fail(w, r.factors_position,
               "factors of offloaded layer " + str(std::get<1>(linear)) + " " +
                   std::string(to_string(static_cast<LinearKind>(std::get<2>(linear)))) +
                   " prefetched here are never written back");
        }
      }
    }
  }

  Cell partner_of(const Instruction& in) const {
    const auto m = static_cast<std::size_t>(keys_.microbatches);
    if (in.kind == OpKind::kReduceGradPipelines) {
      const int other = 1 - in.pipeline;
      return {worker_of(other, in.chunk),
              reduce_pipelines_pos_[keys_.chunk_index(in.step, other, in.chunk)]};
    }
    const std::size_t key = keys_.index(in.step, in.pipeline, in.chunk, in.microbatch);
    switch (in.kind) {
      case OpKind::kSendActivation:
        return {worker_of(in.pipeline, in.chunk + 1), recv_act_pos_[key + m]};
      case OpKind::kRecvActivation:
        return {worker_of(in.pipeline, in.chunk - 1), send_act_pos_[key - m]};
      case OpKind::kSendGradient:
        return {worker_of(in.pipeline, in.chunk - 1), recv_grad_pos_[key - m]};
      default:
        return {worker_of(in.pipeline, in.chunk + 1), send_grad_pos_[key + m]};
    }
  }

  // Who worker w's blocked head waits for.
  int waits_for(int w, std::int32_t pos) const {
    const Instruction& in = at(w, pos);
    if (is_point_to_point(in.kind) || in.kind == OpKind::kReduceGradPipelines) {
      return partner_of(in).worker;
    }
    const std::size_t key = keys_.index(in.step, in.pipeline, in.chunk, in.microbatch);
    const auto m = static_cast<std::size_t>(keys_.microbatches);
    if (in.kind == OpKind::kForward) return worker_of(in.pipeline, in.chunk - 1);
    if (forward_end_[key] < 0) return w;
    if (in.kind != OpKind::kBackwardWeight && backward_end_[key + m] < 0) {
      return worker_of(in.pipeline, in.chunk + 1);
    }
    return w;
  }

  [[noreturn]] void report_deadlock(const std::vector<std::int32_t>& head) const {
    auto finished = [&](int w) {
      return static_cast<std::size_t>(head[static_cast<std::size_t>(w)]) ==
             s_.streams[static_cast<std::size_t>(w)].size();
    };
    int start = 0;
    while (finished(start)) ++start;
    std::vector<int> chain;
    std::vector<int> seen(static_cast<std::size_t>(workers_), -1);
    int w = start;
    while (seen[static_cast<std::size_t>(w)] < 0 && !finished(w)) {
      seen[static_cast<std::size_t>(w)] = static_cast<int>(chain.size());
      chain.push_back(w);
      w = waits_for(w, head[static_cast<std::size_t>(w)]);
    }
    auto describe = [&](int worker) {
      const std::int32_t pos = head[static_cast<std::size_t>(worker)];
      return "worker " + str(worker) + " at position " + str(pos) + " (" +
             short_label(at(worker, pos)) + ")";
    };
    std::string message = lowered_ ? "deadlock under blocking send/receive semantics: "
                                   : "the streams can never finish (a cyclic wait): ";
    if (finished(w)) {
      const int last = chain.back();
      message += describe(last) + " waits for worker " + str(w) +
                 ", which has finished its stream without reaching the matching instruction";
      fail(last, head[static_cast<std::size_t>(last)], message.substr(0));
    }
    const int cycle_start = seen[static_cast<std::size_t>(w)];
    std::string cycle;
    for (std::size_t i = static_cast<std::size_t>(cycle_start); i < chain.size(); ++i) {
      cycle += describe(chain[i]) + " waits for ";
    }
    cycle += "worker " + str(w) + " (cycle)";
    const int first = chain[static_cast<std::size_t>(cycle_start)];
    fail(first, head[static_cast<std::size_t>(first)], message + cycle);
  }

  const Schedule& s_;
  int workers_ = 0;
  int num_layers_ = 0;
  KeySpace keys_;
  bool lowered_ = false;
  bool has_kfac_ = false;
  std::vector<std::vector<ChunkRef>> chunks_of_worker_;
  std::vector<std::int32_t> layer_chunk_;  // [pipeline * L + layer] -> chunk
  std::vector<std::int32_t> forward_pos_, backward_pos_, weight_pos_;
  std::vector<std::uint8_t> split_;
  std::vector<std::int32_t> send_act_pos_, recv_act_pos_, send_grad_pos_, recv_grad_pos_;
  std::vector<std::int32_t> reduce_pipelines_pos_, reduce_dp_pos_, optimizer_pos_;
  std::vector<std::int32_t> last_backward_;  // per (step, pipeline, chunk)
  std::vector<double> forward_end_, backward_end_;
  std::vector<double> activation_arrival_, gradient_arrival_;  // layouts: data ready
};

}  // namespace

void validate(const Schedule& schedule) {
  Validator validator(schedule);
  validator.check();
  validator.replay(nullptr, nullptr);
}

std::vector<std::vector<traces::SpanTiming>> replay_timings(const Schedule& schedule,
                                                            const DurationFn& duration) {
  Validator validator(schedule);
  validator.check();
  Timings timings;
  validator.replay(&duration, &timings);
  return timings;
}

}  // namespace pf::sched
