#include "sim/cpu_device.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "common/cpu_vectors.h"

namespace pf::sim {

namespace {

void check_tier(int vector_tier) {
  if (vector_tier < 0 || vector_tier > 3) {
    throw std::invalid_argument("cpu device: vector tier " + std::to_string(vector_tier) +
                                " is not 0 (SSE) to 3 (AVX-512)");
  }
}

}  // namespace

double cpu_flops_per_cycle(int vector_tier) {
  check_tier(vector_tier);
  constexpr double kFlops[] = {8.0, 16.0, 32.0, 64.0};
  return kFlops[vector_tier];
}

double cpu_cache_bytes_per_cycle(int vector_tier) {
  check_tier(vector_tier);
  constexpr double kBytes[] = {32.0, 32.0, 64.0, 128.0};
  return kBytes[vector_tier];
}

DeviceSpec cpu_device(double clock_hz, int vector_tier, const std::vector<CacheLevel>& caches) {
  if (!std::isfinite(clock_hz) || clock_hz <= 0.0) {
    throw std::invalid_argument("cpu device: clock " + std::to_string(clock_hz) +
                                " Hz is not a positive number");
  }
  const double peak = clock_hz * cpu_flops_per_cycle(vector_tier);
  char name[96];
  std::snprintf(name, sizeof name, "%s (%s, %.2f GHz)", kThisCpuDevice,
                vector_tier_name(vector_tier), clock_hz * 1e-9);
  // The fields of sim/calibration/cpu_start.json, with this CPU's peaks.
  nlohmann::json json = {{"name", name},
                         {"peak_flops", {{"fp32", peak}}},
                         {"matmul_efficiency", 0.5},
                         {"memory_bandwidth", clock_hz * cpu_cache_bytes_per_cycle(vector_tier)},
                         {"link_bandwidth", 1.0e10},
                         {"link_latency_s", 1e-6},
                         {"inverse_solve", "lower_triangle"},
                         {"classes", {{"attention", {{"size_measure", "harmonic_mean"}}}}}};
  double second_level = 0.0, last_level = 0.0;
  int last = 2;
  for (const CacheLevel& cache : caches) {
    if (cache.level == 2) second_level = std::max(second_level, cache.bytes);
    if (cache.level > last) {
      last = cache.level;
      last_level = cache.bytes;
    }
  }
  nlohmann::json memory = nlohmann::json::object();
  if (second_level > 0.0) {
    memory["half_efficiency_size"] = second_level;
    if (last_level > 0.0) memory["outer_cache_bytes"] = last_level;
  } else if (last_level > 0.0) {
    memory["half_efficiency_size"] = last_level;
  }
  if (!memory.empty()) json["classes"]["memory"] = memory;
  return device_from_json(json, kThisCpuDevice);
}

double measure_core_clock_hz() {
#if defined(__x86_64__)
  constexpr int kAddsPerIteration = 100;
  constexpr std::int64_t kIterations = 100000;  // 1e7 cycles: about 3-5 ms
  double best = 0.0;
  for (int attempt = 0; attempt < 9; ++attempt) {
    std::uint64_t value = 0;
    const std::uint64_t one = 1;
    const auto start = std::chrono::steady_clock::now();
    for (std::int64_t i = 0; i < kIterations; ++i) {
      // Each addition waits for the previous one: one per cycle on every x86-64 core. A register
      // operand, not an immediate: recent Intel cores (Golden Cove) fold chains of immediate
      // additions at rename, several per cycle (11 "GHz" on an Emerald Rapids Xeon).
      asm volatile(".rept 100\n\tadd %1, %0\n\t.endr" : "+r"(value) : "r"(one));
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (value != static_cast<std::uint64_t>(kIterations) * kAddsPerIteration) {
      throw std::runtime_error("measure_core_clock_hz: the addition chain miscounted");
    }
    if (seconds > 0.0) {
      best = std::max(best, static_cast<double>(value) / seconds);
    }
  }
  if (best <= 0.0) throw std::runtime_error("measure_core_clock_hz: the clock did not advance");
  return best;
#else
  throw std::runtime_error(
      "this-cpu: measuring the clock needs an x86-64 CPU; give a device JSON file instead "
      "(sim/calibration/cpu_start.json with this CPU's peaks)");
#endif
}

DeviceSpec this_cpu_device() {
  return cpu_device(measure_core_clock_hz(), cpu_vector_tier(), cpu_data_caches());
}

}  // namespace pf::sim
