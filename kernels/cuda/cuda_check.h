#pragma once
// Error checks for CUDA runtime and cuBLAS calls: a failure throws std::runtime_error naming the
// call, the error and the source location.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace pf::kernels::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t error, const char* call, const char* file,
                                          int line) {
  throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + call +
                           " failed: " + cudaGetErrorName(error) + " (" +
                           cudaGetErrorString(error) + ")");
}

[[noreturn]] inline void throw_cublas_error(cublasStatus_t status, const char* call,
                                            const char* file, int line) {
  throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + call +
                           " failed: cuBLAS status " + cublasGetStatusName(status) + " (" +
                           cublasGetStatusString(status) + ")");
}

}  // namespace pf::kernels::cuda

#define CUDA_CHECK(call)                                                                \
  do {                                                                                  \
    const cudaError_t pf_cuda_error_ = (call);                                          \
    if (pf_cuda_error_ != cudaSuccess) {                                                \
      ::pf::kernels::cuda::throw_cuda_error(pf_cuda_error_, #call, __FILE__, __LINE__); \
    }                                                                                   \
  } while (false)

#define CUBLAS_CHECK(call)                                                                   \
  do {                                                                                       \
    const cublasStatus_t pf_cublas_status_ = (call);                                         \
    if (pf_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                                        \
      ::pf::kernels::cuda::throw_cublas_error(pf_cublas_status_, #call, __FILE__, __LINE__); \
    }                                                                                        \
  } while (false)
