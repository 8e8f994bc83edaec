#pragma once
// The CPU benchmarks record which library ran their dense kernels (kernels/cpu/dense_library.h)
// in Google Benchmark's context; a bad PF_CPU_DENSE_LIBRARY is reported, not thrown.
#include <benchmark/benchmark.h>

#include <iostream>
#include <stdexcept>

#include "kernels/cpu/dense_library.h"

namespace pf::bench {

inline bool add_dense_library_context(const char* program) {
  try {
    benchmark::AddCustomContext("dense_library", kernels::cpu::dense_library().summary);
    return true;
  } catch (const std::invalid_argument& error) {
    std::cerr << program << ": error: " << error.what() << "\n";
    return false;
  }
}

}  // namespace pf::bench
