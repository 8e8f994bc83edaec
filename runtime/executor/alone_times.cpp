#include "runtime/executor/alone_times.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>

namespace pf::exec {

namespace {

bool computes(const InstructionEvent& event) {
  return (event.lane == Lane::kCompute || event.lane == Lane::kKfac) && event.bucket < 0;
}

}  // namespace

std::vector<InstructionEvent> alone_times(std::vector<InstructionEvent> events, double capacity) {
  if (!std::isfinite(capacity) || capacity <= 0.0) {
    throw std::invalid_argument("alone_times: capacity " + std::to_string(capacity) +
                                " (must be finite and > 0)");
  }
  // How many compute instructions run, piece by piece: a sweep over their starts and ends.
  std::vector<std::pair<double, int>> edges;
  for (const auto& event : events) {
    if (!computes(event) || !(event.end_s > event.start_s)) continue;
    edges.emplace_back(event.start_s, +1);
    edges.emplace_back(event.end_s, -1);
  }
  std::sort(edges.begin(), edges.end());
  std::vector<double> boundary;  // piece i is [boundary[i], boundary[i + 1])
  std::vector<double> rate;      // each instruction's speed in piece i
  int running = 0;
  for (std::size_t i = 0; i < edges.size();) {
    const double time = edges[i].first;
    for (; i < edges.size() && edges[i].first == time; ++i) running += edges[i].second;
    boundary.push_back(time);
    rate.push_back(running <= capacity ? 1.0 : capacity / running);
  }
  for (auto& event : events) {
    if (!computes(event) || !(event.end_s > event.start_s)) continue;
    const auto first = std::upper_bound(boundary.begin(), boundary.end(), event.start_s) - 1;
    double work = 0.0;
    for (auto piece = first; piece + 1 < boundary.end() && *piece < event.end_s; ++piece) {
      const double from = std::max(*piece, event.start_s);
      const double to = std::min(*(piece + 1), event.end_s);
      if (to > from) work += (to - from) * rate[static_cast<std::size_t>(piece - boundary.begin())];
    }
    event.busy_s *= work / (event.end_s - event.start_s);
  }
  return events;
}

std::vector<InstructionEvent> alone_times_by_machine(std::vector<InstructionEvent> events,
                                                     double capacity,
                                                     const std::vector<int>& machine_of_rank) {
  if (machine_of_rank.empty()) return alone_times(std::move(events), capacity);
  std::map<int, std::vector<std::size_t>> by_machine;  // event indices of each machine
  for (std::size_t i = 0; i < events.size(); ++i) {
    const int rank = events[i].rank;
    if (rank < 0 || static_cast<std::size_t>(rank) >= machine_of_rank.size()) {
      throw std::invalid_argument("alone_times_by_machine: an event of rank " +
                                  std::to_string(rank) + ", but the machine map has " +
                                  std::to_string(machine_of_rank.size()) + " ranks");
    }
    by_machine[machine_of_rank[static_cast<std::size_t>(rank)]].push_back(i);
  }
  if (by_machine.size() <= 1) return alone_times(std::move(events), capacity);
  for (const auto& [machine, indices] : by_machine) {
    std::vector<InstructionEvent> mine;
    mine.reserve(indices.size());
    for (const auto i : indices) mine.push_back(events[i]);
    mine = alone_times(std::move(mine), capacity);
    for (std::size_t j = 0; j < indices.size(); ++j) events[indices[j]] = std::move(mine[j]);
  }
  return events;
}

}  // namespace pf::exec
