// The one file that maps a device to its DeviceRuntime (as kernels/make_ops.cpp maps it to its
// ops): the only place outside kernels/cuda, kfac/cuda, runtime/optim/cuda and
// runtime/device/cuda that knows whether this build has CUDA.
#include "runtime/device/device_runtime.h"

#include <string>

#ifndef PF_HAVE_CUDA
#define PF_HAVE_CUDA 0
#endif
#if PF_HAVE_CUDA
#include "runtime/device/cuda/cuda_device_runtime.h"
#endif

namespace pf::device {

bool cuda_runtime_compiled() {
  return PF_HAVE_CUDA != 0;
}

std::shared_ptr<DeviceRuntime> open_device_runtime(tensor::Device device,
                                                   kernels::GemmPrecision precision,
                                                   kernels::AttentionAlgorithm attention) {
  if (device.kind == tensor::DeviceKind::kCpu) return nullptr;
#if PF_HAVE_CUDA
  return std::make_shared<cuda::CudaDeviceRuntime>(device.index, precision, attention);
#else
  (void)precision;
  (void)attention;
  throw DeviceUnavailableError("--device " + tensor::to_string(device) +
                               ": this build has no CUDA (configure with a CUDA toolkit and "
                               "-DPF_WITH_CUDA=ON)");
#endif
}

}  // namespace pf::device
