# Schedule compiler: generate + lower + validate (interleaved 1F1B).
pf_add_benchmark(NAME bench_scheduler
                 SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_scheduler.cpp
                 LIBS pf_scheduler
                 SMOKE_ARGS --benchmark_filter=/4/2/8$)
