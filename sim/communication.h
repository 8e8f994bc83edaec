#pragma once
// Link cost formulas shared by the cost models.
#include <stdexcept>
#include <string>

namespace pf::sim {

// One message over one link: latency + bytes / bandwidth.
inline double transfer_seconds(double bytes, double bandwidth, double latency_s) {
  return latency_s + bytes / bandwidth;
}

// A K-FAC offload transfer (sched::is_kfac_transfer) of `bytes` over the host link (PCIe).
// Throws std::invalid_argument naming `what_sets_it` when the bandwidth is not known.
inline double host_transfer_seconds(double bytes, double bandwidth, double latency_s,
                                    const std::string& what_sets_it) {
  if (!(bandwidth > 0.0)) {
    throw std::invalid_argument("K-FAC offload transfers need the host link's bandwidth: set " +
                                what_sets_it);
  }
  return transfer_seconds(bytes, bandwidth, latency_s);
}

// Ring all-reduce of `bytes` over n participants: 2 (n - 1) / n * bytes / bandwidth for the
// reduce-scatter and all-gather halves, plus 2 (n - 1) message latencies. 0 for n <= 1.
inline double ring_allreduce_seconds(double bytes, int participants, double bandwidth,
                                     double latency_s) {
  if (participants <= 1) return 0.0;
  const double n = participants;
  return 2.0 * (n - 1.0) / n * bytes / bandwidth + 2.0 * (n - 1.0) * latency_s;
}

}  // namespace pf::sim
