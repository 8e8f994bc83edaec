#include "runtime/tensor/arena.h"

#include <algorithm>

namespace pf::tensor {
namespace {
constexpr std::size_t kAlignment = 64;
constexpr std::size_t kMinBlock = std::size_t{1} << 20;
std::size_t align_up(std::size_t bytes) {
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}
}  // namespace

Arena::Arena(Backend& backend, std::size_t initial_bytes) : backend_(&backend) {
  if (initial_bytes > 0) blocks_.emplace_back(backend, align_up(initial_bytes));
}

std::size_t Arena::capacity() const {
  std::size_t total = 0;
  for (const auto& block : blocks_) total += block.bytes();
  return total;
}

void* Arena::allocate_bytes(std::size_t bytes) {
  const std::size_t size = align_up(std::max<std::size_t>(bytes, 1));
  while (current_ < blocks_.size() && offset_ + size > blocks_[current_].bytes()) {
    ++current_;
    offset_ = 0;
  }
  if (current_ == blocks_.size()) {
    // Only what this allocation needs (small ones share a kMinBlock): reset() merges the cycle's
    // blocks into one of the cycle's size, so doubling here would only inflate the warm-up peak.
    blocks_.emplace_back(*backend_, std::max(size, kMinBlock));
    offset_ = 0;
  }
  void* pointer = static_cast<std::byte*>(blocks_[current_].data()) + offset_;
  offset_ += size;
  used_total_ += size;
  return pointer;
}

Tensor Arena::allocate(Shape shape, DType dtype) {
  const auto count = numel_of(shape);
  void* pointer = allocate_bytes(static_cast<std::size_t>(count) * element_size(dtype));
  return Tensor::view(pointer, std::move(shape), dtype, backend_->device());
}

void Arena::reset() {
  if (blocks_.size() > 1) {
    // One block of exactly what this cycle handed out (its allocations, aligned, back to back)
    // holds the same sequence again, without the space lost at the ends of the blocks. It is at
    // least the first block: the cycle overflowed it.
    const std::size_t total = used_total_;
    blocks_.clear();
    blocks_.emplace_back(*backend_, total);
  }
  current_ = 0;
  offset_ = 0;
  used_total_ = 0;
}

std::unique_ptr<Arena> ArenaPool::acquire() {
  if (free_.empty()) return std::make_unique<Arena>(*backend_);
  auto arena = std::move(free_.back());
  free_.pop_back();
  return arena;
}

std::size_t ArenaPool::idle_capacity() const {
  std::size_t total = 0;
  for (const auto& arena : free_) total += arena->capacity();
  return total;
}

void ArenaPool::release(std::unique_ptr<Arena> arena) {
  arena->reset();
  free_.push_back(std::move(arena));
}

}  // namespace pf::tensor
