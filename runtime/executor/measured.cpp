#include "runtime/executor/measured.h"

#include <algorithm>
#include <limits>
#include <map>
#include <stdexcept>

#include "traces/chrome_trace.h"

namespace pf::exec {

namespace {

double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  const auto middle = values.begin() + static_cast<std::ptrdiff_t>(values.size() / 2);
  std::nth_element(values.begin(), middle, values.end());
  double result = *middle;
  if (values.size() % 2 == 0) {
    result = (result + *std::max_element(values.begin(), middle)) / 2.0;
  }
  return result;
}

// Busy times of one Linear's K-FAC tasks, by kind.
struct KfacTimes {
  std::vector<double> a, b, inv_a, inv_b, precondition, sync;
};

bool is_timed_kfac(sched::OpKind kind) {
  using sched::OpKind;
  return kind == OpKind::kCurvatureA || kind == OpKind::kCurvatureB || kind == OpKind::kInvertA ||
         kind == OpKind::kInvertB || kind == OpKind::kPrecondition ||
         kind == OpKind::kCurvatureSync;
}

void record_kfac(KfacTimes& times, sched::OpKind kind, double busy_s) {
  using sched::OpKind;
  if (kind == OpKind::kCurvatureA) times.a.push_back(busy_s);
  if (kind == OpKind::kCurvatureB) times.b.push_back(busy_s);
  if (kind == OpKind::kInvertA) times.inv_a.push_back(busy_s);
  if (kind == OpKind::kInvertB) times.inv_b.push_back(busy_s);
  if (kind == OpKind::kPrecondition) times.precondition.push_back(busy_s);
  if (kind == OpKind::kCurvatureSync) times.sync.push_back(busy_s);
}

}  // namespace

nlohmann::json measured_trace(const sched::Schedule& schedule,
                              const std::vector<InstructionEvent>& events) {
  // The executed instructions unrolled into one stream per rank (rounds one after another),
  // with pair ids made unique per round and peers turned into ranks.
  const int workers = schedule.num_workers();
  const int replicas = schedule.params.data_parallel;
  std::int64_t pair_span = 1;
  for (const auto& stream : schedule.streams) {
    for (const auto& in : stream) pair_span = std::max(pair_span, in.pair_id + 1);
  }
  sched::Schedule unrolled;
  unrolled.params = schedule.params;
  unrolled.params.workers = workers * replicas;
  unrolled.placement = schedule.placement;
  unrolled.streams.resize(static_cast<std::size_t>(workers * replicas));
  std::vector<std::vector<traces::SpanTiming>> timings(unrolled.streams.size());
  std::vector<const InstructionEvent*> ordered;
  ordered.reserve(events.size());
  for (const auto& event : events) ordered.push_back(&event);
  std::stable_sort(ordered.begin(), ordered.end(), [](const auto* a, const auto* b) {
    return std::pair(a->rank, a->start_s) < std::pair(b->rank, b->start_s);
  });
  for (const auto* event : ordered) {
    if (event->rank < 0 || event->rank >= workers * replicas) continue;
    if (event->bucket >= 0) continue;  // not an instruction: added below
    sched::Instruction in = event->instruction;
    const std::int64_t round = event->global_step / schedule.num_steps;
    if (in.pair_id >= 0) in.pair_id += round * pair_span;
    if (in.peer >= 0) in.peer += (event->rank / workers) * workers;
    in.step = static_cast<std::int16_t>(std::min<std::int64_t>(event->global_step, 32767));
    if (in.bytes == 0) in.bytes = event->bytes;
    unrolled.streams[static_cast<std::size_t>(event->rank)].push_back(in);
    timings[static_cast<std::size_t>(event->rank)].push_back(
        {event->start_s * 1e6, (event->end_s - event->start_s) * 1e6});
  }
  auto trace = traces::make_chrome_trace(unrolled, timings);
  // Data-parallel gradient buckets on their rank's collective lane, beside the backward they
  // overlap (and the DP reduction that waits for them).
  auto& trace_events = trace["traceEvents"];
  for (const auto* event : ordered) {
    if (event->bucket < 0 || event->rank < 0 || event->rank >= workers * replicas) continue;
    const auto& in = event->instruction;
    trace_events.push_back(
        {{"ph", "X"},
         {"name", "DP bucket " + std::to_string(event->bucket) + " c" + std::to_string(in.chunk)},
         {"cat", "dp_bucket"},
         {"pid", event->rank},
         {"tid", static_cast<int>(traces::Lane::kCollective)},
         {"ts", event->start_s * 1e6},
         {"dur", (event->end_s - event->start_s) * 1e6},
         {"cname", traces::colour_of(in.kind)},
         {"args",
          {{"kind", "dp_bucket"},
           {"bucket", event->bucket},
           {"bytes", event->bytes},
           {"chunk", in.chunk},
           {"pipeline", in.pipeline},
           {"step", event->global_step}}}});
  }
  return trace;
}

