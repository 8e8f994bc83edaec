#include "sim/simulator.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <queue>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "sim/op_names.h"
#include "sim/processor_share.h"

namespace pf::sim {
namespace {

using sched::Instruction;
using sched::OpKind;
using sched::Schedule;

// Lanes as bits so that a collective can hold both communication lanes.
constexpr std::uint8_t kComputeLane = 1;
constexpr std::uint8_t kSendLane = 2;
constexpr std::uint8_t kRecvLane = 4;  // held by collectives (a ring all-reduce also receives)
constexpr std::uint8_t kHostLane = 8;  // the host link (PCIe): K-FAC offload copies
constexpr int kNumLanes = 4;

// kHostCopy: a K-FAC offload transfer between device and host memory (sched::is_kfac_transfer).
enum class Role : std::uint8_t { kCompute, kSend, kRecv, kCollective, kHostCopy };

Role role_of(OpKind kind) {
  switch (kind) {
    case OpKind::kSendActivation:
    case OpKind::kSendGradient:
      return Role::kSend;
    case OpKind::kRecvActivation:
    case OpKind::kRecvGradient:
      return Role::kRecv;
    case OpKind::kReduceGradPipelines:
    case OpKind::kReduceGradDataParallel:
    case OpKind::kCurvatureSync:
    case OpKind::kBroadcastInverses:
    case OpKind::kBroadcastGradient:
      return Role::kCollective;
    case OpKind::kPrefetchFactors:
    case OpKind::kWriteBackState:
    case OpKind::kPrefetchInverses:
      return Role::kHostCopy;
    default:
      return Role::kCompute;
  }
}

std::uint8_t lanes_of(Role role) {
  switch (role) {
    case Role::kSend:
      return kSendLane;
    case Role::kRecv:
      return 0;  // a posted receive (irecv) holds no lane while it waits for its data
    case Role::kCollective:
      return kSendLane | kRecvLane;
    case Role::kHostCopy:
      return kHostLane;
    case Role::kCompute:
      break;
  }
  return kComputeLane;
}

bool is_weight_gradient(OpKind kind) {
  return kind == OpKind::kBackward || kind == OpKind::kBackwardWeight;
}
bool is_input_gradient(OpKind kind) {
  return kind == OpKind::kBackward || kind == OpKind::kBackwardInput;
}
bool is_gradient_reduction(OpKind kind) {
  return kind == OpKind::kReduceGradPipelines || kind == OpKind::kReduceGradDataParallel;
}

// Index spaces of the flat lookup tables (no hashing, no string keys).
struct Keys {
  std::int64_t steps = 1, pipelines = 1, chunks = 1, microbatches = 1, layers = 1;

  std::int64_t microbatch_key(int step, int pipeline, int chunk, int microbatch) const {
    if (chunk < 0 || chunk >= chunks || microbatch < 0) return -1;
    return ((std::int64_t{step} * pipelines + pipeline) * chunks + chunk) * microbatches +
           microbatch;
  }
  std::int64_t chunk_key(int step, int pipeline, int chunk) const {
    if (chunk < 0 || chunk >= chunks) return -1;
    return (std::int64_t{step} * pipelines + pipeline) * chunks + chunk;
  }
  std::int64_t linear_key(int step, int layer, sched::LinearKind linear) const {
    if (layer < 0) return -1;
    return (std::int64_t{step} * layers + layer) * sched::kNumLinearKinds +
           static_cast<int>(linear);
  }
  std::int64_t microbatch_space() const { return steps * pipelines * chunks * microbatches; }
  std::int64_t chunk_space() const { return steps * pipelines * chunks; }
  std::int64_t linear_space() const { return steps * layers * sched::kNumLinearKinds; }
};

struct Dep {
  std::int32_t source;
  double delay;  // ready at end[source] + delay
};

void check_duration(double seconds, const Instruction& instruction, int worker, int position,
                    const char* what) {
  if (!std::isfinite(seconds) || seconds < 0.0) {
    throw std::invalid_argument("cost model gave " + std::string(what) + " " +
                                std::to_string(seconds) + " s (must be finite and >= 0) for " +
                                describe(instruction, worker, position));
  }
}

class Engine {
 public:
  Engine(const Schedule& schedule, const CostModel& costs, const SimOptions& options)
      : schedule_(schedule), costs_(costs), options_(options) {}

  SimResult run() {
    resolve_shared_processors();
    flatten();
    size_keys();
    index_producers();
    pair_point_to_point();
    build_dependencies();
    group_collectives();
    replay();
    return report();
  }

 private:
  // The processor of every worker (processor_of_), or none when every worker has its own.
  void resolve_shared_processors() {
    processor_of_ = resolve_processors(options_.shared_processors, schedule_.num_workers());
  }

  // ---- flattening --------------------------------------------------------------------------
  void flatten() {
    const int workers = schedule_.num_workers();
    offset_.assign(static_cast<std::size_t>(workers) + 1, 0);
    for (int w = 0; w < workers; ++w) {
      offset_[w + 1] = offset_[w] + static_cast<std::int64_t>(schedule_.streams[w].size());
    }
    n_ = offset_[workers];
    if (n_ > std::int64_t{std::numeric_limits<std::int32_t>::max()}) {
      throw std::invalid_argument("schedule has too many instructions to simulate: " +
                                  std::to_string(n_));
    }
    instr_.resize(n_);
    worker_of_.resize(n_);
    for (int w = 0; w < workers; ++w) {
      const auto& stream = schedule_.streams[w];
      for (std::size_t i = 0; i < stream.size(); ++i) {
        instr_[offset_[w] + i] = &stream[i];
        worker_of_[offset_[w] + i] = w;
      }
    }
  }

  int position_of(std::int64_t g) const { return static_cast<int>(g - offset_[worker_of_[g]]); }
  std::string where(std::int64_t g) const {
    return describe(*instr_[g], worker_of_[g], position_of(g));
  }

  void size_keys() {
    const auto& placement = schedule_.placement;
    int max_step = schedule_.num_steps - 1, max_pipeline = placement.num_pipelines - 1;
    int max_chunk = placement.chunks_per_pipeline - 1, max_mb = 0;
    int max_layer = placement.num_layers - 1;
    for (std::int64_t g = 0; g < n_; ++g) {
      const Instruction& in = *instr_[g];
      // A pipelined refresh's inversion or curvature sync of the previous window
      // (sched::is_wrapped): its dependencies ran in that window; the stream order (and, a sync,
      // its partner) places it.
      const bool wrapped =
          schedule_.kfac_pipelined_refresh && sched::is_wrapped(in) &&
          (in.kind == OpKind::kInvertA || in.kind == OpKind::kInvertB ||
           in.kind == OpKind::kCurvatureSync || in.kind == OpKind::kPrefetchFactors ||
           in.kind == OpKind::kWriteBackState);
      if ((in.step < 0 && !wrapped) || in.pipeline < 0) {
        throw std::invalid_argument("negative step or pipeline in " + where(g));
      }
      max_step = std::max<int>(max_step, in.step);
      max_pipeline = std::max<int>(max_pipeline, in.pipeline);
      max_chunk = std::max(max_chunk, in.chunk);
      max_mb = std::max(max_mb, in.microbatch);
      max_layer = std::max<int>(max_layer, in.layer);
    }
    keys_.steps = std::max(1, max_step + 1);
    keys_.pipelines = std::max(1, max_pipeline + 1);
    keys_.chunks = std::max(1, max_chunk + 1);
    keys_.microbatches = max_mb + 1;
    keys_.layers = std::max(1, max_layer + 1);
    // Flat tables must stay proportional to the schedule: refuse absurdly sparse indices.
    const std::int64_t budget = 64 * n_ + (1 << 20);
    if (keys_.microbatch_space() > budget || keys_.linear_space() > budget) {
      throw std::invalid_argument(
          "schedule indices are too sparse to simulate (steps " + std::to_string(keys_.steps) +
          ", chunks " + std::to_string(keys_.chunks) + ", micro-batches " +
          std::to_string(keys_.microbatches) + ", layers " + std::to_string(keys_.layers) +
          " for " + std::to_string(n_) + " instructions)");
    }
  }

