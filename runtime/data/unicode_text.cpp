#include "runtime/data/unicode_text.h"

#include <utf8proc.h>

#include <algorithm>
#include <array>

namespace pf::data {
namespace {

bool is_continuation(unsigned char byte) {
  return (byte & 0xC0U) == 0x80U;
}

utf8proc_category_t category_of(char32_t code_point) {
  return utf8proc_category(static_cast<utf8proc_int32_t>(code_point));
}

// Python's Final_Sigma context uses "cased" and "case-ignorable" (Unicode 3.13); utf8proc has
// categories and case mappings, which give both up to a few rare characters.
bool is_cased(char32_t code_point) {
  const auto category = category_of(code_point);
  if (category == UTF8PROC_CATEGORY_LU || category == UTF8PROC_CATEGORY_LL ||
      category == UTF8PROC_CATEGORY_LT) {
    return true;
  }
  const auto cp = static_cast<utf8proc_int32_t>(code_point);
  return utf8proc_tolower(cp) != cp || utf8proc_toupper(cp) != cp;
}

bool is_case_ignorable(char32_t code_point) {
  switch (code_point) {
    case U'\'':
    case U'.':
    case U':':
    case U'^':
    case U'`':
    case 0x00B7:
    case 0x0387:
    case 0x05F4:
    case 0x2018:
    case 0x2019:
    case 0x2024:
    case 0x2027:
    case 0xFE13:
    case 0xFE52:
    case 0xFE55:
    case 0xFF07:
    case 0xFF0E:
    case 0xFF1A:
      return true;
    default:
      break;
  }
  const auto category = category_of(code_point);
  return category == UTF8PROC_CATEGORY_MN || category == UTF8PROC_CATEGORY_ME ||
         category == UTF8PROC_CATEGORY_CF || category == UTF8PROC_CATEGORY_LM ||
         category == UTF8PROC_CATEGORY_SK;
}

constexpr char32_t kCapitalSigma = 0x03A3;
constexpr char32_t kFinalSigma = 0x03C2;
constexpr char32_t kSmallSigma = 0x03C3;

bool sigma_is_final(std::u32string_view word, std::size_t index) {
  bool cased_before = false;
  for (std::size_t i = index; i-- > 0;) {
    if (is_case_ignorable(word[i])) continue;
    cased_before = is_cased(word[i]);
    break;
  }
  if (!cased_before) return false;
  for (std::size_t i = index + 1; i < word.size(); ++i) {
    if (is_case_ignorable(word[i])) continue;
    return !is_cased(word[i]);
  }
  return true;
}

}  // namespace

int decode_utf8(std::string_view text, std::size_t pos, char32_t& code_point) {
  const std::size_t left = text.size() - pos;
  const auto b0 = static_cast<unsigned char>(text[pos]);
  if (b0 < 0x80U) {
    code_point = b0;
    return 1;
  }
  auto byte = [&](std::size_t k) { return static_cast<unsigned char>(text[pos + k]); };
  if (b0 >= 0xC2U && b0 <= 0xDFU) {
    if (left < 2 || !is_continuation(byte(1))) return 0;
    code_point = (char32_t{b0 & 0x1FU} << 6) | (byte(1) & 0x3FU);
    return 2;
  }
  if (b0 >= 0xE0U && b0 <= 0xEFU) {
    if (left < 3 || !is_continuation(byte(1)) || !is_continuation(byte(2))) return 0;
    if (b0 == 0xE0U && byte(1) < 0xA0U) return 0;  // overlong
    if (b0 == 0xEDU && byte(1) > 0x9FU) return 0;  // UTF-16 surrogate
    code_point =
        (char32_t{b0 & 0x0FU} << 12) | (char32_t{byte(1) & 0x3FU} << 6) | (byte(2) & 0x3FU);
    return 3;
  }
  if (b0 >= 0xF0U && b0 <= 0xF4U) {
    if (left < 4 || !is_continuation(byte(1)) || !is_continuation(byte(2)) ||
        !is_continuation(byte(3))) {
      return 0;
    }
    if (b0 == 0xF0U && byte(1) < 0x90U) return 0;  // overlong
    if (b0 == 0xF4U && byte(1) > 0x8FU) return 0;  // beyond U+10FFFF
    code_point = (char32_t{b0 & 0x07U} << 18) | (char32_t{byte(1) & 0x3FU} << 12) |
                 (char32_t{byte(2) & 0x3FU} << 6) | (byte(3) & 0x3FU);
    return 4;
  }
  return 0;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::size_t find_invalid_utf8(std::string_view text) {
  std::size_t pos = 0;
  while (pos < text.size()) {
    if (static_cast<unsigned char>(text[pos]) < 0x80U) {
      ++pos;
      continue;
    }
    char32_t cp = 0;
    const int length = decode_utf8(text, pos, cp);
    if (length == 0) return pos;
    pos += static_cast<std::size_t>(length);
  }
  return std::string_view::npos;
}

std::size_t drop_invalid_utf8(std::string_view text, std::string& out) {
  std::size_t dropped = 0;
  std::size_t pos = 0;
  out.reserve(out.size() + text.size());
  while (pos < text.size()) {
    char32_t cp = 0;
    const int length = decode_utf8(text, pos, cp);
    if (length == 0) {
      ++dropped;
      ++pos;
      continue;
    }
    out.append(text.substr(pos, static_cast<std::size_t>(length)));
    pos += static_cast<std::size_t>(length);
  }
  return dropped;
}

bool is_bert_whitespace(char32_t cp) {
  if (cp == U' ' || cp == U'\t' || cp == U'\n' || cp == U'\r') return true;
  return category_of(cp) == UTF8PROC_CATEGORY_ZS;
}

bool is_bert_control(char32_t cp) {
  if (cp == U'\t' || cp == U'\n' || cp == U'\r') return false;
  const auto category = category_of(cp);
  return category == UTF8PROC_CATEGORY_CC || category == UTF8PROC_CATEGORY_CF;
}

bool is_bert_punctuation(char32_t cp) {
  if ((cp >= 33 && cp <= 47) || (cp >= 58 && cp <= 64) || (cp >= 91 && cp <= 96) ||
      (cp >= 123 && cp <= 126)) {
    return true;
  }
  switch (category_of(cp)) {
    case UTF8PROC_CATEGORY_PC:
    case UTF8PROC_CATEGORY_PD:
    case UTF8PROC_CATEGORY_PS:
    case UTF8PROC_CATEGORY_PE:
    case UTF8PROC_CATEGORY_PI:
    case UTF8PROC_CATEGORY_PF:
    case UTF8PROC_CATEGORY_PO:
      return true;
    default:
      return false;
  }
}

bool is_cjk_ideograph(char32_t cp) {
  return (cp >= 0x4E00 && cp <= 0x9FFF) || (cp >= 0x3400 && cp <= 0x4DBF) ||
         (cp >= 0x20000 && cp <= 0x2A6DF) || (cp >= 0x2A700 && cp <= 0x2B73F) ||
         (cp >= 0x2B740 && cp <= 0x2B81F) || (cp >= 0x2B820 && cp <= 0x2CEAF) ||
         (cp >= 0xF900 && cp <= 0xFAFF) || (cp >= 0x2F800 && cp <= 0x2FA1F);
}

bool is_python_space(char32_t cp) {
  if (cp == 0x2028 || cp == 0x2029) return true;  // line/paragraph separators (Zl, Zp)
  if (cp == 0x85 || (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x1F)) return true;
  return is_bert_whitespace(cp);
}

void python_lower(std::u32string_view word, std::u32string& out) {
  for (std::size_t i = 0; i < word.size(); ++i) {
    const char32_t cp = word[i];
    if (cp < 0x80) {
      out.push_back((cp >= U'A' && cp <= U'Z') ? cp + 32 : cp);
    } else if (cp == kCapitalSigma) {
      out.push_back(sigma_is_final(word, i) ? kFinalSigma : kSmallSigma);
    } else if (cp == 0x0130) {
      out.push_back(U'i');  // full mapping of U+0130 is "i" + U+0307
      out.push_back(0x0307);
    } else {
      out.push_back(static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))));
    }
  }
}

