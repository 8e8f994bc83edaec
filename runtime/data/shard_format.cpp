#include "runtime/data/shard_format.h"

#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "common/input_error.h"
#include "runtime/data/vocabulary.h"

namespace pf::data {

static_assert(std::endian::native == std::endian::little, "shards are little-endian");

namespace {

constexpr std::array<char, 8> kMagic = {'P', 'F', 'B', 'E', 'R', 'T', 'S', 'H'};

template <class T>
void put(std::vector<char>& bytes, std::size_t offset, T value) {
  std::memcpy(bytes.data() + offset, &value, sizeof(T));
}

template <class T>
T get(const std::vector<char>& bytes, std::size_t offset) {
  T value{};
  std::memcpy(&value, bytes.data() + offset, sizeof(T));
  return value;
}

std::vector<char> encode_header(const ShardInfo& info) {
  std::vector<char> header(ShardInfo::kHeaderBytes, 0);
  std::memcpy(header.data(), kMagic.data(), kMagic.size());
  put<std::uint32_t>(header, 8, info.version);
  put<std::uint32_t>(header, 12, static_cast<std::uint32_t>(ShardInfo::kHeaderBytes));
  put<std::uint64_t>(header, 16, info.vocab_hash);
  put<std::uint32_t>(header, 24, info.vocab_size);
  put<std::uint32_t>(header, 28, info.max_seq_length);
  put<std::uint32_t>(header, 32, info.max_predictions);
  put<std::uint32_t>(header, 36, static_cast<std::uint32_t>(info.record_bytes()));
  put<std::uint64_t>(header, 40, info.num_instances);
  put<std::uint64_t>(header, 48, info.payload_checksum);
  put<std::uint64_t>(header, 56, fnv1a64(std::string_view(header.data(), 56)));
  return header;
}

ShardInfo decode_header(const std::vector<char>& header, const std::string& path) {
  auto fail = [&](const std::string& what) { throw InputError("shard '" + path + "': " + what); };
  if (std::memcmp(header.data(), kMagic.data(), kMagic.size()) != 0) {
    fail("not a pipefisher shard (bad magic bytes)");
  }
  ShardInfo info;
  info.version = get<std::uint32_t>(header, 8);
  if (info.version != ShardInfo::kVersion) {
    fail("format version " + std::to_string(info.version) + ", this build reads version " +
         std::to_string(ShardInfo::kVersion));
  }
  if (get<std::uint64_t>(header, 56) != fnv1a64(std::string_view(header.data(), 56))) {
    fail("header checksum mismatch (corrupted header)");
  }
  if (get<std::uint32_t>(header, 12) != ShardInfo::kHeaderBytes) fail("unexpected header size");
  info.vocab_hash = get<std::uint64_t>(header, 16);
  info.vocab_size = get<std::uint32_t>(header, 24);
  info.max_seq_length = get<std::uint32_t>(header, 28);
  info.max_predictions = get<std::uint32_t>(header, 32);
  info.num_instances = get<std::uint64_t>(header, 40);
  info.payload_checksum = get<std::uint64_t>(header, 48);
  if (info.max_seq_length < 5 || info.max_seq_length > 65535 || info.max_predictions > 255 ||
      info.max_predictions > info.max_seq_length) {
    fail("implausible limits in header (max_seq_length " + std::to_string(info.max_seq_length) +
         ", max_predictions " + std::to_string(info.max_predictions) + ")");
  }
  if (get<std::uint32_t>(header, 36) != info.record_bytes()) fail("record size mismatch in header");
  return info;
}

void encode_record(const TrainingInstance& instance, const ShardInfo& info,
                   std::vector<char>& out) {
  std::fill(out.begin(), out.end(), char{0});
  put<std::uint16_t>(out, 0, static_cast<std::uint16_t>(instance.tokens.size()));
  put<std::uint16_t>(out, 2, static_cast<std::uint16_t>(instance.segment_a_length));
  put<std::uint8_t>(out, 4, instance.is_random_next ? 1 : 0);
  put<std::uint8_t>(out, 5, static_cast<std::uint8_t>(instance.masked_positions.size()));
  std::size_t offset = 8;
  for (std::size_t i = 0; i < instance.tokens.size(); ++i) {
    put<std::uint32_t>(out, offset + 4 * i, static_cast<std::uint32_t>(instance.tokens[i]));
  }
  offset += 4 * std::size_t{info.max_seq_length};
  for (std::size_t i = 0; i < instance.masked_positions.size(); ++i) {
    put<std::uint16_t>(out, offset + 2 * i,
                       static_cast<std::uint16_t>(instance.masked_positions[i]));
  }
  offset += 2 * std::size_t{info.max_predictions};
  for (std::size_t i = 0; i < instance.masked_labels.size(); ++i) {
    put<std::uint32_t>(out, offset + 4 * i, static_cast<std::uint32_t>(instance.masked_labels[i]));
  }
}

}  // namespace

void write_shard(const std::string& path, ShardInfo info,
                 const std::vector<TrainingInstance>& instances) {
  info.version = ShardInfo::kVersion;
  info.num_instances = instances.size();
  if (info.max_predictions > 255) throw std::invalid_argument("max_predictions must be <= 255");
  std::vector<char> record(info.record_bytes());
  const std::string temporary = path + ".tmp";
  std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
  if (!out) throw InputError("cannot create '" + temporary + "': " + std::strerror(errno));
  out.write(encode_header(info).data(), ShardInfo::kHeaderBytes);  // rewritten below
  std::uint64_t checksum = fnv1a64("");
  for (std::size_t n = 0; n < instances.size(); ++n) {
    const TrainingInstance& instance = instances[n];
    const bool fits = instance.tokens.size() <= info.max_seq_length &&
                      instance.masked_positions.size() <= info.max_predictions &&
                      instance.masked_positions.size() == instance.masked_labels.size() &&
                      instance.segment_a_length <= instance.tokens.size();
    if (!fits) {
      throw std::invalid_argument("instance " + std::to_string(n) + " (" +
                                  std::to_string(instance.tokens.size()) + " tokens, " +
                                  std::to_string(instance.masked_positions.size()) +
                                  " masked) does not fit the shard limits");
    }
    encode_record(instance, info, record);
    checksum = fnv1a64(std::string_view(record.data(), record.size()), checksum);
    out.write(record.data(), static_cast<std::streamsize>(record.size()));
  }
  info.payload_checksum = checksum;
  out.seekp(0);
  out.write(encode_header(info).data(), ShardInfo::kHeaderBytes);
  out.close();
  if (!out) throw InputError("cannot write '" + temporary + "'");
  std::error_code error;
  std::filesystem::rename(temporary, path, error);
  if (error) throw InputError("cannot rename '" + temporary + "': " + error.message());
}

ShardInfo ShardReader::read_header(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError("cannot open shard '" + path + "': " + std::strerror(errno));
  std::vector<char> header(ShardInfo::kHeaderBytes);
  if (!in.read(header.data(), static_cast<std::streamsize>(header.size()))) {
    throw InputError("shard '" + path + "': shorter than its 64-byte header (truncated?)");
  }
  return decode_header(header, path);
}

ShardReader::ShardReader(const std::string& path, std::optional<std::uint64_t> expected_vocab_hash,
                         bool verify_checksum)
    : path_(path), info_(read_header(path)), file_(path, std::ios::binary) {
  if (!file_) throw InputError("cannot open shard '" + path + "'");
  record_.resize(info_.record_bytes());
  const std::uintmax_t actual = std::filesystem::file_size(path);
  // The count comes from the file: compare it with what the file can hold before multiplying,
  // so that 2^58 instances cannot wrap the expected size around to the actual one.
  const std::uintmax_t records_that_fit =
      actual < ShardInfo::kHeaderBytes ? 0 : (actual - ShardInfo::kHeaderBytes) / record_.size();
  if (info_.num_instances > records_that_fit) {
    throw InputError("shard '" + path +
                     "': header field 'num_instances' = " + std::to_string(info_.num_instances) +
                     " but the file's " + std::to_string(actual) + " bytes hold at most " +
                     std::to_string(records_that_fit) + " records of " +
                     std::to_string(record_.size()) + " bytes: truncated or corrupted");
  }
  const std::uintmax_t expected =
      ShardInfo::kHeaderBytes + info_.num_instances * info_.record_bytes();
  if (actual != expected) {
    throw InputError("shard '" + path + "': " + std::to_string(actual) + " bytes, header says " +
                     std::to_string(expected) + " (" + std::to_string(info_.num_instances) +
                     " records): truncated or padded");
  }
  if (expected_vocab_hash && *expected_vocab_hash != info_.vocab_hash) {
    throw InputError("shard '" + path + "' was made with another vocabulary (hash " +
                     std::to_string(info_.vocab_hash) + ", expected " +
                     std::to_string(*expected_vocab_hash) + ")");
  }
  if (verify_checksum) {
    file_.seekg(static_cast<std::streamoff>(ShardInfo::kHeaderBytes));
    std::uint64_t checksum = fnv1a64("");
    std::vector<char> block(1 << 20);
    while (file_) {
      file_.read(block.data(), static_cast<std::streamsize>(block.size()));
      const auto got = static_cast<std::size_t>(file_.gcount());
      checksum = fnv1a64(std::string_view(block.data(), got), checksum);
    }
    file_.clear();
    if (checksum != info_.payload_checksum) {
      throw InputError("shard '" + path + "': record checksum mismatch (corrupted data)");
    }
  }
}

void ShardReader::read(std::size_t index, TrainingInstance& out) {
  if (index >= size()) {
    throw std::out_of_range("shard '" + path_ + "': record " + std::to_string(index) +
                            " out of range (" + std::to_string(size()) + " records)");
  }
  file_.seekg(static_cast<std::streamoff>(ShardInfo::kHeaderBytes + index * record_.size()));
  if (!file_.read(record_.data(), static_cast<std::streamsize>(record_.size()))) {
    file_.clear();
    throw InputError("shard '" + path_ + "': cannot read record " + std::to_string(index));
  }
  auto fail = [&](const std::string& what) {
    throw InputError("shard '" + path_ + "' record " + std::to_string(index) + ": " + what);
  };
  const auto length = get<std::uint16_t>(record_, 0);
  const auto segment_a = get<std::uint16_t>(record_, 2);
  const auto nsp = get<std::uint8_t>(record_, 4);
  const auto masked = get<std::uint8_t>(record_, 5);
  if (length < 3 || length > info_.max_seq_length) fail("bad length " + std::to_string(length));
  if (segment_a < 2 || segment_a >= length)
    fail("bad segment A length " + std::to_string(segment_a));
  if (nsp > 1) fail("bad NSP label " + std::to_string(nsp));
  if (masked > info_.max_predictions) fail("bad masked count " + std::to_string(masked));
  out.tokens.resize(length);
  out.segment_a_length = segment_a;
  out.is_random_next = nsp == 1;
  out.masked_positions.resize(masked);
  out.masked_labels.resize(masked);
  std::size_t offset = 8;
  for (std::size_t i = 0; i < length; ++i) {
    const auto id = get<std::uint32_t>(record_, offset + 4 * i);
    if (id >= info_.vocab_size) fail("token id " + std::to_string(id) + " outside the vocabulary");
    out.tokens[i] = static_cast<TokenId>(id);
  }
  offset += 4 * std::size_t{info_.max_seq_length};
  for (std::size_t i = 0; i < masked; ++i) {
    const auto position = get<std::uint16_t>(record_, offset + 2 * i);
    if (position >= length) fail("masked position " + std::to_string(position) + " past the end");
    out.masked_positions[i] = position;
  }
  offset += 2 * std::size_t{info_.max_predictions};
  for (std::size_t i = 0; i < masked; ++i) {
    const auto id = get<std::uint32_t>(record_, offset + 4 * i);
    if (id >= info_.vocab_size) fail("label id " + std::to_string(id) + " outside the vocabulary");
    out.masked_labels[i] = static_cast<TokenId>(id);
  }
}

}  // namespace pf::data
