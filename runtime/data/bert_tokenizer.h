// BERT's full tokenizer: the basic tokenizer, then greedy longest-match-first WordPiece.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/data/basic_tokenizer.h"
#include "runtime/data/vocabulary.h"

namespace pf::data {

struct TokenizerOptions {
  bool lower_case = true;
  // Words longer than this (in code points) become [UNK]. Hugging Face's BertTokenizer uses 100;
  // google-research/bert's WordpieceTokenizer uses 200.
  std::size_t max_word_chars = 100;
};

class BertTokenizer {
 public:
  // Keeps a reference to `vocab`, which must outlive the tokenizer.
  explicit BertTokenizer(const Vocabulary& vocab, TokenizerOptions options = {});

  // Appends the ids of `text` to `ids`; `scratch` is reused between calls to avoid allocation.
  // Throws std::invalid_argument on invalid UTF-8.
  void encode(std::string_view text, std::vector<TokenId>& ids, BasicTokens& scratch) const;
  std::vector<TokenId> encode(std::string_view text) const;
  std::vector<std::string> tokenize(std::string_view text) const;

  // WordPiece of one basic word, appended to `ids`.
  void wordpiece(std::string_view word, std::vector<TokenId>& ids) const;

  const Vocabulary& vocab() const { return vocab_; }
  const TokenizerOptions& options() const { return options_; }
  const BasicTokenizer& basic() const { return basic_; }

 private:
  const Vocabulary& vocab_;
  TokenizerOptions options_;
  BasicTokenizer basic_;
};

}  // namespace pf::data
