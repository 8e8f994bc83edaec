// Small corpora and vocabularies made inside the data tests.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "runtime/data/python_random.h"
#include "runtime/data/vocabulary.h"

namespace pf::data::testing {

inline std::vector<std::string> word_list() {
  return {"the", "cat", "sat",  "on", "mat",  "dog",  "ran",    "far", "away", "from", "home",
          "big", "red", "ball", "is", "here", "they", "played", "all", "day",  "and",  "night"};
}

inline Vocabulary small_vocab() {
  std::vector<std::string> tokens = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ","};
  for (const auto& word : word_list()) tokens.push_back(word);
  for (const auto& piece : {"##s", "##ed", "##ing"}) tokens.emplace_back(piece);
  return Vocabulary::from_tokens(tokens, "small test vocabulary");
}

// `documents` documents of 3-12 sentences of 3-14 words each, in BERT's input format.
inline std::string random_corpus(std::size_t documents, std::uint64_t seed) {
  PythonRandom rng(seed);
  const auto words = word_list();
  std::string text;
  for (std::size_t d = 0; d < documents; ++d) {
    const auto sentences = rng.randint(3, 12);
    for (std::int64_t s = 0; s < sentences; ++s) {
      const auto length = rng.randint(3, 14);
      for (std::int64_t w = 0; w < length; ++w) {
        if (w > 0) text += ' ';
        text += words[static_cast<std::size_t>(rng.below(words.size()))];
      }
      text += " .\n";
    }
    text += '\n';
  }
  return text;
}

// A fresh directory under the system temp directory, removed on destruction. Named by the
// process and the object: ctest runs tests in parallel processes, and under ASan (no address
// randomisation) two of them placed their TempDir at one address, so that one removed the
// other's files.
class TempDir {
 public:
  explicit TempDir(const std::string& name)
      : path_(std::filesystem::temp_directory_path() /
              (name + "-" + std::to_string(::getpid()) + "-" +
               std::to_string(reinterpret_cast<std::uintptr_t>(this)))) {
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::string path() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace pf::data::testing
