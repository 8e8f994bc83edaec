#pragma once
// A tensor: shape, strides (in elements), dtype and device over memory that it either owns
// (shared ownership of a Buffer: copies of a Tensor are views of the same storage) or merely
// views (memory owned elsewhere, e.g. an Arena or a caller's array).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/tensor/backend.h"
#include "runtime/tensor/buffer.h"
#include "runtime/tensor/dtype.h"

namespace pf::tensor {

using Shape = std::vector<std::int64_t>;
std::string shape_to_string(const Shape& shape);
// Product of the dimensions; throws std::invalid_argument on a negative dimension.
std::int64_t numel_of(const Shape& shape);
Shape contiguous_strides(const Shape& shape);

class Tensor {
 public:
  Tensor() = default;

  // Owning: a fresh allocation on `backend` (contents undefined / zeroed).
  static Tensor empty(Backend& backend, Shape shape, DType dtype);
  static Tensor zeros(Backend& backend, Shape shape, DType dtype);
  // Non-owning view of contiguous memory that outlives the tensor.
  static Tensor view(void* data, Shape shape, DType dtype, Device device = {});

  template <typename T>
  T* data() const {
    if (dtype_ != dtype_of<T>) {
      throw std::invalid_argument("tensor holds " + std::string(to_string(dtype_)) +
                                  ", accessed as " + std::string(to_string(dtype_of<T>)));
    }
    return static_cast<T*>(data_);
  }
  void* raw_data() const { return data_; }

  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  std::int64_t dim() const { return static_cast<std::int64_t>(shape_.size()); }
  std::int64_t size(std::int64_t axis) const;
  std::int64_t numel() const { return numel_; }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel_) * element_size(dtype_); }
  bool defined() const { return data_ != nullptr || numel_ == 0; }
  bool is_contiguous() const { return strides_ == contiguous_strides(shape_); }
  bool owns_memory() const { return storage_ != nullptr; }
  // Owning, and no other tensor (copy, reshape, slice) shares its memory.
  bool sole_owner() const { return storage_ != nullptr && storage_.use_count() == 1; }

  // Same memory, another shape with the same element count (contiguous tensors only).
  Tensor reshape(Shape shape) const;
  // Rows [begin, end) of the first axis; shares memory.
  Tensor slice_rows(std::int64_t begin, std::int64_t end) const;

 private:
  std::shared_ptr<Buffer> storage_;
  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  Device device_{};
  Shape shape_;
  Shape strides_;
  std::int64_t numel_ = 0;
};

}  // namespace pf::tensor