  // ---- producers of data ---------------------------------------------------------------------
  void claim(std::vector<std::int32_t>& table, std::int64_t key, std::int64_t g) {
    if (key < 0) throw std::invalid_argument("chunk or micro-batch missing in " + where(g));
    if (table[key] >= 0) {
      throw std::invalid_argument("duplicate instruction: " + where(g) + " repeats " +
                                  where(table[key]));
    }
    table[key] = static_cast<std::int32_t>(g);
  }

  void index_producers() {
    forward_at_.assign(keys_.microbatch_space(), -1);
    input_grad_at_.assign(keys_.microbatch_space(), -1);
    weight_grad_at_.assign(keys_.microbatch_space(), -1);
    last_weight_grad_of_chunk_.assign(keys_.chunk_space(), -1);
    for (std::int64_t g = 0; g < n_; ++g) {
      const Instruction& in = *instr_[g];
      if (!is_compute_kind(in.kind) || in.kind == OpKind::kOptimizerStep || is_kfac_kind(in.kind)) {
        continue;
      }
      const std::int64_t key = keys_.microbatch_key(in.step, in.pipeline, in.chunk, in.microbatch);
      if (in.kind == OpKind::kForward) claim(forward_at_, key, g);
      if (is_input_gradient(in.kind)) claim(input_grad_at_, key, g);
      if (in.kind == OpKind::kBackwardWeight) claim(weight_grad_at_, key, g);
      if (is_weight_gradient(in.kind)) {
        last_weight_grad_of_chunk_[keys_.chunk_key(in.step, in.pipeline, in.chunk)] =
            static_cast<std::int32_t>(g);
      }
    }
  }

  int placed_worker(int pipeline, int chunk) const {
    const auto& placement = schedule_.placement;
    const std::int64_t index = std::int64_t{pipeline} * placement.chunks_per_pipeline + chunk;
    if (chunk < 0 || chunk >= placement.chunks_per_pipeline || index < 0 ||
        index >= static_cast<std::int64_t>(placement.chunks.size())) {
      return -1;
    }
    return placement.chunks[index].worker;
  }

  void pair_point_to_point() {
    partner_.assign(n_, -1);
    producer_chunk_.assign(n_, -1);
    recv_activation_at_.assign(keys_.microbatch_space(), -1);
    recv_gradient_at_.assign(keys_.microbatch_space(), -1);

    std::vector<std::pair<std::int64_t, std::int32_t>> sends, recvs;
    std::int64_t max_pair = -1;
    for (std::int64_t g = 0; g < n_; ++g) {
      const Instruction& in = *instr_[g];
      const Role role = role_of(in.kind);
      if (role != Role::kSend && role != Role::kRecv) continue;
      if (in.pair_id < 0) throw std::invalid_argument("send/receive without pair_id: " + where(g));
      (role == Role::kSend ? sends : recvs).emplace_back(in.pair_id, static_cast<std::int32_t>(g));
      max_pair = std::max(max_pair, in.pair_id);
    }
    const auto count = static_cast<std::int64_t>(sends.size() + recvs.size());
    if (max_pair < 2 * count + 16) {
      // Lowered schedules number their pairs densely: match through a flat table.
      std::vector<std::int32_t> send_of(max_pair + 1, -1);
      for (const auto& [pair, g] : sends) {
        if (send_of[pair] >= 0) {
          throw std::invalid_argument("two sends share pair_id " + std::to_string(pair) + ": " +
                                      where(send_of[pair]) + " and " + where(g));
        }
        send_of[pair] = g;
      }
      for (const auto& [pair, g] : recvs) {
        const std::int32_t send = send_of[pair];
        if (send < 0) {
          throw std::invalid_argument(send == -2 ? "two receives share pair_id " +
                                                       std::to_string(pair) + ": " + where(g)
                                                 : "receive has no matching send: " + where(g));
        }
        link(send, g);
        send_of[pair] = -2;  // consumed
      }
      for (const auto& [pair, g] : sends) {
        if (send_of[pair] != -2) {
          throw std::invalid_argument("send has no matching receive: " + where(g));
        }
      }
      return;
    }
    // Sparse ids: sort both sides and walk them together.
    std::sort(sends.begin(), sends.end());
    std::sort(recvs.begin(), recvs.end());
    std::size_t r = 0;
    for (std::size_t s = 0; s < sends.size(); ++s) {
      if (s + 1 < sends.size() && sends[s + 1].first == sends[s].first) {
        throw std::invalid_argument("two sends share pair_id " + std::to_string(sends[s].first) +
                                    ": " + where(sends[s].second) + " and " +
                                    where(sends[s + 1].second));
      }
      if (r < recvs.size() && recvs[r].first < sends[s].first) {
        throw std::invalid_argument("receive has no matching send: " + where(recvs[r].second));
      }
      if (r == recvs.size() || recvs[r].first != sends[s].first) {
        throw std::invalid_argument("send has no matching receive: " + where(sends[s].second));
      }
      if (r + 1 < recvs.size() && recvs[r + 1].first == recvs[r].first) {
        throw std::invalid_argument("two receives share pair_id " + std::to_string(recvs[r].first) +
                                    ": " + where(recvs[r].second) + " and " +
                                    where(recvs[r + 1].second));
      }
      link(sends[s].second, recvs[r].second);
      ++r;
    }
    if (r < recvs.size()) {
      throw std::invalid_argument("receive has no matching send: " + where(recvs[r].second));
    }
  }

