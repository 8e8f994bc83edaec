#include "runtime/data/rst_corpus.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <filesystem>
#include <stdexcept>

#include "common/input_error.h"
#include "runtime/data/sentence_splitter.h"
#include "runtime/data/text_file.h"

namespace pf::data {
namespace {

// Directives whose indented body is prose (admonitions and object descriptions).
constexpr std::array<std::string_view, 34> kProseDirectives = {"note",
                                                               "warning",
                                                               "versionadded",
                                                               "versionchanged",
                                                               "deprecated",
                                                               "deprecated-removed",
                                                               "seealso",
                                                               "attention",
                                                               "caution",
                                                               "danger",
                                                               "error",
                                                               "hint",
                                                               "important",
                                                               "tip",
                                                               "admonition",
                                                               "impl-detail",
                                                               "function",
                                                               "class",
                                                               "method",
                                                               "attribute",
                                                               "data",
                                                               "exception",
                                                               "describe",
                                                               "decorator",
                                                               "decoratormethod",
                                                               "classmethod",
                                                               "staticmethod",
                                                               "coroutinefunction",
                                                               "coroutinemethod",
                                                               "abstractmethod",
                                                               "opcode",
                                                               "option",
                                                               "envvar",
                                                               "cmdoption"};

bool is_blank(std::string_view line) {
  return std::all_of(line.begin(), line.end(), [](char c) { return c == ' ' || c == '\t'; });
}

std::size_t indent_of(std::string_view line) {
  std::size_t column = 0;
  for (const char c : line) {
    if (c == ' ') {
      ++column;
    } else if (c == '\t') {
      column = (column / 8 + 1) * 8;
    } else {
      break;
    }
  }
  return column;
}

std::string_view trim(std::string_view text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t')) text.remove_suffix(1);
  return text;
}

// A section adornment: one punctuation character repeated (at least 3 times).
bool is_adornment(std::string_view line) {
  if (line.size() < 3) return false;
  const char c = line.front();
  if (std::isalnum(static_cast<unsigned char>(c)) != 0 ||
      std::isspace(static_cast<unsigned char>(c)) != 0 || static_cast<unsigned char>(c) >= 0x80) {
    return false;
  }
  return std::all_of(line.begin(), line.end(), [c](char x) { return x == c; });
}

bool is_table_line(std::string_view line) {
  if (line.starts_with("+-") || line.starts_with("+=")) return true;
  // simple-table border: runs of '=' separated by spaces
  return line.starts_with("==") &&
         std::all_of(line.begin(), line.end(), [](char x) { return x == '=' || x == ' '; });
}

// ":name: value" option or field line (not an inline role, which has a backquote).
bool is_field_line(std::string_view line) {
  if (line.size() < 3 || line.front() != ':') return false;
  const std::size_t close = line.find(':', 1);
  if (close == std::string_view::npos || close == 1) return false;
  for (std::size_t i = 1; i < close; ++i) {
    const char c = line[i];
    if (std::isalnum(static_cast<unsigned char>(c)) == 0 && c != '-' && c != '_' && c != ' ')
      return false;
  }
  return close + 1 == line.size() || line[close + 1] == ' ';
}

// Removes a list marker ("* ", "- ", "#. ", "1. ", "(a) ") at the start of a line.
std::string_view strip_bullet(std::string_view line) {
  if (line.size() >= 2 && (line[0] == '*' || line[0] == '-' || line[0] == '+') && line[1] == ' ') {
    return trim(line.substr(2));
  }
  std::size_t i = 0;
  while (i < line.size() && std::isdigit(static_cast<unsigned char>(line[i])) != 0) ++i;
  if ((i > 0 || (line.size() > 1 && line[0] == '#')) && i < 4) {
    const std::size_t dot = i > 0 ? i : 1;
    if (dot + 1 < line.size() && line[dot] == '.' && line[dot + 1] == ' ')
      return trim(line.substr(dot + 2));
  }
  return line;
}

bool is_role_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_' || c == '.' || c == ':' ||
         c == '+' || c == '-';
}

std::string role_text(std::string_view role, std::string_view content) {
  std::string_view text = trim(content);
  const std::size_t angle = text.rfind(" <");
  if (!text.empty() && text.back() == '>' && angle != std::string_view::npos) {
    return std::string(trim(text.substr(0, angle)));
  }
  if (text.starts_with('!')) text.remove_prefix(1);
  if (text.starts_with('~')) {
    text.remove_prefix(1);
    const std::size_t dot = text.rfind('.');
    if (dot != std::string_view::npos) text = text.substr(dot + 1);
  }
  if (role == "pep") return "PEP " + std::string(text);
  if (role == "rfc") return "RFC " + std::string(text);
  return std::string(text);
}

bool is_word_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) != 0 || static_cast<unsigned char>(c) >= 0x80;
}

}  // namespace

