#pragma once
// Element types a tensor can store. fp32 is what the model computes in today; f64 serves the
// double-precision reference paths of the tests; bf16/fp16 storage is reserved for the GPU path.
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace pf::tensor {

enum class DType : std::uint8_t { kF32, kF64, kF16, kBF16, kI32, kI64 };

constexpr std::size_t element_size(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF64:
    case DType::kI64:
      return 8;
    case DType::kF16:
    case DType::kBF16:
      return 2;
  }
  return 0;
}

constexpr std::string_view to_string(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kF64:
      return "f64";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kI32:
      return "i32";
    case DType::kI64:
      return "i64";
  }
  return "?";
}

// The DType that stores a C++ scalar type (only the types we compute in).
template <typename T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::kF32;
};
template <>
struct DTypeOf<double> {
  static constexpr DType value = DType::kF64;
};
template <>
struct DTypeOf<std::int32_t> {
  static constexpr DType value = DType::kI32;
};
template <>
struct DTypeOf<std::int64_t> {
  static constexpr DType value = DType::kI64;
};
template <typename T>
inline constexpr DType dtype_of = DTypeOf<T>::value;

}  // namespace pf::tensor