  // Matches one send with its receive and works out which chunks produce and consume the data.
  // Both conventions are accepted: each side naming its own chunk (torch's "3SEND_F1" /
  // "4RECV_F1"), or both naming the same chunk (then the placement tells which side it is on).
  void link(std::int32_t send, std::int32_t recv) {
    const Instruction& s = *instr_[send];
    const Instruction& r = *instr_[recv];
    const bool activation = s.kind == OpKind::kSendActivation;
    const OpKind expected = activation ? OpKind::kRecvActivation : OpKind::kRecvGradient;
    if (r.kind != expected) {
      throw std::invalid_argument("pair_id " + std::to_string(s.pair_id) + " joins " + where(send) +
                                  " with " + where(recv) + " (kinds do not match)");
    }
    if (s.peer >= 0 && s.peer != worker_of_[recv]) {
      throw std::invalid_argument(where(send) + " names peer " + std::to_string(s.peer) +
                                  " but its receive is on worker " +
                                  std::to_string(worker_of_[recv]));
    }
    if (s.step != r.step || s.pipeline != r.pipeline || s.microbatch != r.microbatch) {
      throw std::invalid_argument("send and receive of pair_id " + std::to_string(s.pair_id) +
                                  " disagree on step, pipeline or micro-batch: " + where(send) +
                                  " / " + where(recv));
    }
    const int direction = activation ? 1 : -1;
    int producer = s.chunk, consumer = r.chunk;
    if (s.chunk == r.chunk) {
      if (placed_worker(s.pipeline, s.chunk) == worker_of_[send]) {
        consumer = s.chunk + direction;
      } else {
        producer = s.chunk - direction;
      }
    }
    const std::int64_t key = keys_.microbatch_key(r.step, r.pipeline, consumer, r.microbatch);
    if (key < 0 || producer < 0) {
      throw std::invalid_argument("receive delivers to no valid chunk: " + where(recv));
    }
    claim(activation ? recv_activation_at_ : recv_gradient_at_, key, recv);
    partner_[send] = recv;
    partner_[recv] = send;
    producer_chunk_[send] = producer;
  }

  // ---- dependencies --------------------------------------------------------------------------
  double duration_of(const Instruction& in, int worker, int position) const {
    const double seconds = costs_.duration(schedule_, worker, in);
    check_duration(seconds, in, worker, position, "duration");
    return seconds;
  }

  // Transfer time for data that crosses workers with no send/receive in the streams
  // (schedules that were not lowered).
  double implicit_transfer(std::int64_t producer, int consumer_worker, bool activation) const {
    const int producer_worker = worker_of_[producer];
    if (producer_worker == consumer_worker) return 0.0;
    const Instruction& p = *instr_[producer];
    Instruction send;
    send.kind = activation ? OpKind::kSendActivation : OpKind::kSendGradient;
    send.pipeline = p.pipeline;
    send.step = p.step;
    send.chunk = p.chunk;
    send.microbatch = p.microbatch;
    send.peer = consumer_worker;
    return duration_of(send, producer_worker, position_of(producer));
  }

  void add_dep(std::int64_t g, std::int64_t source, double delay) {
    if (source < 0) return;
    if (worker_of_[source] == worker_of_[g] && source >= g) {
      throw std::invalid_argument(where(g) + " depends on " + where(source) +
                                  ", which comes later in the same stream (it would deadlock)");
    }
    deps_.push_back(Dep{static_cast<std::int32_t>(source), delay});
  }

  std::int64_t require(std::int64_t source, std::int64_t g, const char* what) const {
    if (source < 0) {
      throw std::invalid_argument(where(g) + " needs " + what + ", which no worker runs");
    }
    return source;
  }

  // The most recent earlier instruction on the current worker recorded in `table`.
  std::int64_t local(const std::vector<std::int32_t>& table, std::int64_t key,
                     std::int64_t worker_begin) const {
    if (key < 0) return -1;
    const std::int32_t g = table[key];
    return g >= worker_begin ? g : -1;
  }

