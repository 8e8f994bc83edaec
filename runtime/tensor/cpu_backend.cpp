#include "runtime/tensor/cpu_backend.h"

#include <cstdlib>
#include <cstring>
#include <new>

namespace pf::tensor {
namespace {

constexpr std::size_t kAlignment = 64;  // one cache line; enough for AVX-512 loads

class CpuStream final : public Stream {
 public:
  void synchronize() override {}
  void wait(const Event& /*event*/) override {}
};

class CpuEvent final : public Event {
 public:
  void record(Stream& /*stream*/) override {}
  void synchronize() const override {}
  bool completed() const override { return true; }
};

}  // namespace

std::string to_string(const Device& device) {
  return device.kind == DeviceKind::kCpu ? std::string("cpu")
                                         : "cuda:" + std::to_string(device.index);
}

void* CpuBackend::allocate(std::size_t bytes) {
  const std::size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* pointer = std::aligned_alloc(kAlignment, rounded == 0 ? kAlignment : rounded);
  if (pointer == nullptr) throw std::bad_alloc();
  allocations_.fetch_add(1, std::memory_order_relaxed);
  const auto in_use =
      bytes_in_use_.fetch_add(static_cast<std::int64_t>(bytes), std::memory_order_relaxed) +
      static_cast<std::int64_t>(bytes);
  std::int64_t peak = peak_bytes_.load(std::memory_order_relaxed);
  while (in_use > peak && !peak_bytes_.compare_exchange_weak(peak, in_use)) {
  }
  return pointer;
}

void CpuBackend::deallocate(void* pointer, std::size_t bytes) noexcept {
  if (pointer == nullptr) return;
  std::free(pointer);
  bytes_in_use_.fetch_sub(static_cast<std::int64_t>(bytes), std::memory_order_relaxed);
}

void CpuBackend::copy(void* destination, const void* source, std::size_t bytes, CopyKind /*kind*/,
                      Stream* /*stream*/) {
  if (bytes > 0) std::memmove(destination, source, bytes);
}

void CpuBackend::fill_zero(void* destination, std::size_t bytes, Stream* /*stream*/) {
  if (bytes > 0) std::memset(destination, 0, bytes);
}

std::unique_ptr<Stream> CpuBackend::create_stream() {
  return std::make_unique<CpuStream>();
}
std::unique_ptr<Event> CpuBackend::create_event() {
  return std::make_unique<CpuEvent>();
}

AllocationStats CpuBackend::stats() const {
  return {allocations_.load(), bytes_in_use_.load(), peak_bytes_.load()};
}

}  // namespace pf::tensor
