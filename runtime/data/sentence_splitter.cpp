#include "runtime/data/sentence_splitter.h"

#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cctype>

#include "runtime/data/text_file.h"
#include "runtime/data/unicode_text.h"

namespace pf::data {
namespace {

constexpr std::array<std::string_view, 44> kAbbreviations = {
    "mr",     "mrs",  "ms",  "dr",   "prof", "sr",   "jr",  "st",  "vs",  "etc", "cf",
    "fig",    "figs", "no",  "nos",  "vol",  "vols", "eq",  "eqs", "sec", "ch",  "al",
    "approx", "dept", "inc", "ltd",  "co",   "corp", "jan", "feb", "mar", "apr", "jun",
    "jul",    "aug",  "sep", "sept", "oct",  "nov",  "dec", "gen", "gov", "rev", "resp"};

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
bool is_terminator(char c) {
  return c == '.' || c == '!' || c == '?';
}
bool is_closer(char c) {
  return c == '"' || c == '\'' || c == ')' || c == ']';
}
bool is_opener(char c) {
  return c == '"' || c == '\'' || c == '(' || c == '[';
}

bool starts_sentence(std::string_view text, std::size_t pos) {
  if (pos >= text.size()) return false;
  const auto byte = static_cast<unsigned char>(text[pos]);
  if (byte < 0x80)
    return std::isupper(byte) != 0 || std::isdigit(byte) != 0 || is_opener(text[pos]);
  char32_t cp = 0;
  if (decode_utf8(text, pos, cp) == 0) return false;
  if (cp == 0x201C || cp == 0x2018 || cp == 0x00AB) return true;  // opening quotes
  const auto category = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return category == UTF8PROC_CATEGORY_LU || category == UTF8PROC_CATEGORY_LT;
}

// Is the '.' at `dot` part of an abbreviation, an initial, or a dotted word?
bool is_abbreviation_dot(std::string_view text, std::size_t dot) {
  std::size_t begin = dot;
  while (begin > 0 && !is_space(text[begin - 1]) && text[begin - 1] != '(') --begin;
  std::string_view word = text.substr(begin, dot - begin);
  if (word.empty()) return false;
  // Abbreviations are letters (and inner dots): "U.S", "e.g", "Mr". A word ending in a bracket
  // or holding other symbols (URLs, file names) ends a sentence normally.
  const bool letters_and_dots = std::all_of(word.begin(), word.end(), [](char c) {
    return std::isalpha(static_cast<unsigned char>(c)) != 0 || c == '.';
  });
  if (!letters_and_dots) return false;
  if (word.find('.') != std::string_view::npos) return true;  // e.g., U.S., i.e.
  if (word.size() == 1 && std::isalpha(static_cast<unsigned char>(word[0])) != 0) return true;
  std::string lower(word);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return std::find(kAbbreviations.begin(), kAbbreviations.end(), lower) != kAbbreviations.end();
}

std::string collapse_spaces(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  bool pending_space = false;
  for (const char c : text) {
    if (is_space(c)) {
      pending_space = !out.empty();
    } else {
      if (pending_space) out.push_back(' ');
      pending_space = false;
      out.push_back(c);
    }
  }
  return out;
}

}  // namespace

std::vector<std::string> split_sentences(std::string_view paragraph) {
  const std::string text = collapse_spaces(paragraph);
  std::vector<std::string> sentences;
  std::size_t start = 0;
  std::size_t pos = 0;
  while (pos < text.size()) {
    if (!is_terminator(text[pos])) {
      ++pos;
      continue;
    }
    std::size_t end = pos;
    while (end < text.size() && is_terminator(text[end])) ++end;
    const bool single_dot = end == pos + 1 && text[pos] == '.';
    while (end < text.size() && is_closer(text[end])) ++end;
    const bool boundary = end < text.size() && text[end] == ' ' && starts_sentence(text, end + 1) &&
                          !(single_dot && is_abbreviation_dot(text, pos));
    if (boundary) {
      sentences.push_back(text.substr(start, end - start));
      start = end + 1;
    }
    pos = end;
  }
  if (start < text.size()) sentences.push_back(text.substr(start));
  return sentences;
}

std::string paragraphs_to_sentences(std::string_view text) {
  std::string out;
  std::string paragraph;
  std::size_t blank_run = 0;
  auto flush = [&] {
    for (const std::string& sentence : split_sentences(paragraph)) {
      out += sentence;
      out += '\n';
    }
    paragraph.clear();
  };
  auto new_document = [&] {
    if (!out.empty() && !out.ends_with("\n\n")) out += '\n';
  };
  for_each_line(text, [&](std::string_view line) {
    const bool form_feed =
        line.find('\f') != std::string_view::npos &&
        std::all_of(line.begin(), line.end(), [](char c) { return is_space(c); });
    const bool blank = std::all_of(line.begin(), line.end(), [](char c) { return is_space(c); });
    if (blank) {
      flush();
      ++blank_run;
      if (form_feed || blank_run == 2) new_document();
      return;
    }
    blank_run = 0;
    paragraph += ' ';
    paragraph += line;
  });
  flush();
  new_document();
  return out;
}

}  // namespace pf::data