  void build_dependencies() {
    const int workers = schedule_.num_workers();
    dep_begin_.assign(n_ + 1, 0);
    deps_.clear();
    deps_.reserve(static_cast<std::size_t>(n_) * 2);
    duration_.resize(n_);
    lanes_.resize(n_);
    role_.resize(n_);

    std::vector<std::int32_t> last_curvature_a(keys_.linear_space(), -1);
    std::vector<std::int32_t> last_curvature_b(keys_.linear_space(), -1);
    std::vector<std::int32_t> last_sync(keys_.linear_space(), -1);
    std::vector<std::int32_t> last_inversion(keys_.linear_space(), -1);
    std::vector<std::int32_t> last_precondition(keys_.linear_space(), -1);
    std::vector<std::int32_t> last_prefetch_factors(keys_.linear_space(), -1);
    std::vector<std::int32_t> last_prefetch_inverses(keys_.linear_space(), -1);
    std::vector<std::int32_t> last_write_back(keys_.linear_space(), -1);  // any step: key of step 0
    std::vector<std::int32_t> last_wrapped_sync(keys_.linear_space(), -1);  // key of step 0
    // The same for the offload copies of those inversions (their factors' prefetch, then the
    // inversions, then their write-back).
    std::vector<std::int32_t> last_wrapped_prefetch(keys_.linear_space(), -1);
    std::vector<std::int32_t> last_wrapped_inversion(keys_.linear_space(), -1);
    std::vector<std::int32_t> last_reduction_of_step(keys_.steps, -1);
    std::vector<std::int32_t> last_weight_grad_of_step(keys_.steps, -1);

    for (int w = 0; w < workers; ++w) {
      const std::int64_t begin = offset_[w];
      for (std::int64_t g = begin; g < offset_[w + 1]; ++g) {
        const Instruction& in = *instr_[g];
        const int position = static_cast<int>(g - begin);
        duration_[g] = duration_of(in, w, position);
        const Role role = role_of(in.kind);
        role_[g] = role;
        lanes_[g] = options_.overlap_communication ? lanes_of(role) : kComputeLane;
        dep_begin_[g] = static_cast<std::int64_t>(deps_.size());
        if (sched::is_wrapped(in)) {
          // The previous window's work (size_keys): its dependencies ran there, except a wrapped
          // inversion's on a sync of its Linear wrapped too (the sync's lanes are not compute's).
          const std::int64_t any_step = keys_.linear_key(0, in.layer, in.linear);
          if (in.kind == OpKind::kCurvatureSync && any_step >= 0) last_wrapped_sync[any_step] = g;
          if ((in.kind == OpKind::kInvertA || in.kind == OpKind::kInvertB) && any_step >= 0) {
            add_dep(g, local(last_wrapped_sync, any_step, begin), 0.0);
            add_dep(g, local(last_wrapped_prefetch, any_step, begin), 0.0);
            last_wrapped_inversion[any_step] = g;
          }
          if (in.kind == OpKind::kPrefetchFactors && any_step >= 0) {
            last_wrapped_prefetch[any_step] = g;
          }
          if (in.kind == OpKind::kWriteBackState && any_step >= 0) {
            add_dep(g, local(last_wrapped_inversion, any_step, begin), 0.0);
            last_write_back[any_step] = g;
          }
          continue;
        }
        const std::int64_t key =
            keys_.microbatch_key(in.step, in.pipeline, in.chunk, in.microbatch);
        const std::int64_t lin = keys_.linear_key(in.step, in.layer, in.linear);
        switch (in.kind) {
          case OpKind::kForward: {
            if (in.chunk > 0) {
              const std::int64_t recv = recv_activation_at_[key];
              if (recv >= 0) {
                add_dep(g, recv, 0.0);
              } else {
                const std::int64_t producer =
                    require(forward_at_[keys_.microbatch_key(in.step, in.pipeline, in.chunk - 1,
                                                             in.microbatch)],
                            g, "the forward of the previous chunk");
                add_dep(g, producer, implicit_transfer(producer, w, true));
              }
            }
            break;
          }
          case OpKind::kBackward:
          case OpKind::kBackwardInput: {
            add_dep(g, require(forward_at_[key], g, "its forward"), 0.0);
            if (in.chunk + 1 < keys_.chunks) {
              const std::int64_t recv = recv_gradient_at_[key];
              const std::int64_t next_key =
                  keys_.microbatch_key(in.step, in.pipeline, in.chunk + 1, in.microbatch);
              if (recv >= 0) {
                add_dep(g, recv, 0.0);
              } else if (forward_at_[next_key] >= 0 || input_grad_at_[next_key] >= 0) {
                const std::int64_t producer =
                    require(input_grad_at_[next_key], g, "the backward of the next chunk");
                add_dep(g, producer, implicit_transfer(producer, w, false));
              }
            }
            break;
          }
          case OpKind::kBackwardWeight:
            add_dep(g, require(input_grad_at_[key], g, "its backward-input"), 0.0);
            break;
          case OpKind::kSendActivation:
          case OpKind::kSendGradient: {
            const std::int64_t producer_key =
                keys_.microbatch_key(in.step, in.pipeline, producer_chunk_[g], in.microbatch);
            if (producer_key < 0) throw std::invalid_argument("send of no chunk: " + where(g));
            const auto& table = in.kind == OpKind::kSendActivation ? forward_at_ : input_grad_at_;
            add_dep(g, require(table[producer_key], g, "the computation that produces its data"),
                    0.0);
            break;
          }
          case OpKind::kRecvActivation:
          case OpKind::kRecvGradient:
            break;  // its end waits for the matching send (see replay)
          case OpKind::kReduceGradPipelines:
          case OpKind::kReduceGradDataParallel: {
            if (in.chunk >= 0) {
              add_dep(g,
                      last_weight_grad_of_chunk_[keys_.chunk_key(in.step, in.pipeline, in.chunk)],
                      0.0);
            } else {
              add_dep(g, local(last_weight_grad_of_step, in.step, begin), 0.0);
            }
            break;
          }
          case OpKind::kOptimizerStep:
            add_dep(g, local(last_reduction_of_step, in.step, begin), 0.0);
            add_dep(g, local(last_weight_grad_of_step, in.step, begin), 0.0);
            break;
          case OpKind::kCurvatureA:
            add_dep(g, require(key >= 0 ? forward_at_[key] : -1, g, "its forward"), 0.0);
            break;
          case OpKind::kCurvatureB:
            add_dep(g, require(key >= 0 ? input_grad_at_[key] : -1, g, "its backward"), 0.0);
            break;
          case OpKind::kCurvatureSync:
            add_dep(g, local(last_curvature_a, lin, begin), 0.0);
            add_dep(g, local(last_curvature_b, lin, begin), 0.0);
            break;
          case OpKind::kInvertA:
            add_dep(g, local(last_curvature_a, lin, begin), 0.0);
            add_dep(g, local(last_sync, lin, begin), 0.0);
            add_dep(g, local(last_prefetch_factors, lin, begin), 0.0);
            break;
          case OpKind::kInvertB:
            add_dep(g, local(last_curvature_b, lin, begin), 0.0);
            add_dep(g, local(last_sync, lin, begin), 0.0);
            add_dep(g, local(last_prefetch_factors, lin, begin), 0.0);
            break;
          case OpKind::kPrecondition:
            if (in.chunk >= 0) {
              add_dep(g,
                      last_weight_grad_of_chunk_[keys_.chunk_key(in.step, in.pipeline, in.chunk)],
                      0.0);
            }
            add_dep(g, local(last_reduction_of_step, in.step, begin), 0.0);
            add_dep(g, local(last_prefetch_inverses, lin, begin), 0.0);  // offloaded inverses
            break;
          case OpKind::kPrefetchFactors:  // the host copy is there since the last write-back
            break;
          case OpKind::kWriteBackState:  // the refresh's new factors and inverses
            add_dep(g, local(last_inversion, lin, begin), 0.0);
            break;
          case OpKind::kPrefetchInverses:  // the refresh's last step reads the new inverses
            if (in.step == keys_.steps - 1) {
              add_dep(g, local(last_write_back, keys_.linear_key(0, in.layer, in.linear), begin),
                      0.0);
            }
            break;
          case OpKind::kBroadcastInverses:  // the owner's inverses, once both are computed
            add_dep(g, local(last_inversion, lin, begin), 0.0);
            break;
          case OpKind::kBroadcastGradient:  // the owner's preconditioned gradient
            add_dep(g, local(last_precondition, lin, begin), 0.0);
            break;
        }
        // Record this instruction for the later ones of the same stream.
        if (in.kind == OpKind::kCurvatureA && lin >= 0) last_curvature_a[lin] = g;
        if (in.kind == OpKind::kCurvatureB && lin >= 0) last_curvature_b[lin] = g;
        if (in.kind == OpKind::kCurvatureSync && lin >= 0) last_sync[lin] = g;
        if ((in.kind == OpKind::kInvertA || in.kind == OpKind::kInvertB) && lin >= 0) {
          last_inversion[lin] = g;
        }
        if (in.kind == OpKind::kPrecondition && lin >= 0) last_precondition[lin] = g;
        if (in.kind == OpKind::kPrefetchFactors && lin >= 0) last_prefetch_factors[lin] = g;
        if (in.kind == OpKind::kPrefetchInverses && lin >= 0) last_prefetch_inverses[lin] = g;
        if (in.kind == OpKind::kWriteBackState && in.layer >= 0) {
          last_write_back[keys_.linear_key(0, in.layer, in.linear)] = g;
        }
        if (is_gradient_reduction(in.kind)) last_reduction_of_step[in.step] = g;
        if (is_weight_gradient(in.kind)) last_weight_grad_of_step[in.step] = g;
      }
    }
    dep_begin_[n_] = static_cast<std::int64_t>(deps_.size());
  }

  // Collectives that name a peer are rendezvous of exactly two workers. Partners share pair_id
  // when it is set, otherwise (kind, step, chunk, layer, linear, piece, the two workers): the
  // pieces of a divided curvature sync pair piece by piece.
  void group_collectives() {
    group_of_.assign(n_, -1);
    // Key: kind, then either (-1, pair_id) or (the two workers, step, chunk, layer, linear).
    using Entry = std::array<std::int64_t, 7>;  // last element: the instruction
    std::vector<Entry> entries;
    for (std::int64_t g = 0; g < n_; ++g) {
      const Instruction& in = *instr_[g];
      if (role_of(in.kind) != Role::kCollective || in.peer < 0) continue;
      const int w = worker_of_[g];
      if (in.peer == w || in.peer >= schedule_.num_workers()) {
        throw std::invalid_argument("collective names an invalid peer: " + where(g));
      }
      const std::int64_t kind = static_cast<std::int64_t>(in.kind);
      if (in.pair_id >= 0) {
        entries.push_back(Entry{kind, -1, in.pair_id, 0, 0, 0, g});
      } else {
        const std::int64_t workers_key =
            std::int64_t{std::min(w, in.peer)} * schedule_.num_workers() + std::max(w, in.peer);
        const std::int64_t linear_and_piece = static_cast<std::int64_t>(in.linear) |
                                              std::int64_t{in.piece_begin} << 8 |
                                              std::int64_t{in.piece_end} << 24;
        entries.push_back(
            Entry{kind, workers_key, in.step, in.chunk, in.layer, linear_and_piece, g});
      }
    }
    std::sort(entries.begin(), entries.end());
    group_members_.clear();
    for (std::size_t i = 0; i < entries.size();) {
      std::size_t j = i;
      while (j < entries.size() &&
             std::equal(entries[j].begin(), entries[j].end() - 1, entries[i].begin())) {
        ++j;
      }
      const auto first = static_cast<std::int32_t>(entries[i][6]);
      if (j - i != 2) {
        throw std::invalid_argument((j - i == 1
                                         ? "collective has no partner on worker " +
                                               std::to_string(instr_[first]->peer) + ": "
                                         : std::string("collective has more than one partner: ")) +
                                    where(first));
      }
      const auto second = static_cast<std::int32_t>(entries[i + 1][6]);
      if (instr_[second]->peer != worker_of_[first] || instr_[first]->peer != worker_of_[second]) {
        throw std::invalid_argument("collective partners disagree on peers: " + where(first) +
                                    " / " + where(second));
      }
      const auto id = static_cast<std::int32_t>(group_members_.size() / 2);
      group_of_[first] = group_of_[second] = id;
      group_members_.push_back(first);
      group_members_.push_back(second);
      i = j;
    }
  }

