#include "scheduler/generators.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "scheduler/placement.h"

namespace pf::sched {
namespace {

std::string str(int value) {
  return std::to_string(value);
}

[[noreturn]] void refuse(const ScheduleParams& params, const std::string& rule) {
  throw std::invalid_argument(std::string(to_string(params.kind)) + ": " + rule);
}

// Appends compute instructions to one worker's stream.
class StreamWriter {
 public:
  StreamWriter(std::vector<Instruction>& stream, bool split_backward)
      : stream_(stream), split_backward_(split_backward) {}

  void forward(int pipeline, int chunk, int microbatch) {
    stream_.push_back(make(OpKind::kForward, pipeline, chunk, microbatch));
  }
  void backward_input(int chunk, int microbatch) {
    stream_.push_back(make(OpKind::kBackwardInput, 0, chunk, microbatch));
  }
  void backward_weight(int chunk, int microbatch) {
    stream_.push_back(make(OpKind::kBackwardWeight, 0, chunk, microbatch));
  }
  // A full backward, or backward-input immediately followed by backward-weight.
  void backward(int pipeline, int chunk, int microbatch) {
    if (split_backward_) {
      stream_.push_back(make(OpKind::kBackwardInput, pipeline, chunk, microbatch));
      stream_.push_back(make(OpKind::kBackwardWeight, pipeline, chunk, microbatch));
    } else {
      stream_.push_back(make(OpKind::kBackward, pipeline, chunk, microbatch));
    }
  }

