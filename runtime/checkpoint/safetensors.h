#pragma once
// The safetensors file format (Hugging Face): an 8-byte little-endian header size N, N bytes of
// JSON header {name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]},
// "__metadata__": {str: str}}, then the tensor bytes (offsets relative to the end of the header).
// Checkpoints written here load in Python with safetensors.torch.load_file and vice versa.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace pf::ckpt {

enum class DType : std::uint8_t { kF32, kF16, kBF16, kF64, kI32, kI64, kU8, kBool };

struct TensorRecord {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> data;  // little-endian, row-major, exactly element_count * size bytes
};

struct SafetensorsFile {
  std::map<std::string, TensorRecord> tensors;
  std::map<std::string, std::string> metadata;
  std::string source;  // the file it was read from, for error messages (empty: built in memory)
};

// "F32", "F16", "BF16", "F64", "I32", "I64", "U8", "BOOL" as the format spells them.
std::string_view to_string(DType dtype);
// Throws std::invalid_argument for a name the format does not define or we do not support.
DType dtype_from_string(std::string_view name);
std::size_t element_size(DType dtype);
// Product of the dimensions; throws std::invalid_argument on a negative dimension or overflow.
std::int64_t element_count(std::span<const std::int64_t> shape);
std::string shape_to_string(std::span<const std::int64_t> shape);

// Reads the whole file. Throws pf::InputError (a std::runtime_error) naming the file (and tensor)
// when the file is truncated, the header is not valid JSON or not the expected layout, a dtype is
// unknown, offsets overlap, leave holes or point past the data, or a tensor's byte size disagrees
// with its shape.
SafetensorsFile load_safetensors(const std::filesystem::path& path);

// Writes atomically: the bytes go to a temporary file in the same directory which is flushed to
// disk and then renamed over `path`, so a crash leaves either the old file or the new one.
// Throws std::invalid_argument for a record whose data size disagrees with its shape, an empty
// or duplicate name, or the reserved name "__metadata__"; std::runtime_error on I/O failure.
void save_safetensors(const std::filesystem::path& path, const std::vector<TensorRecord>& records,
                      const std::map<std::string, std::string>& metadata = {});

// The serialized bytes of a file (what save_safetensors writes), for tests and in-memory use.
std::vector<std::byte> serialize_safetensors(const std::vector<TensorRecord>& records,
                                             const std::map<std::string, std::string>& metadata);
// Parses bytes in the format; `source` names them in error messages (a file path usually).
SafetensorsFile parse_safetensors(std::span<const std::byte> bytes, std::string_view source);

// Typed access. Each throws pf::InputError (a std::runtime_error) naming the tensor when it is
// missing, has another dtype, or its shape differs from expected_shape.
std::vector<float> read_f32(const SafetensorsFile& file, std::string_view name,
                            std::span<const std::int64_t> expected_shape);
// Accepts F64 and F32 data (F32 is widened exactly).
std::vector<double> read_f64(const SafetensorsFile& file, std::string_view name,
                             std::span<const std::int64_t> expected_shape);
// Accepts I64 and I32 data (I32 is widened).
std::vector<std::int64_t> read_i64(const SafetensorsFile& file, std::string_view name,
                                   std::span<const std::int64_t> expected_shape);
// Converts F32, F16, BF16 and F64 data to float (Hugging Face checkpoints are often F16).
std::vector<float> read_as_f32(const SafetensorsFile& file, std::string_view name,
                               std::span<const std::int64_t> expected_shape);

// Throws std::invalid_argument when values.size() disagrees with the shape.
TensorRecord make_f32_record(std::string name, std::vector<std::int64_t> shape,
                             std::span<const float> values);
TensorRecord make_f64_record(std::string name, std::vector<std::int64_t> shape,
                             std::span<const double> values);
TensorRecord make_i64_record(std::string name, std::vector<std::int64_t> shape,
                             std::span<const std::int64_t> values);

}  // namespace pf::ckpt