  // ---- the event loop ------------------------------------------------------------------------
  // Events are (time, worker): the worker may issue its next instruction at that time. A worker
  // that cannot issue yet parks on the instruction whose end it needs and is woken when that end
  // becomes known. Each instruction is issued once: O(n log workers) heap work overall.
  static constexpr std::uint8_t kIssued = 1;
  static constexpr std::uint8_t kEnded = 2;

  bool ended(std::int64_t g) const { return (state_[g] & kEnded) != 0; }

  void park(int worker, std::int64_t g) {
    wait_next_[worker] = wait_head_[g];
    wait_head_[g] = worker;
  }

  void finish(std::int64_t g, double end) {
    end_[g] = end;
    state_[g] |= kEnded;
    for (int w = wait_head_[g]; w >= 0;) {
      const int next = wait_next_[w];
      queue_.emplace(end, w);
      w = next;
    }
    wait_head_[g] = -1;
    // A receive issued before its send can now learn when its data arrives.
    if (role_[g] == Role::kSend) {
      const std::int64_t recv = partner_[g];
      if ((state_[recv] & kIssued) != 0 && !ended(recv)) finish(recv, std::max(start_[recv], end));
    }
  }

  void issue(int worker, std::int64_t g, double start) {
    start_[g] = start;
    state_[g] |= kIssued;
    last_issue_[worker] = start;
    for (int lane = 0; lane < kNumLanes; ++lane) {
      if ((lanes_[g] >> lane) & 1) lane_last_[worker * kNumLanes + lane] = g;
    }
    ++pc_[worker];
    if (role_[g] == Role::kRecv) {
      const std::int64_t send = partner_[g];
      if (ended(send)) finish(g, std::max(start, end_[send]));
    } else if (role_[g] == Role::kCompute && !processors_.empty()) {
      const int p = processor_of(worker);
      processors_[p].add(g, duration_[g], start);
      schedule_processor(p);  // its end comes when the processor's share says
    } else {
      finish(g, start + duration_[g]);
    }
    queue_.emplace(start, worker);
  }

  // ---- shared processors (SimOptions::shared_processors) --------------------------------------
  // Queue entries past the workers' ids are processor events: the next end of a running job.
  // Compute on a shared processor is issued in time order (try_issue waits until `now_` reaches
  // its start), so a job never joins a processor in its past.
  int processor_of(int worker) const { return processor_of_[static_cast<std::size_t>(worker)]; }

  void schedule_processor(int p) {
    const double end = processors_[p].next_end();
    processor_event_[p] = end;
    if (std::isfinite(end)) queue_.emplace(end, schedule_.num_workers() + p);
  }

  void on_processor_event(int p, double time) {
    if (processor_event_[p] != time) return;  // superseded: a job started or ended since
    done_.clear();
    processors_[p].take_done(time, done_);
    for (const std::int64_t g : done_) finish(g, time);
    schedule_processor(p);
  }

  void try_issue(int worker) {
    if (offset_[worker] + pc_[worker] >= offset_[worker + 1] || arrived_[worker]) return;
    const std::int64_t g = offset_[worker] + pc_[worker];
    double ready = last_issue_[worker];
    for (int lane = 0; lane < kNumLanes; ++lane) {
      if (((lanes_[g] >> lane) & 1) == 0) continue;
      const std::int64_t previous = lane_last_[worker * kNumLanes + lane];
      if (previous < 0) continue;
      if (!ended(previous)) return park(worker, previous);
      ready = std::max(ready, end_[previous]);
    }
    // `free` is when the instruction could start if every transfer and collective took no time:
    // the difference is communication the compute lane waits for (exposed communication).
    double free = ready;
    for (std::int64_t d = dep_begin_[g]; d < dep_begin_[g + 1]; ++d) {
      const Dep& dep = deps_[d];
      const std::int64_t source = dep.source;
      if (!ended(source)) return park(worker, source);
      ready = std::max(ready, end_[source] + dep.delay);
      switch (role_[source]) {
        case Role::kRecv:
          free = std::max(free, std::max(start_[source], start_[partner_[source]]));
          break;
        case Role::kCollective:
        case Role::kSend:
        case Role::kHostCopy:
          free = std::max(free, start_[source]);
          break;
        case Role::kCompute:
          free = std::max(free, end_[source]);
          break;
      }
    }
    if (role_[g] == Role::kCompute && !processors_.empty() && ready > now_) {
      queue_.emplace(ready, worker);  // joins its shared processor at its start, not before
      return;
    }
    if (role_[g] == Role::kCompute) exposed_[worker] += ready - free;
    const std::int32_t group = group_of_[g];
    if (group < 0) return issue(worker, g, ready);
    // Rendezvous: wait for the partner, then both start together.
    group_ready_[group] = std::max(group_ready_[group], ready);
    arrived_[worker] = 1;
    if (++group_arrivals_[group] < 2) return;
    const double start = group_ready_[group];
    for (int k = 0; k < 2; ++k) {
      const std::int32_t member = group_members_[2 * group + k];
      arrived_[worker_of_[member]] = 0;
      issue(worker_of_[member], member, start);
    }
  }

