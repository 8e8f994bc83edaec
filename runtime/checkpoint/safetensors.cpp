#include "runtime/checkpoint/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>
#include <system_error>

#include "common/input_error.h"
#include "common/json_fields.h"

namespace pf::ckpt {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; this reader copies bytes as they are");

namespace {

// Guards against a corrupt size field asking for an absurd allocation (the Rust reader uses the
// same 100 MB bound).
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;
constexpr std::string_view kMetadataKey = "__metadata__";

struct HeaderEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

struct ParsedHeader {
  std::vector<HeaderEntry> entries;  // sorted by begin offset
  std::map<std::string, std::string> metadata;
};

[[noreturn]] void fail(std::string_view source, const std::string& what) {
  throw InputError("safetensors '" + std::string(source) + "': " + what);
}

std::uint64_t read_le_u64(const std::byte* bytes) {
  std::uint64_t value = 0;
  std::memcpy(&value, bytes, sizeof(value));
  return value;
}

ParsedHeader parse_header(std::string_view header_text, std::uint64_t data_bytes,
                          std::string_view source) {
  const auto first = header_text.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos || header_text[first] != '{') {
    fail(source, "header is not a JSON object");
  }
  nlohmann::json header;
  try {
    header = json_fields::parse_bounded(header_text, source);
  } catch (const nlohmann::json::exception& error) {
    fail(source, std::string("header is not valid JSON: ") + error.what());
  }
  if (!header.is_object()) fail(source, "header is not a JSON object");

