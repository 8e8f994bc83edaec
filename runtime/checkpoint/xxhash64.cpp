#include "runtime/checkpoint/xxhash64.h"

#include <bit>
#include <cstring>

namespace pf::ckpt {

static_assert(std::endian::native == std::endian::little,
              "XXH64 reads little-endian lanes; this implementation loads them as they are");

namespace {

constexpr std::uint64_t kPrime1 = 0x9E3779B185EBCA87ULL;
constexpr std::uint64_t kPrime2 = 0xC2B2AE3D27D4EB4FULL;
constexpr std::uint64_t kPrime3 = 0x165667B19E3779F9ULL;
constexpr std::uint64_t kPrime4 = 0x85EBCA77C2B2AE63ULL;
constexpr std::uint64_t kPrime5 = 0x27D4EB2F165667C5ULL;

std::uint64_t load64(const std::byte* p) {
  std::uint64_t value = 0;
  std::memcpy(&value, p, sizeof(value));
  return value;
}

std::uint32_t load32(const std::byte* p) {
  std::uint32_t value = 0;
  std::memcpy(&value, p, sizeof(value));
  return value;
}

std::uint64_t round(std::uint64_t accumulator, std::uint64_t lane) {
  accumulator += lane * kPrime2;
  return std::rotl(accumulator, 31) * kPrime1;
}

std::uint64_t merge(std::uint64_t accumulator, std::uint64_t lane_accumulator) {
  accumulator ^= round(0, lane_accumulator);
  return accumulator * kPrime1 + kPrime4;
}

}  // namespace

std::uint64_t xxhash64(std::span<const std::byte> bytes, std::uint64_t seed) {
  const std::byte* p = bytes.data();
  const std::byte* const end = p + bytes.size();
  std::uint64_t hash = 0;
  if (bytes.size() >= 32) {
    // Four independent lanes over 32-byte stripes: what makes the hash fast.
    std::uint64_t v1 = seed + kPrime1 + kPrime2;
    std::uint64_t v2 = seed + kPrime2;
    std::uint64_t v3 = seed;
    std::uint64_t v4 = seed - kPrime1;
    const std::byte* const last_stripe = end - 32;
    do {
      v1 = round(v1, load64(p));
      v2 = round(v2, load64(p + 8));
      v3 = round(v3, load64(p + 16));
      v4 = round(v4, load64(p + 24));
      p += 32;
    } while (p <= last_stripe);
    hash = std::rotl(v1, 1) + std::rotl(v2, 7) + std::rotl(v3, 12) + std::rotl(v4, 18);
    hash = merge(hash, v1);
    hash = merge(hash, v2);
    hash = merge(hash, v3);
    hash = merge(hash, v4);
  } else {
    hash = seed + kPrime5;
  }
  hash += static_cast<std::uint64_t>(bytes.size());
  for (; end - p >= 8; p += 8) {
    hash ^= round(0, load64(p));
    hash = std::rotl(hash, 27) * kPrime1 + kPrime4;
  }
  if (end - p >= 4) {
    hash ^= static_cast<std::uint64_t>(load32(p)) * kPrime1;
    hash = std::rotl(hash, 23) * kPrime2 + kPrime3;
    p += 4;
  }
  for (; p < end; ++p) {
    hash ^= static_cast<std::uint64_t>(std::to_integer<std::uint8_t>(*p)) * kPrime5;
    hash = std::rotl(hash, 11) * kPrime1;
  }
  // Avalanche: every input bit affects every output bit.
  hash ^= hash >> 33;
  hash *= kPrime2;
  hash ^= hash >> 29;
  hash *= kPrime3;
  hash ^= hash >> 32;
  return hash;
}

std::string to_hex64(std::uint64_t value) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string text(16, '0');
  for (int i = 15; i >= 0; --i) {
    text[static_cast<std::size_t>(i)] = kDigits[value & 0xF];
    value >>= 4;
  }
  return text;
}

}  // namespace pf::ckpt