std::string strip_inline_rst(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  std::size_t i = 0;
  while (i < text.size()) {
    const char c = text[i];
    if (c == '\\' && i + 1 < text.size()) {  // escapes: "\ " disappears, "\x" is x
      if (text[i + 1] != ' ') out.push_back(text[i + 1]);
      i += 2;
      continue;
    }
    if (c == ':' && (i == 0 || !is_word_char(text[i - 1]))) {  // :role:`content`
      std::size_t j = i + 1;
      while (j < text.size() && is_role_char(text[j])) ++j;
      if (j < text.size() && text[j] == '`' && j > i + 2 && text[j - 1] == ':') {
        const std::size_t close = text.find('`', j + 1);
        if (close != std::string_view::npos) {
          std::string_view role = text.substr(i + 1, j - i - 2);
          const std::size_t last_colon = role.rfind(':');
          if (last_colon != std::string_view::npos) role = role.substr(last_colon + 1);
          out += role_text(role, text.substr(j + 1, close - j - 1));
          i = close + 1;
          continue;
        }
      }
    }
    if (c == '`') {
      if (i + 1 < text.size() && text[i + 1] == '`') {  // ``literal``
        const std::size_t close = text.find("``", i + 2);
        if (close != std::string_view::npos) {
          out.append(text.substr(i + 2, close - i - 2));
          i = close + 2;
          continue;
        }
      } else {  // `text <url>`_, `text`_, `default role`
        const std::size_t close = text.find('`', i + 1);
        if (close != std::string_view::npos) {
          out += role_text("", text.substr(i + 1, close - i - 1));
          i = close + 1;
          while (i < text.size() && text[i] == '_') ++i;
          continue;
        }
      }
    }
    if (c == '[' && i + 1 < text.size()) {  // footnote and citation references: [#]_, [1]_
      const std::size_t close = text.find("]_", i + 1);
      if (close != std::string_view::npos && close - i <= 12 &&
          text.substr(i + 1, close - i - 1).find(' ') == std::string_view::npos) {
        while (!out.empty() && out.back() == ' ') out.pop_back();
        i = close + 2;
        continue;
      }
    }
    if (c == '*') {  // emphasis markers at a word's start or end
      std::size_t j = i;
      while (j < text.size() && text[j] == '*') ++j;
      const bool at_start =
          (i == 0 || !is_word_char(text[i - 1])) && j < text.size() && text[j] != ' ';
      const bool at_end =
          i > 0 && text[i - 1] != ' ' && (j == text.size() || !is_word_char(text[j]));
      if ((at_start || at_end) && j - i <= 2) {
        i = j;
        continue;
      }
    }
    out.push_back(c);
    ++i;
  }
  return out;
}

