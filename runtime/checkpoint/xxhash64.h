#pragma once
// XXH64, the 64-bit xxHash of Yann Collet's published specification: fast (several GB/s) and
// good enough to notice any corrupted byte in a checkpoint file. Same results as the reference
// library (and `xxhsum -H64`, Python's xxhash.xxh64), so files can be checked outside this project.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace pf::ckpt {

std::uint64_t xxhash64(std::span<const std::byte> bytes, std::uint64_t seed = 0);
// 16 lowercase hexadecimal digits, as xxhsum prints it.
std::string to_hex64(std::uint64_t value);

}  // namespace pf::ckpt
