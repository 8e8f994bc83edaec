#include "runtime/data/python_random.h"

#include <bit>
#include <stdexcept>

namespace pf::data {

PythonRandom::PythonRandom(std::uint64_t seed) {
  // random.seed(int): the key is the seed's 32-bit words, least significant first.
  std::vector<std::uint32_t> key;
  do {
    key.push_back(static_cast<std::uint32_t>(seed & 0xffffffffU));
    seed >>= 32;
  } while (seed != 0);

  state_[0] = 19650218U;
  for (std::size_t i = 1; i < kStateSize; ++i) {
    state_[i] =
        1812433253U * (state_[i - 1] ^ (state_[i - 1] >> 30)) + static_cast<std::uint32_t>(i);
  }
  std::size_t i = 1;
  std::size_t j = 0;
  for (std::size_t k = std::max(kStateSize, key.size()); k > 0; --k) {
    state_[i] = (state_[i] ^ ((state_[i - 1] ^ (state_[i - 1] >> 30)) * 1664525U)) + key[j] +
                static_cast<std::uint32_t>(j);
    ++i;
    ++j;
    if (i >= kStateSize) {
      state_[0] = state_[kStateSize - 1];
      i = 1;
    }
    if (j >= key.size()) j = 0;
  }
  for (std::size_t k = kStateSize - 1; k > 0; --k) {
    state_[i] = (state_[i] ^ ((state_[i - 1] ^ (state_[i - 1] >> 30)) * 1566083941U)) -
                static_cast<std::uint32_t>(i);
    ++i;
    if (i >= kStateSize) {
      state_[0] = state_[kStateSize - 1];
      i = 1;
    }
  }
  state_[0] = 0x80000000U;
  index_ = kStateSize;
}

void PythonRandom::twist() {
  constexpr std::size_t kShift = 397;
  constexpr std::uint32_t kMatrix = 0x9908b0dfU;
  for (std::size_t k = 0; k < kStateSize; ++k) {
    const std::uint32_t y =
        (state_[k] & 0x80000000U) | (state_[(k + 1) % kStateSize] & 0x7fffffffU);
    state_[k] = state_[(k + kShift) % kStateSize] ^ (y >> 1) ^ ((y & 1U) != 0 ? kMatrix : 0U);
  }
  index_ = 0;
}

std::uint32_t PythonRandom::next_u32() {
  if (index_ >= kStateSize) twist();
  std::uint32_t y = state_[index_++];
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680U;
  y ^= (y << 15) & 0xefc60000U;
  y ^= y >> 18;
  return y;
}

double PythonRandom::random() {
  const std::uint32_t a = next_u32() >> 5;
  const std::uint32_t b = next_u32() >> 6;
  return (a * 67108864.0 + b) * (1.0 / 9007199254740992.0);
}

std::uint64_t PythonRandom::getrandbits(int bits) {
  if (bits < 1 || bits > 64) throw std::invalid_argument("getrandbits: bits must be in [1, 64]");
  if (bits <= 32) return next_u32() >> (32 - bits);
  const std::uint64_t low = next_u32();
  const std::uint64_t high = next_u32() >> (64 - bits);
  return low | (high << 32);
}

std::uint64_t PythonRandom::below(std::uint64_t n) {
  if (n == 0) throw std::invalid_argument("randbelow: n must be positive");
  const int bits = std::bit_width(n);
  std::uint64_t r = getrandbits(bits);
  while (r >= n) r = getrandbits(bits);
  return r;
}

std::int64_t PythonRandom::randint(std::int64_t low, std::int64_t high) {
  if (high < low) throw std::invalid_argument("randint: empty range");
  const auto span = static_cast<std::uint64_t>(high - low) + 1;
  return low + static_cast<std::int64_t>(below(span));
}

}  // namespace pf::data
