#include "scheduler/grid.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "scheduler/unit_timings.h"

namespace pf::sched {
namespace {

std::string pad(const std::string& text, std::size_t width) {
  return text.size() >= width ? text : text + std::string(width - text.size(), ' ');
}

bool shown(const Instruction& in, bool compute_only) {
  return !compute_only || is_compute(in.kind);
}

}  // namespace

std::string render_grid(const Schedule& schedule, const GridOptions& options) {
  const int workers = schedule.num_workers();
  const int first_worker = std::clamp(options.first_worker, 0, workers);
  const int last_worker =
      options.num_workers < 0 ? workers : std::min(workers, first_worker + options.num_workers);
  // Cells per row (filtered when compute_only).
  std::vector<std::vector<std::string>> cells;
  std::size_t width = 1;
  std::size_t longest = 0;
  for (int w = first_worker; w < last_worker; ++w) {
    const auto& stream = schedule.streams[static_cast<std::size_t>(w)];
    std::vector<std::string> row;
    int position = 0;
    for (std::size_t i = 0; i < stream.size(); ++i) {
      if (!shown(stream[i], options.compute_only)) continue;
      const int index = position++;
      if (index < options.first_position) continue;
      if (options.num_positions >= 0 && index >= options.first_position + options.num_positions) {
        row.push_back("...");
        break;
      }
      std::string label = short_label(stream[i]);
      if (w == options.marked_worker && static_cast<int>(i) == options.marked_position) {
        label = "[" + label + "]";
      }
      width = std::max(width, label.size());
      row.push_back(std::move(label));
    }
    longest = std::max(longest, row.size());
    cells.push_back(std::move(row));
  }
  const std::string header_label = "worker";
  std::string out = pad("", 10) + "position " + std::to_string(options.first_position) + "..\n";
  for (int w = first_worker; w < last_worker; ++w) {
    std::string line = pad("w" + std::to_string(w), 6) + "| ";
    const auto& row = cells[static_cast<std::size_t>(w - first_worker)];
    for (std::size_t j = 0; j < row.size(); ++j) {
      line += pad(row[j], width + 1);
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  return out;
}

std::string render_grid_around(const Schedule& schedule, int worker, int position, int radius) {
  GridOptions options;
  constexpr int kRowsEitherSide = 4;
  options.first_worker = std::max(0, worker - kRowsEitherSide);
  options.num_workers = 2 * kRowsEitherSide + 1;
  options.first_position = std::max(0, position - radius);
  options.num_positions = 2 * radius + 1;
  options.marked_worker = worker;
  options.marked_position = position;
  return render_grid(schedule, options);
}

std::string render_timeline(const Schedule& schedule, int max_slots) {
  UnitDurations durations;
  durations.forward_us = 1;
  durations.backward_us = 1;
  durations.backward_input_us = 1;
  durations.backward_weight_us = 1;
  durations.communication_us = 0;
  durations.reduction_us = 0;
  durations.optimizer_us = 0;
  durations.kfac_us = 0;
  const auto timings = unit_timings(schedule, durations);
  std::size_t width = 1;
  int slots = 0;
  for (std::size_t w = 0; w < schedule.streams.size(); ++w) {
    for (std::size_t i = 0; i < schedule.streams[w].size(); ++i) {
      const Instruction& in = schedule.streams[w][i];
      if (!is_compute(in.kind)) continue;
      width = std::max(width, short_label(in).size());
      slots = std::max(slots, static_cast<int>(std::lround(timings[w][i].start_us)) + 1);
    }
  }
  const int shown_slots = std::min(slots, max_slots);
  std::string out;
  for (std::size_t w = 0; w < schedule.streams.size(); ++w) {
    std::vector<std::string> row(static_cast<std::size_t>(shown_slots), ".");
    for (std::size_t i = 0; i < schedule.streams[w].size(); ++i) {
      const Instruction& in = schedule.streams[w][i];
      if (!is_compute(in.kind)) continue;
      const long slot = std::lround(timings[w][i].start_us);
      if (slot < shown_slots) row[static_cast<std::size_t>(slot)] = short_label(in);
    }
    std::string line = pad("w" + std::to_string(w), 6) + "| ";
    for (const std::string& cell : row) line += pad(cell, width + 1);
    if (slots > shown_slots) line += "...";
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  return out;
}

}  // namespace pf::sched
