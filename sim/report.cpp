#include "sim/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "traces/chrome_trace.h"

namespace pf::sim {
namespace {

std::string format(const char* pattern, double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), pattern, value);
  return buffer;
}

// Seconds in the most readable unit.
// Below half a nanosecond a duration is floating-point residue of sums (e.g. exposed
// communication of 3.7e-15 s where none is exposed): printed as 0.
std::string duration(double seconds) {
  if (std::abs(seconds) < 0.5e-9) return "0";
  if (seconds >= 1.0) return format("%.4g s", seconds);
  if (seconds >= 1e-3) return format("%.4g ms", seconds * 1e3);
  if (seconds >= 1e-6) return format("%.4g us", seconds * 1e6);
  return format("%.3g ns", seconds * 1e9);
}

std::string bytes(double value) {
  if (value >= 1024.0 * 1024.0 * 1024.0) return format("%.3g GiB", value / (1024.0 * 1024 * 1024));
  if (value >= 1024.0 * 1024.0) return format("%.3g MiB", value / (1024.0 * 1024.0));
  return format("%.4g B", value);
}

std::string percent(double fraction) {
  return format("%.1f%%", 100.0 * fraction);
}

std::string pad(std::string text, std::size_t width) {
  if (text.size() < width) text.insert(0, width - text.size(), ' ');
  return text;
}

}  // namespace

Headline headline(const sched::Schedule& schedule, const SimResult& result,
                  const RunDescription& run) {
  Headline h;
  h.step_time_s = result.step_time_s;
  h.bubble_fraction = result.bubble_fraction;
  const double replicas = std::max(1, schedule.params.data_parallel);
  if (run.micro_batch_size > 0 && result.step_time_s > 0.0) {
    h.sequences_per_s = double{1.0} * schedule.params.microbatches * run.micro_batch_size *
                        replicas / result.step_time_s;
  }
  const double gpus =
      replicas * std::max(1, schedule.num_workers()) * std::max(1, run.tensor_parallel);
  if (h.sequences_per_s > 0.0 && run.model_flops_per_sequence > 0.0 &&
      run.peak_flops_per_worker > 0.0) {
    h.mfu = h.sequences_per_s * run.model_flops_per_sequence / (gpus * run.peak_flops_per_worker);
  }
  const double executed = run.hardware_flops_per_sequence > 0.0 ? run.hardware_flops_per_sequence
                                                                : run.model_flops_per_sequence;
  if (h.sequences_per_s > 0.0 && executed > 0.0) {
    h.achieved_tflops_per_gpu = h.sequences_per_s * executed / gpus / 1e12;
  }
  for (const WorkerReport& w : result.workers) {
    h.mean_exposed_communication_s += w.exposed_communication_s;
    h.max_peak_memory_bytes = std::max(h.max_peak_memory_bytes, w.peak_memory_bytes);
  }
  if (!result.workers.empty()) h.mean_exposed_communication_s /= result.workers.size();
  return h;
}

std::string summary_table(const sched::Schedule& schedule, const SimResult& result,
                          const RunDescription& run) {
  const Headline h = headline(schedule, result, run);
  const auto& p = schedule.params;
  std::string out = "simulated " + std::string(sched::to_string(p.kind)) +
                    ": p=" + std::to_string(schedule.num_workers()) +
                    " m=" + std::to_string(p.microbatches) +
                    " v=" + std::to_string(p.chunks_per_worker);
  if (p.data_parallel > 1) out += " data-parallel=" + std::to_string(p.data_parallel);
  if (run.tensor_parallel > 1) out += " tensor-parallel=" + std::to_string(run.tensor_parallel);
  if (result.num_steps > 1) out += " steps=" + std::to_string(result.num_steps);
  out +=
      "; costs: " + run.cost_model + (run.details.empty() ? "" : " (" + run.details + ")") + "\n";
  out += "step time " + duration(h.step_time_s) + " | bubble " + percent(h.bubble_fraction) +
         " | exposed communication " + duration(h.mean_exposed_communication_s) +
         " per worker (mean)";
  if (h.sequences_per_s > 0.0)
    out += " | throughput " + format("%.4g", h.sequences_per_s) + " seq/s";
  if (h.mfu > 0.0) out += " | MFU " + percent(h.mfu);
  if (run.tensor_parallel > 1 || run.hardware_flops_per_sequence > 0.0) {
    out += " | " + format("%.4g", h.achieved_tflops_per_gpu) + " TFLOP/s per GPU";
  }
  out += "\n";
  out +=
      " worker  utilization      busy/step      idle/step   exposed comm    peak memory  "
      "stashed\n";
  for (std::size_t w = 0; w < result.workers.size(); ++w) {
    const WorkerReport& r = result.workers[w];
    out += pad(std::to_string(w), 7) + pad(percent(r.utilization), 13) +
           pad(duration(r.busy_s), 15) + pad(duration(r.idle_s), 15) +
           pad(duration(r.exposed_communication_s), 15) + pad(bytes(r.peak_memory_bytes), 15) +
           pad(std::to_string(r.peak_stashed_microbatches), 9) + "\n";
  }
  return out;
}

