#pragma once
// Chrome trace event format (Perfetto, chrome://tracing) for schedules laid out in time.
//
// Conventions: one process per worker ("worker w", process_sort_index w); threads (lanes)
// compute / send / recv / K-FAC / collective with thread_name and thread_sort_index; one complete
// event (ph X, µs) per instruction whose args carry kind, micro_batch, chunk, pipeline, step
// (plus layer and linear for K-FAC work, peer / bytes / pair_id for communication); a flow arrow
// (ph s -> ph f, same id and cat "p2p", bp "e") from each send to its receive; a stable colour per
// kind (cname, from the trace viewer's reserved colour names); counters as ph C.
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "scheduler/schedule.h"
#include "traces/span_timing.h"

namespace pf::traces {

struct CounterTrack {
  int worker = 0;
  std::string name;
  std::vector<std::pair<double, double>> samples;  // (time_us, value)
};

// kHostLink: K-FAC offload copies between device and host memory (PCIe).
enum class Lane : int {
  kCompute = 0,
  kSend = 1,
  kRecv = 2,
  kKfac = 3,
  kCollective = 4,
  kHostLink = 5
};
Lane lane_of(sched::OpKind kind);
std::string_view lane_name(Lane lane);
std::string_view colour_of(sched::OpKind kind);  // a reserved trace-viewer colour name

// timings is parallel to schedule.streams (throws std::invalid_argument when the shapes differ).
nlohmann::json make_chrome_trace(const sched::Schedule& schedule,
                                 const std::vector<std::vector<SpanTiming>>& timings,
                                 const std::vector<CounterTrack>& counters = {});

void write_json_file(const std::filesystem::path& path, const nlohmann::json& json);

// One complete (ph X) event read back from a trace.
struct TraceEvent {
  std::string name;
  std::string category;
  int pid = 0;
  int tid = 0;
  double ts_us = 0;
  double dur_us = 0;
  nlohmann::json args;
};

// The X events of a trace (a JSON object with traceEvents, or a bare array), in file order.
// Throws std::invalid_argument naming `source` and the field (traceEvents[i].pid) when an X
// event lacks a field or has one of the wrong type or range.
std::vector<TraceEvent> complete_events(const nlohmann::json& trace,
                                        std::string_view source = "trace");
std::vector<TraceEvent> read_chrome_trace(const std::filesystem::path& path);

}  // namespace pf::traces
