// UTF-8 decoding and the Unicode character classes BERT's basic tokenizer relies on.
// Unicode data (categories, case mapping, canonical decomposition) comes from utf8proc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace pf::data {

// Decodes the code point starting at text[pos]. Returns its length in bytes (1-4), or 0 when
// the bytes there are not well-formed UTF-8 (overlong forms, surrogates, > U+10FFFF, truncation).
int decode_utf8(std::string_view text, std::size_t pos, char32_t& code_point);

void append_utf8(std::string& out, char32_t code_point);

// Byte offset of the first ill-formed sequence, or std::string_view::npos when valid.
std::size_t find_invalid_utf8(std::string_view text);

// Copies `text` to `out` without its ill-formed bytes (like Python's decode(errors="ignore"),
// one byte at a time). Returns the number of bytes dropped.
std::size_t drop_invalid_utf8(std::string_view text, std::string& out);

// BERT's classes (google-research/bert tokenization.py):
//   whitespace: space, \t, \n, \r and category Zs;
//   control: categories Cc and Cf except \t, \n, \r (removed from the text);
//   punctuation: every non-alphanumeric printable ASCII character and categories P*;
//   CJK ideograph: the CJK Unified Ideographs blocks and their extensions/compatibility blocks.
bool is_bert_whitespace(char32_t code_point);
bool is_bert_control(char32_t code_point);
bool is_bert_punctuation(char32_t code_point);
bool is_cjk_ideograph(char32_t code_point);
// Characters Python's str.split() also splits on after BERT's cleaning (U+2028, U+2029, ...).
bool is_python_space(char32_t code_point);

// Python's str.lower() on a whole word (simple case mapping plus the Final_Sigma rule),
// appended to `out`.
void python_lower(std::u32string_view word, std::u32string& out);

// NFD (canonical decomposition and canonical ordering) without nonspacing marks (category Mn):
// BERT's accent stripping. Appends to `out`.
void strip_accents_nfd(std::u32string_view word, std::u32string& out);

}  // namespace pf::data
