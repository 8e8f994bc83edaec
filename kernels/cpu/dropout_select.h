#pragma once
// The dropout select `keep ? x : +0` as integer arithmetic on x's bits. Written as a ternary on
// floating-point values, GCC keeps it as control flow (the product feeding it may trap, and
// -ftrapping-math forbids computing it for dropped elements), so the mask loops ran one element
// at a time with a mispredicted branch per dropped element; the bitwise form vectorises (4x
// faster dropout on AVX2, docs/benchmarks.md) and gives the same bits: x where kept, +0 where
// dropped, whatever x is.
#include <bit>
#include <cstdint>
#include <type_traits>

namespace pf::kernels::cpu {

template <typename T>
inline T keep_or_zero(T x, bool keep) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "float or double");
  using Bits = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
  const Bits mask = keep ? ~Bits(0) : Bits(0);
  return std::bit_cast<T>(static_cast<Bits>(std::bit_cast<Bits>(x) & mask));
}

}  // namespace pf::kernels::cpu
