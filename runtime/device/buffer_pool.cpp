#include "runtime/device/buffer_pool.h"

#include <algorithm>

namespace pf::device {

tensor::Tensor BufferPool::acquire(tensor::Shape shape, tensor::DType dtype) {
  return take(std::move(shape), dtype, nullptr);
}

tensor::Tensor BufferPool::acquire(tensor::Shape shape, tensor::DType dtype, tensor::Stream& user) {
  return take(std::move(shape), dtype, &user);
}

tensor::Tensor BufferPool::take(tensor::Shape shape, tensor::DType dtype, tensor::Stream* user) {
  const std::int64_t count = tensor::numel_of(shape);
  auto& use = use_[{dtype, count}];
  use.peak = std::max(use.peak, ++use.out);
  auto pending = free_.end();  // the first released of those still in use on the device
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->buffer.dtype() != dtype || it->buffer.numel() != count) continue;
    if (!it->last_use->completed()) {
      if (pending == free_.end()) pending = it;
      continue;
    }
    pending = it;
    break;
  }
  if (pending != free_.end() && (user != nullptr || pending->last_use->completed())) {
    if (user != nullptr) user->wait(*pending->last_use);  // completed: returns at once
    tensor::Tensor buffer = pending->buffer.reshape(std::move(shape));
    free_.erase(pending);
    ++reused_;
    return buffer;
  }
  ++allocated_;
  return tensor::Tensor::empty(*backend_, std::move(shape), dtype);
}

void BufferPool::release(tensor::Tensor buffer, tensor::Stream& last_use) {
  if (buffer.numel() == 0 || !buffer.owns_memory()) return;
  if (const auto it = use_.find({buffer.dtype(), buffer.numel()}); it != use_.end()) {
    it->second.out = std::max<std::int64_t>(0, it->second.out - 1);
  }
  Entry entry{std::move(buffer), backend_->create_event()};
  entry.last_use->record(last_use);
  free_.push_back(std::move(entry));
}

void BufferPool::trim_to_peak_use() {
  std::map<Key, std::int64_t> kept;
  std::erase_if(free_, [&](const Entry& entry) {
    const Key key{entry.buffer.dtype(), entry.buffer.numel()};
    const auto it = use_.find(key);
    const std::int64_t keep = it == use_.end() ? 0 : it->second.peak;
    return ++kept[key] > keep;
  });
  for (auto& [key, use] : use_) use.peak = use.out;
}

std::size_t BufferPool::free_bytes() const {
  std::size_t bytes = 0;
  for (const auto& entry : free_) bytes += entry.buffer.nbytes();
  return bytes;
}

}  // namespace pf::device
