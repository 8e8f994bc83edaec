#pragma once
// The untimed runs before each round-robin sample of the kernel harnesses (bench_sim_calibrate,
// bench_device_kernels): the cases visited since evicted this one's data, and on a
// non-inclusive L3 (Intel's since Skylake-SP) data that comes back from memory once is not kept
// there. An add of 9.4 MB timed after one warm-up ran at 13 GB/s, after two or more at 23, as
// when timed back to back (docs/simulator.md, "The warm-up before each sample, and two cliffs").
namespace pf::bench {

inline constexpr int kWarmUpRuns = 3;

// `run` kWarmUpRuns times, unless one run takes 20 ms or more (a run that long is not helped).
template <typename Run>
void warm_up(double one_run_seconds, const Run& run) {
  if (one_run_seconds >= 2e-2) return;
  for (int i = 0; i < kWarmUpRuns; ++i) run();
}

}  // namespace pf::bench
