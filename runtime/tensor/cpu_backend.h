#pragma once
// The CPU backend: host memory, synchronous copies; streams and events exist but do nothing,
// because every call has finished when it returns.
#include <atomic>

#include "runtime/tensor/backend.h"

namespace pf::tensor {

class CpuBackend final : public Backend {
 public:
  Device device() const override { return {DeviceKind::kCpu, 0}; }
  void* allocate(std::size_t bytes) override;
  void deallocate(void* pointer, std::size_t bytes) noexcept override;
  void copy(void* destination, const void* source, std::size_t bytes, CopyKind kind,
            Stream* stream = nullptr) override;
  void fill_zero(void* destination, std::size_t bytes, Stream* stream = nullptr) override;
  std::unique_ptr<Stream> create_stream() override;
  std::unique_ptr<Event> create_event() override;
  void synchronize() override {}
  AllocationStats stats() const override;

 private:
  std::atomic<std::int64_t> allocations_{0};
  std::atomic<std::int64_t> bytes_in_use_{0};
  std::atomic<std::int64_t> peak_bytes_{0};
};

}  // namespace pf::tensor
