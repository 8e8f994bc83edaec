#pragma once
// The checking macro for cuSOLVER calls (as CUDA_CHECK and CUBLAS_CHECK for theirs): a failed
// call throws std::runtime_error naming the call, its file and line and the status.
#include <cusolverDn.h>

#include <stdexcept>
#include <string>

namespace pf::kfac::cuda {

[[noreturn]] inline void throw_cusolver_error(cusolverStatus_t status, const char* call,
                                              const char* file, int line) {
  throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + call +
                           " failed: cuSOLVER status " + std::to_string(static_cast<int>(status)));
}

}  // namespace pf::kfac::cuda

#define CUSOLVER_CHECK(call)                                                                  \
  do {                                                                                        \
    const cusolverStatus_t pf_cusolver_status_ = (call);                                      \
    if (pf_cusolver_status_ != CUSOLVER_STATUS_SUCCESS) {                                     \
      ::pf::kfac::cuda::throw_cusolver_error(pf_cusolver_status_, #call, __FILE__, __LINE__); \
    }                                                                                         \
  } while (false)
