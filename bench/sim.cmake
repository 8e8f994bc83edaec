# Simulator benchmarks (docs/benchmarks.md, "Simulator").
pf_add_benchmark(NAME bench_sim
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_sim.cpp
  LIBS pf_sim pf_scheduler
  SMOKE_ARGS --benchmark_filter=BM_SimulateSmall)

# This machine's CPU kernels timed into a measurements file for `pipefisher_sim calibrate` (a bench
# program; see its header for the flags).
add_executable(bench_sim_calibrate ${CMAKE_CURRENT_SOURCE_DIR}/bench_sim_calibrate.cpp)
target_link_libraries(bench_sim_calibrate PRIVATE pf_kernels pf_kfac pf_eigen_warnings nlohmann_json::nlohmann_json
                      pf_project)
if(PF_BUILD_TESTS)
  add_test(NAME bench_sim_calibrate.smoke COMMAND bench_sim_calibrate --smoke
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(bench_sim_calibrate.smoke PROPERTIES LABELS "bench;no_sanitizer" TIMEOUT 600)
endif()

# The simulator at scale: a 3072-GPU PTD-P step and the configuration search (docs/scale.md).
if(TARGET pf_sim_command)
  pf_add_benchmark(NAME bench_scale
    SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_scale.cpp
    LIBS pf_sim_command
    SMOKE_ARGS --benchmark_filter=BM_SearchBertLarge512)
endif()

# The runtime's device kernels, one class at a time, timed into a measurements file for
# `pipefisher_sim calibrate` (see its header). The suite runs it on the host device runtime and
# prices what it wrote (calibrate --no-fit): the program and its file format are checked without
# a GPU.
add_executable(bench_device_kernels ${CMAKE_CURRENT_SOURCE_DIR}/bench_device_kernels.cpp)
target_link_libraries(bench_device_kernels PRIVATE pf_device pf_ops nlohmann_json::nlohmann_json
                      pf_project)
if(PF_BUILD_TESTS AND TARGET pipefisher_sim)
  add_test(NAME bench_device_kernels.smoke
           COMMAND bash -c "set -e; out=$(mktemp -d); trap 'rm -rf $out' EXIT
             \"$0\" --device host --smoke --out $out/kernels.json
             \"$1\" calibrate --measurements $out/kernels.json --device sim/calibration/cpu_start.json --no-fit"
             $<TARGET_FILE:bench_device_kernels> $<TARGET_FILE:pipefisher_sim>
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(bench_device_kernels.smoke PROPERTIES LABELS "bench;no_sanitizer" TIMEOUT 600)
endif()
