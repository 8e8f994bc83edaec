#include "runtime/checkpoint/xxhash64.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

namespace pf::ckpt {
namespace {

std::uint64_t hash_text(const std::string& text, std::uint64_t seed = 0) {
  return xxhash64(std::as_bytes(std::span<const char>(text.data(), text.size())), seed);
}

// Expected values from the reference library (libxxhash 0.8.1, XXH64) on this machine; the
// inputs cover every tail path (0, 1, 3 bytes, under and over one 32-byte stripe).
TEST(XxHash64, MatchesTheReferenceLibrary) {
  EXPECT_EQ(hash_text(""), 0xef46db3751d8e999ULL);
  EXPECT_EQ(hash_text("a"), 0xd24ec4f1a98c6e5bULL);
  EXPECT_EQ(hash_text("abc"), 0x44bc2cf5ad770999ULL);
  const std::string alnum = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
  EXPECT_EQ(hash_text(alnum), 0x7639d419de614eedULL);
  std::string long_input;
  for (int repeat = 0; repeat < 4; ++repeat) {
    for (int i = 0; i < 256; ++i) long_input.push_back(static_cast<char>(i));
  }
  long_input += "xyz";
  EXPECT_EQ(hash_text(long_input), 0xe146cb31b65bc21aULL);
}

TEST(XxHash64, SeedChangesTheHash) {
  EXPECT_EQ(hash_text("", 12345), 0x95584af7701f808dULL);
  EXPECT_EQ(hash_text("a", 12345), 0x747b860523d69ab6ULL);
  EXPECT_EQ(hash_text("abc", 12345), 0x01700e64f6f23509ULL);
}

TEST(XxHash64, EverySingleBitFlipChangesTheHash) {
  std::vector<std::byte> bytes(100);
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>(i * 7);
  const auto original = xxhash64(bytes);
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      bytes[i] ^= static_cast<std::byte>(1 << bit);
      EXPECT_NE(xxhash64(bytes), original) << "byte " << i << " bit " << bit;
      bytes[i] ^= static_cast<std::byte>(1 << bit);
    }
  }
}

TEST(XxHash64, HexIsSixteenLowercaseDigits) {
  EXPECT_EQ(to_hex64(0), "0000000000000000");
  EXPECT_EQ(to_hex64(0xef46db3751d8e999ULL), "ef46db3751d8e999");
}

}  // namespace
}  // namespace pf::ckpt