  ParsedHeader parsed;
  for (const auto& [key, value] : header.items()) {
    if (key == kMetadataKey) {
      if (!value.is_object()) fail(source, "__metadata__ is not an object");
      for (const auto& [meta_key, meta_value] : value.items()) {
        if (!meta_value.is_string()) {
          fail(source, "__metadata__ value of '" + meta_key + "' is not a string");
        }
        parsed.metadata[meta_key] = meta_value.get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor '" + key + "': ";
    if (!value.is_object()) fail(source, where + "entry is not an object");
    if (!value.contains("dtype") || !value["dtype"].is_string()) {
      fail(source, where + "missing string field 'dtype'");
    }
    if (!value.contains("shape") || !value["shape"].is_array()) {
      fail(source, where + "missing array field 'shape'");
    }
    if (!value.contains("data_offsets") || !value["data_offsets"].is_array() ||
        value["data_offsets"].size() != 2) {
      fail(source, where + "missing field 'data_offsets' = [begin, end]");
    }
    HeaderEntry entry;
    entry.name = key;
    try {
      entry.dtype = dtype_from_string(value["dtype"].get<std::string>());
    } catch (const std::invalid_argument& error) {
      fail(source, where + error.what());
    }
    for (const auto& dim : value["shape"]) {
      if (!dim.is_number_integer() || dim.get<std::int64_t>() < 0) {
        fail(source, where + "shape entry " + dim.dump() + " is not a non-negative integer");
      }
      entry.shape.push_back(dim.get<std::int64_t>());
    }
    const auto& offsets = value["data_offsets"];
    for (const auto& offset : offsets) {
      if (!offset.is_number_unsigned()) {
        fail(source,
             where + "data_offsets entry " + offset.dump() + " is not a non-negative integer");
      }
    }
    entry.begin = offsets[0].get<std::uint64_t>();
    entry.end = offsets[1].get<std::uint64_t>();
    if (entry.end < entry.begin) {
      fail(source, where + "data_offsets [" + std::to_string(entry.begin) + ", " +
                       std::to_string(entry.end) + "] end before begin");
    }
    if (entry.end > data_bytes) {
      fail(source, where + "data_offsets end " + std::to_string(entry.end) +
                       " is beyond the data section of " + std::to_string(data_bytes) + " bytes");
    }
    std::int64_t count = 0;
    try {
      count = element_count(entry.shape);
    } catch (const std::invalid_argument& error) {
      fail(source, where + error.what());
    }
    const auto expected = static_cast<std::uint64_t>(count) * element_size(entry.dtype);
    if (entry.end - entry.begin != expected) {
      fail(source, where + "holds " + std::to_string(entry.end - entry.begin) +
                       " bytes but dtype " + std::string(to_string(entry.dtype)) + " and shape " +
                       shape_to_string(entry.shape) + " need " + std::to_string(expected));
    }
    parsed.entries.push_back(std::move(entry));
  }
  std::sort(parsed.entries.begin(), parsed.entries.end(),
            [](const HeaderEntry& a, const HeaderEntry& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  // The format requires the data section to be covered exactly, without overlaps or holes.
  std::uint64_t covered = 0;
  const HeaderEntry* previous = nullptr;
  for (const auto& entry : parsed.entries) {
    if (entry.begin < covered) {
      fail(source, "tensor '" + entry.name + "': data_offsets [" + std::to_string(entry.begin) +
                       ", " + std::to_string(entry.end) + "] overlap tensor '" +
                       (previous ? previous->name : std::string()) + "'");
    }
    if (entry.begin > covered) {
      fail(source, "tensor '" + entry.name + "': data_offsets begin " +
                       std::to_string(entry.begin) + " leaves a hole after byte " +
                       std::to_string(covered));
    }
    covered = entry.end;
    previous = &entry;
  }
  if (covered != data_bytes) {
    fail(source, "data section has " + std::to_string(data_bytes) +
                     " bytes but the tensors cover " + std::to_string(covered));
  }
  return parsed;
}

void validate_record(const TensorRecord& record) {
  if (record.name.empty()) throw std::invalid_argument("safetensors: tensor with an empty name");
  if (record.name == kMetadataKey) {
    throw std::invalid_argument("safetensors: '__metadata__' is reserved, not a tensor name");
  }
  const auto count = element_count(record.shape);
  const auto expected = static_cast<std::uint64_t>(count) * element_size(record.dtype);
  if (record.data.size() != expected) {
    throw std::invalid_argument(
        "safetensors: tensor '" + record.name + "' has " + std::to_string(record.data.size()) +
        " bytes but dtype " + std::string(to_string(record.dtype)) + " and shape " +
        shape_to_string(record.shape) + " need " + std::to_string(expected));
  }
}

std::string describe(const SafetensorsFile& file) {
  return file.source.empty() ? std::string("safetensors") : "safetensors '" + file.source + "'";
}

const TensorRecord& find_tensor(const SafetensorsFile& file, std::string_view name,
                                std::span<const std::int64_t> expected_shape) {
  const auto it = file.tensors.find(std::string(name));
  if (it == file.tensors.end()) {
    throw InputError(describe(file) + ": tensor '" + std::string(name) + "' is missing");
  }
  const auto& record = it->second;
  if (!std::equal(record.shape.begin(), record.shape.end(), expected_shape.begin(),
                  expected_shape.end())) {
    throw InputError(describe(file) + ": tensor '" + std::string(name) + "' has shape " +
                     shape_to_string(record.shape) + ", expected " +
                     shape_to_string(expected_shape));
  }
  return record;
}

[[noreturn]] void wrong_dtype(const SafetensorsFile& file, const TensorRecord& record,
                              std::string_view wanted) {
  throw InputError(describe(file) + ": tensor '" + record.name + "' has dtype " +
                   std::string(to_string(record.dtype)) + ", expected " + std::string(wanted));
}

template <typename T>
std::vector<T> copy_as(const TensorRecord& record) {
  std::vector<T> values(record.data.size() / sizeof(T));
  if (!values.empty()) std::memcpy(values.data(), record.data.data(), record.data.size());
  return values;
}

template <typename T>
TensorRecord make_record(std::string name, DType dtype, std::vector<std::int64_t> shape,
                         std::span<const T> values) {
  const auto count = element_count(shape);
  if (static_cast<std::uint64_t>(count) != values.size()) {
    throw std::invalid_argument("safetensors: tensor '" + name + "' has " +
                                std::to_string(values.size()) + " values but shape " +
                                shape_to_string(shape) + " needs " + std::to_string(count));
  }
  TensorRecord record{std::move(name), dtype, std::move(shape), {}};
  record.data.resize(values.size_bytes());
  if (!values.empty()) std::memcpy(record.data.data(), values.data(), values.size_bytes());
  return record;
}

float half_to_float(std::uint16_t bits) {
  const std::uint32_t sign = (bits >> 15) & 1U;
  const std::uint32_t exponent = (bits >> 10) & 0x1FU;
  const std::uint32_t mantissa = bits & 0x3FFU;
  float magnitude = 0.0F;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);  // subnormal
  } else if (exponent == 31) {
    magnitude = mantissa == 0 ? std::numeric_limits<float>::infinity()
                              : std::numeric_limits<float>::quiet_NaN();
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400U), static_cast<int>(exponent) - 25);
  }
  return sign ? -magnitude : magnitude;
}

void write_all(int fd, const std::byte* data, std::size_t size, const std::string& where) {
  while (size > 0) {
    const auto written = ::write(fd, data, size);
    if (written < 0) {
      if (errno == EINTR) continue;
      throw std::system_error(errno, std::generic_category(), "safetensors: writing " + where);
    }
    data += written;
    size -= static_cast<std::size_t>(written);
  }
}

}  // namespace