  void replay() {
    const int workers = schedule_.num_workers();
    start_.assign(n_, 0.0);
    end_.assign(n_, 0.0);
    state_.assign(n_, 0);
    wait_head_.assign(n_, -1);
    wait_next_.assign(workers, -1);
    pc_.assign(workers, 0);
    arrived_.assign(workers, 0);
    last_issue_.assign(workers, 0.0);
    exposed_.assign(workers, 0.0);
    lane_last_.assign(static_cast<std::size_t>(workers) * kNumLanes, -1);
    group_ready_.assign(group_members_.size() / 2, 0.0);
    group_arrivals_.assign(group_members_.size() / 2, 0);
    processors_.clear();
    processor_event_.clear();
    now_ = 0.0;
    if (!processor_of_.empty()) {
      // capacity_of_processor falls back to the common capacity for processors without an
      // entry, which only processors no worker uses can lack (resolve_processors checks).
      for (int p = 0; p < workers; ++p)
        processors_.emplace_back(capacity_of_processor(options_.shared_processors, p));
      processor_event_.assign(static_cast<std::size_t>(workers),
                              std::numeric_limits<double>::infinity());
    }
    for (int w = 0; w < workers; ++w) queue_.emplace(0.0, w);
    while (!queue_.empty()) {
      const auto [time, id] = queue_.top();
      queue_.pop();
      now_ = time;
      if (id >= workers) {
        on_processor_event(id - workers, time);
      } else {
        try_issue(id);
      }
    }
    std::string stuck;
    int count = 0;
    for (int w = 0; w < workers; ++w) {
      const std::int64_t g = offset_[w] + pc_[w];
      if (g < offset_[w + 1] && count++ < 4) stuck += "\n  " + where(g);
    }
    if (count > 0) {
      throw std::invalid_argument("schedule deadlocks: " + std::to_string(count) +
                                  " worker(s) can never continue, waiting at:" + stuck);
    }
  }

  // ---- results -------------------------------------------------------------------------------
  SimResult report() {
    const int workers = schedule_.num_workers();
    SimResult result;
    result.num_steps = std::max(1, schedule_.num_steps);
    result.times.resize(workers);
    result.workers.resize(workers);
    double makespan = 0.0;
    for (int w = 0; w < workers; ++w) {
      auto& times = result.times[w];
      times.resize(offset_[w + 1] - offset_[w]);
      for (std::int64_t g = offset_[w]; g < offset_[w + 1]; ++g) {
        times[g - offset_[w]] = Timing{start_[g], end_[g]};
        makespan = std::max(makespan, end_[g]);
      }
    }
    result.makespan_s = makespan;
    result.step_time_s = makespan / result.num_steps;
    double total_busy = 0.0;
    for (int w = 0; w < workers; ++w) {
      WorkerReport& report = result.workers[w];
      const double busy = busy_time(w);
      total_busy += busy;
      report.busy_s = busy / result.num_steps;
      report.idle_s = result.step_time_s - report.busy_s;
      report.utilization = makespan > 0.0 ? busy / makespan : 0.0;
      report.exposed_communication_s = exposed_communication(w) / result.num_steps;
      if (options_.track_memory) track_memory(w, makespan, report);
    }
    result.bubble_fraction =
        makespan > 0.0 && workers > 0 ? 1.0 - total_busy / (workers * makespan) : 0.0;
    return result;
  }

  double busy_time(int w) const {
    double busy = 0.0;
    for (std::int64_t g = offset_[w]; g < offset_[w + 1]; ++g) {
      if (role_[g] == Role::kCompute) busy += end_[g] - start_[g];
    }
    return busy;
  }

  // Exposed communication of one worker: how long its compute waited for transfers and
  // collectives beyond when their data would have been there for free (accumulated during the
  // replay), plus, without overlap, the communication that occupied the compute lane itself.
  double exposed_communication(int w) const {
    double exposed = exposed_[w];
    if (options_.overlap_communication) return exposed;
    for (std::int64_t g = offset_[w]; g < offset_[w + 1]; ++g) {
      if (role_[g] == Role::kRecv) {
        exposed += end_[g] - std::max(start_[g], start_[partner_[g]]);
      } else if (role_[g] != Role::kCompute) {
        exposed += end_[g] - start_[g];
      }
    }
    return exposed;
  }

  // The factor sums of every Linear the worker accumulates (kfac::FactorState::sum, the
  // executor's life cycle; docs/simulator.md): a factor's from the start of the first curvature
  // of its refresh (CurvatureA for A, CurvatureB for B; any piece) to the end of the Linear's
  // first inversion (either factor's, the piece starting at unit 0: it finalizes both factors,
  // as the pi-adjusted damping needs both). A replica without the factors (sharded state,
  // SimOptions::kfac_holds_factors) drops them at the end of the curvature sync's last piece
  // instead. An offloaded Linear's finalized sums leave the device with its next write-back (the
  // CUDA layer keeps their buffer until then). A pipelined refresh's sums that no inversion of
  // their own window finalizes are the next window's set-aside sums: the simulated window, one of
  // a repeated series, holds them from its start to its first wrapped inversion of that Linear
  // (or its wrapped sync's end without the factors), while its own sums accumulate.
  template <typename AddEvent>
  void add_factor_sum_events(int w, AddEvent add_event) const {
    const std::size_t slots = offloaded_.size();
    std::vector<double> open(2 * slots, 0.0);        // accumulating (slot, factor), their bytes
    std::vector<double> finalized(2 * slots, 0.0);   // offloaded, waiting for the write-back
    std::vector<double> set_aside_end(slots, -1.0);  // when the set-aside sums leave
    std::vector<std::uint8_t> set_aside_finalized(slots, 0);  // offloaded: write-back to come
    for (std::int64_t g = offset_[w]; g < offset_[w + 1]; ++g) {
      const Instruction& in = *instr_[g];
      if (in.layer < 0 || !is_kfac_kind(in.kind)) continue;
      const std::size_t slot = static_cast<std::size_t>(in.layer) * sched::kNumLinearKinds +
                               static_cast<std::size_t>(in.linear);
      const bool holds =
          !options_.kfac_holds_factors || options_.kfac_holds_factors(w, in.layer, in.linear);
      const auto release_open = [&](double time, bool to_write_back) {
        for (std::size_t i = 2 * slot; i < 2 * slot + 2; ++i) {
          if (open[i] <= 0.0) continue;
          if (to_write_back) {
            finalized[i] += open[i];
          } else {
            add_event(time, -open[i]);
          }
          open[i] = 0.0;
        }
      };
      switch (in.kind) {
        case OpKind::kCurvatureA:
        case OpKind::kCurvatureB: {
          const bool a_factor = in.kind == OpKind::kCurvatureA;
          double& bytes = open[2 * slot + (a_factor ? 0 : 1)];
          if (bytes > 0.0) break;
          bytes = factor_sum_bytes(schedule_, costs_, options_, in.layer, in.linear, a_factor);
          check_duration(bytes, in, w, position_of(g), "K-FAC factor sum bytes");
          if (bytes > 0.0) add_event(start_[g], bytes);
          break;
        }
        case OpKind::kCurvatureSync:
          if (holds || in.piece_end != sched::kPieceUnits) break;
          if (!sched::is_wrapped(in)) {
            release_open(end_[g], false);
          } else if (set_aside_end[slot] < 0.0) {
            set_aside_end[slot] = end_[g];
          }
          break;
        case OpKind::kInvertA:
        case OpKind::kInvertB:
          if (!holds || in.piece_begin != 0) break;
          if (!sched::is_wrapped(in)) {
            release_open(end_[g], offloaded_[slot] != 0);
          } else if (set_aside_end[slot] < 0.0 && !set_aside_finalized[slot]) {
            if (offloaded_[slot] != 0) {
              set_aside_finalized[slot] = 1;
            } else {
              set_aside_end[slot] = end_[g];
            }
          }
          break;
        case OpKind::kWriteBackState:
          for (std::size_t i = 2 * slot; i < 2 * slot + 2; ++i) {
            if (finalized[i] > 0.0) add_event(end_[g], -finalized[i]);
            finalized[i] = 0.0;
          }
          if (set_aside_finalized[slot] && set_aside_end[slot] < 0.0) {
            set_aside_end[slot] = end_[g];
          }
          break;
        default:
          break;
      }
    }
    if (!schedule_.kfac_pipelined_refresh) return;
    for (std::size_t slot = 0; slot < slots; ++slot) {
      if (set_aside_end[slot] < 0.0) continue;
      for (std::size_t i = 2 * slot; i < 2 * slot + 2; ++i) {
        if (open[i] <= 0.0) continue;
        add_event(0.0, open[i]);
        add_event(set_aside_end[slot], -open[i]);
      }
    }
  }

