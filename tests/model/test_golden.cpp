// The model against PyTorch: tests/fixtures/make_bert_golden.py built the same tiny BERT with
// torch ops from the weights in the fixture, ran its batch (dropout off) in float64 and float32
// and stored the losses, logits and every gradient.
//
// Tolerances. Our double path against PyTorch's float64 differs only by summation order:
// 1e-10 of the tensor's scale. Our float path: fp32 rounding (2^-24 ~ 6e-8 per operation,
// accumulated over sums of up to 64 terms and ~20 dependent layers) gives errors of a few 1e-7
// of the scale; the fixture shows PyTorch's own fp32 result off its fp64 one by at most 4e-7 of
// the largest gradient, so 1e-5 of the scale leaves a 25x margin while any wrong term (an error
// of order 1e-2 or more) still fails. The scale of a tensor is its largest |value|, floored at a
// tenth of the largest gradient of the model: the key biases' true gradient is exactly zero
// (softmax ignores a constant shift), so only an absolute bound makes sense there.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "runtime/checkpoint/safetensors.h"
#include "runtime/model/bert_chunk.h"
#include "runtime/model/hf_weights.h"
#include "runtime/tensor/cpu_backend.h"

namespace pf::model {
namespace {

// Tests run from the repository root (tests/CMakeLists.txt sets the working directory).
const char* kFixture = "tests/fixtures/bert_golden.safetensors";

std::vector<double> read_f64(const ckpt::SafetensorsFile& file, const std::string& name) {
  const auto it = file.tensors.find(name);
  if (it == file.tensors.end()) throw std::runtime_error("fixture lacks " + name);
  if (it->second.dtype != ckpt::DType::kF64) throw std::runtime_error(name + " is not F64");
  std::vector<double> values(it->second.data.size() / sizeof(double));
  std::memcpy(values.data(), it->second.data.data(), values.size() * sizeof(double));
  return values;
}

std::vector<std::int64_t> shape_of(const ckpt::SafetensorsFile& file, const std::string& name) {
  return file.tensors.at(name).shape;
}

struct Golden {
  ckpt::SafetensorsFile file = ckpt::load_safetensors(kFixture);
  BertConfig config = bert_config_from_hf_json(nlohmann::json::parse(file.metadata.at("config")),
                                               "golden fixture config");
  Batch batch = read_batch();

  Batch read_batch() const {
    Batch b;
    const auto shape = shape_of(file, "batch.input_ids");
    b.batch_size = shape[0];
    b.seq_len = shape[1];
    b.max_predictions = shape_of(file, "batch.masked_lm_positions")[1];
    const std::vector<std::int64_t> bs{b.batch_size, b.seq_len};
    const std::vector<std::int64_t> bp{b.batch_size, b.max_predictions};
    const std::vector<std::int64_t> bn{b.batch_size};
    b.input_ids = ckpt::read_i64(file, "batch.input_ids", bs);
    b.token_type_ids = ckpt::read_i64(file, "batch.token_type_ids", bs);
    b.attention_mask = ckpt::read_i64(file, "batch.attention_mask", bs);
    b.masked_lm_positions = ckpt::read_i64(file, "batch.masked_lm_positions", bp);
    b.masked_lm_ids = ckpt::read_i64(file, "batch.masked_lm_ids", bp);
    b.masked_lm_weights = ckpt::read_f32(file, "batch.masked_lm_weights", bp);
    b.next_sentence_labels = ckpt::read_i64(file, "batch.next_sentence_labels", bn);
    return b;
  }
};

template <typename T>
void compare_with_pytorch(double relative_tolerance) {
  const Golden golden;
  tensor::CpuBackend backend;
  BertChunk<T> model(golden.config, whole_model(golden.config), backend);
  load_hf_weights(golden.file, model);
  model.zero_grad();
  ForwardOptions options;
  options.training = false;
  options.keep_logits = true;
  const auto result = model.forward(0, golden.batch, {}, options);
  ASSERT_TRUE(result.losses.has_value());
  EXPECT_NEAR(result.losses->total(), read_f64(golden.file, "expected.loss")[0],
              relative_tolerance * 10);
  EXPECT_NEAR(result.losses->mlm, read_f64(golden.file, "expected.mlm_loss")[0],
              relative_tolerance * 10);
  EXPECT_NEAR(result.losses->nsp, read_f64(golden.file, "expected.nsp_loss")[0],
              relative_tolerance);
  auto compare = [&](const std::string& what, const T* actual, const std::vector<double>& expected,
                     double scale_floor) {
    double scale = scale_floor;
    for (double v : expected) scale = std::max(scale, std::abs(v));
    double worst = 0;
    for (std::size_t i = 0; i < expected.size(); ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(actual[i]) - expected[i]));
    }
    EXPECT_LE(worst, relative_tolerance * scale) << what << " (scale " << scale << ")";
  };
  const auto mlm_logits = read_f64(golden.file, "expected.mlm_logits");
  ASSERT_EQ(static_cast<std::size_t>(result.mlm_logits.rows * result.mlm_logits.cols),
            mlm_logits.size());
  compare("mlm logits", result.mlm_logits.data, mlm_logits, 0);
  compare("nsp logits", result.nsp_logits.data, read_f64(golden.file, "expected.nsp_logits"), 0);

