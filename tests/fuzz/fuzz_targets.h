#pragma once
// One entry point per parser, shared by the libFuzzer harnesses (fuzz_<target>, built with clang
// and PF_BUILD_FUZZERS=ON) and by the corpus replay test of the normal suite (test_fuzz_corpus),
// so that a crafted file committed under corpus/<target>/ runs through exactly the code a
// fuzzer exercised. Each entry point reads its input the way the programs do (through a file
// path, for file readers) and then uses what it read.
//
// The contract every parser must keep, checked here: bad input ends in std::invalid_argument or
// pf::InputError whose message names the file; anything else that escapes (std::bad_alloc, a
// bare nlohmann::json exception, std::out_of_range, a sanitizer report, a hang) is a finding.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/checkpoint/training_checkpoint.h"

namespace pf::fuzz {

struct Target {
  std::string_view name;
  // Optional: adjusts the fuzzer's bytes before they become the file (e.g. fixes a checksum that
  // would otherwise stop every mutation at the first check).
  void (*prepare)(std::vector<std::uint8_t>& bytes);
  // Reads `input` from `path` (a file holding exactly those bytes) and uses what it read.
  void (*run)(std::span<const std::uint8_t> input, const std::string& path);
  bool names_file;  // its error messages must contain the path
};

std::span<const Target> targets();

// The small checkpoint behind the checkpoint_* targets; make_fuzz_corpus saves the same one, so
// that the committed manifest seed matches the files the harness writes.
ckpt::TrainingCheckpoint sample_training_checkpoint();
// Throws std::invalid_argument listing the known names.
const Target& target_named(std::string_view name);

// Runs `target` on `input`: std::nullopt when accepted, the error message when rejected the
// documented way. Anything else propagates; a rejection whose message lacks the file name
// becomes a std::logic_error (a finding).
std::optional<std::string> run_target(const Target& target, std::span<const std::uint8_t> input);

}  // namespace pf::fuzz
