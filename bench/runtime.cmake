# The runtime's figures: executor overhead, pipeline vs one worker, simulator replay error and
# K-FAC in the bubbles, measured side by side (a bench program; see its header for the flags).
add_executable(bench_runtime ${CMAKE_CURRENT_SOURCE_DIR}/bench_runtime.cpp)
target_link_libraries(bench_runtime PRIVATE pf_train pf_project)
if(PF_BUILD_TESTS)
  add_test(NAME bench_runtime.smoke COMMAND bench_runtime --smoke
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(bench_runtime.smoke PROPERTIES LABELS "bench;no_sanitizer" TIMEOUT 600)
endif()

# MPI processes against threads, run under mpirun (built where MPI is found).
if(TARGET pf_executor_mpi)
  add_executable(bench_mpi ${CMAKE_CURRENT_SOURCE_DIR}/bench_mpi.cpp)
  target_link_libraries(bench_mpi PRIVATE pf_executor_mpi pf_project)
  if(PF_BUILD_TESTS AND MPIEXEC_EXECUTABLE)
    add_test(NAME bench_mpi.smoke
             COMMAND ${MPIEXEC_EXECUTABLE} --oversubscribe --allow-run-as-root --bind-to none -np 2
                     $<TARGET_FILE:bench_mpi> --smoke
             WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(bench_mpi.smoke PROPERTIES LABELS "bench;no_sanitizer;mpi" TIMEOUT 600)
  endif()
endif()

# K-FAC state across data-parallel replicas: memory and bytes per placement, measured under mpirun
# against the cost model, and simulated for a larger model (--simulate).
if(TARGET pf_executor_mpi)
  add_executable(bench_kfac_sharding ${CMAKE_CURRENT_SOURCE_DIR}/bench_kfac_sharding.cpp)
  target_link_libraries(bench_kfac_sharding PRIVATE pf_executor_mpi pf_pipefisher pf_project)
  if(PF_BUILD_TESTS AND MPIEXEC_EXECUTABLE)
    add_test(NAME bench_kfac_sharding.smoke
             COMMAND ${MPIEXEC_EXECUTABLE} --oversubscribe --allow-run-as-root --bind-to none -np 4
                     $<TARGET_FILE:bench_kfac_sharding> --smoke
             WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(bench_kfac_sharding.smoke
                         PROPERTIES LABELS "bench;no_sanitizer;mpi" TIMEOUT 600)
  endif()
endif()
