#include "kernels/cuda/cuda_backend.h"

#include "kernels/cuda/cuda_check.h"

namespace pf::kernels::cuda {

int device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error of a missing driver
    return 0;
  }
  return count;
}

CudaStream::CudaStream() {
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}
CudaStream::~CudaStream() {
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}
void CudaStream::synchronize() {
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}
void CudaStream::wait(const tensor::Event& event) {
  const auto& cuda_event = dynamic_cast<const CudaEvent&>(event);
  CUDA_CHECK(cudaStreamWaitEvent(stream_, cuda_event.get(), 0));
}

CudaEvent::CudaEvent() {
  CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
}
CudaEvent::~CudaEvent() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}
void CudaEvent::record(tensor::Stream& stream) {
  CUDA_CHECK(cudaEventRecord(event_, dynamic_cast<CudaStream&>(stream).get()));
}
void CudaEvent::synchronize() const {
  CUDA_CHECK(cudaEventSynchronize(event_));
}
bool CudaEvent::completed() const {
  const cudaError_t status = cudaEventQuery(event_);
  if (status == cudaErrorNotReady) return false;
  CUDA_CHECK(status);
  return true;
}

CublasHandle::CublasHandle() {
  CUBLAS_CHECK(cublasCreate(&handle_));
}
CublasHandle::~CublasHandle() {
  if (handle_ != nullptr) cublasDestroy(handle_);
}
void CublasHandle::set_stream(cudaStream_t stream) {
  CUBLAS_CHECK(cublasSetStream(handle_, stream));
}

cudaStream_t stream_of(tensor::Stream* stream) {
  return stream == nullptr ? cudaStream_t{} : dynamic_cast<CudaStream&>(*stream).get();
}

CudaBackend::CudaBackend(int device) : device_(device) {
  const int count = device_count();
  if (device < 0 || device >= count) {
    throw std::runtime_error("CUDA device " + std::to_string(device) + " requested, " +
                             std::to_string(count) + " available");
  }
  CUDA_CHECK(cudaSetDevice(device));
}

void* CudaBackend::allocate(std::size_t bytes) {
  void* pointer = nullptr;
  CUDA_CHECK(cudaMalloc(&pointer, bytes == 0 ? 1 : bytes));  // 256-byte aligned
  allocations_.fetch_add(1);
  const auto in_use =
      bytes_in_use_.fetch_add(static_cast<std::int64_t>(bytes)) + static_cast<std::int64_t>(bytes);
  std::int64_t peak = peak_bytes_.load();
  while (in_use > peak && !peak_bytes_.compare_exchange_weak(peak, in_use)) {
  }
  return pointer;
}

void CudaBackend::deallocate(void* pointer, std::size_t bytes) noexcept {
  if (pointer == nullptr) return;
  cudaFree(pointer);
  bytes_in_use_.fetch_sub(static_cast<std::int64_t>(bytes));
}

void CudaBackend::copy(void* destination, const void* source, std::size_t bytes,
                       tensor::CopyKind kind, tensor::Stream* stream) {
  const cudaMemcpyKind direction = kind == tensor::CopyKind::kHostToDevice ? cudaMemcpyHostToDevice
                                   : kind == tensor::CopyKind::kDeviceToHost
                                       ? cudaMemcpyDeviceToHost
                                       : cudaMemcpyDeviceToDevice;
  CUDA_CHECK(cudaMemcpyAsync(destination, source, bytes, direction, stream_of(stream)));
}

void CudaBackend::fill_zero(void* destination, std::size_t bytes, tensor::Stream* stream) {
  CUDA_CHECK(cudaMemsetAsync(destination, 0, bytes, stream_of(stream)));
}

std::unique_ptr<tensor::Stream> CudaBackend::create_stream() {
  return std::make_unique<CudaStream>();
}
std::unique_ptr<tensor::Event> CudaBackend::create_event() {
  return std::make_unique<CudaEvent>();
}
void CudaBackend::synchronize() {
  CUDA_CHECK(cudaDeviceSynchronize());
}

tensor::AllocationStats CudaBackend::stats() const {
  return {allocations_.load(), bytes_in_use_.load(), peak_bytes_.load()};
}

}  // namespace pf::kernels::cuda
