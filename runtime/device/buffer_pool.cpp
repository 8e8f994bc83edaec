#include "runtime/device/buffer_pool.h"

namespace pf::device {

tensor::Tensor BufferPool::acquire(tensor::Shape shape, tensor::DType dtype) {
  const std::int64_t count = tensor::numel_of(shape);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->buffer.dtype() != dtype || it->buffer.numel() != count) continue;
    if (!it->last_use->completed()) continue;
    tensor::Tensor buffer = it->buffer.reshape(std::move(shape));
    free_.erase(it);
    ++reused_;
    return buffer;
  }
  return tensor::Tensor::empty(*backend_, std::move(shape), dtype);
}

void BufferPool::release(tensor::Tensor buffer, tensor::Stream& last_use) {
  if (buffer.numel() == 0 || !buffer.owns_memory()) return;
  Entry entry{std::move(buffer), backend_->create_event()};
  entry.last_use->record(last_use);
  free_.push_back(std::move(entry));
}

std::size_t BufferPool::free_bytes() const {
  std::size_t bytes = 0;
  for (const auto& entry : free_) bytes += entry.buffer.nbytes();
  return bytes;
}

}  // namespace pf::device
