# Simulator benchmarks (docs/benchmarks.md, "Simulator").
pf_add_benchmark(NAME bench_sim
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_sim.cpp
  LIBS pf_sim pf_scheduler
  SMOKE_ARGS --benchmark_filter=BM_SimulateSmall)
