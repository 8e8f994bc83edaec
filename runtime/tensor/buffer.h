#pragma once
// One RAII allocation on a backend: freed when the Buffer goes away. Move-only.
#include <cstddef>
#include <utility>

#include "runtime/tensor/backend.h"

namespace pf::tensor {

class Buffer {
 public:
  Buffer() = default;
  Buffer(Backend& backend, std::size_t bytes)
      : backend_(&backend), data_(backend.allocate(bytes)), bytes_(bytes) {}
  ~Buffer() { release(); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& other) noexcept
      : backend_(other.backend_),
        data_(std::exchange(other.data_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)) {}
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      release();
      backend_ = other.backend_;
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  Backend* backend() const { return backend_; }

 private:
  void release() noexcept {
    if (data_ != nullptr) backend_->deallocate(data_, bytes_);
    data_ = nullptr;
    bytes_ = 0;
  }
  Backend* backend_ = nullptr;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace pf::tensor
