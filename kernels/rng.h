#pragma once
// Counter-based random numbers: the value at (seed, index) is a pure function of the two, so a
// dropout mask is the same on every backend, every thread count and every chunking of the model,
// and the backward pass regenerates the mask instead of storing it. The mixer is SplitMix64's
// finaliser (Steele, Lea, Flood 2014) applied to seed and index; plain 64-bit integer arithmetic,
// so the CUDA kernels include this header unchanged.
#include <cstdint>

#if defined(__CUDACC__)
#define PF_HOST_DEVICE __host__ __device__
#else
#define PF_HOST_DEVICE
#endif

namespace pf::kernels {

PF_HOST_DEVICE inline std::uint64_t mix64(std::uint64_t value) {
  value += 0x9E3779B97F4A7C15ULL;
  value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9ULL;
  value = (value ^ (value >> 27)) * 0x94D049BB133111EBULL;
  return value ^ (value >> 31);
}

// 32 uniformly distributed bits for element `index` of the stream `seed`. Loops hoist
// stream_key(seed) and call bits_for_key (which vectorises).
PF_HOST_DEVICE inline std::uint64_t stream_key(std::uint64_t seed) {
  return mix64(seed);
}
PF_HOST_DEVICE inline std::uint32_t bits_for_key(std::uint64_t key, std::uint64_t index) {
  return static_cast<std::uint32_t>(mix64(key ^ index) >> 32);
}
PF_HOST_DEVICE inline std::uint32_t random_bits(std::uint64_t seed, std::uint64_t index) {
  return bits_for_key(stream_key(seed), index);
}

// A derived seed for a sub-stream (a dropout site, a layer): independent of the parent stream.
PF_HOST_DEVICE inline std::uint64_t derive_seed(std::uint64_t seed, std::uint64_t salt) {
  return mix64(seed ^ mix64(salt + 0x632BE59BD9B4E019ULL));
}

// Dropout keeps element `index` when its bits reach the threshold: P(drop) = threshold / 2^32.
PF_HOST_DEVICE inline std::uint32_t dropout_threshold(float probability) {
  return static_cast<std::uint32_t>(static_cast<double>(probability) * 4294967296.0);
}
PF_HOST_DEVICE inline bool dropout_keep(std::uint64_t seed, std::uint64_t index,
                                        std::uint32_t threshold) {
  return random_bits(seed, index) >= threshold;
}

}  // namespace pf::kernels