sim::Profile measured_profile(const sched::Schedule& schedule,
                              const std::vector<InstructionEvent>& events, int warmup_steps,
                              const std::string& description, ProfileStatistic statistic) {
  const auto typical = [statistic](const std::vector<double>& values) {
    if (statistic == ProfileStatistic::kMedian || values.empty()) return median(values);
    double sum = 0.0;
    for (double value : values) sum += value;
    return sum / static_cast<double>(values.size());
  };
  using sched::OpKind;
  struct ChunkTimes {
    std::vector<double> forward, backward, backward_input, backward_weight;
    double stash_bytes = 0.0;      // largest stash a micro-batch's backward released
    double reduction_bytes = 0.0;  // the chunk's gradient all-reduce payload
  };
  double message_bytes = 0.0;
  std::map<std::pair<int, int>, ChunkTimes> chunks;
  std::vector<double> send_rates, reduction_rates, host_rates, optimizer;
  bool saw_host_copy = false;
  std::map<std::pair<int, int>, KfacTimes> kfac;  // (layer, linear)
  // A refresh every k steps may run its curvature and inversions only in a warm-up step (a run
  // no longer than its refresh interval): those samples stand in for a kind the later steps
  // never ran, rather than pricing it as free.
  std::map<std::pair<int, int>, KfacTimes> kfac_warmup;
  // The same for the offload copies (factors-only offload copies only around inversions).
  std::vector<double> host_rates_warmup;
  bool saw_host_copy_warmup = false;
  for (const auto& event : events) {
    if (event.global_step < warmup_steps) {
      const auto& in = event.instruction;
      if (event.bucket < 0 && is_timed_kfac(in.kind)) {
        record_kfac(kfac_warmup[{in.layer, static_cast<int>(in.linear)}], in.kind, event.busy_s);
      }
      if (sched::is_kfac_transfer(in.kind)) {
        saw_host_copy_warmup = true;
        if (event.busy_s > 0 && event.bytes > 0) {
          host_rates_warmup.push_back(static_cast<double>(event.bytes) / event.busy_s);
        }
      }
      continue;
    }
    // Buckets overlap the backward; their reduction's own event holds the time it still costs.
    if (event.bucket >= 0) continue;
    const auto& in = event.instruction;
    auto& times = chunks[{in.pipeline, in.chunk}];
    switch (in.kind) {
      case OpKind::kForward:
        times.forward.push_back(event.busy_s);
        break;
      case OpKind::kBackward:
        times.backward.push_back(event.busy_s);
        times.stash_bytes = std::max(times.stash_bytes, static_cast<double>(event.stash_bytes));
        break;
      case OpKind::kBackwardInput:
        times.backward_input.push_back(event.busy_s);
        break;
      case OpKind::kBackwardWeight:
        times.backward_weight.push_back(event.busy_s);
        times.stash_bytes = std::max(times.stash_bytes, static_cast<double>(event.stash_bytes));
        break;
      case OpKind::kSendActivation:
      case OpKind::kSendGradient:
        if (event.busy_s > 0 && event.bytes > 0) {
          send_rates.push_back(static_cast<double>(event.bytes) / event.busy_s);
        }
        message_bytes = std::max(message_bytes, static_cast<double>(event.bytes));
        break;
      case OpKind::kReduceGradPipelines:
      case OpKind::kReduceGradDataParallel:
        if (event.busy_s > 0 && event.bytes > 0) {
          reduction_rates.push_back(static_cast<double>(event.bytes) / event.busy_s);
        }
        times.reduction_bytes = std::max(times.reduction_bytes, static_cast<double>(event.bytes));
        break;
      case OpKind::kOptimizerStep:
        optimizer.push_back(event.busy_s);
        break;
      case OpKind::kPrefetchFactors:  // K-FAC offload copies: the host link's rate
      case OpKind::kWriteBackState:
      case OpKind::kPrefetchInverses:
        saw_host_copy = true;
        if (event.busy_s > 0 && event.bytes > 0) {
          host_rates.push_back(static_cast<double>(event.bytes) / event.busy_s);
        }
        break;
      case OpKind::kRecvActivation:
      case OpKind::kRecvGradient:
        break;
      default:
        record_kfac(kfac[{in.layer, static_cast<int>(in.linear)}], in.kind, event.busy_s);
        break;
    }
  }
  sim::Profile profile;
  profile.description = description;
  for (const auto& [key, times] : chunks) {
    if (times.forward.empty()) continue;
    sim::ChunkProfile chunk;
    chunk.pipeline = key.first;
    chunk.chunk = key.second;
    chunk.forward_s = typical(times.forward);
    if (!times.backward.empty()) {
      chunk.backward_s = typical(times.backward);
    } else {
      chunk.backward_input_s = typical(times.backward_input);
      chunk.backward_weight_s = typical(times.backward_weight);
      chunk.backward_s = chunk.backward_input_s + chunk.backward_weight_s;
    }
    // What one micro-batch in flight really holds (its stash arena, pooled: the forward's
    // buffers and the gradients backward_input keeps), not the boundary message; the message
    // is the communication link's message_bytes. gradient_bytes is what the simulator prices
    // a reduction without a byte count by: the chunk's measured gradient all-reduce payload.
    chunk.activation_bytes = times.stash_bytes;
    chunk.gradient_bytes = times.reduction_bytes;
    profile.chunks.push_back(chunk);
  }
  profile.communication.message_bytes = message_bytes;
  // Sends are copies into the receiver's mailbox: a rate, no latency.
  profile.communication.bandwidth = send_rates.empty() ? 1e12 : typical(send_rates);
  profile.reduction.bandwidth =
      reduction_rates.empty() ? profile.communication.bandwidth : typical(reduction_rates);
  // Copies too short for the clock: as good as free (as sends without a rate).
  if (!saw_host_copy && saw_host_copy_warmup) {
    saw_host_copy = true;
    host_rates = std::move(host_rates_warmup);
  }
  if (saw_host_copy) profile.host_link.bandwidth = host_rates.empty() ? 1e12 : typical(host_rates);
  profile.optimizer_step_s = typical(optimizer);
  for (const auto& entry : kfac_warmup) kfac.try_emplace(entry.first);
  for (const auto& [key, k] : kfac) {
    const auto warm_it = kfac_warmup.find(key);
    const KfacTimes no_samples;
    const KfacTimes& warm = warm_it == kfac_warmup.end() ? no_samples : warm_it->second;
    const auto pick = [&](const std::vector<double>& later, const std::vector<double>& early) {
      return typical(later.empty() ? early : later);
    };
    sim::KfacProfile entry;
    entry.layer = key.first;
    entry.linear = static_cast<sched::LinearKind>(key.second);
    entry.curvature_a_s = pick(k.a, warm.a);
    entry.curvature_b_s = pick(k.b, warm.b);
    entry.invert_a_s = pick(k.inv_a, warm.inv_a);
    entry.invert_b_s = pick(k.inv_b, warm.inv_b);
    entry.precondition_s = pick(k.precondition, warm.precondition);
    if (!k.sync.empty() || !warm.sync.empty()) entry.curvature_sync_s = pick(k.sync, warm.sync);
    profile.kfac.push_back(entry);
  }
  (void)schedule;
  return profile;
}

