# NCCL overheads: our NcclCommunicator against raw NCCL calls, side by side in one run, under
# mpirun (one rank per GPU; the lent machine's one GPU: -np 1). Built where the NCCL communicator
# is; without a CUDA device it prints that it measured nothing and exits 0, which the smoke run
# in the test suite asserts on CPU machines (on a GPU: every result verified).
if(TARGET pf_comm_nccl)
  add_executable(bench_nccl ${CMAKE_CURRENT_SOURCE_DIR}/bench_nccl.cpp)
  target_link_libraries(bench_nccl PRIVATE pf_comm_nccl pf_kernels_cuda pf_nccl_library
                                           CUDA::cudart pf_project)
  if(PF_BUILD_TESTS AND MPIEXEC_EXECUTABLE)
    add_test(NAME bench_nccl.smoke
             COMMAND ${MPIEXEC_EXECUTABLE} --oversubscribe --allow-run-as-root --bind-to none -np 1
                     $<TARGET_FILE:bench_nccl> --smoke
             WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(
      bench_nccl.smoke
      PROPERTIES LABELS "bench;no_sanitizer;mpi" TIMEOUT 300
                 PASS_REGULAR_EXPRESSION
                 "bench_nccl: (no CUDA device, nothing measured|every result verified)"
                 FAIL_REGULAR_EXPRESSION "bench_nccl: (FAILED|error|rank [0-9]+: error)")
  endif()
endif()
