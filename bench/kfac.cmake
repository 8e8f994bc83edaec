# K-FAC operations of one Linear layer (curvature, inversion, preconditioning) and optimizer steps.
pf_add_benchmark(NAME bench_kfac SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_kfac.cpp
                 LIBS pf_kfac pf_optim SMOKE_ARGS --benchmark_filter=/64)
# Divisible inversion: the blocked Cholesky chain against the monolithic inverse and Newton-Schulz.
pf_add_benchmark(NAME bench_kfac_pieces SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_kfac_pieces.cpp
                 LIBS pf_kfac SMOKE_ARGS --benchmark_filter=/256)