void add_measured_memory(sim::Profile& profile, const std::vector<WorkerMemory>& ranks) {
  std::map<std::pair<int, int>, std::int64_t> chunk_bytes;  // (pipeline, chunk)
  std::map<std::pair<int, int>, std::int64_t> kfac_bytes;   // (layer, linear)
  for (const auto& rank : ranks) {
    for (const auto& c : rank.chunks) {
      auto& bytes = chunk_bytes[{c.pipeline, c.chunk}];
      bytes = std::max(bytes, c.total());
    }
    for (const auto& k : rank.kfac) {
      auto& bytes = kfac_bytes[{k.layer, static_cast<int>(k.linear)}];
      bytes = std::max(bytes, k.peak_bytes);
    }
  }
  for (auto& chunk : profile.chunks) {
    // An entry for every pipeline (-1) takes the largest of its pipelines' chunks.
    for (const auto& [key, bytes] : chunk_bytes) {
      if (key.second == chunk.chunk && (chunk.pipeline < 0 || key.first == chunk.pipeline)) {
        chunk.static_bytes = std::max(chunk.static_bytes, static_cast<double>(bytes));
      }
    }
  }
  for (auto& entry : profile.kfac) {
    for (const auto& [key, bytes] : kfac_bytes) {
      const bool layer = entry.layer < 0 || entry.layer == key.first;
      const bool linear = !entry.linear || static_cast<int>(*entry.linear) == key.second;
      if (layer && linear) entry.bytes = std::max(entry.bytes, static_cast<double>(bytes));
    }
  }
}

