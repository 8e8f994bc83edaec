// Binary shards of pretraining instances: a versioned 64-byte header (with the vocabulary's
// hash and a checksum of the records) followed by fixed-size records, so that instance i is
// found at a computed offset (random access for shuffling and resuming).
//
// Header, little-endian:  magic "PFBERTSH" | u32 version | u32 header bytes (64) |
//   u64 vocabulary hash | u32 vocabulary size | u32 max_seq_length | u32 max_predictions |
//   u32 record bytes | u64 instances | u64 FNV-1a-64 of all records | u64 FNV-1a-64 of the
//   preceding 56 header bytes.
// Record: u16 length | u16 segment A length (type-0 tokens) | u8 NSP label (1 = random) |
//   u8 masked count | u16 zero | u32 ids[max_seq_length] | u16 positions[max_predictions] |
//   u32 labels[max_predictions]; unused slots are zero.
#pragma once

#include <cstdint>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "runtime/data/training_instance.h"

namespace pf::data {

struct ShardInfo {
  static constexpr std::uint32_t kVersion = 1;
  static constexpr std::size_t kHeaderBytes = 64;

  std::uint32_t version = kVersion;
  std::uint64_t vocab_hash = 0;
  std::uint32_t vocab_size = 0;
  std::uint32_t max_seq_length = 0;
  std::uint32_t max_predictions = 0;
  std::uint64_t num_instances = 0;
  std::uint64_t payload_checksum = 0;

  std::size_t record_bytes() const {
    return 8 + 4 * std::size_t{max_seq_length} + 6 * std::size_t{max_predictions};
  }
};

// Writes `instances` as one shard (to path + ".tmp", then renamed). Throws
// std::invalid_argument if an instance does not fit the limits in `info`.
void write_shard(const std::string& path, ShardInfo info,
                 const std::vector<TrainingInstance>& instances);

class ShardReader {
 public:
  // Opens and checks a shard: magic, version, header checksum, size against the header
  // (truncation), the vocabulary hash when `expected_vocab_hash` is given, and, when
  // `verify_checksum`, the checksum of all records. Throws std::runtime_error naming the file
  // and what is wrong.
  explicit ShardReader(const std::string& path,
                       std::optional<std::uint64_t> expected_vocab_hash = std::nullopt,
                       bool verify_checksum = true);

  const ShardInfo& info() const { return info_; }
  std::size_t size() const { return static_cast<std::size_t>(info_.num_instances); }
  const std::string& path() const { return path_; }
  // Reads record `index`; validates its fields (std::runtime_error on a corrupted record).
  void read(std::size_t index, TrainingInstance& out);

  // Reads just the header (for listing shards).
  static ShardInfo read_header(const std::string& path);

 private:
  std::string path_;
  ShardInfo info_;
  std::ifstream file_;
  std::vector<char> record_;
};

}  // namespace pf::data