  model.backward(0, {}, {});
  double largest_gradient = 0;
  for (const auto& p : model.parameters()) {
    for (double v : read_f64(golden.file, "grad." + p.name)) {
      largest_gradient = std::max(largest_gradient, std::abs(v));
    }
  }
  ASSERT_GT(largest_gradient, 0.1);
  int compared = 0;
  for (const auto& p : model.parameters()) {
    const auto expected = read_f64(golden.file, "grad." + p.name);
    ASSERT_EQ(static_cast<std::int64_t>(expected.size()), p.size) << p.name;
    compare("gradient of " + p.name, p.grad, expected, 0.1 * largest_gradient);
    ++compared;
  }
  EXPECT_EQ(compared, 5 + 16 * golden.config.num_layers + 9);
}

TEST(GoldenPyTorch, DoubleMatchesFloat64Reference) {
  compare_with_pytorch<double>(1e-10);
}

TEST(GoldenPyTorch, FloatMatchesWithinFp32Rounding) {
  compare_with_pytorch<float>(1e-5);
}

TEST(GoldenPyTorch, PyTorchFp32ErrorIsWithinTheTolerance) {
  // The premise of the float tolerance: PyTorch's own fp32 run is well inside it.
  const Golden golden;
  for (const auto& [name, record] : golden.file.tensors) {
    if (name.rfind("grad32.", 0) != 0) continue;
    const auto reference = read_f64(golden.file, "grad." + name.substr(7));
    const auto fp32 = ckpt::read_f32(golden.file, name, record.shape);
    for (std::size_t i = 0; i < fp32.size(); ++i) {
      ASSERT_NEAR(fp32[i], reference[i], 1e-6) << name;
    }
  }
}

TEST(HfWeights, SaveThenLoadRoundTripsAndSplitsAcrossChunks) {
  const Golden golden;
  tensor::CpuBackend backend;
  BertChunk<float> whole(golden.config, whole_model(golden.config), backend);
  load_hf_weights(golden.file, whole);
  const auto path = std::filesystem::temp_directory_path() /
                    ("pf_hf_roundtrip_" + std::to_string(::getpid()) + ".safetensors");
  const auto config_path = std::filesystem::temp_directory_path() /
                           ("pf_hf_roundtrip_config_" + std::to_string(::getpid()) + ".json");
  std::vector<BertChunk<float>*> chunks{&whole};
  save_hf_weights<float>(path, chunks, config_path);
  const auto saved = ckpt::load_safetensors(path);
  EXPECT_EQ(saved.metadata.at("format"), "pt");
  EXPECT_TRUE(saved.tensors.contains("cls.predictions.decoder.weight"));
  EXPECT_TRUE(saved.tensors.contains("cls.predictions.decoder.bias"));
  auto reread = bert_config_from_hf_json(config_path);
  reread.name = golden.config.name;  // the name records where a config came from
  EXPECT_EQ(reread, golden.config);
  // Loading into two chunks: the head chunk gets its decoder copy.
  BertChunk<float> first(golden.config, {0, 1, true, false}, backend);
  BertChunk<float> second(golden.config, {1, 1, false, true}, backend);
  load_hf_weights(saved, first);
  load_hf_weights(saved, second);
  for (auto* chunk : {&first, &second}) {
    for (const auto& p : chunk->parameters()) {
      const auto expected = ckpt::read_f32(saved, p.name, p.shape);
      for (std::int64_t i = 0; i < p.size; ++i)
        ASSERT_EQ(p.value[i], expected[static_cast<std::size_t>(i)]) << p.name;
    }
  }
  // A split model saves the same file content.
  std::vector<BertChunk<float>*> split{&first, &second};
  const auto records = hf_weight_records<float>(split);
  EXPECT_EQ(records.size(), saved.tensors.size());
  for (const auto& record : records)
    EXPECT_EQ(record.data, saved.tensors.at(record.name).data) << record.name;
  std::filesystem::remove(path);
  std::filesystem::remove(config_path);
}