 private:
  static Instruction make(OpKind kind, int pipeline, int chunk, int microbatch) {
    Instruction in;
    in.kind = kind;
    in.pipeline = static_cast<std::int8_t>(pipeline);
    in.chunk = chunk;
    in.microbatch = microbatch;
    return in;
  }
  std::vector<Instruction>& stream_;
  bool split_backward_;
};

void generate_gpipe(const ScheduleParams& params, Schedule& schedule) {
  for (int worker = 0; worker < params.workers; ++worker) {
    StreamWriter out(schedule.streams[static_cast<std::size_t>(worker)], params.split_backward);
    for (int mb = 0; mb < params.microbatches; ++mb) out.forward(0, worker, mb);
    for (int mb = 0; mb < params.microbatches; ++mb) out.backward(0, worker, mb);
  }
}

// Worker r: p - r - 1 warm-up forwards, then one forward / one backward, then the drain.
void generate_one_f_one_b(const ScheduleParams& params, Schedule& schedule) {
  const int p = params.workers;
  const int m = params.microbatches;
  for (int worker = 0; worker < p; ++worker) {
    StreamWriter out(schedule.streams[static_cast<std::size_t>(worker)], params.split_backward);
    const int warmup = std::min(p - worker - 1, m);
    for (int mb = 0; mb < warmup; ++mb) out.forward(0, worker, mb);
    for (int i = 0; i < m - warmup; ++i) {
      out.forward(0, worker, warmup + i);
      out.backward(0, worker, i);
    }
    for (int mb = m - warmup; mb < m; ++mb) out.backward(0, worker, mb);
  }
}

// Megatron's interleaved order. The k-th forward of worker r works on local chunk
// (k mod pv) / p (global chunk local * p + r) and micro-batch (k / pv) * p + k mod p; backwards
// visit the local chunks in reverse. Warm-up: 2(p - r - 1) + (v - 1)p forwards (all of them when
// m == p), capped at m v.
void generate_interleaved(const ScheduleParams& params, Schedule& schedule) {
  const int p = params.workers;
  const int v = params.chunks_per_worker;
  const int m = params.microbatches;
  const int total = m * v;
  const int group = p * v;
  for (int worker = 0; worker < p; ++worker) {
    StreamWriter out(schedule.streams[static_cast<std::size_t>(worker)], params.split_backward);
    auto microbatch_of = [&](int k) { return (k / group) * p + k % p; };
    auto forward_k = [&](int k) {
      const int local = (k % group) / p;
      out.forward(0, local * p + worker, microbatch_of(k));
    };
    auto backward_k = [&](int k) {
      const int local = v - 1 - (k % group) / p;
      out.backward(0, local * p + worker, microbatch_of(k));
    };
    int warmup = m == p ? total : std::min(2 * (p - worker - 1) + (v - 1) * p, total);
    for (int k = 0; k < warmup; ++k) forward_k(k);
    for (int k = 0; k < total - warmup; ++k) {
      forward_k(warmup + k);
      backward_k(k);
    }
    for (int k = total - warmup; k < total; ++k) backward_k(k);
  }
}

// Chimera (PipeFisher's order). Worker s < D/2 holds down stage s (pipeline 0) and up stage
// D-1-s (pipeline 1). Per unit of D micro-batches (D/2 per pipeline) it runs: a = D/2 - s down
// forwards; b = s pairs (up F, down F); a pairs (up F, up B); b pairs (down B, up B); a down B.
// Workers in the second half mirror this with up and down swapped.
void generate_chimera(const ScheduleParams& params, Schedule& schedule) {
  const int d = params.workers;
  const int half = d / 2;
  const int units = params.microbatches / d;
  for (int worker = 0; worker < d; ++worker) {
    StreamWriter out(schedule.streams[static_cast<std::size_t>(worker)], params.split_backward);
    const bool first_half = worker < half;
    const int mirror = first_half ? worker : d - 1 - worker;
    const int a = half - mirror;
    const int b = mirror;
    // "first" is the pipeline this worker injects first: down in the first half, up otherwise.
    const int first = first_half ? 0 : 1;
    const int second = 1 - first;
    auto chunk_of = [&](int pipeline) { return pipeline == 0 ? worker : d - 1 - worker; };
    for (int unit = 0; unit < units; ++unit) {
      const int base = unit * half;
      int next_f[2] = {base, base};
      int next_b[2] = {base, base};
      auto f = [&](int pl) { out.forward(pl, chunk_of(pl), next_f[pl]++); };
      auto bw = [&](int pl) { out.backward(pl, chunk_of(pl), next_b[pl]++); };
      for (int i = 0; i < a; ++i) f(first);
      for (int i = 0; i < b; ++i) {
        f(second);
        f(first);
      }
      for (int i = 0; i < a; ++i) {
        f(second);
        bw(second);
      }
      for (int i = 0; i < b; ++i) {
        bw(first);
        bw(second);
      }
      for (int i = 0; i < a; ++i) bw(first);
    }
  }
}

// Zero-bubble H family (Qi et al., "Zero Bubble Pipeline Parallelism", handcrafted ZB-H1 and
// ZB-H2) with at most L = max_in_flight micro-batches held per worker (forward done, weight
// gradient not yet). Worker i runs w_i = min(L - 1 - i, 2(p - 1 - i)) warm-up forwards, then
// (forward, backward-input) pairs and the drain of backward-inputs; a backward-weight follows a
// backward-input only while more than d_i = L - 1 - w_i of them are pending (at most
// m - 1 - w_i), and the rest run at the end. L = p (ZB-H1): w_i = p-1-i, d_i = i, the 1F1B warm-up
// with each worker's W passes deferred by its distance from the first; the bubble shrinks to
// (p-1)(F + B - W). L = 2p-1 (ZB-H2): w_i = 2(p-1-i), d_i = 2i, no idle time between a worker's
// first and last instruction (with F = B = W), so consecutive steps tile into a parallelogram.
void generate_zero_bubble_h(const ScheduleParams& params, int max_in_flight, Schedule& schedule) {
  const int p = params.workers;
  const int m = params.microbatches;
  for (int worker = 0; worker < p; ++worker) {
    StreamWriter out(schedule.streams[static_cast<std::size_t>(worker)], true);
    const int full_warmup = std::min(max_in_flight - 1 - worker, 2 * (p - 1 - worker));
    const int warmup = std::min(full_warmup, m);
    // With few micro-batches (m < 2p-1) deferring more W passes than the steady phase has
    // backward-inputs only delays the drain.
    const int deferred = std::max(0, std::min(max_in_flight - 1 - full_warmup, m - 1 - warmup));
    int forwards = 0;
    int inputs = 0;
    int weights = 0;
    auto input_then_maybe_weight = [&] {
      out.backward_input(worker, inputs++);
      if (inputs - weights > deferred) out.backward_weight(worker, weights++);
    };
    while (forwards < warmup) out.forward(0, worker, forwards++);
    while (forwards < m) {
      out.forward(0, worker, forwards++);
      input_then_maybe_weight();
    }
    while (inputs < m) input_then_maybe_weight();
    while (weights < m) out.backward_weight(worker, weights++);
  }
}

// ZB-V (Qi et al., section 6; the order of torch's ScheduleZBVZeroBubble): worker r holds chunk
// a = r (descending leg) and b = 2p-1-r (ascending leg). Micro-batches are counted up to
// n = max(m, 2p-1) and those >= m are left out (idle slots), so every m works.
//  1. 2(p-r)-1 forwards of a;  2. r x (F b, F a);  3. p-r x (F b, I b, W b);
//  4. while b's forwards lag a's or a has forwards left: [F a], I a, W a, F b, I b, W b;
//  5. r x (I a, I b) with their W deferred;  6. p-r x (I a, the oldest pending W of a);
//  7. the pending W of b, then those of a.
void generate_zero_bubble_v(const ScheduleParams& params, Schedule& schedule) {
  const int p = params.workers;
  const int m = params.microbatches;
  const int n = std::max(m, 2 * p - 1);
  for (int worker = 0; worker < p; ++worker) {
    StreamWriter out(schedule.streams[static_cast<std::size_t>(worker)], true);
    struct Counters {
      int chunk;
      int forwards = 0;
      int inputs = 0;
      int weights = 0;
    };
    Counters a{worker};
    Counters b{2 * p - 1 - worker};
    auto f = [&](Counters& c) {
      if (c.forwards < m) out.forward(0, c.chunk, c.forwards);
      ++c.forwards;
    };
    auto i = [&](Counters& c) {
      if (c.inputs < m) out.backward_input(c.chunk, c.inputs);
      ++c.inputs;
    };
    auto w = [&](Counters& c) {
      if (c.weights < m) out.backward_weight(c.chunk, c.weights);
      ++c.weights;
    };
    for (int k = 0; k < 2 * (p - worker) - 1; ++k) f(a);
    for (int k = 0; k < worker; ++k) {
      f(b);
      f(a);
    }
    for (int k = 0; k < p - worker; ++k) {
      f(b);
      i(b);
      w(b);
    }
    while (b.forwards < a.forwards || a.forwards < n) {
      if (a.forwards < n) f(a);
      i(a);
      w(a);
      f(b);
      i(b);
      w(b);
    }
    for (int k = 0; k < worker; ++k) {
      i(a);
      i(b);
    }
    for (int k = 0; k < p - worker; ++k) {
      i(a);
      w(a);
    }
    while (b.weights < b.inputs) w(b);
    while (a.weights < a.inputs) w(a);
  }
}

}  // namespace

int zero_bubble_max_in_flight(const ScheduleParams& params) {
  if (params.max_in_flight > 0) return params.max_in_flight;
  return params.kind == ScheduleKind::kZeroBubbleH2 ? 2 * params.workers - 1 : params.workers;
}

void check_params(const ScheduleParams& params) {
  const int p = params.workers;
  const int m = params.microbatches;
  const int v = params.chunks_per_worker;
  if (p <= 0) refuse(params, "stages must be at least 1, got " + str(p));
  if (m <= 0) refuse(params, "micro-batches must be at least 1, got " + str(m));
  if (v <= 0) refuse(params, "chunks per worker must be at least 1, got " + str(v));
  if (params.data_parallel <= 0) {
    refuse(params, "data-parallel replicas must be at least 1, got " + str(params.data_parallel));
  }
  if (params.num_layers < 0) {
    refuse(params, "layers must be >= 0 (0 = one per chunk), got " + str(params.num_layers));
  }
  const std::int64_t chunks = std::int64_t{p} * v;
  if (chunks > kMaxChunks) {
    refuse(params, "too many chunks: " + std::to_string(chunks) +
                       " (stages x chunks per worker; "
                       "at most " +
                       std::to_string(kMaxChunks) + ")");
  }
  if (chunks * m > kMaxComputeUnits) {
    refuse(params, "too large: " + std::to_string(chunks * m) +
                       " forward units (chunks x micro-batches); at most " +
                       std::to_string(kMaxComputeUnits));
  }
  if (params.num_layers > kMaxLayers) {
    refuse(params, "at most " + str(kMaxLayers) + " layers, got " + str(params.num_layers));
  }
  if (params.num_layers > 0 && params.num_layers < p * v) {
    refuse(params, "more chunks than layers: " + str(p) + " stages x " + str(v) +
                       " chunks = " + str(p * v) + " chunks need at least " + str(p * v) +
                       " layers, got " + str(params.num_layers));
  }
  switch (params.kind) {
    case ScheduleKind::kGPipe:
      if (v != 1) refuse(params, "one chunk per worker only (got " + str(v) + "); use interleaved");
      break;
    case ScheduleKind::kOneFOneB:
      if (v != 1) refuse(params, "one chunk per worker only (got " + str(v) + "); use interleaved");
      if (m < p) {
        refuse(params, "needs micro-batches >= stages to reach the steady state (m=" + str(m) +
                           ", p=" + str(p) + "): use m >= " + str(p) + ", or gpipe");
      }
      break;
    case ScheduleKind::kInterleaved:
      if (m % p != 0) {
        refuse(params, "needs micro-batches to be a multiple of stages (m=" + str(m) +
                           ", p=" + str(p) + "): use m = " + str(p) + ", " + str(2 * p) + ", " +
                           str(3 * p) + ", ...");
      }
      break;
    case ScheduleKind::kChimera:
      if (p % 2 != 0) {
        refuse(params, "needs an even number of stages D for its two pipelines, got D=" + str(p) +
                           ": use D = " + str(p == 1 ? 2 : p - 1) + " or " + str(p + 1));
      }
      if (v != 1) refuse(params, "one chunk per worker and pipeline only, got " + str(v));
      if (m % p != 0) {
        refuse(params, "needs micro-batches in units of D (m=" + str(m) + ", D=" + str(p) +
                           "): use m = " + str(p) + ", " + str(2 * p) + ", " + str(3 * p) +
                           ", ...");
      }
      break;
    case ScheduleKind::kZeroBubbleH1:
    case ScheduleKind::kZeroBubbleH2: {
      if (v != 1) refuse(params, "one chunk per worker only (got " + str(v) + "); use zbv");
      const int limit = zero_bubble_max_in_flight(params);
      if (limit < p || limit > 2 * p - 1) {
        refuse(params, "max in-flight micro-batches must be in [p, 2p-1] = [" + str(p) + ", " +
                           str(2 * p - 1) + "] (p: ZB-H1's 1F1B memory, 2p-1: ZB-H2), got " +
                           str(limit));
      }
      break;
    }
    case ScheduleKind::kZeroBubbleV:
      if (v != 2) {
        refuse(params,
               "holds exactly two chunks per worker (the V: chunk i and 2p-1-i on "
               "worker i), got " +
                   str(v) + ": use chunks per worker 2");
      }
      break;
    case ScheduleKind::kCustom:
      refuse(params,
             "custom schedules are not generated: load them from a JSON or CSV file "
             "(allowed generators: gpipe, 1f1b, interleaved, chimera, zbh1, zbh2, zbv)");
  }
  if (params.max_in_flight != 0 && params.kind != ScheduleKind::kZeroBubbleH1 &&
      params.kind != ScheduleKind::kZeroBubbleH2) {
    refuse(params, "max in-flight micro-batches applies to zbh1 / zbh2 only, got " +
                       str(params.max_in_flight));
  }
  if (params.max_in_flight < 0) {
    refuse(params, "max in-flight micro-batches must be >= 0 (0: the kind's own), got " +
                       str(params.max_in_flight));
  }
  if (params.v_shape && params.kind != ScheduleKind::kZeroBubbleV) {
    refuse(params, "a V-shaped placement is generated by zbv only");
  }
}

Schedule generate(const ScheduleParams& params) {
  check_params(params);
  Schedule schedule;
  schedule.params = params;
  // Zero-bubble schedules are defined on split backwards: record that they have them.
  const bool zero_bubble = params.kind == ScheduleKind::kZeroBubbleH1 ||
                           params.kind == ScheduleKind::kZeroBubbleH2 ||
                           params.kind == ScheduleKind::kZeroBubbleV;
  if (zero_bubble) schedule.params.split_backward = true;
  schedule.placement = make_placement(params);
  schedule.num_steps = 1;
  schedule.streams.resize(static_cast<std::size_t>(params.workers));
  const std::size_t per_worker = static_cast<std::size_t>(params.microbatches) *
                                 static_cast<std::size_t>(params.chunks_per_worker) *
                                 (schedule.params.split_backward ? 3u : 2u);
  for (auto& stream : schedule.streams) stream.reserve(per_worker);
  switch (params.kind) {
    case ScheduleKind::kGPipe:
      generate_gpipe(params, schedule);
      break;
    case ScheduleKind::kOneFOneB:
      generate_one_f_one_b(params, schedule);
      break;
    case ScheduleKind::kInterleaved:
      generate_interleaved(params, schedule);
      break;
    case ScheduleKind::kChimera:
      generate_chimera(params, schedule);
      break;
    case ScheduleKind::kZeroBubbleH1:
    case ScheduleKind::kZeroBubbleH2:
      generate_zero_bubble_h(params, zero_bubble_max_in_flight(params), schedule);
      break;
    case ScheduleKind::kZeroBubbleV:
      generate_zero_bubble_v(params, schedule);
      break;
    case ScheduleKind::kCustom:
      break;  // refused by check_params
  }
  return schedule;
}

Schedule repeat_steps(const Schedule& one_step, int num_steps) {
  if (num_steps < 1 || num_steps > 32767) {
    throw std::invalid_argument("repeat_steps: num_steps must be in [1, 32767], got " +
                                str(num_steps));
  }
  if (one_step.num_steps != 1) {
    throw std::invalid_argument("repeat_steps: the input already has " + str(one_step.num_steps) +
                                " steps; it needs exactly one");
  }
  Schedule result;
  result.params = one_step.params;
  result.placement = one_step.placement;
  result.num_steps = num_steps;
  result.streams.resize(one_step.streams.size());
  for (std::size_t w = 0; w < one_step.streams.size(); ++w) {
    const auto& stream = one_step.streams[w];
    for (const Instruction& in : stream) {
      if (!is_compute(in.kind) && !is_kfac(in.kind)) {
        throw std::invalid_argument("repeat_steps: worker " + str(static_cast<int>(w)) + " holds " +
                                    std::string(to_string(in.kind)) +
                                    "; repeat the compute-only schedule, then lower() it");
      }
    }
    auto& out = result.streams[w];
    out.reserve(stream.size() * static_cast<std::size_t>(num_steps));
    for (int step = 0; step < num_steps; ++step) {
      for (Instruction in : stream) {
        in.step = static_cast<std::int16_t>(step);
        out.push_back(in);
      }
    }
  }
  return result;
}

}  // namespace pf::sched
