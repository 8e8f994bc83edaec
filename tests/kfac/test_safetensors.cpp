// The safetensors reader and writer: round trips, files laid out as the Python writer does, and
// every kind of malformed input gives an error that names the file and the tensor.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "runtime/checkpoint/safetensors.h"

namespace pf::ckpt {
namespace {

namespace fs = std::filesystem;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("pf_safetensors_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A file as Python's safetensors writes it: header text chosen by the test, then raw data.
  fs::path write_raw(const std::string& name, const std::string& header,
                     const std::vector<std::byte>& data, std::uint64_t header_size_field = 0) {
    const auto path = dir_ / name;
    std::ofstream out(path, std::ios::binary);
    const std::uint64_t size = header_size_field ? header_size_field : header.size();
    out.write(reinterpret_cast<const char*>(&size), 8);
    out.write(header.data(), static_cast<std::streamsize>(header.size()));
    out.write(reinterpret_cast<const char*>(data.data()),
              static_cast<std::streamsize>(data.size()));
    return path;
  }

  static std::vector<std::byte> floats(std::initializer_list<float> values) {
    std::vector<std::byte> bytes(values.size() * 4);
    std::memcpy(bytes.data(), values.begin(), bytes.size());
    return bytes;
  }

  // The message of the runtime_error the load throws, or a failure when nothing is thrown.
  std::string load_error(const fs::path& path) {
    try {
      load_safetensors(path);
    } catch (const std::runtime_error& error) {
      return error.what();
    }
    ADD_FAILURE() << "no error loading " << path;
    return {};
  }

  fs::path dir_;
};

TEST_F(SafetensorsTest, RoundTripsTensorsAndMetadata) {
  const std::vector<float> weight = {1.5F, -2.0F, 3.25F, 0.0F, 5.0F, -6.5F};
  const std::vector<std::int64_t> ids = {7, -1, 1LL << 40};
  std::vector<TensorRecord> records = {
      make_f32_record("layer.weight", {2, 3}, weight),
      make_i64_record("ids", {3}, ids),
      make_f32_record("scalar", {}, std::vector<float>{42.0F}),
      make_f32_record("empty", {0, 4}, std::vector<float>{}),
  };
  const auto path = dir_ / "model.safetensors";
  save_safetensors(path, records, {{"format", "pt"}, {"step", "12"}});
  EXPECT_FALSE(fs::exists(dir_ / ("model.safetensors.tmp." + std::to_string(::getpid()))));

  const auto file = load_safetensors(path);
  EXPECT_EQ(file.tensors.size(), 4U);
  EXPECT_EQ(file.metadata.at("format"), "pt");
  EXPECT_EQ(file.metadata.at("step"), "12");
  const std::int64_t weight_shape[] = {2, 3};
  EXPECT_EQ(read_f32(file, "layer.weight", weight_shape), weight);
  const std::int64_t ids_shape[] = {3};
  EXPECT_EQ(read_i64(file, "ids", ids_shape), ids);
  EXPECT_EQ(read_f32(file, "scalar", {}), std::vector<float>{42.0F});
  const std::int64_t empty_shape[] = {0, 4};
  EXPECT_TRUE(read_f32(file, "empty", empty_shape).empty());

  // The data section starts 8-byte aligned, as the Python writer pads it.
  std::ifstream in(path, std::ios::binary);
  std::uint64_t header_size = 0;
  in.read(reinterpret_cast<char*>(&header_size), 8);
  EXPECT_EQ(header_size % 8, 0U);
}

TEST_F(SafetensorsTest, SavingReplacesAnExistingFile) {
  const auto path = dir_ / "ckpt.safetensors";
  save_safetensors(path, {make_f32_record("a", {1}, std::vector<float>{1.0F})});
  save_safetensors(path, {make_f32_record("b", {2}, std::vector<float>{2.0F, 3.0F})});
  const auto file = load_safetensors(path);
  EXPECT_EQ(file.tensors.count("a"), 0U);
  const std::int64_t shape[] = {2};
  EXPECT_EQ(read_f32(file, "b", shape), (std::vector<float>{2.0F, 3.0F}));
}

TEST_F(SafetensorsTest, ReadsAFileLaidOutByThePythonWriter) {
  // Header as safetensors.torch.save_file writes it: sorted keys, metadata first, space padding.
  std::string header =
      R"({"__metadata__":{"format":"pt"},"bias":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("mask":{"dtype":"BOOL","shape":[2],"data_offsets":[24,26]},)"
      R"("pos":{"dtype":"I32","shape":[2],"data_offsets":[16,24]},)"
      R"("w":{"dtype":"BF16","shape":[2,2],"data_offsets":[8,16]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  auto data = floats({0.5F, -0.25F});
  for (std::uint16_t bits : {0x3F80, 0xC000, 0x3E80, 0x0000}) {  // bf16: 1, -2, 0.25, 0
    data.push_back(static_cast<std::byte>(bits & 0xFF));
    data.push_back(static_cast<std::byte>(bits >> 8));
  }
  for (std::int32_t v : {3, -4}) {
    std::byte bytes[4];
    std::memcpy(bytes, &v, 4);
    data.insert(data.end(), bytes, bytes + 4);
  }
  data.push_back(std::byte{1});
  data.push_back(std::byte{0});
  const auto path = write_raw("python.safetensors", header, data);

  const auto file = load_safetensors(path);
  EXPECT_EQ(file.metadata.at("format"), "pt");
  const std::int64_t two[] = {2};
  const std::int64_t two_by_two[] = {2, 2};
  EXPECT_EQ(read_f32(file, "bias", two), (std::vector<float>{0.5F, -0.25F}));
  EXPECT_EQ(read_i64(file, "pos", two), (std::vector<std::int64_t>{3, -4}));
  EXPECT_EQ(read_as_f32(file, "w", two_by_two), (std::vector<float>{1.0F, -2.0F, 0.25F, 0.0F}));
  EXPECT_EQ(file.tensors.at("mask").dtype, DType::kBool);
}

TEST_F(SafetensorsTest, ConvertsHalfPrecisionToFloat) {
  TensorRecord half{"h", DType::kF16, {4}, {}};
  for (std::uint16_t bits : {0x3C00, 0xC100, 0x0001, 0x7C00}) {  // 1, -2.5, 2^-24, +inf
    half.data.push_back(static_cast<std::byte>(bits & 0xFF));
    half.data.push_back(static_cast<std::byte>(bits >> 8));
  }
  const auto path = dir_ / "half.safetensors";
  save_safetensors(path, {half});
  const auto values = read_as_f32(load_safetensors(path), "h", std::vector<std::int64_t>{4});
  EXPECT_EQ(values[0], 1.0F);
  EXPECT_EQ(values[1], -2.5F);
  EXPECT_EQ(values[2], std::ldexp(1.0F, -24));
  EXPECT_TRUE(std::isinf(values[3]));
}

TEST_F(SafetensorsTest, F64RoundTripsAndReadF64WidensF32) {
  const std::vector<double> wide = {0.1, -1e-300, 3.0};
  const std::vector<float> narrow = {0.1F, -2.5F};
  const auto path = dir_ / "f64.safetensors";
  save_safetensors(path, {make_f64_record("d", {3}, wide), make_f32_record("f", {2}, narrow),
                          make_i64_record("n", {1}, std::vector<std::int64_t>{5})});
  const auto file = load_safetensors(path);
  EXPECT_EQ(file.tensors.at("d").dtype, DType::kF64);
  EXPECT_EQ(read_f64(file, "d", std::vector<std::int64_t>{3}), wide);
  EXPECT_EQ(read_f64(file, "f", std::vector<std::int64_t>{2}),
            (std::vector<double>{double{0.1F}, -2.5}));
  try {
    read_f64(file, "n", std::vector<std::int64_t>{1});
    FAIL() << "no error";
  } catch (const std::runtime_error& error) {
    EXPECT_NE(std::string(error.what()).find("'n' has dtype I64, expected F64 or F32"),
              std::string::npos)
        << error.what();
  }
  EXPECT_THROW(make_f64_record("bad", {2}, wide), std::invalid_argument);
}

TEST_F(SafetensorsTest, TypedReadsNameTheTensorOnMismatch) {
  const auto path = dir_ / "typed.safetensors";
  save_safetensors(path, {make_f32_record("w", {2, 2}, std::vector<float>{1, 2, 3, 4}),
                          make_i64_record("n", {1}, std::vector<std::int64_t>{5})});
  const auto file = load_safetensors(path);
  const std::int64_t good[] = {2, 2};
  const std::int64_t bad[] = {4};
  const auto message = [&](auto&& call) {
    try {
      call();
    } catch (const std::runtime_error& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { read_f32(file, "missing", good); }).find("'missing' is missing"),
            std::string::npos);
  EXPECT_NE(message([&] { read_f32(file, "w", bad); }).find("'w' has shape [2, 2], expected [4]"),
            std::string::npos);
  EXPECT_NE(message([&] {
              read_f32(file, "n", std::vector<std::int64_t>{1});
            }).find("'n' has dtype I64, expected F32"),
            std::string::npos);
  EXPECT_NE(message([&] { read_i64(file, "w", good); }).find("'w' has dtype F32"),
            std::string::npos);
}

TEST_F(SafetensorsTest, RejectsTruncatedFiles) {
  const auto tiny = dir_ / "tiny.safetensors";
  std::ofstream(tiny, std::ios::binary) << "abc";
  EXPECT_NE(load_error(tiny).find("too short"), std::string::npos);
  EXPECT_NE(load_error(tiny).find("tiny.safetensors"), std::string::npos);

  const auto beyond = write_raw("beyond.safetensors", "{}", {}, 4096);
  EXPECT_NE(load_error(beyond).find("beyond the end of the file"), std::string::npos);

  // A complete file cut short in its data section.
  const auto full = dir_ / "full.safetensors";
  save_safetensors(full, {make_f32_record("w", {4}, std::vector<float>{1, 2, 3, 4})});
  fs::resize_file(full, fs::file_size(full) - 4);
  const auto error = load_error(full);
  EXPECT_NE(error.find("'w'"), std::string::npos) << error;
  EXPECT_NE(error.find("beyond the data section"), std::string::npos) << error;
}

TEST_F(SafetensorsTest, RejectsMalformedHeaders) {
  const auto data = floats({1, 2});
  struct Case {
    std::string header;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]})", "not valid JSON"},
      {R"([1, 2])", "not a JSON object"},
      {R"({"w": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 8]}})",
       "tensor 'w': unknown or unsupported dtype 'F8_E4M3'"},
      {R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})",
       "tensor 'w': holds 8 bytes but dtype F32 and shape [3] need 12"},
      {R"({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})",
       "tensor 'w': shape entry -2"},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}})",
       "tensor 'w': data_offsets end 16 is beyond the data section of 8 bytes"},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", "end before begin"},
      {R"({"w": {"dtype": "F32", "shape": [2]}})", "tensor 'w': missing field 'data_offsets'"},
      {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
       R"( "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
       "tensor 'b': data_offsets [4, 8] overlap tensor 'a'"},
      {R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
       "tensor 'a': data_offsets begin 4 leaves a hole"},
      {R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", "tensors cover 4"},
      {R"({"__metadata__": {"k": 1}})", "__metadata__ value of 'k' is not a string"},
  };
  int index = 0;
  for (const auto& test_case : cases) {
    const auto name = "bad" + std::to_string(index++) + ".safetensors";
    const auto error = load_error(write_raw(name, test_case.header, data));
    EXPECT_NE(error.find(test_case.expected), std::string::npos)
        << "header " << test_case.header << "\n  gave: " << error;
    EXPECT_NE(error.find(name), std::string::npos) << error;
  }
}

