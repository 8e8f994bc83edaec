// Trains a WordPiece vocabulary from text: words from BERT's basic tokenizer, then the
// frequency-driven merge procedure (as Hugging Face's WordPiece trainer does: BPE merges with
// "##" marking pieces that continue a word).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "runtime/data/basic_tokenizer.h"

namespace pf::data {

struct VocabTrainerOptions {
  std::size_t vocab_size = 30522;     // including the special tokens
  std::size_t min_frequency = 2;      // stop merging when the best pair is rarer
  std::size_t alphabet_limit = 1000;  // most frequent characters kept as initial pieces
  // Fill up to vocab_size with "[unusedN]" when merging stops early (BERT-shaped embeddings).
  bool pad_to_size = true;
};

struct VocabTrainerStats {
  std::uint64_t words = 0;
  std::size_t distinct_words = 0;
  std::size_t alphabet = 0;
  std::size_t merges = 0;
  std::size_t padding = 0;
};

struct TransparentStringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view text) const {
    return std::hash<std::string_view>{}(text);
  }
};
using WordCounts =
    std::unordered_map<std::string, std::uint64_t, TransparentStringHash, std::equal_to<>>;

// Counts the basic tokenizer's words of each line of `text`. Throws std::invalid_argument on
// invalid UTF-8 (the caller adds file and line).
void count_words(const BasicTokenizer& tokenizer, std::string_view text, WordCounts& counts,
                 BasicTokens& scratch);

// The vocabulary: [PAD] [UNK] [CLS] [SEP] [MASK], the alphabet (each character and "##" form),
// then merged pieces in merge order, then padding.
std::vector<std::string> train_wordpiece_vocab(const WordCounts& counts,
                                               const VocabTrainerOptions& options,
                                               VocabTrainerStats* stats = nullptr);

}  // namespace pf::data
