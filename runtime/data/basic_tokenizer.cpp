#include "runtime/data/basic_tokenizer.h"

#include <stdexcept>

#include "runtime/data/unicode_text.h"

namespace pf::data {

std::vector<std::string> BasicTokens::to_strings() const {
  std::vector<std::string> words;
  words.reserve(size());
  for (std::size_t i = 0; i < size(); ++i) words.emplace_back((*this)[i]);
  return words;
}

BasicTokenizer::BasicTokenizer(bool lower_case) : lower_case_(lower_case) {
  for (char32_t c = 0; c < 128; ++c) {
    AsciiClass cls = AsciiClass::kWord;
    if (c == 0 || is_bert_control(c)) {
      cls = AsciiClass::kDrop;
    } else if (is_bert_whitespace(c)) {
      cls = AsciiClass::kSpace;
    } else if (is_bert_punctuation(c)) {
      cls = AsciiClass::kPunctuation;
    }
    ascii_class_[c] = cls;
  }
}

std::vector<std::string> BasicTokenizer::split(std::string_view text) const {
  BasicTokens tokens;
  split(text, tokens);
  return tokens.to_strings();
}

void BasicTokenizer::split(std::string_view text, BasicTokens& out) const {
  // A "raw word" is a run between whitespace after cleaning (BERT's first whitespace split);
  // lower-casing and accent stripping apply to it as a whole, then punctuation splits it.
  std::string& raw = out.raw_word();
  raw.clear();
  bool raw_is_ascii = true;
  auto finish = [&] {
    if (raw.empty()) return;
    if (raw_is_ascii) {
      finish_ascii_word(raw, out);
    } else {
      finish_unicode_word(raw, out);
    }
    raw.clear();
    raw_is_ascii = true;
  };
  std::size_t pos = 0;
  while (pos < text.size()) {
    const auto byte = static_cast<unsigned char>(text[pos]);
    if (byte < 0x80U) {
      ++pos;
      switch (ascii_class_[byte]) {
        case AsciiClass::kSpace:
          finish();
          break;
        case AsciiClass::kDrop:
          break;
        case AsciiClass::kWord:
        case AsciiClass::kPunctuation:
          raw.push_back(static_cast<char>(byte));
          break;
      }
      continue;
    }
    char32_t cp = 0;
    const int length = decode_utf8(text, pos, cp);
    if (length == 0) {
      throw std::invalid_argument("invalid UTF-8 at byte " + std::to_string(pos));
    }
    const std::string_view bytes = text.substr(pos, static_cast<std::size_t>(length));
    pos += static_cast<std::size_t>(length);
    if (cp == 0xFFFD || is_bert_control(cp)) continue;
    if (is_python_space(cp)) {
      finish();
    } else if (is_cjk_ideograph(cp)) {
      finish();
      finish_unicode_word(bytes, out);
    } else {
      raw.append(bytes);
      raw_is_ascii = false;
    }
  }
  finish();
}

void BasicTokenizer::finish_ascii_word(std::string_view raw, BasicTokens& out) const {
  std::string& buffer = out.buffer();
  std::size_t word_start = buffer.size();
  for (const char c : raw) {
    const auto byte = static_cast<unsigned char>(c);
    if (ascii_class_[byte] == AsciiClass::kPunctuation) {
      out.add_word(word_start);
      word_start = buffer.size();
      buffer.push_back(c);
      out.add_word(word_start);
      word_start = buffer.size();
    } else {
      buffer.push_back((lower_case_ && c >= 'A' && c <= 'Z') ? static_cast<char>(c + 32) : c);
    }
  }
  out.add_word(word_start);
}

void BasicTokenizer::finish_unicode_word(std::string_view raw, BasicTokens& out) const {
  std::u32string& chars = out.code_points();
  chars.clear();
  for (std::size_t pos = 0; pos < raw.size();) {
    char32_t cp = 0;
    pos += static_cast<std::size_t>(decode_utf8(raw, pos, cp));  // raw is already validated
    chars.push_back(cp);
  }
  if (lower_case_) {
    std::u32string& lowered = out.lowered();
    lowered.clear();
    python_lower(chars, lowered);
    chars.clear();
    strip_accents_nfd(lowered, chars);
  }
  std::string& buffer = out.buffer();
  std::size_t word_start = buffer.size();
  for (const char32_t cp : chars) {
    if (is_python_space(cp)) {
      out.add_word(word_start);
      word_start = buffer.size();
    } else if (is_bert_punctuation(cp)) {
      out.add_word(word_start);
      word_start = buffer.size();
      append_utf8(buffer, cp);
      out.add_word(word_start);
      word_start = buffer.size();
    } else {
      append_utf8(buffer, cp);
    }
  }
  out.add_word(word_start);
}

}  // namespace pf::data
