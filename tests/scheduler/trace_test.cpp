// Chrome traces of schedules: metadata, one complete event per instruction with its args, flow
// arrows from sends to receives, counters, and the reader.
#include <unistd.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <set>
#include <string>

#include "scheduler/compile.h"
#include "scheduler/unit_timings.h"
#include "traces/chrome_trace.h"

namespace pf {
namespace {

sched::Schedule sample() {
  sched::ScheduleParams params;
  params.kind = sched::ScheduleKind::kOneFOneB;
  params.workers = 3;
  params.microbatches = 4;
  return sched::compile(params);
}

TEST(ChromeTrace, EventsFlowsAndMetadata) {
  const sched::Schedule s = sample();
  const auto timings = sched::unit_timings(s, 1, 2, 0.25);
  traces::CounterTrack memory{1, "memory_bytes", {{0.0, 10.0}, {3.0, 20.0}}};
  const nlohmann::json trace = traces::make_chrome_trace(s, timings, {memory});
  ASSERT_TRUE(trace.contains("traceEvents"));
  std::size_t complete = 0;
  std::size_t counters = 0;
  std::set<int> named_processes;
  std::map<std::int64_t, int> flow_phases;  // id -> bitmask (1: s, 2: f)
  for (const auto& e : trace["traceEvents"]) {
    const std::string ph = e["ph"];
    if (ph == "M" && e["name"] == "process_name") named_processes.insert(e["pid"].get<int>());
    if (ph == "X") {
      ++complete;
      EXPECT_TRUE(e.contains("cname"));
      EXPECT_TRUE(e["args"].contains("step"));
    }
    if (ph == "s") flow_phases[e["id"].get<std::int64_t>()] |= 1;
    if (ph == "f") {
      EXPECT_EQ(e["bp"], "e");
      EXPECT_EQ(e["cat"], "p2p");
      flow_phases[e["id"].get<std::int64_t>()] |= 2;
    }
    if (ph == "C") ++counters;
  }
  EXPECT_EQ(complete, s.num_instructions());
  EXPECT_EQ(named_processes, (std::set<int>{0, 1, 2}));
  EXPECT_EQ(counters, 2u);
  // One complete arrow per send: 2 boundaries x 4 micro-batches x (activation + gradient).
  EXPECT_EQ(flow_phases.size(), 16u);
  for (const auto& [id, phases] : flow_phases) EXPECT_EQ(phases, 3) << id;

  // Write, read back: the X events keep their fields.
  const auto path = std::filesystem::temp_directory_path() /
                    ("pf_trace_test_" + std::to_string(::getpid()) + ".json");
  traces::write_json_file(path, trace);
  const auto events = traces::read_chrome_trace(path);
  std::filesystem::remove(path);
  ASSERT_EQ(events.size(), s.num_instructions());
  const auto& first = events.front();
  EXPECT_EQ(first.name, "F0.c0");
  EXPECT_EQ(first.category, "forward");
  EXPECT_EQ(first.pid, 0);
  EXPECT_EQ(first.tid, static_cast<int>(traces::Lane::kCompute));
  EXPECT_EQ(first.args["micro_batch"], 0);
  EXPECT_EQ(first.args["chunk"], 0);
  EXPECT_DOUBLE_EQ(first.dur_us, 1.0);
}

TEST(ChromeTrace, UnitTimingsRespectDependencies) {
  const sched::Schedule s = sample();
  const auto t = sched::unit_timings(s, 1, 2, 0);
  // Worker 2 (last stage) starts F0 after workers 0 and 1 ran theirs: at time 2.
  for (std::size_t i = 0; i < s.streams[2].size(); ++i) {
    if (s.streams[2][i].kind == sched::OpKind::kForward) {
      EXPECT_DOUBLE_EQ(t[2][i].start_us, 2.0);
      break;
    }
  }
}

TEST(ChromeTrace, RefusesMismatchedTimingsAndBadFiles) {
  const sched::Schedule s = sample();
  EXPECT_THROW(traces::make_chrome_trace(s, {}), std::invalid_argument);
  EXPECT_THROW(traces::complete_events(nlohmann::json::object()), std::invalid_argument);
  EXPECT_THROW(traces::read_chrome_trace("/nonexistent/trace.json"), std::runtime_error);
}

}  // namespace
}  // namespace pf
