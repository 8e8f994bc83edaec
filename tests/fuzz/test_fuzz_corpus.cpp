// Replays the committed corpus (corpus/<target>/*: the seeds that make_fuzz_corpus writes with the
// project's own writers, the crafted files of issue #16's defects, and anything a fuzzer found)
// through the fuzzers' entry points. Every file must be accepted or rejected the documented way;
// the crafted files must be rejected with the message that names file, field, value and limit.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_targets.h"

namespace pf::fuzz {
namespace {

namespace fs = std::filesystem;

const fs::path kCorpus = PF_FUZZ_CORPUS_DIR;

std::vector<std::uint8_t> read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<fs::path> files_of(std::string_view target) {
  std::vector<fs::path> files;
  const fs::path directory = kCorpus / target;
  if (!fs::is_directory(directory)) return files;
  for (const auto& entry : fs::directory_iterator(directory)) {
    if (entry.is_regular_file()) files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

// What the run of one crafted file must say (substrings of the error; the file name is checked by
// run_target itself).
struct Crafted {
  std::string_view target;
  std::string_view file;
  std::vector<std::string_view> message;
};

const std::vector<Crafted>& crafted_files() {
  static const std::vector<Crafted> files = {
      // Defect 1: 4 * hidden_size overflowed int before validation.
      {"hf_config",
       "defect1-hidden-size-600000000.json",
       {"field 'hidden_size' = 600000000 (allowed: an integer in [1, 1048576])"}},
      // Defect 2: a 64-bit layer count narrowed to int read as 1 layer.
      {"hf_config",
       "defect2-layers-4294967297.json",
       {"field 'num_hidden_layers' = 4294967297 (allowed: an integer in [1, 4096])"}},
      // Defect 3: first_layer + num_layers overflowed; the placement was accepted.
      {"schedule_json",
       "defect3-first-layer-2147483647.json",
       {"layers [2147483647, 2147483648) outside the model's 2 layers"}},
      // Defect 4: tables sized by the largest index: 4 GiB and a bare std::bad_alloc.
      {"profile", "defect4-index-1073741824.json", {"no entry in 'chunks' for pipeline 0 chunk 0"}},
      // Defect 5: 64 + 2^58 * record_bytes wrapped to the file size: "checksum ok".
      {"shard",
       "defect5-instances-2pow58.pfshard",
       {"header field 'num_instances' = 288230376151711744", "hold at most 0 records"}},
      // Smaller: nlohmann's bare type error without the file name.
      {"device", "name-not-a-string.json", {"field 'name' = 42 (allowed: a string)"}},
      // Found after the first fuzzing round, by reading: copying, comparing and quoting a JSON
      // value recurse per level, so deep nesting overflowed the stack (exit 139).
      {"device", "peak-flops-nested-1000-deep.json", {"JSON nested deeper than 256 levels"}},
      {"checkpoint_state_json",
       "identity-nested-1000-deep.json",
       {"state.json: JSON nested deeper than 256 levels"}},
  };
  return files;
}

class FuzzCorpus : public ::testing::TestWithParam<Target> {};

}  // namespace

// Test listings show the target's name, not the struct's bytes (which hold addresses).
void PrintTo(const Target& target, std::ostream* out) {
  *out << target.name;
}

namespace {

TEST_P(FuzzCorpus, EveryFileIsAcceptedOrRejectedTheDocumentedWay) {
  const Target& target = GetParam();
  const auto files = files_of(target.name);
  ASSERT_FALSE(files.empty()) << "no corpus for " << target.name << " under " << kCorpus;
  std::size_t accepted = 0;
  for (const fs::path& file : files) {
    SCOPED_TRACE(file.string());
    const auto bytes = read_bytes(file);
    std::optional<std::string> rejection;
    try {
      rejection = run_target(target, bytes);
    } catch (const std::exception& error) {
      ADD_FAILURE() << "escaped " << typeid(error).name() << ": " << error.what();
      continue;
    }
    if (!rejection) ++accepted;
    for (const Crafted& crafted : crafted_files()) {
      if (crafted.target != target.name || crafted.file != file.filename().string()) continue;
      ASSERT_TRUE(rejection.has_value()) << "the crafted file was accepted";
      for (const std::string_view needle : crafted.message) {
        EXPECT_NE(rejection->find(needle), std::string::npos) << *rejection;
      }
    }
  }
  // The seeds written by the project's own programs must be accepted.
  EXPECT_GT(accepted, 0U) << target.name;
}

TEST(FuzzCorpus, EveryCraftedFileIsCommitted) {
  for (const Crafted& crafted : crafted_files()) {
    EXPECT_TRUE(fs::is_regular_file(kCorpus / crafted.target / crafted.file))
        << crafted.target << "/" << crafted.file;
  }
}

TEST(FuzzCorpus, EveryCorpusDirectoryIsATarget) {
  // scripts/fuzz.sh runs one harness per corpus directory.
  for (const auto& entry : fs::directory_iterator(kCorpus)) {
    if (!entry.is_directory()) continue;
    EXPECT_NO_THROW(target_named(entry.path().filename().string()));
  }
}

TEST(FuzzCorpus, RejectionsNameTheFile) {
  // The contract run_target enforces for every fuzzed input: an error that does not name the
  // file is itself a finding.
  const std::string garbage = "{ not json";
  const std::span bytes(reinterpret_cast<const std::uint8_t*>(garbage.data()), garbage.size());
  const auto message = run_target(target_named("hf_config"), bytes);
  ASSERT_TRUE(message.has_value());
  EXPECT_NE(message->find("/proc/self/fd/"), std::string::npos) << *message;
  EXPECT_THROW(target_named("nothing"), std::invalid_argument);
}

INSTANTIATE_TEST_SUITE_P(AllTargets, FuzzCorpus,
                         ::testing::ValuesIn(targets().begin(), targets().end()),
                         [](const auto& param_info) { return std::string(param_info.param.name); });

}  // namespace
}  // namespace pf::fuzz
