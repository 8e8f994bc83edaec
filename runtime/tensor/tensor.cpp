#include "runtime/tensor/tensor.h"

namespace pf::tensor {

std::string shape_to_string(const Shape& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    text += (i ? ", " : "") + std::to_string(shape[i]);
  }
  return text + "]";
}

std::int64_t numel_of(const Shape& shape) {
  std::int64_t count = 1;
  for (auto extent : shape) {
    if (extent < 0)
      throw std::invalid_argument("negative dimension in shape " + shape_to_string(shape));
    count *= extent;
  }
  return count;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size(), 1);
  for (std::size_t i = shape.size(); i-- > 1;) strides[i - 1] = strides[i] * shape[i];
  return strides;
}

Tensor Tensor::empty(Backend& backend, Shape shape, DType dtype) {
  Tensor tensor;
  tensor.numel_ = numel_of(shape);
  tensor.storage_ = std::make_shared<Buffer>(
      backend, static_cast<std::size_t>(tensor.numel_) * element_size(dtype));
  tensor.data_ = tensor.storage_->data();
  tensor.dtype_ = dtype;
  tensor.device_ = backend.device();
  tensor.strides_ = contiguous_strides(shape);
  tensor.shape_ = std::move(shape);
  return tensor;
}

Tensor Tensor::zeros(Backend& backend, Shape shape, DType dtype) {
  Tensor tensor = empty(backend, std::move(shape), dtype);
  backend.fill_zero(tensor.data_, tensor.nbytes());
  return tensor;
}

Tensor Tensor::view(void* data, Shape shape, DType dtype, Device device) {
  Tensor tensor;
  tensor.numel_ = numel_of(shape);
  if (data == nullptr && tensor.numel_ > 0) {
    throw std::invalid_argument("Tensor::view of null memory with shape " + shape_to_string(shape));
  }
  tensor.data_ = data;
  tensor.dtype_ = dtype;
  tensor.device_ = device;
  tensor.strides_ = contiguous_strides(shape);
  tensor.shape_ = std::move(shape);
  return tensor;
}

std::int64_t Tensor::size(std::int64_t axis) const {
  if (axis < 0) axis += dim();
  if (axis < 0 || axis >= dim()) {
    throw std::out_of_range("axis " + std::to_string(axis) + " out of range for shape " +
                            shape_to_string(shape_));
  }
  return shape_[static_cast<std::size_t>(axis)];
}

Tensor Tensor::reshape(Shape shape) const {
  if (!is_contiguous()) throw std::invalid_argument("reshape of a non-contiguous tensor");
  if (numel_of(shape) != numel_) {
    throw std::invalid_argument("cannot reshape " + shape_to_string(shape_) + " to " +
                                shape_to_string(shape));
  }
  Tensor result = *this;
  result.strides_ = contiguous_strides(shape);
  result.shape_ = std::move(shape);
  return result;
}

Tensor Tensor::slice_rows(std::int64_t begin, std::int64_t end) const {
  if (shape_.empty() || begin < 0 || end < begin || end > shape_[0]) {
    throw std::out_of_range("row slice [" + std::to_string(begin) + ", " + std::to_string(end) +
                            ") of shape " + shape_to_string(shape_));
  }
  Tensor result = *this;
  result.shape_[0] = end - begin;
  result.numel_ = numel_of(result.shape_);
  result.data_ = static_cast<std::byte*>(data_) +
                 static_cast<std::size_t>(begin * strides_[0]) * element_size(dtype_);
  return result;
}

}  // namespace pf::tensor