TEST_F(SafetensorsTest, RejectsBadRecordsOnSave) {
  const auto path = dir_ / "x.safetensors";
  TensorRecord short_data{"w", DType::kF32, {3}, std::vector<std::byte>(8)};
  EXPECT_THROW(save_safetensors(path, {short_data}), std::invalid_argument);
  const auto one = make_f32_record("w", {1}, std::vector<float>{1});
  EXPECT_THROW(save_safetensors(path, {one, one}), std::invalid_argument);
  EXPECT_THROW(
      save_safetensors(path, {make_f32_record("__metadata__", {1}, std::vector<float>{1})}),
      std::invalid_argument);
  EXPECT_THROW(make_f32_record("w", {2, 2}, std::vector<float>{1, 2, 3}), std::invalid_argument);
  EXPECT_FALSE(fs::exists(path));
}

TEST_F(SafetensorsTest, ParsesFromMemoryLikeFromDisk) {
  const auto bytes =
      serialize_safetensors({make_f32_record("w", {2}, std::vector<float>{1, 2})}, {});
  const auto file = parse_safetensors(bytes, "memory");
  EXPECT_EQ(read_f32(file, "w", std::vector<std::int64_t>{2}), (std::vector<float>{1, 2}));
  EXPECT_THROW(parse_safetensors(std::span(bytes).first(bytes.size() - 1), "memory"),
               std::runtime_error);
}

}  // namespace
}  // namespace pf::ckpt
