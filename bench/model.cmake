# Forward + backward of BERT pretraining (MLM over 20 positions + NSP), the numerical core's
# throughput figure; bench/torch_bert_bench.py runs it side by side with PyTorch.
pf_add_benchmark(NAME bench_model SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_model.cpp
                 LIBS pf_model SMOKE_ARGS --benchmark_filter=tiny/batch:2)
target_link_libraries(bench_model PRIVATE pf_eigen_warnings)
