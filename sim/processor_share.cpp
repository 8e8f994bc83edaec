#include "sim/processor_share.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace pf::sim {

ProcessorShare::ProcessorShare(double capacity) : capacity_(capacity) {
  if (!std::isfinite(capacity) || capacity <= 0.0) {
    throw std::invalid_argument("shared processor capacity " + std::to_string(capacity) +
                                " (must be finite and > 0)");
  }
}

double ProcessorShare::rate() const {
  const auto n = static_cast<double>(targets_.size());
  return n <= capacity_ ? 1.0 : capacity_ / n;
}

void ProcessorShare::advance(double now) {
  if (now > time_) {
    if (!targets_.empty()) service_ += (now - time_) * rate();
    time_ = now;
  }
}

void ProcessorShare::add(std::int64_t job, double work, double now) {
  advance(now);
  targets_.emplace(service_ + work, job);
}

double ProcessorShare::next_end() const {
  if (targets_.empty()) return std::numeric_limits<double>::infinity();
  return time_ + std::max(0.0, targets_.top().first - service_) / rate();
}

void ProcessorShare::take_done(double now, std::vector<std::int64_t>& done) {
  advance(now);
  if (targets_.empty()) return;
  // `now` came from next_end(): the earliest job is due, whatever the rounding of the clock
  // left of its service. Those with the same target end with it.
  service_ = std::max(service_, targets_.top().first);
  while (!targets_.empty() && targets_.top().first <= service_) {
    done.push_back(targets_.top().second);
    targets_.pop();
  }
}

}  // namespace pf::sim
