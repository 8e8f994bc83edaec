#include "kernels/make_ops.h"

#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/cpu/cpu_ops.h"
#ifndef PF_HAVE_CUDA
#define PF_HAVE_CUDA 0
#endif
#if PF_HAVE_CUDA
#include "kernels/cuda/cuda_ops.h"
#endif

namespace pf::kernels {

bool cuda_ops_compiled() {
  return PF_HAVE_CUDA != 0;
}

template <typename T>
std::unique_ptr<BackendOps<T>> make_ops(tensor::Backend& backend, tensor::Stream* stream,
                                        GemmPrecision precision, AttentionAlgorithm attention) {
  const tensor::Device device = backend.device();
  if (device.kind == tensor::DeviceKind::kCpu) {
    if (attention != AttentionAlgorithm::kBatchedGemm) {
      throw std::invalid_argument("make_ops: the CPU has the batched attention only, not " +
                                  std::string(to_string(attention)));
    }
    return std::make_unique<CpuOps<T>>();
  }
#if PF_HAVE_CUDA
  if constexpr (std::is_same_v<T, float>) {
    if (device.kind == tensor::DeviceKind::kCuda) {
      return std::make_unique<cuda::CudaOps>(dynamic_cast<cuda::CudaBackend&>(backend), stream,
                                             precision, attention);
    }
  }
#else
  (void)stream;
  (void)precision;
#endif
  throw std::invalid_argument("make_ops: no " + std::string(sizeof(T) == 8 ? "double" : "float") +
                              " ops for device " + tensor::to_string(device) +
                              (cuda_ops_compiled() ? "" : " (built without CUDA)"));
}

template std::unique_ptr<BackendOps<float>> make_ops<float>(tensor::Backend&, tensor::Stream*,
                                                            GemmPrecision, AttentionAlgorithm);
template std::unique_ptr<BackendOps<double>> make_ops<double>(tensor::Backend&, tensor::Stream*,
                                                              GemmPrecision, AttentionAlgorithm);

}  // namespace pf::kernels