std::string_view to_string(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kF64:
      return "F64";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
    case DType::kU8:
      return "U8";
    case DType::kBool:
      return "BOOL";
  }
  return "?";
}

DType dtype_from_string(std::string_view name) {
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16, DType::kF64, DType::kI32, DType::kI64,
                      DType::kU8, DType::kBool}) {
    if (to_string(dtype) == name) return dtype;
  }
  throw std::invalid_argument("unknown or unsupported dtype '" + std::string(name) + "'");
}

std::size_t element_size(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kF16:
      return 2;
    case DType::kBF16:
      return 2;
    case DType::kF64:
      return 8;
    case DType::kI32:
      return 4;
    case DType::kI64:
      return 8;
    case DType::kU8:
      return 1;
    case DType::kBool:
      return 1;
  }
  return 0;
}

std::int64_t element_count(std::span<const std::int64_t> shape) {
  std::int64_t count = 1;
  for (const auto dim : shape) {
    if (dim < 0)
      throw std::invalid_argument("negative dimension in shape " + shape_to_string(shape));
    // 2^56 elements is far beyond any file; the bound keeps count * element_size from overflowing.
    constexpr std::int64_t kLimit = std::int64_t{1} << 56;
    if (dim != 0 && count > kLimit / dim) {
      throw std::invalid_argument("shape " + shape_to_string(shape) + " is too large");
    }
    count *= dim;
  }
  return count;
}

std::string shape_to_string(std::span<const std::int64_t> shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(shape[i]);
  }
  return text + "]";
}

SafetensorsFile parse_safetensors(std::span<const std::byte> bytes, std::string_view source) {
  if (bytes.size() < 8) {
    fail(source, "file of " + std::to_string(bytes.size()) +
                     " bytes is too short for the 8-byte header size");
  }
  const auto header_size = read_le_u64(bytes.data());
  if (header_size > kMaxHeaderBytes) {
    fail(source, "header size " + std::to_string(header_size) + " exceeds the limit of " +
                     std::to_string(kMaxHeaderBytes) + " bytes");
  }
  if (header_size > bytes.size() - 8) {
    fail(source, "header size " + std::to_string(header_size) + " is beyond the end of the file (" +
                     std::to_string(bytes.size()) + " bytes): truncated?");
  }
  const std::string_view header_text(reinterpret_cast<const char*>(bytes.data() + 8), header_size);
  const auto data_bytes = bytes.size() - 8 - header_size;
  auto parsed = parse_header(header_text, data_bytes, source);
  SafetensorsFile file;
  file.source = std::string(source);
  file.metadata = std::move(parsed.metadata);
  const std::byte* data = bytes.data() + 8 + header_size;
  for (auto& entry : parsed.entries) {
    TensorRecord record;
    record.name = entry.name;
    record.dtype = entry.dtype;
    record.shape = std::move(entry.shape);
    record.data.assign(data + entry.begin, data + entry.end);
    file.tensors.emplace(entry.name, std::move(record));
  }
  return file;
}

