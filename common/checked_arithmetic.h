#pragma once
// Overflow-checked integer arithmetic for sizes and offsets computed from untrusted input: the
// result, or std::nullopt where the exact result does not fit T (never a wrapped value, never
// signed-overflow undefined behaviour).
#include <concepts>
#include <optional>

namespace pf {

template <std::integral T>
std::optional<T> checked_add(T a, T b) {
  T result{};
  if (__builtin_add_overflow(a, b, &result)) return std::nullopt;
  return result;
}

template <std::integral T>
std::optional<T> checked_mul(T a, T b) {
  T result{};
  if (__builtin_mul_overflow(a, b, &result)) return std::nullopt;
  return result;
}

}  // namespace pf