  void track_memory(int w, double makespan, WorkerReport& report) {
    const auto& placement = schedule_.placement;
    double static_bytes = 0.0;
    for (const auto& chunk : placement.chunks) {
      if (chunk.worker == w)
        static_bytes += costs_.static_bytes(schedule_, chunk.pipeline, chunk.chunk);
    }
    // (time, delta in bytes, delta in stashed micro-batches); frees sort before allocations at
    // the same instant, as a real allocator reuses the memory a finished backward released.
    struct Event {
      double time;
      double bytes;
      int stashed;
      bool operator<(const Event& o) const {
        return time < o.time || (time == o.time && bytes < o.bytes);
      }
    };
    std::vector<Event> events;
    kfac_seen_.assign(keys_.layers * sched::kNumLinearKinds, 0);
    // Offloaded Linears (those with offload transfers in this stream) hold their K-FAC state on
    // the device only between a prefetch and its release (docs/offload.md): from a factor
    // prefetch's start to its write-back's end, what that write-back moves (the factors and the
    // new inverses, its bytes); from an inverse prefetch's start to the end of its
    // preconditioning's last piece, its bytes.
    // A Linear offloaded factors only (sched::is_factors_only; offloaded_ 2) keeps its inverses
    // on the device: where the worker inverts it, they count from its first K-FAC instruction's
    // start on, as a kept Linear's state does (in the steady state the previous refresh's
    // inverses are there when the window starts: its first preconditionings read them), at the
    // factors' bytes (the same size: its factor prefetch's, or where that is 0, a replica
    // holding the inverses alone, its K-FAC state); its factors only inside their windows.
    offloaded_.assign(keys_.layers * sched::kNumLinearKinds, 0);
    std::vector<double> factor_bytes(offloaded_.size(), 0.0);
    std::vector<std::uint8_t> inverts(offloaded_.size(), 0);
    for (std::int64_t g = offset_[w]; g < offset_[w + 1]; ++g) {
      const Instruction& in = *instr_[g];
      if ((in.kind == OpKind::kInvertA || in.kind == OpKind::kInvertB) && in.layer >= 0) {
        inverts[static_cast<std::size_t>(in.layer) * sched::kNumLinearKinds +
                static_cast<std::size_t>(in.linear)] = 1;
      }
      if (sched::is_kfac_transfer(in.kind) && in.layer >= 0) {
        const std::int64_t slot =
            std::int64_t{in.layer} * sched::kNumLinearKinds + static_cast<int>(in.linear);
        offloaded_[slot] =
            std::max<std::uint8_t>(offloaded_[slot], sched::is_factors_only(in) ? 2 : 1);
        if (in.kind == OpKind::kPrefetchFactors) {
          factor_bytes[slot] = std::max(factor_bytes[slot], static_cast<double>(in.bytes));
        }
      }
    }
    // Per factor prefetch: the bytes of the write-back that ends its residency (the next one of
    // its Linear in the stream); per offloaded Linear, a prefetched preconditioning's inverses.
    std::vector<double> window_bytes(static_cast<std::size_t>(offset_[w + 1] - offset_[w]), 0.0);
    {
      std::vector<double> next_write_back(offloaded_.size(), 0.0);
      for (std::int64_t g = offset_[w + 1] - 1; g >= offset_[w]; --g) {
        const Instruction& in = *instr_[g];
        if (!sched::is_kfac_transfer(in.kind) || in.layer < 0) continue;
        const std::int64_t slot =
            std::int64_t{in.layer} * sched::kNumLinearKinds + static_cast<int>(in.linear);
        if (in.kind == OpKind::kWriteBackState)
          next_write_back[slot] = static_cast<double>(in.bytes);
        if (in.kind == OpKind::kPrefetchFactors) {
          window_bytes[g - offset_[w]] =
              std::max(next_write_back[slot], static_cast<double>(in.bytes));
        }
      }
    }
    std::vector<double> fetched_inverses(offloaded_.size(), 0.0);
    for (std::int64_t g = offset_[w]; g < offset_[w + 1]; ++g) {
      const Instruction& in = *instr_[g];
      const std::int64_t linear_slot =
          in.layer >= 0
              ? std::int64_t{in.layer} * sched::kNumLinearKinds + static_cast<int>(in.linear)
              : -1;
      if (linear_slot >= 0 && is_kfac_kind(in.kind) && offloaded_[linear_slot]) {
        if (offloaded_[linear_slot] == 2 && inverts[linear_slot] && !kfac_seen_[linear_slot]) {
          kfac_seen_[linear_slot] = 1;  // the inverses, from now on
          double bytes = factor_bytes[linear_slot];
          if (bytes <= 0.0) {
            bytes = options_.kfac_state_bytes ? options_.kfac_state_bytes(w, in.layer, in.linear)
                                              : costs_.kfac_bytes(schedule_, in.layer, in.linear);
          }
          check_duration(bytes, in, w, position_of(g), "K-FAC bytes");
          events.push_back(Event{start_[g], bytes, 0});
        }
        switch (in.kind) {
          case OpKind::kPrefetchFactors:
            events.push_back(Event{start_[g], window_bytes[g - offset_[w]], 0});
            break;
          case OpKind::kWriteBackState:
            events.push_back(Event{end_[g], -static_cast<double>(in.bytes), 0});
            break;
          case OpKind::kPrefetchInverses:
            events.push_back(Event{start_[g], static_cast<double>(in.bytes), 0});
            fetched_inverses[linear_slot] += static_cast<double>(in.bytes);
            break;
          case OpKind::kPrecondition:
            if (in.piece_end == sched::kPieceUnits && fetched_inverses[linear_slot] > 0.0) {
              events.push_back(Event{end_[g], -fetched_inverses[linear_slot], 0});
              fetched_inverses[linear_slot] = 0.0;
            }
            break;
          default:
            break;
        }
        continue;
      }
      if (in.kind == OpKind::kForward) {
        const double bytes = costs_.activation_bytes(schedule_, in.pipeline, in.chunk);
        check_duration(bytes, in, w, position_of(g), "activation bytes");
        // Activations live until the weight gradient is done (backward, or backward-weight).
        const std::int64_t key =
            keys_.microbatch_key(in.step, in.pipeline, in.chunk, in.microbatch);
        std::int64_t release =
            weight_grad_at_[key] >= 0 ? weight_grad_at_[key] : input_grad_at_[key];
        events.push_back(Event{start_[g], bytes, 1});
        if (release >= 0) events.push_back(Event{end_[release], -bytes, -1});
      } else if (is_kfac_kind(in.kind) && in.layer >= 0) {
        const std::int64_t slot =
            std::int64_t{in.layer} * sched::kNumLinearKinds + static_cast<int>(in.linear);
        if (!kfac_seen_[slot]) {
          kfac_seen_[slot] = 1;
          const double bytes = options_.kfac_state_bytes
                                   ? options_.kfac_state_bytes(w, in.layer, in.linear)
                                   : costs_.kfac_bytes(schedule_, in.layer, in.linear);
          check_duration(bytes, in, w, position_of(g), "K-FAC bytes");
          events.push_back(Event{start_[g], bytes, 0});
        }
      }
    }
    if (options_.count_factor_sums) {
      add_factor_sum_events(w, [&events](double time, double bytes) {
        events.push_back(Event{time, bytes, 0});
      });
    }
    if (!std::is_sorted(events.begin(), events.end())) {
      std::stable_sort(events.begin(), events.end());
    }
    report.static_memory_bytes = static_bytes;
    report.memory.clear();
    report.memory.reserve(events.size() + 2);
    report.memory.push_back(MemorySample{0.0, static_bytes});
    double current = static_bytes, peak = static_bytes, activations = 0.0, peak_activations = 0.0;
    int stashed = 0, peak_stashed = 0;
    for (const Event& e : events) {
      current += e.bytes;
      stashed += e.stashed;
      if (e.stashed != 0) activations += e.bytes;
      peak = std::max(peak, current);
      peak_activations = std::max(peak_activations, activations);
      peak_stashed = std::max(peak_stashed, stashed);
      if (!report.memory.empty() && report.memory.back().time_s == e.time) {
        report.memory.back().bytes = current;
      } else {
        report.memory.push_back(MemorySample{e.time, current});
      }
    }
    if (report.memory.back().time_s < makespan) report.memory.push_back({makespan, current});
    report.peak_memory_bytes = peak;
    report.peak_activation_bytes = peak_activations;
    report.peak_stashed_microbatches = peak_stashed;
  }