SafetensorsFile load_safetensors(const std::filesystem::path& path) {
  const std::string source = path.string();
  std::error_code error;
  const auto file_size = std::filesystem::file_size(path, error);
  if (error) fail(source, "cannot read: " + error.message());
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(source, "cannot open for reading");
  if (file_size < 8) {
    fail(source,
         "file of " + std::to_string(file_size) + " bytes is too short for the 8-byte header size");
  }
  std::byte size_bytes[8];
  in.read(reinterpret_cast<char*>(size_bytes), 8);
  if (!in) fail(source, "cannot read the header size");
  const auto header_size = read_le_u64(size_bytes);
  if (header_size > kMaxHeaderBytes) {
    fail(source, "header size " + std::to_string(header_size) + " exceeds the limit of " +
                     std::to_string(kMaxHeaderBytes) + " bytes");
  }
  if (header_size > file_size - 8) {
    fail(source, "header size " + std::to_string(header_size) + " is beyond the end of the file (" +
                     std::to_string(file_size) + " bytes): truncated?");
  }
  std::string header_text(header_size, '\0');
  in.read(header_text.data(), static_cast<std::streamsize>(header_size));
  if (!in) fail(source, "cannot read the header");
  const auto data_start = 8 + header_size;
  auto parsed = parse_header(header_text, file_size - data_start, source);

  // Entries are sorted and contiguous, so the data is read front to back without seeking.
  SafetensorsFile file;
  file.source = std::string(source);
  file.metadata = std::move(parsed.metadata);
  for (auto& entry : parsed.entries) {
    TensorRecord record;
    record.name = entry.name;
    record.dtype = entry.dtype;
    record.shape = std::move(entry.shape);
    record.data.resize(entry.end - entry.begin);
    in.seekg(static_cast<std::streamoff>(data_start + entry.begin));
    in.read(reinterpret_cast<char*>(record.data.data()),
            static_cast<std::streamsize>(record.data.size()));
    if (!in) fail(source, "tensor '" + entry.name + "': cannot read its data");
    file.tensors.emplace(entry.name, std::move(record));
  }
  return file;
}

std::vector<std::byte> serialize_safetensors(const std::vector<TensorRecord>& records,
                                             const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    auto& meta = header[std::string(kMetadataKey)];
    meta = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
  }
  std::set<std::string_view> names;
  std::uint64_t offset = 0;
  for (const auto& record : records) {
    validate_record(record);
    if (!names.insert(record.name).second) {
      throw std::invalid_argument("safetensors: duplicate tensor name '" + record.name + "'");
    }
    auto& entry = header[record.name];
    entry["dtype"] = std::string(to_string(record.dtype));
    entry["shape"] = record.shape;
    entry["data_offsets"] = {offset, offset + record.data.size()};
    offset += record.data.size();
  }
  std::string header_text = header.dump();
  // Pad with spaces so the data starts 8-byte aligned, as the Python writer does.
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  std::vector<std::byte> bytes;
  bytes.reserve(8 + header_text.size() + offset);
  // The header's size as a little-endian u64 (the format's), byte by byte: also keeps GCC 12's
  // -Wnull-dereference quiet, which misfired on a memcpy into the fresh vector (-march=znver*).
  const std::uint64_t header_size = header_text.size();
  for (int i = 0; i < 8; ++i)
    bytes.push_back(static_cast<std::byte>((header_size >> (8 * i)) & 0xFFU));
  const auto* header_bytes = reinterpret_cast<const std::byte*>(header_text.data());
  bytes.insert(bytes.end(), header_bytes, header_bytes + header_text.size());
  for (const auto& record : records) {
    bytes.insert(bytes.end(), record.data.begin(), record.data.end());
  }
  return bytes;
}