void strip_accents_nfd(std::u32string_view word, std::u32string& out) {
  // Decompose, then put each run of combining marks into canonical order (stable by combining
  // class) before dropping the Mn marks, exactly as NFD followed by the filter would.
  std::array<utf8proc_int32_t, 32> buffer{};
  const std::size_t first = out.size();
  for (const char32_t cp : word) {
    if (cp < 0x80) {
      out.push_back(cp);
      continue;
    }
    int last_boundclass = 0;
    const auto count = utf8proc_decompose_char(
        static_cast<utf8proc_int32_t>(cp), buffer.data(),
        static_cast<utf8proc_ssize_t>(buffer.size()),
        static_cast<utf8proc_option_t>(UTF8PROC_DECOMPOSE | UTF8PROC_STABLE), &last_boundclass);
    if (count < 0 || static_cast<std::size_t>(count) > buffer.size()) {
      out.push_back(cp);
      continue;
    }
    for (utf8proc_ssize_t k = 0; k < count; ++k) {
      out.push_back(static_cast<char32_t>(buffer[static_cast<std::size_t>(k)]));
    }
  }
  auto combining_class = [](char32_t cp) -> int {
    if (cp < 0x300) return 0;  // no combining marks below U+0300
    return utf8proc_get_property(static_cast<utf8proc_int32_t>(cp))->combining_class;
  };
  std::size_t i = first;
  while (i < out.size()) {
    if (combining_class(out[i]) == 0) {
      ++i;
      continue;
    }
    std::size_t j = i;
    while (j < out.size() && combining_class(out[j]) != 0) ++j;
    std::stable_sort(
        out.begin() + static_cast<std::ptrdiff_t>(i), out.begin() + static_cast<std::ptrdiff_t>(j),
        [&](char32_t a, char32_t b) { return combining_class(a) < combining_class(b); });
    i = j;
  }
  std::size_t kept = first;
  for (std::size_t k = first; k < out.size(); ++k) {
    if (out[k] < 0x300 || category_of(out[k]) != UTF8PROC_CATEGORY_MN) out[kept++] = out[k];
  }
  out.resize(kept);
}

}  // namespace pf::data
