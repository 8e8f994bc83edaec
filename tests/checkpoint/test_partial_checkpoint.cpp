// Checkpoints written in parts (one per process under MPI): they load into the same value as a
// checkpoint written whole, become visible only at the commit, and a missing or corrupt part is
// refused naming the file. The processes are played here by one process in turn; the MPI tests
// (tests/mpi/checkpoint_resume.sh) run the same functions from real ranks.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "checkpoint_test_util.h"

namespace pf::ckpt {
namespace {

using testing::entries_of;
using testing::error_of;
using testing::read_text;
using testing::sample_checkpoint;
using testing::ScratchDir;
namespace fs = std::filesystem;

void expect_contains(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "'" << part << "' not in: " << text;
}

// The sample checkpoint split over three "ranks": weights over the first two (one tensor in
// both, as the tied copies of a pipeline are), the optimizer's step counter in every part
// (replicated state), K-FAC state on the last one only.
std::vector<CheckpointPart> split(const TrainingCheckpoint& whole) {
  std::vector<CheckpointPart> parts(3);
  parts[0].weights = {whole.weights[0], whole.weights[1]};
  parts[1].weights = {whole.weights[1], whole.weights[2]};
  parts[0].optimizer = {whole.optimizer[0], whole.optimizer[1]};
  parts[1].optimizer = {whole.optimizer[0]};
  parts[2].optimizer = {whole.optimizer[0]};
  parts[2].kfac = whole.kfac;
  return parts;
}

// Parts written in reverse order of rank (as processes may finish), not committed.
struct Written {
  fs::path temp_dir;
  std::vector<nlohmann::json> answers;
};
Written write_parts(const fs::path& root, const TrainingCheckpoint& whole) {
  Written written{begin_partial_save(root, whole.step), {}};
  const auto parts = split(whole);
  for (int rank = 2; rank >= 0; --rank) {
    written.answers.push_back(
        write_checkpoint_part(written.temp_dir, rank, 3, parts[static_cast<std::size_t>(rank)]));
  }
  return written;
}

TEST(PartialCheckpoint, LoadsAsTheWholeCheckpoint) {
  const ScratchDir root;
  const auto whole = sample_checkpoint(5);
  const auto written = write_parts(root.path(), whole);
  const auto dir = commit_partial_save(root.path(), written.temp_dir, whole, written.answers);
  EXPECT_EQ(dir, root.path() / "step-00000005");
  EXPECT_EQ(read_text(root.path() / "latest"), "step-00000005\n");
  EXPECT_EQ(entries_of(dir),
            (std::vector<std::string>{
                "config.json", "kfac-00003-of-00003.safetensors", "manifest.json",
                "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                "model.safetensors.index.json", "optimizer-00001-of-00003.safetensors",
                "optimizer-00002-of-00003.safetensors", "optimizer-00003-of-00003.safetensors",
                "schedule.json", "state.json"}));
  const auto loaded = load_latest_checkpoint(root.path());
  ASSERT_TRUE(loaded.has_value());
  testing::expect_same_checkpoint(*loaded, whole);

  const auto manifest = nlohmann::json::parse(read_text(dir / "manifest.json"));
  EXPECT_EQ(manifest["parts"]["model"], (nlohmann::json{"model-00001-of-00003.safetensors",
                                                        "model-00002-of-00003.safetensors"}));
  EXPECT_EQ(manifest["files"].size(), entries_of(dir).size() - 1);  // all but the manifest
  // transformers' index of sharded weights: each tensor in the first part holding it.
  const auto index = nlohmann::json::parse(read_text(dir / "model.safetensors.index.json"));
  EXPECT_EQ(index["weight_map"]["bert.encoder.layer.0.attention.self.query.weight"],
            "model-00001-of-00003.safetensors");
  EXPECT_EQ(index["weight_map"]["cls.predictions.bias"], "model-00002-of-00003.safetensors");
}

TEST(PartialCheckpoint, NothingIsVisibleBeforeTheCommit) {
  const ScratchDir root;
  save_training_checkpoint(root.path(), sample_checkpoint(2));
  // Every part written, the committer gone (a crash): the previous checkpoint is the latest.
  const auto written = write_parts(root.path(), sample_checkpoint(4));
  ASSERT_TRUE(fs::exists(written.temp_dir));
  const auto loaded = load_latest_checkpoint(root.path());
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->step, 2);
  EXPECT_EQ(list_checkpoints(root.path()).size(), 1U);
  // The next save removes the leftovers (of this process's save and of another's).
  fs::create_directory(root.path() / ".tmp-step-00000003-1");
  const auto again = write_parts(root.path(), sample_checkpoint(4));
  EXPECT_FALSE(fs::exists(root.path() / ".tmp-step-00000003-1"));
  commit_partial_save(root.path(), again.temp_dir, sample_checkpoint(4), again.answers);
  EXPECT_EQ(load_latest_checkpoint(root.path())->step, 4);
  EXPECT_EQ(entries_of(root.path()),
            (std::vector<std::string>{"latest", "step-00000002", "step-00000004"}));
}

TEST(PartialCheckpoint, AFailedCommitLeavesThePreviousCheckpoint) {
  const ScratchDir root;
  save_training_checkpoint(root.path(), sample_checkpoint(2));
  auto written = write_parts(root.path(), sample_checkpoint(4));
  written.answers.pop_back();  // a rank's answer lost: indices no longer 0..n-1
  const auto error = [&] {
    try {
      commit_partial_save(root.path(), written.temp_dir, sample_checkpoint(4), written.answers);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  }();
  expect_contains(error, "part index 2 out of range");
  EXPECT_FALSE(fs::exists(written.temp_dir));
  EXPECT_EQ(load_latest_checkpoint(root.path())->step, 2);
}

TEST(PartialCheckpoint, AMissingOrCorruptPartIsRefusedNamingIt) {
  const ScratchDir root;
  const auto whole = sample_checkpoint(5);
  const auto written = write_parts(root.path(), whole);
  const auto dir = commit_partial_save(root.path(), written.temp_dir, whole, written.answers);
  const auto part = dir / "optimizer-00002-of-00003.safetensors";
  auto bytes = read_file_bytes(part);
  bytes[bytes.size() - 1] ^= std::byte{0x01};
  testing::write_bytes(part, bytes);
  expect_contains(error_of([&] { load_training_checkpoint(dir); }),
                  "optimizer-00002-of-00003.safetensors is corrupt");
  fs::remove(part);
  expect_contains(error_of([&] { load_training_checkpoint(dir); }),
                  "optimizer-00002-of-00003.safetensors is missing");
}

}  // namespace
}  // namespace pf::ckpt
