# Data path: tokenization throughput, instance creation, shard loading.
pf_add_benchmark(NAME bench_data
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_data.cpp
  LIBS pf_data
  SMOKE_ARGS --benchmark_filter=Tokenize)