  const Schedule& schedule_;
  const CostModel& costs_;
  SimOptions options_;

  std::int64_t n_ = 0;
  std::vector<std::int64_t> offset_;
  std::vector<const Instruction*> instr_;
  std::vector<std::int32_t> worker_of_;
  Keys keys_;

  std::vector<std::int32_t> forward_at_, input_grad_at_, weight_grad_at_;
  std::vector<std::int32_t> last_weight_grad_of_chunk_;
  std::vector<std::int32_t> recv_activation_at_, recv_gradient_at_;
  std::vector<std::int32_t> partner_, producer_chunk_;

  std::vector<std::int64_t> dep_begin_;
  std::vector<Dep> deps_;
  std::vector<double> duration_;
  std::vector<std::uint8_t> lanes_;
  std::vector<Role> role_;
  std::vector<std::int32_t> group_of_, group_members_;

  std::vector<double> start_, end_;
  std::vector<std::uint8_t> state_;
  std::vector<int> wait_head_, wait_next_;
  std::vector<std::int64_t> pc_;
  std::vector<std::uint8_t> arrived_;
  std::vector<double> last_issue_;
  std::vector<double> exposed_;  // per worker: compute-lane waits caused by communication
  std::vector<std::int64_t> lane_last_;
  std::vector<double> group_ready_;
  std::vector<int> group_arrivals_;
  std::priority_queue<std::pair<double, int>, std::vector<std::pair<double, int>>, std::greater<>>
      queue_;

  std::vector<std::uint8_t> kfac_seen_;
  std::vector<std::uint8_t> offloaded_;

  std::vector<int> processor_of_;           // per worker; empty: a processor per worker
  std::vector<ProcessorShare> processors_;  // empty: a processor per worker
  std::vector<double> processor_event_;     // each processor's pending event time
  std::vector<std::int64_t> done_;
  double now_ = 0.0;  // time of the queue entry in hand
};

// Per-processor capacities, when given, cover every processor in use and are finite and > 0.
std::vector<int> check_capacities(const SharedProcessors& shared, std::vector<int> processor_of) {
  if (shared.processor_capacity.empty()) return processor_of;
  for (const int p : processor_of) {
    if (static_cast<std::size_t>(p) >= shared.processor_capacity.size()) {
      throw std::invalid_argument(
          "shared processors: " + std::to_string(shared.processor_capacity.size()) +
          " per-processor capacities, processor " + std::to_string(p) + " is in use");
    }
  }
  for (std::size_t p = 0; p < shared.processor_capacity.size(); ++p) {
    const double c = shared.processor_capacity[p];
    if (!std::isfinite(c) || c <= 0.0) {
      throw std::invalid_argument("shared processors: processor " + std::to_string(p) +
                                  " capacity " + std::to_string(c) + " (must be finite and > 0)");
    }
  }
  return processor_of;
}

}  // namespace

std::vector<int> resolve_processors(const SharedProcessors& shared, int workers) {
  std::vector<int> processor_of;
  if (!shared.enabled()) return processor_of;
  if (!std::isfinite(shared.capacity) || shared.capacity <= 0.0) {
    throw std::invalid_argument("shared processors: capacity " + std::to_string(shared.capacity) +
                                " (must be finite and > 0)");
  }
  if (shared.workers_per_processor > 0) {
    for (int w = 0; w < workers; ++w) processor_of.push_back(w / shared.workers_per_processor);
    return check_capacities(shared, processor_of);
  }
  if (shared.workers_per_processor < 0) {
    throw std::invalid_argument(
        "shared processors: " + std::to_string(shared.workers_per_processor) +
        " workers per processor (must be >= 0)");
  }
  if (static_cast<int>(shared.processor_of_worker.size()) != workers) {
    throw std::invalid_argument(
        "shared processors: " + std::to_string(shared.processor_of_worker.size()) +
        " workers mapped, the schedule has " + std::to_string(workers));
  }
  for (int w = 0; w < workers; ++w) {
    const int p = shared.processor_of_worker[static_cast<std::size_t>(w)];
    if (p < 0 || p >= workers) {
      throw std::invalid_argument("shared processors: worker " + std::to_string(w) +
                                  " on processor " + std::to_string(p) + " (allowed: 0.." +
                                  std::to_string(workers - 1) + ")");
    }
    processor_of.push_back(p);
  }
  return check_capacities(shared, processor_of);
}

double capacity_of_processor(const SharedProcessors& shared, int processor) {
  return processor >= 0 && static_cast<std::size_t>(processor) < shared.processor_capacity.size()
             ? shared.processor_capacity[static_cast<std::size_t>(processor)]
             : shared.capacity;
}

double factor_sum_bytes(const sched::Schedule& schedule, const CostModel& costs,
                        const SimOptions& options, int layer, sched::LinearKind linear,
                        bool a_factor) {
  return options.kfac_sum_bytes ? options.kfac_sum_bytes(layer, linear, a_factor)
                                : costs.kfac_sum_bytes(schedule, layer, linear, a_factor);
}

SimResult simulate(const sched::Schedule& schedule, const CostModel& costs,
                   const SimOptions& options) {
  Engine engine(schedule, costs, options);
  return engine.run();
}

}  // namespace pf::sim
