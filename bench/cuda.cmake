# CUDA ops on the GPU (GEMM precisions, attention, LayerNorm, K-FAC inversion), timed with CUDA
# events. Without a device the program prints that it skipped and exits 0 (CI compiles it).
if(PF_HAVE_CUDA)
  pf_add_benchmark(NAME bench_cuda SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_cuda.cpp
                   LIBS pf_kernels_cuda SMOKE_ARGS --benchmark_filter=LayerNorm)
endif()
if(PF_HAVE_CUDA)
  pf_add_benchmark(NAME bench_kfac_cuda SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_kfac_cuda.cpp
                   LIBS pf_kfac_cuda pf_optim_cuda SMOKE_ARGS --benchmark_filter=Precondition)
endif()
if(PF_HAVE_CUDA)
  pf_add_benchmark(NAME bench_model_cuda SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_model_cuda.cpp
                   LIBS pf_model pf_kernels_cuda SMOKE_ARGS --benchmark_filter=BertStage/0)
endif()
