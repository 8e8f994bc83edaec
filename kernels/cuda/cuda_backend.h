#pragma once
// The CUDA implementation of the backend interface: device memory (cudaMalloc), asynchronous
// copies on streams, CUDA events; plus RAII owners of a stream, an event and a cuBLAS handle.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <atomic>

#include "runtime/tensor/backend.h"

namespace pf::kernels::cuda {

// Number of usable devices; 0 when the driver or a device is missing (never throws).
int device_count() noexcept;

class CudaStream final : public tensor::Stream {
 public:
  CudaStream();
  ~CudaStream() override;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  void synchronize() override;
  void wait(const tensor::Event& event) override;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

class CudaEvent final : public tensor::Event {
 public:
  CudaEvent();
  ~CudaEvent() override;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  void record(tensor::Stream& stream) override;
  void synchronize() const override;
  bool completed() const override;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

class CublasHandle {
 public:
  CublasHandle();
  ~CublasHandle();
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  cublasHandle_t get() const { return handle_; }
  void set_stream(cudaStream_t stream);

 private:
  cublasHandle_t handle_ = nullptr;
};

// The stream to run on: the given CudaStream, or the legacy default stream for nullptr.
cudaStream_t stream_of(tensor::Stream* stream);

class CudaBackend final : public tensor::Backend {
 public:
  explicit CudaBackend(int device = 0);
  tensor::Device device() const override { return {tensor::DeviceKind::kCuda, device_}; }
  void* allocate(std::size_t bytes) override;
  void deallocate(void* pointer, std::size_t bytes) noexcept override;
  void copy(void* destination, const void* source, std::size_t bytes, tensor::CopyKind kind,
            tensor::Stream* stream = nullptr) override;
  void fill_zero(void* destination, std::size_t bytes, tensor::Stream* stream = nullptr) override;
  std::unique_ptr<tensor::Stream> create_stream() override;
  std::unique_ptr<tensor::Event> create_event() override;
  void synchronize() override;
  tensor::AllocationStats stats() const override;

 private:
  int device_;
  std::atomic<std::int64_t> allocations_{0};
  std::atomic<std::int64_t> bytes_in_use_{0};
  std::atomic<std::int64_t> peak_bytes_{0};
};

}  // namespace pf::kernels::cuda
