#pragma once
// Link cost formulas shared by the cost models.
namespace pf::sim {

// One message over one link: latency + bytes / bandwidth.
inline double transfer_seconds(double bytes, double bandwidth, double latency_s) {
  return latency_s + bytes / bandwidth;
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