nlohmann::json report_json(const sched::Schedule& schedule, const SimResult& result,
                           const RunDescription& run) {
  const Headline h = headline(schedule, result, run);
  const auto& p = schedule.params;
  nlohmann::json workers = nlohmann::json::array();
  for (std::size_t w = 0; w < result.workers.size(); ++w) {
    const WorkerReport& r = result.workers[w];
    workers.push_back({{"worker", w},
                       {"utilization", r.utilization},
                       {"busy_s", r.busy_s},
                       {"idle_s", r.idle_s},
                       {"exposed_communication_s", r.exposed_communication_s},
                       {"peak_memory_bytes", r.peak_memory_bytes},
                       {"static_memory_bytes", r.static_memory_bytes},
                       {"peak_activation_bytes", r.peak_activation_bytes},
                       {"peak_stashed_microbatches", r.peak_stashed_microbatches}});
  }
  return {{"schedule",
           {{"kind", sched::to_string(p.kind)},
            {"workers", schedule.num_workers()},
            {"microbatches", p.microbatches},
            {"chunks_per_worker", p.chunks_per_worker},
            {"data_parallel", p.data_parallel},
            {"num_steps", result.num_steps},
            {"instructions", schedule.num_instructions()}}},
          {"cost_model", run.cost_model},
          {"cost_model_details", run.details},
          {"step_time_s", h.step_time_s},
          {"makespan_s", result.makespan_s},
          {"bubble_fraction", h.bubble_fraction},
          {"sequences_per_s", h.sequences_per_s},
          {"mfu", h.mfu},
          {"achieved_tflops_per_gpu", h.achieved_tflops_per_gpu},
          {"tensor_parallel", std::max(1, run.tensor_parallel)},
          {"exposed_communication_s", h.mean_exposed_communication_s},
          {"max_peak_memory_bytes", h.max_peak_memory_bytes},
          {"workers", workers}};
}

nlohmann::json simulated_trace(const sched::Schedule& schedule, const SimResult& result) {
  std::vector<std::vector<traces::SpanTiming>> timings(result.times.size());
  for (std::size_t w = 0; w < result.times.size(); ++w) {
    timings[w].reserve(result.times[w].size());
    for (const Timing& t : result.times[w]) {
      timings[w].push_back({t.start_s * 1e6, (t.end_s - t.start_s) * 1e6});
    }
  }
  std::vector<traces::CounterTrack> counters;
  for (std::size_t w = 0; w < result.workers.size(); ++w) {
    traces::CounterTrack track;
    track.worker = static_cast<int>(w);
    track.name = "memory (MiB)";
    for (const MemorySample& s : result.workers[w].memory) {
      track.samples.emplace_back(s.time_s * 1e6, s.bytes / (1024.0 * 1024.0));
    }
    if (!track.samples.empty()) counters.push_back(std::move(track));
  }
  return traces::make_chrome_trace(schedule, timings, counters);
}

std::string comparison_table(const std::vector<ComparisonRow>& rows) {
  std::string out =
      "   schedule    p     m   v      step time   bubble  throughput (seq/s)     MFU    peak "
      "memory\n";
  for (const ComparisonRow& row : rows) {
    out += pad(row.name, 11) + pad(std::to_string(row.workers), 5) +
           pad(std::to_string(row.microbatches), 6) + pad(std::to_string(row.chunks_per_worker), 4);
    if (!row.skipped_reason.empty()) {
      out += "   skipped: " + row.skipped_reason + "\n";
      continue;
    }
    const Headline& h = row.figures;
    out += pad(duration(h.step_time_s), 15) + pad(percent(h.bubble_fraction), 9) +
           pad(h.sequences_per_s > 0 ? format("%.4g", h.sequences_per_s) : "-", 20) +
           pad(h.mfu > 0 ? percent(h.mfu) : "-", 8) + pad(bytes(h.max_peak_memory_bytes), 15) +
           "\n";
  }
  return out;
}

nlohmann::json comparison_json(const std::vector<ComparisonRow>& rows, const RunDescription& run) {
  nlohmann::json list = nlohmann::json::array();
  for (const ComparisonRow& row : rows) {
    nlohmann::json item = {{"schedule", row.name},
                           {"workers", row.workers},
                           {"microbatches", row.microbatches},
                           {"chunks_per_worker", row.chunks_per_worker}};
    if (!row.skipped_reason.empty()) {
      item["skipped"] = row.skipped_reason;
    } else {
      item["step_time_s"] = row.figures.step_time_s;
      item["bubble_fraction"] = row.figures.bubble_fraction;
      item["sequences_per_s"] = row.figures.sequences_per_s;
      item["mfu"] = row.figures.mfu;
      item["achieved_tflops_per_gpu"] = row.figures.achieved_tflops_per_gpu;
      item["max_peak_memory_bytes"] = row.figures.max_peak_memory_bytes;
    }
    list.push_back(item);
  }
  return {{"cost_model", run.cost_model}, {"cost_model_details", run.details}, {"schedules", list}};
}

}  // namespace pf::sim
