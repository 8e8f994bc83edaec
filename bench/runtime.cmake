# The runtime's figures: executor overhead, pipeline vs one worker, simulator replay error and
# K-FAC in the bubbles, measured side by side (a bench program; see its header for the flags).
add_executable(bench_runtime ${CMAKE_CURRENT_SOURCE_DIR}/bench_runtime.cpp)
target_link_libraries(bench_runtime PRIVATE pf_train pf_project)
if(PF_BUILD_TESTS)
  add_test(NAME bench_runtime.smoke COMMAND bench_runtime --smoke
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(bench_runtime.smoke PROPERTIES LABELS "bench;no_sanitizer" TIMEOUT 600)
endif()
