#pragma once
// The CUDA DeviceRuntime: one CudaBackend shared by the process's workers, CUDA events with
// timing for the measured trace, the fused CUDA optimizers, K-FAC layers on KfacLayerCuda (one
// KfacCuda, i.e. one cuBLAS and one cuSOLVER handle, per stream), the in-process exchange.
// Built only where nvcc exists; reached only through open_device_runtime.
#include <map>
#include <memory>
#include <mutex>

#include "kernels/cuda/cuda_backend.h"
#include "kfac/cuda/kfac_cuda.h"
#include "runtime/device/device_runtime.h"

namespace pf::device::cuda {

class CudaDeviceRuntime final : public DeviceRuntime {
 public:
  // Throws DeviceUnavailableError when device `index` does not exist.
  CudaDeviceRuntime(
      int index, kernels::GemmPrecision precision,
      kernels::AttentionAlgorithm attention = kernels::AttentionAlgorithm::kBatchedGemm);

  tensor::Device device() const override { return backend_->device(); }
  kernels::GemmPrecision precision() const override { return precision_; }
  kernels::AttentionAlgorithm attention() const override { return attention_; }
  tensor::Backend& backend() override { return *backend_; }
  void bind_thread() override;
  std::unique_ptr<TimingMark> create_timing_mark() override;
  std::unique_ptr<optim::Optimizer> make_optimizer(const OptimizerChoice& choice,
                                                   tensor::Stream* stream) override;
  std::unique_ptr<DeviceKfacLayer> make_kfac_layer(tensor::Stream* stream, std::int64_t d_in,
                                                   std::int64_t d_out,
                                                   const std::string& name) override;
  MessageExchange& exchange() override { return exchange_; }
  // cudaHostAlloc (page-locked: cudaMemcpyAsync from and to it is asynchronous).
  PinnedHostBuffer allocate_pinned_host(std::size_t bytes) override;

 private:
  int index_;
  kernels::GemmPrecision precision_;
  kernels::AttentionAlgorithm attention_;
  std::unique_ptr<kernels::cuda::CudaBackend> backend_;
  MessageExchange exchange_;
  std::mutex mutex_;
  // Shared by the layers of one stream; owned by them, so that it goes with the worker whose
  // stream it issues on (a later stream at the same address gets a new one).
  std::map<tensor::Stream*, std::weak_ptr<kfac::cuda::KfacCuda>> kfac_by_stream_;
};

}  // namespace pf::device::cuda