nlohmann::json memory_to_json(const std::vector<WorkerMemory>& ranks) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& rank : ranks) {
    nlohmann::json chunks = nlohmann::json::array();
    for (const auto& c : rank.chunks) {
      chunks.push_back(
          {c.pipeline, c.chunk, c.parameter_bytes, c.gradient_bytes, c.optimizer_bytes});
    }
    nlohmann::json kfac = nlohmann::json::array();
    for (const auto& k : rank.kfac) {
      kfac.push_back({k.pipeline, k.layer, static_cast<int>(k.linear), k.peak_bytes});
    }
    out.push_back({{"rank", rank.rank}, {"chunks", chunks}, {"kfac", kfac}});
  }
  return out;
}

std::vector<WorkerMemory> memory_from_json(const nlohmann::json& json) {
  const auto fail = [](const std::string& what) {
    throw std::invalid_argument("worker memory record: " + what);
  };
  if (!json.is_array()) fail("expected an array, got " + json.dump());
  std::vector<WorkerMemory> ranks;
  try {
    for (const auto& node : json) {
      WorkerMemory rank;
      rank.rank = node.at("rank").get<int>();
      for (const auto& c : node.at("chunks")) {
        if (c.size() != 5) fail("a chunk needs 5 numbers, got " + c.dump());
        rank.chunks.push_back({c[0].get<int>(), c[1].get<int>(), c[2].get<std::int64_t>(),
                               c[3].get<std::int64_t>(), c[4].get<std::int64_t>()});
      }
      for (const auto& k : node.at("kfac")) {
        const int linear = k.size() == 4 ? k[2].get<int>() : -1;
        if (linear < 0 || linear >= sched::kNumLinearKinds) {
          fail("a K-FAC entry needs pipeline, layer, linear, bytes; got " + k.dump());
        }
        rank.kfac.push_back({k[0].get<int>(), k[1].get<int>(),
                             static_cast<sched::LinearKind>(linear), k[3].get<std::int64_t>()});
      }
      ranks.push_back(std::move(rank));
    }
  } catch (const nlohmann::json::exception& e) {
    fail(e.what());
  }
  return ranks;
}

std::vector<StepTiming> step_timings(const std::vector<InstructionEvent>& events, int ranks,
                                     int warmup_steps) {
  std::map<std::int64_t, StepTiming> steps;
  std::map<std::int64_t, std::pair<double, double>> span;
  for (const auto& event : events) {
    const auto step = event.global_step;
    if (step < warmup_steps) continue;
    auto& timing = steps[step];
    timing.step = step;
    timing.compute_busy_s.resize(static_cast<std::size_t>(ranks));
    timing.kfac_busy_s.resize(static_cast<std::size_t>(ranks));
    // K-FAC tasks of an earlier step run in this step's bubbles: time them where they ran.
    if (event.lane == Lane::kCompute) {
      timing.compute_busy_s[static_cast<std::size_t>(event.rank)] += event.busy_s;
      auto [it, fresh] = span.try_emplace(step, event.start_s, event.end_s);
      if (!fresh) {
        it->second.first = std::min(it->second.first, event.start_s);
        it->second.second = std::max(it->second.second, event.end_s);
      }
    } else if (event.lane == Lane::kKfac) {
      timing.kfac_busy_s[static_cast<std::size_t>(event.rank)] += event.busy_s;
    }
  }
  std::vector<StepTiming> result;
  for (auto& [step, timing] : steps) {
    if (auto it = span.find(step); it != span.end()) {
      timing.wall_s = it->second.second - it->second.first;
    }
    result.push_back(std::move(timing));
  }
  return result;
}