void save_safetensors(const std::filesystem::path& path, const std::vector<TensorRecord>& records,
                      const std::map<std::string, std::string>& metadata) {
  const auto bytes = serialize_safetensors(records, metadata);
  const auto directory = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  auto temp = path;
  temp += ".tmp." + std::to_string(::getpid());
  const std::string where = temp.string();
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw std::system_error(errno, std::generic_category(), "safetensors: creating " + where);
  }
  try {
    write_all(fd, bytes.data(), bytes.size(), where);
    if (::fsync(fd) != 0) {
      throw std::system_error(errno, std::generic_category(), "safetensors: syncing " + where);
    }
  } catch (...) {
    ::close(fd);
    ::unlink(temp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    const int saved = errno;
    ::unlink(temp.c_str());
    throw std::system_error(saved, std::generic_category(), "safetensors: closing " + where);
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    const int saved = errno;
    ::unlink(temp.c_str());
    throw std::system_error(saved, std::generic_category(),
                            "safetensors: renaming " + where + " to " + path.string());
  }
  // Make the rename itself durable; failure here does not lose data already written.
  const int dir_fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
}

std::vector<float> read_f32(const SafetensorsFile& file, std::string_view name,
                            std::span<const std::int64_t> expected_shape) {
  const auto& record = find_tensor(file, name, expected_shape);
  if (record.dtype != DType::kF32) wrong_dtype(file, record, "F32");
  return copy_as<float>(record);
}

std::vector<double> read_f64(const SafetensorsFile& file, std::string_view name,
                             std::span<const std::int64_t> expected_shape) {
  const auto& record = find_tensor(file, name, expected_shape);
  if (record.dtype == DType::kF64) return copy_as<double>(record);
  if (record.dtype == DType::kF32) {
    const auto narrow = copy_as<float>(record);
    return {narrow.begin(), narrow.end()};
  }
  wrong_dtype(file, record, "F64 or F32");
}

std::vector<std::int64_t> read_i64(const SafetensorsFile& file, std::string_view name,
                                   std::span<const std::int64_t> expected_shape) {
  const auto& record = find_tensor(file, name, expected_shape);
  if (record.dtype == DType::kI64) return copy_as<std::int64_t>(record);
  if (record.dtype == DType::kI32) {
    const auto narrow = copy_as<std::int32_t>(record);
    return {narrow.begin(), narrow.end()};
  }
  wrong_dtype(file, record, "I64 or I32");
}

std::vector<float> read_as_f32(const SafetensorsFile& file, std::string_view name,
                               std::span<const std::int64_t> expected_shape) {
  const auto& record = find_tensor(file, name, expected_shape);
  switch (record.dtype) {
    case DType::kF32:
      return copy_as<float>(record);
    case DType::kF64: {
      const auto wide = copy_as<double>(record);
      std::vector<float> values(wide.size());
      std::transform(wide.begin(), wide.end(), values.begin(),
                     [](double v) { return static_cast<float>(v); });
      return values;
    }
    case DType::kF16: {
      const auto bits = copy_as<std::uint16_t>(record);
      std::vector<float> values(bits.size());
      std::transform(bits.begin(), bits.end(), values.begin(), half_to_float);
      return values;
    }
    case DType::kBF16: {
      const auto bits = copy_as<std::uint16_t>(record);
      std::vector<float> values(bits.size());
      std::transform(bits.begin(), bits.end(), values.begin(), [](std::uint16_t b) {
        return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
      });
      return values;
    }
    default:
      wrong_dtype(file, record, "a floating-point type (F32, F16, BF16, F64)");
  }
}

TensorRecord make_f32_record(std::string name, std::vector<std::int64_t> shape,
                             std::span<const float> values) {
  return make_record(std::move(name), DType::kF32, std::move(shape), values);
}

TensorRecord make_f64_record(std::string name, std::vector<std::int64_t> shape,
                             std::span<const double> values) {
  return make_record(std::move(name), DType::kF64, std::move(shape), values);
}

TensorRecord make_i64_record(std::string name, std::vector<std::int64_t> shape,
                             std::span<const std::int64_t> values) {
  return make_record(std::move(name), DType::kI64, std::move(shape), values);
}

}  // namespace pf::ckpt
