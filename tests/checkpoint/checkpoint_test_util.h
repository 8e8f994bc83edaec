#pragma once
// Helpers shared by the training-checkpoint tests: a unique scratch directory per test, small
// checkpoints with distinguishable contents, and comparisons.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "runtime/checkpoint/durable_file.h"
#include "runtime/checkpoint/training_checkpoint.h"

namespace pf::ckpt::testing {

namespace fs = std::filesystem;

// A directory of its own for each test, removed afterwards.
class ScratchDir {
 public:
  ScratchDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() / ("pf_ckpt_" + std::string(info->test_suite_name()) + "_" +
                                         info->name() + "_" + std::to_string(::getpid()));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// A checkpoint whose every part depends on `step`, so that two steps never look alike.
inline TrainingCheckpoint sample_checkpoint(std::int64_t step, bool with_kfac = true) {
  TrainingCheckpoint checkpoint;
  checkpoint.step = step;
  const auto f = static_cast<float>(step);
  checkpoint.weights = {
      make_f32_record("bert.embeddings.word_embeddings.weight", {5, 3},
                      std::vector<float>{f, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14}),
      make_f32_record("bert.encoder.layer.0.attention.self.query.weight", {3, 3},
                      std::vector<float>{0.5F, -1, 2, f, 0, 0, 1, 1, 1}),
      make_f32_record("cls.predictions.bias", {5}, std::vector<float>{0, 0, 0, 0, f})};
  checkpoint.hf_config = {{"architectures", {"BertForPreTraining"}},
                          {"model_type", "bert"},
                          {"hidden_size", 3},
                          {"vocab_size", 5}};
  checkpoint.optimizer = {make_i64_record("optimizer.step", {}, std::vector<std::int64_t>{step}),
                          make_f32_record("optimizer.cls.predictions.bias.m", {5},
                                          std::vector<float>{f, 0.25F, 0, 0, 1})};
  if (with_kfac) {
    checkpoint.kfac = {
        make_f32_record("kfac.layer.0.query.A", {2, 2}, std::vector<float>{2, f, f, 2}),
        make_i64_record("kfac.counters", {2, 4},
                        std::vector<std::int64_t>{1, 2, 3, 4, 5, 6, 7, step})};
  }
  checkpoint.state = {{"loader", {{{"epoch", 0}, {"batches_in_epoch", step}}}},
                      {"rng", "1 2 3 " + std::to_string(step)},
                      {"learning_rate", 1e-4 * static_cast<double>(step + 1)}};
  checkpoint.schedule = {{"kind", "1f1b"}, {"stages", 2}, {"microbatches", 4}};
  checkpoint.identity = {{"hidden_size", 3},
                         {"vocab_size", 5},
                         {"optimizer", "lamb"},
                         {"precision", "float32"},
                         {"data", {{"vocab_hash", "abc"}, {"seq_len", 128}}}};
  return checkpoint;
}

inline void expect_same_records(const std::vector<TensorRecord>& actual,
                                const std::vector<TensorRecord>& expected) {
  const auto actual_file = to_safetensors_file(actual);
  const auto expected_file = to_safetensors_file(expected);
  ASSERT_EQ(actual_file.tensors.size(), expected_file.tensors.size());
  for (const auto& [name, record] : expected_file.tensors) {
    ASSERT_TRUE(actual_file.tensors.contains(name)) << name;
    const auto& other = actual_file.tensors.at(name);
    EXPECT_EQ(other.dtype, record.dtype) << name;
    EXPECT_EQ(other.shape, record.shape) << name;
    EXPECT_EQ(other.data, record.data) << name;
  }
}

inline void expect_same_checkpoint(const TrainingCheckpoint& actual,
                                   const TrainingCheckpoint& expected) {
  EXPECT_EQ(actual.step, expected.step);
  expect_same_records(actual.weights, expected.weights);
  expect_same_records(actual.optimizer, expected.optimizer);
  expect_same_records(actual.kfac, expected.kfac);
  EXPECT_EQ(actual.hf_config, expected.hf_config);
  EXPECT_EQ(actual.state, expected.state);
  EXPECT_EQ(actual.schedule, expected.schedule);
  EXPECT_EQ(actual.identity, expected.identity);
}

// The message of the std::runtime_error that `action` throws ("" and a failure when none).
template <typename Action>
std::string error_of(Action&& action) {
  try {
    action();
  } catch (const std::runtime_error& error) {
    return error.what();
  }
  ADD_FAILURE() << "expected a std::runtime_error";
  return {};
}

inline std::string read_text(const fs::path& path) {
  const auto bytes = read_file_bytes(path);
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

// Without fsync: tests that rewrite a file many times stay fast.
inline void write_bytes(const fs::path& path, const std::vector<std::byte>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

inline void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

// Names of the entries of a directory, sorted.
inline std::vector<std::string> entries_of(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace pf::ckpt::testing
