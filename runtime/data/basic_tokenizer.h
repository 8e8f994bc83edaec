// BERT's basic tokenizer: clean control characters, split on whitespace, optionally lower-case
// and strip accents, split off punctuation and CJK ideographs.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pf::data {

// The words of one text, stored in one buffer so that reusing it allocates nothing.
class BasicTokens {
 public:
  void clear() {
    text_.clear();
    spans_.clear();
  }
  std::size_t size() const { return spans_.size(); }
  bool empty() const { return spans_.empty(); }
  std::string_view operator[](std::size_t i) const {
    return std::string_view(text_).substr(spans_[i].first, spans_[i].second - spans_[i].first);
  }
  std::vector<std::string> to_strings() const;

  // Used by the tokenizer: the current word is text()[word_start(), end).
  std::string& buffer() { return text_; }
  // Scratch for the word being cleaned (kept to avoid an allocation per call).
  std::string& raw_word() { return raw_; }
  std::u32string& code_points() { return code_points_; }
  std::u32string& lowered() { return lowered_; }
  void add_word(std::size_t begin) {
    if (text_.size() > begin) spans_.emplace_back(begin, text_.size());
  }

 private:
  std::string text_;
  std::string raw_;
  std::u32string code_points_;
  std::u32string lowered_;
  std::vector<std::pair<std::size_t, std::size_t>> spans_;
};

class BasicTokenizer {
 public:
  explicit BasicTokenizer(bool lower_case = true);

  // Appends the words of `text` to `out`. Throws std::invalid_argument("invalid UTF-8 at byte N")
  // on ill-formed input (clean it with drop_invalid_utf8 first to skip such bytes).
  void split(std::string_view text, BasicTokens& out) const;
  std::vector<std::string> split(std::string_view text) const;

  bool lower_case() const { return lower_case_; }

 private:
  void finish_ascii_word(std::string_view raw, BasicTokens& out) const;
  void finish_unicode_word(std::string_view raw, BasicTokens& out) const;

  bool lower_case_;
  // Per ASCII byte: what the cleaning and splitting steps do with it.
  enum class AsciiClass : std::uint8_t { kWord, kSpace, kDrop, kPunctuation };
  AsciiClass ascii_class_[128];
};

}  // namespace pf::data