void rst_to_corpus(std::string_view rst, std::string& out, RstStats& stats) {
  ++stats.files;
  stats.input_bytes += rst.size();
  const std::size_t out_start = out.size();
  std::vector<std::string_view> lines;
  for_each_line(rst, [&](std::string_view line) { lines.push_back(line); });

  std::string paragraph;
  std::size_t paragraph_lines = 0;
  bool paragraph_is_item = false;
  std::size_t paragraph_indent = 0;
  bool document_has_text = false;
  auto end_document = [&] {
    if (document_has_text) {
      out += '\n';
      ++stats.documents;
      document_has_text = false;
    }
  };
  auto flush = [&] {
    if (paragraph_lines > 0) {
      for (const std::string& sentence : split_sentences(strip_inline_rst(paragraph))) {
        // Keep prose: at least one letter and not a lone symbol or signature fragment.
        const bool has_letter = std::any_of(sentence.begin(), sentence.end(), [](char x) {
          return std::isalpha(static_cast<unsigned char>(x)) != 0;
        });
        if (!has_letter) continue;
        out += sentence;
        out += '\n';
        ++stats.sentences;
        document_has_text = true;
      }
    }
    paragraph.clear();
    paragraph_lines = 0;
  };

  // Lines indented deeper than skip_deeper_than are a skipped block (code, directive bodies).
  constexpr std::size_t kNoSkip = static_cast<std::size_t>(-1);
  std::size_t skip_deeper_than = kNoSkip;
  bool skip_until_blank = false;
  bool in_directive_options = false;
  for (std::size_t n = 0; n < lines.size(); ++n) {
    const std::string_view line = lines[n];
    const std::size_t indent = indent_of(line);
    const std::string_view text = trim(line);
    if (is_blank(line)) {
      flush();
      skip_until_blank = false;
      in_directive_options = false;
      continue;
    }
    if (skip_until_blank) continue;
    if (skip_deeper_than != kNoSkip) {
      if (indent > skip_deeper_than) continue;
      skip_deeper_than = kNoSkip;
    }
    if (in_directive_options && is_field_line(text)) continue;
    in_directive_options = false;
    if (is_adornment(text)) {  // section title under/overline: the title is not prose
      if (paragraph_lines == 1) {
        paragraph.clear();
        paragraph_lines = 0;
      } else {
        flush();
      }
      end_document();
      continue;
    }
    if (text.starts_with(".. ") || text == "..") {
      flush();
      const std::size_t marker = text.find("::");
      std::string_view name;
      if (marker != std::string_view::npos) name = trim(text.substr(3, marker - 3));
      const bool prose =
          marker != std::string_view::npos && name.find(' ') == std::string_view::npos &&
          std::find(
              kProseDirectives.begin(), kProseDirectives.end(),
              name.substr(name.rfind(':') == std::string_view::npos ? 0 : name.rfind(':') + 1)) !=
              kProseDirectives.end();
      if (prose) {
        in_directive_options = true;
        // versionchanged:: 3.2 Text  -- text after the version on the same line is prose too
        if (name.starts_with("version") || name.starts_with("deprecated")) {
          std::string_view rest = trim(text.substr(marker + 2));
          const std::size_t space = rest.find(' ');
          if (space != std::string_view::npos) {
            paragraph += std::string(trim(rest.substr(space + 1)));
            paragraph_lines = 1;
          }
        }
      } else {
        skip_deeper_than = indent;
      }
      continue;
    }
    if (text.starts_with(">>>") || text.starts_with("$ ") || is_table_line(text) ||
        (text.starts_with('|') && text.ends_with('|') && text.size() > 1)) {
      flush();
      skip_until_blank = true;
      continue;
    }
    if (is_field_line(text)) {  // field lists (":param x:") are reference material, not prose
      flush();
      skip_until_blank = true;
      continue;
    }
    // A list item starts a paragraph, but only after a blank line or as the next item of a
    // list at the same indent ("+ tail" inside a wrapped sentence is not a list).
    std::string_view item = strip_bullet(text);
    const bool is_item =
        item.size() != text.size() &&
        (paragraph_lines == 0 || (paragraph_is_item && indent == paragraph_indent));
    if (is_item) {
      flush();
    } else {
      item = text;
    }
    if (paragraph_lines == 0) {
      paragraph_is_item = is_item;
      paragraph_indent = indent;
    }
    if (paragraph_lines > 0) paragraph += ' ';
    paragraph += item;
    ++paragraph_lines;
    if (text.ends_with("::")) {  // "Text::" introduces a literal block
      while (paragraph.ends_with(':')) paragraph.pop_back();
      while (paragraph.ends_with(' ')) paragraph.pop_back();
      if (!paragraph.empty() && text != "::" && !text.ends_with(" ::")) paragraph += ':';
      flush();
      skip_deeper_than = indent;
    }
  }
  flush();
  end_document();
  stats.output_bytes += out.size() - out_start;
}

std::vector<std::string> find_rst_files(const std::string& directory) {
  namespace fs = std::filesystem;
  std::error_code error;
  if (!fs::is_directory(directory, error)) {
    throw InputError("'" + directory + "' is not a directory");
  }
  std::vector<std::string> files;
  for (const auto& entry : fs::recursive_directory_iterator(directory)) {
    if (!entry.is_regular_file()) continue;
    const std::string path = entry.path().string();
    if (path.ends_with(".rst.txt") || path.ends_with(".rst") || path.ends_with(".txt")) {
      files.push_back(path);
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace pf::data
