#pragma once
// A bump allocator for activations: allocate() hands out aligned slices of a block, reset()
// takes them all back at once. If a cycle needed more than one block, reset() replaces the
// blocks by a single block large enough for that cycle's peak, so after the first (warm-up)
// cycle a cycle of the same shape allocates nothing from the backend.
#include <cstddef>
#include <memory>
#include <vector>

#include "runtime/tensor/tensor.h"

namespace pf::tensor {

class Arena {
 public:
  explicit Arena(Backend& backend, std::size_t initial_bytes = 0);
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  Arena(Arena&&) = default;
  Arena& operator=(Arena&&) = default;

  void* allocate_bytes(std::size_t bytes);
  // A view of fresh (uninitialised) memory; valid until reset().
  Tensor allocate(Shape shape, DType dtype);
  template <typename T>
  T* allocate_array(std::int64_t count) {
    return static_cast<T*>(allocate_bytes(static_cast<std::size_t>(count) * sizeof(T)));
  }
  void reset();

  std::size_t bytes_used() const { return used_total_; }
  std::size_t capacity() const;
  Backend& backend() const { return *backend_; }

 private:
  Backend* backend_;
  std::vector<Buffer> blocks_;
  std::size_t current_ = 0;     // index of the block being filled
  std::size_t offset_ = 0;      // bytes used in that block
  std::size_t used_total_ = 0;  // bytes handed out this cycle (with alignment padding)
};

// Arenas for in-flight micro-batches: acquire one per forward, release it after the backward.
// Released arenas keep their memory and are handed out again, so the steady state allocates
// nothing.
class ArenaPool {
 public:
  explicit ArenaPool(Backend& backend) : backend_(&backend) {}
  std::unique_ptr<Arena> acquire();
  void release(std::unique_ptr<Arena> arena);
  std::size_t idle() const { return free_.size(); }
  // Bytes the idle arenas hold from the backend (Arena::capacity summed).
  std::size_t idle_capacity() const;

 private:
  Backend* backend_;
  std::vector<std::unique_ptr<Arena>> free_;
};

}  // namespace pf::tensor