TEST(HfWeights, ExportForTransformersCheck) {
  // tests/fixtures/check_transformers.py loads this export into transformers'
  // BertForPreTraining and compares its loss with the fixture's: run
  //   PF_EXPORT_HF_DIR=/tmp/pf_hf ctest -R ExportForTransformers
  //   python3 tests/fixtures/check_transformers.py /tmp/pf_hf
  const char* export_dir = std::getenv("PF_EXPORT_HF_DIR");
  if (export_dir == nullptr) GTEST_SKIP() << "set PF_EXPORT_HF_DIR to export the checkpoint";
  const Golden golden;
  tensor::CpuBackend backend;
  BertChunk<float> whole(golden.config, whole_model(golden.config), backend);
  load_hf_weights(golden.file, whole);
  const std::filesystem::path dir(export_dir);
  std::filesystem::create_directories(dir);
  std::vector<BertChunk<float>*> chunks{&whole};
  save_hf_weights<float>(dir / "model.safetensors", chunks, dir / "config.json");
  EXPECT_TRUE(std::filesystem::exists(dir / "config.json"));
}

TEST(HfWeights, BadFilesNameTheTensor) {
  const Golden golden;
  tensor::CpuBackend backend;
  BertChunk<float> model(golden.config, whole_model(golden.config), backend);
  auto expect_error = [&](ckpt::SafetensorsFile file, const std::string& needle) {
    try {
      load_hf_weights(file, model);
      FAIL() << "expected an error mentioning " << needle;
    } catch (const std::runtime_error& error) {
      EXPECT_NE(std::string(error.what()).find(needle), std::string::npos) << error.what();
    }
  };
  const std::string name = "bert.encoder.layer.1.intermediate.dense.weight";
  auto missing = golden.file;
  missing.tensors.erase(name);
  expect_error(missing, name);
  auto misshaped = golden.file;
  misshaped.tensors.at(name).shape = {32, 64};
  expect_error(misshaped, name);
  auto wrong_type = golden.file;
  wrong_type.tensors.at(name).dtype = ckpt::DType::kI32;
  expect_error(wrong_type, name);
  // Older spellings load: LayerNorm gamma/beta and names without "bert.".
  auto renamed = golden.file;
  for (const std::string& old_name : {std::string("bert.embeddings.LayerNorm.weight"),
                                      std::string("bert.encoder.layer.0.output.dense.bias")}) {
    auto node = renamed.tensors.extract(old_name);
    node.key() = old_name == "bert.embeddings.LayerNorm.weight"
                     ? "bert.embeddings.LayerNorm.gamma"
                     : "encoder.layer.0.output.dense.bias";
    renamed.tensors.insert(std::move(node));
  }
  EXPECT_NO_THROW(load_hf_weights(renamed, model));
  auto untied = golden.file;
  auto decoder = untied.tensors.at("bert.embeddings.word_embeddings.weight");
  decoder.name = "cls.predictions.decoder.weight";
  decoder.data[5] = std::byte{0x7f};
  untied.tensors.emplace(decoder.name, decoder);
  expect_error(untied, "cls.predictions.decoder.weight");
}

}  // namespace
}  // namespace pf::model
