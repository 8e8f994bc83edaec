#include "runtime/data/vocabulary.h"

#include <fstream>
#include <sstream>
#include <stdexcept>

#include "runtime/data/text_file.h"
#include "runtime/data/unicode_text.h"

namespace pf::data {
namespace {

bool is_ascii_space(char c) {
  return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\v' || c == '\f';
}

std::string_view strip(std::string_view text) {
  while (!text.empty() && is_ascii_space(text.front())) text.remove_prefix(1);
  while (!text.empty() && is_ascii_space(text.back())) text.remove_suffix(1);
  return text;
}

}  // namespace

std::uint64_t fnv1a64(std::string_view bytes, std::uint64_t seed) {
  std::uint64_t hash = seed;
  for (const char c : bytes) {
    hash ^= static_cast<unsigned char>(c);
    hash *= 0x100000001b3ULL;
  }
  return hash;
}

Vocabulary Vocabulary::load(const std::string& path) {
  const std::string text = read_text_file(path);
  Vocabulary vocab;
  std::vector<std::size_t> line_numbers;
  std::size_t line_number = 0;
  for_each_line(text, [&](std::string_view line) {
    ++line_number;
    vocab.tokens_.emplace_back(strip(line));
    line_numbers.push_back(line_number);
  });
  vocab.index(path, line_numbers);
  return vocab;
}

Vocabulary Vocabulary::from_tokens(std::vector<std::string> tokens, const std::string& origin) {
  Vocabulary vocab;
  vocab.tokens_ = std::move(tokens);
  std::vector<std::size_t> line_numbers(vocab.tokens_.size());
  for (std::size_t i = 0; i < line_numbers.size(); ++i) line_numbers[i] = i + 1;
  vocab.index(origin, line_numbers);
  return vocab;
}

Vocabulary::Vocabulary(const Vocabulary& other) : tokens_(other.tokens_) {
  std::vector<std::size_t> line_numbers(tokens_.size());
  for (std::size_t i = 0; i < line_numbers.size(); ++i) line_numbers[i] = i + 1;
  index("copy", line_numbers);
}

Vocabulary& Vocabulary::operator=(const Vocabulary& other) {
  if (this != &other) {
    Vocabulary copy(other);
    *this = std::move(copy);
  }
  return *this;
}

void Vocabulary::index(const std::string& origin, const std::vector<std::size_t>& line_numbers) {
  if (tokens_.empty()) throw std::invalid_argument(origin + ": vocabulary is empty");
  if (tokens_.size() > 0x7fffffffU) throw std::invalid_argument(origin + ": vocabulary too large");
  by_token_.clear();
  by_continuation_.clear();
  by_token_.reserve(tokens_.size());
  continuation_.assign(tokens_.size(), false);
  max_token_bytes_ = 0;
  max_continuation_bytes_ = 0;
  hash_ = fnv1a64("");
  for (std::size_t i = 0; i < tokens_.size(); ++i) {
    const std::string& token = tokens_[i];
    const auto bad = find_invalid_utf8(token);
    if (bad != std::string_view::npos) {
      throw std::invalid_argument(origin + ":" + std::to_string(line_numbers[i]) +
                                  ": invalid UTF-8 at byte " + std::to_string(bad));
    }
    const auto id = static_cast<TokenId>(i);
    const auto [it, inserted] = by_token_.emplace(std::string_view(token), id);
    if (!inserted) {
      throw std::invalid_argument(
          origin + ":" + std::to_string(line_numbers[i]) + ": duplicate token '" + token +
          "' (first on line " + std::to_string(line_numbers[static_cast<std::size_t>(it->second)]) +
          ")");
    }
    max_token_bytes_ = std::max(max_token_bytes_, token.size());
    if (token.size() > 2 && token.starts_with("##")) {
      const std::string_view piece = std::string_view(token).substr(2);
      by_continuation_.emplace(piece, id);
      continuation_[i] = true;
      max_continuation_bytes_ = std::max(max_continuation_bytes_, piece.size());
    }
    if (i > 0) hash_ = fnv1a64("\n", hash_);
    hash_ = fnv1a64(token, hash_);
  }
  std::string missing;
  auto require = [&](const char* name, TokenId& slot) {
    const auto found = find(name);
    if (found) {
      slot = *found;
    } else {
      missing += missing.empty() ? "" : " ";
      missing += name;
    }
  };
  require("[PAD]", special_.pad);
  require("[UNK]", special_.unk);
  require("[CLS]", special_.cls);
  require("[SEP]", special_.sep);
  require("[MASK]", special_.mask);
  if (!missing.empty()) {
    throw std::invalid_argument(origin + ": vocabulary lacks the special token(s) " + missing +
                                " (BERT needs [PAD] [UNK] [CLS] [SEP] [MASK])");
  }
}

std::optional<TokenId> Vocabulary::find(std::string_view token) const {
  const auto it = by_token_.find(token);
  if (it == by_token_.end()) return std::nullopt;
  return it->second;
}

std::optional<TokenId> Vocabulary::find_continuation(std::string_view piece) const {
  const auto it = by_continuation_.find(piece);
  if (it == by_continuation_.end()) return std::nullopt;
  return it->second;
}

void Vocabulary::save(const std::string& path) const {
  std::string text;
  for (const auto& token : tokens_) {
    text += token;
    text += '\n';
  }
  write_text_file(path, text);
}

}  // namespace pf::data
