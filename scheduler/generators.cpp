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

}  // namespace

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
    case ScheduleKind::kCustom:
      refuse(params,
             "custom schedules are not generated: load them from a JSON or CSV file "
             "(allowed generators: gpipe, 1f1b, interleaved, chimera)");
  }
}

Schedule generate(const ScheduleParams& params) {
  check_params(params);
  Schedule schedule;
  schedule.params = params;
  schedule.placement = make_placement(params);
  schedule.num_steps = 1;
  schedule.streams.resize(static_cast<std::size_t>(params.workers));
  const std::size_t per_worker = static_cast<std::size_t>(params.microbatches) *
                                 static_cast<std::size_t>(params.chunks_per_worker) *
                                 (params.split_backward ? 3u : 2u);
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
