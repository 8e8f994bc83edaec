# Runs an MPI job that must fail: passes when the job exits non-zero within MAX_SECONDS and its
# output matches EXPECT (a regular expression). A job that hangs is killed at MAX_SECONDS and
# fails the test.
# With -DEXPECT_ONCE=ON the match must occur exactly once (one error line, not one per rank).
#   cmake -DJOB="mpirun;-np;2;prog;args" -DEXPECT="regex" -DMAX_SECONDS=60 -P expect_job_failure.cmake
string(TIMESTAMP start "%s")
execute_process(COMMAND ${JOB} RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err
                TIMEOUT ${MAX_SECONDS})
string(TIMESTAMP end "%s")
math(EXPR elapsed "${end} - ${start}")
message("${out}${err}")
message("job ended after ${elapsed} s with: ${result}")
if(result STREQUAL "0")
  message(FATAL_ERROR "the job succeeded, it should have failed")
endif()
if(result MATCHES "timeout")
  message(FATAL_ERROR "the job hung: killed after ${MAX_SECONDS} s")
endif()
if(NOT "${out}${err}" MATCHES "${EXPECT}")
  message(FATAL_ERROR "the job's output does not match: ${EXPECT}")
endif()
if(EXPECT_ONCE)
  string(REGEX MATCHALL "${EXPECT}" matches "${out}${err}")
  list(LENGTH matches count)
  if(NOT count EQUAL 1)
    message(FATAL_ERROR "expected one match of ${EXPECT}, found ${count}")
  endif()
endif()
