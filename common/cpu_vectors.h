#pragma once
// The widest vector instructions this CPU runs, as a tier: 0 SSE, 1 AVX, 2 AVX2 with FMA,
// 3 AVX-512 (F, CD, BW, DQ, VL). The CPU's dense-library choice (kernels/cpu/dense_library.h)
// and the simulator's start device for this CPU (sim/cpu_device.h) read it. Header-only:
// common/ has no library of its own.
#include <array>
#include <cstddef>

namespace pf {

// cpuid with the operating system's support for the registers (GCC's __builtin_cpu_supports
// checks XCR0); 0 on a CPU that is not x86.
inline int cpu_vector_tier() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl")) {
    return 3;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 2;
  if (__builtin_cpu_supports("avx")) return 1;
#endif
  return 0;
}

// "SSE", "AVX", "AVX2", "AVX-512"; "unknown" outside 0-3.
inline const char* vector_tier_name(int tier) {
  constexpr std::array<const char*, 4> kNames = {"SSE", "AVX", "AVX2", "AVX-512"};
  return tier >= 0 && tier < 4 ? kNames[static_cast<std::size_t>(tier)] : "unknown";
}

}  // namespace pf
