#include "traces/chrome_trace.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <unordered_map>

#include "common/input_error.h"
#include "common/json_fields.h"

namespace pf::traces {

using nlohmann::json;
using sched::OpKind;

Lane lane_of(OpKind kind) {
  switch (kind) {
    case OpKind::kSendActivation:
    case OpKind::kSendGradient:
      return Lane::kSend;
    case OpKind::kRecvActivation:
    case OpKind::kRecvGradient:
      return Lane::kRecv;
    case OpKind::kReduceGradPipelines:
    case OpKind::kReduceGradDataParallel:
    case OpKind::kCurvatureSync:
    case OpKind::kBroadcastInverses:
    case OpKind::kBroadcastGradient:
      return Lane::kCollective;
    case OpKind::kCurvatureA:
    case OpKind::kCurvatureB:
    case OpKind::kInvertA:
    case OpKind::kInvertB:
    case OpKind::kPrecondition:
      return Lane::kKfac;
    case OpKind::kPrefetchFactors:
    case OpKind::kWriteBackState:
    case OpKind::kPrefetchInverses:
      return Lane::kHostLink;
    default:
      return Lane::kCompute;
  }
}

std::string_view lane_name(Lane lane) {
  switch (lane) {
    case Lane::kCompute:
      return "compute";
    case Lane::kSend:
      return "send";
    case Lane::kRecv:
      return "recv";
    case Lane::kKfac:
      return "K-FAC";
    case Lane::kCollective:
      return "collective";
    case Lane::kHostLink:
      return "host link";
  }
  return "compute";
}

std::string_view colour_of(OpKind kind) {
  switch (kind) {
    case OpKind::kForward:
      return "thread_state_running";
    case OpKind::kBackward:
      return "thread_state_iowait";
    case OpKind::kBackwardInput:
      return "rail_response";
    case OpKind::kBackwardWeight:
      return "rail_animation";
    case OpKind::kSendActivation:
      return "thread_state_runnable";
    case OpKind::kRecvActivation:
      return "thread_state_sleeping";
    case OpKind::kSendGradient:
      return "light_memory_dump";
    case OpKind::kRecvGradient:
      return "detailed_memory_dump";
    case OpKind::kReduceGradPipelines:
      return "rail_load";
    case OpKind::kReduceGradDataParallel:
      return "rail_idle";
    case OpKind::kOptimizerStep:
      return "black";
    case OpKind::kCurvatureA:
      return "good";
    case OpKind::kCurvatureB:
      return "olive";
    case OpKind::kCurvatureSync:
      return "grey";
    case OpKind::kInvertA:
      return "yellow";
    case OpKind::kInvertB:
      return "terrible";
    case OpKind::kPrecondition:
      return "bad";
    case OpKind::kBroadcastInverses:
      return "cq_build_passed";
    case OpKind::kBroadcastGradient:
      return "cq_build_attempt_passed";
    case OpKind::kPrefetchFactors:
      return "cq_build_running";
    case OpKind::kWriteBackState:
      return "cq_build_failed";
    case OpKind::kPrefetchInverses:
      return "cq_build_abandoned";
  }
  return "generic_work";
}

namespace {

json args_of(const sched::Instruction& in) {
  json args = {{"kind", sched::to_string(in.kind)}, {"step", in.step}};
  if (in.microbatch >= 0) args["micro_batch"] = in.microbatch;
  if (in.chunk >= 0) {
    args["chunk"] = in.chunk;
    args["pipeline"] = in.pipeline;
  }
  if (sched::is_kfac(in.kind)) {
    args["layer"] = in.layer;
    args["linear"] = sched::to_string(in.linear);
  }
  if (in.peer >= 0) args["peer"] = in.peer;
  if (in.pair_id >= 0) args["pair_id"] = in.pair_id;
  if (in.bytes != 0) args["bytes"] = in.bytes;
  return args;
}

}  // namespace

json make_chrome_trace(const sched::Schedule& schedule,
                       const std::vector<std::vector<SpanTiming>>& timings,
                       const std::vector<CounterTrack>& counters) {
  if (timings.size() != schedule.streams.size()) {
    throw std::invalid_argument("trace: timings for " + std::to_string(timings.size()) +
                                " workers, the schedule has " +
                                std::to_string(schedule.streams.size()));
  }
  json events = json::array();
  std::unordered_map<std::int64_t, std::pair<int, std::size_t>> receive_of;
  for (std::size_t w = 0; w < schedule.streams.size(); ++w) {
    const auto& stream = schedule.streams[w];
    if (timings[w].size() != stream.size()) {
      throw std::invalid_argument("trace: worker " + std::to_string(w) + " has " +
                                  std::to_string(stream.size()) + " instructions but " +
                                  std::to_string(timings[w].size()) + " timings");
    }
    const int pid = static_cast<int>(w);
    events.push_back({{"ph", "M"},
                      {"name", "process_name"},
                      {"pid", pid},
                      {"args", {{"name", "worker " + std::to_string(w)}}}});
    events.push_back({{"ph", "M"},
                      {"name", "process_sort_index"},
                      {"pid", pid},
                      {"args", {{"sort_index", pid}}}});
    for (int lane = 0; lane <= static_cast<int>(Lane::kHostLink); ++lane) {
      events.push_back({{"ph", "M"},
                        {"name", "thread_name"},
                        {"pid", pid},
                        {"tid", lane},
                        {"args", {{"name", lane_name(static_cast<Lane>(lane))}}}});
      events.push_back({{"ph", "M"},
                        {"name", "thread_sort_index"},
                        {"pid", pid},
                        {"tid", lane},
                        {"args", {{"sort_index", lane}}}});
    }
    for (std::size_t i = 0; i < stream.size(); ++i) {
      if (sched::is_receive(stream[i].kind)) receive_of[stream[i].pair_id] = {pid, i};
    }
  }
  for (std::size_t w = 0; w < schedule.streams.size(); ++w) {
    const auto& stream = schedule.streams[w];
    const int pid = static_cast<int>(w);
    for (std::size_t i = 0; i < stream.size(); ++i) {
      const sched::Instruction& in = stream[i];
      const SpanTiming& t = timings[w][i];
      const int tid = static_cast<int>(lane_of(in.kind));
      events.push_back({{"ph", "X"},
                        {"name", sched::short_label(in)},
                        {"cat", sched::to_string(in.kind)},
                        {"pid", pid},
                        {"tid", tid},
                        {"ts", t.start_us},
                        {"dur", t.duration_us},
                        {"cname", colour_of(in.kind)},
                        {"args", args_of(in)}});
      if (!sched::is_send(in.kind)) continue;
      const auto it = receive_of.find(in.pair_id);
      if (it == receive_of.end()) continue;
      const auto [peer, position] = it->second;
      const SpanTiming& rt = timings[static_cast<std::size_t>(peer)][position];
      const std::string name = in.kind == OpKind::kSendActivation ? "activation" : "gradient";
      events.push_back({{"ph", "s"},
                        {"id", in.pair_id},
                        {"cat", "p2p"},
                        {"name", name},
                        {"pid", pid},
                        {"tid", tid},
                        {"ts", t.start_us}});
      events.push_back({{"ph", "f"},
                        {"bp", "e"},
                        {"id", in.pair_id},
                        {"cat", "p2p"},
                        {"name", name},
                        {"pid", peer},
                        {"tid", static_cast<int>(Lane::kRecv)},
                        {"ts", rt.start_us}});
    }
  }
  for (const CounterTrack& track : counters) {
    for (const auto& [time_us, value] : track.samples) {
      events.push_back({{"ph", "C"},
                        {"name", track.name},
                        {"pid", track.worker},
                        {"ts", time_us},
                        {"args", {{track.name, value}}}});
    }
  }
  return json{{"traceEvents", std::move(events)},
              {"displayTimeUnit", "ms"},
              {"otherData",
               {{"schedule", sched::to_string(schedule.params.kind)},
                {"workers", schedule.params.workers},
                {"microbatches", schedule.params.microbatches},
                {"chunks_per_worker", schedule.params.chunks_per_worker}}}};
}

void write_json_file(const std::filesystem::path& path, const nlohmann::json& json_value) {
  std::ofstream out(path);
  if (!out) throw InputError("cannot write " + path.string());
  out << json_value.dump() << '\n';
  if (!out) throw InputError("failed writing " + path.string());
}

std::vector<TraceEvent> complete_events(const nlohmann::json& trace, std::string_view source) {
  const std::string where(source);
  const json* events = &trace;
  if (trace.is_object()) {
    const auto it = trace.find("traceEvents");
    if (it == trace.end()) throw std::invalid_argument(where + ": no traceEvents array");
    events = &*it;
  }
  if (!events->is_array()) throw std::invalid_argument(where + ": traceEvents is not an array");
  constexpr int kIntMin = std::numeric_limits<int>::min();
  constexpr int kIntMax = std::numeric_limits<int>::max();
  auto number = [&](const json& event, const char* key, const std::string& prefix) {
    const auto it = event.find(key);
    if (it == event.end()) json_fields::fail_missing(where, prefix + key, "a finite number");
    if (!it->is_number() || !std::isfinite(it->get<double>())) {
      json_fields::fail(where, prefix + key, *it, "a finite number");
    }
    return it->get<double>();
  };
  std::vector<TraceEvent> result;
  for (std::size_t i = 0; i < events->size(); ++i) {
    const json& e = (*events)[i];
    const std::string prefix = "traceEvents[" + std::to_string(i) + "].";
    if (!e.is_object()) continue;
    if (json_fields::string_field(e, "ph", where, std::string(), prefix) != "X") continue;
    TraceEvent event;
    event.name = json_fields::string_field(e, "name", where, std::nullopt, prefix);
    event.category = json_fields::string_field(e, "cat", where, std::string(), prefix);
    event.pid = json_fields::integer_field<int>(e, "pid", where, kIntMin, kIntMax, {}, prefix);
    event.tid = json_fields::integer_field<int>(e, "tid", where, kIntMin, kIntMax, {}, prefix);
    event.ts_us = number(e, "ts", prefix);
    event.dur_us = number(e, "dur", prefix);
    event.args = e.value("args", json::object());
    result.push_back(std::move(event));
  }
  return result;
}

std::vector<TraceEvent> read_chrome_trace(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw InputError("cannot open trace " + path.string());
  json trace;
  try {
    trace = json_fields::parse_bounded(in, path.string());
  } catch (const json::parse_error& error) {
    throw std::invalid_argument(path.string() + ": not valid JSON: " + error.what());
  }
  return complete_events(trace, path.string());
}

}  // namespace pf::traces