RunSummary summarize_run(const std::vector<InstructionEvent>& events, int ranks, int warmup_steps) {
  RunSummary summary;
  summary.compute_busy_s.assign(static_cast<std::size_t>(ranks), 0.0);
  summary.kfac_busy_s.assign(static_cast<std::size_t>(ranks), 0.0);
  // Steps are delimited by the optimizer steps: an event's global_step is the step whose data it
  // uses, and K-FAC work of one step may run several steps later, so only the optimizer steps
  // (every rank runs one per step, last) say when a step ended.
  std::int64_t last = -1;
  for (const auto& event : events) {
    if (event.instruction.kind == sched::OpKind::kOptimizerStep) {
      last = std::max(last, event.global_step);
    }
  }
  if (last < 0) return summary;
  const std::int64_t first = std::min<std::int64_t>(std::max(warmup_steps, 0), last);
  double open = std::numeric_limits<double>::infinity(), close = 0.0;
  bool has_previous = false;
  for (const auto& event : events) {
    open = first == 0 ? std::min(open, event.start_s) : open;
    if (event.instruction.kind != sched::OpKind::kOptimizerStep) continue;
    if (event.global_step == first - 1) {
      open = has_previous ? std::max(open, event.end_s) : event.end_s;
      has_previous = true;
    }
    if (event.global_step == last) close = std::max(close, event.end_s);
  }
  // Busy time of everything that started inside the window, whatever step its data belongs to.
  for (const auto& event : events) {
    if (event.start_s < open || event.start_s >= close || event.rank < 0 || event.rank >= ranks) {
      continue;
    }
    const auto r = static_cast<std::size_t>(event.rank);
    if (event.lane == Lane::kCompute) summary.compute_busy_s[r] += event.busy_s;
    if (event.lane == Lane::kKfac) summary.kfac_busy_s[r] += event.busy_s;
  }
  summary.first_step = first;
  summary.last_step = last + 1;
  // Time when no rank is inside any instruction for long (a checkpoint written between run
  // segments) is not the executor's: leave such gaps out. Gaps between one rank's instructions
  // are microseconds, and a waiting rank is inside its receive, so nothing else is dropped.
  constexpr double kForeignGap_s = 0.005;
  std::vector<std::pair<double, double>> spans;
  for (const auto& event : events) {
    if (event.end_s > open && event.start_s < close) {
      spans.emplace_back(std::max(event.start_s, open), std::min(event.end_s, close));
    }
  }
  std::sort(spans.begin(), spans.end());
  double covered_until = open, foreign = 0.0;
  for (const auto& [start, end] : spans) {
    if (start - covered_until > kForeignGap_s) foreign += start - covered_until;
    covered_until = std::max(covered_until, end);
  }
  summary.window_s = std::max(0.0, close - open - foreign);
  summary.step_time_s = summary.window_s / static_cast<double>(summary.last_step - first);
  return summary;
}

double RunSummary::compute_utilization() const {
  if (window_s <= 0 || compute_busy_s.empty()) return 0.0;
  double sum = 0.0;
  for (double busy : compute_busy_s) sum += busy;
  return sum / (window_s * static_cast<double>(compute_busy_s.size()));
}

double RunSummary::utilization_with_kfac() const {
  if (window_s <= 0 || compute_busy_s.empty()) return 0.0;
  double sum = 0.0;
  for (std::size_t r = 0; r < compute_busy_s.size(); ++r) sum += compute_busy_s[r] + kfac_busy_s[r];
  return sum / (window_s * static_cast<double>(compute_busy_s.size()));
}

double RunSummary::idle_fraction_of_busiest() const {
  if (window_s <= 0) return 0.0;
  double busiest = 0.0;
  for (std::size_t r = 0; r < compute_busy_s.size(); ++r) {
    busiest = std::max(busiest, compute_busy_s[r] + kfac_busy_s[r]);
  }
  return (window_s - busiest) / window_s;
}

}  // namespace pf::exec
