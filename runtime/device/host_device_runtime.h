#pragma once
// A DeviceRuntime over the CPU backend: the executor's device path (messages by ticket through
// the MessageExchange, stream/event ordering, staged reductions, device K-FAC layers, timing
// marks) run on host memory with the CPU's real components (CpuBackend, CpuOps, the Eigen K-FAC
// of kfac/, the CPU optimizers, host-clock marks). Not a stand-in for a GPU: it exists so that
// the device path's logic is exercised, and compared with the CPU path, on machines without
// one. --device cpu does not use it (the CPU path is the executor's own, without a runtime).
#include "runtime/device/device_runtime.h"
#include "runtime/tensor/cpu_backend.h"

namespace pf::device {

class HostDeviceRuntime final : public DeviceRuntime {
 public:
  tensor::Device device() const override { return backend_.device(); }
  kernels::GemmPrecision precision() const override { return kernels::GemmPrecision::kFp32; }
  tensor::Backend& backend() override { return backend_; }
  void bind_thread() override {}
  std::unique_ptr<TimingMark> create_timing_mark() override;
  std::unique_ptr<optim::Optimizer> make_optimizer(const OptimizerChoice& choice,
                                                   tensor::Stream* stream) override;
  std::unique_ptr<DeviceKfacLayer> make_kfac_layer(tensor::Stream* stream, std::int64_t d_in,
                                                   std::int64_t d_out,
                                                   const std::string& name) override;
  MessageExchange& exchange() override { return exchange_; }
  // Ordinary host memory (the CPU backend's copies are memcpy's, with nothing to pin for).
  PinnedHostBuffer allocate_pinned_host(std::size_t bytes) override;

 private:
  tensor::CpuBackend backend_;
  MessageExchange exchange_;
};

// The optimizer of `choice` on the CPU (BasicLamb/BasicAdamW/BasicSgd<float>); throws
// std::invalid_argument for an unknown name.
std::unique_ptr<optim::Optimizer> make_host_optimizer(const OptimizerChoice& choice);

}  // namespace pf::device
