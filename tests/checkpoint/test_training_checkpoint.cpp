// Round trips and every way a checkpoint on disk can be wrong: each must be refused with a
// message that names the file and what differs.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "checkpoint_test_util.h"
#include "runtime/checkpoint/xxhash64.h"

namespace pf::ckpt {
namespace {

using testing::entries_of;
using testing::error_of;
using testing::read_text;
using testing::sample_checkpoint;
using testing::ScratchDir;
using testing::write_text;
namespace fs = std::filesystem;

const std::vector<std::string> kDataFiles = {
    "model.safetensors", "config.json", "optimizer.safetensors",
    "kfac.safetensors",  "state.json",  "schedule.json"};

void expect_contains(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "'" << part << "' not in: " << text;
}

// Makes the manifest agree with a file changed on purpose, so that the file's own check speaks.
void refresh_manifest_entry(const fs::path& dir, const std::string& file) {
  auto manifest = nlohmann::json::parse(read_text(dir / "manifest.json"));
  const auto bytes = read_file_bytes(dir / file);
  manifest["files"][file] = {{"bytes", bytes.size()}, {"xxh64", to_hex64(xxhash64(bytes))}};
  write_text(dir / "manifest.json", manifest.dump(2));
}

void flip_byte(const fs::path& path, std::size_t position) {
  auto bytes = read_file_bytes(path);
  ASSERT_LT(position, bytes.size());
  bytes[position] ^= std::byte{0x01};
  testing::write_bytes(path, bytes);
}

TEST(TrainingCheckpoint, RoundTripsEveryPart) {
  const ScratchDir root;
  const auto saved = sample_checkpoint(7);
  const auto dir = save_training_checkpoint(root.path(), saved);
  EXPECT_EQ(dir, root.path() / "step-00000007");
  EXPECT_EQ(read_text(root.path() / "latest"), "step-00000007\n");
  EXPECT_EQ(entries_of(dir),
            (std::vector<std::string>{"config.json", "kfac.safetensors", "manifest.json",
                                      "model.safetensors", "optimizer.safetensors", "schedule.json",
                                      "state.json"}));
  EXPECT_EQ(entries_of(root.path()), (std::vector<std::string>{"latest", "step-00000007"}));

  const auto loaded = load_latest_checkpoint(root.path());
  ASSERT_TRUE(loaded.has_value());
  testing::expect_same_checkpoint(*loaded, saved);
  EXPECT_EQ(loaded->directory, dir);
  testing::expect_same_checkpoint(load_training_checkpoint(dir), saved);

  const auto manifest = nlohmann::json::parse(read_text(dir / "manifest.json"));
  EXPECT_EQ(manifest["format"], "pipefisher-training-checkpoint");
  EXPECT_EQ(manifest["format_version"], 1);
  EXPECT_EQ(manifest["step"], 7);
  EXPECT_EQ(manifest["files"].size(), kDataFiles.size());
  for (const auto& file : kDataFiles) {
    EXPECT_EQ(manifest["files"][file]["bytes"], fs::file_size(dir / file)) << file;
  }
  // The optimizer and K-FAC state hand straight to the load_state functions.
  const auto optimizer = to_safetensors_file(loaded->optimizer);
  EXPECT_EQ(read_i64(optimizer, "optimizer.step", {}), std::vector<std::int64_t>{7});
}

TEST(TrainingCheckpoint, WithoutKfacStateThereIsNoKfacFile) {
  const ScratchDir root;
  const auto saved = sample_checkpoint(3, /*with_kfac=*/false);
  const auto dir = save_training_checkpoint(root.path(), saved);
  EXPECT_FALSE(fs::exists(dir / "kfac.safetensors"));
  const auto loaded = load_latest_checkpoint(root.path());
  ASSERT_TRUE(loaded.has_value());
  EXPECT_TRUE(loaded->kfac.empty());
  testing::expect_same_checkpoint(*loaded, saved);
}

TEST(TrainingCheckpoint, NoCheckpointYetIsNullopt) {
  const ScratchDir root;
  EXPECT_FALSE(load_latest_checkpoint(root.path() / "absent").has_value());
  EXPECT_FALSE(load_latest_checkpoint(root.path()).has_value());
  EXPECT_TRUE(list_checkpoints(root.path() / "absent").empty());
}

TEST(TrainingCheckpoint, ACopiedCheckpointLoadsUnderAnyDirectoryName) {
  const ScratchDir root;
  const auto saved = sample_checkpoint(11);
  const auto dir = save_training_checkpoint(root.path(), saved);
  fs::copy(dir, root.path() / "my-favourite");
  testing::expect_same_checkpoint(load_training_checkpoint(root.path() / "my-favourite"), saved);
}

TEST(TrainingCheckpoint, ACorruptByteInAnyFileIsRefusedNamingTheFile) {
  const ScratchDir root;
  const auto dir = save_training_checkpoint(root.path(), sample_checkpoint(5));
  for (const auto& file : kDataFiles) {
    const auto size = fs::file_size(dir / file);
    for (const std::size_t position : {std::size_t{0}, size / 2, size - 1}) {
      const auto copy = root.path() / "copy" / "step-00000005";
      fs::remove_all(root.path() / "copy");
      fs::create_directories(copy.parent_path());
      fs::copy(dir, copy);
      flip_byte(copy / file, position);
      const auto message = error_of([&] { load_training_checkpoint(copy); });
      expect_contains(message, copy.string());
      expect_contains(message, file + " is corrupt: its XXH64 checksum is ");
    }
  }
}

TEST(TrainingCheckpoint, EveryCorruptByteOfTheManifestIsRefused) {
  const ScratchDir root;
  const auto dir = save_training_checkpoint(root.path(), sample_checkpoint(5));
  const auto original = read_file_bytes(dir / "manifest.json");
  for (std::size_t position = 0; position < original.size(); ++position) {
    auto bytes = original;
    bytes[position] ^= std::byte{0x01};
    testing::write_bytes(dir / "manifest.json", bytes);
    const auto message = error_of([&] { load_training_checkpoint(dir); });
    expect_contains(message, "manifest");
  }
  testing::write_bytes(dir / "manifest.json", original);
  EXPECT_NO_THROW(load_training_checkpoint(dir));
}

TEST(TrainingCheckpoint, ATruncatedFileIsRefused) {
  const ScratchDir root;
  const auto dir = save_training_checkpoint(root.path(), sample_checkpoint(5));
  const auto full = fs::file_size(dir / "model.safetensors");
  fs::resize_file(dir / "model.safetensors", full / 2);
  expect_contains(error_of([&] { load_training_checkpoint(dir); }),
                  "model.safetensors has " + std::to_string(full / 2) +
                      " bytes but the manifest says " + std::to_string(full) + " (truncated)");
  // Even with a manifest that agrees, the safetensors reader refuses the cut file.
  refresh_manifest_entry(dir, "model.safetensors");
  const auto message = error_of([&] { load_training_checkpoint(dir); });
  expect_contains(message, "model.safetensors: safetensors '");
}

TEST(TrainingCheckpoint, AMissingFileIsRefusedNamingIt) {
  const ScratchDir root;
  const auto dir = save_training_checkpoint(root.path(), sample_checkpoint(5));
  for (const auto& file : kDataFiles) {
    const auto copy = root.path() / "copy";
    fs::remove_all(copy);
    fs::copy(dir, copy);
    fs::remove(copy / file);
    expect_contains(error_of([&] { load_training_checkpoint(copy); }), file + " is missing");
  }
  fs::remove(dir / "manifest.json");
  expect_contains(error_of([&] { load_training_checkpoint(dir); }), "manifest.json is missing");
  expect_contains(error_of([&] { load_training_checkpoint(root.path() / "nowhere"); }),
                  "does not exist");
}

TEST(TrainingCheckpoint, AManifestWithoutARequiredFileIsRefused) {
  const ScratchDir root;
  const auto dir = save_training_checkpoint(root.path(), sample_checkpoint(5));
  auto manifest = nlohmann::json::parse(read_text(dir / "manifest.json"));
  manifest["files"].erase("state.json");
  write_text(dir / "manifest.json", manifest.dump());
  expect_contains(error_of([&] { load_training_checkpoint(dir); }),
                  "manifest.json does not list the required file 'state.json'");
}

TEST(TrainingCheckpoint, UnparsableJsonIsRefusedNamingTheFile) {
  const ScratchDir root;
  const auto dir = save_training_checkpoint(root.path(), sample_checkpoint(5));
  for (const std::string file : {"config.json", "state.json", "schedule.json"}) {
    const auto copy = root.path() / "copy";
    fs::remove_all(copy);
    fs::copy(dir, copy);
    write_text(copy / file, "{\"step\": 5,");
    refresh_manifest_entry(copy, file);
    expect_contains(error_of([&] { load_training_checkpoint(copy); }), file + " is not valid JSON");
  }
  write_text(dir / "manifest.json", "{\"format\": ");
  expect_contains(error_of([&] { load_training_checkpoint(dir); }),
                  "manifest.json is not valid JSON");
}

TEST(TrainingCheckpoint, AnotherFormatVersionIsRefused) {
  const ScratchDir root;
  const auto dir = save_training_checkpoint(root.path(), sample_checkpoint(5));
  auto manifest = nlohmann::json::parse(read_text(dir / "manifest.json"));
  manifest["format_version"] = 2;
  write_text(dir / "manifest.json", manifest.dump());
  expect_contains(error_of([&] { load_training_checkpoint(dir); }),
                  "manifest.json: format_version is 2; this program reads version 1");
  manifest["format_version"] = 1;
  manifest["format"] = "something-else";
  write_text(dir / "manifest.json", manifest.dump());
  expect_contains(error_of([&] { load_training_checkpoint(dir); }),
                  "manifest.json: format is \"something-else\"");
}

TEST(TrainingCheckpoint, StepsThatDisagreeAreRefused) {
  const ScratchDir root;
  const auto dir = save_training_checkpoint(root.path(), sample_checkpoint(5));
  fs::rename(dir, root.path() / "step-00000006");
  expect_contains(error_of([&] { load_training_checkpoint(root.path() / "step-00000006"); }),
                  "manifest.json: step is 5 but the directory is step-00000006");
  // state.json of another step under a manifest that agrees with it byte-wise.
  const auto other = save_training_checkpoint(root.path() / "other", sample_checkpoint(9));
  fs::copy_file(other / "state.json", root.path() / "step-00000006" / "state.json",
                fs::copy_options::overwrite_existing);
  auto manifest = nlohmann::json::parse(read_text(root.path() / "step-00000006/manifest.json"));
  manifest["step"] = 6;
  write_text(root.path() / "step-00000006/manifest.json", manifest.dump());
  refresh_manifest_entry(root.path() / "step-00000006", "state.json");
  expect_contains(error_of([&] { load_training_checkpoint(root.path() / "step-00000006"); }),
                  "state.json: step is 9 but the manifest says 6");
}

TEST(TrainingCheckpoint, ABrokenLatestIsAnErrorThatNamesTheAlternatives) {
  const ScratchDir root;
  save_training_checkpoint(root.path(), sample_checkpoint(1), 3);
  save_training_checkpoint(root.path(), sample_checkpoint(2), 3);
  const auto newest = save_training_checkpoint(root.path(), sample_checkpoint(3), 3);
  flip_byte(newest / "optimizer.safetensors", 20);
  const auto message = error_of([&] { load_latest_checkpoint(root.path()); });
  expect_contains(message, "the latest checkpoint, step-00000003, cannot be loaded");
  expect_contains(message, "not falling back");
  expect_contains(message, "optimizer.safetensors is corrupt");
  expect_contains(message, "step-00000001, step-00000002");
  expect_contains(message, (root.path() / "latest").string());
  // The way out the message offers works.
  write_text(root.path() / "latest", "step-00000002\n");
  const auto loaded = load_latest_checkpoint(root.path());
  ASSERT_TRUE(loaded.has_value());
  testing::expect_same_checkpoint(*loaded, sample_checkpoint(2));

  fs::remove_all(root.path() / "step-00000002");
  expect_contains(error_of([&] { load_latest_checkpoint(root.path()); }), "does not exist");
  write_text(root.path() / "latest", "../../etc\n");
  expect_contains(error_of([&] { load_latest_checkpoint(root.path()); }),
                  "holds '../../etc', not a checkpoint name step-<N>");
}

TEST(TrainingCheckpoint, KeepLastPrunesOlderCheckpoints) {
  const ScratchDir root;
  for (std::int64_t step = 1; step <= 5; ++step) {
    save_training_checkpoint(root.path(), sample_checkpoint(step));
  }
  EXPECT_EQ(entries_of(root.path()),
            (std::vector<std::string>{"latest", "step-00000004", "step-00000005"}));
  save_training_checkpoint(root.path(), sample_checkpoint(6), 3);
  EXPECT_EQ(entries_of(root.path()), (std::vector<std::string>{"latest", "step-00000004",
                                                               "step-00000005", "step-00000006"}));
  save_training_checkpoint(root.path(), sample_checkpoint(7), 1);
  EXPECT_EQ(entries_of(root.path()), (std::vector<std::string>{"latest", "step-00000007"}));
  testing::expect_same_checkpoint(*load_latest_checkpoint(root.path()), sample_checkpoint(7));
}

TEST(TrainingCheckpoint, NewerCheckpointsOfAnotherRunAreNotPruned) {
  const ScratchDir root;
  save_training_checkpoint(root.path(), sample_checkpoint(100));
  save_training_checkpoint(root.path(), sample_checkpoint(200));
  // A fresh run into the same directory: its saves never delete what has larger steps.
  save_training_checkpoint(root.path(), sample_checkpoint(1), 1);
  save_training_checkpoint(root.path(), sample_checkpoint(2), 1);
  EXPECT_EQ(entries_of(root.path()), (std::vector<std::string>{"latest", "step-00000002",
                                                               "step-00000100", "step-00000200"}));
  EXPECT_EQ(load_latest_checkpoint(root.path())->step, 2);
}

TEST(TrainingCheckpoint, SavingAStepAgainReplacesIt) {
  const ScratchDir root;
  auto first = sample_checkpoint(4);
  save_training_checkpoint(root.path(), first);
  auto second = sample_checkpoint(4);
  second.state["rng"] = "another state";
  second.kfac.clear();
  save_training_checkpoint(root.path(), second);
  EXPECT_EQ(entries_of(root.path()), (std::vector<std::string>{"latest", "step-00000004"}));
  testing::expect_same_checkpoint(*load_latest_checkpoint(root.path()), second);
}

TEST(TrainingCheckpoint, ImpossibleCheckpointsAreNotWritten) {
  const ScratchDir root;
  auto checkpoint = sample_checkpoint(1);
  checkpoint.step = -1;
  EXPECT_THROW(save_training_checkpoint(root.path(), checkpoint), std::invalid_argument);
  checkpoint = sample_checkpoint(1);
  checkpoint.weights.clear();
  EXPECT_THROW(save_training_checkpoint(root.path(), checkpoint), std::invalid_argument);
  checkpoint = sample_checkpoint(1);
  checkpoint.hf_config = "bert";
  EXPECT_THROW(save_training_checkpoint(root.path(), checkpoint), std::invalid_argument);
  checkpoint = sample_checkpoint(1);
  checkpoint.identity = nlohmann::json::array();
  EXPECT_THROW(save_training_checkpoint(root.path(), checkpoint), std::invalid_argument);
  EXPECT_THROW(save_training_checkpoint(root.path(), sample_checkpoint(1), 0),
               std::invalid_argument);
  // A duplicate tensor name fails in the middle of the save: nothing is left behind.
  checkpoint = sample_checkpoint(1);
  checkpoint.optimizer.push_back(checkpoint.optimizer.front());
  EXPECT_THROW(save_training_checkpoint(root.path(), checkpoint), std::invalid_argument);
  EXPECT_TRUE(entries_of(root.path()).empty());
  EXPECT_FALSE(load_latest_checkpoint(root.path()).has_value());
}

TEST(ResumeCompatibility, MatchingIdentityPasses) {
  const auto checkpoint = sample_checkpoint(100);
  EXPECT_NO_THROW(check_resume_compatible(checkpoint.identity, checkpoint));
}

TEST(ResumeCompatibility, EveryDifferingFieldIsNamed) {
  auto checkpoint = sample_checkpoint(100);
  checkpoint.identity["hidden_size"] = 256;
  auto run = checkpoint.identity;
  run["hidden_size"] = 512;
  run["optimizer"] = "adamw";
  run["data"]["seq_len"] = 512;
  run.erase("precision");
  run["kfac"] = true;
  const auto message = error_of([&] { check_resume_compatible(run, checkpoint); });
  expect_contains(message, "checkpoint step-00000100 does not match this run: ");
  expect_contains(message, "hidden_size is 256 in the checkpoint, 512 in this run");
  expect_contains(message, "optimizer is \"lamb\" in the checkpoint, \"adamw\" in this run");
  expect_contains(message, "data.seq_len is 128 in the checkpoint, 512 in this run");
  expect_contains(message, "precision is \"float32\" in the checkpoint, absent in this run");
  expect_contains(message, "kfac is absent in the checkpoint, true in this run");
  EXPECT_EQ(message.find("vocab_size"), std::string::npos) << message;
}

TEST(ResumeCompatibility, ALoadedCheckpointIsNamedByItsDirectory) {
  const ScratchDir root;
  save_training_checkpoint(root.path(), sample_checkpoint(100));
  const auto loaded = load_latest_checkpoint(root.path());
  auto run = loaded->identity;
  run["vocab_size"] = 30522;
  expect_contains(error_of([&] { check_resume_compatible(run, *loaded); }),
                  "checkpoint " + (root.path() / "step-00000100").string() +
                      " does not match this run: vocab_size is 5 in the checkpoint, 30522");
}

}  // namespace
}  // namespace pf::ckpt
