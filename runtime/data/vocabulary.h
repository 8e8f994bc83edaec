// A WordPiece vocabulary (BERT's vocab.txt: one token per line, the line number is the id).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace pf::data {

using TokenId = std::int32_t;

struct SpecialTokenIds {
  TokenId pad = 0;
  TokenId unk = 0;
  TokenId cls = 0;
  TokenId sep = 0;
  TokenId mask = 0;
};

class Vocabulary {
 public:
  // Reads vocab.txt. Each line is one token, stripped of surrounding whitespace (as BERT's
  // load_vocab does). Throws std::runtime_error when the file cannot be read and
  // std::invalid_argument (with file and line) on invalid UTF-8, duplicate tokens, or missing
  // special tokens [PAD] [UNK] [CLS] [SEP] [MASK].
  static Vocabulary load(const std::string& path);
  // Same checks on an in-memory token list (`origin` names it in error messages).
  static Vocabulary from_tokens(std::vector<std::string> tokens,
                                const std::string& origin = "token list");

  Vocabulary(const Vocabulary& other);
  Vocabulary& operator=(const Vocabulary& other);
  Vocabulary(Vocabulary&&) noexcept = default;
  Vocabulary& operator=(Vocabulary&&) noexcept = default;
  ~Vocabulary() = default;

  std::size_t size() const { return tokens_.size(); }
  const std::string& token(TokenId id) const { return tokens_.at(static_cast<std::size_t>(id)); }
  std::optional<TokenId> find(std::string_view token) const;
  // Looks up "##" + piece without building the string.
  std::optional<TokenId> find_continuation(std::string_view piece) const;
  bool is_continuation(TokenId id) const { return continuation_[static_cast<std::size_t>(id)]; }
  const SpecialTokenIds& special() const { return special_; }
  // Longest token / continuation piece in bytes: longer substrings need no lookup.
  std::size_t max_token_bytes() const { return max_token_bytes_; }
  std::size_t max_continuation_bytes() const { return max_continuation_bytes_; }
  // FNV-1a 64 of the tokens joined by '\n': identifies the vocabulary in shard headers.
  std::uint64_t hash() const { return hash_; }

  void save(const std::string& path) const;

 private:
  Vocabulary() = default;
  void index(const std::string& origin, const std::vector<std::size_t>& line_numbers);

  std::vector<std::string> tokens_;
  std::unordered_map<std::string_view, TokenId> by_token_;
  std::unordered_map<std::string_view, TokenId> by_continuation_;
  std::vector<bool> continuation_;
  SpecialTokenIds special_;
  std::size_t max_token_bytes_ = 0;
  std::size_t max_continuation_bytes_ = 0;
  std::uint64_t hash_ = 0;
};

std::uint64_t fnv1a64(std::string_view bytes, std::uint64_t seed = 0xcbf29ce484222325ULL);

}  // namespace pf::data
