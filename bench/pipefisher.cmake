# The PipeFisher pass: timing of the pass itself, and (with --figures) the docs' tables.
pf_add_benchmark(NAME bench_pipefisher
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_pipefisher.cpp
  LIBS pf_pipefisher
  SMOKE_ARGS --benchmark_filter=BM_PipeFisherPass/0)
